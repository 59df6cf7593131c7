"""Linear layers with preallocated, stacked LoRA slot buffers.

One ``LoRALinear`` serves one or more projections that share an input (q/k/v, gate/up): the base
weights are concatenated along the output dimension, and each slot packs its adapter's A halves
row-wise and its B halves block-diagonally, at the adapter's real ranks:

    lora_a[s] = [A_q; A_k; A_v; 0]                       # [R_max, in],  R_s = r_q + r_k + r_v
    lora_b[s] = blockdiag(B_q, B_k, B_v) padded with 0   # [sum(out), R_max]

so that ``x @ lora_a[s, :R_s]^T @ lora_b[s, :, :R_s]^T`` equals the concatenated per-projection
deltas. A projection the adapter does not target contributes rank 0.

The LoRA delta runs on torch ops (``loraplex.ops.lora``); after ``use_lora_kernels(model, "sgmv", ...)``
on the C++ CPU kernel (``loraplex.ops.lora_sgmv``); after ``use_lora_kernels(model, "triton", ...)`` gave
the layers shared ``LoRAStepBuffers``, on the Triton kernels (``loraplex.ops.lora_triton``). The kernels
read the slot ranks and blocks from device tensors kept in step with every slot write.

The slots hold A and B in the model's dtype unless ``use_lora_dtype(model, torch.bfloat16)`` narrowed them
(``EngineConfig.lora_dtype``): a slot write then rounds each weight to bfloat16 (nearest even; B with its
scale already folded in), and every kernel widens them back to the activations' dtype as it reads them.

DoRA: a slot may carry a per-output-feature scale ``g`` folded once per adapter version
(``g = m / ||W + B A||``); its rows then get ``y = (x W^T + x A^T B^T) * g + b``, stored as
``dora_scale[s + 1]`` (row 0 is the base model's: all ones) and, with a bias, ``dora_offset[s + 1] =
b * (1 - g)`` (-0.0 where g == 1). Rows of other slots multiply by exactly 1.0 and add exactly -0.0, so
they stay bit for bit what they were.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from loraplex.ops.dense import dense_linear, pack_weight, unpack_weight
from loraplex.ops.int8 import Int8Weight
from loraplex.ops.lora import Blocks, LoRACache, add_lora
from loraplex.ops.lora_batch import SEGMENTS, LoRABatch
from loraplex.ops.lora_sgmv import add_lora_sgmv
from loraplex.ops.lora_step_buffers import LoRAStepBuffers
from loraplex.ops.quantized_weight import QuantizedWeight


class LoRALinear(nn.Module):
    """``y = x W^T + b + LoRA_slot(x)`` for packed projections; slots are written between steps only
    (a ``LoRABatch`` derived before a slot write must not be used after it)."""

    def __init__(
        self,
        in_features: int,
        out_features: tuple[int, ...],
        names: tuple[str, ...],
        max_loras: int,
        max_lora_rank: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if len(out_features) != len(names):
            raise ValueError("one output size per projection name")
        self.in_features = in_features
        self.out_features = tuple(out_features)
        self.names = tuple(names)
        self.out_offsets = [sum(out_features[:i]) for i in range(len(out_features) + 1)]
        total_out = self.out_offsets[-1]
        rank_capacity = len(names) * max_lora_rank
        self.max_lora_rank = max_lora_rank
        self.weight = nn.Parameter(torch.empty(total_out, in_features, dtype=dtype, device=device),
                                   requires_grad=False)  # [sum(out), in]
        self.bias = (nn.Parameter(torch.zeros(total_out, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)  # [sum(out)]
        self.register_buffer("lora_a", torch.zeros(max_loras, rank_capacity, in_features, dtype=dtype,
                                                   device=device), persistent=False)  # [max_loras, R_max, in]
        # Stored rank-major ([max_loras, R_max, out] in memory) and exposed as its transpose: the expand
        # reads B^T blocks [r_p, out_p] whose rows are long contiguous runs (measured ~1.7x faster at
        # decode than B blocks [out_p, r_p] strided by R_max).
        self.register_buffer("lora_b", torch.zeros(max_loras, rank_capacity, total_out, dtype=dtype,
                                                   device=device).transpose(1, 2),
                             persistent=False)  # [max_loras, out, R_max]
        self.slot_ranks = [0] * max_loras  # packed rank R_s per slot; 0 = slot empty for this layer
        self.slot_blocks: list[Blocks] = [()] * max_loras  # per slot: B's (out, rank) block per projection
        # the same two tables on the device, rewritten in place by every slot write (read by the kernels)
        self.register_buffer("slot_ranks_dev", torch.zeros(max_loras, dtype=torch.int32, device=device),
                             persistent=False)  # [max_loras]
        self.register_buffer("slot_blocks_dev", torch.zeros(max_loras, len(names), 4, dtype=torch.int32,
                                                            device=device), persistent=False)  # [max_loras, P, 4]
        self.lora_kernels = "torch"  # what computes the delta: "torch", "sgmv" or "triton" (use_lora_kernels)
        self.step_buffers: LoRAStepBuffers | None = None  # the Triton kernels' index buffers (set for "triton")
        self.lora_cache = LoRACache()  # weight views and per-batch plan; cleared on every slot write
        self.register_buffer("dora_scale", torch.ones(max_loras + 1, total_out, dtype=dtype, device=device),
                             persistent=False)  # [max_loras + 1, sum(out)], row s + 1 = slot s
        self.register_buffer("dora_offset", torch.full((max_loras + 1, total_out), -0.0, dtype=dtype, device=device)
                             if bias else None, persistent=False)  # [max_loras + 1, sum(out)]
        self.dora_slots: set[int] = set()  # slots whose adapter is DoRA in this layer
        # oneDNN-packed copy of ``weight`` once ``pack_dense()`` ran, or its int8 form once ``quantize_int8()``
        # ran (or GGUF blocks after ``use_quantized_weight``); ``weight`` is then None
        self.packed_weight: torch.Tensor | None = None
        self.int8_weight: QuantizedWeight | None = None

    def use_quantized_weight(self, weight: QuantizedWeight) -> None:
        """Serve the base weight from ``weight`` (``[sum(out), in]``, e.g. GGUF blocks) and drop the float copy."""
        self.int8_weight = weight
        self.weight, self.packed_weight = None, None

    def quantize_int8(self) -> None:
        """Replace the base weight by its weight-only int8 form (``loraplex.ops.int8``); LoRA slots stay
        float. Call after the weights are loaded and before ``pack_dense`` (which then leaves it alone)."""
        if self.int8_weight is None:
            self.int8_weight = Int8Weight.from_float(self.dense_weight())
            self.weight, self.packed_weight = None, None

    def pack_dense(self) -> None:
        """Reorder the base weight once for the CPU GEMM library and drop the plain copy (a no-op where
        ``ops.dense`` does not pack, or when already packed). Call after the weights are loaded."""
        if self.packed_weight is None and self.weight is not None and self.int8_weight is None:
            self.packed_weight = pack_weight(self.weight)
            if self.packed_weight is not None:
                self.weight = None

    def dense_weight(self) -> torch.Tensor:
        """The base weight ``[sum(out), in]``, plain (a copy if packed; dequantized if int8)."""
        if self.int8_weight is not None:
            return self.int8_weight.dense(self.dora_scale.dtype)
        return unpack_weight(self.packed_weight) if self.weight is None else self.weight

    def set_slot(self, slot: int, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                 dora_scales: Mapping[str, torch.Tensor] | None = None) -> None:
        """Write one adapter into ``slot``. ``pairs[name] = (A [r, in], B [out, r])``, B scale-folded;
        ``dora_scales[name] = g [out]`` for DoRA projections.

        A slot's nonzero entries are always A's rows ``[0, R_s)`` and B's blocks ``slot_blocks[s]``, so
        only the previous adapter's entries that this one does not overwrite are zeroed: a write touches
        about the adapter's own bytes, not the slot's whole capacity (it runs in the step loop)."""
        rank_offset = 0
        blocks = []
        for i, name in enumerate(self.names):
            r = pairs[name][0].shape[0] if name in pairs else 0
            blocks.append((self.out_offsets[i], self.out_offsets[i + 1], rank_offset, rank_offset + r))
            rank_offset += r
        self.lora_cache.clear()
        if self.slot_ranks[slot] > rank_offset:
            self.lora_a[slot, rank_offset : self.slot_ranks[slot]].zero_()
        for lo, hi, r_lo, r_hi in self.slot_blocks[slot]:
            if (lo, hi, r_lo, r_hi) not in blocks:
                self.lora_b[slot, lo:hi, r_lo:r_hi].zero_()
        for name, (lo, hi, r_lo, r_hi) in zip(self.names, blocks, strict=True):
            if name in pairs:
                a, b = pairs[name]
                self.lora_a[slot, r_lo:r_hi].copy_(a)
                self.lora_b[slot, lo:hi, r_lo:r_hi].copy_(b)
        self.slot_ranks[slot] = rank_offset
        self.slot_blocks[slot] = tuple(blocks)
        self.slot_ranks_dev[slot] = rank_offset
        self.slot_blocks_dev[slot] = torch.tensor(blocks, dtype=torch.int32)
        self._set_dora(slot, dora_scales or {})

    def _set_dora(self, slot: int, dora_scales: Mapping[str, torch.Tensor]) -> None:
        """Slot ``slot``'s DoRA rows: g where given, 1 elsewhere (and an empty ``dora_scales``: not DoRA)."""
        was_dora = slot in self.dora_slots
        self.dora_slots.discard(slot)
        if not dora_scales:
            if was_dora:
                self.dora_scale[slot + 1].fill_(1.0)
                if self.dora_offset is not None:
                    self.dora_offset[slot + 1].fill_(-0.0)
            return
        scale = self.dora_scale[slot + 1]  # [sum(out)]
        scale.fill_(1.0)
        for i, name in enumerate(self.names):
            if name in dora_scales:
                scale[self.out_offsets[i] : self.out_offsets[i + 1]].copy_(dora_scales[name])
        if self.dora_offset is not None:
            self.dora_offset[slot + 1] = torch.where(scale == 1.0, -0.0, self.bias * (1.0 - scale))
        self.dora_slots.add(slot)

    def clear_slot(self, slot: int) -> None:
        self.lora_cache.clear()
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.slot_ranks[slot] = 0
        self.slot_blocks[slot] = ()
        self.slot_ranks_dev[slot] = 0
        self.slot_blocks_dev[slot] = 0
        self.dora_scale[slot + 1].fill_(1.0)
        if self.dora_offset is not None:
            self.dora_offset[slot + 1].fill_(-0.0)
        self.dora_slots.discard(slot)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        # x: [T, in] -> [T, sum(out)]
        if self.int8_weight is not None:
            y = self.int8_weight.linear(x, self.bias)
        else:
            y = dense_linear(x, self.weight, self.packed_weight, self.bias)
        if lora is None or not lora.has_lora:
            return y
        if self.lora_kernels == "sgmv":
            add_lora_sgmv(y, x, self.lora_a, self.lora_b, self.slot_ranks, self.slot_ranks_dev, self.slot_blocks_dev,
                          lora, slot_blocks=self.slot_blocks, cache=self.lora_cache)
        elif self.step_buffers is None:
            add_lora(y, x, self.lora_a, self.lora_b, self.slot_ranks, lora, slot_blocks=self.slot_blocks,
                     cache=self.lora_cache)
        else:
            from loraplex.ops.lora_triton import add_lora_triton  # lazy: importing Triton picks JIT or interpreter

            for part in (lora, *lora.more):  # a plan of several passes refills the buffers per pass
                if part.has_lora:
                    self.step_buffers.prepare(part)  # refilled once per step (the first layer); version checked
                    add_lora_triton(y, x, self.lora_a, self.lora_b, self.slot_ranks_dev, self.slot_blocks_dev,
                                    self.step_buffers, block_width=max(self.out_features))
        if self.dora_slots and not self.dora_slots.isdisjoint(lora.group_slots):
            self._rescale_dora_rows(y, lora)
        return y

    def _rescale_dora_rows(self, y: torch.Tensor, lora: LoRABatch) -> None:
        """``y[t] = y[t] * dora_scale[slot_t + 1] (+ dora_offset[slot_t + 1])``, in place. Runs of one slot
        (prefill) scale their rows alone; otherwise one gather of per-token scales covers every row."""
        if lora.method == SEGMENTS:
            for start, end, slot in lora.runs:
                if slot in self.dora_slots:
                    y[start:end].mul_(self.dora_scale[slot + 1])
                    if self.dora_offset is not None:
                        y[start:end].add_(self.dora_offset[slot + 1])
            return
        rows = lora.slot_rows  # [T]
        y.mul_(self.dora_scale.index_select(0, rows))
        if self.dora_offset is not None:
            y.add_(self.dora_offset.index_select(0, rows))

    def _apply(self, fn, recurse: bool = True):  # .to(), .float(), ...: the buffers are replaced
        self.lora_cache.clear()
        return super()._apply(fn, recurse)


def use_lora_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every ``LoRALinear``'s A and B slots of ``model`` in ``dtype`` (its other buffers keep theirs).
    Call before any adapter is written: the slots are reallocated empty."""
    for linear in (m for m in model.modules() if isinstance(m, LoRALinear)):
        if linear.lora_a.dtype is dtype:
            continue
        if any(linear.slot_ranks):
            raise RuntimeError("use_lora_dtype: a slot already holds an adapter; set the dtype before writing any")
        slots, rank_capacity, in_features = linear.lora_a.shape
        device = linear.lora_a.device
        linear.lora_a = torch.zeros(slots, rank_capacity, in_features, dtype=dtype, device=device)
        linear.lora_b = torch.zeros(slots, rank_capacity, linear.out_offsets[-1], dtype=dtype,
                                    device=device).transpose(1, 2)  # rank-major, as allocated in __init__
        linear.lora_cache.clear()


def use_lora_kernels(model: nn.Module, kernels: str, max_tokens: int) -> None:
    """Make every ``LoRALinear`` of ``model`` compute its delta with ``kernels`` ("torch", "sgmv" or "triton",
    as ``loraplex.ops.lora.resolve_lora_kernels`` returns them). The Triton layers share one
    ``LoRAStepBuffers`` sized for ``max_tokens`` tokens per step, on the layers' device."""
    if kernels not in ("torch", "sgmv", "triton"):
        raise ValueError(f"kernels must be 'torch', 'sgmv' or 'triton', got {kernels!r}")
    linears = [m for m in model.modules() if isinstance(m, LoRALinear)]
    buffers = None
    if kernels == "triton" and linears:
        buffers = LoRAStepBuffers(max_tokens, linears[0].lora_a.shape[0], linears[0].lora_a.device)
    for linear in linears:
        linear.lora_kernels = kernels
        linear.step_buffers = buffers
