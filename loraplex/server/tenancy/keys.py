"""Scoped API keys: who a caller is (its tenant), what it may use, whether it may manage adapters, its limits.

``--api-keys FILE`` (TOML, or YAML for ``.yaml``/``.yml``) holds a list ``keys``; each entry:

- ``key`` (required): the secret sent as ``Authorization: Bearer <key>``; never logged.
- ``tenant`` (required): who is served; fair share, limits and the ``tenant`` metric label use it.
- ``adapters``: adapter names or glob patterns (``fnmatch``: ``acme-*``) the key may use (default: none).
- ``base_model``: whether it may use the base model (default true).
- ``admin``: whether it may load, unload, roll back and split adapters (default false).
- ``metrics``: whether it may read ``GET /metrics`` (default false; admin keys always may): a scraper's key.
- ``max_concurrent_requests``, ``max_running_requests``, ``tokens_per_minute``: optional limits
  (``server/tenancy/quotas.py``).

``--api-key KEY`` is the single-key form: tenant ``default``, every adapter, the base model, admin; with it
``/metrics`` stays open (``KeyTable.open_metrics``). With a keys file, ``/metrics`` lists every adapter's and
tenant's traffic, so only admin keys and keys with ``metrics = true`` may read it.
An adapter outside a key's scope is answered exactly as an unknown one (404, same body), so names do not
leak. Keys are compared in constant time (``hmac.compare_digest`` against every configured key).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

DEFAULT_TENANT = "default"  # the tenant of the single --api-key
_LIMITS = ("max_concurrent_requests", "max_running_requests", "tokens_per_minute")
_FIELDS = {"key", "tenant", "adapters", "base_model", "admin", "metrics", *_LIMITS}


@dataclass(frozen=True)
class ApiKey:
    """One key's tenant, scope and limits (``key`` stays out of ``repr``: it must never reach a log)."""

    key: str = field(repr=False)
    tenant: str | None
    adapters: tuple[str, ...] = ("*",)  # names or fnmatch patterns
    base_model: bool = True
    admin: bool = True
    max_concurrent_requests: int | None = None
    tokens_per_minute: int | None = None
    metrics: bool = False  # may read /metrics without being an admin (a scraper)
    max_running_requests: int | None = None  # engine requests (choices) in flight

    @property
    def may_scrape(self) -> bool:
        """Whether this key may read ``GET /metrics``."""
        return self.admin or self.metrics

    def may_use(self, adapter: str | None) -> bool:
        """Whether this key may run requests on ``adapter`` (None: the base model)."""
        if adapter is None:
            return self.base_model
        return any(fnmatchcase(adapter, pattern) for pattern in self.adapters)


OPEN_ACCESS = ApiKey(key="", tenant=None)  # no key configured: everything, the anonymous tenant
ANONYMOUS = ApiKey(key="", tenant=None, adapters=(), admin=False)  # no key sent where none is needed: the base


class KeyTable:
    """The configured keys; ``lookup`` finds the one a bearer token names, in constant time."""

    def __init__(self, keys: Iterable[ApiKey], open_metrics: bool = False) -> None:
        self.keys = tuple(keys)
        self.open_metrics = open_metrics  # /metrics needs no key (the single --api-key form)
        secrets = [k.key for k in self.keys]
        if len(set(secrets)) != len(secrets):
            raise ValueError("the same key is listed twice")
        self.tenants = frozenset(k.tenant for k in self.keys if k.tenant is not None)
        self.scoped = any(k.adapters != ("*",) or not k.base_model for k in self.keys)

    @classmethod
    def single(cls, key: str) -> KeyTable:
        return cls([ApiKey(key=key, tenant=DEFAULT_TENANT)], open_metrics=True)

    @classmethod
    def load(cls, path: str | Path) -> KeyTable:
        """Read a keys file (TOML, or YAML by its suffix); ``ValueError`` naming the entry and field."""
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                raise ValueError(f"{path}: TOML keys files need Python 3.11 (tomllib); write it as YAML") from None
            data = tomllib.loads(text)
        if not isinstance(data, Mapping) or not isinstance(data.get("keys"), list) or not data["keys"]:
            raise ValueError(f"{path}: expected a non-empty list 'keys' of key entries")
        return cls(_entry(path, i, e) for i, e in enumerate(data["keys"]))

    def lookup(self, token: str) -> ApiKey | None:
        """The key equal to ``token``, comparing against every key (no early exit)."""
        found = None
        candidate = token.encode()
        for key in self.keys:
            if hmac.compare_digest(candidate, key.key.encode()):
                found = key
        return found


def _entry(path: Path, index: int, entry: Any) -> ApiKey:
    where = f"{path}: keys[{index}]"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where}: expected a table of fields")
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(_FIELDS))})")
    for name in ("key", "tenant"):
        if not isinstance(entry.get(name), str) or not entry[name]:
            raise ValueError(f"{where}.{name}: required, a non-empty string")
    adapters = entry.get("adapters", [])
    if not isinstance(adapters, list) or not all(isinstance(a, str) and a for a in adapters):
        raise ValueError(f"{where}.adapters: expected a list of adapter names or glob patterns")
    for name in ("base_model", "admin", "metrics"):
        if not isinstance(entry.get(name, False), bool):
            raise ValueError(f"{where}.{name}: expected true or false")
    for name in _LIMITS:
        value = entry.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{where}.{name}: expected a positive integer")
    return ApiKey(key=entry["key"], tenant=entry["tenant"], adapters=tuple(adapters),
                  base_model=entry.get("base_model", True), admin=entry.get("admin", False),
                  metrics=entry.get("metrics", False), **{name: entry.get(name) for name in _LIMITS})
