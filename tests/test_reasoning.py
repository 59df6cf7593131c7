"""Reasoning output (``--reasoning-parser``): the parsers on their own (whole and streamed texts), then over
HTTP on a tiny model whose chat template opens and closes ``<think>`` blocks as Qwen3's does: the output is
forced (a regex constraint) to a think block and an answer, which must come back split into
``reasoning_content`` and ``content``, streamed and not; ``chat_template_kwargs`` (``enable_thinking: false``)
and ``reasoning_effort`` reach the template (the prompt equals HF's rendering with them), and a template
that does not read ``reasoning_effort`` answers 400."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from loraplex.server.openai.reasoning import REASONING_PARSERS, ReasoningStream
from tests.server_harness import BASE, Server, tiny_server

THINKING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{%- if reasoning_effort is defined %}effort: {{ reasoning_effort }}\n{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "Is 7 prime?"}]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), [
    ("qwen3", "<think>\nLet me see.\n</think>\n\nYes.", "\nLet me see.\n", "\n\nYes."),
    ("qwen3", "Yes, it is.", "", "Yes, it is."),
    ("qwen3", "<think>still going", "still going", ""),
    ("qwen3", "<think>\n\n</think>\n\nNo thinking.", "\n\n", "\n\nNo thinking."),
    ("deepseek_r1", "Hmm, 7 has no divisors.</think>Yes.", "Hmm, 7 has no divisors.", "Yes."),
    ("deepseek_r1", "<think>Hmm.</think>Yes.", "Hmm.", "Yes."),
    ("deepseek_r1", "cut short by max_tokens", "cut short by max_tokens", ""),
])
def test_parsers_split_whole_and_streamed(name: str, text: str, reasoning: str, content: str) -> None:
    parser = REASONING_PARSERS[name]
    assert parser.split(text) == (reasoning, content)
    for step in (1, 2, 5):
        stream, thought, last = ReasoningStream(parser), "", ""
        for cut in [*range(step, len(text), step), len(text)]:
            new, so_far = stream.delta(text[:cut], cut == len(text))
            thought += new
            assert so_far.startswith(last)  # content only grows
            last = so_far
        assert (thought, last) == (reasoning, content)


@pytest.fixture(scope="module")
def thinker(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a Qwen3-style thinking chat template."""
    folder = tmp_path_factory.mktemp("thinker") / "model"
    shutil.copytree(tiny_llama, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def server(thinker: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_server(thinker, tiny_llama_adapters, (), (), tmp_path_factory.mktemp("root"),
                     app_options={"reasoning_parser": "qwen3"}, max_loras=1, max_lora_rank=16,
                     kv_cache_blocks=64, max_num_seqs=4) as srv:
        yield srv


def _forced(text: str) -> dict:
    return {"structured_outputs": {"regex": re.escape(text)}}


def test_reasoning_content_split_from_content(server: Server) -> None:
    client = server.client()
    forced = "<think>Seven has no divisors.</think>Yes."
    kw = dict(model=BASE, messages=MESSAGES, max_tokens=60, temperature=0, extra_body=_forced(forced))
    message = client.chat.completions.create(**kw).choices[0].message
    assert (message.reasoning_content, message.content) == ("Seven has no divisors.", "Yes.")
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Seven has no divisors."
    assert "".join(d.content or "" for d in deltas) == "Yes."
    assert not any("<think>" in (d.content or "") or "</think>" in (d.content or "") for d in deltas)
    plain = client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=60, temperature=0,
                                           extra_body=_forced("Just yes."))
    assert (plain.choices[0].message.reasoning_content, plain.choices[0].message.content) == (None, "Just yes.")


def test_template_kwargs_and_reasoning_effort_reach_the_template(server: Server, thinker: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(thinker)
    client = server.client()

    def prompt_tokens(**fields: object) -> int:
        return client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=1,
                                              extra_body=fields).usage.prompt_tokens

    def hf(**kwargs: object) -> int:
        return len(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True,
                                                 **kwargs)["input_ids"])

    assert prompt_tokens() == hf()
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == hf(enable_thinking=False) > hf()
    assert prompt_tokens(reasoning_effort="low") == hf(reasoning_effort="low") > hf()
    r = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": BASE, "messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_reasoning_effort_is_400_for_a_template_that_ignores_it(tiny_llama: Path, tiny_llama_adapters: dict,
                                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    with tiny_server(tiny_llama, tiny_llama_adapters, (), (), tmp_path_factory.mktemp("root"), max_loras=1,
                     max_lora_rank=16, kv_cache_blocks=32, max_num_seqs=2) as srv:
        body = {"model": BASE, "messages": MESSAGES, "max_tokens": 1}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={**body, "reasoning_effort": "high"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
        assert httpx.post(f"{srv.url}/v1/chat/completions", json={**body, "reasoning_effort": "none"}
                          ).status_code == 200
