"""The server on the real embedded SmolLM2-135M-Instruct: chat through its own template, base and an
adapter, streamed and not, equal to HF transformers + PEFT's greedy answer decoded by HF's tokenizer
(``tests/hf_text.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from loraplex import LLM
from loraplex.models.embedded import EMBEDDED_MODEL, embedded_checkpoint
from loraplex.server.app import create_app
from tests.fixtures import write_peft_adapter
from tests.hf_text import HfAnswer, hf_chat
from tests.server_harness import running_server

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
MAX_TOKENS = 12


@dataclass
class Smol:
    url: str
    prompt_tokens: int
    offline: dict[str, HfAnswer]  # model name -> HF + PEFT's answer

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Smol]:
    """A server on SmolLM2 with one adapter, and HF + PEFT's answers for the base model and the adapter."""
    base = embedded_checkpoint()
    adapter = write_peft_adapter(base, tmp_path_factory.mktemp("smol") / "qv", rank=8, b_std=0.09, seed=3)
    offline = {model: hf_chat(base, folder, MESSAGES, MAX_TOKENS)
               for model, folder in ((EMBEDDED_MODEL, None), ("qv", adapter))}
    llm = LLM(max_loras=1, max_lora_rank=8, kv_cache_blocks=64)
    llm.load_adapter("qv", adapter)
    with running_server(create_app(llm)) as url:  # an LLM serves its own engine
        yield Smol(url, len(offline[EMBEDDED_MODEL].prompt_ids), offline)


@pytest.mark.parametrize("model", [EMBEDDED_MODEL, "qv"])
def test_chat_on_smollm2(smol: Smol, model: str) -> None:
    want = smol.offline[model]
    client = smol.client()
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert full.choices[0].message.content == want.text
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (smol.prompt_tokens, len(want.token_ids))
    chunks = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text


def test_smollm2_models_and_outputs_differ(smol: Smol) -> None:
    cards = {m.id: m for m in smol.client().models.list().data}
    assert set(cards) == {EMBEDDED_MODEL, "qv"}
    assert cards["qv"].parent == EMBEDDED_MODEL and Path(cards["qv"].root).name == "qv"
    assert smol.offline[EMBEDDED_MODEL].text.strip()
    assert smol.offline[EMBEDDED_MODEL].text != smol.offline["qv"].text
