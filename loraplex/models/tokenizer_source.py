"""The base model's tokenizer from what ``resolve_model`` returned: an HF folder's tokenizer files, or the
tokenizer (and chat template) in a GGUF file's metadata, as transformers reads them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def model_tokenizer(path: str | Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer of the model at ``path`` (a folder or a ``*.gguf`` file), None when it has none."""
    path = Path(path)
    if path.is_file():
        from loraplex.models.gguf.metadata import gguf_tokenizer, has_tokenizer

        return gguf_tokenizer(path) if has_tokenizer(path) else None
    if not (path / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
