"""HF transformers + PEFT's greedy answer to a chat, decoded by HF's tokenizer: what every client must get."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from tests.reference import with_adapter


def hf_chat_text(model: Path, adapter: Path | None, messages: list[dict], max_tokens: int) -> str:
    """Greedy ``max_tokens`` tokens (cut at EOS) after the chat template's generation prompt."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    [tokens] = with_adapter(model, adapter, [list(prompt)], max_tokens)
    if tokenizer.eos_token_id in tokens:
        tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
    return tokenizer.decode(tokens, skip_special_tokens=True)
