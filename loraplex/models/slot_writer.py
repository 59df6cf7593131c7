"""Writing one adapter into a device slot of a model (any family).

The adapter arrives per projection (``modules[(layer_idx, proj_name)] = (A [r, in], B [out, r])``,
scale already folded into B) and is regrouped per packed layer as the family packs them (e.g. q/k/v ->
``qkv_proj``, gate/up -> ``gate_up_proj``). Everything is validated before the first write, so a bad adapter leaves the
slot (and every other slot) exactly as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from loraplex.errors import AdapterRankTooLarge, AdapterShapeMismatch, UnsupportedAdapter

Pair = tuple[torch.Tensor, torch.Tensor]


class AdapterModules(Protocol):
    """What ``set_slot`` reads of an ``AdapterWeights``."""

    modules: Mapping[tuple[int, str], Pair]


def group_by_layer(model, weights: AdapterModules) -> list[list[dict[str, Pair]]]:
    """Validate ``weights`` against ``model`` and return ``[layer][packed_index] -> {proj: (A, B)}``
    in the order of each block's ``adapted()``."""
    cfg = model.config
    shapes = cfg.projections()
    source = getattr(weights, "path", "adapter")
    adapted = model.adapted_layers()
    packed_index = {name: i for i, linear in enumerate(adapted[0]) for name in linear.names}
    grouped: list[list[dict[str, Pair]]] = [[{} for _ in linears] for linears in adapted]
    for (layer_idx, proj), (a, b) in weights.modules.items():
        if proj not in shapes:
            raise UnsupportedAdapter(f"{source}: module {proj!r} is not an adapted projection {tuple(shapes)}")
        if not 0 <= layer_idx < cfg.num_layers:
            raise AdapterShapeMismatch(f"{source}: layer {layer_idx} of {proj} is outside the model's "
                                       f"{cfg.num_layers} layers")
        in_f, out_f = shapes[proj].in_features, shapes[proj].out_features
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or b.shape[1] != r:
            raise AdapterShapeMismatch(
                f"{source}: layer {layer_idx} {proj}: A {tuple(a.shape)}, B {tuple(b.shape)}; expected "
                f"A [r, {in_f}] and B [{out_f}, r]"
            )
        if r > model.max_lora_rank:
            raise AdapterRankTooLarge(f"{source}: layer {layer_idx} {proj} has rank {r} > max_lora_rank "
                                      f"{model.max_lora_rank}")
        grouped[layer_idx][packed_index[proj]][proj] = (a, b)
    return grouped


def write_adapter_slot(model, slot: int, weights: AdapterModules) -> None:
    """Validate, then write ``weights`` into ``slot`` of every adapted layer (untargeted ones zeroed)."""
    if not 0 <= slot < model.max_loras:
        raise IndexError(f"slot {slot} out of range [0, {model.max_loras})")
    grouped = group_by_layer(model, weights)
    for linears, per_linear in zip(model.adapted_layers(), grouped, strict=True):
        for linear, pairs in zip(linears, per_linear, strict=True):
            linear.set_slot(slot, pairs)
