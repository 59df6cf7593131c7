"""Structured outputs that finish (issue 32, item 5): how many of 32 schema-constrained answers are valid JSON
within ``max_tokens`` on the embedded SmolLM2, with the default number bounds (``bounds.py``) off and on.

The corpus is ``tests/structured_schemas.py`` with its numeric bounds removed (``minimum``, ``maximum`` and
the exclusive ones: numbers as schemas usually give them), strings and arrays bounded as there. Each
schema's budget is 2x (and 8x) the tokens of its shortest valid answer (a minimal instance, compact JSON),
at least 8. Greedy, one batch per mode, the same prompts. Run: ``python -m benchmarks.structured_finish``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any
from unittest import mock

import jsonschema

from benchmarks.common import machine_line, write_json
from loraplex import LLM, SamplingParams, StructuredOutputsParams
from tests.structured_schemas import SCHEMAS

_NUMERIC = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}


def unbounded(schema: Any) -> Any:
    """``schema`` without numeric bounds (enum and const values kept as they are)."""
    if isinstance(schema, list):
        return [unbounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: v if k in ("enum", "const") else unbounded(v) for k, v in schema.items() if k not in _NUMERIC}


def minimal(schema: Any) -> Any:  # noqa: PLR0911 - one case per schema shape
    """A short valid instance of the corpus's schemas."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    if "anyOf" in schema:
        return minimal(schema["anyOf"][0])
    kind = schema.get("type")
    if kind == "object":
        return {k: minimal(schema["properties"][k]) for k in schema.get("required", [])}
    if kind == "array":
        items = [minimal(s) for s in schema.get("prefixItems", [])]
        more = schema.get("minItems", 0) - len(items)
        return items + [minimal(schema["items"])] * more if more > 0 else items
    if kind == "string":  # a pattern's shortest match: about as long as the corpus's patterns
        return "a" * schema.get("minLength", 0) if "pattern" not in schema else "a" * 10
    return {"integer": 0, "number": 0, "boolean": True, "null": None}[kind]


def finished(llm: LLM, schemas: list[dict], budgets: list[int]) -> list[bool]:
    prompts = [f"Reply with JSON for record {i}: a population count, prices and names." for i in range(len(schemas))]
    params = [SamplingParams(max_tokens=b, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True))
              for s, b in zip(schemas, budgets, strict=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    valid = []
    for out, schema in zip(outs, schemas, strict=True):
        try:
            jsonschema.validate(json.loads(out.text), schema)
            valid.append(True)
        except (ValueError, jsonschema.ValidationError):
            valid.append(False)
    return valid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--factors", type=int, nargs="+", default=[2, 8], help="budgets: x the shortest answer")
    parser.add_argument("--out", default="benchmarks/results/structured_finish.json")
    args = parser.parse_args()
    llm = LLM(model="smollm2-135m-instruct", max_num_seqs=32)
    schemas = [unbounded(s) for s in SCHEMAS]
    shortest = [len(llm.tokenize(json.dumps(minimal(s), separators=(", ", ": ")))) for s in schemas]
    result: dict[str, Any] = {"schemas": len(schemas), "shortest": shortest, "machine": machine_line()}
    print(f"{'budget':>8} {'mode':>22} {'valid JSON within max_tokens':>30}")
    for factor in args.factors:
        budgets = [max(8, factor * n) for n in shortest]
        with mock.patch("loraplex.engine.sampling.structured.params.bounded_schema", lambda s: s):
            before = finished(llm, schemas, budgets)
        after = finished(llm, schemas, budgets)
        for mode, valid in (("no default bounds", before), ("default number bounds", after)):
            print(f"{factor:>7}x {mode:>22} {sum(valid):>27}/{len(schemas)}")
        result[f"x{factor}"] = {"valid_before": sum(before), "valid_after": sum(after), "before": before,
                                "after": after, "budgets": budgets}
    result["load_average"] = os.getloadavg()
    write_json(args.out, result)


if __name__ == "__main__":
    main()
