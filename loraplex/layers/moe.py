"""A sparse mixture-of-experts MLP with LoRA on the router and on every expert, over a flat ragged batch.

Semantics, per token t of ``x [T, H]`` (``ExpertConfig`` E experts, top k, expert width I):

- router logits ``z = x W_r^T`` ``[T, E]`` (plus the router's LoRA delta where adapted: Qwen3-MoE's ``gate``);
- routing, as HF computes it: "softmax_topk" (Qwen3-MoE): ``p = softmax(float32(z))``,
  ``(w, e) = topk(p, k)``, then ``w = w / sum(w)`` when ``normalize_top_k``; "topk_softmax" (GraniteMoE):
  ``(l, e) = topk(float32(z), k)``, ``w = softmax(l)``; both cast w to x's dtype;
- expert i: ``f_i(x) = (act(g) * u) D_i^T`` with ``[g, u] = x G_i^T`` (``G_i = gate_up[i]`` ``[2I, H]``, gate
  rows then up rows; ``D_i = down[i]`` ``[H, I]``), each product plus the LoRA delta of the token's adapter
  for expert i (``x A_i^T B_i^T``, B scale-folded; PEFT's ``target_parameters`` on the stacked tensors);
- ``y[t] = sum_j w[t, j] * f_{e[t, j]}(x[t])``, summed in ascending expert order (HF's loop order).

Computed with the router once per token, then the ``T * k`` (token, choice) pairs sorted by expert
(``ops.moe_groups``): each expert with pairs runs one matmul per projection over its contiguous rows (its
weights read once per step, whichever adapters its tokens use), and the LoRA deltas of all experts run in
one batched LoRA call per projection over (adapter slot, expert) groups, on the same ops as the dense layers
(the sgmv kernel on CPUs, torch ops elsewhere). Experts no token chose are not touched.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.config import ExpertConfig
from loraplex.layers.lora_linear import LoRALinear
from loraplex.layers.mlp import activation
from loraplex.ops import cpu_kernels
from loraplex.ops.dense import dense_linear, pack_weight, unpack_weight
from loraplex.ops.int8 import Int8Weight
from loraplex.ops.lora import Blocks, LoRACache, add_lora
from loraplex.ops.lora_batch import LoRABatch
from loraplex.ops.lora_sgmv import add_lora_sgmv
from loraplex.ops.moe_groups import ExpertGroups, expert_lora_batch, group_by_expert

logger = logging.getLogger(__name__)


def route(logits: torch.Tensor, config: ExpertConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> ``(weights [T, k] in dtype, experts [T, k] int64)``, the module docstring's routing."""
    if config.routing == "softmax_topk":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, experts = torch.topk(probs, config.top_k, dim=-1)
        if config.normalize_top_k:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(dtype), experts
    top_logits, experts = torch.topk(logits.float(), config.top_k, dim=-1)
    return torch.softmax(top_logits, dim=-1).to(dtype), experts


class ExpertLoRA(nn.Module):
    """The LoRA slots of one stacked expert projection (``in -> out`` per expert). Slot s of expert e is
    virtual slot ``v = s * E + e`` of the batched LoRA ops: ``lora_a [max_loras * E, R_max, in]``,
    ``lora_b [max_loras * E, out, R_max]`` (stored rank-major, as ``LoRALinear``'s), ranks per virtual slot.

    The two buffers take ``max_loras * E * R_max * (in + out)`` values, E times a dense layer's (OLMoE-1B-7B's
    experts at 4 slots of rank 16: 117 MB a layer), so they are allocated when the first adapter with LoRA on
    these experts is written (zeros: untouched pages cost nothing until written); a model served with
    attention-only adapters never allocates them."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        slots = max_loras * num_experts
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.max_lora_rank, self.dtype = max_lora_rank, dtype
        self.register_buffer("lora_a", None, persistent=False)  # [L * E, R_max, in] once allocated
        self.register_buffer("lora_b", None, persistent=False)  # [L * E, out, R_max] once allocated
        self.slot_ranks = [0] * slots
        self.slot_blocks: list[Blocks] = [()] * slots
        self.register_buffer("slot_ranks_dev", torch.zeros(slots, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("slot_blocks_dev", torch.zeros(slots, 1, 4, dtype=torch.int32, device=device),
                             persistent=False)  # [L * E, 1, 4]
        self.cache = LoRACache()

    def set_slot(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Write ``(A [E, r, in], B [E, out, r])`` (B scale-folded) into slot ``slot`` of every expert, or empty it."""
        lo, hi = slot * self.num_experts, (slot + 1) * self.num_experts
        self.cache.clear()
        if self.lora_a is None:
            if pair is None:
                return
            self._allocate()
        old = self.slot_ranks[lo]
        if old:
            self.lora_a[lo:hi, :old].zero_()
            self.lora_b[lo:hi, :, :old].zero_()
        rank = 0 if pair is None else pair[0].shape[1]
        if pair is not None:
            self.lora_a[lo:hi, :rank].copy_(pair[0])
            self.lora_b[lo:hi, :, :rank].copy_(pair[1])
        blocks = ((0, self.out_features, 0, rank),) if rank else ()
        self.slot_ranks[lo:hi] = [rank] * self.num_experts
        self.slot_blocks[lo:hi] = [blocks] * self.num_experts
        self.slot_ranks_dev[lo:hi] = rank
        self.slot_blocks_dev[lo:hi] = torch.tensor([0, self.out_features, 0, rank], dtype=torch.int32) if rank else 0

    def _allocate(self) -> None:
        slots, device = len(self.slot_ranks), self.slot_ranks_dev.device
        self.lora_a = torch.zeros(slots, self.max_lora_rank, self.in_features, dtype=self.dtype, device=device)
        self.lora_b = torch.zeros(slots, self.max_lora_rank, self.out_features, dtype=self.dtype,
                                  device=device).transpose(1, 2)  # rank-major in memory
        logger.info("expert LoRA slots allocated: %.0f MiB", (self.lora_a.nbytes + self.lora_b.nbytes) / 2**20)

    def add(self, y: torch.Tensor, x: torch.Tensor, batch: LoRABatch, kernels: str) -> None:
        """``y += LoRA(x)`` per (slot, expert) group of ``batch`` (rows = pairs), in place."""
        if self.lora_a is None:
            return  # no adapter with LoRA on these experts was ever written
        if kernels == "sgmv":
            add_lora_sgmv(y, x, self.lora_a, self.lora_b, self.slot_ranks, self.slot_ranks_dev, self.slot_blocks_dev,
                          batch, slot_blocks=self.slot_blocks, cache=self.cache)
        else:
            add_lora(y, x, self.lora_a, self.lora_b, self.slot_ranks, batch, slot_blocks=self.slot_blocks,
                     cache=self.cache)

    def _apply(self, fn, recurse: bool = True):  # .to(), .float(), ...: the buffers are replaced
        self.cache.clear()
        return super()._apply(fn, recurse)


class WeightView(nn.Module):
    """One checkpoint tensor's parameter, a view of the experts' stacked weights (so the loader fills them)."""

    def __init__(self, view: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(view, requires_grad=False)


class MoEExperts(nn.Module):
    """Every expert's weights (``gate_up [E, 2I, H]``, ``down [E, H, I]``), their LoRA slots, and the grouped
    compute (module docstring). Duck-types ``LoRALinear``'s slot interface for the projections ``names``
    (``set_slot``, ``clear_slot``, ``pack_dense``, ``quantize_int8``), so the model's slot writes reach it."""

    names = ("gate_up_proj", "down_proj")

    def __init__(self, config: ExpertConfig, hidden: int, hidden_act: str, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        e, i = config.num_experts, config.intermediate_size
        self.num_experts, self.intermediate = e, i
        self.act = activation(hidden_act)
        self.register_buffer("gate_up", torch.empty(e, 2 * i, hidden, dtype=dtype, device=device), persistent=False)
        self.register_buffer("down", torch.empty(e, hidden, i, dtype=dtype, device=device), persistent=False)
        self.gate_up_lora = ExpertLoRA(e, hidden, 2 * i, max_loras, max_lora_rank, dtype, device)
        self.down_lora = ExpertLoRA(e, i, hidden, max_loras, max_lora_rank, dtype, device)
        # per expert, once ``pack_dense()`` / ``quantize_int8()`` ran: {"gate_up": [...], "down": [...]}; the
        # stacked float weights are then dropped
        self.packed: dict[str, list[torch.Tensor]] | None = None
        self.int8: dict[str, list[Int8Weight]] | None = None
        self.lora_kernels = "sgmv"  # the sgmv kernel where it takes the call, else torch ops; "torch": torch ops
        self.views: list[WeightView] = []  # the checkpoint parameters aliasing the stacked weights

    def per_expert_checkpoint(self) -> nn.ModuleList:
        """Modules ``N.gate_proj`` / ``N.up_proj`` / ``N.down_proj`` whose ``weight`` views expert N's rows (the
        checkpoint names of Qwen3-MoE, as transformers saves them)."""
        i = self.intermediate
        experts = nn.ModuleList()
        for n in range(self.num_experts):
            module = nn.Module()
            module.gate_proj, module.up_proj = WeightView(self.gate_up[n, :i]), WeightView(self.gate_up[n, i:])
            module.down_proj = WeightView(self.down[n])
            self.views += [module.gate_proj, module.up_proj, module.down_proj]
            experts.append(module)
        return experts

    def fused_checkpoint(self) -> tuple[WeightView, WeightView]:
        """Modules whose ``weight`` is the whole ``gate_up`` / ``down`` stack (GraniteMoE's ``input_linear`` and
        ``output_linear``)."""
        views = (WeightView(self.gate_up), WeightView(self.down))
        self.views += list(views)
        return views

    def dense_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [E, 2I, H], down [E, H, I])`` as plain float tensors (dequantized or unpacked copies)."""
        if self.int8 is not None:
            return tuple(torch.stack([w.dense(self.gate_up_lora.dtype) for w in self.int8[k]])
                         for k in ("gate_up", "down"))
        if self.packed is not None:
            return tuple(torch.stack([unpack_weight(w) for w in self.packed[k]]) for k in ("gate_up", "down"))
        return self.gate_up, self.down

    def _drop_float(self) -> None:
        self.gate_up, self.down = None, None
        for view in self.views:
            view.weight = None

    def pack_dense(self) -> None:
        """Each expert's weights packed for the CPU GEMM library (``ops.dense``); idempotent; int8 stays."""
        if self.packed is not None or self.int8 is not None:
            return
        packed = {"gate_up": [pack_weight(w) for w in self.gate_up], "down": [pack_weight(w) for w in self.down]}
        if any(p is None for ps in packed.values() for p in ps):
            return  # not packable here (CUDA, other dtypes): plain matmuls
        self.packed = packed
        self._drop_float()

    def quantize_int8(self) -> None:
        """Each expert's weights to weight-only int8 per output channel (``ops.int8``); idempotent."""
        if self.int8 is None:
            gate_up, down = self.dense_weights()
            self.int8 = {"gate_up": [Int8Weight.from_float(w) for w in gate_up],
                         "down": [Int8Weight.from_float(w) for w in down]}
            self.packed = None
            self._drop_float()

    def set_slot(self, slot: int, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                 dora_scales: Mapping[str, torch.Tensor] | None = None) -> None:
        """``pairs[name] = (A [E, r, in], B [E, out, r])`` for ``name`` in ``names`` (absent: rank 0)."""
        if dora_scales:
            raise ValueError("DoRA is not served on experts (PEFT refuses it for target_parameters too)")
        self.gate_up_lora.set_slot(slot, pairs.get("gate_up_proj"))
        self.down_lora.set_slot(slot, pairs.get("down_proj"))

    def clear_slot(self, slot: int) -> None:
        self.gate_up_lora.set_slot(slot, None)
        self.down_lora.set_slot(slot, None)

    def _matmul(self, which: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8[which][expert].linear(x)
        if self.packed is not None:
            return dense_linear(x, None, self.packed[which][expert])
        return F.linear(x, (self.gate_up if which == "gate_up" else self.down)[expert])

    def _grouped(self, which: str, x: torch.Tensor, runs: list[tuple[int, int, int]]) -> torch.Tensor:
        """Each expert's matmul over its own rows of ``x [N, in]`` -> ``[N, out]`` (rows in ``x``'s order)."""
        parts = [self._matmul(which, e, x[lo:hi]) for e, lo, hi in runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def forward(self, x: torch.Tensor, groups: ExpertGroups, lora: LoRABatch | None) -> torch.Tensor:
        # x: [T, H] -> [T, H]; groups: the step's pairs sorted by expert
        runs = groups.runs()
        rows = x.index_select(0, groups.tokens)  # [N, H]
        batch = expert_lora_batch(groups, lora, self.num_experts) if lora is not None and lora.has_lora else None
        if batch is not None and not batch.has_lora:
            batch = None  # the adapted tokens' adapters have no expert LoRA
        gate_up = self._grouped("gate_up", rows, runs)  # [N, 2I]
        if batch is not None:
            self.gate_up_lora.add(gate_up, rows, batch, self.lora_kernels)
        kernels = cpu_kernels.for_tensors(gate_up) if self.act is F.silu else None
        if kernels is not None:
            hidden = kernels.silu_mul(gate_up)  # [N, I]
        else:
            hidden = self.act(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
        down = self._grouped("down", hidden, runs)  # [N, H]
        if batch is not None:
            self.down_lora.add(down, hidden, batch, self.lora_kernels)
        down.mul_(groups.weights[:, None])
        return torch.zeros_like(x).index_add_(0, groups.tokens, down)


class SparseMoE(nn.Module):
    """Router + experts (module docstring), called as ``block(x [T, H], lora) -> [T, H]``. ``router`` is a
    ``LoRALinear`` (adaptable: Qwen3-MoE's ``gate``) or a module computing ``x -> logits``; the family names it
    and the experts' checkpoint modules as its checkpoint does (``router_name``, ``checkpoint``)."""

    def __init__(self, config: ExpertConfig, router_name: str, router: nn.Module, experts: MoEExperts,
                 checkpoint: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.config, self.router_name = config, router_name
        self.add_module(router_name, router)
        for name, module in checkpoint.items():
            self.add_module(name, module)
        self.moe = experts

    def adapted(self) -> tuple[nn.Module, ...]:
        """The block's adapted layers: the router when it is adaptable, then the experts."""
        router = getattr(self, self.router_name)
        return (router, self.moe) if isinstance(router, LoRALinear) else (self.moe,)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        router = getattr(self, self.router_name)
        logits = router(x, lora) if isinstance(router, LoRALinear) else router(x)  # [T, E]
        weights, experts = route(logits, self.config, x.dtype)  # [T, k] each
        return self.moe(x, group_by_expert(experts, weights, self.config.num_experts), lora)
