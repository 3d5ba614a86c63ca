"""EAGLE token trees (``EagleConfig.tree`` / ``Eagle3Config.tree``): EAGLE-2's
dynamic tree and EAGLE-1's static tree, drafted by the head after verification.

Greedy: hypothesis over random batches, prompts, heads (random, and the echo
head whose drafts are accepted often) and trees, ragged per request, token-
identical to plain greedy decoding; KV pressure with preemption; every node a
step drafts is what the head computes densely along its root-to-node path
from the committed sequence (the catch-up over a tree step used the accepted
path, and the head's KV was compacted like the target's). Sampled: one
chi-square through ``LLM.generate`` with a planted bug as negative control.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specdec.api import LLM
from specdec.core.checkpoint import load_decoder
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.core.registry import Role
from specdec.engine import EngineConfig
from specdec.models.eagle import EagleHead, save_head
from specdec.models.llama import DenseCausalAttend, LlamaDecoder
from specdec.spec import pipeline as spec_pipeline
from specdec.spec.proposers.eagle import Eagle3Config, EagleConfig, EagleDrafter
from specdec.spec.tree import TreeConfig

from eagle_heads import head_for, scratch_dir  # tests/spec/eagle_heads.py
from test_greedy_exactness import HYP, MIN_MARGIN, _rand_prompts, _target, prompts
from test_sampling_exactness import N, P_FAIL, P_PASS, PROMPT, exact_joint, gof_pvalue, plant_uniform_tree_q

DEBUG = False
STATIC = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


_LEAKY: dict[str, Path] = {}


def leaky_echo_head(target: Any) -> Path:
    """The echo head (its h is its input feature: it drafts the target's next token)
    plus a little of the token's embedding and a small attention term: drafts
    are still accepted on loops, and every h depends on the tokens paired with
    the features and on the head's KV cache (a wrong pairing or key shows)."""
    key = str(target.path)
    if key not in _LEAKY:
        echo = head_for(target, "eagle-echo")
        head = load_decoder(echo, role=Role.DRAFT_HEAD, dtype=torch.float32).module
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            w = head.layers[0].self_attn.o_proj.weight
            w.copy_(torch.randn(w.shape, generator=g) * 0.05)
            h = w.shape[0]  # and the token: fc reads a little of its embedding
            head.fc.weight[:, :h] = torch.randn(h, h, generator=g) * 0.02
        out = scratch_dir("head-leaky")
        save_head(head, out, num_target_layers=2)
        _LEAKY[key] = out
    return _LEAKY[key]


def _method(target: Any, head: str, tree: TreeConfig, gamma: int) -> Any:
    cls = Eagle3Config if head.startswith("eagle3") else EagleConfig
    path = leaky_echo_head(target) if head == "eagle-leaky" else head_for(target, head)
    return cls(path=str(path), num_speculative_tokens=gamma, tree=tree)


@st.composite
def eagle_trees(draw: Any) -> tuple[str, TreeConfig, int]:
    """(head, tree, γ): random heads (rejections) and echo heads (accepted paths), any tree kind."""
    head = draw(st.sampled_from(["eagle3", "eagle3-small-vocab", "eagle", "eagle-echo", "eagle-leaky"]))
    if draw(st.booleans()):
        tree = TreeConfig(kind="dynamic", top_k=draw(st.integers(1, 4)), depth=draw(st.integers(1, 5)),
                          total_tokens=draw(st.sampled_from([0, 0, 3, 8, 12])))
    else:
        tree = TreeConfig(kind="static", choices=STATIC[: draw(st.integers(1, len(STATIC)))])
    return head, tree, draw(st.integers(1, 10))


def _run(target, method, ps, sps, caps, block, **rt_kw) -> tuple[list[list[int]], Any, Any]:
    rt = RuntimeConfig(**{"max_batch_size": 16, "max_seq_len": 128, "block_size": block, **rt_kw})
    llm = LLM(str(target.path), method, runtime=rt, engine_config=EngineConfig(max_batch_size=rt.max_batch_size))
    engine = llm.new_engine()
    ctxs = [engine.add_request(p, sp) for p, sp in zip(ps, sps)]
    for c, g in zip(ctxs, caps):
        c.num_speculative_tokens = g
    engine.run()
    return [c.generated for c in ctxs], llm, engine


@settings(HYP, max_examples=12)
@given(data=st.data())
def test_eagle_tree_greedy_is_exact(tiny_llama, generate, greedy_margin, data) -> None:
    target = _target(tiny_llama, data.draw(st.sampled_from(["full", "loopy"]), label="target"))
    head, tree, gamma = data.draw(eagle_trees(), label="tree")
    b = data.draw(st.integers(1, 6), label="batch")
    ps = [data.draw(prompts(), label="prompt") for _ in range(b)]
    sps = [SamplingParams(max_new_tokens=data.draw(st.integers(4, 20))) for _ in range(b)]
    caps = data.draw(st.lists(st.sampled_from([None, None, 0, 1, 2, 5]), min_size=b, max_size=b), label="caps")
    block = data.draw(st.sampled_from([4, 8, 16]), label="block")
    ref, _ = generate(target, None, ps, sps, block_size=block)
    assume(min(greedy_margin(target.hf, p, r) for p, r in zip(ps, ref)) > MIN_MARGIN)
    method = _method(target, head, tree, gamma)
    out, llm, _ = _run(target, method, ps, sps, caps, block)
    for i, (o, r) in enumerate(zip(out, ref)):
        assert o == r, f"request {i} (prompt len {len(ps[i])}, cap {caps[i]}): tree {o} != plain {r}"
    c = llm.pipeline.stats().counts
    assert c.proposed <= c.steps * method.num_speculative_tokens


@pytest.mark.parametrize(("head", "tree"), [
    ("eagle-echo", TreeConfig(kind="static", choices=STATIC)),
    ("eagle3", TreeConfig(kind="dynamic", top_k=3, depth=4, total_tokens=8)),
], ids=["eagle-echo-static", "eagle3-dynamic"])
def test_eagle_tree_exact_and_accepting(tiny_llama, generate, head, tree) -> None:
    # A loopy target: the echo head's top-1 path (the bonus repeated) is accepted on loops.
    target = _target(tiny_llama, "loopy")
    ps = _rand_prompts(3, 8, lo=2, hi=30)
    sp = SamplingParams(max_new_tokens=24)
    ref, _ = generate(target, None, ps, sp)
    out, llm = generate(target, _method(target, head, tree, 8), ps, sp)
    assert out == ref
    c = llm.pipeline.stats().counts
    assert c.tree_size > 1
    if head == "eagle-echo":
        assert c.accepted > 0 and c.tau > 1.2, c.summary()


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_eagle_tree_kv_pressure_preempts_and_recomputes_exactly(tiny_llama, generate, kind) -> None:
    target = _target(tiny_llama, "loopy")
    ps = _rand_prompts(8, 12, lo=10, hi=30)
    sp = SamplingParams(max_new_tokens=20)
    ref, _ = generate(target, None, ps, sp, max_seq_len=64, block_size=4)
    if kind == "dynamic":
        method = _method(target, "eagle3", TreeConfig(kind="dynamic", top_k=3, depth=3, total_tokens=6), 6)
    else:
        method = _method(target, "eagle-echo", TreeConfig(kind="static", choices=STATIC[:6]), 6)
    out, llm, engine = _run(target, method, ps, [sp] * len(ps), [None] * len(ps), 4,
                            max_batch_size=12, max_seq_len=64, num_blocks=48)
    assert engine.stats.preemptions > 0
    assert out == ref


# -- the drafted nodes are the head's own computation ---------------------------------------------


def _dense_h(target: LlamaDecoder, head: EagleHead, seq: list[int], path: list[int]) -> torch.Tensor:
    """The head's h after the committed ``seq`` (last token the bonus) and then the
    draft tokens ``path``, dense from scratch (logits of the next node: target_logits)."""
    with torch.no_grad():
        s = len(seq) - 1
        x = target.model.embed_tokens(torch.tensor(seq[:-1]))
        cos, sin = target._rope(torch.arange(s), s - 1)
        hid, aux = target._layers(x, cos, sin, DenseCausalAttend(1, s, None), head.aux_layers)
        feats = head.project(hid, torch.cat(aux, -1) if aux else None)  # [s, H]
        toks = list(seq[1:])
        h = head.forward_dense(torch.tensor([toks]), feats.unsqueeze(0))[0, -1]
        for t in path:
            toks.append(t)
            feats = torch.cat([feats, h.unsqueeze(0)])
            h = head.forward_dense(torch.tensor([toks]), feats.unsqueeze(0))[0, -1]
        return h


@pytest.mark.parametrize(("head", "tree"), [
    ("eagle3-small-vocab", TreeConfig(kind="dynamic", top_k=2, depth=3, total_tokens=5)),
    ("eagle-leaky", TreeConfig(kind="dynamic", top_k=2, depth=4, total_tokens=6)),
    ("eagle-leaky", TreeConfig(kind="static", choices=STATIC[:7])),
], ids=["eagle3-dynamic", "leaky-dynamic", "leaky-static"])
def test_tree_nodes_equal_the_heads_dense_computation(tiny_llama, monkeypatch, head, tree) -> None:
    # Every node of every tree drafted: its token is among the top tokens the head
    # computes densely at its parent (root: the committed sequence; a node: the
    # sequence then its root-to-parent path). For a static tree, exactly the
    # rank its choice names.
    target = tiny_llama(vocab=64, seed=0, qk_scale=0.1)
    method = _method(target, head, tree, 6)
    seen: list[tuple[str, int, list[int], list[int], int]] = []  # (request, bonus position, tokens, parents, n)
    real = EagleDrafter.draft_after

    def spy(self, step, gamma, sampling):
        t = real(self, step, gamma, sampling)
        owner = step.state._owner
        pos = step.inputs.positions.index_select(0, step.bonus_row)
        if DEBUG:
            print("STEP", [owner[x] for x in step.slots.tolist()], pos.tolist(), step.num_accepted.tolist(),
                  None if step.path is None else step.path.tolist(), t.tokens[:, :3].tolist())
        for slot, p, tok, par, n in zip(step.slots.tolist(), pos.tolist(), t.tokens.tolist(), t.parents.tolist(),
                                        t.num_nodes.tolist()):
            seen.append((owner[slot], p, tok, par, n))
        return t

    monkeypatch.setattr(EagleDrafter, "draft_after", spy)
    ps = _rand_prompts(5, 4, lo=2, hi=16)
    llm = LLM(str(target.path), method, runtime=RuntimeConfig(max_batch_size=4, max_seq_len=64, block_size=4),
              engine_config=EngineConfig(max_batch_size=4))
    engine = llm.new_engine()
    ctxs = [engine.add_request(p, SamplingParams(max_new_tokens=16)) for p in ps]
    engine.run()
    seqs = {c.request_id: list(c.tokens) for c in ctxs}
    counts = llm.pipeline.stats().counts
    assert counts.tree_size > 1
    if head == "eagle-leaky":  # tree steps accepted paths: the catch-up over them and the compaction are checked
        assert counts.accepted >= 6, counts.summary()

    ref_target = load_decoder(target.path, dtype=torch.float32).module
    hd = load_decoder(method.path, role=Role.DRAFT_HEAD, dtype=torch.float32).module
    hd.attach_target(ref_target.model.embed_tokens, ref_target.lm_head)
    hd.prepare_for_inference()
    ranks = None
    if tree.kind == "static":
        from specdec.spec.tree import static_tree
        ranks = static_tree(tree.choices).ranks.tolist()
    checked = 0
    for rid, pos, toks, pars, n in seen:
        seq = seqs[rid][: pos + 2]
        if len(seq) < pos + 2:
            continue
        for i in range(n):
            path, p = [], pars[i]
            while p >= 0:
                path.append(toks[p])
                p = pars[p]
            lg = hd.target_logits(_dense_h(ref_target, hd, seq, path[::-1]))
            order = lg.argsort(descending=True).tolist()
            if ranks is not None:
                assert toks[i] == order[ranks[i]], f"request {rid} at {pos}: node {i}"
            else:  # top_k children of their parent (ties aside)
                assert toks[i] in order[: tree.top_k], f"request {rid} at {pos}: node {i}"
            checked += 1
    assert checked >= 20


# -- sampled: chi-square through LLM.generate -----------------------------------------------------

V = 8


@pytest.fixture(scope="module")
def small_target(tiny_llama) -> Any:
    return tiny_llama(vocab=V, init=0.2, seed=0)  # as in test_sampling_exactness.py


def _sample(target: Any, seed0: int) -> tuple[np.ndarray, Any]:
    tree = TreeConfig(kind="dynamic", top_k=3, depth=3, total_tokens=5)
    method = Eagle3Config(path=str(head_for(target, "eagle3")), tree=tree)
    rt = RuntimeConfig(max_batch_size=256, max_seq_len=32, block_size=4)
    llm = LLM(str(target.path), method, runtime=rt, engine_config=EngineConfig(max_batch_size=256))
    sps = [SamplingParams(seed=seed0 + i, max_new_tokens=6, temperature=1.0) for i in range(N)]
    counts = np.zeros((V, V, V))
    for o in llm.generate([PROMPT] * N, sps):
        assert len(o.token_ids) == 6, o
        counts[tuple(o.token_ids[:3])] += 1
    return counts, llm


def test_sampled_eagle3_tree_follows_the_target_distribution(small_target) -> None:
    counts, llm = _sample(small_target, 140_000)
    p = gof_pvalue(counts, exact_joint(small_target.hf, PROMPT, temperature=1.0))
    c = llm.pipeline.stats().counts
    print(f"chi-square p = {p:.3g}, alpha = {c.alpha:.3f}, tau = {c.tau:.3f}")
    assert c.tree_size > 1.5 and c.accepted > N // 8  # (a request's first step drafts nothing)
    assert p > P_PASS, f"chi-square p = {p:.3g}"


def test_the_test_rejects_eagle_tree_verification_with_the_wrong_draft_distribution(small_target,
                                                                                    monkeypatch) -> None:
    plant_uniform_tree_q(monkeypatch)  # the top-k nodes verified as if drawn uniformly
    counts, _ = _sample(small_target, 140_000)
    p = gof_pvalue(counts, exact_joint(small_target.hf, PROMPT, temperature=1.0))
    print(f"chi-square p = {p:.3g}")
    assert p < P_FAIL, f"the planted bug went unnoticed: chi-square p = {p:.3g}"


def test_eagle_tree_config() -> None:
    t = TreeConfig(kind="dynamic", top_k=2, depth=3, total_tokens=9)
    assert Eagle3Config(path="x", num_speculative_tokens=4, tree=t).num_speculative_tokens == 9
    static = TreeConfig(kind="static", choices=[[0], [1], [0, 0]])
    assert EagleConfig(path="x", num_speculative_tokens=8, tree=static).num_speculative_tokens == 3
    assert Eagle3Config(path="x", tree={"kind": "dynamic", "top_k": 2}).tree.top_k == 2
