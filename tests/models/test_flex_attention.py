"""``runtime.attention="flex"``: attention through ``flex_attention`` over the paged cache
(specdec/core/flex.py), reading every slot in place under a mask built from the batch.

It must give the gather path's values: prefill, decode, ragged batches, a draft tree, a
window (speculative exactness over it: tests/spec/test_flex_exactness.py).
Each padded row count compiles the flex call once (seconds to tens of seconds on a busy
2-core machine): the default selection keeps one compile per model.
"""

from __future__ import annotations

import pytest
import torch

from specdec.core.flex import FlexAttend, padded_rows
from specdec.core.inputs import KVCacheTensors
from specdec.core.pipeline_model import RuntimeConfig
from specdec.models.llama import PagedAttend
from specdec.spec.tree import tree_attention_mask

from packing import pack_rows  # tests/packing.py

BLOCK, NUM_BLOCKS, H, HKV, D = 4, 16, 4, 2, 8


def _cache(seed: int) -> KVCacheTensors:
    g = torch.Generator().manual_seed(seed)
    shape = (1, NUM_BLOCKS * BLOCK, HKV, D)
    return KVCacheTensors(k=torch.randn(shape, generator=g), v=torch.randn(shape, generator=g))


def _compare(inputs, window=None, seed=0) -> None:
    """One layer's attention of ``inputs`` by flex and by SDPA over gathered keys (each on
    its own copy of the same cache): the same values, and the same cache writes."""
    g = torch.Generator().manual_seed(seed)
    t = inputs.tokens.shape[0]
    q, k, v = torch.randn(t, H, D, generator=g), torch.randn(t, HKV, D, generator=g), torch.randn(t, HKV, D, generator=g)
    a, b = _cache(seed), _cache(seed)
    flex = FlexAttend(inputs, a, window)(0, q, k, v)
    ref = PagedAttend(inputs, b, window, isolate_rows=False)(0, q, k, v)
    assert flex.shape == ref.shape == (t, H * D)
    torch.testing.assert_close(flex, ref, atol=2e-6, rtol=1e-5)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


# (tokens per request, cached before, block tables): every case packs to <= 16 rows.
CASES = {
    "prefill": ([5, 3], [0, 0], [[3, 7], [5]]),
    "decode": ([1, 1, 1], [9, 2, 6], [[3, 7, 1], [5], [0, 2]]),
    "ragged": ([4, 1, 2], [5, 11, 0], [[3, 7, 1], [5, 8, 4], [0]]),
    "one_request": ([3], [6], [[2, 9, 6]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flex_attention_equals_the_gather_path(case: str) -> None:
    lens, starts, tables = CASES[case]
    inputs = pack_rows(list(range(sum(lens))), starts, lens, tables, BLOCK)
    assert padded_rows(inputs.tokens.shape[0]) == 16  # one compiled shape for all of them
    _compare(inputs)


@pytest.mark.slow  # a compile of its own (tree / window mask)
@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
def test_flex_attention_equals_the_gather_path_on_a_draft_tree(window: int | None) -> None:
    parents = torch.tensor([[-1, -1, 0, 0, 2, 1], [-1, 0, -1, 1, 0, 0]])
    num_nodes = torch.tensor([6, 4])
    starts, lens, tables = [5, 2], [7, 5], [[3, 7, 1], [5, 0]]
    inputs = pack_rows(list(range(sum(lens))), starts, lens, tables, BLOCK)
    q = inputs.q_index.shape[1]
    inputs.tree_mask = tree_attention_mask(parents, num_nodes)[:, :q, :q]
    # Rope positions root + depth (the packer wrote key indices; q_pos keeps them).
    depth = torch.tensor([[0, 1, 1, 2, 2, 3, 2], [0, 1, 1, 2, 2, 0, 0]])
    inputs.positions = torch.cat([starts[i] + depth[i, : lens[i]] for i in range(2)])
    _compare(inputs, window)


def test_runtime_attention_is_checked() -> None:
    with pytest.raises(ValueError, match="runtime.attention must be auto or flex, got 'flash'"):
        RuntimeConfig(attention="flash")


def test_a_verified_row_gets_the_bits_it_gets_decoded_alone() -> None:
    """Row i of a 4-row verification (keys 0 … start + i) = that query decoded alone
    after the same context: what makes greedy speculation over flex exact."""
    g = torch.Generator().manual_seed(5)
    start, table = 9, [[3, 7, 1, 12]]
    q, k, v = torch.randn(4, H, D, generator=g), torch.randn(4, HKV, D, generator=g), torch.randn(4, HKV, D, generator=g)
    cache = _cache(5)
    rows = FlexAttend(pack_rows([0] * 4, [start], [4], table, BLOCK), cache, None)(0, q, k, v)
    for i in range(4):
        alone = FlexAttend(pack_rows([0], [start + i], [1], table, BLOCK), cache, None)(0, q[i : i + 1], k[i : i + 1],
                                                                                          v[i : i + 1])
        assert torch.equal(alone, rows[i : i + 1]), i


@pytest.mark.parametrize("which", ["value", "key"])
def test_a_non_finite_key_or_value_reaches_only_the_rows_that_read_it(which: str) -> None:
    """Row 1 of request 0 writes a NaN value (key), in the one 128-slot tile every row reads:
    request 0's rows from 1 on read it and go NaN (so it still fails), its row 0 and the
    other request keep their clean bits, now and in a later forward beside the stale slot."""
    lens, starts, tables = [4, 3], [5, 2], [[3, 7, 1], [5, 0]]
    inputs = pack_rows(list(range(7)), starts, lens, tables, BLOCK)
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(7, H, D, generator=g), torch.randn(7, HKV, D, generator=g), torch.randn(7, HKV, D, generator=g)
    bad_k, bad_v = k.clone(), v.clone()
    (bad_v if which == "value" else bad_k)[1, 0, 2] = float("nan")
    clean_cache, cache = _cache(0), _cache(0)
    clean = FlexAttend(inputs, clean_cache, None)(0, q, k, v)
    out = FlexAttend(inputs, cache, None)(0, q, bad_k, bad_v)
    assert torch.equal(out[0], clean[0]) and torch.equal(out[4:], clean[4:])
    assert out[1:4].isnan().any(-1).all()
    # The next decode step: request 1 beside the stale NaN-made slot, request 0 over it.
    step = pack_rows([0, 1], [9, 5], [1, 1], tables, BLOCK)
    q1, k1, v1 = q[:2], k[:2], v[:2]
    again = FlexAttend(step, cache, None)(0, q1, k1, v1)
    assert torch.equal(again[1], FlexAttend(step, clean_cache, None)(0, q1, k1, v1)[1])
    assert again[0].isnan().any()
