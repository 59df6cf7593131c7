"""Structured outputs in mixed batches (offline API): every output of a 32-schema corpus parses and validates
with ``jsonschema`` (greedy and sampled, base and adapter rows, free rows in the batch); free rows are token
for token what they are without constrained batchmates; logprobs report the constrained distribution
(HF + PEFT logits, masked, float64 log-softmax); regex, choice and EBNF outputs match; n > 1; bad
constraints fail before anything is queued; grammars are compiled once per schema and tokenizer."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr

from loraplex import LLM, RequestError, SamplingParams, StructuredOutputsParams
from tests.reference import hf_model
from tests.structured_schemas import SCHEMAS

ADAPTERS = (None, "r8_all", "r4_attn")
FREE_PROMPTS = ["The cat sat on", "Once upon a time", "Numbers: 1, 2,", "Hello"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def llm(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> LLM:
    llm = LLM(model=str(tiny_llama), max_loras=4, max_lora_rank=16, kv_cache_blocks=512, block_size=8)
    for name in ADAPTERS[1:]:
        llm.load_adapter(name, tiny_llama_adapters[name])
    return llm


def free_params(greedy: bool, i: int) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.0 if greedy else 0.9, seed=None if greedy else 100 + i)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_schema_corpus_validates_and_free_rows_are_unchanged(llm: LLM, greedy: bool) -> None:
    assert len(SCHEMAS) >= 30
    constrained = [SamplingParams(max_tokens=200, temperature=0.0 if greedy else 1.0, seed=i, structured_outputs=(
        StructuredOutputsParams(json=schema, disable_any_whitespace=i % 4 != 0))) for i, schema in enumerate(SCHEMAS)]
    free = [free_params(greedy, i) for i in range(len(FREE_PROMPTS))]
    free_adapters = [ADAPTERS[i % 3] for i in range(len(FREE_PROMPTS))]
    prompts = [f"Answer in JSON ({i}):" for i in range(len(SCHEMAS))] + FREE_PROMPTS
    adapters = [ADAPTERS[i % 3] for i in range(len(SCHEMAS))] + free_adapters
    outs = llm.generate(prompts, constrained + free, adapters=adapters, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs, strict=False):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    alone = llm.generate(FREE_PROMPTS, free, adapters=free_adapters, use_tqdm=False)
    assert [o.token_ids for o in outs[len(SCHEMAS):]] == [o.token_ids for o in alone]


def test_regex_choice_and_grammar(llm: LLM) -> None:
    kinds = [(StructuredOutputsParams(regex=r"[A-Z]{3}-\d{2}"), lambda t: re.fullmatch(r"[A-Z]{3}-\d{2}", t)),
             (StructuredOutputsParams(choice=["yes", "no", 'may"be']), lambda t: t in ("yes", "no", 'may"be')),
             (StructuredOutputsParams(grammar='root ::= "a" ("b" | "c"){0,5} "d"'),
              lambda t: re.fullmatch(r"a[bc]{0,5}d", t)),
             (StructuredOutputsParams(json_object=True, disable_any_whitespace=True), None)]
    params = [SamplingParams(max_tokens=12 if check is None else 60, temperature=temperature, seed=5,
                             structured_outputs=so) for temperature in (0.0, 1.0) for so, check in kinds]
    outs = llm.generate([f"p{i}" for i in range(len(params))], params,
                        adapters=[ADAPTERS[i % 3] for i in range(len(params))], use_tqdm=False)
    for (_, check), out in zip(kinds * 2, outs, strict=True):
        if check is None:  # a whole JSON value within 12 tokens is rare for a random model: check the prefix
            assert out.text.startswith(("{", "[")), out.text
            if out.finish_reason == "stop":
                json.loads(out.text)
        else:
            assert out.finish_reason == "stop" and check(out.text), out.text


def test_n_choices_each_follow_the_schema(llm: LLM) -> None:
    schema = SCHEMAS[1]
    params = SamplingParams(n=4, max_tokens=80, temperature=1.0, seed=11,
                            structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))
    [out] = llm.generate(["People:"], params, adapters=["r8_all"], use_tqdm=False)
    assert len(out.outputs) == 4
    for choice in out.outputs:
        jsonschema.validate(json.loads(choice.text), schema)
    assert len({c.text for c in out.outputs}) > 1


def test_logprobs_are_the_constrained_distribution(llm: LLM, tiny_llama: Path,
                                                   tiny_llama_adapters: dict[str, Path]) -> None:
    so = StructuredOutputsParams(json=SCHEMAS[1], disable_any_whitespace=True)
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=3, logprobs=4, structured_outputs=so)
    prompt = llm.tokenize("Person:")
    out, free = llm.generate([prompt, prompt], [params, replace(params, structured_outputs=None)],
                             adapters=["r8_all", "r8_all"], use_tqdm=False)
    model = hf_model(tiny_llama, tiny_llama_adapters["r8_all"])
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0].double()  # [P + O, vocab]
    model.unload()
    info = xgr.TokenizerInfo.from_huggingface(llm.engine.tokenizer, vocab_size=logits.shape[-1], stop_token_ids=[2])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(so.source(), **so.json_options()))
    bitmask = xgr.allocate_token_bitmask(1, logits.shape[-1])
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = ((bitmask[0, :, None] >> torch.arange(32)) & 1).bool().flatten()[: logits.shape[-1]]
        ref = torch.log_softmax(logits[len(prompt) - 1 + step].masked_fill(~allowed, float("-inf")), -1)
        assert entry.token_id == token and abs(entry.logprob - float(ref[token])) <= ATOL
        torch.testing.assert_close(torch.tensor([lp for _, lp in entry.top], dtype=torch.float64),
                                   ref.topk(4).values, rtol=0, atol=ATOL)
        assert all(bool(allowed[t]) for t, _ in entry.top if _ > float("-inf"))
        assert matcher.accept_token(token)
    assert matcher.is_terminated() and out.finish_reason == "stop"
    assert free.logprobs[0].logprob != out.logprobs[0].logprob  # the free row reports the unconstrained one


@pytest.mark.parametrize(("so", "param", "message"), [
    (StructuredOutputsParams(json={"type": "frob"}), "structured_outputs", "frob"),
    (StructuredOutputsParams(json="{not json"), "structured_outputs", "not valid JSON"),
    (StructuredOutputsParams(regex="[a-"), "structured_outputs", "regex"),
    (StructuredOutputsParams(grammar="root ::= missing_rule"), "structured_outputs", "EBNF"),
    (StructuredOutputsParams(choice=[]), "structured_outputs", "choice"),
    (StructuredOutputsParams(regex="a", choice=["a"]), "structured_outputs", "exactly one"),
    (StructuredOutputsParams(), "structured_outputs", "exactly one"),
    (StructuredOutputsParams(structural_tag="{}"), "structured_outputs", "structural_tag"),
])
def test_bad_constraints_fail_before_queueing(llm: LLM, so: StructuredOutputsParams, param: str,
                                              message: str) -> None:
    with pytest.raises(RequestError, match=re.escape(message)) as caught:
        llm.engine.add_request(None, [5], SamplingParams(structured_outputs=so))
    assert caught.value.param == param
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("field", ["ignore_eos", "min_tokens"])
def test_fields_that_fight_the_grammar_are_refused(field: str) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"), **{field: 1})
    with pytest.raises(RequestError) as caught:
        params.validate()
    assert caught.value.param == field


def test_grammars_compile_once_per_schema_and_tokenizer(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"unique_to_this_test": {"type": "boolean"}},
              "required": ["unique_to_this_test"]}
    before = llm.engine.grammars.stats.compiles
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so)
    outs = llm.generate(["a", "b", "c"], params, adapters=[None, None, "r8_all"], use_tqdm=False)
    assert llm.engine.grammars.stats.compiles == before + 1
    assert all(o.finish_reason == "stop" for o in outs)
