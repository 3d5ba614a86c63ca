"""Token trees end to end (``DraftModelConfig.tree``): greedy tree speculation is
token-identical to plain greedy decoding, and sampled tree speculation keeps
the target's distribution.

Greedy: hypothesis over random batches, prompts, drafters, static trees
(random ``choices``) and dynamic trees (random ``top_k`` / ``depth`` / budget),
ragged per request (each request's own γ caps its tree's nodes), then KV
pressure with preemption and one compiled run. The deterministic scenarios of
test_greedy_exactness.py (joins, stops, chunked prefill, preemption …) run the
tree methods too (its ``METHODS``).

Sampled: the chi-square goodness-of-fit test of test_sampling_exactness.py on
the first three tokens, through ``LLM.generate`` for a dynamic and a static
draft-model tree, with a planted bug (verification told the wrong draft
distribution) that the same test must reject.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import Phase, assume, given, settings
from hypothesis import strategies as st

from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import EngineConfig
from specdec.spec import draft_and_verify as spec_pipeline
from specdec.spec.proposers.draft_model import DraftModelConfig
from specdec.spec.proposers.ngram import NgramConfig
from specdec.spec.tree import TreeConfig
from tests.spec.fused import count_fused_draftings

from test_greedy_exactness import HYP, MIN_MARGIN, VOCAB, _drafter, _rand_prompts, _target, prompts
from test_sampling_exactness import N, P_FAIL, P_PASS, PROMPT, TOPK_TOPP, exact_joint, gof_pvalue, plant_uniform_tree_q


@st.composite
def static_choices(draw: Any, max_nodes: int = 10, max_rank: int = 3) -> list[list[int]]:
    """A random static tree as Medusa-style choices (every prefix present)."""
    paths: list[tuple[int, ...]] = [(0,)]
    for _ in range(draw(st.integers(0, max_nodes - 1))):
        parent = draw(st.sampled_from([()] + paths))
        taken = {p[-1] for p in paths if p[:-1] == parent}
        free = [r for r in range(max_rank + 1) if r not in taken]
        if free:
            paths.append(parent + (draw(st.sampled_from(free)),))
    return [list(p) for p in paths]


@st.composite
def trees(draw: Any) -> tuple[TreeConfig, int]:
    """(tree, γ): γ is the node budget unless the tree sets total_tokens."""
    if draw(st.booleans()):
        return TreeConfig(kind="static", choices=draw(static_choices())), draw(st.integers(1, 10))
    tree = TreeConfig(kind="dynamic", top_k=draw(st.integers(1, 4)), depth=draw(st.integers(1, 5)),
                      total_tokens=draw(st.sampled_from([0, 0, 3, 8, 12])))
    return tree, draw(st.integers(1, 10))


def _run(target, method, ps, sps, gammas, block) -> tuple[list[list[int]], Any]:
    rt = RuntimeConfig(max_batch_size=16, max_seq_len=128, block_size=block)
    llm = LLM(str(target.path), method, runtime=rt, engine_config=EngineConfig(max_batch_size=16))
    engine = llm.new_engine()
    ctxs = [engine.add_request(p, sp) for p, sp in zip(ps, sps)]
    for c, g in zip(ctxs, gammas):
        c.num_speculative_tokens = g
    engine.run()
    return [c.generated for c in ctxs], llm


def _draft_model_tree(tiny_llama, data, tkind) -> DraftModelConfig:
    dkind = data.draw(st.sampled_from(["self", "perturbed", "unrelated"]), label="drafter")
    tree, gamma = data.draw(trees(), label="tree")
    return DraftModelConfig(path=str(_drafter(tiny_llama, dkind, tkind).path), num_speculative_tokens=gamma, tree=tree)


def _ngram_tree(tiny_llama, data, tkind) -> NgramConfig:
    return NgramConfig(num_speculative_tokens=data.draw(st.integers(1, 10), label="gamma"),
                       branches=data.draw(st.integers(2, 4), label="branches"),
                       max_n=data.draw(st.integers(1, 3), label="max_n"), min_n=1)


def _tree_case(tiny_llama, generate, greedy_margin, data, make_method=_draft_model_tree) -> None:
    tkind = data.draw(st.sampled_from(["full", "loopy"]), label="target")
    target = _target(tiny_llama, tkind)
    method = make_method(tiny_llama, data, tkind)
    b = data.draw(st.integers(1, 8), label="batch")
    ps = [data.draw(prompts(), label="prompt") for _ in range(b)]
    sps = [SamplingParams(max_new_tokens=data.draw(st.integers(4, 20))) for _ in range(b)]
    # Ragged trees: each request its own node cap (None: the method's budget).
    gammas = data.draw(st.lists(st.sampled_from([None, None, 0, 1, 2, 5]), min_size=b, max_size=b), label="caps")
    block = data.draw(st.sampled_from([4, 8, 16]), label="block")
    ref, _ = generate(target, None, ps, sps, block_size=block)
    assume(min(greedy_margin(target.hf, p, r) for p, r in zip(ps, ref)) > MIN_MARGIN)
    out, llm = _run(target, method, ps, sps, gammas, block)
    for i, (o, r) in enumerate(zip(out, ref)):
        assert o == r, f"request {i} (prompt len {len(ps[i])}, cap {gammas[i]}): tree {o} != plain {r}"
    c = llm.pipeline.stats().counts
    assert c.proposed <= c.steps * method.num_speculative_tokens  # never more nodes than the budget


@settings(HYP, max_examples=15)
@given(data=st.data())
def test_draft_model_tree_greedy_is_exact(tiny_llama, generate, greedy_margin, data) -> None:
    _tree_case(tiny_llama, generate, greedy_margin, data)


@pytest.mark.slow
@settings(HYP, max_examples=100, derandomize=False, phases=list(Phase))  # fresh examples each run, shrunk
@given(data=st.data())
def test_draft_model_tree_greedy_is_exact_many_examples(tiny_llama, generate, greedy_margin, data) -> None:
    _tree_case(tiny_llama, generate, greedy_margin, data)


@settings(HYP, max_examples=15)
@given(data=st.data())
def test_ngram_tree_greedy_is_exact(tiny_llama, generate, greedy_margin, data) -> None:
    # Branches under the root (several followers of the matched n-gram), ragged per request.
    _tree_case(tiny_llama, generate, greedy_margin, data, _ngram_tree)


def test_ngram_tree_accepts_paths_through_other_branches(tiny_llama, generate, monkeypatch) -> None:
    # Endings followed by several different tokens: the tree verifies those
    # branches in one forward, and some steps accept a path that does not start
    # at the chain's first token (path row 1 is not node 0's row).
    real = spec_pipeline.verify_tree_greedy
    first_rows: list[int] = []

    def spy(**kw: Any) -> Any:
        v = real(**kw)
        first_rows.extend(v.path[:, 1].tolist())
        return v

    monkeypatch.setattr(spec_pipeline, "verify_tree_greedy", spy)
    target = _target(tiny_llama, "loopy")
    ps = _rand_prompts(30, 8, lo=20, hi=40)
    sp = SamplingParams(max_new_tokens=24)
    ref, _ = generate(target, None, ps, sp)
    out, llm = generate(target, NgramConfig(num_speculative_tokens=6, max_n=2, branches=3), ps, sp)
    assert out == ref
    assert llm.pipeline.stats().counts.tree_size > 0
    assert any(r > 1 for r in first_rows), "no step accepted a branch other than the first"


def test_tree_budget_sets_gamma_and_config_errors() -> None:
    t = TreeConfig(kind="dynamic", top_k=2, depth=3, total_tokens=9)
    assert DraftModelConfig(path="x", num_speculative_tokens=4, tree=t).num_speculative_tokens == 9
    assert DraftModelConfig(path="x", num_speculative_tokens=4,
                            tree=TreeConfig(kind="dynamic")).num_speculative_tokens == 4
    static = TreeConfig(kind="static", choices=[[0], [1], [0, 0]])
    assert DraftModelConfig(path="x", num_speculative_tokens=8, tree=static).num_speculative_tokens == 3
    assert DraftModelConfig(path="x", num_speculative_tokens=2, tree=static).num_speculative_tokens == 2
    assert DraftModelConfig(path="x", num_speculative_tokens=4, tree={"kind": "dynamic", "top_k": 2}).tree.top_k == 2
    for bad in (dict(kind="bush"), dict(kind="static", choices=[[0, 1]]), dict(top_k=0)):
        with pytest.raises(ValueError):
            TreeConfig(**bad)
    # A static tree without choices takes the drafter's shipped list; a draft model ships none.
    with pytest.raises(ValueError, match="choices"):
        DraftModelConfig(path="x", tree=TreeConfig(kind="static"))


def test_tree_method_from_hydra_style_node() -> None:
    from specdec.conf_schema import method_configs

    out = method_configs({"num_speculative_tokens": 6,
                          "draft_model": {"path": "x", "tree": {"kind": "static", "choices": [[0], [1], [0, 0]]}}})
    cfg = out["draft_model"]
    assert cfg.tree.kind == "static" and cfg.tree.choices == ((0,), (1,), (0, 0)) and cfg.num_speculative_tokens == 3
    dyn = method_configs({"draft_model": {"path": "x", "tree": {"kind": "dynamic", "total_tokens": 10}}})
    assert dyn["draft_model"].num_speculative_tokens == 10


def _self_drafted(tiny_llama, generate, ps: list[list[int]], sp: SamplingParams, tree: TreeConfig) -> Any:
    """Counts of the target drafting its own tree over ``ps``, its output checked against plain decoding."""
    target = _target(tiny_llama, "full")
    ref, _ = generate(target, None, ps, sp)
    out, llm = generate(target, DraftModelConfig(path=str(target.path), tree=tree), ps, sp)
    assert out == ref
    return llm.pipeline.stats().counts


def test_self_drafted_tree_accepts_along_the_top1_path(tiny_llama, generate) -> None:
    # The drafter is the target: greedy, the top-1 child at every depth is the
    # target's argmax, so a top-1 chain-shaped tree is accepted whole.
    c = _self_drafted(tiny_llama, generate, _rand_prompts(20, 4, lo=3, hi=20),
                      SamplingParams(max_new_tokens=15),  # three steps of 4 accepted + 1 bonus
                      TreeConfig(kind="dynamic", top_k=1, depth=4, total_tokens=4))
    assert c.alpha == 1.0 and c.tau == 5.0, c.summary()
    assert c.per_position == [1.0] * 4 and c.tree_size == 4.0


def test_a_requests_last_trees_keep_their_size(tiny_llama, generate) -> None:
    # Only a tree's depth adds tokens: with fewer tokens left than nodes, a request
    # still verifies its whole tree (what a path accepts past max_new_tokens is
    # dropped). Cutting the node budget to the tokens left, as a chain's γ is cut,
    # shrank every request's last trees: here to 2 of 6 nodes.
    c = _self_drafted(tiny_llama, generate, _rand_prompts(21, 3, lo=3, hi=12), SamplingParams(max_new_tokens=3),
                      TreeConfig(kind="dynamic", top_k=3, depth=2, total_tokens=6))
    assert c.tree_size == 6.0 and c.tau == 3.0, c.summary()


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_tree_kv_pressure_preempts_and_recomputes_exactly(tiny_llama, generate, kind) -> None:
    target = _target(tiny_llama, "loopy")
    ps = _rand_prompts(8, 12, lo=10, hi=30)
    sp = SamplingParams(max_new_tokens=20)
    ref, _ = generate(target, None, ps, sp, max_seq_len=64, block_size=4)
    tree = (TreeConfig(kind="dynamic", top_k=3, depth=3, total_tokens=6) if kind == "dynamic"
            else TreeConfig(kind="static", choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]]))
    method = DraftModelConfig(path=str(_drafter(tiny_llama, "perturbed", "loopy").path), tree=tree)
    rt = RuntimeConfig(max_batch_size=12, max_seq_len=64, block_size=4, num_blocks=48)
    llm = LLM(str(target.path), method, runtime=rt, engine_config=EngineConfig(max_batch_size=12))
    engine = llm.new_engine()
    ctxs = [engine.add_request(p, sp) for p in ps]
    engine.run()
    assert engine.stats.preemptions > 0
    assert [c.generated for c in ctxs] == ref
    assert llm.pipeline.stats().counts.accepted > 0


@pytest.mark.slow  # compiling takes minutes on a busy 2-core machine
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_compiled_tree_speculation_matches_eager(tiny_llama, kind) -> None:
    # Compiled, a tree of the method's budget drafts (catch-up, every level, selection) in one graph.
    from torch._dynamo.utils import counters

    target = tiny_llama(vocab=64, seed=0)
    draft = tiny_llama(vocab=64, seed=0, perturb=0.01, perturb_seed=1)
    prompts_ = [[3, 5, 7, 11, 13, 17, 19], [1, 2], list(range(30))]
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    tree = (TreeConfig(kind="dynamic", top_k=2, depth=3, total_tokens=5) if kind == "dynamic"
            else TreeConfig(kind="static", choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]]))
    method = DraftModelConfig(path=str(draft.path), tree=tree, num_speculative_tokens=5)
    ec = EngineConfig(max_batch_size=2)
    runs = {}
    counters.clear()
    for compile_ in (False, True):
        # aten linears: the tiny model's native backend has no dynamo graphs to compile around.
        rt = RuntimeConfig(max_batch_size=2, max_seq_len=64, compile=compile_, cpu_linear="aten")
        spec = LLM(target.path, method=method, runtime=rt, engine_config=ec)
        fused_calls: list[int] = []
        if compile_:
            for m in (spec.pipeline.module.target, spec.pipeline.module.drafter.decoder):
                assert hasattr(m.forward, "_torchdynamo_orig_callable")  # compiled
            drafter = spec.pipeline.module.drafter
            assert drafter.compiled_tree
            fused_calls, _ = count_fused_draftings(drafter)
        runs[compile_] = ([o.token_ids for o in spec.generate(prompts_, sp)], spec.pipeline.stats().counts)
        assert len(fused_calls) >= 3 or not compile_
    assert not counters["graph_break"] and not counters["unimplemented"], dict(counters["unimplemented"])
    plain = LLM(target.path, runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64), engine_config=ec)
    ref = [o.token_ids for o in plain.generate(prompts_, sp)]
    (eager, ec_), (comp, cc) = runs[False], runs[True]
    assert eager == ref and comp == ref
    assert (cc.accepted, cc.proposed) == (ec_.accepted, ec_.proposed) and ec_.accepted > 0


# -- sampled trees: chi-square through LLM.generate -----------------------------------------------

V = 8
GAMMA_NODES = 5


@pytest.fixture(scope="module")
def models(tiny_llama) -> dict[str, Any]:
    return {  # as in test_sampling_exactness.py
        "target": tiny_llama(vocab=V, init=0.2, seed=0),
        "perturbed": tiny_llama(vocab=V, init=0.2, seed=0, perturb=0.005, perturb_seed=1),
        "unrelated": tiny_llama(vocab=V, init=0.2, seed=5, layers=1),
    }


SAMPLED_TREES = {
    "dynamic": TreeConfig(kind="dynamic", top_k=3, depth=3, total_tokens=GAMMA_NODES),
    "static": TreeConfig(kind="static", choices=[[0], [1], [2], [0, 0], [0, 1]]),
}


def _tree_method(models, drafter: str, tree: str) -> DraftModelConfig:
    return DraftModelConfig(path=str(models[drafter].path), tree=SAMPLED_TREES[tree])


def sample_joint(target: Any, method: Any, *, seed0: int, n: int = N, prompt: list[int] = PROMPT,
                 **sampling: Any) -> tuple[np.ndarray, Any]:
    """Counts [V, V, V] of the first three tokens over ``n`` seeded requests.

    Each request generates 6 tokens (only the first three are counted): a
    tree's nodes are capped by the tokens left to generate, so with 3 the
    first step could verify 2 nodes at most."""
    rt = RuntimeConfig(max_batch_size=256, max_seq_len=32, block_size=4)
    llm = LLM(str(target.path), method, runtime=rt, engine_config=EngineConfig(max_batch_size=256))
    sps = [SamplingParams(seed=seed0 + i, max_new_tokens=6, **sampling) for i in range(n)]
    counts = np.zeros((V, V, V))
    for o in llm.generate([prompt] * n, sps):
        assert len(o.token_ids) == 6, o
        counts[tuple(o.token_ids[:3])] += 1
    return counts, llm


@pytest.mark.parametrize(("drafter", "tree", "sampling", "seed0"), [
    pytest.param("perturbed", "dynamic", dict(temperature=1.0), 110_000, id="perturbed-dynamic"),
    pytest.param("unrelated", "static", TOPK_TOPP, 120_000, id="unrelated-static-topk-topp",
                 marks=pytest.mark.slow),
    pytest.param("unrelated", "dynamic", dict(temperature=1.0), 130_000, id="unrelated-dynamic",
                 marks=pytest.mark.slow),
])
def test_sampled_tree_follows_the_target_distribution(models, drafter, tree, sampling, seed0) -> None:
    target = models["target"]
    probs = exact_joint(target.hf, PROMPT, **sampling)
    counts, llm = sample_joint(target, _tree_method(models, drafter, tree), seed0=seed0, **sampling)
    p = gof_pvalue(counts, probs)
    c = llm.pipeline.stats().counts
    print(f"chi-square p = {p:.3g}, alpha = {c.alpha:.3f}, tau = {c.tau:.3f}")
    assert c.tree_size > 2 and c.accepted > N // 4  # real trees were drafted, and partly accepted
    assert p > P_PASS, f"{drafter} {tree} {sampling}: chi-square p = {p:.3g}"


# "1 2" was followed by 3, 4 and 5: the n-gram tree has three branches under the root.
BRANCHY = [1, 2, 3, 1, 2, 4, 1, 2, 5, 6, 1, 2]
NGRAM_TREE = NgramConfig(num_speculative_tokens=GAMMA_NODES, max_n=2, branches=3)


def test_sampled_ngram_tree_follows_the_target_distribution(models) -> None:
    # Deterministic drafts (q one-hot) in a tree of several branches: each tried
    # child is accepted with its residual probability.
    target = models["target"]
    probs = exact_joint(target.hf, BRANCHY, temperature=1.0)
    counts, llm = sample_joint(target, NGRAM_TREE, seed0=140_000, prompt=BRANCHY, temperature=1.0)
    p = gof_pvalue(counts, probs)
    c = llm.pipeline.stats().counts
    print(f"chi-square p = {p:.3g}, alpha = {c.alpha:.3f}, tau = {c.tau:.3f}")
    assert c.tree_size > 2 and c.accepted > N // 4
    assert p > P_PASS, f"n-gram tree: chi-square p = {p:.3g}"


def test_the_test_rejects_tree_verification_with_the_wrong_draft_distribution(models, monkeypatch) -> None:
    plant_uniform_tree_q(monkeypatch)  # the top-k nodes verified as if drawn uniformly
    target = models["target"]
    probs = exact_joint(target.hf, PROMPT, temperature=1.0)
    counts, _ = sample_joint(target, _tree_method(models, "unrelated", "dynamic"), seed0=110_000, temperature=1.0)
    p = gof_pvalue(counts, probs)
    print(f"chi-square p = {p:.3g}")
    assert p < P_FAIL, f"the planted bug went unnoticed: chi-square p = {p:.3g}"


def test_the_test_rejects_an_ngram_tree_verified_path_by_path(models, monkeypatch) -> None:
    # Planted bug (the negative control): every branch is tried against the
    # unchanged target distribution, as if each root-to-leaf path were verified on
    # its own and the longest accepted kept. A rejected child must leave only the
    # residual to its siblings and to the recovered token; here it leaves all of p.
    import specdec.spec.tree as tree_mod

    monkeypatch.setattr(tree_mod, "residual", lambda p, q: p)
    target = models["target"]
    probs = exact_joint(target.hf, BRANCHY, temperature=1.0)
    counts, _ = sample_joint(target, NGRAM_TREE, seed0=140_000, prompt=BRANCHY, temperature=1.0)
    p = gof_pvalue(counts, probs)
    print(f"chi-square p = {p:.3g}")
    assert p < P_FAIL, f"the planted bug went unnoticed: chi-square p = {p:.3g}"


if __name__ == "__main__":  # pragma: no cover
    random.seed(0)
    pytest.main([__file__, "-q"])
