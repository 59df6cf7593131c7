"""One adapter version's validated tensors, as read from a PEFT folder (CPU, float32; after
``CausalLM.prepare`` the projections' A and B are in the slots' dtype: bfloat16 under ``EngineConfig.lora_dtype``).

- ``modules[(layer, proj)] = (A [r, in], B [out, r])``: LoRA on a block's projection, B scale-folded
  (alpha/r, or alpha/sqrt(r) with rsLoRA).
- ``magnitudes[(layer, proj)] = m [out]``: DoRA's magnitude for that projection (``use_dora``).
  ``dora_scales`` holds what the model folds from it once per version (``CausalLM.prepare``):
  ``g = m / ||W + B A||`` per output feature, W the base weight, so a step only scales rows.
- ``vocab["embed_tokens" | "lm_head"]``: the adapter's change to a vocabulary-sized module
  (``VocabModule``): rows it replaces or adds (``modules_to_save``, trainable tokens, a resized
  embedding), LoRA on it, and DoRA's magnitude.
- ``score_head``: a sequence-classification head (PEFT ``SEQ_CLS``: ``score`` or ``classifier`` in
  ``modules_to_save``), ``ScoreHead``; None for a generative adapter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

ModuleKey = tuple[int, str]  # (layer_idx, projection name)
Pair = tuple[torch.Tensor, torch.Tensor]
VOCAB_MODULES = ("embed_tokens", "lm_head")
SCORE_HEADS = ("score", "classifier")  # the names HF's *ForSequenceClassification give their head


def _empty() -> Mapping[Any, Any]:
    return MappingProxyType({})


@dataclass(frozen=True, eq=False)
class VocabModule:
    """An adapter's ``embed_tokens`` or ``lm_head`` (both ``[V, hidden]`` matrices in the base model).

    Served as: ``W_a`` = the base matrix with rows ``row_ids`` replaced by ``rows`` (ids >= the base
    vocabulary add rows); embedding ``e = g * (W_a[x] + A^T[x] B^T)``; lm_head
    ``z = g * (h W_a^T + h A^T B^T)``, with g = 1 without DoRA.
    """

    vocab_size: int  # rows this adapter serves (>= the base vocabulary)
    row_ids: torch.Tensor | None = None  # [n] int64, ascending
    rows: torch.Tensor | None = None  # [n, hidden]
    lora: Pair | None = None  # embed: A [r, V_a], B [hidden, r]; lm_head: A [r, hidden], B [V_a, r]; B scaled
    magnitude: torch.Tensor | None = None  # DoRA m [out]: embed [hidden], lm_head [V_a]
    dora_scale: torch.Tensor | None = None  # g [out], folded against the base by ``CausalLM.prepare``

    @property
    def row_bytes(self) -> int:
        return 0 if self.rows is None else self.rows.nbytes

    @property
    def nbytes(self) -> int:
        parts = [self.row_ids, self.magnitude, self.dora_scale, *(self.lora or ())]
        return self.row_bytes + sum(t.nbytes for t in parts if t is not None)


@dataclass(frozen=True, eq=False)
class ScoreHead:
    """A sequence-classification head over the final hidden state ``h [hidden]`` of a prompt's last token
    (after the final norm; HF's ``*ForSequenceClassification`` on an unpadded sequence):
    ``logits = h @ weight^T + bias`` (``[num_labels]``; no bias: ``score`` heads have none)."""

    weight: torch.Tensor  # [num_labels, hidden] float32
    bias: torch.Tensor | None  # [num_labels] float32
    class_labels: tuple[str, ...]  # class names by index (``id2label``; ``LABEL_i`` when none is given)

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [hidden]`` (float32) -> ``[num_labels]`` float32."""
        return torch.nn.functional.linear(hidden, self.weight, self.bias)


@dataclass(frozen=True, eq=False)
class AdapterWeights:
    """One adapter version, validated, on CPU; see the module docstring for the fields."""

    path: str
    config: Any  # adapters.adapter_config.AdapterConfig
    modules: Mapping[ModuleKey, Pair]
    content_hash: str  # sha256 of the normalised config and every served tensor
    max_rank: int
    magnitudes: Mapping[ModuleKey, torch.Tensor] = field(default_factory=_empty)
    dora_scales: Mapping[ModuleKey, torch.Tensor] = field(default_factory=_empty)
    vocab: Mapping[str, VocabModule] = field(default_factory=_empty)
    score_head: ScoreHead | None = None

    @property
    def uses_dora(self) -> bool:
        return bool(self.magnitudes) or any(v.magnitude is not None for v in self.vocab.values())

    @property
    def scalable(self) -> bool:
        """Whether a per-request scale or mix can weight its whole delta: LoRA on block projections only (the
        vocabulary modules, DoRA and stacked experts read a step's first LoRA pass unscaled: ``LoRABatch``; a
        classification head is not scaled)."""
        return (not self.vocab and not self.uses_dora and self.score_head is None
                and all(a.dim() == 2 for a, _ in self.modules.values()))

    @property
    def prepared(self) -> bool:
        """Whether every DoRA magnitude has its folded scale (``CausalLM.prepare`` ran)."""
        return (set(self.dora_scales) == set(self.magnitudes)
                and all((v.magnitude is None) == (v.dora_scale is None) for v in self.vocab.values()))

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary this adapter serves when it resizes it, else None (the base's)."""
        return max((v.vocab_size for v in self.vocab.values()), default=None)

    @property
    def saved_bytes(self) -> int:
        """Bytes of replaced/added vocabulary rows (whole matrices or token rows), counted once per
        storage (a tied pair shares one): what the manager's memory budget counts."""
        seen: dict[int, int] = {}
        for module in self.vocab.values():
            if module.rows is not None:
                seen[module.rows.untyped_storage().data_ptr()] = module.row_bytes
        return sum(seen.values())

    @property
    def nbytes(self) -> int:
        lora = sum(a.nbytes + b.nbytes for a, b in self.modules.values())
        dora = sum(t.nbytes for t in (*self.magnitudes.values(), *self.dora_scales.values()))
        vocab = sum(v.nbytes - v.row_bytes for v in self.vocab.values())
        head = 0 if self.score_head is None else self.score_head.nbytes
        return lora + dora + vocab + self.saved_bytes + head
