"""What the manager tells the rest of the engine about a registered adapter version (``AdapterInfo``), and
its counters (``AdapterCounters``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loraplex.adapters.reading.weights import ScoreHead


@dataclass(frozen=True)
class AdapterInfo:
    """One registered adapter version. Requests resolve a name to ``version_id`` once, at admission; a
    reload makes a new id. ``tokenizer`` (when the adapter ships its own) encodes and decodes that
    version's requests and renders their chat template; ``vocab_size`` bounds their token ids."""

    name: str
    path: str
    version_id: int  # the version: fresh for every load
    content_hash: str
    max_rank: int
    vocab_size: int | None = None  # the adapter's vocabulary when it adds tokens, else None (the base's)
    saved_bytes: int = 0  # saved vocabulary rows, counted in the budget
    uses_dora: bool = False
    tokenizer: Any = field(default=None, compare=False, repr=False)  # its own, or None: the base model's
    loaded_at: float = 0.0  # when this version was loaded (Unix time)
    roots: tuple[str, ...] | None = None  # the allowed roots it was loaded under (its re-reads keep them)
    in_memory: bool = False  # loaded from tensors: no folder to re-read, so its weights stay in host memory
    scalable: bool = True  # a lora_scale or adapter mix can weight it (``AdapterWeights.scalable``)
    # aLoRA: its delta applies from the last occurrence of these token ids in a request's prompt on (else None)
    alora_invocation_tokens: tuple[int, ...] | None = None
    # a SEQ_CLS adapter's classification head (``reading.weights.ScoreHead``), read with this version; else None
    score_head: ScoreHead | None = field(default=None, compare=False, repr=False)

    @property
    def class_labels(self) -> tuple[str, ...] | None:
        """Its classification head's class names, or None (no head)."""
        return None if self.score_head is None else self.score_head.class_labels


@dataclass
class AdapterCounters:
    """Cumulative counts since start, exported as metrics."""

    loads: int = 0  # successful load() calls
    device_evictions: int = 0  # a slot's adapter overwritten by another one
    host_evictions: int = 0  # weights dropped from host memory by the LRU bound
    device_hits: int = 0  # acquire found the adapter already in a slot
    host_hits: int = 0  # acquire wrote a slot from weights in host memory
    disk_reads: int = 0  # background re-reads of adapters no longer in host memory
