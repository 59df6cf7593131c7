"""What an OpenAI client must get, computed without loraplex's code: HF transformers + PEFT's greedy tokens
(``tests/reference.py``), the prompt tokenized and the answer decoded by HF's tokenizer (the adapter folder's
own when it ships one), EOS and stop strings applied as the OpenAI API states them: generation ends at EOS
(counted, not shown) or once the text contains a stop string (the text ends before it; the tokens up to
the one that completed it are counted)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.reference import with_adapter


@dataclass(frozen=True)
class HfAnswer:
    prompt_ids: list[int]
    token_ids: list[int]  # the completion tokens counted in ``usage`` (an EOS that ended it included)
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


@lru_cache(maxsize=8)
def hf_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(folder)


def tokenizer_for(base: Path, adapter: Path | None) -> PreTrainedTokenizerBase:
    """The adapter folder's tokenizer when it ships one, else the base model's."""
    own = adapter is not None and any((adapter / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    return hf_tokenizer(str(adapter if own else base))


def _answer(tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], tokens: list[int], ignore_eos: bool,
            stop: Sequence[str]) -> HfAnswer:
    if not ignore_eos and tokenizer.eos_token_id in tokens:
        tokens = tokens[: tokens.index(tokenizer.eos_token_id) + 1]
        finish = "stop"
    else:
        finish = "length"
    for k in range(1, len(tokens) + 1) if stop else ():
        text = tokenizer.decode(tokens[:k], skip_special_tokens=True)
        found = [text.index(s) for s in stop if s in text]
        if found:
            return HfAnswer(prompt_ids, tokens[:k], text[: min(found)], "stop")
    return HfAnswer(prompt_ids, tokens, tokenizer.decode(tokens, skip_special_tokens=True), finish)


def hf_complete(base: Path, adapter: Path | None, prompt: str | list[int], max_tokens: int, *,
                ignore_eos: bool = False, stop: Sequence[str] = ()) -> HfAnswer:
    """A completion: ``prompt`` (text, tokenized as HF does by default, or token ids) then greedy tokens."""
    tokenizer = tokenizer_for(base, adapter)
    ids = list(prompt) if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]
    [tokens] = with_adapter(base, adapter, [ids], max_tokens)
    return _answer(tokenizer, ids, tokens, ignore_eos, stop)


def hf_chat(base: Path, adapter: Path | None, messages: list[dict], max_tokens: int, *,
            ignore_eos: bool = False, stop: Sequence[str] = ()) -> HfAnswer:
    """A chat: the chat template's generation prompt (the adapter's own template when it ships one)."""
    tokenizer = tokenizer_for(base, adapter)
    own_template = adapter is not None and (adapter / "chat_template.jinja").is_file()
    template = (adapter / "chat_template.jinja").read_text() if own_template else None
    ids = list(tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                             return_dict=True)["input_ids"])
    [tokens] = with_adapter(base, adapter, [ids], max_tokens)
    return _answer(tokenizer, ids, tokens, ignore_eos, stop)
