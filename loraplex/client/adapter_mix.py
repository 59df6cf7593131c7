"""Per-request adapter scales and blends, as a frontend routes them: ``AdapterMix`` (the offline API's),
``scaled`` (one routed adapter at a ``lora_scale``) and ``mixed`` (several routed adapters, an ``adapter_mix``).

Each name is routed once, first, like a single adapter's (``AdapterDirectory.route``); the ``Version`` made
here carries the request's LoRA plan (``Version.plan``: ``(version id, scale)`` per entry, in order) and
everything derived from it keys on that plan: the engine holds and pins every member, the prefix cache keys
its blocks on the whole plan (``engine/scheduler/block_hash.py``), the answer names every member version.
A mix's members must share one tokenizer (the prompt is tokenized once, for all of them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from loraplex.client.directory import Version
from loraplex.errors import RequestError


@dataclass(frozen=True, init=False)
class AdapterMix:
    """Adapters blended in one request: ``AdapterMix([("style", 0.7), ("domain", 1.0)])`` computes
    ``W x + 0.7 * B_style A_style x + 1.0 * B_domain A_domain x`` at every position (PEFT's
    ``add_weighted_adapter(..., combination_type="cat")``). One entry is one adapter at that scale."""

    entries: tuple[tuple[str, float], ...]

    def __init__(self, entries: Iterable[tuple[str, float]]) -> None:
        object.__setattr__(self, "entries", tuple((name, scale) for name, scale in entries))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.entries)


def scaled(version: Version, scale: float | None, field: str = "lora_scale") -> Version:
    """``version`` (one routed adapter) at ``scale`` (None or 1: itself, the plain request)."""
    if scale is None or scale == 1.0:
        return version
    if version.version_id is None:
        raise RequestError(f"{field} scales an adapter's delta: name an adapter as the model (the base model "
                           "has none)", field)
    return replace(version, plan=((version.version_id, scale),))


def mixed(versions: Sequence[Version], scales: Sequence[float], field: str = "adapter_mix") -> Version:
    """The version of a request blending routed ``versions`` at ``scales``: its plan, its members' shared
    tokenizer, a label and content hash naming every member. ``RequestError`` on ``field`` for no entry, the base
    model or a name given twice, or members that do not share one tokenizer."""
    if not versions:
        raise RequestError(f"{field} needs at least one adapter", field)
    if len(versions) == 1:
        return scaled(versions[0], scales[0], field)
    names = [v.name for v in versions]
    if any(v.version_id is None for v in versions):
        raise RequestError(f"{field} blends adapters: the base model cannot be one of them", field)
    if len(set(names)) != len(names):
        raise RequestError(f"{field} names one adapter twice: give each adapter once, with its scale", field)
    first = versions[0]
    if any(v.tokenizer is not first.tokenizer or v.vocab_size != first.vocab_size for v in versions):
        raise RequestError(f"{field} of {', '.join(map(repr, names))}: they do not share one tokenizer (an adapter "
                           "that ships its own or adds tokens can only be mixed with itself)", field)
    digest = hashlib.sha256()
    for version, scale in zip(versions, scales, strict=True):
        digest.update(f"{version.content_hash}*{float(scale)!r};".encode())
    ids = [v.version_id for v in versions if v.version_id is not None]
    return Version(None, "+".join(str(n) for n in names), digest.hexdigest(), first.vocab_size, first.tokenizer,
                   first.tokenizer_folder, first.tokenizer_roots, plan=tuple(zip(ids, scales, strict=True)))
