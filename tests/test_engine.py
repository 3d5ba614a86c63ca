"""The continuous-batching engine over PlainGeneration: batching never changes outputs.

Every engine here serves a tiny random Llama (Llama 3 rope scaling) saved with
``save_pretrained``; greedy references come from transformers' ``generate``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.core.context import SamplingParams, Status
from specdec.core.kv_cache import BlockAllocator
from specdec.core.pipeline_model import PlainGeneration, RuntimeConfig, registered_pipeline_model
from specdec.engine import Engine, EngineConfig

from engine_helpers import generate_ids  # tests/engine_helpers.py

MAX_SEQ = 256
BLOCK = 8
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1234, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return hf_checkpoint("llama")


@pytest.fixture(scope="module")
def _shared_pipeline(ckpt):
    path, _ = ckpt
    return registered_pipeline_model(path, RuntimeConfig(max_batch_size=16, max_seq_len=MAX_SEQ, block_size=BLOCK))


def _reset(pm):
    """A fresh allocator, so a failed test's leftovers cannot leak into the next."""
    for cache in pm.caches:
        cache.allocator = BlockAllocator(cache.params.num_blocks)
    return pm


@pytest.fixture
def big_pipeline(_shared_pipeline):
    """Room for 16 full sequences: never preempts. Shared by the module's tests."""
    return _reset(_shared_pipeline)


def _engine(pm, max_batch_size: int = 16, max_tokens_per_step: int = 2048, **kw) -> Engine:
    return Engine(
        PlainGeneration(pm, pm.processor.runtime.max_seq_len),
        EngineConfig(max_batch_size=max_batch_size, max_tokens_per_step=max_tokens_per_step),
        **kw,
    )


def _assert_all_free(pm) -> None:
    for cache in pm.caches:
        assert cache.allocator.num_free == cache.params.num_blocks, "KV blocks leaked"


def _prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _run(pm, prompts, params, **engine_kw) -> tuple[list, Engine]:
    engine = _engine(pm, **engine_kw)
    ctxs = generate_ids(engine, prompts, params)
    _assert_all_free(pm)
    return ctxs, engine


def _alone(pm, prompt, params) -> list[int]:
    (ctx,), _ = _run(pm, [prompt], params)
    assert ctx.error is None
    return ctx.generated


# -- batched == alone == transformers -------------------------------------------------


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 200), min_size=1, max_size=16),
    new_tokens=st.lists(st.integers(1, 12), min_size=16, max_size=16),
    max_batch_size=st.integers(1, 16),
    max_tokens_per_step=st.sampled_from([2048, 300, 64]),
    seed=st.integers(0, 2**16),
)
def test_batched_equals_alone_equals_transformers(
    lengths, new_tokens, max_batch_size, max_tokens_per_step, seed, big_pipeline, ckpt, hf_greedy
):
    _, hf = ckpt
    prompts = _prompts(seed, lengths, hf.config.vocab_size)
    params = [SamplingParams(max_new_tokens=new_tokens[i], ignore_eos=True) for i in range(len(prompts))]
    ctxs, engine = _run(big_pipeline, prompts, params, max_batch_size=max_batch_size,
                        max_tokens_per_step=max_tokens_per_step)
    assert engine.stats.preemptions == 0
    assert max(engine.stats.step_batch_sizes) <= max_batch_size
    assert engine.stats.tokens_generated == sum(new_tokens[: len(prompts)])
    for p, sp, c in zip(prompts, params, ctxs):
        assert c.status is Status.FINISHED and c.finish_reason == "length", c.error
        assert len(c.generated) == sp.max_new_tokens
        assert c.tokens[: len(p)] == p
        assert c.generated == hf_greedy(hf, p, sp.max_new_tokens), f"{c.request_id}: differs from HF"
        assert c.generated == _alone(big_pipeline, p, sp), f"{c.request_id}: batched != alone"


def test_seeded_sampling_same_alone_and_in_batch(big_pipeline, ckpt):
    _, hf = ckpt
    v = hf.config.vocab_size
    target = _prompts(1, [37], v)[0]
    alone = _alone(big_pipeline, target, SAMPLED)
    assert len(alone) == SAMPLED.max_new_tokens
    # In a batch with greedy and differently-sampled neighbours, placed in the middle.
    others = _prompts(2, [5, 120, 1, 64], v)
    prompts = others[:2] + [target] + others[2:]
    params = [
        GREEDY,
        SamplingParams(temperature=1.3, top_k=5, seed=7, max_new_tokens=9, ignore_eos=True),
        SAMPLED,
        SamplingParams(temperature=0.5, top_p=0.5, max_new_tokens=3, ignore_eos=True),  # engine-drawn seed
        GREEDY,
    ]
    ctxs, _ = _run(big_pipeline, prompts, params, max_batch_size=4)
    assert ctxs[2].generated == alone
    # The seed matters (a different one gives a different continuation) and
    # sampling is not secretly greedy.
    reseeded = _alone(big_pipeline, target, SamplingParams(**{**SAMPLED.__dict__, "seed": 99}))
    greedy = _alone(big_pipeline, target, GREEDY)
    assert reseeded != alone or greedy != alone


def test_top_k_larger_than_vocab_is_no_cut(big_pipeline, ckpt):
    """top_k >= vocab keeps every token (as if top_k were 0) instead of failing."""
    _, hf = ckpt
    prompt = _prompts(3, [10], hf.config.vocab_size)[0]
    base = SamplingParams(temperature=0.8, seed=5, max_new_tokens=6, ignore_eos=True)
    big_k = SamplingParams(temperature=0.8, seed=5, top_k=10 * hf.config.vocab_size, max_new_tokens=6, ignore_eos=True)
    engine = _engine(big_pipeline)
    a = engine.add_request(prompt, base, "no-top-k")
    b = engine.add_request(prompt, big_k, "huge-top-k")
    engine.run()
    _assert_all_free(big_pipeline)
    assert b.error is None and b.generated == a.generated


# -- preemption, chunked prefill, data parallelism ------------------------------------


def _workload(vocab: int):
    prompts = _prompts(4, [30, 9, 45, 17, 3, 26], vocab)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (16, 12, 8, 16, 14, 10)]
    params[3] = SamplingParams(temperature=0.9, top_k=30, seed=11, max_new_tokens=16, ignore_eos=True)
    return prompts, params


def _outputs(ctxs) -> list[list[int]]:
    for c in ctxs:
        assert c.status is Status.FINISHED, (c.request_id, c.error)
    return [c.generated for c in ctxs]


@pytest.fixture(scope="module")
def reference_outputs(_shared_pipeline, ckpt):
    _, hf = ckpt
    prompts, params = _workload(hf.config.vocab_size)
    ctxs, engine = _run(_reset(_shared_pipeline), prompts, params)
    assert engine.stats.preemptions == 0
    return _outputs(ctxs)


def test_preemption_when_kv_blocks_run_out(ckpt, reference_outputs):
    path, hf = ckpt
    prompts, params = _workload(hf.config.vocab_size)
    # 8 blocks of 8 tokens: the longest request (61 tokens) fits alone, all six do not.
    pm = registered_pipeline_model(path, RuntimeConfig(max_batch_size=8, max_seq_len=128, block_size=8, num_blocks=8))
    ctxs, engine = _run(pm, prompts, params, max_batch_size=8)
    assert engine.stats.preemptions > 0
    assert _outputs(ctxs) == reference_outputs


@pytest.mark.parametrize("budget", [1, 7, 32])
def test_chunked_prefill_identical(budget, big_pipeline, ckpt, reference_outputs):
    _, hf = ckpt
    prompts, params = _workload(hf.config.vocab_size)
    ctxs, engine = _run(big_pipeline, prompts, params, max_batch_size=4, max_tokens_per_step=budget)
    assert _outputs(ctxs) == reference_outputs
    # Prefill was really split: more steps than the longest request needs unchunked.
    assert engine.stats.steps > max(p.max_new_tokens for p in params)


def test_chunked_prefill_with_preemption(ckpt, reference_outputs):
    path, hf = ckpt
    prompts, params = _workload(hf.config.vocab_size)
    pm = registered_pipeline_model(path, RuntimeConfig(max_batch_size=8, max_seq_len=128, block_size=8, num_blocks=9))
    ctxs, engine = _run(pm, prompts, params, max_batch_size=8, max_tokens_per_step=5)
    assert _outputs(ctxs) == reference_outputs


def test_preempted_request_holding_no_blocks_does_not_stall_the_step(ckpt):
    """A step whose every scheduled request is preempted still makes progress.

    A long prompt is mid-prefill (one token a step) and holds 3 of the 4
    blocks; a one-token prompt arrives and fits the last block. Decoding, it is
    scheduled first and takes the whole step budget until it needs a second
    block: it is the newest, so it is preempted, and the engine must run the
    long prompt instead of packing an empty batch (or spinning). It then waits
    (no room to recompute) until the long one is done: one preemption only.
    """
    path, hf = ckpt
    pm = registered_pipeline_model(path, RuntimeConfig(max_batch_size=4, max_seq_len=64, block_size=4, num_blocks=4))
    engine = _engine(pm, max_batch_size=4, max_tokens_per_step=1)
    a = engine.add_request(list(range(1, 13)), SamplingParams(max_new_tokens=1, ignore_eos=True), "long")
    for _ in range(9):
        engine.step()
    assert a.processed() == 9 and pm.caches[0].allocator.num_free == 1
    b = engine.add_request([5], SamplingParams(max_new_tokens=6, ignore_eos=True), "short")
    for _ in range(50):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work()
    assert a.status is b.status is Status.FINISHED
    assert engine.stats.preemptions == 1
    ref_pm = registered_pipeline_model(path, RuntimeConfig(max_batch_size=2, max_seq_len=64, block_size=4))
    assert a.generated == _alone(ref_pm, a.tokens[: a.prompt_len], a.sampling)
    assert b.generated == _alone(ref_pm, [5], b.sampling)
    _assert_all_free(pm)


def test_a_request_arriving_at_a_full_cache_waits_for_room(ckpt):
    """Admission leaves the running requests room for their next steps: a request
    that would only be preempted at once stays queued until blocks come back."""
    path, _ = ckpt
    pm = registered_pipeline_model(path, RuntimeConfig(max_batch_size=4, max_seq_len=64, block_size=4, num_blocks=3))
    engine = _engine(pm, max_batch_size=4, max_tokens_per_step=1)
    a = engine.add_request(list(range(1, 13)), SamplingParams(max_new_tokens=1, ignore_eos=True), "long")
    for _ in range(9):
        engine.step()
    assert pm.caches[0].allocator.num_free == 0
    b = engine.add_request([5], SamplingParams(max_new_tokens=2, ignore_eos=True), "short")
    engine.step()
    assert b.status is Status.WAITING and a.processed() == 10
    engine.run()
    assert a.status is b.status is Status.FINISHED and engine.stats.preemptions == 0
    ref_pm = registered_pipeline_model(path, RuntimeConfig(max_batch_size=2, max_seq_len=64, block_size=4))
    assert b.generated == _alone(ref_pm, [5], b.sampling)
    _assert_all_free(pm)


@pytest.mark.parametrize(
    "max_new",
    [(8, 8, 8, 8, 8, 8), (16, 12, 8, 16, 14, 10), (16, 3, 8, 2, 14, 4)],
    ids=["same-lengths", "uneven-lengths", "one-replica-finishes-first"],
)
def test_data_parallel_two_replicas_identical(max_new, ckpt, reference_outputs):
    """Requests alternate between replicas (0, 1, 0, ...); in the last case
    replica 1's requests all finish while replica 0 still has work."""
    path, hf = ckpt
    prompts, params = _workload(hf.config.vocab_size)
    params = [SamplingParams(**{**p.__dict__, "max_new_tokens": n}) for p, n in zip(params, max_new)]
    pm = registered_pipeline_model(
        path, RuntimeConfig(max_batch_size=8, max_seq_len=128, block_size=8, data_parallel_degree=2)
    )
    assert len(pm.modules) == 2 and len(pm.caches) == 2
    ctxs, engine = _run(pm, prompts, params, max_batch_size=8, num_replicas=2)
    assert [c.replica for c in ctxs] == [0, 1, 0, 1, 0, 1]
    # A prefix of the reference: greedy and seeded sampling do not depend on max_new_tokens.
    assert _outputs(ctxs) == [r[:n] for r, n in zip(reference_outputs, max_new)]


def test_data_parallel_needs_supporting_decoder(ckpt):
    from specdec.core.checkpoint import load_decoder
    from specdec.models.llama import LlamaDecoder

    class NoDP(LlamaDecoder):
        supports_data_parallel = False

    path, _ = ckpt
    loaded = load_decoder(path)
    loaded.module.__class__ = NoDP
    with pytest.raises(ValueError, match="NoDP"):
        registered_pipeline_model(loaded, RuntimeConfig(max_seq_len=32, data_parallel_degree=2))


# -- bad requests are rejected, the rest of the batch completes -----------------------


def test_bad_requests_rejected_by_id(big_pipeline, ckpt, hf_greedy):
    _, hf = ckpt
    v = hf.config.vocab_size
    good = _prompts(5, [12, 40], v)
    bad = {
        "too-long": ([1] * MAX_SEQ, GREEDY, "max_seq_len"),
        "way-too-long": ([1] * (MAX_SEQ + 50), GREEDY, "max_seq_len"),
        "empty": ([], GREEDY, "empty prompt"),
        "oov-high": ([1, v, 2], GREEDY, "vocabulary"),
        "oov-negative": ([1, -1, 2], GREEDY, "vocabulary"),
        "not-int": ([1, 2.5], GREEDY, "integers"),
        "neg-temp": ([1, 2], SamplingParams(temperature=-0.5), "temperature"),
        "nan-temp": ([1, 2], SamplingParams(temperature=float("nan")), "temperature"),
        "top-p-zero": ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        "top-p-big": ([1, 2], SamplingParams(top_p=1.5), "top_p"),
        "neg-top-k": ([1, 2], SamplingParams(top_k=-1), "top_k"),
        "zero-new": ([1, 2], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        "bad-seed": ([1, 2], SamplingParams(seed=-3), "seed"),
        "bool-token": ([1, True, 2], GREEDY, "not bool"),
        "bool-tensor": (torch.tensor([True, False]), GREEDY, "not bool"),
        "bytes": (b"\x01\x02", GREEDY, "got bytes"),
        "text": ("12", GREEDY, "got str"),
        "none": (None, GREEDY, "got NoneType"),
        "int": (7, GREEDY, "got int"),
        "frac-new": ([1, 2], SamplingParams(max_new_tokens=2.5), "sampling.max_new_tokens"),
        "frac-top-k": ([1, 2], SamplingParams(top_k=2.5), "sampling.top_k"),
        "frac-seed": ([1, 2], SamplingParams(seed=1.5), "sampling.seed"),
        "inf-temp": ([1, 2], SamplingParams(temperature=float("inf")), "sampling.temperature"),
        "str-temp": ([1, 2], SamplingParams(temperature="hot"), "sampling.temperature"),
        "int-stop": ([1, 2], SamplingParams(stop_token_ids=5), "sampling.stop_token_ids"),
        "not-params": ([1, 2], {"temperature": 0.5}, "must be a SamplingParams"),
    }
    engine = _engine(big_pipeline)
    g0 = engine.add_request(good[0], GREEDY, "good-0")
    rejected = {rid: engine.add_request(p, sp, rid) for rid, (p, sp, _) in bad.items()}
    dup = engine.add_request(good[1], GREEDY, "good-0")  # a live id: the two would share per-request state
    assert dup.status is Status.REJECTED and "'good-0'" in dup.error and "already queued or running" in dup.error
    g1 = engine.add_request(good[1], GREEDY, "good-1")
    for rid, ctx in rejected.items():
        assert ctx.status is Status.REJECTED and ctx.finish_reason == "error"
        assert f"'{rid}'" in ctx.error and bad[rid][2] in ctx.error, ctx.error
        assert ctx.generated == []
    assert len(engine.waiting) == 2  # rejected requests never queue
    engine.run()
    _assert_all_free(big_pipeline)
    for ctx, p in ((g0, good[0]), (g1, good[1])):
        assert ctx.status is Status.FINISHED
        assert ctx.generated == hf_greedy(hf, p, GREEDY.max_new_tokens)
    assert {c.request_id for c in engine.finished} == set(bad) | {"good-0", "good-1"}


def test_longest_prompt_that_fits(big_pipeline, ckpt):
    """A prompt of max_seq_len - 1 tokens fits and stops at max_seq_len ("length")."""
    _, hf = ckpt
    prompt = _prompts(6, [MAX_SEQ - 3], hf.config.vocab_size)[0]
    (ctx,), _ = _run(big_pipeline, [prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert ctx.finish_reason == "length" and len(ctx.tokens) == MAX_SEQ and len(ctx.generated) == 3


# -- stop conditions ------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_reference(_shared_pipeline, ckpt):
    """A prompt and its 24 greedy tokens, and a token first seen at index >= 3."""
    _, hf = ckpt
    _reset(_shared_pipeline)
    for seed in range(100):
        prompt = _prompts(100 + seed, [15], hf.config.vocab_size)[0]
        ref = _alone(_shared_pipeline, prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
        for k in range(3, len(ref)):
            if ref[k] not in ref[:k]:
                return prompt, ref, k
    pytest.fail("no prompt with a fresh token after position 3")


def test_stops_at_eos(big_pipeline, long_reference):
    prompt, ref, k = long_reference
    eos = ref[k]
    engine = _engine(big_pipeline, eos_token_ids=(eos,))
    c = engine.add_request(prompt, SamplingParams(max_new_tokens=24))
    c_ignore = engine.add_request(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
    engine.run()
    assert c.finish_reason == "eos" and c.generated == ref[: k + 1]  # EOS kept, nothing after
    assert c_ignore.finish_reason == "length" and c_ignore.generated == ref
    assert engine.stats.tokens_generated == k + 1 + 24
    _assert_all_free(big_pipeline)


def test_stops_at_stop_id(big_pipeline, long_reference):
    prompt, ref, k = long_reference
    (c,), _ = _run(big_pipeline, [prompt], SamplingParams(max_new_tokens=24, stop_token_ids=(12345, ref[k])))
    assert c.finish_reason == "stop" and c.generated == ref[: k + 1]


@pytest.mark.parametrize("n", [1, 2, 7])
def test_stops_at_max_new_tokens(n, big_pipeline, long_reference):
    prompt, ref, _ = long_reference
    (c,), _ = _run(big_pipeline, [prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))
    assert c.finish_reason == "length" and c.generated == ref[:n]


def test_engine_config_validates():
    with pytest.raises(ValueError, match="max_batch_size"):
        EngineConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        EngineConfig(max_tokens_per_step=0)
    with pytest.raises(ValueError, match="data_parallel_degree"):
        RuntimeConfig(data_parallel_degree=0)


def test_data_parallel_balances_requests_arriving_between_steps(ckpt):
    """Requests added one at a time between steps still alternate replicas."""
    path, hf = ckpt
    pm = registered_pipeline_model(
        path, RuntimeConfig(max_batch_size=8, max_seq_len=64, block_size=8, data_parallel_degree=2)
    )
    engine = _engine(pm, max_batch_size=8, num_replicas=2)
    ctxs = []
    for p in _prompts(7, [5, 9, 3, 12], hf.config.vocab_size):
        ctxs.append(engine.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True)))
        engine.step()
    engine.run()
    assert [c.replica for c in ctxs] == [0, 1, 0, 1]
    ref_pm = registered_pipeline_model(path, RuntimeConfig(max_batch_size=2, max_seq_len=64, block_size=8))
    for c in ctxs:
        assert c.generated == _alone(ref_pm, c.tokens[: c.prompt_len], c.sampling)
    _assert_all_free(pm)


def test_integer_like_prompts_accepted(big_pipeline, ckpt):
    """numpy and torch integer prompts are token ids like any list of ints."""
    import numpy as np

    _, hf = ckpt
    prompt = _prompts(8, [11], hf.config.vocab_size)[0]
    want = _alone(big_pipeline, prompt, GREEDY)
    engine = _engine(big_pipeline)
    a = engine.add_request(np.asarray(prompt, dtype=np.int64), GREEDY, "numpy")
    b = engine.add_request(torch.tensor(prompt), GREEDY, "torch")
    c = engine.add_request([1, 2.5, 3], GREEDY, "float")
    engine.run()
    assert a.error is None and a.generated == want
    assert b.error is None and b.generated == want
    assert all(type(t) is int for t in a.tokens + b.tokens)
    assert c.status is Status.REJECTED and "float" in c.error and "2.5" in c.error
    _assert_all_free(big_pipeline)


def test_data_parallel_with_preemption(ckpt, reference_outputs):
    """Each replica has its own small cache: preemption per replica, same outputs."""
    path, hf = ckpt
    prompts, params = _workload(hf.config.vocab_size)
    pm = registered_pipeline_model(
        path, RuntimeConfig(max_batch_size=8, max_seq_len=128, block_size=8, num_blocks=9, data_parallel_degree=2)
    )
    ctxs, engine = _run(pm, prompts, params, max_batch_size=8, num_replicas=2, max_tokens_per_step=40)
    assert engine.stats.preemptions > 0
    assert _outputs(ctxs) == reference_outputs


def test_request_too_big_for_the_whole_cache_is_rejected_alone(ckpt):
    """A request that cannot fit even with the cache to itself is rejected by id;
    the requests around it still complete."""
    path, _ = ckpt
    # 4 blocks of 4 tokens = 16 slots; a 30-token prompt can never fit.
    pm = registered_pipeline_model(path, RuntimeConfig(max_batch_size=4, max_seq_len=64, block_size=4, num_blocks=4))
    engine = _engine(pm, max_batch_size=4)
    small = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True), "small")
    big = engine.add_request(list(range(1, 31)), SamplingParams(max_new_tokens=4, ignore_eos=True), "big")
    assert big.status is Status.REJECTED  # at admission, before it generated anything
    assert "'big'" in big.error and "need 9 KV blocks" in big.error and "which has 4" in big.error, big.error
    engine.run()
    assert small.finish_reason == "length" and small.num_generated == 4
    assert big.generated == []
    assert pm.caches[0].allocator.num_free == 4  # nothing leaked


def test_blocks_held_outside_the_engine_reject_a_request_alone_instead_of_spinning(ckpt):
    """A request that fits the empty cache but cannot get blocks with nothing
    else running (another holder has them) is rejected by id; the engine does
    not preempt and readmit it forever."""
    from specdec.core.context import TextContext

    path, _ = ckpt
    pm = registered_pipeline_model(path, RuntimeConfig(max_batch_size=4, max_seq_len=64, block_size=4, num_blocks=4))
    holder = TextContext(request_id="other", tokens=[1] * 12, prompt_len=12, sampling=GREEDY)
    pm.reserve(holder, 12)  # 3 of the 4 blocks
    engine = _engine(pm, max_batch_size=4)
    c = engine.add_request(list(range(1, 9)), SamplingParams(max_new_tokens=4, ignore_eos=True), "c")
    engine.run()
    assert c.status is Status.REJECTED and "'c'" in c.error and "held outside this engine" in c.error, c.error
    assert engine.stats.preemptions == 0
    pm.free(holder)
    _assert_all_free(pm)


def test_request_timing_fields(big_pipeline, ckpt):
    from specdec.engine import GenerationOutput

    _, hf = ckpt
    engine = _engine(big_pipeline, max_batch_size=1)  # one at a time: the second waits for the first
    a = engine.add_request(_prompts(1, [9], hf.config.vocab_size)[0], SamplingParams(max_new_tokens=6), "a")
    b = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=4), "b")
    bad = engine.add_request([], SamplingParams(), "bad")
    engine.run()
    oa, ob, obad = (GenerationOutput.from_context(c) for c in (a, b, bad))
    # Plain decoding emits one token with the prefill, then one per step.
    assert (oa.decode_tokens, ob.decode_tokens) == (5, 3)
    assert a.t_added <= a.t_first_token <= a.t_finished <= b.t_first_token <= b.t_finished
    assert oa.ttft_s > 0 and oa.decode_s > 0
    assert ob.ttft_s > oa.ttft_s  # b queued behind all of a
    assert obad.ttft_s is None and obad.decode_s is None and obad.decode_tokens == 0


def test_a_lone_request_whose_decode_logits_go_non_finite_ends_alone(big_pipeline, ckpt):
    """A batch of one whose decode step reads a NaN key (its own slot 0, poisoned after the
    prefill) ends with an error naming it and the position; the engine, its blocks and the
    next request go on as before."""
    _, hf = ckpt
    prompt = _prompts(5, [9], hf.config.vocab_size)[0]
    expected = _alone(big_pipeline, prompt, GREEDY)
    engine = _engine(big_pipeline, max_batch_size=1)
    ctx = engine.add_request(prompt, GREEDY)
    engine.step()  # the prefill: one token
    assert ctx.generated == expected[:1]
    k = big_pipeline.caches[0].tensors.k
    slot = ctx.kv[big_pipeline.cache_name].blocks[0] * BLOCK
    kept = k[:, slot].clone()
    try:
        k[:, slot] = float("nan")
        engine.step()
    finally:
        k[:, slot] = kept
    assert ctx.finish_reason == "error" and ctx.generated == expected[:1]
    assert "'req-0'" in ctx.error and "target's logits went non-finite" in ctx.error and "position 10" in ctx.error
    assert not engine.has_work()
    _assert_all_free(big_pipeline)
    assert _alone(big_pipeline, prompt, GREEDY) == expected
