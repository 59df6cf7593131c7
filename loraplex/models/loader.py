"""Build a model from an HF safetensors checkpoint folder (or a GGUF file: ``loraplex.models.gguf.loader``).

Reads every ``*.safetensors`` file in the folder (one file or shards; tensor names with or without
the ``model.`` prefix), copies each tensor straight into the model's preallocated parameters
(q/k/v and gate/up land in row ranges of the packed ``qkv_proj`` / ``gate_up_proj`` weights, with
no intermediate concatenation), and fails with a ``ModelError`` naming any missing or mis-shaped
tensor, or one the model has no place for. Tied embeddings: the model has no ``lm_head`` of its own, so
a checkpoint's copy is ignored.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from loraplex.config import ModelConfig
from loraplex.errors import ModelError
from loraplex.layers.lora_linear import LoRALinear
from loraplex.models.base import CausalLM
from loraplex.models.gguf.source import find_gguf
from loraplex.models.registry import model_class
from loraplex.models.registry import model_config as family_config

logger = logging.getLogger(__name__)


def _destinations(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint tensor name (without ``model.``) -> the parameter (or row slice) it fills."""
    out: dict[str, torch.Tensor] = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            parent = mod_name.rsplit(".", 1)[0]
            for kind in ("weight", "bias"):
                param = getattr(module, kind)
                if param is None:
                    continue
                for i, proj in enumerate(module.names):
                    lo, hi = module.out_offsets[i], module.out_offsets[i + 1]
                    out[f"{parent}.{proj}.{kind}"] = param[lo:hi]
        else:
            for p_name, param in module.named_parameters(recurse=False):
                out[f"{mod_name}.{p_name}" if mod_name else p_name] = param
    return out


def _checkpoint_index(folder: Path) -> dict[str, tuple[Path, str]]:
    """Normalised tensor name -> (file, name in file) over all shards."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder}: no *.safetensors files (only safetensors checkpoints are read)")
    index: dict[str, tuple[Path, str]] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                name = key.removeprefix("model.")
                if name in index:
                    raise ModelError(f"{folder}: tensor {name!r} appears in both {index[name][0].name} and "
                                     f"{file.name}")
                index[name] = (file, key)
    return index


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """Checkpoint tensors that carry nothing the model needs: a tied lm_head's copy, cached rotary tables."""
    return (name == "lm_head.weight" and cfg.tie_word_embeddings) or name.endswith("rotary_emb.inv_freq")


def load_model(
    folder: str | Path,
    model_config: ModelConfig | None,
    max_loras: int,
    max_lora_rank: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> CausalLM:
    """Build the model for ``model_config`` (read from ``folder`` by its family when None) and fill its
    weights. A checkpoint tensor the model has no place for is an error (it would be silently ignored)."""
    folder = Path(folder)
    if (gguf := find_gguf(folder)) is not None:
        from loraplex.models.gguf.loader import load_gguf_model

        return load_gguf_model(gguf, model_config, max_loras, max_lora_rank, dtype, device)
    cfg = model_config if model_config is not None else family_config(folder)
    cls = model_class(cfg.architecture)
    if not isinstance(cfg, cls.config_class):
        raise ModelError(f"{folder}: {cfg.architecture} needs a {cls.config_class.__name__}, got "
                         f"{type(cfg).__name__} (use loraplex.models.registry.model_config)")
    model = cls(cfg, max_loras, max_lora_rank, dtype, device)
    destinations = _destinations(model)
    index = _checkpoint_index(folder)
    missing = sorted(set(destinations) - set(index))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelError(f"{folder}: checkpoint lacks {len(missing)} tensors the model needs: {shown}")
    by_file: dict[Path, list[str]] = {}
    for name in destinations:
        by_file.setdefault(index[name][0], []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name in names:
                    src = f.get_slice(index[name][1])
                    dst = destinations[name]
                    if tuple(src.get_shape()) != tuple(dst.shape):
                        raise ModelError(f"{folder}: tensor {index[name][1]!r} in {file.name} has shape "
                                         f"{tuple(src.get_shape())}, the model expects {tuple(dst.shape)}")
                    dst.copy_(src[:])
    unused = sorted(name for name in set(index) - set(destinations) if not _ignorable(name, cfg))
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise ModelError(f"{folder}: checkpoint has {len(unused)} tensors {cfg.architecture} does not use: {shown}")
    logger.info("loaded %s (%s, %d layers) from %s", cfg.architecture, dtype, cfg.num_layers, folder)
    return model.eval()
