"""What every model family shares: embeddings, the final norm and lm_head, slot writes, dense packing.

A family is one file in ``loraplex/models/families/`` plus one line in ``registry.py``. Its model class derives
from ``CausalLM`` and declares itself:

- ``config_class``: its ``ModelConfig`` (a frozen subclass when it has fields of its own), which
  normalises ``config.json`` once and lists the adaptable projections (``ModelConfig.projections``:
  the PEFT target names, where they sit and their shapes);
- ``packed_projections``: how those projections are packed into each block's ``LoRALinear`` layers
  (e.g. ``qkv_proj`` holds q, k and v); every block's ``adapted()`` returns them in that order;
- ``make_layer(index)``: one decoder block, called as ``block(hidden, rope, attn, kv_cache, lora)``
  where ``rope`` is what ``rope_tables`` returns (``(cos, sin)`` unless the family overrides it,
  as Gemma 3 does for its two rope bases);
- where it differs from Llama: ``norm_offset`` (1.0 for ``(1 + w)`` RMSNorms), ``scale_embeddings``
  (embeddings times ``sqrt(hidden)``).

Module names follow HF's (``embed_tokens``, ``layers.N.self_attn``, ``layers.N.mlp``, ``norm``,
``lm_head``) so the loader maps checkpoint tensors by name.

The embedding and the logits belong to this class for every family: ``embed(input_ids, lora)`` and
``logits(hidden, logits_rows, lora)`` apply each slot's ``embed_tokens`` / ``lm_head`` adapter parts
(LoRA, DoRA, replaced or added vocabulary rows), so a family never handles them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from loraplex.config import ModelConfig
from loraplex.layers.attention import AttentionMetadata
from loraplex.layers.embedding import VocabEmbedding
from loraplex.layers.lm_head import LMHeadSlots
from loraplex.layers.lora_linear import LoRALinear
from loraplex.layers.norms import RMSNorm
from loraplex.layers.rotary import RotaryEmbedding
from loraplex.models.fold import prepare_adapter
from loraplex.models.slot_writer import AdapterModules, write_adapter_slot
from loraplex.ops.dense import dense_linear, pack_weight
from loraplex.ops.int8 import Int8Weight
from loraplex.ops.lora_batch import LoRABatch
from loraplex.ops.quantized_weight import QuantizedWeight


class CausalLM(nn.Module):
    """A decoder-only LM over a flat ragged batch with LoRA slots; parameters are allocated uninitialised
    and filled by ``loraplex.models.loader.load_model``."""

    config_class: ClassVar[type[ModelConfig]] = ModelConfig
    packed_projections: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = ()
    norm_offset: ClassVar[float] = 0.0  # RMSNorm computes (norm_offset + weight) * normalised x
    scale_embeddings: ClassVar[bool] = False  # embeddings multiplied by sqrt(hidden_size)

    def __init__(self, model_config: ModelConfig, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        cfg = model_config
        self.config = cfg
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.dtype, self.device = dtype, device
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, max_loras, dtype, device)
        # HF Gemma keeps the scale as a tensor of the weights' dtype: same rounding here
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5, dtype=dtype, device=device)
                             if self.scale_embeddings else None, persistent=False)
        self.rotary = RotaryEmbedding(cfg, device)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(cfg.num_layers))
        self.norm = self.rms_norm(cfg.hidden_size)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device))
        if self.lm_head is not None:
            self.lm_head.weight.requires_grad_(False)
        # oneDNN-packed lm_head once ``pack_dense()`` ran, or its int8 form once ``quantize_int8()`` ran; the
        # plain one stays (tied: the embedding reads it); GGUF models set their lm_head's blocks here
        self.lm_head_packed: torch.Tensor | None = None
        self.lm_head_int8: QuantizedWeight | None = None
        self.lm_head_slots = LMHeadSlots(max_loras)  # per-slot lm_head adapter parts

    def make_layer(self, index: int) -> nn.Module:
        """Decoder block ``index``; it must provide ``adapted() -> tuple[LoRALinear, ...]``."""
        raise NotImplementedError

    def rms_norm(self, size: int) -> RMSNorm:
        """An RMSNorm of this family's kind over ``size`` features (the hidden size, or head_dim for q/k)."""
        return RMSNorm(size, self.config.rms_norm_eps, self.dtype, self.device, self.norm_offset)

    def embed(self, input_ids: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """``input_ids [T]`` -> ``[T, hidden]``, each slot's embed_tokens part included (before the scale,
        as PEFT scales LoRA contributions with the embedding)."""
        hidden = self.embed_tokens(input_ids, lora)
        return hidden if self.embed_scale is None else hidden * self.embed_scale

    def rope_tables(self, positions: torch.Tensor, seq_lens: torch.Tensor, dtype: torch.dtype) -> Any:
        """What every block's ``rope`` argument gets this step: ``(cos, sin)``, each ``[T, 1, d]``."""
        return self.rotary.cos_sin(positions, seq_lens, dtype)

    def lora_linear(self, packed_name: str, in_features: int, bias: bool = False) -> LoRALinear:
        """The ``LoRALinear`` for one entry of ``packed_projections``, sized from ``config.projections()``."""
        names = dict(self.packed_projections)[packed_name]
        shapes = self.config.projections()
        return LoRALinear(in_features, tuple(shapes[n].out_features for n in names), names, self.max_loras,
                          self.max_lora_rank, bias=bias, dtype=self.dtype, device=self.device)

    def adapted_layers(self) -> list[tuple[LoRALinear, ...]]:
        """Per block, its packed LoRA layers in ``packed_projections`` order."""
        return [layer.adapted() for layer in self.layers]

    def pack_dense(self) -> None:
        """Pack every base matmul's weight for the CPU GEMM library (``loraplex.ops.dense``); idempotent.
        Weights already in int8 stay as they are."""
        for linears in self.adapted_layers():
            for linear in linears:
                linear.pack_dense()
        if self.lm_head_packed is None and self.lm_head_int8 is None:
            self.lm_head_packed = pack_weight(self.lm_head_weight)

    def quantize_int8(self) -> None:
        """Every base projection and the lm_head to weight-only int8 (``loraplex.ops.int8``); idempotent.
        LoRA slots, norms and (untied) embeddings stay float. With tied embeddings the embedding table is
        replaced by the dequantized lm_head, so both read the same weights, as in the float model."""
        for linears in self.adapted_layers():
            for linear in linears:
                linear.quantize_int8()
        if self.lm_head_int8 is None:
            self.lm_head_int8 = Int8Weight.from_float(self.lm_head_weight)
            self.lm_head_packed = None
            if self.lm_head is None:
                self.embed_tokens.weight.copy_(self.lm_head_int8.dense(self.dtype))
            else:
                self.lm_head = None  # the int8 form replaces it

    @property
    def served_vocab_size(self) -> int:
        """The largest token id + 1 any slot serves (adapters that add tokens widen the base vocabulary)."""
        return max([self.config.vocab_size, *(s.vocab_size for s in self.embed_tokens.slots if s is not None)])

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[vocab, hidden]``: the embedding when tied, a dequantized copy when int8."""
        if self.lm_head_int8 is not None:
            return self.lm_head_int8.dense(self.dtype)
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor, logits_rows: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """Final norm and lm_head (with each slot's lm_head adapter parts) of rows ``logits_rows [S]`` of
        ``hidden [T, hidden]`` -> float32 ``[S, vocab]`` (wider when a row's adapter adds tokens)."""
        last = self.norm(hidden.index_select(0, logits_rows))  # [S, hidden]
        if self.lm_head_int8 is not None:
            base = self.lm_head_int8.linear(last)  # [S, V]
        else:
            base = dense_linear(last, self.lm_head_weight, self.lm_head_packed)  # [S, V]
        return self.lm_head_slots.apply(base, last, logits_rows, lora).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: Sequence[torch.Tensor], lora: LoRABatch | None,
                logits_rows: torch.Tensor) -> torch.Tensor:
        """Run a flat ragged batch; return float32 logits ``[S, vocab']`` of the rows ``logits_rows [S]``.

        ``input_ids [T]`` and ``positions [T]`` (int64) list every entry's tokens back to back; block i
        writes its new K/V into ``kv_caches[i]`` at ``attn.write_rows``; ``lora`` (token order = flat
        order) is passed to every adapted projection.
        """
        hidden = self.embed(input_ids, lora)  # [T, hidden]
        rope = self.rope_tables(positions, attn.seq_lens, hidden.dtype)
        return self.logits(self.run_layers(hidden, rope, attn, kv_caches, lora), logits_rows, lora)

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                       kv_caches: Sequence[torch.Tensor], lora: LoRABatch | None, logits_rows: torch.Tensor,
                       hidden_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s logits ``[S, vocab']`` of ``logits_rows [S]`` (``[0, vocab']`` when S is 0), and the
        float32 final hidden states of ``hidden_rows [H]``: ``hidden_states``' ``[H, hidden]``."""
        hidden = self.embed(input_ids, lora)  # [T, hidden]
        rope = self.rope_tables(positions, attn.seq_lens, hidden.dtype)
        hidden = self.run_layers(hidden, rope, attn, kv_caches, lora)
        if logits_rows.numel():
            logits = self.logits(hidden, logits_rows, lora)
        else:
            logits = torch.empty((0, self.served_vocab_size), dtype=torch.float32, device=hidden.device)
        return logits, self.hidden_states(hidden, hidden_rows)

    def hidden_states(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The final norm of rows ``rows [H]`` of the last block's output ``hidden [T, hidden]`` -> float32
        ``[H, hidden]`` (HF's ``last_hidden_state``: what pooling reads)."""
        return self.norm(hidden.index_select(0, rows)).float()

    def run_layers(self, hidden: torch.Tensor, rope: Any, attn: AttentionMetadata, kv_caches: Sequence[torch.Tensor],
                   lora: LoRABatch | None) -> torch.Tensor:
        """Every block in order on ``hidden [T, hidden]``; a family may fuse across blocks (Llama does)."""
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, rope, attn, kv_cache, lora)
        return hidden

    def prepare(self, weights: AdapterModules) -> AdapterModules:
        """Fold what is constant per adapter version against the base weights (DoRA scales, vocabulary
        rows that equal the base's dropped), once, off the step loop; ``set_slot`` then only copies."""
        return prepare_adapter(self, weights)

    def set_slot(self, slot: int, weights: AdapterModules) -> None:
        """Write an adapter (``.modules[(layer, proj)] = (A, B)``, DoRA scales, ``embed_tokens`` / ``lm_head``
        parts) into ``slot`` of every adapted layer; validates everything before writing anything."""
        write_adapter_slot(self, slot, weights)

    def clear_slot(self, slot: int) -> None:
        """Empty ``slot`` in every adapted layer (its tokens would then get exactly the base model)."""
        if not 0 <= slot < self.max_loras:
            raise IndexError(f"slot {slot} out of range [0, {self.max_loras})")
        for linears in self.adapted_layers():
            for linear in linears:
                linear.clear_slot(slot)
        self.embed_tokens.clear_slot(slot)
        self.lm_head_slots.clear_slot(slot)
