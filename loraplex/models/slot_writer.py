"""Writing one adapter into a device slot of a model (any family).

The adapter arrives per projection (``modules[(layer_idx, proj_name)] = (A [r, in], B [out, r])``, or
``(A [E, r, in], B [E, out, r])`` for a stacked expert parameter, scale already folded into B;
``dora_scales[(layer_idx, proj_name)] = g [out]`` for DoRA) and is regrouped per packed layer as the family
packs them (e.g. q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``); its ``embed_tokens`` / ``lm_head``
parts (``vocab``) go to the embedding and the lm_head. Everything is validated before the first write, so
a bad adapter leaves the slot (and every other slot) exactly as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from loraplex.errors import AdapterRankTooLarge, AdapterShapeMismatch, UnsupportedAdapter
from loraplex.layers.vocab_slot import VocabSlot

Pair = tuple[torch.Tensor, torch.Tensor]
Grouped = list[list[tuple[dict[str, Pair], dict[str, torch.Tensor]]]]  # [layer][packed] -> (pairs, DoRA scales)


class AdapterModules(Protocol):
    """What ``set_slot`` reads of an ``AdapterWeights`` (``adapters.weights``)."""

    modules: Mapping[tuple[int, str], Pair]
    dora_scales: Mapping[tuple[int, str], torch.Tensor]
    magnitudes: Mapping[tuple[int, str], torch.Tensor]
    vocab: Mapping[str, Any]  # "embed_tokens" / "lm_head" -> adapters.weights.VocabModule


def group_by_layer(model, weights: AdapterModules) -> Grouped:
    """Validate ``weights`` against ``model`` and return ``[layer][packed_index] -> ({proj: (A, B)},
    {proj: g})`` in the order of each block's ``adapted()``."""
    cfg = model.config
    shapes = cfg.projections()
    source = getattr(weights, "path", "adapter")
    adapted = model.adapted_layers()
    packed_index = {name: i for i, linear in enumerate(adapted[0]) for name in linear.names}
    grouped: Grouped = [[({}, {}) for _ in linears] for linears in adapted]
    scales = getattr(weights, "dora_scales", {})
    if set(getattr(weights, "magnitudes", {})) != set(scales):
        raise ValueError(f"{source}: DoRA magnitudes are not folded; pass the weights through model.prepare()")
    for (layer_idx, proj), (a, b) in weights.modules.items():
        if proj not in shapes:
            raise UnsupportedAdapter(f"{source}: module {proj!r} is not an adapted projection {tuple(shapes)}")
        if not 0 <= layer_idx < cfg.num_layers:
            raise AdapterShapeMismatch(f"{source}: layer {layer_idx} of {proj} is outside the model's "
                                       f"{cfg.num_layers} layers")
        in_f, out_f, experts = shapes[proj].in_features, shapes[proj].out_features, shapes[proj].experts
        lead = (experts,) if experts else ()  # stacked experts: one pair per expert
        r = a.shape[-2] if a.dim() >= 2 else -1
        if tuple(a.shape) != (*lead, r, in_f) or tuple(b.shape) != (*lead, out_f, r):
            e = f"{experts}, " if experts else ""
            raise AdapterShapeMismatch(
                f"{source}: layer {layer_idx} {proj}: A {tuple(a.shape)}, B {tuple(b.shape)}; expected "
                f"A [{e}r, {in_f}] and B [{e}{out_f}, r]"
            )
        if r > model.max_lora_rank:
            raise AdapterRankTooLarge(f"{source}: layer {layer_idx} {proj} has rank {r} > max_lora_rank "
                                      f"{model.max_lora_rank}")
        pairs, dora = grouped[layer_idx][packed_index[proj]]
        pairs[proj] = (a, b)
        if (g := scales.get((layer_idx, proj))) is not None:
            if tuple(g.shape) != (out_f,):
                raise AdapterShapeMismatch(f"{source}: layer {layer_idx} {proj}: DoRA scale {tuple(g.shape)}, "
                                           f"expected [{out_f}]")
            dora[proj] = g
    return grouped


def vocab_slots(model, weights: AdapterModules) -> dict[str, VocabSlot]:
    """Validate the ``embed_tokens`` / ``lm_head`` parts and build their device-side slots."""
    cfg = model.config
    source = getattr(weights, "path", "adapter")
    out = {}
    for name, module in getattr(weights, "vocab", {}).items():
        if name not in ("embed_tokens", "lm_head"):
            raise UnsupportedAdapter(f"{source}: vocabulary module {name!r} is not embed_tokens or lm_head")
        if (module.magnitude is None) != (module.dora_scale is None):
            raise ValueError(f"{source}: {name}'s DoRA magnitude is not folded; pass the weights through "
                             "model.prepare()")
        v_a, hidden = module.vocab_size, cfg.hidden_size
        if v_a < cfg.vocab_size or (module.rows is not None and tuple(module.rows.shape[1:]) != (hidden,)):
            raise AdapterShapeMismatch(f"{source}: {name} serves {v_a} tokens of width "
                                       f"{None if module.rows is None else module.rows.shape[1]}; the model has "
                                       f"{cfg.vocab_size} tokens of width {hidden}")
        if module.lora is not None and module.lora[0].shape[0] > model.max_lora_rank:
            raise AdapterRankTooLarge(f"{source}: {name} has rank {module.lora[0].shape[0]} > max_lora_rank "
                                      f"{model.max_lora_rank}")
        out[name] = VocabSlot.build(v_a, module.row_ids, module.rows, module.lora, module.dora_scale,
                                    model.dtype, model.device)
    return out


def write_adapter_slot(model, slot: int, weights: AdapterModules) -> None:
    """Validate, then write ``weights`` into ``slot`` of every adapted layer (untargeted ones zeroed)."""
    if not 0 <= slot < model.max_loras:
        raise IndexError(f"slot {slot} out of range [0, {model.max_loras})")
    grouped = group_by_layer(model, weights)
    vocab = vocab_slots(model, weights)
    for linears, per_linear in zip(model.adapted_layers(), grouped, strict=True):
        for linear, (pairs, dora) in zip(linears, per_linear, strict=True):
            linear.set_slot(slot, pairs, dora)
    model.embed_tokens.set_slot(slot, vocab.get("embed_tokens"))
    model.lm_head_slots.set_slot(slot, vocab.get("lm_head"))
