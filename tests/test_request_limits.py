"""Request limits and the work kept off the event loop: 413 before the body is read, ``stop`` list
size, and the character-count proof that refuses a prompt before it is tokenized."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from loraplex.client.tokenizers import VersionTokenizers
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.request import check_context_length
from loraplex.errors import RequestError
from loraplex.server.app import create_app
from loraplex.server.limits import MAX_STOP_STRINGS, default_max_request_bytes
from loraplex.server.prepare.prompt_bound import PromptBound
from loraplex.server.prepare.worker import PrepareConfig, PrepareWorker
from tests.server_harness import running_server

LIMIT = 20_000


@pytest.fixture(scope="module")
def url(tiny_llama: Path) -> Iterator[str]:
    app = create_app(Engine(EngineConfig(model=str(tiny_llama), kv_cache_blocks=64)), served_model_name="tiny",
                     max_request_bytes=LIMIT)
    with running_server(app) as base:
        yield base


def completion(prompt: str, **fields: object) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True, **fields}


def assert_413(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == 413 and str(LIMIT) in r.json()["error"]["message"]


def test_body_over_the_limit_is_413_before_it_is_read(url: str) -> None:
    big = httpx.Request("POST", f"{url}/v1/completions", json=completion("x" * LIMIT)).content
    assert_413(httpx.post(f"{url}/v1/completions", content=big, headers={"content-type": "application/json"}))

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield from (big[i:i + 4096] for i in range(0, len(big), 4096))

    assert_413(httpx.post(f"{url}/v1/completions", content=chunks(), headers={"content-type": "application/json"}))
    assert_413(httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x" * LIMIT, "lora_path": "p"}))
    ok = httpx.post(f"{url}/v1/completions", json=completion("y" * (LIMIT // 2)), timeout=60)
    assert ok.status_code == 400 and ok.json()["error"]["param"] == "prompt"  # read, then too long for 512
    assert httpx.post(f"{url}/v1/completions", json=completion("Hello"), timeout=60).status_code == 200


def test_default_limit_fits_any_prompt_that_fits_the_context() -> None:
    assert default_max_request_bytes(512) == 1 << 20
    assert default_max_request_bytes(128 * 1024) == 64 * 128 * 1024


def test_stop_lists_are_bounded(url: str) -> None:
    ok = httpx.post(f"{url}/v1/completions", json=completion("Hi", stop=["a"] * MAX_STOP_STRINGS), timeout=60)
    assert ok.status_code == 200, ok.text
    r = httpx.post(f"{url}/v1/completions", json=completion("Hi", stop=["a"] * (MAX_STOP_STRINGS + 1)))
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


@pytest.fixture(scope="module")
def smol_tokenizer(tiny_llama: Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(tiny_llama)


def random_text(rng: random.Random, n: int, special: list[str]) -> str:
    pieces = [" ", "  \n\t", "a", "Zebra", "日本語", "🙂", "é", "e\u0301", "#" * 90, " " * 200, "x" * 300,
              "<|im_start|>", *special]
    return "".join(rng.choice(pieces) for _ in range(n))


def test_prompt_bound_never_exceeds_the_real_token_count(smol_tokenizer: PreTrainedTokenizerFast) -> None:
    bound = PromptBound.for_tokenizer(smol_tokenizer)
    assert bound is not None
    special = [t.content for t in smol_tokenizer.added_tokens_decoder.values()]
    rng = random.Random(0)
    for n in (1, 3, 10, 100, 1000):
        for _ in range(20):
            text = random_text(rng, n, special)
            assert bound.min_tokens(len(text)) <= len(smol_tokenizer.encode(text, add_special_tokens=False))


def test_prompt_bound_needs_a_pipeline_that_keeps_every_character() -> None:
    """A pre-tokenizer that drops whitespace (a million spaces are zero tokens) voids the proof; NFC
    composition divides the bound by 4."""
    vocab = {"[UNK]": 0, "a": 1, "b": 2}

    def fast(normalizer: object, pre: object) -> PreTrainedTokenizerFast:
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.normalizer, tok.pre_tokenizer = normalizer, pre
        return PreTrainedTokenizerFast(tokenizer_object=tok)

    assert PromptBound.for_tokenizer(fast(None, pre_tokenizers.Whitespace())) is None
    assert PromptBound.for_tokenizer(fast(normalizers.Strip(), pre_tokenizers.ByteLevel())) is None
    assert PromptBound.for_tokenizer(fast(None, pre_tokenizers.ByteLevel())) == PromptBound(5)  # "[UNK]"
    assert PromptBound.for_tokenizer(fast(normalizers.NFC(), pre_tokenizers.Metaspace())) == PromptBound(20)


class CountingTokenizer:
    """Wraps a tokenizer and counts ``encode`` calls."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner, self.encodes = inner, 0
        self.backend_tokenizer, self.get_vocab = inner.backend_tokenizer, inner.get_vocab

    def encode(self, text: str, **kw: object) -> list[int]:
        self.encodes += 1
        return self.inner.encode(text, **kw)


def test_a_prompt_too_long_by_its_characters_is_never_tokenized(smol_tokenizer: PreTrainedTokenizerFast) -> None:
    counting = CountingTokenizer(smol_tokenizer)
    worker = PrepareWorker(PrepareConfig(None, max_model_len=512), VersionTokenizers(counting))
    bound = worker.bound(counting)
    assert bound is not None
    limit_chars = 512 * bound.chars_per_token
    with pytest.raises(RequestError) as info:
        worker.token_ids(counting, "word " * limit_chars, reserve=16, param="prompt")
    assert info.value.param == "prompt" and "at least" in str(info.value) and counting.encodes == 0
    ids = worker.token_ids(counting, "word " * 600, reserve=16, param="messages")  # under the bound: tokenized
    assert counting.encodes == 1  # (the engine refuses it by its real count at submission)
    with pytest.raises(RequestError, match="exceeds the maximum context length"):
        check_context_length(len(ids), 16, 512)
    assert worker.token_ids(counting, "word " * 10, reserve=16, param="prompt") == smol_tokenizer.encode(
        "word " * 10, add_special_tokens=False)
