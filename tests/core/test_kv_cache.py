"""Paged KV cache: allocator, block tables, truncation — unit and property tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from specdec.core.kv_cache import BlockAllocator, BlockTable, KVCacheParams, OutOfBlocks, PagedKVCache


def _cache(num_blocks: int = 8, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(KVCacheParams(num_layers=1, num_kv_heads=1, head_dim=2,
                                      block_size=block_size, num_blocks=num_blocks))


def test_params_validate():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheParams(num_layers=1, num_kv_heads=1, head_dim=2, block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheParams(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=0)
    p = KVCacheParams(num_layers=2, num_kv_heads=3, head_dim=4, block_size=4, num_blocks=5)
    assert p.num_slots == 20
    c = PagedKVCache(p)
    assert c.tensors.k.shape == c.tensors.v.shape == (2, 20, 3, 4)


def test_allocator_hands_out_low_ids_first_and_never_twice():
    a = BlockAllocator(4)
    assert a.allocate(0) == [] and a.num_free == 4
    assert a.allocate(2) == [0, 1]
    assert a.allocate(1) == [2]
    with pytest.raises(OutOfBlocks, match="need 2 KV blocks, 1 free of 4"):
        a.allocate(2)
    assert a.num_free == 1  # a failed allocation takes nothing
    a.free([0, 1])
    got = a.allocate(3)
    assert sorted(got) == [0, 1, 3]
    assert a.num_free == 0


def test_allocator_hands_out_the_lowest_free_ids_whatever_the_free_order():
    # Freed blocks come back in any order; the next allocation still takes the
    # lowest free ids, in order, so blocks in use stay packed at the cache start.
    a = BlockAllocator(10)
    held = a.allocate(10)
    a.free([held[i] for i in (7, 2, 9, 4)])
    a.free([held[0]])
    assert a.allocate(3) == [0, 2, 4]
    a.free([8, 1])
    assert a.allocate(4) == [1, 7, 8, 9]
    assert a.num_free == 0


def test_reserve_slots_truncate_worked_example():
    c = _cache(num_blocks=4, block_size=4)
    t = BlockTable()
    c.reserve(t, 6)
    assert t.blocks == [0, 1] and t.num_tokens == 0  # reserve does not advance
    t.num_tokens = 6
    assert c.slots(t, 0, 6) == [0, 1, 2, 3, 4, 5]
    c.reserve(t, 6)  # already has room: no-op
    assert t.blocks == [0, 1]
    c.reserve(t, 9)
    assert t.blocks == [0, 1, 2]
    t.num_tokens = 9
    c.truncate(t, 5)  # 9 -> 5 tokens: block 2 emptied
    assert t.num_tokens == 5 and t.blocks == [0, 1] and c.allocator.num_free == 2
    c.truncate(t, 4)  # 5 -> 4: block 1 emptied
    assert t.num_tokens == 4 and t.blocks == [0]
    c.truncate(t, 4)
    assert t.num_tokens == 4 and t.blocks == [0]
    with pytest.raises(ValueError):
        c.truncate(t, 5)  # cannot grow by truncating
    c.free(t)
    assert t.blocks == [] and t.num_tokens == 0 and c.allocator.num_free == 4


def test_scratch_requests_get_their_slots_and_give_the_blocks_back():
    c = _cache(num_blocks=5, block_size=4)
    live = BlockTable()
    c.reserve(live, 3)  # block 0 is a live request's
    with c.scratch(2, 5) as slots:  # two throwaway requests of 5 tokens: blocks 1-2, then 3-4
        assert slots.tolist() == [[4, 5, 6, 7, 8], [12, 13, 14, 15, 16]] and c.allocator.num_free == 0
    assert c.allocator.num_free == 4 and live.blocks == [0]
    with pytest.raises(RuntimeError):  # freed on the way out of an error too
        with c.scratch(1, 4):
            raise RuntimeError("timing failed")
    assert c.allocator.num_free == 4
    with pytest.raises(OutOfBlocks):  # the second request finds no room: the first's blocks come back
        with c.scratch(2, 9):
            pass
    assert c.allocator.num_free == 4


def test_truncating_below_zero_is_an_error():
    c = _cache(num_blocks=4, block_size=4)
    t = BlockTable()
    c.reserve(t, 3)
    t.num_tokens = 3
    with pytest.raises(ValueError):
        c.truncate(t, -1)
    assert t.num_tokens == 3 and t.blocks == [0]  # unchanged


def test_out_of_blocks_when_exhausted():
    c = _cache(num_blocks=3, block_size=2)
    a, b = BlockTable(), BlockTable()
    c.reserve(a, 4)
    with pytest.raises(OutOfBlocks):
        c.reserve(b, 3)  # needs 2, 1 free
    assert b.blocks == [] and c.allocator.num_free == 1  # nothing taken
    c.reserve(b, 2)
    with pytest.raises(OutOfBlocks):
        c.reserve(a, 5)
    assert a.blocks == [0, 1]


class KVCacheMachine(RuleBasedStateMachine):
    """Random allocate / reserve / append / truncate / free over several tables."""

    tables = Bundle("tables")

    def __init__(self) -> None:
        super().__init__()
        self.cache: PagedKVCache | None = None
        self.live: list[BlockTable] = []

    @precondition(lambda self: self.cache is None)
    @rule(num_blocks=st.integers(1, 12), block_size=st.integers(1, 5))
    def make_cache(self, num_blocks: int, block_size: int) -> None:
        self.cache = _cache(num_blocks, block_size)

    @precondition(lambda self: self.cache is not None)
    @rule(target=tables)
    def allocate_table(self) -> BlockTable:
        t = BlockTable()
        self.live.append(t)
        return t

    @precondition(lambda self: self.cache is not None)
    @rule(t=tables, extra=st.integers(0, 20))
    def reserve(self, t: BlockTable, extra: int) -> None:
        self._reserve(t, t.num_tokens + extra)

    @precondition(lambda self: self.cache is not None)
    @rule(t=tables, n=st.integers(0, 12))
    def append(self, t: BlockTable, n: int) -> None:
        if self._reserve(t, t.num_tokens + n):
            t.num_tokens += n

    @precondition(lambda self: self.cache is not None)
    @rule(t=tables, frac=st.floats(0, 1))
    def truncate(self, t: BlockTable, frac: float) -> None:
        keep = int(t.num_tokens * frac)
        self._shrink(t, keep, lambda: self.cache.truncate(t, keep))

    @precondition(lambda self: self.cache is not None)
    @rule(t=consumes(tables))
    def free(self, t: BlockTable) -> None:
        before = self.cache.allocator.num_free
        n = len(t.blocks)
        self.cache.free(t)
        assert t.blocks == [] and t.num_tokens == 0
        assert self.cache.allocator.num_free == before + n
        self.live = [x for x in self.live if x is not t]  # identity: empty tables compare equal

    # -- helpers ------------------------------------------------------------------
    def _reserve(self, t: BlockTable, total: int) -> bool:
        c = self.cache
        bs = c.block_size
        need = max(0, -(-total // bs) - len(t.blocks))
        before_free, before_blocks = c.allocator.num_free, list(t.blocks)
        if need > before_free:
            with pytest.raises(OutOfBlocks):
                c.reserve(t, total)
            assert t.blocks == before_blocks and c.allocator.num_free == before_free
            return False
        c.reserve(t, total)
        assert t.blocks[: len(before_blocks)] == before_blocks  # existing blocks stay put
        assert len(t.blocks) == len(before_blocks) + need
        assert c.allocator.num_free == before_free - need
        return True

    def _shrink(self, t: BlockTable, keep: int, op) -> None:
        c = self.cache
        bs = c.block_size
        before_blocks, before_free = list(t.blocks), c.allocator.num_free
        kept_blocks = max(-(-keep // bs), 0)
        emptied = before_blocks[kept_blocks:]
        op()
        assert t.num_tokens == keep
        assert t.blocks == before_blocks[: len(before_blocks) - len(emptied)]
        assert c.allocator.num_free == before_free + len(emptied)  # exactly the emptied blocks
        # The emptied blocks are free again: reallocating everything gets them back.
        free_now = c.allocator.allocate(c.allocator.num_free)
        assert set(emptied) <= set(free_now)
        c.allocator.free(free_now)

    # -- invariants -----------------------------------------------------------------
    @invariant()
    def no_leak_no_alias(self) -> None:
        if self.cache is None:
            return
        c = self.cache
        in_use = [b for t in self.live for b in t.blocks]
        assert len(in_use) == len(set(in_use)), "a block is in two tables"
        assert c.allocator.num_free + len(in_use) == c.params.num_blocks, "blocks leaked"
        free = c.allocator._free
        assert len(free) == len(set(free)), "a block is free twice"
        assert not set(free) & set(in_use), "a block is both free and in use"
        assert set(free) | set(in_use) == set(range(c.params.num_blocks))

    @invariant()
    def tables_hold_their_tokens(self) -> None:
        if self.cache is None:
            return
        for t in self.live:
            assert t.num_tokens >= 0
            assert len(t.blocks) * self.cache.block_size >= t.num_tokens
            if t.num_tokens:
                slots = self.cache.slots(t, 0, t.num_tokens)
                assert len(set(slots)) == len(slots)
                assert all(0 <= s < self.cache.params.num_slots for s in slots)


KVCacheMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheProperties = KVCacheMachine.TestCase


def test_written_values_survive_other_tables_traffic():
    """Values a table wrote stay in its slots while other tables come and go."""
    c = _cache(num_blocks=6, block_size=2)
    a, b = BlockTable(), BlockTable()
    c.reserve(a, 3)
    sa = c.slots(a, 0, 3)
    c.tensors.k[0, sa] = torch.arange(3.0).view(3, 1, 1).expand(3, 1, 2)
    for _ in range(3):
        c.reserve(b, 6)
        c.tensors.k[0, c.slots(b, 0, 6)] = -1.0
        c.free(b)
    assert c.tensors.k[0, sa, 0, 0].tolist() == [0.0, 1.0, 2.0]
