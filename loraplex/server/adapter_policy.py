"""Which adapter folders the HTTP API may load at run time.

Runtime loading is off unless enabled. With adapter roots set, a path is accepted only if it
resolves (``..`` collapsed, every symlink followed) inside one of them, so neither ``../`` nor a
symlink can reach a folder outside. With loading enabled and no roots, any path is accepted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from loraplex.server.errors import ServerError

logger = logging.getLogger(__name__)


class AdapterPathPolicy:
    def __init__(self, allow_runtime_adapters: bool, adapter_roots: Iterable[str | Path] = ()) -> None:
        self.enabled = allow_runtime_adapters
        self.roots = tuple(Path(r).expanduser().resolve() for r in adapter_roots)
        if self.enabled and not self.roots:
            logger.warning("runtime adapter loading is on with no --adapter-root: any path can be loaded")

    def check_enabled(self) -> None:
        """Raise ``ServerError(403)`` unless runtime loading and unloading are enabled."""
        if not self.enabled:
            raise ServerError(
                403, "runtime adapter loading is disabled; start the server with --allow-runtime-adapters"
            )

    def check(self, path: str) -> Path:
        """The resolved folder to load; raises ``ServerError(403)`` when policy forbids it."""
        self.check_enabled()
        resolved = Path(path).expanduser().resolve()
        if self.roots and not any(resolved.is_relative_to(root) for root in self.roots):
            raise ServerError(
                403, f"{path!r} resolves to {str(resolved)!r}, outside the allowed adapter roots "
                f"({', '.join(str(r) for r in self.roots)})", "lora_path",
            )
        return resolved
