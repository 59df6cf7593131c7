"""``checkpoint_fingerprint``: the identity of the base checkpoint served, for ``system_fingerprint``."""

from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 1 << 20


def checkpoint_fingerprint(folder: Path) -> str:
    """SHA-256 (hex) over ``config.json`` and every ``*.safetensors`` file of ``folder`` (a GGUF model's path
    is its one file), each preceded by its name and size, in name order: the same bytes give the same
    fingerprint on any host. Reads every weight byte once (about a second per GB); callers compute it once,
    off the event loop."""
    digest = hashlib.sha256()
    files = [folder] if folder.is_file() else [folder / "config.json", *sorted(folder.glob("*.safetensors"))]
    for path in files:
        if not path.is_file():
            continue
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()
