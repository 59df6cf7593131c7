"""Batched LoRA delta over a ragged batch of tokens, a list of (token row, slot, scale) entries.

Semantics (for every pass of the plan, and in it every slot group g with slot s and packed rank R_s > 0;
c_i = ``token_scales[order[i]]``, 1 when the pass has no scales):
    y[order[i]] += c_i * (x[order[i]] @ A[s, :R_s]^T) @ B[s, :, :R_s]^T    for i in o_g..o_{g+1}-1
Tokens with slot -1 are untouched (never written; no weight is ever indexed with -1, and slots no
token reads are never read). B already carries the adapter's scale (alpha/r or alpha/sqrt(r)).
Shapes: x [T, in], y [T, out] (changed in place), A [max_loras, R_max, in], B [max_loras, out, R_max],
slot_ranks [max_loras] (R_s; 0 = the slot holds nothing for this layer). Any float dtype, x and y alike;
A and B may be stored narrower (bfloat16 under ``EngineConfig.lora_dtype``): they are upcast to x's dtype
once per memo entry (a copy, so the memo's owner clears it on every slot write, as for views).
Precondition (``LoRALinear`` keeps it): ``A[s, R_s:]`` and ``B[s, :, R_s:]`` are zero.

A packed layer's B is block-diagonal; ``slot_blocks[s]`` may list its blocks ``(out_lo, out_hi,
rank_lo, rank_hi)``, one per projection in output order, covering every output (an untargeted
projection has ``rank_lo == rank_hi``), with B zero outside them, so the expand can skip the zeros.

Three methods, all exact; ``batch.method`` picks one per step from the batch's shape (on CPU one op
dispatch costs as much as a few token rows of LoRA arithmetic, so op counts matter at decode sizes):
- ``segments``: per run of consecutive tokens that read one slot (a prefill sequence), two GEMMs on
  row slices of x and y, no copies: 2 ops per run (1 + one per block when expanded block by block).
- ``grouped``: per slot group, gather its rows, two GEMMs, scatter-add: 4 ops per group (3 + one per
  block, + a concat, when expanded block by block).
- ``padded``: every group at once, two batched GEMMs over a ``[G, M, in]`` grid of gathered rows
  (M = the largest group) and one scatter-add: 5 ops whatever G (+1 to zero pad cells when groups
  differ in size, +2 when the groups' slots are not one contiguous range and their weights must be
  gathered, + one per block and a concat when expanded block by block). Padding: pad cells are
  zeroed after the shrink and add exact zeros to a real row; every group runs at the batch's largest
  rank in this layer, ``max_g R_{s_g}`` (not ``R_max``): a smaller adapter's extra A rows and B
  columns are zeros, so they add exact zeros too.

On CUDA the same op runs as Triton kernels (``loraplex.ops.lora_triton``), on x86 CPUs as one C++ kernel
(``loraplex.ops.lora_sgmv``); ``resolve_lora_kernels`` chooses per device.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence

import torch

from loraplex.config import LORA_KERNELS
from loraplex.ops.lora_batch import GROUPED, LORA_METHODS, PADDED, SEGMENTS, LoRABatch

Blocks = tuple[tuple[int, int, int, int], ...]  # (out_lo, out_hi, rank_lo, rank_hi) per projection
BLOCKWISE_MIN_ROWS = 16  # below this many rows of one slot, one expand over B's zero blocks is cheaper


class LoRACache:
    """A layer's memo for ``add_lora``: weight views (they alias the slot buffers, so slot writes show
    through) and the padded method's rank and blocks for the last batch. The owner must ``clear()``
    it whenever slot ranks or blocks change or the buffers are replaced."""

    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self.views: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self.last_batch: LoRABatch | None = None
        self.last_plan: tuple[int, Blocks] = (0, ())

    def clear(self) -> None:
        self.views.clear()
        self.last_batch = None

    def view(self, key: tuple, make: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """The views stored under ``key``, made by ``make()`` on a miss (the memo is bounded)."""
        found = self.views.get(key)
        if found is None:
            if len(self.views) >= self.max_entries:
                self.views.clear()
            found = self.views[key] = make()
        return found


def resolve_lora_kernels(requested: str, device: torch.device) -> str:
    """``EngineConfig.lora_kernels`` -> "torch", "sgmv" or "triton". "auto": Triton on CUDA when it is
    installed, the C++ sgmv kernel on CPUs where it builds (AVX2; measured faster than the torch ops at
    every decode batch shape, ``benchmarks/lora_layer.py``), torch elsewhere. "sgmv" needs a CPU device
    and the kernel built; "triton" needs Triton and a CUDA device, or Triton's interpreter for CPU tensors
    (``TRITON_INTERPRET=1`` set before Triton is first imported); otherwise a ValueError says which."""
    if requested not in LORA_KERNELS:
        raise ValueError(f"lora_kernels must be one of {LORA_KERNELS}, got {requested!r}")
    installed = importlib.util.find_spec("triton") is not None
    if requested == "auto":
        if device.type == "cuda" and installed:
            return "triton"
        return "sgmv" if device.type == "cpu" and _sgmv_builds() else "torch"
    if requested == "sgmv" and (device.type != "cpu" or not _sgmv_builds()):
        why = f"the device is {device.type}" if device.type != "cpu" else "the kernel did not build here (see the log)"
        raise ValueError(f"lora_kernels='sgmv' runs on CPUs with AVX2 where its C++ kernel builds; {why}")
    if requested == "triton":
        if not installed:
            raise ValueError("lora_kernels='triton' needs the triton package: pip install 'loraplex[gpu]'")
        if device.type != "cuda" and not _triton_interprets():
            raise ValueError(f"lora_kernels='triton' on {device.type} needs Triton's interpreter "
                             "(TRITON_INTERPRET=1 set before triton is imported); use a CUDA device")
    return requested


def _sgmv_builds() -> bool:
    from loraplex.ops.lora_sgmv import kernel  # lazy: lora_sgmv runs the ops of this module as its fallback

    return kernel() is not None


def _triton_interprets() -> bool:
    import triton  # lazy: only asked when Triton kernels are requested off CUDA

    return bool(triton.knobs.runtime.interpret)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot_ranks: Sequence[int],
    batch: LoRABatch,
    *,
    slot_blocks: Sequence[Blocks] | None = None,
    method: str | None = None,
    cache: LoRACache | None = None,
) -> None:
    """``y += LoRA(x)`` per slot group, each group at its own rank; see the module docstring.

    ``method`` forces one of ``LORA_METHODS`` (default: ``batch.method``); ``cache`` memoises views.
    """
    # x: [T, in]; y: [T, out]; lora_a: [max_loras, R_max, in]; lora_b: [max_loras, out, R_max]
    cache = LoRACache() if cache is None else cache
    for part in (batch, *batch.more):
        if part.has_lora:
            _add_pass(y, x, lora_a, lora_b, slot_ranks, part, slot_blocks, part.method if method is None else method,
                      cache)


def _add_pass(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              slot_ranks: Sequence[int], batch: LoRABatch, slot_blocks: Sequence[Blocks] | None, chosen: str,
              cache: LoRACache) -> None:
    """One pass of the plan (at most one entry per row) by the method ``chosen``."""
    if chosen == SEGMENTS:
        for (start, end, slot), scale in zip(batch.runs, batch.run_scales, strict=True):
            if slot_ranks[slot]:
                _add_slot(y[start:end], x[start:end], lora_a, lora_b, slot, slot_ranks, slot_blocks, cache, scale)
    elif chosen == GROUPED:
        scales = batch.entry_scales
        for g, slot in enumerate(batch.group_slots):
            if slot_ranks[slot]:
                lo, hi = batch.group_offsets[g], batch.group_offsets[g + 1]
                rows = batch.order[lo:hi]  # [n_g]
                y.index_add_(0, rows, _slot_delta(x.index_select(0, rows), lora_a, lora_b, slot, slot_ranks,
                                                  slot_blocks, cache, y.shape[1],
                                                  None if scales is None else scales[lo:hi, None]))
    elif chosen == PADDED:
        _add_padded(y, x, lora_a, lora_b, slot_ranks, batch, slot_blocks, cache)
    else:
        raise ValueError(f"unknown LoRA method {chosen!r}; expected one of {LORA_METHODS}")


def _add_slot(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slot: int,
              slot_ranks: Sequence[int], slot_blocks: Sequence[Blocks] | None, cache: LoRACache,
              scale: float = 1.0) -> None:
    """``y += scale * (x @ A_s^T) @ B_s^T`` for rows that all read ``slot``; y [n, out], x [n, in] (views are fine)."""
    blocks, a_t, b_ts = _slot_weights(lora_a, lora_b, slot, slot_ranks, slot_blocks, cache, x.shape[0], y.shape[1],
                                      x.dtype)
    shrunk = x @ a_t  # [n, R_s]
    if scale != 1.0:
        shrunk.mul_(scale)
    for (o_lo, o_hi, r_lo, r_hi), b_t in zip(blocks, b_ts, strict=True):
        if r_hi > r_lo:
            y[:, o_lo:o_hi].addmm_(shrunk[:, r_lo:r_hi], b_t)


def _slot_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slot: int, slot_ranks: Sequence[int],
                slot_blocks: Sequence[Blocks] | None, cache: LoRACache, out: int,
                scales: torch.Tensor | None = None) -> torch.Tensor:
    """``c * (x @ A_s^T) @ B_s^T`` as a new ``[n, out]`` tensor, for rows x [n, in] that all read ``slot``
    (``scales`` c ``[n, 1]``, None: 1)."""
    blocks, a_t, b_ts = _slot_weights(lora_a, lora_b, slot, slot_ranks, slot_blocks, cache, x.shape[0], out, x.dtype)
    shrunk = x @ a_t  # [n, R_s]
    if scales is not None:
        shrunk.mul_(scales.to(shrunk.dtype))
    if len(blocks) == 1:
        return shrunk @ b_ts[0]
    return torch.cat([shrunk[:, r_lo:r_hi] @ b_t for (_, _, r_lo, r_hi), b_t in zip(blocks, b_ts, strict=True)], 1)


def _slot_weights(lora_a: torch.Tensor, lora_b: torch.Tensor, slot: int, slot_ranks: Sequence[int],
                  slot_blocks: Sequence[Blocks] | None, cache: LoRACache, rows: int, out: int,
                  dtype: torch.dtype) -> tuple[Blocks, torch.Tensor, tuple[torch.Tensor, ...]]:
    """One slot's blocks (B's own when ``rows`` make block-by-block pay, else one) and views
    ``A_s^T [in, R_s]``, ``B^T [r_p, out_p]`` per block (copies in ``dtype`` if stored narrower)."""
    rank = slot_ranks[slot]
    blocks = slot_blocks[slot] if slot_blocks is not None else ()
    if len(blocks) < 2 or rows < BLOCKWISE_MIN_ROWS:
        blocks = ((0, out, 0, rank),)
    a_t, *b_ts = cache.view(("slot", slot, blocks), lambda: (
        lora_a[slot, :rank].t().to(dtype),
        *(lora_b[slot, o_lo:o_hi, r_lo:r_hi].t().to(dtype) for o_lo, o_hi, r_lo, r_hi in blocks)))
    return blocks, a_t, tuple(b_ts)


def _add_padded(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                slot_ranks: Sequence[int], batch: LoRABatch, slot_blocks: Sequence[Blocks] | None,
                cache: LoRACache) -> None:
    if cache.last_batch is not batch:
        cache.last_batch, cache.last_plan = batch, _padded_plan(batch.group_slots, slot_ranks, slot_blocks)
    rank, blocks = cache.last_plan
    if rank == 0:
        return
    if not blocks:
        blocks = ((0, y.shape[1], 0, rank),)
    span = batch.slot_span
    if span is not None:  # the groups' slots are one range: views of the buffers, memoised
        a_t, *b_ts = cache.view(("span", span, blocks), lambda: _grid_weights(
            lora_a, lora_b, rank, blocks, lambda t: t[span[0] : span[1]].to(x.dtype)))
    else:  # copies of just the groups' slots, at rank R and block by block
        a_t, *b_ts = _grid_weights(lora_a, lora_b, rank, blocks,
                                   lambda t: t.index_select(0, batch.slots_tensor).to(x.dtype))
    layout = batch.padded
    g, m = len(batch.group_slots), layout.max_group_tokens
    if layout.contiguous is not None:  # x and y through views; the expand accumulates into y in place
        lo, hi = layout.contiguous
        shrunk = torch.bmm(x[lo:hi].reshape(g, m, -1), a_t)  # [G, M, R]
        if layout.scales is not None:
            shrunk.mul_(layout.scales.to(shrunk.dtype))
        out = y[lo:hi].view(g, m, -1)  # [G, M, out]
        for (o_lo, o_hi, r_lo, r_hi), b_t in zip(blocks, b_ts, strict=True):
            out[:, :, o_lo:o_hi].baddbmm_(shrunk[:, :, r_lo:r_hi], b_t)
        return
    grid = x.index_select(0, layout.rows).view(g, m, -1)
    shrunk = torch.bmm(grid, a_t)  # [G, M, R]
    if layout.scales is not None:  # 0 at pad cells
        shrunk.mul_(layout.scales.to(shrunk.dtype))
    elif layout.pad_mask is not None:
        shrunk.masked_fill_(layout.pad_mask, 0.0)
    if len(b_ts) == 1:
        delta = torch.bmm(shrunk, b_ts[0])  # [G, M, out]
    else:
        parts = shrunk.split([r_hi - r_lo for _, _, r_lo, r_hi in blocks], dim=2)
        delta = torch.cat([torch.bmm(p, b_t) for p, b_t in zip(parts, b_ts, strict=True)], dim=2)
    y.index_add_(0, layout.rows, delta.view(-1, y.shape[1]))


def _padded_plan(slots: Sequence[int], slot_ranks: Sequence[int],
                 slot_blocks: Sequence[Blocks] | None) -> tuple[int, Blocks]:
    """The batch's largest rank in this layer, and the B blocks if every slot shares them (else ``()``)."""
    rank = max(slot_ranks[s] for s in slots)
    if slot_blocks is None or len(slot_blocks[slots[0]]) < 2:
        return rank, ()
    first = slot_blocks[slots[0]]
    return rank, (first if all(slot_blocks[s] == first for s in slots) else ())


def _grid_weights(lora_a: torch.Tensor, lora_b: torch.Tensor, rank: int, blocks: Blocks,
                  pick: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``A^T [G, in, R]`` and one ``B^T [G, r_p, out_p]`` per block, ``pick`` choosing the G slots."""
    return (pick(lora_a[:, :rank]).transpose(1, 2),
            *(pick(lora_b[:, o_lo:o_hi, r_lo:r_hi]).transpose(1, 2) for o_lo, o_hi, r_lo, r_hi in blocks))
