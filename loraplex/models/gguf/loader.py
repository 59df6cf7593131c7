"""Build a model from a GGUF file: the config from its metadata (``metadata.hf_config``), every tensor mapped
to the model's parameter by gguf's own HF -> GGUF name map, llama.cpp's q/k row permutation undone.

Base projections (and the lm_head, tied or not) whose rows are ``Q4_0``, ``Q4_1``, ``Q8_0``, ``Q4_K``, ``Q5_K``
or ``Q6_K`` stay in those blocks (``ops.gguf.block_weight.BlockWeight``, given to the layer with
``use_quantized_weight``) when the model is float32 on the CPU and ``keep_blocks`` is set; every other tensor
(norms, the embedding table, a packed layer holding another type, logged, and the rest of what ``gguf.quants``
reads) is dequantized to float as transformers dequantizes it, so the model computes float math on the same
weights as HF loading the same file. A tensor the model has no place
for, or a missing or mis-shaped one, is a ``GGUFError``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

from loraplex.config import ModelConfig
from loraplex.layers.lora_linear import LoRALinear
from loraplex.models.base import CausalLM
from loraplex.models.gguf.metadata import hf_config
from loraplex.models.gguf.reader import GGUFError, GGUFFile, GGUFTensor
from loraplex.models.registry import model_class
from loraplex.models.registry import model_config as family_config
from loraplex.ops.gguf.block_weight import BlockWeight
from loraplex.ops.gguf.formats import NATIVE_TYPES, block_values

logger = logging.getLogger(__name__)

# Tensors some converters write that the model computes itself (llama3 rope factors come from the config).
_IGNORED = ("rope_freqs.weight",)


class _Tensors:
    """The file's tensors by the model's (HF) parameter names, rows unpermuted, with a record of those used."""

    def __init__(self, file: GGUFFile, cfg: ModelConfig) -> None:
        arch = {name: a for a, name in MODEL_ARCH_NAMES.items()}.get(file.architecture)
        if arch is None:
            raise GGUFError(f"{file.path}: gguf knows no tensor names for architecture {file.architecture!r}")
        self.file, self.cfg = file, cfg
        self.names = get_tensor_name_map(arch, cfg.num_layers)
        # llama.cpp's converter permutes q/k rows of Llama checkpoints (transformers undoes it the same way)
        self.permuted = file.architecture == "llama"
        self.used: set[str] = set()

    def gguf_name(self, hf_name: str) -> str:
        name = self.names.get_name(f"model.{hf_name}" if hf_name != "lm_head.weight" else hf_name,
                                   try_suffixes=(".weight", ".bias"))
        if name is None:
            raise GGUFError(f"{self.file.path}: no GGUF tensor name for the model's {hf_name!r}")
        return name  # with hf_name's suffix

    def get(self, hf_name: str, shape: tuple[int, ...]) -> tuple[GGUFTensor, np.ndarray]:
        """The tensor for ``hf_name`` and its stored rows (unpermuted), checked against ``shape``."""
        tensor = self.file.tensor(self.gguf_name(hf_name))
        if tensor.shape != tuple(shape):
            raise GGUFError(f"{self.file.path}: tensor {tensor.name!r} has shape {tensor.shape}, the model's "
                            f"{hf_name} needs {tuple(shape)}")
        self.used.add(tensor.name)
        rows = tensor.rows()
        heads = self._heads(hf_name)
        if heads:  # llama.cpp stored rows as [heads, d/2, 2] of HF's [heads, 2, d/2]
            rows = rows.reshape(heads, -1, 2, rows.shape[1]).swapaxes(1, 2).reshape(rows.shape)
        return tensor, rows

    def _heads(self, hf_name: str) -> int:
        if not self.permuted:
            return 0
        if hf_name.endswith("self_attn.q_proj.weight"):
            return self.cfg.num_heads
        return self.cfg.num_kv_heads if hf_name.endswith("self_attn.k_proj.weight") else 0

    def float_tensor(self, hf_name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor, rows = self.get(hf_name, shape)
        return tensor.dequantized(rows)


def _load_linear(linear: LoRALinear, parent: str, tensors: _Tensors, keep_blocks: bool) -> None:
    """One packed layer: its projections' rows as GGUF blocks when all are native types, else float."""
    parts = [tensors.get(f"{parent}.{proj}.weight", (linear.out_features[i], linear.in_features))
             for i, proj in enumerate(linear.names)]
    if linear.bias is not None:
        for i, proj in enumerate(linear.names):
            lo, hi = linear.out_offsets[i], linear.out_offsets[i + 1]
            linear.bias[lo:hi].copy_(tensors.float_tensor(f"{parent}.{proj}.bias", (hi - lo,)))
    if keep_blocks and _native(parent, [t for t, _ in parts], linear.in_features):
        rows = [(t.qtype.name, torch.from_numpy(np.array(r))) for t, r in parts]
        linear.use_quantized_weight(BlockWeight.from_rows(rows, linear.in_features))
        return
    for i, (tensor, rows) in enumerate(parts):
        linear.weight[linear.out_offsets[i] : linear.out_offsets[i + 1]].copy_(tensor.dequantized(rows))


def _native(parent: str, tensors: list[GGUFTensor], in_features: int) -> bool:
    """Whether every tensor of a packed layer can be multiplied in its blocks (the reason logged if not)."""
    for tensor in tensors:
        qtype = tensor.qtype.name
        if qtype not in NATIVE_TYPES:
            if qtype not in ("F32", "F16"):
                logger.info("%s: %s is %s, not served natively: the layer is dequantized to float", parent,
                            tensor.name, qtype)
            return False
        if in_features % block_values(qtype):
            logger.info("%s: %s rows of %d values are not whole %s blocks of %d: the layer is dequantized to "
                        "float", parent, tensor.name, in_features, qtype, block_values(qtype))
            return False
    return True


def _load_lm_head(model: CausalLM, tensors: _Tensors, keep_blocks: bool) -> None:
    """The lm_head (the embedding's tensor when tied) as blocks where native; else the float copy stays."""
    cfg = model.config
    name = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    tensor, rows = tensors.get(name, (cfg.vocab_size, cfg.hidden_size))
    if keep_blocks and _native("lm_head", [tensor], cfg.hidden_size):
        data = torch.from_numpy(np.array(rows))
        model.lm_head_int8 = BlockWeight.from_rows([(tensor.qtype.name, data)], cfg.hidden_size)
        model.lm_head = None
    elif model.lm_head is not None:
        model.lm_head.weight.copy_(tensor.dequantized(rows))


def load_gguf_model(path: str | Path, model_config: ModelConfig | None, max_loras: int, max_lora_rank: int,
                    dtype: torch.dtype, device: torch.device | str, keep_blocks: bool = True) -> CausalLM:
    """The model in GGUF file ``path`` (``model_config``: read from its metadata when None); base weights in
    native block types stay in blocks when ``keep_blocks`` and the model is float32 on the CPU."""
    path = Path(path)
    file = GGUFFile(path)
    cfg = model_config if model_config is not None else family_config(hf_config(path, file))
    cls = model_class(cfg.architecture)
    model = cls(cfg, max_loras, max_lora_rank, dtype, device)
    keep_blocks = keep_blocks and dtype == torch.float32 and torch.device(device).type == "cpu"
    tensors = _Tensors(file, cfg)
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            if isinstance(module, LoRALinear):
                _load_linear(module, mod_name.rsplit(".", 1)[0], tensors, keep_blocks)
                continue
            if module is model.lm_head:
                continue
            for p_name, param in module.named_parameters(recurse=False):
                name = f"{mod_name}.{p_name}" if mod_name else p_name
                param.copy_(tensors.float_tensor(name, tuple(param.shape)))
        _load_lm_head(model, tensors, keep_blocks)
    unused = sorted(set(file.tensors) - tensors.used - set(_IGNORED))
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise GGUFError(f"{path}: has {len(unused)} tensors {cfg.architecture} does not use: {shown}")
    blocks = sum(isinstance(m, LoRALinear) and m.int8_weight is not None for m in model.modules())
    logger.info("loaded %s (%s, %d layers) from %s; %d packed projections kept in GGUF blocks",
                cfg.architecture, dtype, cfg.num_layers, path, blocks)
    return model.eval()
