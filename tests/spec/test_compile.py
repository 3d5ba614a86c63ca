"""``runtime.compile=true``: the decoders run through ``torch.compile`` and
nothing observable changes — the same greedy tokens as eager plain decoding,
and the same draft tokens (a draft model's catch-up and γ - 1 one-token steps
then run as one graph, greedy or sampled) (so the same τ and acceptance counts) as eager
speculation, sampled runs included (same seeds, same tokens). The τ check matters: a compiled drafter whose KV-cache writes
went astray still yields exact output (verification fixes it) but drafts
garbage.

Compiling takes a while on 2 cores: the draft-model test traces 14 graphs (every
shape kind of the target's forward, the fused chain and the sampled verification),
9.5 minutes with a cold Inductor cache on a 2-core Zen 1, so all of these are marked
slow (``make test-all``); ``make test`` compiles one packed layer
(tests/core/test_linear.py).
"""

from __future__ import annotations

import pytest
from torch._dynamo.utils import counters

from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import EngineConfig
from specdec.spec.proposers.draft_model import DraftModelConfig
from tests.spec.fused import count_compiled_eagle_draftings, count_fused_draftings

PROMPTS = [[3, 5, 7, 11, 13, 17, 19], [1, 2], [9] * 20, list(range(40))]


def _run(tiny_llama, compile_: bool) -> tuple[list[list[int]], list[list[int]], object, list[list[int]], object]:
    """(plain tokens, speculative tokens, speculative counts, then sampled speculative tokens
    and counts) over PROMPTS, two at a time."""
    target = tiny_llama(vocab=64, seed=0)
    draft = tiny_llama(vocab=64, seed=0, perturb=0.01, perturb_seed=1)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    method = DraftModelConfig(path=str(draft.path), num_speculative_tokens=3)
    ec = EngineConfig(max_batch_size=2)
    # aten linears: the tiny model's native backend has no dynamo graphs to compile around.
    rt = RuntimeConfig(max_batch_size=2, max_seq_len=96, compile=compile_, cpu_linear="aten")
    plain = LLM(target.path, runtime=rt, engine_config=ec)
    spec = LLM(target.path, method=method, runtime=rt, engine_config=ec)
    counters.clear()
    if compile_:  # the modules that run are the compiled ones
        modules = (plain.pipeline.target.module, spec.pipeline.module.target, spec.pipeline.module.drafter.decoder)
        assert all(hasattr(m.forward, "_torchdynamo_orig_callable") for m in modules)
        # ... each with a code object, so a cache of graphs, of its own (compile_decoder)
        codes = {id(m.forward._torchdynamo_orig_callable.__func__.__code__) for m in modules}
        assert len(codes) == 3
        # A step of the full γ drafts its one-token steps in one compiled graph, its catch-up
        # inside it: a drafting with no catch-up of its own is a fused one. Count those.
        drafter = spec.pipeline.module.drafter
        assert drafter.compiled_chain
        fused_calls, own_catch_ups = count_fused_draftings(drafter)
        # A one-request step's verification forward and its verification are one compiled
        # call, through a code object of the module's own (compile_method); a batch's are two.
        module, verify_calls = spec.pipeline.module, []
        verify = module.target_verify_chain
        assert verify._torchdynamo_orig_callable.__func__.__code__ is not type(module)._target_verify_chain.__code__
        module.target_verify_chain = lambda *a: verify_calls.append(1) or verify(*a)
        step, steps = module.forward, []
        module.forward = lambda **k: steps.append(k["target_inputs"].single_request) or step(**k)
    out = ([o.token_ids for o in plain.generate(PROMPTS, sp)], [o.token_ids for o in spec.generate(PROMPTS, sp)],
           spec.pipeline.stats().counts)
    if compile_:
        # One request alone: its steps take the fused call, and decode as plain decoding does.
        assert [o.token_ids for o in spec.generate(PROMPTS[2:3], sp)] == out[0][2:3]
        assert len(verify_calls) == sum(steps) >= 4 and len(steps) > sum(steps)
        assert len(fused_calls) >= 4  # every request's first steps draft the full γ
        # (A step near a request's end drafts fewer and runs its catch-up apart.)
        assert own_catch_ups
        fused_calls.clear()
        verify_calls.clear()
        steps.clear()
    spec.pipeline.reset_stats()
    sampled = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=5)
    out += ([o.token_ids for o in spec.generate(PROMPTS, sampled)], spec.pipeline.stats().counts)
    if compile_:
        assert len(fused_calls) >= 4  # sampled chains fuse too
        # ... and so does their verification with the target's forward.
        # (A step that drafts nothing, a request's last, runs as plain decoding: no verification.)
        assert len(verify_calls) == sum(steps)
        # ... and traced whole: a graph break would run the fused steps piece by piece.
        assert not counters["graph_break"] and not counters["unimplemented"], dict(counters["unimplemented"])
        # The analytic limit charges a draft what it costs this way (the fused steps, timed).
        assert spec.pipeline.proposer.draft_forward_time(24, repeats=2) > 0
    return out


def _check(eager, compiled) -> None:
    (eager_plain, eager_spec, eager_counts, eager_sampled, eager_sc) = eager
    (comp_plain, comp_spec, comp_counts, comp_sampled, comp_sc) = compiled
    assert eager_spec == eager_plain
    assert comp_plain == eager_plain
    assert comp_spec == eager_plain
    assert comp_counts.accepted == eager_counts.accepted and comp_counts.proposed == eager_counts.proposed
    assert eager_counts.accepted > 0  # the drafter is a good one: the τ check has teeth
    # Sampled: the fused chain draws the same drafts from the same q (seeded noise), so
    # verification accepts the same ones. (Its distribution is tested in test_sampling_exactness.)
    assert comp_sampled == eager_sampled and eager_sampled != eager_plain
    assert comp_sc.accepted == eager_sc.accepted and comp_sc.proposed == eager_sc.proposed
    assert eager_sc.accepted > 0


@pytest.mark.slow  # 14 graphs: 1.7 min with a warm Inductor cache, 9.5 min cold on a 2-core Zen 1
def test_compiled_speculation_matches_eager(tiny_llama) -> None:
    _check(_run(tiny_llama, False), _run(tiny_llama, True))


@pytest.mark.slow  # (the groups' graphs compile in about a minute more)
def test_compiled_attention_groups_match_eager(tiny_llama, monkeypatch) -> None:
    # Every batch of two requests attends in two groups (DecoderInputs.attention_groups),
    # as a prompt joining decoding requests does; these sizes are too small to cut unless made to.
    from specdec.core import batch_processor

    eager = _run(tiny_llama, False)
    cuts: list[int | None] = []
    monkeypatch.setattr(batch_processor, "attention_split", lambda lens, ctx: cuts.append(len(lens) - 1 or None)
                        or cuts[-1])
    _check(eager, _run(tiny_llama, True))
    assert any(cuts)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])


@pytest.mark.slow  # about 3 minutes of compiling on 2 cores (make test-all runs it)
def test_compiled_eagle_heads_draft_what_eager_ones_draft(tiny_llama, monkeypatch) -> None:
    # The head is compiled too (its one-layer paged forward, catch-up and
    # one-token steps): every step's drafts must be the eager head's drafts,
    # token for token, so a KV write that went astray under compile shows.
    from eagle_heads import head_for  # tests/spec/eagle_heads.py

    from specdec.spec.proposers.eagle import Eagle3Config, EagleDrafter

    target = tiny_llama(vocab=64, seed=0)
    prompts = [[3, 5, 7, 11, 13, 17, 19], [1, 2], list(range(30))]
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    method = Eagle3Config(path=str(head_for(target, "eagle3-small-vocab")), num_speculative_tokens=3)
    real = EagleDrafter.draft_after
    drafts: list[list[int]] = []

    def spy(self, step, gamma, sampling):
        tree = real(self, step, gamma, sampling)
        drafts.extend(tree.tokens.tolist())
        return tree

    monkeypatch.setattr(EagleDrafter, "draft_after", spy)
    runs = {}
    counters.clear()
    for compile_ in (False, True):
        drafts.clear()
        # aten linears: the tiny head's native backend has no dynamo graphs to compile around.
        rt = RuntimeConfig(max_batch_size=2, max_seq_len=96, compile=compile_, cpu_linear="aten")
        spec = LLM(target.path, method=method, runtime=rt, engine_config=EngineConfig(max_batch_size=2))
        fused_calls: list[int] = []
        if compile_:
            assert hasattr(spec.pipeline.proposer.head.forward, "_torchdynamo_orig_callable")  # compiled
            drafter = spec.pipeline.proposer.drafter  # its full-γ steps run as one compiled graph
            assert drafter.compiled_chain and not drafter.compiled_tree
            fused_calls = count_compiled_eagle_draftings(drafter)
        greedy_out = [o.token_ids for o in spec.generate(prompts, sp)]
        if compile_:
            assert len(fused_calls) >= 3
            fused_calls.clear()
        sampled = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0, seed=3)
        runs[compile_] = (greedy_out, [o.token_ids for o in spec.generate(prompts, sampled)], list(drafts))
        if compile_:
            assert len(fused_calls) >= 3  # sampled chains fuse too
            fused_calls.clear()  # the limit's T_draft(1) times the fused steps
            assert spec.pipeline.proposer.draft_forward_time(24, repeats=2) > 0 and fused_calls
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == runs[False][1] and runs[False][1] != runs[False][0]  # sampled: same seeds, same tokens
    assert runs[True][2] == runs[False][2] and len(runs[False][2]) > 20
    # Every compiled function ran whole: a graph break (the target's captured layers once
    # raised one) sends a frame back to eager and compiles its pieces one by one.
    assert not counters["graph_break"] and not counters["unimplemented"], dict(counters["unimplemented"])


@pytest.mark.slow  # minutes of compiling on 2 cores (make test-all runs it)
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_compiled_eagle_tree_drafts_in_one_graph_what_eager_drafts(tiny_llama, monkeypatch, kind) -> None:
    # Under compile a tree of the method's budget drafts every level (head forwards,
    # top-k expansion, selection) in one graph: its trees must be the eager ones, node
    # for node, the output plain decoding's, and the graph whole (no break).
    from eagle_heads import head_for  # tests/spec/eagle_heads.py

    from specdec.spec.proposers.eagle import Eagle3Config, EagleDrafter
    from specdec.spec.tree import TreeConfig

    target = tiny_llama(vocab=64, seed=0)
    prompts = [[3, 5, 7, 11, 13, 17, 19], [1, 2], list(range(30))]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    tree = (TreeConfig(kind="dynamic", top_k=2, depth=3) if kind == "dynamic"
            else TreeConfig(kind="static", choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]]))
    method = Eagle3Config(path=str(head_for(target, "eagle3-small-vocab")), num_speculative_tokens=5, tree=tree)
    real = EagleDrafter.draft_after
    trees: list[tuple[list[list[int]], list[list[int]], list[int]]] = []

    def spy(self, step, gamma, sampling):
        t = real(self, step, gamma, sampling)
        trees.append((t.tokens.tolist(), t.parents.tolist(), t.num_nodes.tolist()))
        return t

    monkeypatch.setattr(EagleDrafter, "draft_after", spy)
    plain = LLM(target.path, runtime=RuntimeConfig(max_batch_size=2, max_seq_len=96, cpu_linear="aten"),
                engine_config=EngineConfig(max_batch_size=2))
    ref = [o.token_ids for o in plain.generate(prompts, sp)]
    runs = {}
    counters.clear()
    for compile_ in (False, True):
        trees.clear()
        rt = RuntimeConfig(max_batch_size=2, max_seq_len=96, compile=compile_, cpu_linear="aten")  # (as above)
        spec = LLM(target.path, method=method, runtime=rt, engine_config=EngineConfig(max_batch_size=2))
        fused_calls: list[int] = []
        if compile_:
            drafter = spec.pipeline.proposer.drafter
            assert drafter.compiled_tree and not drafter.compiled_chain
            fused_calls = count_compiled_eagle_draftings(drafter)
        out = [o.token_ids for o in spec.generate(prompts, sp)]
        runs[compile_] = (out, list(trees), spec.pipeline.stats().counts)
        if compile_:
            assert len(fused_calls) >= 3
    (eager, eager_trees, ec), (comp, comp_trees, cc) = runs[False], runs[True]
    assert eager == ref and comp == ref
    assert comp_trees == eager_trees and len(eager_trees) > 5
    assert (cc.accepted, cc.proposed) == (ec.accepted, ec.proposed) and ec.accepted > 0
    assert not counters["graph_break"] and not counters["unimplemented"], dict(counters["unimplemented"])
