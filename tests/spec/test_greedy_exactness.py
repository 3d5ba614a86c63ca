"""Greedy speculation is exact: every output is token-identical to plain greedy
decoding of the target (``LLM(target, method=None)``), whatever the drafter,
γ, batch, prompt lengths, stop conditions, KV pressure or prefill chunking.

Targets are tiny random Llamas (vocab 64) with a large initializer range, so
argmax is decided by the model and not by float noise; hypothesis examples
where the target's own choice is a near tie (top-1 − top-2 logit < 1e-4)
are discarded (``assume``), since there exactness is not a meaningful claim.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import EngineConfig
from specdec.spec.proposers.draft_model import DraftModelConfig
from specdec.spec.proposers.eagle import Eagle3Config, EagleConfig
from specdec.spec.proposers.medusa import MedusaConfig
from specdec.spec.proposers.ngram import NgramConfig
from specdec.spec.tree import TreeConfig

from echo_drafter import EchoConfig  # tests/spec/echo_drafter.py
from eagle_heads import head_for  # tests/spec/eagle_heads.py
from medusa_heads import medusa_for  # tests/spec/medusa_heads.py

VOCAB = 64
MIN_MARGIN = 1e-4
HYP = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,  # the same examples every run: a failure reproduces
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure reports its example at once
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _target(tiny_llama, kind: str):
    # "full": ordinary random attention; "loopy": queries/keys shrunk, so greedy
    # output repeats itself and n-gram drafts get accepted (α ≈ 0.3).
    return tiny_llama(vocab=VOCAB, seed=0, qk_scale=1.0 if kind == "full" else 0.1)


def _drafter(tiny_llama, kind: str, target_kind: str):
    qk = 1.0 if target_kind == "full" else 0.1
    if kind == "self":  # τ = γ + 1
        return tiny_llama(vocab=VOCAB, seed=0, qk_scale=qk)
    if kind == "perturbed":  # in between: greedy α ≈ 0.4 (full) / 0.7 (loopy) at γ = 4
        return tiny_llama(vocab=VOCAB, seed=0, qk_scale=qk, perturb=0.01, perturb_seed=1)
    return tiny_llama(vocab=VOCAB, seed=1, layers=1)  # unrelated: agrees ~1/64 of the time


@st.composite
def prompts(draw: Any, vocab: int = VOCAB) -> list[int]:
    n = draw(st.integers(1, 60))
    if draw(st.booleans()):  # repetitive: a short pattern repeated, so n-gram lookup proposes
        pat = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4))
        return (pat * n)[:n]
    return draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))


@st.composite
def workloads(draw: Any) -> tuple[list[list[int]], list[SamplingParams], int, int]:
    b = draw(st.integers(1, 16))
    ps = [draw(prompts()) for _ in range(b)]
    sps = [SamplingParams(max_new_tokens=draw(st.integers(8, 24))) for _ in range(b)]
    gamma = draw(st.integers(1, 8))
    block = draw(st.sampled_from([4, 8, 16]))
    return ps, sps, gamma, block


def _check_exact(generate, greedy_margin, target, method, ps, sps, block) -> Any:
    ref, _ = generate(target, None, ps, sps, block_size=block)
    assume(min(greedy_margin(target.hf, p, r) for p, r in zip(ps, ref)) > MIN_MARGIN)
    out, llm = generate(target, method, ps, sps, block_size=block)
    for i, (o, r) in enumerate(zip(out, ref)):
        assert o == r, f"request {i} (prompt len {len(ps[i])}): speculative {o} != plain {r}"
    return llm


def _ngram_case(tiny_llama, generate, greedy_margin, data) -> None:
    target = _target(tiny_llama, data.draw(st.sampled_from(["full", "loopy"]), label="target"))
    ps, sps, gamma, block = data.draw(workloads(), label="workload")
    min_n = data.draw(st.integers(1, 3), label="min_n")
    method = NgramConfig(num_speculative_tokens=gamma, max_n=3, min_n=min_n)
    _check_exact(generate, greedy_margin, target, method, ps, sps, block)


def _draft_model_case(tiny_llama, generate, greedy_margin, data) -> None:
    tkind = data.draw(st.sampled_from(["full", "loopy"]), label="target")
    dkind = data.draw(st.sampled_from(["self", "perturbed", "unrelated"]), label="drafter")
    target, drafter = _target(tiny_llama, tkind), _drafter(tiny_llama, dkind, tkind)
    ps, sps, gamma, block = data.draw(workloads(), label="workload")
    method = DraftModelConfig(path=str(drafter.path), num_speculative_tokens=gamma)
    llm = _check_exact(generate, greedy_margin, target, method, ps, sps, block)
    if dkind == "self":  # the drafter *is* the target: every proposal is kept
        assert llm.pipeline.stats().counts.alpha == 1.0


def _eagle_case(tiny_llama, generate, greedy_margin, data) -> None:
    # Random heads (rejections, ragged acceptance) and the echo head (long accepted runs on loops).
    tkind = data.draw(st.sampled_from(["full", "loopy"]), label="target")
    target = _target(tiny_llama, tkind)
    kind = data.draw(st.sampled_from(["eagle", "eagle3", "eagle3-small-vocab", "eagle-echo"]), label="head")
    ps, sps, gamma, block = data.draw(workloads(), label="workload")
    cls = Eagle3Config if kind.startswith("eagle3") else EagleConfig
    method = cls(path=str(head_for(target, kind)), num_speculative_tokens=gamma)
    _check_exact(generate, greedy_margin, target, method, ps, sps, block)


def _medusa_case(tiny_llama, generate, greedy_margin, data) -> None:
    # Random heads (own lm heads, or the target's with a repeated block; K = 4, so γ > 4
    # is cut to 4) and echo heads (K = 8: long accepted runs on loops).
    target = _target(tiny_llama, data.draw(st.sampled_from(["full", "loopy"]), label="target"))
    kind = data.draw(st.sampled_from(["medusa", "medusa-shared", "medusa-echo"]), label="heads")
    ps, sps, gamma, block = data.draw(workloads(), label="workload")
    # A chain, or a static Medusa-choices tree (depth <= 4) cut to γ nodes.
    tree = data.draw(st.sampled_from([None, [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1],
                                             [0, 0, 0, 0]]]), label="tree")
    method = MedusaConfig(path=str(medusa_for(target, kind)), num_speculative_tokens=gamma,
                          **({"tree": {"kind": "static", "choices": tree}} if tree else {}))
    _check_exact(generate, greedy_margin, target, method, ps, sps, block)


@settings(HYP, max_examples=12)  # (a K-head pass is all a Medusa drafter adds: fewer examples)
@given(data=st.data())
def test_medusa_greedy_is_exact(tiny_llama, generate, greedy_margin, data) -> None:
    _medusa_case(tiny_llama, generate, greedy_margin, data)


@HYP
@given(data=st.data())
def test_eagle_greedy_is_exact(tiny_llama, generate, greedy_margin, data) -> None:
    _eagle_case(tiny_llama, generate, greedy_margin, data)


@HYP
@given(data=st.data())
def test_ngram_greedy_is_exact(tiny_llama, generate, greedy_margin, data) -> None:
    _ngram_case(tiny_llama, generate, greedy_margin, data)


@HYP
@given(data=st.data())
def test_draft_model_greedy_is_exact(tiny_llama, generate, greedy_margin, data) -> None:
    _draft_model_case(tiny_llama, generate, greedy_margin, data)


@pytest.mark.slow
@settings(HYP, max_examples=100, derandomize=False, phases=list(Phase))  # fresh examples each run, shrunk
@given(data=st.data())
def test_ngram_greedy_is_exact_many_examples(tiny_llama, generate, greedy_margin, data) -> None:
    _ngram_case(tiny_llama, generate, greedy_margin, data)


@pytest.mark.slow
@settings(HYP, max_examples=100, derandomize=False, phases=list(Phase))
@given(data=st.data())
def test_draft_model_greedy_is_exact_many_examples(tiny_llama, generate, greedy_margin, data) -> None:
    _draft_model_case(tiny_llama, generate, greedy_margin, data)


# -- deterministic scenarios ---------------------------------------------------------------------


def _rand_prompts(seed: int, n: int, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


METHODS = {
    "ngram": lambda tiny_llama, g: NgramConfig(num_speculative_tokens=g, max_n=3, min_n=1),
    # Branches under the root: the followers of the matched n-gram, verified as one tree.
    "ngram_tree": lambda tiny_llama, g: NgramConfig(num_speculative_tokens=g, max_n=2, min_n=1, branches=3),
    "draft_model": lambda tiny_llama, g: DraftModelConfig(
        path=str(_drafter(tiny_llama, "perturbed", "loopy").path), num_speculative_tokens=g
    ),
    # Token trees (γ: the node budget): EAGLE-2-style dynamic, and a static tree of 7 nodes.
    "draft_model_tree": lambda tiny_llama, g: DraftModelConfig(
        path=str(_drafter(tiny_llama, "perturbed", "loopy").path), num_speculative_tokens=g,
        tree=TreeConfig(kind="dynamic", top_k=3, depth=4)),
    "draft_model_static_tree": lambda tiny_llama, g: DraftModelConfig(
        path=str(_drafter(tiny_llama, "perturbed", "loopy").path), num_speculative_tokens=g,
        tree=TreeConfig(kind="static", choices=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]])),
    # Drafts after verification, from the target's hidden states kept in the state store.
    "echo": lambda tiny_llama, g: EchoConfig(num_speculative_tokens=g),
    "eagle": lambda tiny_llama, g: EagleConfig(path=str(head_for(_target(tiny_llama, "loopy"), "eagle-echo")),
                                               num_speculative_tokens=g),
    "eagle3": lambda tiny_llama, g: Eagle3Config(
        path=str(head_for(_target(tiny_llama, "loopy"), "eagle3-small-vocab")), num_speculative_tokens=g),
    # EAGLE trees (γ: the node budget): EAGLE-2's dynamic tree, EAGLE-1's static tree (echo head: accepted paths).
    "eagle3_tree": lambda tiny_llama, g: Eagle3Config(
        path=str(head_for(_target(tiny_llama, "loopy"), "eagle3-small-vocab")), num_speculative_tokens=g,
        tree=TreeConfig(kind="dynamic", top_k=3, depth=4)),
    "eagle_static_tree": lambda tiny_llama, g: EagleConfig(
        path=str(head_for(_target(tiny_llama, "loopy"), "eagle-echo")), num_speculative_tokens=g,
        tree=TreeConfig(kind="static", choices=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]])),
    "medusa": lambda tiny_llama, g: MedusaConfig(path=str(medusa_for(_target(tiny_llama, "loopy"), "medusa-echo")),
                                                 num_speculative_tokens=g),
}


def test_ngram_drafts_are_accepted_on_a_repetitive_target(tiny_llama, generate) -> None:
    # The hypothesis tests above are only convincing if n-gram drafts are
    # really accepted sometimes (the accept path, not just rejections).
    target = _target(tiny_llama, "loopy")
    ps = _rand_prompts(0, 16)
    sp = SamplingParams(max_new_tokens=24)
    ref, _ = generate(target, None, ps, sp)
    out, llm = generate(target, METHODS["ngram"](tiny_llama, 4), ps, sp)
    assert out == ref
    c = llm.pipeline.stats().counts
    assert c.alpha > 0.15, c.summary()
    assert c.tau > 1.3, c.summary()


@pytest.mark.parametrize("grouped", [False, True], ids=["one-group", "attention-groups"])
@pytest.mark.parametrize("method", list(METHODS))
def test_requests_join_and_leave(tiny_llama, generate, method, grouped, monkeypatch) -> None:
    # 40 requests, at most 16 running: later ones join as earlier ones finish;
    # different max_new_tokens make them finish at different steps.
    # grouped: every batch that can be cut in two attends in two groups (a
    # joining prompt beside decoding requests; DecoderInputs.attention_groups);
    # else none does.
    from specdec.core import batch_processor

    cuts: list[int | None] = []
    lone: list[bool] = []  # a cut that leaves one request alone (a lone prompt's fast path, or a copy)
    split = batch_processor.attention_split

    def cut(lens, ctx):
        cuts.append(split(lens, ctx, min_saving=0) if grouped else None)
        lone.append(cuts[-1] in (1, len(lens) - 1))
        return cuts[-1]

    monkeypatch.setattr(batch_processor, "attention_split", cut)
    target = _target(tiny_llama, "loopy")
    ps = _rand_prompts(1, 40)
    rng = random.Random(2)
    sps = [SamplingParams(max_new_tokens=rng.randint(2, 20)) for _ in ps]
    ref, _ = generate(target, None, ps, sps)
    llm = LLM(str(target.path), METHODS[method](tiny_llama, 4),
              runtime=RuntimeConfig(max_batch_size=16, max_seq_len=128, block_size=8),
              engine_config=EngineConfig(max_batch_size=16))
    engine = llm.new_engine()
    ctxs = [engine.add_request(p, sp) for p, sp in zip(ps, sps)]
    engine.run()
    assert [c.generated for c in ctxs] == ref
    assert max(engine.stats.step_batch_sizes) == 16
    assert [c.finish_reason for c in ctxs] == ["length"] * 40
    assert any(c is not None for c in cuts) == grouped
    assert any(lone) == grouped


@pytest.mark.parametrize("method", list(METHODS))
def test_more_requests_than_runtime_batch_with_default_engine_config(tiny_llama, method) -> None:
    # An everyday call: RuntimeConfig(max_batch_size=4) and the default
    # EngineConfig (max_batch_size=32). The engine must not admit more requests
    # than the pipeline has state slots / KV for; plain decoding copes.
    target = _target(tiny_llama, "full")
    ps = _rand_prompts(3, 10, hi=10)
    sp = SamplingParams(max_new_tokens=5)
    rt = RuntimeConfig(max_batch_size=4, max_seq_len=64, block_size=8)
    ref = [o.token_ids for o in LLM(str(target.path), None, runtime=rt).generate(ps, sp)]
    out = [o.token_ids for o in LLM(str(target.path), METHODS[method](tiny_llama, 3), runtime=rt).generate(ps, sp)]
    assert out == ref


def _self_draft(target, g: int) -> DraftModelConfig:
    return DraftModelConfig(path=str(target.path), num_speculative_tokens=g)


def test_stop_id_inside_an_accepted_run(tiny_llama, generate) -> None:
    # Self-draft, γ = 6: each step emits 7 tokens, all accepted drafts but the
    # last. A stop id first met at generated index 1..5 lies inside a run; the
    # output must end exactly there, as in plain decoding.
    target = _target(tiny_llama, "full")
    ps = _rand_prompts(4, 6, lo=3, hi=20)
    free, _ = generate(target, None, ps, SamplingParams(max_new_tokens=20))
    checked = 0
    for p, f in zip(ps, free):
        idx = next((i for i in range(1, 6) if f[i] not in f[:i]), None)
        if idx is None:
            continue
        sp = SamplingParams(max_new_tokens=20, stop_token_ids=(f[idx],))
        (ref,), _ = generate(target, None, [p], sp)
        (out,), llm = generate(target, _self_draft(target, 6), [p], sp)
        assert ref == f[: idx + 1]
        assert out == ref
        assert llm.pipeline.stats().counts.steps == 1  # it all came from the first (accepted) run
        checked += 1
    assert checked >= 3


def test_eos_inside_an_accepted_run_and_ignore_eos(tiny_llama, generate, with_eos) -> None:
    target = _target(tiny_llama, "full")
    p = _rand_prompts(5, 1, lo=5, hi=5)[0]
    (free,), _ = generate(target, None, [p], SamplingParams(max_new_tokens=20))
    idx = next(i for i in range(2, 6) if free[i] not in free[:i])
    eos_dir = with_eos(target, free[idx])  # same weights, config names free[idx] as EOS
    for sp, want_len, reason in (
        (SamplingParams(max_new_tokens=20), idx + 1, "eos"),
        (SamplingParams(max_new_tokens=20, ignore_eos=True), 20, "length"),
    ):
        plain = LLM(str(eos_dir), None, runtime=RuntimeConfig(max_batch_size=4, max_seq_len=64, block_size=8))
        spec = LLM(str(eos_dir), DraftModelConfig(path=str(eos_dir), num_speculative_tokens=6),
                   runtime=RuntimeConfig(max_batch_size=4, max_seq_len=64, block_size=8))
        (r,) = plain.generate([p], sp)
        (o,) = spec.generate([p], sp)
        assert r.token_ids == free[:want_len] and r.finish_reason == reason
        assert o.token_ids == r.token_ids and o.finish_reason == reason


@pytest.mark.parametrize("method", list(METHODS))
def test_max_new_tokens_inside_a_run(tiny_llama, generate, method) -> None:
    # γ = 6 and max_new_tokens 2..11 in one batch: the limit falls at every
    # offset of a run; each request stops exactly at its limit.
    target = _target(tiny_llama, "loopy")
    p = _rand_prompts(6, 1, lo=8, hi=8)[0]
    sps = [SamplingParams(max_new_tokens=n) for n in range(2, 12)]
    (free,), _ = generate(target, None, [p], SamplingParams(max_new_tokens=11))
    out, _ = generate(target, METHODS[method](tiny_llama, 6), [p] * len(sps), sps)
    assert out == [free[:n] for n in range(2, 12)]
    (selfd,), _ = generate(target, _self_draft(target, 6), [p], SamplingParams(max_new_tokens=9))
    assert selfd == free[:9]


@pytest.mark.parametrize("method", list(METHODS))
def test_max_new_tokens_one_batched_with_longer_requests(tiny_llama, generate, method) -> None:
    # A request whose only step proposes nothing (max_new_tokens = 1: γ = 0)
    # shares the batch with requests that speculate.
    target = _target(tiny_llama, "full")
    ps = _rand_prompts(7, 3, lo=2, hi=10)
    sps = [SamplingParams(max_new_tokens=n) for n in (1, 6, 1)]
    ref, _ = generate(target, None, ps, sps)
    out, _ = generate(target, METHODS[method](tiny_llama, 3), ps, sps)
    assert out == ref


@pytest.mark.parametrize("method", list(METHODS))
def test_kv_pressure_preempts_and_recomputes_exactly(tiny_llama, generate, method) -> None:
    # 12 requests of up to ~50 tokens in blocks of 4 need ~150 blocks; 40
    # force preemption (the newest request is evicted and recomputed later).
    target = _target(tiny_llama, "loopy")
    ps = _rand_prompts(8, 12, lo=10, hi=30)
    sp = SamplingParams(max_new_tokens=20)
    ref, _ = generate(target, None, ps, sp, max_seq_len=64, block_size=4)
    rt = RuntimeConfig(max_batch_size=12, max_seq_len=64, block_size=4, num_blocks=40)
    llm = LLM(str(target.path), METHODS[method](tiny_llama, 4), runtime=rt,
              engine_config=EngineConfig(max_batch_size=12))
    engine = llm.new_engine()
    ctxs = [engine.add_request(p, sp) for p in ps]
    engine.run()
    assert engine.stats.preemptions > 0
    assert [c.generated for c in ctxs] == ref


@pytest.mark.parametrize("method", list(METHODS))
def test_chunked_prefill(tiny_llama, generate, method) -> None:
    # A 7-token budget per step: prompts of up to 50 tokens are fed in chunks
    # (sharing steps with other requests' decode steps).
    target = _target(tiny_llama, "loopy")
    ps = _rand_prompts(9, 6, lo=15, hi=50)
    sp = SamplingParams(max_new_tokens=12)
    ref, _ = generate(target, None, ps, sp)
    out, llm = generate(target, METHODS[method](tiny_llama, 4), ps, sp,
                        engine=EngineConfig(max_batch_size=16, max_tokens_per_step=7))
    assert out == ref


@pytest.mark.parametrize("method", list(METHODS))
def test_chunks_share_the_forward_of_a_step_that_drafts_nothing(tiny_llama, generate, method) -> None:
    # γ = 0 (as adaptive γ picks for large batches): a step with prefill chunks
    # and decoding requests runs one target forward, as plain decoding does.
    target = _target(tiny_llama, "loopy")
    ps = _rand_prompts(9, 6, lo=15, hi=50)
    sp = SamplingParams(max_new_tokens=12)
    ec = EngineConfig(max_batch_size=16, max_tokens_per_step=7)
    ref, plain = generate(target, None, ps, sp, engine=ec)
    out, llm = generate(target, METHODS[method](tiny_llama, 0), ps, sp, engine=ec)
    assert out == ref
    assert llm.pipeline.stats().target_forwards == plain.pipeline.stats().target_forwards


@pytest.mark.parametrize("method", list(METHODS))
def test_per_request_gamma_in_one_batch(tiny_llama, generate, method) -> None:
    # Each context its own γ (None: the method's, 6), including 0 (plain decoding).
    target = _target(tiny_llama, "loopy")
    ps = _rand_prompts(10, 6, lo=5, hi=30)
    gammas = [0, 1, 3, None, 0, 6]
    sp = SamplingParams(max_new_tokens=16)
    ref, _ = generate(target, None, ps, sp)
    llm = LLM(str(target.path), METHODS[method](tiny_llama, 6),
              runtime=RuntimeConfig(max_batch_size=8, max_seq_len=128, block_size=8),
              engine_config=EngineConfig(max_batch_size=8))
    engine = llm.new_engine()
    ctxs = [engine.add_request(p, sp) for p in ps]
    for c, g in zip(ctxs, gammas):
        c.num_speculative_tokens = g
    engine.run()
    assert [c.generated for c in ctxs] == ref
    for c, g in zip(ctxs, gammas):
        counts = llm.pipeline.stats().per_request[c.request_id]
        g_eff = 6 if g is None else g
        assert counts.proposed <= g_eff * counts.steps  # never more than its own γ per step
        if g_eff == 0:
            assert counts.proposed == 0 and counts.steps == 16  # plain decoding: one token a step
