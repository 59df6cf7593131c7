"""A request's LoRA plan, checked at intake: which adapter versions it reads and at what scale.

A plan is an ordered tuple of ``(version id, scale)`` entries (``request.Plan``): ``((v, s),)`` is one
adapter at a per-request scale (``lora_scale``), several entries an adapter mix (``adapter_mix``); each
row of the request computes ``W x + sum_k s_k * B_k A_k x`` (PEFT's ``add_weighted_adapter(...,
combination_type="cat")``). Every member is held for the request's life and pinned in its own slot while it
runs, so a plan has at most ``max_adapters_per_request`` entries (and no more than ``max_loras``).

Refused, as a ``RequestError`` naming ``lora_scale`` (one entry) or ``adapter_mix``: a negative or non-finite
scale, too many entries, a version named twice; and, once the members are held (``check_members``), a member
whose delta the plan cannot weight (``AdapterInfo.scalable``: vocabulary modules, DoRA, stacked experts read
the step's first LoRA pass unscaled; an aLoRA's delta starts at its own invocation point), unless it is one
adapter at scale 1, and a mix of adapters that do not
share one tokenizer (its token ids would mean different things to its members).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from loraplex.adapters.info import AdapterInfo
from loraplex.engine.request import Plan
from loraplex.errors import RequestError


def plan_field(plan: Sequence[object]) -> str:
    """The request field a plan comes from: ``lora_scale`` for one entry, ``adapter_mix`` for a mix."""
    return "lora_scale" if len(plan) == 1 else "adapter_mix"


def check_plan(plan: Sequence[object], version_id: int | None, max_entries: int) -> Plan:
    """``plan`` as a canonical ``Plan`` (int ids, float scales), or ``RequestError`` (module docstring).
    ``version_id`` must be the single entry's version, or None for a mix."""
    if not isinstance(plan, tuple | list) or not plan:
        raise RequestError("a LoRA plan is a non-empty list of (adapter version, scale) entries", "adapter_mix")
    field = plan_field(plan)
    entries: list[tuple[int, float]] = []
    for entry in plan:
        if not isinstance(entry, tuple | list) or len(entry) != 2:
            raise RequestError(f"a LoRA plan entry is (adapter version, scale), got {entry!r:.60}", field)
        version, scale = entry
        if isinstance(version, bool) or not isinstance(version, int):
            raise RequestError(f"a LoRA plan entry's adapter version is an int, got {version!r:.40}", field)
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale) or scale < 0:
            raise RequestError(f"{field}: a scale must be a finite number >= 0, got {scale!r:.40}", field)
        entries.append((version, float(scale)))
    if len(entries) > max_entries:
        raise RequestError(f"adapter_mix has {len(entries)} entries: at most {max_entries} adapters per request "
                           "(--max-adapters-per-request, and no more than --max-loras)", "adapter_mix")
    ids = [v for v, _ in entries]
    if len(set(ids)) != len(ids):
        raise RequestError("adapter_mix names one adapter twice: give each adapter once, with its scale",
                           "adapter_mix")
    if version_id != (ids[0] if len(ids) == 1 else None):
        raise RequestError(f"a LoRA plan of versions {ids} was sent with adapter version {version_id}", field)
    return tuple(entries)


def check_members(plan: Plan, infos: Sequence[AdapterInfo]) -> None:
    """``RequestError`` unless every member of ``plan`` (``infos``, in plan order, held) can be weighted by
    it and, for a mix, all members share one tokenizer and vocabulary."""
    field = plan_field(plan)
    for info, (_, scale) in zip(infos, plan, strict=True):
        if not info.scalable and not (len(plan) == 1 and scale == 1.0):
            why = ("is an activated LoRA (alora_invocation_tokens), served alone" if info.alora_invocation_tokens
                   else "changes embed_tokens / lm_head (LoRA, saved or added rows), uses DoRA or adapts MoE experts, "
                   "whose deltas are served")
            raise RequestError(f"adapter {info.name!r} cannot be scaled or mixed: it {why} at scale 1 only", field)
    if len(infos) > 1:
        tokenizers = {id(info.tokenizer) if info.tokenizer is not None else None for info in infos}
        if len(tokenizers) > 1 or len({info.vocab_size for info in infos}) > 1:
            names = ", ".join(repr(info.name) for info in infos)
            raise RequestError(f"adapter_mix of {names}: they do not share one tokenizer (an adapter that ships its "
                               "own or adds tokens can only be mixed with itself)", "adapter_mix")
