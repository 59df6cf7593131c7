"""An adapter's own tokenizer and chat template, when its folder ships them (as trainers save them).

An adapter that adds tokens (``added_tokens.json`` and a resized embedding) must encode and decode its
requests with its own tokenizer; an adapter trained on another chat format brings its template
(``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``). A tokenizer equal to the
base model's is dropped (None: use the base's), so thousands of adapters saved with a copy of the base
tokenizer cost nothing.

The folder is untrusted: transformers is never pointed at it. The known tokenizer files are read
through ``safe_files`` (regular files inside the allowed roots, at most ``MAX_TOKENIZER_FILE_BYTES``
each) and copied into a private temporary folder, with every path-valued field of
``tokenizer_config.json`` (``*_file``, ``*_files``) removed, and the tokenizer is loaded from there
(local files only, no remote code): no other file is opened, whatever the files say.
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loraplex.adapters.reading.bounded_json import parse_json
from loraplex.adapters.reading.safe_files import Roots, present, read_file, resolve_roots
from loraplex.errors import InvalidAdapter

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "added_tokens.json")
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
_ALSO_READ = ("special_tokens_map.json", "merges.txt", "config.json")  # read with a tokenizer when present
_CONFIG = "tokenizer_config.json"
MAX_TOKENIZER_FILE_BYTES = 128 << 20  # the largest tokenizer.json of a common model is ~33 MB (Gemma 3)


def read_adapter_tokenizer(folder: str | Path, base: Any | None, vocab_size: int,
                           roots: Iterable[str | Path] | None = None) -> Any | None:
    """The folder's tokenizer (with its chat template, else the base's), or None when the folder ships
    none or it equals ``base``. ``InvalidAdapter`` if it has more tokens than the adapter serves rows;
    with ``roots``, every file read must resolve inside one of them (``ForbiddenAdapterPath``)."""
    folder, resolved_roots = Path(folder), resolve_roots(roots)
    has_tokenizer = any(present(folder, name) for name in TOKENIZER_FILES)
    template = next((name for name in TEMPLATE_FILES if present(folder, name)), None)
    if not has_tokenizer and template is None:
        return None
    if has_tokenizer:
        tokenizer = _load_tokenizer(folder, resolved_roots)
        if not getattr(tokenizer, "chat_template", None) and base is not None:
            tokenizer.chat_template = base.chat_template
    elif base is None:
        raise InvalidAdapter(f"{folder}: {template} without a tokenizer, and the base model has none")
    else:
        tokenizer = copy.deepcopy(base)
        tokenizer.chat_template = _read_template(folder, template, resolved_roots)
    if len(tokenizer) > vocab_size:
        added = sorted(i for i in tokenizer.get_vocab().values() if i >= vocab_size)
        raise InvalidAdapter(
            f"{folder}: its tokenizer has {len(tokenizer)} tokens but the adapter serves {vocab_size} "
            f"(token ids {added[:5]}{' ...' if len(added) > 5 else ''} have no embedding rows); ship the "
            "resized embed_tokens and lm_head (modules_to_save) or their trainable_token_indices rows")
    return None if base is not None and _same(tokenizer, base) else tokenizer


def _load_tokenizer(folder: Path, roots: Roots) -> Any:
    """AutoTokenizer over a private copy of the folder's tokenizer files (module docstring)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="loraplex-tokenizer-") as private:
        for name in (*TOKENIZER_FILES, *_ALSO_READ, *TEMPLATE_FILES):
            if present(folder, name):
                data = read_file(folder, name, roots, MAX_TOKENIZER_FILE_BYTES)
                Path(private, name).write_bytes(_without_paths(data, folder) if name == _CONFIG else data)
        try:
            tokenizer = AutoTokenizer.from_pretrained(private, local_files_only=True, trust_remote_code=False)
        except Exception as e:  # tokenizers raise many types for a bad file
            reason = str(e).replace(private, str(folder))
            raise InvalidAdapter(f"{folder}: cannot load the adapter's tokenizer ({reason})") from e
    tokenizer.name_or_path = str(folder)
    return tokenizer


def _without_paths(data: bytes, folder: Path) -> bytes:
    """``tokenizer_config.json`` without its path-valued fields (a tokenizer class opens such a path as is)."""
    config = parse_json(data, f"{folder}: {_CONFIG}", MAX_TOKENIZER_FILE_BYTES)
    if not isinstance(config, dict):
        return data
    return json.dumps({k: v for k, v in config.items() if not k.endswith(("_file", "_files"))}).encode()


def _read_template(folder: Path, name: str, roots: Roots) -> str:
    data = read_file(folder, name, roots, MAX_TOKENIZER_FILE_BYTES)
    try:
        if name.endswith(".json"):
            return parse_json(data, f"{folder}: {name}", MAX_TOKENIZER_FILE_BYTES)["chat_template"]
        return data.decode()
    except (UnicodeDecodeError, KeyError, TypeError) as e:
        raise InvalidAdapter(f"{folder}: cannot read the chat template in {name} ({e!r})") from e


def _same(tokenizer: Any, base: Any) -> bool:
    return (type(tokenizer) is type(base) and len(tokenizer) == len(base)
            and tokenizer.chat_template == base.chat_template
            and tokenizer.special_tokens_map == base.special_tokens_map
            and tokenizer.get_vocab() == base.get_vocab())
