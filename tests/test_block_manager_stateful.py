"""The block manager under random sequences of admissions, growth, releases, step commits and failures,
adapter retirements and evictions, held against a model of what every block's K/V *is*: the adapter
version and the tokens it was computed from (or garbage, after a failed step).

Properties checked after every operation: reference counts equal the number of block tables holding each
block and are never negative; every block is exactly one of free / referenced / cached
(``check_integrity``); a keyed block was written under the version its key holds; and a match returns only
blocks whose K/V are exactly what the asking sequence would compute itself: the same version (no block
of version X is reachable from version Y), the same tokens, never garbage. Nobody writes into a shared or
keyed block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from loraplex.engine.scheduler.block_hash import extend_chain
from loraplex.engine.scheduler.block_manager import BlockManager

BLOCK = 2
NUM_BLOCKS = 10
VERSIONS = st.sampled_from([None, 1, 2])
TOKENS = st.lists(st.integers(1, 2), min_size=1, max_size=7)  # a tiny alphabet: prefixes collide often

Content = tuple  # (version, the tokens of the whole prefix through the block) or ("garbage",)


@dataclass
class Seq:
    version: int | None
    tokens: list[int]
    table: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = BlockManager(NUM_BLOCKS, BLOCK)
        self.seqs: list[Seq] = []
        self.content: dict[int, Content] = {}  # block -> what its K/V were computed from
        self.in_step: list[Seq] = []  # sequences that wrote K/V in the step not yet committed
        self.step_writes: set[int] = set()  # blocks written in that step
        self.retired: set[int] = set()

    def _write(self, seq: Seq, start: int) -> None:
        """``seq`` computes its tokens from position ``start``: into its own unshared, unkeyed blocks."""
        for pos in range(start, len(seq.tokens)):
            b = seq.table[pos // BLOCK]
            assert self.m.ref_count(b) == 1 and self.m.key_of(b) is None, "writing into a shared or keyed block"
            self.content[b] = (seq.version, tuple(seq.tokens[: (pos // BLOCK + 1) * BLOCK]))
            self.step_writes.add(b)
        extend_chain(seq.keys, seq.tokens, seq.version, BLOCK)
        first, end = start // BLOCK, len(seq.tokens) // BLOCK
        self.m.cache(seq.table[first:end], seq.keys[first:end])
        if seq not in self.in_step:
            self.in_step.append(seq)

    @rule(tokens=TOKENS, version=VERSIONS)
    def admit(self, tokens: list[int], version: int | None) -> None:
        if version in self.retired:
            return  # an unloaded version takes no new requests
        seq = Seq(version, tokens)
        keys = extend_chain([], tokens, version, BLOCK)[: (len(tokens) - 1) // BLOCK]
        prefix = self.m.match(keys, version, len(tokens))
        for i, b in enumerate(prefix.blocks):
            assert self.content.get(b) == (version, tuple(tokens[: (i + 1) * BLOCK])), "matched foreign K/V"
        fresh = -(-len(tokens) // BLOCK) - len(prefix.blocks)
        if not self.m.can_allocate(fresh, prefix):
            return
        seq.table = self.m.allocate(fresh, version, prefix)
        self.seqs.append(seq)
        self._write(seq, prefix.hit_tokens)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=TOKENS)
    def grow(self, data: st.DataObject, extra: list[int]) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        start = len(seq.tokens)
        seq.tokens += extra[:3]
        need = -(-len(seq.tokens) // BLOCK) - len(seq.table)
        if not self.m.can_allocate(need):
            seq.tokens = seq.tokens[:start]
            return
        seq.table += self.m.allocate(need, seq.version)
        self._write(seq, start)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        self.m.free(seq.table)

    @rule()
    def commit(self) -> None:
        self.m.commit()
        self.in_step.clear()
        self.step_writes.clear()

    @rule()
    def fail_step(self) -> None:
        """The forward pass failed: what the step wrote is garbage; its sequences are recomputed later."""
        self.m.rollback()
        for b in self.step_writes:
            self.content[b] = ("garbage",)
        for seq in self.in_step:
            if seq in self.seqs:
                self.seqs.remove(seq)
                self.m.free(seq.table)
        self.in_step.clear()
        self.step_writes.clear()

    @rule(version=st.sampled_from([1, 2]))
    def retire(self, version: int) -> None:
        """The version is dropped: only once no sequence of it is left; its cached blocks are freed."""
        if any(seq.version == version for seq in self.seqs):
            return
        self.retired.add(version)
        self.m.retire(version)
        assert not [b for b in range(NUM_BLOCKS) if self.m.key_of(b) and self.m.version_of(b) == version]

    @invariant()
    def blocks_are_consistent(self) -> None:
        self.m.check_integrity()
        held: dict[int, int] = {}
        for seq in self.seqs:
            for b in seq.table:
                held[b] = held.get(b, 0) + 1
                assert self.m.version_of(b) == seq.version, "a sequence holds a block of another version"
        for b in range(NUM_BLOCKS):
            assert self.m.ref_count(b) == held.get(b, 0) >= 0
            if self.m.key_of(b) is not None:
                assert self.content[b] != ("garbage",), f"keyed block {b} holds K/V of a failed step"
                version, tokens = self.content[b]
                assert self.m.version_of(b) == version
                assert extend_chain([], list(tokens), version, BLOCK)[-1] == self.m.key_of(b)
        assert self.m.num_free == NUM_BLOCKS - len(held)


def test_block_manager_state_machine() -> None:
    run_state_machine_as_test(BlockManagerMachine, settings=settings(max_examples=150, stateful_step_count=40,
                                                                     deadline=None))
