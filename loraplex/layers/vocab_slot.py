"""One slot's adapter parts for a vocabulary-sized module (``embed_tokens`` or ``lm_head``).

An adapter may replace or add rows of the ``[V, hidden]`` matrix (W_a: the base matrix with ``rows``
at ``row_ids``; ids >= V are added tokens), put LoRA on it and DoRA-scale its output:

    embedding:  e = (W_a[x] + A^T[x] B^T) * g          A [r, V_a], B [hidden, r]  -> e [hidden]
    lm_head:    z = (h W_a^T + (h A^T) B^T) * g        A [r, hidden], B [V_a, r]  -> z [V_a]

with B scale-folded and g = 1 when the adapter is not DoRA. The slot references the adapter
version's tensors (moved to the device; on CPU no copy) and never changes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class VocabSlot:
    vocab_size: int  # V_a >= V
    row_ids: torch.Tensor | None  # [n] int64 ascending; None with ``full``
    rows: torch.Tensor | None  # [n, hidden], or [V_a, hidden] with ``full``
    row_of: torch.Tensor | None  # [V_a] int64: index into ``rows`` per token id, -1 = the base row
    full: bool  # ``rows`` is the whole matrix (every id replaced)
    lora_a: torch.Tensor | None  # [r, in]
    lora_b: torch.Tensor | None  # [out, r]
    scale: torch.Tensor | None  # DoRA g [out]

    @classmethod
    def build(cls, vocab_size: int, row_ids: torch.Tensor | None, rows: torch.Tensor | None,
              lora: tuple[torch.Tensor, torch.Tensor] | None, scale: torch.Tensor | None,
              dtype: torch.dtype, device: torch.device | str) -> VocabSlot:
        """The slot's view of one adapter version's module, on ``device`` in ``dtype``."""
        def put(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype)

        full = rows is not None and rows.shape[0] == vocab_size
        row_of = None
        if rows is not None and not full:
            row_of = torch.full((vocab_size,), -1, dtype=torch.int64)
            row_of[row_ids] = torch.arange(row_ids.shape[0])
            row_of, row_ids = row_of.to(device), row_ids.to(device)
        return cls(vocab_size, None if full else row_ids, put(rows), row_of, full,
                   *(put(t) for t in lora or (None, None)), put(scale))

    def embed(self, ids: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``ids [n]`` for this slot, ``base [n, hidden]`` holding the base rows (ids >= V: any)."""
        e = base
        if self.full:
            e = self.rows.index_select(0, ids)
        elif self.rows is not None:
            pos = self.row_of.index_select(0, ids)  # [n]
            e = torch.where((pos >= 0).unsqueeze(1), self.rows.index_select(0, pos.clamp(min=0)), base)
        if self.lora_a is not None:
            e = e + self.lora_a.t().index_select(0, ids) @ self.lora_b.t()  # [n, r] @ [r, hidden]
        return e if self.scale is None else e * self.scale

    def project(self, hidden: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, V_a]`` of ``hidden [n, hidden]`` for this slot; ``base [n, V]`` = ``hidden W^T``."""
        if self.full:
            z = hidden @ self.rows.t()
        else:
            extra = self.vocab_size - base.shape[1]
            z = base if extra == 0 else torch.cat([base, base.new_empty(base.shape[0], extra)], 1)
            if self.rows is not None:  # every added id (>= V) has a row: checked when the adapter was read
                z.index_copy_(1, self.row_ids, hidden @ self.rows.t())
        if self.lora_a is not None:
            z = z.addmm(hidden @ self.lora_a.t(), self.lora_b.t())
        return z if self.scale is None else z * self.scale
