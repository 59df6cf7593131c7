"""``BlockManager``: the paged KV cache's blocks, reference-counted, with the prefix-cache index.

A sequence owns a *block table* (a list of physical block numbers); the K/V of its token at
position ``p`` live in block ``block_table[p // block_size]`` at offset ``p % block_size`` of every
layer's cache tensor. Blocks need not be contiguous or ordered. A full block's contents are named by
a key (``loraplex.engine.scheduler.block_hash``: its tokens, everything before them and the adapter version);
sequences whose prompts share a keyed prefix share those blocks instead of recomputing them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loraplex.engine.request import KVOwner
from loraplex.engine.scheduler.block_hash import owner_members


@dataclass(frozen=True)
class PrefixMatch:
    """What ``BlockManager.match`` found for one sequence: the cached blocks of its longest keyed prefix."""

    blocks: tuple[int, ...]  # block_table[:len(blocks)] for the sequence, already computed
    version_id: KVOwner  # the owner (version, or LoRA plan) the keys were made with
    queried_tokens: int  # the sequence's tokens when it looked (for the hit-rate counters)
    hit_tokens: int  # len(blocks) * block_size


@dataclass
class PrefixCounts:
    """Prefix-cache lookups of admitted sequences, in tokens."""

    queried_tokens: int = 0
    hit_tokens: int = 0


class BlockManager:
    """Physical blocks ``0 .. num_blocks-1``: their reference counts and the prefix cache's index.

    Every block is in exactly one state: *free* (no reference, no key), *referenced* (held by
    ``ref_count(b) >= 1`` block tables, keyed or not), or *cached* (no reference, keyed: its K/V can
    be reused; it is evicted only when an allocation finds no free block, least recently released
    first, and a sequence's blocks are released tail first so a shared head outlives its tails).
    ``num_free`` counts free and cached blocks: both can be handed out.

    Contract: ask first (``can_allocate``), then commit (``allocate``); allocating more than that
    allows raises without changing anything. ``free`` drops one reference per listed block and rejects
    (changing nothing) a block with no reference left to drop. ``cache`` keys blocks whose K/V the
    running step writes; the keys are *pending* (visible to ``match`` in the same step, whose forward
    pass writes every K/V before any is read) until ``commit``; ``rollback`` forgets the pending keys
    of a step that failed, ``forget`` those of some blocks (a row whose values were not finite). Keys
    hold the adapter version, so a version's blocks never match another version; ``retire(version)``
    (the version was dropped: no sequence of it is left) frees its cached blocks.
    With ``enable_caching=False`` nothing is keyed, matched or kept after its last reference.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_total, self.block_size, self.caching = num_blocks, block_size, enable_caching
        # Popping from the end hands out low block numbers first (deterministic layouts in tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced keyed blocks, LRU first
        self._refs = [0] * num_blocks
        self._keys: list[bytes | None] = [None] * num_blocks
        self._versions: list[KVOwner] = [None] * num_blocks  # owner (version or plan) of the sequence that wrote it
        self._index: dict[bytes, int] = {}  # key -> the block holding that content
        self._pending: dict[int, None] = {}  # blocks keyed in the running step
        self.evictions = 0
        self.totals = PrefixCounts()
        self._by_version: dict[KVOwner, PrefixCounts] = {}

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks whose K/V can be found by key (referenced or not)."""
        return len(self._index)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def key_of(self, block: int) -> bytes | None:
        return self._keys[block]

    def version_of(self, block: int) -> KVOwner:
        return self._versions[block]

    def match(self, keys: Sequence[bytes], version_id: KVOwner, num_tokens: int) -> PrefixMatch:
        """The blocks of the longest prefix of ``keys`` (a sequence's chain, made with ``version_id``)
        that are in the index, referenced or cached. Changes nothing."""
        blocks: list[int] = []
        if self.caching:
            for key in keys:
                block = self._index.get(key)
                if block is None:
                    break
                blocks.append(block)
        return PrefixMatch(tuple(blocks), version_id, num_tokens, len(blocks) * self.block_size)

    def can_allocate(self, n: int, prefix: PrefixMatch | None = None) -> bool:
        """Whether ``n`` fresh blocks (after taking ``prefix``'s, which may be cached ones) are available."""
        reused = sum(1 for b in prefix.blocks if self._refs[b] == 0) if prefix else 0
        return 0 <= n and n + reused <= self.num_free

    def allocate(self, n: int, version_id: KVOwner, prefix: PrefixMatch | None = None, first: int = 0,
                 base_blocks: int = 0) -> list[int]:
        """A block table: ``prefix``'s blocks (one more reference each) then ``n`` fresh blocks written by
        a sequence of ``version_id``, evicting cached blocks when no free one is left. Counts the lookup.
        The fresh blocks sit at the sequence's block indices from ``first`` + the prefix's length on; those
        below ``base_blocks`` are written as the base model's (an aLoRA sequence's blocks before its
        invocation point). Raises ``RuntimeError`` if ``can_allocate(n, prefix)`` is false."""
        if not self.can_allocate(n, prefix):
            raise RuntimeError(f"cannot allocate {n} KV blocks: {self.num_free} of {self.num_total} free")
        if prefix is not None and prefix.version_id != version_id:
            raise ValueError(f"a prefix of version {prefix.version_id} cannot start a sequence of {version_id}")
        shared = list(prefix.blocks) if prefix else []
        for b in shared:
            if self._refs[b] == 0:
                del self._cached[b]
            self._refs[b] += 1
        fresh = [self._free.pop() if self._free else self._evict() for _ in range(n)]
        for k, b in enumerate(fresh):
            self._refs[b] = 1
            self._versions[b] = None if first + len(shared) + k < base_blocks else version_id
        if prefix is not None and self.caching:
            for c in (self.totals, self._by_version.setdefault(version_id, PrefixCounts())):
                c.queried_tokens += prefix.queried_tokens
                c.hit_tokens += prefix.hit_tokens
        return shared + fresh

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference per listed block, tail first. Raises ``ValueError`` (changing nothing) on a
        block that has no reference left to drop (double free, out of range)."""
        for b, times in Counter(blocks).items():
            if not (0 <= b < self.num_total) or self._refs[b] < times:
                raise ValueError(f"KV block {b} is not allocated (double free or foreign block)")
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._keys[b] is not None:
                    self._cached[b] = None  # most recently released: evicted last
                else:
                    self._free.append(b)

    def cache(self, blocks: Sequence[int], keys: Sequence[bytes]) -> None:
        """Key ``blocks[i]`` as ``keys[i]``: full blocks whose K/V this step writes (pending until
        ``commit``). A block already keyed, or whose key another block already holds, is left as is."""
        if not self.caching:
            return
        for b, key in zip(blocks, keys, strict=True):
            if self._refs[b] == 0:
                raise ValueError(f"KV block {b} is not allocated; only a sequence's own blocks can be keyed")
            if self._keys[b] is None and key not in self._index:
                self._keys[b] = key
                self._index[key] = b
                self._pending[b] = None

    def commit(self) -> None:
        """The step's forward pass wrote its K/V: its pending keys become permanent."""
        self._pending.clear()

    def rollback(self) -> None:
        """The step failed before its K/V were all written: forget the keys it entered."""
        self.forget(list(self._pending))

    def forget(self, blocks: Iterable[int]) -> None:
        """Forget the pending keys of ``blocks`` (the others are left as they are): the running step wrote
        unusable K/V there (a row whose values were not finite), so nothing may match them."""
        for b in blocks:
            if b not in self._pending:
                continue
            del self._pending[b]
            self._unkey(b)
            if self._refs[b] == 0:
                del self._cached[b]
                self._free.append(b)

    def retire(self, version_id: int) -> None:
        """``version_id`` was dropped (unloaded or retired, and no sequence of it is left): its cached blocks, and
        those of every plan it is a member of, are freed now (their keys hold it, so nothing else could match
        them) and their lookup counters dropped. Raises ``ValueError`` (changing nothing) if a block of it is
        still referenced."""
        if any(self._refs[b] and version_id in owner_members(self._versions[b]) for b in range(self.num_total)):
            raise ValueError(f"adapter version {version_id} still has referenced KV blocks: it cannot be retired")
        for b in [b for b in self._cached if version_id in owner_members(self._versions[b])]:
            del self._cached[b]
            self._pending.pop(b, None)
            self._unkey(b)
            self._free.append(b)
        for owner in [o for o in self._by_version if version_id in owner_members(o)]:
            del self._by_version[owner]

    def counts_by_version(self) -> dict[KVOwner, PrefixCounts]:
        """Lookup counters per owner (an adapter version, None = base, or a plan) not retired; a copy."""
        return {v: PrefixCounts(c.queried_tokens, c.hit_tokens) for v, c in self._by_version.copy().items()}

    def check_sequence(self, block_table: Sequence[int], keys: Sequence[bytes], version_id: KVOwner,
                       base_blocks: int = 0) -> None:
        """Debug check: every block of a sequence of ``version_id`` (chain ``keys``) is referenced, was
        written under that version (its first ``base_blocks`` under the base model's), and if keyed, holds
        the key of its place in the chain."""
        for i, b in enumerate(block_table):
            if self._refs[b] < 1 or self._versions[b] != (None if i < base_blocks else version_id):
                raise AssertionError(f"block {i} (#{b}) of a sequence of adapter version {version_id} holds K/V of "
                                     f"version {self._versions[b]} (references {self._refs[b]})")
            if self._keys[b] is not None and i < len(keys) and self._keys[b] != keys[i]:
                raise AssertionError(f"block {i} (#{b}) is keyed for other contents than the sequence's chain")

    def check_integrity(self, tables: Iterable[Sequence[int]] | None = None) -> None:
        """Raise AssertionError unless every block is exactly one of free / referenced / cached, the index and
        the keys agree, and (given every live block table) each block's references are the tables holding it."""
        if tables is not None:
            held = Counter(b for table in tables for b in table)
            wrong = [b for b in range(self.num_total) if self._refs[b] != held[b]]
            if wrong:
                raise AssertionError(f"block {wrong[0]}: {self._refs[wrong[0]]} references, {held[wrong[0]]} tables")
        free, cached = set(self._free), set(self._cached)
        for b in range(self.num_total):
            states = (b in free, self._refs[b] > 0, b in cached)
            if sum(states) != 1 or self._refs[b] < 0:
                raise AssertionError(f"block {b}: free/referenced/cached = {states}, references {self._refs[b]}")
            if (b in free and self._keys[b] is not None) or (b in cached and self._keys[b] is None):
                raise AssertionError(f"block {b} is free with a key or cached without one")
        if len(free) != len(self._free) or {b: k for k, b in self._index.items()} != {
                b: k for b, k in enumerate(self._keys) if k is not None}:
            raise AssertionError("free list has duplicates, or the index and the block keys disagree")

    def _evict(self) -> int:
        b, _ = self._cached.popitem(last=False)
        self._unkey(b)
        self._pending.pop(b, None)
        self.evictions += 1
        return b

    def _unkey(self, b: int) -> None:
        del self._index[self._keys[b]]
        self._keys[b] = None
