"""Adapter names: one pattern for every way a name arrives (the Python API, HTTP routes, ``--adapter``).

A name is 1-128 characters: a letter or digit, then letters, digits, ``.``, ``_`` or ``-``
(``ADAPTER_NAME_PATTERN``). So a name is never empty, never blank, never holds a ``/``, a control
character or a newline, never starts with ``.`` (``..`` is not a name), and is safe as one path
component under an adapter root (``--load-on-demand`` loads ``<root>/NAME``) and in logs and metrics.
"""

from __future__ import annotations

import re

from loraplex.errors import InvalidAdapterName

ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHOWN = 64  # characters of a refused name quoted in the error


def check_adapter_name(name: object, param: str | None = None) -> str:
    """``name`` if it matches ``ADAPTER_NAME_PATTERN``, else ``InvalidAdapterName`` (400; ``param``: the
    request field that carried it)."""
    if isinstance(name, str) and _NAME.fullmatch(name) is not None:
        return name
    if isinstance(name, str) and len(name) > _SHOWN:
        shown = f"{name[:_SHOWN]!r}... ({len(name)} characters)"
    else:
        shown = repr(name)
    raise InvalidAdapterName(f"adapter name {shown} does not match {ADAPTER_NAME_PATTERN} (1 to 128 characters: "
                             "a letter or digit, then letters, digits, '.', '_' or '-')", param)
