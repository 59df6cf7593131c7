"""Triton kernels for the batched LoRA delta: shrink and expand per slot group, each slot at its own rank.

Semantics (the same op as ``loraplex.ops.lora.add_lora``): for every slot group g with slot s and
packed rank R_s > 0, and every block p of that slot ``(o_lo, o_hi, r_lo, r_hi)``:
    shrunk[i, :R_s]  = x[rows[i]] @ A[s, :R_s]^T                         (shrink, fp32)
    y[rows[i], o_lo:o_hi] += scales[i] * shrunk[i, r_lo:r_hi] @ B[s, o_lo:o_hi, r_lo:r_hi]^T   (expand)
for i in ``group_starts[g] <= i < group_starts[g+1]``. Rows with slot -1 are in no group and are
never loaded or stored (bit for bit untouched); no slot outside ``group_slots`` is read.
Shapes: x [T, in], y [T, out] (changed in place; any strides), A [max_loras, R_max, in],
B [max_loras, out, R_max] (any strides: loraplex stores B rank-major), slot_ranks [max_loras] int32,
slot_blocks [max_loras, P, 4] int32 (one block per packed projection: q/k/v, gate/up; B is zero
outside them, so the expand computes only the blocks). Index buffers: ``LoRAStepBuffers``.
x and y share one float dtype, A and B one of their own (bfloat16 weights under float32 activations:
``EngineConfig.lora_dtype``); products accumulate in float32 (inputs are upcast before ``tl.dot``,
which also keeps Triton's interpreter exact: it multiplies bfloat16 tiles as raw 16-bit integers).

Each rank is computed at its own size: rank tiles past R_s exit at once, the last one is masked.
The grid is either tight (the step's groups and largest group, for eager launches) or the buffers'
whole capacity (``fixed_grid``: the same grid every step, as a captured CUDA graph replays it; programs
of an emptied group or past a group's end exit at once). No pointer tables, no autotuning: block sizes
come from the shapes, so the kernels also run under ``TRITON_INTERPRET=1`` on CPU tensors.

Importing this module imports Triton, which decides then, from ``TRITON_INTERPRET``, whether kernels
compile for a GPU or run in the interpreter: import it lazily (``LoRALinear`` does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.lora_step_buffers import LoRAStepBuffers

BLOCK_M = 16  # token rows per program (tl.dot needs >= 16)
BLOCK_R = 16  # rank columns per shrink program / per expand step


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, rows_ptr, group_slots_ptr, group_starts_ptr, ranks_ptr,
                   in_features, sx_t, sx_k, sa_s, sa_r, sa_k, s_out,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # all index arithmetic is int64: no overflow on large tensors, and the interpreter skips its
    # per-op int32 overflow checks (which otherwise dominate its run time)
    pid_m, g, pid_r = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
    slot = tl.load(group_slots_ptr + g).to(tl.int64)
    if slot < 0:  # an emptied group
        return
    start = tl.load(group_starts_ptr + g).to(tl.int64)
    end = tl.load(group_starts_ptr + g + 1).to(tl.int64)
    rank = tl.load(ranks_ptr + slot).to(tl.int64)
    if (start + pid_m * BLOCK_M >= end) | (pid_r * BLOCK_R >= rank):
        return
    pos = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # [BM] positions in slot order
    row = tl.load(rows_ptr + pos, mask=pos < end, other=-1).to(tl.int64)  # [BM] token rows, -1 past the end
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # [BR]
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # [BK]
    a_base = a_ptr + slot * sa_s
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + offs_k  # [BK]
        xv = tl.load(x_ptr + row[:, None] * sx_t + k[None, :] * sx_k,
                     mask=(row[:, None] >= 0) & (k[None, :] < in_features), other=0.0)  # [BM, BK]
        av = tl.load(a_base + r[None, :] * sa_r + k[:, None] * sa_k,
                     mask=(r[None, :] < rank) & (k[:, None] < in_features), other=0.0)  # [BK, BR] = A_s^T tile
        acc += tl.dot(xv.to(tl.float32), av.to(tl.float32), input_precision="ieee")
    tl.store(out_ptr + pos[:, None] * s_out + r[None, :], acc, mask=(pos[:, None] < end) & (r[None, :] < rank))


@triton.jit
def _expand_kernel(shrunk_ptr, b_ptr, y_ptr, rows_ptr, scales_ptr, group_slots_ptr, group_starts_ptr, blocks_ptr,
                   s_shrunk, sb_s, sb_o, sb_r, sy_t, sy_o, num_blocks, tiles_per_block,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, g, pid_pn = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
    slot = tl.load(group_slots_ptr + g).to(tl.int64)
    if slot < 0:  # an emptied group
        return
    start = tl.load(group_starts_ptr + g).to(tl.int64)
    end = tl.load(group_starts_ptr + g + 1).to(tl.int64)
    block = blocks_ptr + (slot * num_blocks + pid_pn // tiles_per_block) * 4  # this program's projection
    o_lo, o_hi = tl.load(block).to(tl.int64), tl.load(block + 1).to(tl.int64)
    r_lo, r_hi = tl.load(block + 2).to(tl.int64), tl.load(block + 3).to(tl.int64)
    n0 = o_lo + (pid_pn % tiles_per_block) * BLOCK_N
    if (start + pid_m * BLOCK_M >= end) | (r_hi <= r_lo) | (n0 >= o_hi):
        return
    pos = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # [BM] positions in slot order
    row = tl.load(rows_ptr + pos, mask=pos < end, other=-1).to(tl.int64)  # [BM] token rows, -1 past the end
    o = n0 + tl.arange(0, BLOCK_N).to(tl.int64)  # [BN] output columns
    offs_r = tl.arange(0, BLOCK_R).to(tl.int64)  # [BR]
    b_base = b_ptr + slot * sb_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(r_lo, r_hi, BLOCK_R):
        r = r0 + offs_r  # [BR]
        sv = tl.load(shrunk_ptr + pos[:, None] * s_shrunk + r[None, :],
                     mask=(pos[:, None] < end) & (r[None, :] < r_hi), other=0.0)  # [BM, BR] fp32
        bv = tl.load(b_base + o[None, :] * sb_o + r[:, None] * sb_r,
                     mask=(r[:, None] < r_hi) & (o[None, :] < o_hi), other=0.0)  # [BR, BN] = B block^T tile
        acc += tl.dot(sv, bv.to(tl.float32), input_precision="ieee")
    acc = acc * tl.load(scales_ptr + pos, mask=pos < end, other=0.0)[:, None]  # each entry's scale
    y_at = y_ptr + row[:, None] * sy_t + o[None, :] * sy_o
    mask = (row[:, None] >= 0) & (o[None, :] < o_hi)
    y_old = tl.load(y_at, mask=mask, other=0.0)
    tl.store(y_at, (y_old.to(tl.float32) + acc).to(y_old.dtype), mask=mask)


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    slot_ranks: torch.Tensor, slot_blocks: torch.Tensor, buffers: LoRAStepBuffers, *,
                    block_width: int | None = None, fixed_grid: bool = False) -> None:
    """Semantics: see the module docstring; ``y += LoRA(x)`` for the step ``buffers`` were filled with
    (``buffers.check`` is the caller's: it knows the slot-table version it serves).

    ``block_width``: the widest block's output size (default: all of y, right for one block);
    ``fixed_grid`` launches over the buffers' whole capacity (the grid a captured graph replays).
    """
    # x: [T, in]; y: [T, out]; lora_a: [max_loras, R_max, in]; lora_b: [max_loras, out, R_max]
    # slot_ranks: [max_loras] int32; slot_blocks: [max_loras, P, 4] int32
    if fixed_grid:
        groups, tokens = buffers.max_loras, buffers.max_tokens
    else:
        groups, tokens = buffers.num_groups, buffers.max_group_tokens
    if groups == 0:
        return
    rank_capacity, in_features = lora_a.shape[1], lora_a.shape[2]
    positions = buffers.max_tokens if fixed_grid else buffers.batch.num_lora_tokens
    shrunk = torch.empty(positions, rank_capacity, dtype=torch.float32, device=x.device)  # [positions, R_max]
    tiles_m = triton.cdiv(tokens, BLOCK_M)
    _shrink_kernel[(tiles_m, groups, triton.cdiv(rank_capacity, BLOCK_R))](
        x, lora_a, shrunk, buffers.rows, buffers.group_slots, buffers.group_starts, slot_ranks,
        in_features, x.stride(0), x.stride(1), *lora_a.stride(), shrunk.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=min(triton.next_power_of_2(in_features), 128))
    num_blocks = slot_blocks.shape[1]
    widest = y.shape[1] if block_width is None else block_width
    block_n = max(16, min(triton.next_power_of_2(widest), 128))
    tiles_per_block = triton.cdiv(widest, block_n)
    _expand_kernel[(tiles_m, groups, num_blocks * tiles_per_block)](
        shrunk, lora_b, y, buffers.rows, buffers.scales, buffers.group_slots, buffers.group_starts, slot_blocks,
        shrunk.stride(0), *lora_b.stride(), y.stride(0), y.stride(1), num_blocks, tiles_per_block,
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_N=block_n)

