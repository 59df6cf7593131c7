"""Structured outputs that finish (issue 32, item 5): at the grammar level, through the compiler the engine
uses (``GrammarCompilers``, the tiny Llama's tokenizer), an unbounded integer takes at most 19 digits (the
20th is rejected: no digit loop), an unbounded number stays within ±1e17 with at most 6 fraction digits,
bounds the schema sets are kept (``minimum``, ``exclusiveMaximum``), and ``maxLength``/``maxItems`` close
the string and the array. ``bounded_schema`` leaves data (``enum``, ``const``) alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from loraplex import StructuredOutputsParams
from loraplex.engine.sampling.structured.bounds import bounded_schema
from loraplex.engine.sampling.structured.compiler import GrammarCompilers


@pytest.fixture(scope="module")
def matcher_for(tiny_llama: Path):  # noqa: ANN201 - a factory
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    compilers = GrammarCompilers([tokenizer.eos_token_id])

    def make(field: dict) -> xgr.GrammarMatcher:
        schema = {"type": "object", "properties": {"v": field}, "required": ["v"]}
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return xgr.GrammarMatcher(compilers.submit(so, tokenizer, len(tokenizer)).result(60))

    yield make
    compilers.shutdown()


def accepts(matcher: xgr.GrammarMatcher, text: str) -> bool:
    return all(matcher.accept_string(ch) for ch in text)


def test_an_unbounded_integer_cannot_loop_on_digits(matcher_for) -> None:  # noqa: ANN001
    m = matcher_for({"type": "integer"})
    assert accepts(m, '{"v": ' + "1" * 19)
    assert not m.accept_string("1")  # the 20th digit
    assert accepts(m, "}")
    low = matcher_for({"type": "integer"})
    assert accepts(low, '{"v": ' + str(-(2**63)) + "}")
    high = matcher_for({"type": "integer"})
    assert accepts(high, '{"v": ' + "922337203685477580")
    assert not high.accept_string("8")  # 2**63 is past int64


def test_an_unbounded_number_is_bounded(matcher_for) -> None:  # noqa: ANN001
    m = matcher_for({"type": "number"})
    assert accepts(m, '{"v": ' + "9" * 17)
    assert not m.accept_string("9")  # 18 nines > 1e17
    frac = matcher_for({"type": "number"})
    assert accepts(frac, '{"v": 3.' + "1" * 6)
    assert not frac.accept_string("1")
    assert accepts(frac, "}")


def test_the_schemas_own_bounds_are_kept(matcher_for) -> None:  # noqa: ANN001
    m = matcher_for({"type": "integer", "minimum": 0})  # only the missing side gets the default
    assert not m.accept_string('{"v": -')
    big = matcher_for({"type": "integer", "minimum": 0})
    assert accepts(big, '{"v": ' + "9" * 18 + "}")
    m = matcher_for({"type": "integer", "exclusiveMaximum": 10, "minimum": 0})
    assert accepts(m, '{"v": 9}')
    ten = matcher_for({"type": "integer", "exclusiveMaximum": 10, "minimum": 0})
    assert not accepts(ten, '{"v": 10}')


def test_max_length_and_max_items_close(matcher_for) -> None:  # noqa: ANN001
    m = matcher_for({"type": "string", "maxLength": 3})
    assert accepts(m, '{"v": "abc')
    assert not m.accept_string("d")
    m = matcher_for({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2})
    assert accepts(m, '{"v": [1, 2')
    assert not m.accept_string(",")


def test_bounded_schema_rewrites_types_not_data() -> None:
    schema = {"type": "object", "properties": {
        "type": {"type": ["integer", "null"]},
        "n": {"type": "number", "exclusiveMinimum": 0},
        "e": {"enum": [{"type": "integer"}]}, "c": {"const": {"type": "number"}},
        "i": {"type": "integer", "description": "a count"}, "j": {"type": "integer"}}, "$defs": {"x": {}}}
    int64 = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
    assert bounded_schema(schema) == {"type": "object", "properties": {
        "type": {"type": ["integer", "null"], "minimum": -(2**63), "maximum": 2**63 - 1},
        "n": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e17},
        "e": {"enum": [{"type": "integer"}]}, "c": {"const": {"type": "number"}},
        "i": {"$ref": "#/$defs/loraplex_int64"}, "j": {"$ref": "#/$defs/loraplex_int64"}},
        "$defs": {"x": {}, "loraplex_int64": int64}}  # one shared range grammar
    assert bounded_schema({"type": "integer"}) == int64
    assert "minimum" not in schema["properties"]["type"]  # a new object: the caller's schema is unchanged
