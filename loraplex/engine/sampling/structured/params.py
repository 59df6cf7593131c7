"""``StructuredOutputsParams``: the constraint a request's output must satisfy (vLLM's class and names).

Exactly one kind is set: ``json`` (a JSON Schema, dict or string), ``regex``, ``choice`` (the output is
exactly one of the strings), ``grammar`` (an EBNF grammar in xgrammar's GBNF dialect), or
``json_object=True`` (any JSON object or array). ``disable_any_whitespace`` makes JSON compact (no
whitespace between tokens); otherwise each run of whitespace is at most ``MAX_WHITESPACE`` characters
(enough to pretty-print; small models otherwise loop on whitespace). Unknown JSON properties are refused whether or not
``disable_additional_properties`` is set (xgrammar's strict mode, as vLLM serves it); ``whitespace_pattern``
and ``structural_tag`` are not implemented and refused when set.

Untrusted constraints do bounded work: before anything is built, ``check_limits`` refuses (``RequestError``
naming the limit) a schema or grammar over ``MAX_SOURCE_CHARS``, a schema nested over ``MAX_SCHEMA_DEPTH``,
more than ``MAX_ENUM_VALUES`` enum / const values (``choice`` entries count too) or ``MAX_PROPERTIES``
properties in all, a regex (``regex`` or a schema's ``pattern``) over ``MAX_REGEX_CHARS``, and repetition bounds
(the largest number of each ``{m}``, ``{m,}``, ``{m,n}``) over ``MAX_REGEX_REPEATS`` summed over a regex or all a
schema's patterns: a 30,000-value enum or a 20,000-property schema took xgrammar 45-60 s to compile, and
building a schema's ``pattern`` grows with the square of its bound (``[a-z]{1,3000}``: 1.6 s; 1000: 0.16 s),
so ``[a-z]{1,100000}`` in 16 characters would take half an hour, before any compile's time budget applies.

``validate`` builds the grammar without a tokenizer (milliseconds), so a bad schema is a
``RequestError`` before the request is queued; the engine then compiles it against the request's
tokenizer off the step loop (``compiler.py``). The object holds plain strings and pickles cheaply.
"""

from __future__ import annotations

import hashlib
import json as jsonlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loraplex.engine.sampling.structured.bounds import bounded_schema
from loraplex.errors import RequestError

PARAM = "structured_outputs"
MAX_WHITESPACE = 16
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
MAX_SOURCE_CHARS = 64 * 1024  # a schema (as compact JSON), a grammar or a choice list
MAX_SCHEMA_DEPTH = 32
MAX_ENUM_VALUES = 1024  # enum and const values of a schema in all, or choice entries
MAX_PROPERTIES = 512  # properties of all a schema's objects
MAX_REGEX_CHARS = 4096  # a regex constraint, or one ``pattern`` of a schema
MAX_REGEX_REPEATS = 2048  # the bounds of every ``{m,n}`` of a regex, or of all a schema's patterns, summed
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """The one constraint set (``validate`` guarantees there is exactly one)."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def source(self) -> str:
        """The constraint as one text (a JSON schema as compact JSON, its key order kept: properties are
        generated in that order; numbers without bounds get ``bounds.py``'s; a regex; an EBNF grammar)."""
        kind = self.kind
        if kind == "json":
            schema = self.json if isinstance(self.json, dict) else jsonlib.loads(str(self.json))
            return jsonlib.dumps(bounded_schema(schema), ensure_ascii=False, separators=(",", ":"))
        if kind == "choice":  # EBNF alternatives; a JSON string literal is a valid GBNF literal
            return "root ::= " + " | ".join(jsonlib.dumps(c, ensure_ascii=False) for c in self.choice or ())
        if kind == "json_object":
            return ""
        return str(getattr(self, kind))

    def cache_key(self) -> str:
        """A hash of everything the compiled grammar depends on (but the tokenizer)."""
        text = f"{self.kind}\0{int(self.disable_any_whitespace)}\0{self.source()}"
        return hashlib.sha256(text.encode()).hexdigest()

    def json_options(self) -> dict[str, Any]:
        """xgrammar's options for a JSON schema."""
        return {"any_whitespace": not self.disable_any_whitespace, "strict_mode": True,
                "max_whitespace_cnt": None if self.disable_any_whitespace else MAX_WHITESPACE}

    def build(self, param: str = PARAM) -> Any:
        """The tokenizer-free ``xgrammar.Grammar``; ``RequestError`` on ``param`` if it is invalid."""
        import xgrammar as xgr  # imported on first use: the offline API without constraints never needs it

        kind = self.kind
        try:
            if kind == "json":
                return xgr.Grammar.from_json_schema(self.source(), **self.json_options())
            if kind == "json_object":
                return xgr.Grammar.builtin_json_grammar()
            if kind == "regex":
                return xgr.Grammar.from_regex(str(self.regex))
            return xgr.Grammar.from_ebnf(self.source())
        except (RuntimeError, ValueError) as exc:
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            detail = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", lines[-1])  # xgrammar's "[time] file.cc:line: " prefix
            raise RequestError(f"{param}: invalid {_NAMES[kind]}: {detail}", param) from exc

    def validate(self, param: str = PARAM) -> None:
        """Raise ``RequestError`` on ``param`` unless exactly one supported constraint is set and it compiles."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise RequestError(f"{param}: set exactly one of {', '.join(KINDS)}; got "
                               f"{', '.join(given) if given else 'none'}", param)
        if self.structural_tag is not None:
            raise RequestError(f"{param}.structural_tag is not implemented", param)
        if self.whitespace_pattern is not None:
            raise RequestError(f"{param}.whitespace_pattern is not implemented (disable_any_whitespace is)", param)
        if self.json_object not in (None, True, False):
            raise RequestError(f"{param}.json_object must be a boolean", param)
        if self.json is not None:
            _check_schema(self.json, param)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(f"{param}.{name} must be a non-empty string", param)
        if self.choice is not None and (isinstance(self.choice, str) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise RequestError(f"{param}.choice must be a non-empty list of non-empty strings", param)
        check_limits(self, param)
        key = self.cache_key()
        if key not in _BUILT:  # the server checks a body once, the engine again: build each constraint once
            self.build(param)
            if len(_BUILT) >= _MAX_BUILT:
                _BUILT.clear()
            _BUILT.add(key)


_BUILT: set[str] = set()  # cache keys of constraints that built (thread-safe enough: a miss only rebuilds)
_MAX_BUILT = 4096
_NAMES = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "choice": "choice list",
          "grammar": "EBNF grammar"}


def _check_schema(schema: object, param: str) -> None:
    if isinstance(schema, str):
        try:
            schema = jsonlib.loads(schema)
        except ValueError as exc:
            raise RequestError(f"{param}: the JSON schema is not valid JSON: {exc}", param) from exc
    if not isinstance(schema, dict):
        raise RequestError(f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param)


def _over(param: str, what: str, limit: int, name: str) -> RequestError:
    return RequestError(f"{param}: {what}, over the limit of {limit} ({name})", param)


def check_limits(params: StructuredOutputsParams, param: str = PARAM) -> None:
    """``RequestError`` on ``param`` naming the limit a constraint passes (see the module docstring)."""
    kind = params.kind
    if kind == "regex" and len(str(params.regex)) > MAX_REGEX_CHARS:
        raise _over(param, f"the regex has {len(str(params.regex))} characters", MAX_REGEX_CHARS, "MAX_REGEX_CHARS")
    if kind == "regex" and repeats(str(params.regex)) > MAX_REGEX_REPEATS:
        raise _over(param, f"the regex's repetition bounds sum to {repeats(str(params.regex))}", MAX_REGEX_REPEATS,
                    "MAX_REGEX_REPEATS")
    if kind == "choice" and len(params.choice or ()) > MAX_ENUM_VALUES:
        raise _over(param, f"choice lists {len(params.choice or ())} strings", MAX_ENUM_VALUES, "MAX_ENUM_VALUES")
    if kind == "json":  # walked first: its depth is bounded before anything recurses into it
        _check_schema_limits(params.json if isinstance(params.json, dict) else jsonlib.loads(str(params.json)), param)
    if kind in ("json", "grammar", "choice") and len(params.source()) > MAX_SOURCE_CHARS:
        raise _over(param, f"the {_NAMES[kind]} has {len(params.source())} characters", MAX_SOURCE_CHARS,
                    "MAX_SOURCE_CHARS")


def _check_schema_limits(schema: dict[str, Any], param: str) -> None:
    """Walk the schema (iteratively: its depth is bounded here, not by Python's stack)."""
    enums = properties = repeated = 0
    stack: list[tuple[object, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise _over(param, f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels", MAX_SCHEMA_DEPTH,
                        "MAX_SCHEMA_DEPTH")
        if isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        enum = node.get("enum")
        enums += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
        if enums > MAX_ENUM_VALUES:
            raise _over(param, f"the JSON schema has more than {MAX_ENUM_VALUES} enum and const values",
                        MAX_ENUM_VALUES, "MAX_ENUM_VALUES")
        props = node.get("properties")
        properties += len(props) if isinstance(props, dict) else 0
        if properties > MAX_PROPERTIES:
            raise _over(param, f"the JSON schema has more than {MAX_PROPERTIES} properties", MAX_PROPERTIES,
                        "MAX_PROPERTIES")
        pattern = node.get("pattern")
        if isinstance(pattern, str) and len(pattern) > MAX_REGEX_CHARS:
            raise _over(param, f"a pattern of the JSON schema has {len(pattern)} characters", MAX_REGEX_CHARS,
                        "MAX_REGEX_CHARS")
        repeated += repeats(pattern) if isinstance(pattern, str) else 0
        if repeated > MAX_REGEX_REPEATS:
            raise _over(param, "the repetition bounds of the JSON schema's patterns sum to more than "
                        f"{MAX_REGEX_REPEATS}", MAX_REGEX_REPEATS, "MAX_REGEX_REPEATS")
        stack.extend((value, depth + 1) for key, value in node.items() if key not in ("enum", "const"))


def repeats(regex: str) -> int:
    """The sum of the largest bound of every ``{m}``, ``{m,}``, ``{m,n}`` in ``regex`` (an escaped brace counts
    too: an overestimate refuses at most a regex near the limit)."""
    return sum(max(int(low), int(high or 0)) for low, high in _REPEAT.findall(regex))
