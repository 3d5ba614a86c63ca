"""DecoderBatchProcessor: ragged packing, index tensors, data-parallel splits."""

from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.core.batch_processor import (
    BatchProcessorRuntime,
    DecoderBatchProcessor,
    _pack_general,
    _pack_one,
    split_replicas,
)
from specdec.core.context import SamplingParams, TextContext
from specdec.core.inputs import DecoderOutputs
from specdec.core.kv_cache import BlockTable, KVCacheParams, PagedKVCache
from specdec.core.state_store import RequestStateStore, StateSpec

CACHE = "target"


def _params(block_size: int = 4, num_blocks: int = 256) -> KVCacheParams:
    return KVCacheParams(num_layers=1, num_kv_heads=1, head_dim=2, block_size=block_size, num_blocks=num_blocks)


def _processor(replicas: int = 1, block_size: int = 4, num_blocks: int = 256,
               max_batch_size: int = 16, max_seq_len: int = 64) -> DecoderBatchProcessor:
    caches = [PagedKVCache(_params(block_size, num_blocks), CACHE) for _ in range(replicas)]
    rt = BatchProcessorRuntime(kv_caches=caches, max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    return DecoderBatchProcessor(config=None, runtime=rt)


def _ctx(rid: str, tokens: list[int], cached: int, cache: PagedKVCache, replica: int = 0) -> TextContext:
    """A context whose first ``cached`` tokens are already in ``cache``."""
    c = TextContext(rid, list(tokens), len(tokens), SamplingParams(), replica=replica)
    t = BlockTable()
    c.kv[CACHE] = t
    cache.reserve(t, len(tokens))  # blocks for the whole sequence, as the scheduler does
    t.num_tokens = cached
    return c


def test_worked_example_from_inputs_docstring():
    """The two-request example of specdec.core.inputs (block size 4)."""
    p = _processor(block_size=4)
    cache = p.runtime.kv_caches[0]
    a = _ctx("a", [10, 11, 12, 13], 3, cache)  # blocks [0]
    b = _ctx("b", [20, 21], 0, cache)  # blocks [1]
    batch = p.prepare_initial_token_inputs([[a, b]])
    inp = batch.inputs
    assert inp.tokens.tolist() == [13, 20, 21]
    assert inp.positions.tolist() == [3, 0, 1]
    assert inp.slot_mapping.tolist() == [3, 4, 5]
    assert inp.gather_slots[0].tolist() == [0, 1, 2, 3]
    assert inp.gather_slots[1, :2].tolist() == [4, 5]  # the rest is padding
    assert inp.q_index.tolist() == [[0, 0], [1, 2]]
    assert inp.q_pos.tolist() == [[3, 0], [0, 1]]
    assert inp.out_index.tolist() == [0, 2, 3]
    assert inp.logit_index.tolist() == [0, 2]
    assert inp.context_lengths.tolist() == [4, 2]
    assert inp.data_parallel_splits == [0, 2]
    assert batch.num_new == [1, 2]
    assert a.processed() == 4 and b.processed() == 2


# Requests: (total tokens, already cached, chunk: None = all the rest, else a fraction).
request = st.tuples(st.integers(1, 40), st.floats(0, 1), st.one_of(st.none(), st.floats(0, 1)))


@st.composite
def batches(draw):
    replicas = draw(st.integers(1, 3))
    block_size = draw(st.integers(1, 6))
    per_replica = [draw(st.lists(request, min_size=1, max_size=5)) for _ in range(replicas)]
    n_logits = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    return replicas, block_size, per_replica, n_logits, seed


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 60), st.integers(1, 12), st.integers(0, 6), st.integers(1, 8), st.integers(1, 7),
       st.integers(1, 3), st.data())
def test_one_request_packer_gives_the_general_packers_tensors(start, fed, look, n_logits, block_size, min_q, data):
    """The batch-1 fast path must hand a (compiled) decoder exactly what the general
    packer would: every index tensor equal, with the same dtype, shape and strides
    (a stride that differs recompiles a graph), and the same host facts."""
    look = min(look, fed - 1)
    n = look + 1 if look else n_logits  # with lookahead the step returns its G + 1 rows
    ctx = start + fed
    blocks = data.draw(st.permutations(range(80)))[: -(-ctx // block_size)]
    toks = list(range(100, 100 + fed))
    a, da = _pack_general(toks, [start], [fed], [blocks], block_size, n, [look], min_q=min_q)
    b, db = _pack_one(toks, start, fed, blocks, block_size, n, look, min_q=min_q)
    for f in ("tokens", "positions", "slot_mapping", "gather_slots", "q_index", "q_pos", "out_index", "logit_index",
              "context_lengths"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride()), f
        assert torch.equal(x, y), f
    assert (da is None) == (db is None)
    if da is not None:
        assert (da.shape, da.stride()) == (db.shape, db.stride()) and torch.equal(da, db)
    assert (a.single_request, a.mask, a.attention_groups) == (b.single_request, b.mask, b.attention_groups)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_packing_properties(spec):
    replicas, block_size, per_replica, n_logits, seed = spec
    p = _processor(replicas=replicas, block_size=block_size)
    caches = p.runtime.kv_caches
    g = torch.Generator().manual_seed(seed)
    rbs: list[list[TextContext]] = []
    num_tokens: list[int] = []
    for r, reqs in enumerate(per_replica):
        rb = []
        for i, (total, cached_frac, chunk) in enumerate(reqs):
            cached = min(int(total * cached_frac), total - 1)  # at least one token to feed
            toks = torch.randint(0, 1000, (total,), generator=g).tolist()
            rb.append(_ctx(f"r{r}-{i}", toks, cached, caches[r], replica=r))
            rest = total - cached
            num_tokens.append(rest if chunk is None else max(1, int(rest * chunk)))
        rbs.append(rb)
    ctxs = [c for rb in rbs for c in rb]
    starts = [c.processed() for c in ctxs]
    tables = [list(c.kv[CACHE].blocks) for c in ctxs]
    replica_of = [c.replica for c in ctxs]

    batch = p.prepare_initial_token_inputs(rbs, return_n_logits=n_logits, num_tokens=num_tokens)
    inp = batch.inputs
    b = len(ctxs)
    t = sum(num_tokens)

    # Replica order and where each replica starts.
    assert batch.contexts == ctxs
    splits = [0]
    for rb in rbs:
        splits.append(splits[-1] + len(rb))
    assert inp.data_parallel_splits == splits
    assert batch.num_new == num_tokens

    # Tokens: each request's new tokens, concatenated; positions continue its cache.
    want_tokens, want_pos, want_slots = [], [], []
    for c, s, n, r in zip(ctxs, starts, num_tokens, replica_of):
        want_tokens += c.tokens[s : s + n]
        want_pos += list(range(s, s + n))
        want_slots += caches[r].slots(c.kv[CACHE], s, s + n)
    assert inp.tokens.tolist() == want_tokens
    assert inp.positions.tolist() == want_pos
    assert inp.slot_mapping.tolist() == want_slots
    # slot_mapping through the block tables: block of position // bs, offset position % bs.
    row = 0
    for s, n, blocks in zip(starts, num_tokens, tables):
        for k in range(n):
            pos = s + k
            assert inp.slot_mapping[row + k] == blocks[pos // block_size] * block_size + pos % block_size
        row += n
    # No two new tokens of one replica write the same slot.
    replica_of_row = torch.repeat_interleave(torch.tensor(replica_of), torch.tensor(num_tokens))
    for r in range(replicas):
        slots = inp.slot_mapping[replica_of_row == r].tolist()
        assert len(set(slots)) == len(slots)

    # Context lengths advance; gather_slots reads each request's whole context.
    assert inp.context_lengths.tolist() == [s + n for s, n in zip(starts, num_tokens)]
    for i, c in enumerate(ctxs):
        ln = starts[i] + num_tokens[i]
        assert c.processed() == ln
        assert inp.gather_slots[i, :ln].tolist() == caches[replica_of[i]].slots(c.kv[CACHE], 0, ln)
    assert inp.gather_slots.shape == (b, max(s + n for s, n in zip(starts, num_tokens)))

    # packed -> padded -> packed is the identity; padded queries carry their positions.
    q = inp.q_index.shape[1]
    assert inp.q_index.shape == inp.q_pos.shape == (b, max(num_tokens))
    x = torch.arange(t) * 7 + 3  # any per-row payload
    padded = x[inp.q_index]  # [B, Q]
    assert torch.equal(padded.reshape(-1)[inp.out_index], x)
    assert sorted(inp.out_index.tolist()) == inp.out_index.tolist()  # request-major
    off = 0
    for i, n in enumerate(num_tokens):
        assert inp.q_index[i, :n].tolist() == list(range(off, off + n))
        assert inp.q_pos[i, :n].tolist() == want_pos[off : off + n]
        assert (inp.q_pos[i, n:] == 0).all()
        assert inp.out_index[off : off + n].tolist() == list(range(i * q, i * q + n))
        # logit_index: the request's last n_logits rows (its first row repeated when short).
        want = [max(off + n - n_logits + k, off) for k in range(n_logits)]
        assert inp.logit_index[i * n_logits : (i + 1) * n_logits].tolist() == want
        off += n

    # Per-replica views re-base every index to that replica's rows.
    parts = split_replicas(inp, n_logits)
    if replicas == 1:
        assert parts == [inp]
    else:
        assert len(parts) == replicas
        for r, part in enumerate(parts):
            a, bb = splits[r], splits[r + 1]
            rows = [i for i in range(b) if a <= i < bb]
            toks = [tok for i in rows for tok in ctxs[i].tokens[starts[i] : starts[i] + num_tokens[i]]]
            assert part.tokens.tolist() == toks
            y = torch.arange(len(toks))
            assert torch.equal(y[part.q_index].reshape(-1)[part.out_index], y)
            assert part.logit_index.numel() == len(rows) * n_logits
            assert part.logit_index.max() < len(toks)
            assert part.data_parallel_splits == [0, len(rows)]

    # process_outputs: rows per request.
    v = 5
    logits = torch.randn(b * n_logits, v)
    out = p.process_outputs([DecoderOutputs(logits=logits, hidden_states=torch.zeros(b * n_logits, 2))], batch)
    assert out.logit_offsets.tolist() == [i * n_logits for i in range(b + 1)]


def test_replica_batches_must_match_degree():
    p = _processor(replicas=2)
    c = _ctx("a", [1, 2, 3], 0, p.runtime.kv_caches[0])
    with pytest.raises(ValueError, match="data-parallel degree 2"):
        p.prepare_initial_token_inputs([[c]])
    with pytest.raises(ValueError, match="data-parallel degree 2"):
        p.prepare_initial_token_inputs([[c], [], []])
    assert c.processed() == 0  # nothing advanced


def test_empty_batch_and_bad_chunks_are_errors():
    p = _processor()
    with pytest.raises(ValueError, match="empty"):
        p.prepare_initial_token_inputs([[]])
    c = _ctx("req-7", [1, 2, 3], 2, p.runtime.kv_caches[0])
    with pytest.raises(ValueError, match="req-7"):
        p.prepare_initial_token_inputs([[c]], num_tokens=[2])  # only 1 unprocessed
    with pytest.raises(ValueError):
        p.prepare_initial_token_inputs([[c]], num_tokens=[0])


def test_split_replicas_with_an_empty_replica():
    """Under data parallelism one replica may have nothing to run this step."""
    p = _processor(replicas=2)
    a = _ctx("a", [1, 2, 3], 0, p.runtime.kv_caches[0], replica=0)
    batch = p.prepare_initial_token_inputs([[a], []])
    assert batch.inputs.data_parallel_splits == [0, 1, 1]
    parts = split_replicas(batch.inputs, 1)
    assert len(parts) == 2
    assert parts[0].tokens.tolist() == [1, 2, 3]
    assert parts[1].tokens.numel() == 0


def test_lookahead_placeholders():
    p = _processor(block_size=2)
    cache = p.runtime.kv_caches[0]
    a = _ctx("a", [5, 6, 7], 2, cache)
    cache.reserve(a.kv[CACHE], 3 + 2)
    b = _ctx("b", [8, 9], 0, cache)
    cache.reserve(b.kv[CACHE], 2 + 2)
    batch = p.prepare_initial_token_inputs([[a, b]], lookahead=2, return_n_logits=3)
    assert batch.inputs.tokens.tolist() == [7, 0, 0, 8, 9, 0, 0]
    assert batch.inputs.positions.tolist() == [2, 3, 4, 0, 1, 2, 3]
    assert batch.draft_index.tolist() == [[1, 2], [5, 6]]
    assert batch.inputs.logit_index.tolist() == [0, 1, 2, 4, 5, 6]
    assert batch.num_new == [1, 2] and batch.lookahead == [2, 2]
    assert a.processed() == 5 and b.processed() == 4


def test_ragged_lookahead_pads_logits_and_draft_rows_within_each_request():
    p = _processor(block_size=2)
    cache = p.runtime.kv_caches[0]
    a = _ctx("a", [5, 6, 7], 2, cache)
    cache.reserve(a.kv[CACHE], 3 + 2)
    b = _ctx("b", [8, 9], 0, cache)
    cache.reserve(b.kv[CACHE], 2)
    c = _ctx("c", [4], 0, cache)
    cache.reserve(c.kv[CACHE], 1 + 1)
    batch = p.prepare_initial_token_inputs([[a, b, c]], lookahead=[2, 0, 1], return_n_logits=3)
    # rows: a7 a_ph a_ph | b8 b9 | c4 c_ph -- no placeholder row for b
    assert batch.inputs.tokens.tolist() == [7, 0, 0, 8, 9, 4, 0]
    assert batch.inputs.positions.tolist() == [2, 3, 4, 0, 1, 0, 1]
    # Logits: the last real row, then the placeholders; padded by repeating the last row.
    assert batch.inputs.logit_index.view(3, 3).tolist() == [[0, 1, 2], [4, 4, 4], [5, 6, 6]]
    # Placeholder rows; padding points at the request's last real row (a write there puts its token back).
    assert batch.draft_index.tolist() == [[1, 2], [4, 4], [6, 5]]
    assert batch.lookahead == [2, 0, 1]
    assert (a.processed(), b.processed(), c.processed()) == (5, 2, 2)
    with pytest.raises(ValueError, match="one count"):
        p.prepare_initial_token_inputs([[a, b]], lookahead=[1])


def test_state_store_slots_are_packed_with_the_batch():
    p = _processor(block_size=4)
    cache = p.runtime.kv_caches[0]
    a, b = _ctx("a", [1, 2, 3], 0, cache), _ctx("b", [4, 5], 0, cache)
    assert p.prepare_initial_token_inputs([[a, b]]).state_slots is None  # no store: no slots
    a.tokens.append(6)
    b.tokens.append(7)
    store = RequestStateStore([StateSpec("feature", torch.float32, (2,))], max_batch_size=4)
    p.state_store = store
    with pytest.raises(ValueError, match="'a'"):  # a request without a slot cannot be packed
        p.prepare_initial_token_inputs([[a, b]])
    b.slot, a.slot = store.allocate("b"), store.allocate("a")  # slots in another order than the batch
    store.scatter("feature", torch.tensor([a.slot, b.slot]), torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    packed = p.prepare_initial_token_inputs([[a, b]])
    assert packed.state_slots.tolist() == [a.slot, b.slot] == [1, 0]
    assert store.gather("feature", packed.state_slots).tolist() == [[1.0, 1.0], [2.0, 2.0]]


def test_mask_kind_is_decided_on_the_host():
    from specdec.core.inputs import MaskKind

    p = _processor(block_size=4)
    cache = p.runtime.kv_caches[0]
    fresh = _ctx("fresh", [1, 2, 3], 0, cache)
    assert p.prepare_initial_token_inputs([[fresh]]).inputs.mask == MaskKind.CAUSAL
    fresh.tokens.append(4)
    decode = p.prepare_initial_token_inputs([[fresh]]).inputs
    assert decode.mask == MaskKind.NONE and decode.single_request
    fresh.tokens.append(5)
    cache.reserve(fresh.kv[CACHE], 5 + 2)
    verify = p.prepare_initial_token_inputs([[fresh]], lookahead=2, return_n_logits=3).inputs
    assert verify.mask == MaskKind.EXPLICIT  # queries mid-context: keys past each one are masked
    other = _ctx("other", [7], 0, cache)
    fresh.kv[CACHE].num_tokens = 5  # the two placeholders rolled back, as after a step
    fresh.tokens.append(6)
    both = p.prepare_initial_token_inputs([[fresh, other]]).inputs
    assert both.mask == MaskKind.EXPLICIT and not both.single_request
    # Prompts only, each fed from 0: causal without a mask, however many.
    prompts = p.prepare_initial_token_inputs([[_ctx("p1", [1, 2, 3], 0, cache), _ctx("p2", [4, 5], 0, cache)]]).inputs
    assert prompts.mask == MaskKind.CAUSAL and not prompts.single_request


def test_move_tensors_moves_every_tensor_field_and_nested_inputs():
    from specdec.core.inputs import move_tensors
    from specdec.spec.proposers.draft_model import DraftModelBatch

    p = _processor(block_size=4)
    cache = p.runtime.kv_caches[0]
    inputs = p.prepare_initial_token_inputs([[_ctx("a", [1, 2, 3], 0, cache)]]).inputs
    assert move_tensors(inputs, "cpu") is inputs  # nothing to move: the same object
    batch = DraftModelBatch(gamma=2, num_draft=torch.tensor([2]), first_position=torch.tensor([3]),
                            catch_up=inputs, step_positions=torch.tensor([[3]]))
    moved = move_tensors(batch, "meta")  # a device every build has
    assert moved.num_draft.device.type == "meta" and moved.step_positions.device.type == "meta"
    assert moved.catch_up.tokens.device.type == "meta" and moved.catch_up.gather_slots.device.type == "meta"
    assert moved.gamma == 2 and moved.catch_up.mask == inputs.mask
    assert batch.num_draft.device.type == "cpu"  # the original is left alone


def test_a_prompt_beside_decoding_requests_attends_in_its_own_group():
    from specdec.core.batch_processor import attention_split

    assert attention_split([1, 1, 1, 100], [140, 140, 140, 100]) == 3  # the docstring's example
    assert attention_split([5] * 16, [140] * 16) is None  # uniform: nothing to save
    assert attention_split([100], [100]) is None
    assert attention_split([1, 2], [30, 30]) is None  # too little to pay for a second call per layer
    p = _processor(block_size=4, max_seq_len=256)
    cache = p.runtime.kv_caches[0]
    decoding = [_ctx(f"d{i}", list(range(1, 60 + i)), 58 + i, cache) for i in range(3)]  # 1 new token each
    prompt = _ctx("p", list(range(1, 151)), 0, cache)
    inp = p.prepare_initial_token_inputs([decoding + [prompt]]).inputs
    assert inp.attention_groups is not None
    first, second = inp.attention_groups
    # (decoding: one padding query; the prompt alone: its causal fast path, no padding)
    assert first.q_index.shape == (3, 2) and first.gather_slots.shape == (3, 61) and first.mask.name == "EXPLICIT"
    assert second.single_request and second.mask.name == "CAUSAL" and second.q_index.shape == (1, 150)
    # The groups' rows, in order, are the batch's rows; each group's indices count from its own first row.
    for f in ("tokens", "positions", "slot_mapping"):
        assert torch.equal(torch.cat([getattr(first, f), getattr(second, f)]), getattr(inp, f)), f
    assert second.q_index[0].tolist() == list(range(150))
    assert first.gather_slots.tolist() == inp.gather_slots[:3, :61].tolist()
    # A decoding request alone in its group gets a copy whose outputs nothing reads, so no
    # group on the general path holds one request (a compiled graph specialises a size of 1).
    d = _ctx("d", list(range(1, 60)), 58, cache)
    fresh = [_ctx(f"q{i}", list(range(1, 151)), 0, cache) for i in range(2)]
    lone, prompts = p.prepare_initial_token_inputs([[d] + fresh]).inputs.attention_groups
    assert lone.q_index.shape == (2, 2) and not lone.single_request and lone.mask.name == "EXPLICIT"
    assert torch.equal(lone.q_index[0], lone.q_index[1]) and torch.equal(lone.gather_slots[0], lone.gather_slots[1])
    assert lone.out_index.tolist() == [0]  # the first copy's query only
    assert prompts.q_index.shape == (2, 150) and prompts.mask.name == "CAUSAL" and not prompts.single_request
    # A batch of prompts alike stays one group.
    alike = [_ctx(f"a{i}", list(range(1, 30)), 0, cache) for i in range(4)]
    assert p.prepare_initial_token_inputs([alike]).inputs.attention_groups is None


# -- a plain decode step of one request: the reused step buffers ----------------------


_FIELDS = ("tokens", "positions", "slot_mapping", "gather_slots", "q_index", "q_pos", "out_index", "logit_index",
           "context_lengths")


def _twin(c: TextContext) -> TextContext:
    """A copy of ``c`` on the same blocks (not allocated again), to pack the general way."""
    t = TextContext(c.request_id, list(c.tokens), c.prompt_len, c.sampling)
    t.kv[CACHE] = BlockTable(list(c.kv[CACHE].blocks), c.kv[CACHE].num_tokens)
    return t


def test_pack_decode_gives_the_general_packing_step_after_step():
    """Two requests on interleaved blocks decode by turns, across block boundaries, past the
    slot buffer's first size (max_seq_len 8) and after one is cut back and given new blocks:
    every step's reused inputs equal what prepare_initial_token_inputs packs for it, and the
    request's table advances the same way."""
    p = _processor(block_size=4, max_seq_len=8)
    cache = p.runtime.kv_caches[0]
    a = _ctx("a", [1, 2, 3], 2, cache)
    b = _ctx("b", [7, 8, 9, 10, 11], 4, cache)
    steps = [a, b, a, b, a, a, a, a, b, b, b, b, b, b, a, a, a]
    for i, c in enumerate(steps):
        if i == 9:  # cut b back to 2 tokens and hand it fresh blocks (its old slots freed)
            cache.reserve(a.kv[CACHE], len(a.tokens) + 12)
            cache.truncate(b.kv[CACHE], 2)
            del b.tokens[3:]
        cache.reserve(c.kv[CACHE], len(c.tokens))
        ref = p.prepare_initial_token_inputs([[_twin(c)]]).inputs
        got = p.pack_decode(c)
        assert got is not None
        for f in _FIELDS:
            g, r = getattr(got, f), getattr(ref, f)
            assert g.shape == r.shape and g.dtype == r.dtype and torch.equal(g, r), (i, f, g, r)
        assert (got.single_request, got.mask, got.data_parallel_splits) == (
            ref.single_request, ref.mask, ref.data_parallel_splits)
        assert c.kv[CACHE].num_tokens == len(c.tokens)
        c.tokens.append(100 + i)  # the step's new token, fed by the next step of c


def test_pack_decode_leaves_other_steps_to_the_general_packing():
    """None (pack the general way) for a request with more than one token to feed, and on a
    data-parallel processor; the table is left as it was."""
    p = _processor()
    c = _ctx("a", [1, 2, 3], 1, p.runtime.kv_caches[0])
    assert p.pack_decode(c) is None and c.kv[CACHE].num_tokens == 1
    dp = _processor(replicas=2)
    d = _ctx("d", [1, 2, 3], 2, dp.runtime.kv_caches[0])
    assert dp.pack_decode(d) is None and d.kv[CACHE].num_tokens == 2
