"""Adapters loaded on first use (``--adapter-root DIR --load-on-demand``; vLLM's filesystem resolver): a
request for ``model=NAME`` that no loaded adapter answers loads ``DIR/NAME`` first, then runs.

- ``AdapterRoots``: ``<root>/NAME`` in the first root holding an adapter folder of that name, with the
  runtime loads' path checks (``AdapterPathPolicy``: after ``..`` and symlinks it must stay inside its
  root, else 403; every file the load opens must resolve inside the roots too); a name outside the adapter
  name pattern (``adapters/names.py``: a ``/``, a leading ``.``, blanks...) is never looked up.
- ``OnDemandLoader``: single flight: however many requests for NAME arrive together, ONE load runs (one
  asyncio future per name) and every one of them waits for it; a failed load (an invalid folder: 400)
  fails each of them with its error, and the next request tries again.

The single server and the Ray Serve replicas (``integrations/ray_replica.py``) use this same code.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path

from loraplex.adapters.names import check_adapter_name
from loraplex.client.base import EngineClient
from loraplex.errors import AdapterAlreadyLoaded, InvalidAdapterName
from loraplex.server.openai.errors import ServerError
from loraplex.server.tenancy.access import AdapterPathPolicy

logger = logging.getLogger(__name__)


class AdapterRoots:
    def __init__(self, roots: Iterable[str | Path]) -> None:
        self.roots = tuple(Path(r).expanduser().resolve() for r in roots)
        self.policy = AdapterPathPolicy(True, self.roots)

    def find(self, name: str) -> Path | None:
        """``<root>/name`` in the first root holding an adapter of that name; ``ServerError(403)`` if it
        resolves outside its root (a symlink); None if no root has it or the name is a path."""
        try:
            check_adapter_name(name)
        except InvalidAdapterName:
            return None
        for root in self.roots:
            folder = root / name
            if (folder / "adapter_config.json").is_file():
                return self.policy.check(str(folder))
        return None

    def adapters(self, skip: Iterable[str] = ()) -> list[tuple[str, Path]]:
        """(name, folder) of every servable adapter folder in the roots, by name; names in ``skip`` and
        those an earlier root holds are left out, and so are folders resolving outside their root."""
        found: dict[str, Path] = {}
        skipped = set(skip)
        for root in self.roots:
            for entry in sorted(root.iterdir()):
                if entry.name in skipped or entry.name in found:
                    continue
                try:
                    folder = self.find(entry.name)
                except ServerError:  # a symlink out of its root: not servable, not listed
                    continue
                if folder is not None:
                    found[entry.name] = folder
        return sorted(found.items())


class OnDemandLoader:
    """Loads adapters of ``roots`` into ``client`` on first use, once per name at a time."""

    def __init__(self, client: EngineClient, roots: AdapterRoots) -> None:
        self.client = client
        self.roots = roots
        self.loads = 0  # loads this loader ran (each flight once)
        self._flights: dict[str, asyncio.Future[None]] = {}

    async def ensure(self, name: str) -> bool:
        """Make sure ``name`` is loaded if the roots hold it. False: nothing to do (it is loaded already, or no
        root has it: the request then gets the engine's 404); True: it was loaded for this call (by this call's
        flight or one it joined). Raises the load's error (``AdapterError``, ``ServerError(403)``)."""
        if name in self.client.served_adapters():
            return False
        flight = self._flights.get(name)
        if flight is None:
            folder = self.roots.find(name)
            if folder is None:
                return False
            flight = asyncio.ensure_future(self._load(name, folder))
            self._flights[name] = flight
            flight.add_done_callback(lambda _: self._flights.pop(name, None))
        await asyncio.shield(flight)  # a waiter that goes away does not cancel the others' load
        return True

    async def _load(self, name: str, folder: Path) -> None:
        try:
            await self.client.load_adapter(name, str(folder), roots=self.roots.policy.load_roots())
        except AdapterAlreadyLoaded:  # loaded by another path (an explicit load) meanwhile
            return
        self.loads += 1
        logger.info("loaded adapter %r on first use from %s", name, folder)
