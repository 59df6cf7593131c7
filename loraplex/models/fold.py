"""Fold what is constant per adapter version against the base weights, once, when it is loaded.

- DoRA: ``g = m / ||W + B A||`` per output feature, exactly PEFT's ``get_weight_norm`` (W the base
  weight, B carrying the LoRA scale), so a decode step only multiplies each DoRA row by g. For
  ``embed_tokens`` the norm runs over the vocabulary (one g per hidden feature), as PEFT's
  ``DoraEmbeddingLayer`` computes it; W there is the adapter's vocabulary matrix (replaced/added rows).
- Vocabulary rows (saved matrices, trainable tokens, a saved base layer) that equal the base rows are
  dropped: only the rows an adapter really changes or adds are kept (and counted in the budget).
- Storage dtype: every projection's A and B (B scale-folded) are cast to the slots' dtype (bfloat16 under
  ``EngineConfig.lora_dtype``, rounded to nearest even, the rounding a slot write would do), so the host
  tier holds them at the slots' size; DoRA's g is then folded from the rounded A and B, which are the
  ones served.
Runs in the caller's thread (``AdapterManager.load`` / its background re-read), never in a step.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any

import torch

from loraplex.errors import InvalidAdapter


def dora_scale(weight: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor, dim: int,
               what: str) -> torch.Tensor:
    """``m / ||W + delta||`` along ``dim``: 1 for a Linear (W, delta = B A ``[out, in]``, one g per row),
    0 for an embedding (W, delta = A^T B^T ``[V, hidden]``, one g per hidden feature)."""
    norm = torch.linalg.norm(weight.float() + delta, dim=dim)
    if not bool((norm > 0).all()) or not bool(torch.isfinite(norm).all()):
        raise InvalidAdapter(f"{what}: DoRA norm ||W + BA|| is zero or not finite for some feature")
    return magnitude / norm


def prepare_adapter(model, weights: Any) -> Any:
    """``weights`` with ``dora_scales`` filled and every vocabulary module folded; see the module docstring."""
    source = getattr(weights, "path", "adapter")
    weights = _in_slot_dtype(model, weights)
    scales = {}
    for layer_idx, linears in enumerate(model.adapted_layers()):
        for linear in linears:
            names = [n for n in linear.names if (layer_idx, n) in weights.magnitudes]
            if not names:
                continue
            dense = linear.dense_weight()  # [sum(out), in]: one plain copy at a time (the base may be packed)
            for proj in names:
                i = linear.names.index(proj)
                w = dense[linear.out_offsets[i] : linear.out_offsets[i + 1]]  # [out_p, in]
                a, b = weights.modules[(layer_idx, proj)]
                scales[(layer_idx, proj)] = dora_scale(w, b.float() @ a.float(), weights.magnitudes[(layer_idx, proj)],
                                                       1, f"{source}: layer {layer_idx} {proj}")
    bases: dict[str, torch.Tensor] = {}  # built on first use: an int8 lm_head is dequantized to read it
    folded_rows: dict[tuple[int, str], tuple[torch.Tensor | None, torch.Tensor | None]] = {}
    vocab = {}
    for name, module in weights.vocab.items():
        source_matrix = "embed_tokens" if model.config.tie_word_embeddings else name
        if source_matrix not in bases:
            embed = source_matrix == "embed_tokens"
            bases[source_matrix] = model.embed_tokens.weight if embed else model.lm_head_weight
        base = bases[source_matrix]
        key = (id(module.rows), source_matrix)  # a tied pair folds once and stays shared
        if key not in folded_rows:
            folded_rows[key] = _changed_rows(module.row_ids, module.rows, base)
        row_ids, rows = folded_rows[key]
        scale = None
        if module.magnitude is not None:
            matrix = _served_matrix(base, module.vocab_size, row_ids, rows)  # [V_a, hidden]
            a, b = module.lora
            delta, dim = (a.t() @ b.t(), 0) if name == "embed_tokens" else (b @ a, 1)  # [V_a, hidden]
            scale = dora_scale(matrix, delta, module.magnitude, dim, f"{source}: {name}")
        vocab[name] = replace(module, row_ids=row_ids, rows=rows, dora_scale=scale)
    return replace(weights, dora_scales=MappingProxyType(scales), vocab=MappingProxyType(vocab))


def _in_slot_dtype(model, weights: Any) -> Any:
    """``weights`` with every projection's A and B in the dtype of the model's LoRA slots."""
    dtype = model.adapted_layers()[0][0].lora_a.dtype
    if all(a.dtype is dtype and b.dtype is dtype for a, b in weights.modules.values()):
        return weights
    return replace(weights, modules=MappingProxyType({key: (a.to(dtype), b.to(dtype))
                                                      for key, (a, b) in weights.modules.items()}))


def _changed_rows(row_ids: torch.Tensor | None, rows: torch.Tensor | None,
                  base: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows (and ids) that differ from the base matrix or lie beyond it."""
    if rows is None:
        return None, None
    base = base.detach()
    v = base.shape[0]
    if row_ids.shape[0] >= v and torch.equal(row_ids[:v], torch.arange(v)):  # a whole (maybe resized) matrix
        changed = torch.ones(row_ids.shape[0], dtype=torch.bool)
        changed[:v] = (rows[:v] != base).any(dim=1)
    else:
        inside = row_ids < v
        changed = ~inside
        changed[inside] = (rows[inside] != base.index_select(0, row_ids[inside])).any(dim=1)
    if not bool(changed.any()):
        return None, None
    if bool(changed.all()):
        return row_ids, rows
    return row_ids[changed], rows[changed].contiguous()


def _served_matrix(base: torch.Tensor, vocab_size: int, row_ids: torch.Tensor | None,
                   rows: torch.Tensor | None) -> torch.Tensor:
    """The adapter's ``[V_a, hidden]`` matrix: the base's rows, replaced and extended by its own."""
    matrix = torch.empty(vocab_size, base.shape[1])
    matrix[: base.shape[0]] = base.detach().float()
    if rows is not None:
        matrix.index_copy_(0, row_ids, rows)
    return matrix
