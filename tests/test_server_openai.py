"""The OpenAI surface over real HTTP with the official client: logprobs (legacy and chat, streamed and not),
echo with prompt logprobs (HF + PEFT reference), n choices, prompt lists, penalties, max_completion_tokens,
/tokenize and /detokenize; every OpenAI request field is implemented or refused unless neutral."""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import pytest
import torch
from transformers import AutoTokenizer

from loraplex import LLM, SamplingParams
from loraplex.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from loraplex.server.openai.strict_fields import (
    CHAT_UNIMPLEMENTED,
    COMPLETION_UNIMPLEMENTED,
    GENERIC_NEUTRAL,
    VLLM_DEFAULTS,
)
from tests.format_fixtures import ADDED_TOKENS, write_added_tokens_adapter
from tests.reference import hf_greedy
from tests.server_harness import BASE, MODES, Server, tiny_server
from tests.test_formats_reference import peft_model
from tests.test_logprobs import hf_logprobs

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=256, max_num_seqs=16)
ADAPTERS = ("r8_all", "r4_attn")
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """In-process engine ("thread") and engine process ("process"): logprobs, prompt logprobs, n choices and
    prompt lists cross the process boundary."""
    with tiny_server(tiny_llama, tiny_llama_adapters, ADAPTERS, (), tmp_path_factory.mktemp("root"),
                     mode=request.param, **CONFIG) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> LLM:
    llm = LLM(model=str(tiny_llama), **CONFIG)
    for name in ADAPTERS:
        llm.load_adapter(name, tiny_llama_adapters[name])
    return llm


def request_fields(module: typing.Any) -> set[str]:
    """Every field of an ``openai`` create-params TypedDict (streaming and not)."""
    return set(typing.get_type_hints(module.CompletionCreateParamsStreaming)) | set(
        typing.get_type_hints(module.CompletionCreateParamsNonStreaming))


@pytest.mark.parametrize(("module", "model", "table"), [
    (completion_params, CompletionRequest, COMPLETION_UNIMPLEMENTED),
    (chat_params, ChatCompletionRequest, CHAT_UNIMPLEMENTED)])
def test_every_openai_field_is_implemented_or_refused(module: typing.Any, model: type, table: dict) -> None:
    """A field the installed ``openai`` package adds later fails here until it is implemented or refused."""
    fields = request_fields(module)
    assert "temperature" in fields and "model" in fields
    unknown = fields - set(model.model_fields) - set(table)
    assert not unknown, f"OpenAI request fields neither implemented nor refused: {sorted(unknown)}"
    assert not set(model.model_fields) & set(table)


def test_unimplemented_fields_refused_unless_neutral(server: Server) -> None:
    """OpenAI's unimplemented fields and vLLM's (tool calls among them)."""
    for path, base, table in (("/v1/completions", {"prompt": "Hi"}, COMPLETION_UNIMPLEMENTED),
                              ("/v1/chat/completions", {"messages": MESSAGES}, CHAT_UNIMPLEMENTED)):
        body = {"model": BASE, "max_tokens": 2, **base}
        vllm = {k: v for k, v in VLLM_DEFAULTS.items() if not (k == "echo" and "prompt" in base)}  # implemented
        for name, (neutral, _) in {**table, **vllm}.items():
            for value in neutral:
                r = httpx.post(server.url + path, json={**body, name: value}, timeout=30)
                assert r.status_code == 200, (name, value, r.text)
            r = httpx.post(server.url + path, json={**body, name: {"type": "something"}}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
        neutral_unknown = {f"x_{i}": v for i, v in enumerate(GENERIC_NEUTRAL)}
        assert httpx.post(server.url + path, json={**body, **neutral_unknown}, timeout=30).status_code == 200


def test_completion_logprobs_streamed_and_not(server: Server, offline: LLM) -> None:
    """Legacy format: tokens, token_logprobs, top_logprobs (top k plus the chosen token), text_offset; the
    values are the offline engine's; the streamed chunks carry the same entries."""
    client = server.client()
    kw = dict(model="r8_all", prompt="The sky is", max_tokens=6, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    lp = full.choices[0].logprobs
    ref = offline.generate("The sky is", SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True),
                           adapters="r8_all", use_tqdm=False)[0]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-5)
    assert lp.tokens == [offline.tokenizer.decode([t]) for t in ref.token_ids]
    assert all(len(top) in (2, 3) and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text


def test_chat_logprobs_with_official_client(server: Server, offline: LLM) -> None:
    client = server.client()
    kw = dict(model="r4_attn", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: chosen is the top
    assert b"".join(bytes(c.bytes) for c in content).decode() == full.choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [c for ch in chunks for c in (ch.choices[0].logprobs.content if ch.choices[0].logprobs else [])]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)


def test_echo_scores_prompts_like_hf_peft(server: Server, offline: LLM, tiny_llama: Path,
                                          tiny_llama_adapters: dict[str, Path]) -> None:
    """lm-eval's request: a prompt list, echo, logprobs 1, max_tokens 0 (and 1): the first prompt token's
    logprob is null, the others equal HF + PEFT log-softmax."""
    prompts = ["The capital of France is Paris", "1 2 3 4 5 6"]
    r = server.client().completions.create(model="r8_all", prompt=prompts, echo=True, logprobs=1, max_tokens=0)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 0
    assert r.choices[0].text == prompts[0]
    for choice, prompt in zip(r.choices, prompts, strict=True):
        ids = offline.tokenize(prompt)
        ref = hf_logprobs(tiny_llama, tiny_llama_adapters["r8_all"], ids)
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
        expected = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    one = server.client().completions.create(model="r8_all", prompt=prompts, echo=True, logprobs=1, max_tokens=1,
                                             temperature=0)
    assert [len(c.logprobs.tokens) for c in one.choices] == [len(c.logprobs.tokens) + 1 for c in r.choices]


def test_n_choices_and_prompt_lists_equal_offline(server: Server, offline: LLM) -> None:
    """Seeded n=3 over two prompts: choices indexed prompt_index * n + j, each equal to the offline choice;
    usage counts each prompt once; the streamed choices equal the whole ones."""
    client = server.client()
    kw = dict(model="r8_all", prompt=["Once upon", "In a land"], n=3, max_tokens=6, temperature=1.0, seed=42,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert [c.index for c in full.choices] == list(range(6))
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=42, ignore_eos=True)
    ref = offline.generate(["Once upon", "In a land"], params, adapters="r8_all", use_tqdm=False)
    assert [c.text for c in full.choices] == [c.text for o in ref for c in o.outputs]
    assert full.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in ref)
    assert full.usage.completion_tokens == 36
    texts = [""] * 6
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in full.choices]
    chat = client.chat.completions.create(model=BASE, messages=MESSAGES, n=2, max_tokens=4, seed=1,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8


def test_penalties_and_limits_over_http_equal_offline(server: Server, offline: LLM) -> None:
    body = {"model": "r4_attn", "prompt": "one two one two one", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5,
            "logit_bias": {"100": 3.0}, "min_p": 0.1}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.5, logit_bias={100: 3.0}, min_p=0.1)
    assert r["choices"][0]["text"] == offline.generate(body["prompt"], params, adapters="r4_attn",
                                                       use_tqdm=False)[0].text
    chat = server.client().chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=50,
                                                   max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3  # max_completion_tokens wins


def test_tokenize_and_detokenize(server: Server, offline: LLM) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"model": "r8_all", "prompt": "Hello world",
                                                   "return_token_strs": True}).json()
    ids = offline.tokenizer.encode("Hello world")
    assert r == {"count": len(ids), "max_model_len": server.engine_client.max_model_len, "tokens": ids,
                 "token_strs": offline.tokenizer.convert_ids_to_tokens(ids)}
    chat = httpx.post(f"{server.url}/tokenize", json={"model": BASE, "messages": MESSAGES}).json()
    full = server.client().chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=1)
    assert chat["count"] == full.usage.prompt_tokens and chat["token_strs"] is None
    back = httpx.post(f"{server.url}/detokenize", json={"model": BASE, "tokens": ids}).json()
    assert back == {"prompt": "Hello world"}
    for path, body, param in (("/tokenize", {"model": "nope", "prompt": "x"}, "model"),
                              ("/detokenize", {"model": BASE, "tokens": [49152]}, "tokens"),
                              ("/tokenize", {"model": BASE, "prompt": "x", "messages": MESSAGES}, "messages")):
        r = httpx.post(server.url + path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_stream_chunks_are_valid_json_until_done(server: Server) -> None:
    body = {"model": BASE, "messages": MESSAGES, "max_tokens": 3, "n": 2, "stream": True, "logprobs": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == sum(
        len(c["choices"][0]["logprobs"]["content"]) for c in chunks if c["choices"] and c["choices"][0]["logprobs"])
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}


def test_streamed_echo_leads_with_the_prompt(server: Server) -> None:
    chunks = list(server.client().completions.create(model="r8_all", prompt="Echo me", echo=True, logprobs=0,
                                                     max_tokens=3, temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0]
    assert first.text.startswith("Echo me") and first.logprobs.token_logprobs[0] is None
    whole = server.client().completions.create(model="r8_all", prompt="Echo me", echo=True, logprobs=0, max_tokens=3,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], abs=1e-6)


def test_adapter_with_added_tokens_uses_its_tokenizer(server: Server, offline: LLM, tiny_llama: Path) -> None:
    """An adapter that adds tokens (its own tokenizer, a resized vocabulary): /tokenize, /detokenize, echo and
    logprob token strings use its tokenizer and vocabulary; the echoed prompt's and the generated tokens'
    logprobs equal PEFT on the resized base."""
    text = f"Call {ADDED_TOKENS[0]} then"
    folder = write_added_tokens_adapter(tiny_llama, server.root / "added", "saved", offline.tokenize(text))
    loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "added", "lora_path": str(folder)})
    assert loaded.status_code == 200, loaded.text
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids, vocab = tokenizer.encode(text, add_special_tokens=False), len(tokenizer)
        assert max(ids) >= server.engine_client.vocab_size
        r = httpx.post(f"{server.url}/tokenize", json={"model": "added", "prompt": text, "add_special_tokens": False,
                                                       "return_token_strs": True}).json()
        assert r["tokens"] == ids and ADDED_TOKENS[0] in r["token_strs"]
        assert httpx.post(f"{server.url}/detokenize", json={"model": "added", "tokens": ids}).json() == {"prompt": text}
        refused = httpx.post(f"{server.url}/detokenize", json={"model": BASE, "tokens": ids})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
        out = server.client().completions.create(model="added", prompt=text, echo=True, logprobs=2, max_tokens=3,
                                                 temperature=0, extra_body={"ignore_eos": True})
        reference = peft_model(tiny_llama, folder, vocab)
        generated = hf_greedy(reference, ids, 3)[0]
        everything = ids + generated
        with torch.inference_mode():
            ref = torch.log_softmax(reference(torch.tensor([everything])).logits[0].float(), -1)
        lp = out.choices[0].logprobs
        assert lp.tokens == [tokenizer.decode([t]) for t in everything] and ADDED_TOKENS[0] in lp.tokens
        assert lp.token_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx([float(ref[i - 1, t]) for i, t in enumerate(everything)][1:],
                                                      abs=1e-4)
        assert out.choices[0].text == tokenizer.decode(everything)
    finally:
        httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "added"}).raise_for_status()
