"""Default bounds that make every JSON number of a schema finish: a rewrite of the schema before xgrammar.

xgrammar (0.2.9) enforces ``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum`` on integers
and numbers (a range grammar: a bounded count of digits), ``minLength``/``maxLength`` on strings and
``minItems``/``maxItems`` on arrays natively. What it leaves unbounded is a number without bounds
(``[1-9][0-9]*``): a small model can emit digits until ``max_tokens``. ``bounded_schema`` gives every
``integer`` without a bound on a side the int64 bound of that side (at most 19 digits, what JSON parsers
round trip as integers), and every ``number`` the bound ``±NUMBER_BOUND`` (at most 18 integer digits;
xgrammar's range grammar then allows at most 6 fraction digits). A bound the schema sets is kept.
Values in ``enum``, ``const``, ``default`` and ``examples`` are data, not schemas: never rewritten.
"""

from __future__ import annotations

from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
NUMBER_BOUND = 1e17
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})
_SIDES = (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum"))


def bounded_schema(schema: Any) -> Any:
    """``schema`` with default bounds on every unbounded ``integer`` and ``number`` (a new object). A plain
    ``{"type": "integer"}`` (or ``number``; a title or description aside) becomes a ``$ref`` to one shared
    definition in the root's ``$defs``: xgrammar builds a range grammar per occurrence (500 inlined int64
    ranges compiled in 1.0 s, 500 references to one in 0.04 s)."""
    if not isinstance(schema, dict):
        return _bounded(schema, None)
    shared: dict[str, dict[str, Any]] = {}
    out = {key: value if key in _DATA_KEYS else _bounded(value, shared) for key, value in schema.items()}
    out = _with_bounds(out)
    if shared:
        out["$defs"] = {**out.get("$defs", {}), **shared}
    return out


def _bounded(node: Any, shared: dict[str, dict[str, Any]] | None) -> Any:
    if isinstance(node, list):
        return [_bounded(item, shared) for item in node]
    if not isinstance(node, dict):
        return node
    kind = node.get("type")
    if shared is not None and isinstance(kind, str) and kind in _SHARED and set(node) <= _PLAIN_KEYS:
        name, definition = _SHARED[kind]
        shared[name] = definition
        return {"$ref": f"#/$defs/{name}"}
    return _with_bounds({key: value if key in _DATA_KEYS else _bounded(value, shared) for key, value in node.items()})


def _with_bounds(out: dict[str, Any]) -> dict[str, Any]:
    """``out`` with the default bound on each side it leaves open, when it is an integer or a number."""
    types = out.get("type")  # a dict under "type": a properties map with a property named "type"
    kinds = {t for t in (types if isinstance(types, list) else [types]) if isinstance(t, str)}
    if "integer" in kinds and "number" not in kinds:
        low, high = INT64_MIN, INT64_MAX
    elif "number" in kinds:
        low, high = -NUMBER_BOUND, NUMBER_BOUND
    else:
        return out
    for (inclusive, exclusive), default in zip(_SIDES, (low, high), strict=True):
        if inclusive not in out and not isinstance(out.get(exclusive), int | float):
            out[inclusive] = default
    return out


_PLAIN_KEYS = frozenset({"type", "title", "description"})
_SHARED = {"integer": ("loraplex_int64", {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}),
           "number": ("loraplex_number", {"type": "number", "minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND})}
