"""JSON from an untrusted adapter file, bounded before it is parsed: its size, then its nesting depth.

``json.loads`` recurses once per nesting level (a 100,000-deep ``[[[...`` raises ``RecursionError`` or
worse), so the depth is measured first, in linear time and without a Python-level loop over the
bytes: escaped backslashes and quotes are removed, the parts between quotes (strings) dropped, and
the running sum of the remaining brackets (+1 for ``[`` / ``{``, -1 for ``]`` / ``}``) taken with
``itertools.accumulate``. For valid JSON this is exactly the nesting depth; for invalid JSON it may
differ, and the parser then refuses it.
"""

from __future__ import annotations

import json
from itertools import accumulate

from loraplex.errors import InvalidAdapter

MAX_JSON_DEPTH = 32  # a PEFT config nests 3 deep, a safetensors header 3

_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(set(range(256)) - set(_BRACKETS))
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in ``data`` outside strings (see the module docstring)."""
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[::2])
    brackets = outside.translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def parse_json(data: bytes, what: str, max_bytes: int) -> object:
    """``data`` parsed, or ``InvalidAdapter`` naming ``what`` when it is over ``max_bytes``, nested deeper
    than ``MAX_JSON_DEPTH`` or not valid JSON."""
    if len(data) > max_bytes:
        raise InvalidAdapter(f"{what} is {len(data)} bytes, over the limit of {max_bytes} bytes")
    depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise InvalidAdapter(f"{what} nests {depth} levels deep, over the limit of {MAX_JSON_DEPTH}")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise InvalidAdapter(f"{what} is not valid JSON ({e})") from e
