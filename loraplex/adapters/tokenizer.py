"""An adapter's own tokenizer and chat template, when its folder ships them (as trainers save them).

An adapter that adds tokens (``added_tokens.json`` and a resized embedding) must encode and decode its
requests with its own tokenizer; an adapter trained on another chat format brings its template
(``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``). A tokenizer equal to the
base model's is dropped (None: use the base's), so thousands of adapters saved with a copy of the base
tokenizer cost nothing.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from loraplex.errors import InvalidAdapter

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "added_tokens.json")
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def read_adapter_tokenizer(folder: str | Path, base: Any | None, vocab_size: int) -> Any | None:
    """The folder's tokenizer (with its chat template, else the base's), or None when the folder ships
    none or it equals ``base``. ``InvalidAdapter`` if it has more tokens than the adapter serves rows."""
    folder = Path(folder)
    has_tokenizer = any((folder / name).is_file() for name in TOKENIZER_FILES)
    template_file = next((folder / n for n in TEMPLATE_FILES if (folder / n).is_file()), None)
    if not has_tokenizer and template_file is None:
        return None
    if has_tokenizer:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except Exception as e:  # tokenizers raise many types for a bad file
            raise InvalidAdapter(f"{folder}: cannot load the adapter's tokenizer ({e})") from e
        if not getattr(tokenizer, "chat_template", None) and base is not None:
            tokenizer.chat_template = base.chat_template
    elif base is None:
        raise InvalidAdapter(f"{folder}: {template_file.name} without a tokenizer, and the base model has none")
    else:
        tokenizer = copy.deepcopy(base)
        tokenizer.chat_template = _read_template(template_file)
    if len(tokenizer) > vocab_size:
        added = sorted(i for i in tokenizer.get_vocab().values() if i >= vocab_size)
        raise InvalidAdapter(
            f"{folder}: its tokenizer has {len(tokenizer)} tokens but the adapter serves {vocab_size} "
            f"(token ids {added[:5]}{' ...' if len(added) > 5 else ''} have no embedding rows); ship the "
            "resized embed_tokens and lm_head (modules_to_save) or their trainable_token_indices rows")
    return None if base is not None and _same(tokenizer, base) else tokenizer


def _read_template(file: Path) -> str:
    try:
        return json.loads(file.read_text())["chat_template"] if file.suffix == ".json" else file.read_text()
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise InvalidAdapter(f"{file.parent}: cannot read the chat template in {file.name} ({e!r})") from e


def _same(tokenizer: Any, base: Any) -> bool:
    return (type(tokenizer) is type(base) and len(tokenizer) == len(base)
            and tokenizer.chat_template == base.chat_template
            and tokenizer.special_tokens_map == base.special_tokens_map
            and tokenizer.get_vocab() == base.get_vocab())
