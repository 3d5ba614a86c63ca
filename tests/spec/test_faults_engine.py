"""Faults and bad input in the engine and the LLM API: nothing silent, nothing
leaked, one bad request never touches another.

Plain decoding and two speculative methods (n-gram, a draft model) over a tiny
random Llama. Where a fault or a bad request is injected, the other requests'
outputs are compared token for token with a clean run, and every KV block (the
target's and the draft's caches) and every state slot is checked free.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specdec.api import LLM
from specdec.core.context import SamplingParams, Status
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import Engine, EngineConfig
from specdec.spec.proposers.draft_model import DraftModelConfig
from specdec.spec.proposers.ngram import NgramConfig

from leaks import assert_all_free  # tests/spec/leaks.py

VOCAB = 64
GAMMA = 3
RUNTIME = dict(max_batch_size=4, max_seq_len=64, block_size=8)
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, seed=7, max_new_tokens=10, ignore_eos=True)
METHODS: dict[str, Callable[[Any], Any]] = {
    "plain": lambda draft: None,
    "ngram": lambda draft: NgramConfig(num_speculative_tokens=GAMMA),
    "draft": lambda draft: DraftModelConfig(path=str(draft.path), num_speculative_tokens=GAMMA),
}


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(vocab=VOCAB, seed=0, qk_scale=0.1)  # loopy: n-gram drafts get accepted


@pytest.fixture(scope="module")
def draft(tiny_llama):
    return tiny_llama(vocab=VOCAB, seed=0, qk_scale=0.1, perturb=0.01, perturb_seed=1)


@pytest.fixture(params=list(METHODS))
def make_llm(request, target, draft) -> Callable[..., LLM]:
    """``make_llm(**runtime)``: a fresh LLM of the parametrized method."""
    method = METHODS[request.param](draft)

    def make(**runtime: Any) -> LLM:
        rt = RuntimeConfig(**{**RUNTIME, **runtime})
        return LLM(str(target.path), method, runtime=rt, engine_config=EngineConfig(max_batch_size=rt.max_batch_size))

    return make


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


PROMPTS = _prompts(1, [5, 17, 9, 30, 2, 12])
PARAMS = [GREEDY, SAMPLED, GREEDY, GREEDY, SAMPLED, GREEDY]


def _tokens(outs) -> list[list[int]]:
    for o in outs:
        assert o.error is None, o.error
    return [o.token_ids for o in outs]


def _fail_on_call(monkeypatch, module: torch.nn.Module, n: int, exc: BaseException) -> list[int]:
    """Makes ``module``'s ``n``-th forward raise ``exc``; returns the call counter."""
    calls = [0]
    forward = module.forward

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            raise exc
        return forward(*args, **kwargs)

    monkeypatch.setattr(module, "forward", failing)
    return calls


# -- 1. a fault inside a step -------------------------------------------------------


@pytest.mark.parametrize("exc", [RuntimeError("injected fault"), KeyboardInterrupt("injected interrupt")],
                         ids=["exception", "interrupt"])
def test_a_fault_mid_run_frees_everything_and_the_llm_serves_the_next_call_as_new(make_llm, exc, monkeypatch):
    want = _tokens(make_llm().generate(PROMPTS, PARAMS))
    llm = make_llm()
    calls = _fail_on_call(monkeypatch, llm.pipeline.target.module, 4, exc)
    with pytest.raises(type(exc), match="injected"):
        llm.generate(PROMPTS, PARAMS)
    assert calls[0] == 4  # it failed mid-run
    assert_all_free(llm)
    monkeypatch.undo()
    assert _tokens(llm.generate(PROMPTS, PARAMS)) == want
    assert_all_free(llm)


def test_a_step_that_raises_requeues_its_requests_and_the_engine_goes_on(make_llm, monkeypatch):
    want = _tokens(make_llm().generate(PROMPTS, PARAMS))
    llm = make_llm()
    engine = llm.new_engine()
    ctxs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    _fail_on_call(monkeypatch, llm.pipeline.target.module, 3, RuntimeError("injected fault"))
    with pytest.raises(RuntimeError, match="injected"):
        while engine.has_work():
            engine.step()
    assert_all_free(llm)
    assert not engine.running and all(c.status is Status.WAITING for c in engine.waiting)
    engine.run()  # the fault was once: every request completes, as in a clean run
    assert [c.generated for c in ctxs] == want
    assert all(c.error is None for c in ctxs)
    assert_all_free(llm)


def test_an_interrupted_run_ends_every_request_with_abort(make_llm, monkeypatch):
    llm = make_llm()
    engine = llm.new_engine()
    ctxs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    _fail_on_call(monkeypatch, llm.pipeline.target.module, 2, KeyboardInterrupt("injected interrupt"))
    with pytest.raises(KeyboardInterrupt):
        engine.run()
    assert not engine.has_work()
    for c in ctxs:
        assert c.finish_reason == "abort" and c.request_id in c.error and "KeyboardInterrupt" in c.error
    assert_all_free(llm)


# -- 2. bad input --------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("max_new_tokens", 2.5), ("max_new_tokens", True), ("max_new_tokens", 0),
    ("top_k", 2.5), ("top_k", True), ("seed", 1.5), ("seed", False), ("seed", 2**63),
    ("temperature", float("inf")), ("temperature", float("nan")), ("temperature", "hot"), ("temperature", True),
    ("top_p", float("nan")), ("top_p", "1"), ("stop_token_ids", 5), ("stop_token_ids", (1.5,)),
    ("stop_token_ids", (True,)), ("stop_token_ids", b"ab"), ("ignore_eos", "yes"),
    ("deadline_s", 0), ("deadline_s", float("inf")), ("deadline_s", "soon"),
])
def test_sampling_params_reject_wrong_types_and_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"sampling.{field} must be"):
        SamplingParams(**{field: value}).validate()


def test_sampling_params_accept_integer_and_real_kinds():
    import numpy as np

    SamplingParams(temperature=1, top_k=np.int64(5), top_p=np.float32(0.5), seed=np.uint32(3),
                   max_new_tokens=np.int32(4), stop_token_ids=[np.int64(1), 2], deadline_s=1).validate()


def test_bad_requests_end_alone_and_the_others_are_exact(make_llm):
    good = _prompts(2, [7, 21, 4])
    bad: list[tuple[Any, Any, str]] = [
        (None, GREEDY, "NoneType"),
        (5, GREEDY, "got int"),
        (b"\x01\x02", GREEDY, "got bytes"),
        ([1, True, 2], GREEDY, "not bool"),
        ([1, 2.0], GREEDY, "integers"),
        ("text", GREEDY, "tokenizer.json"),
        (good[0], SamplingParams(max_new_tokens=2.5), "sampling.max_new_tokens"),
        (good[0], SamplingParams(temperature=0.7, top_k=2.5), "sampling.top_k"),
        (good[0], SamplingParams(temperature=0.7, seed=1.5), "sampling.seed"),
        (good[0], SamplingParams(temperature=float("inf")), "sampling.temperature"),
        (good[0], SamplingParams(temperature="hot"), "sampling.temperature"),
        (good[0], "greedy", "must be a SamplingParams"),
    ]
    want = _tokens(make_llm().generate(good, [GREEDY, SAMPLED, GREEDY]))
    llm = make_llm()
    prompts = [good[0], *[p for p, _, _ in bad[:6]], good[1], *[p for p, _, _ in bad[6:]], good[2]]
    params = [GREEDY, *[s for _, s, _ in bad[:6]], SAMPLED, *[s for _, s, _ in bad[6:]], GREEDY]
    outs = llm.generate(prompts, params)
    good_at = [0, 7, len(prompts) - 1]
    assert _tokens([outs[i] for i in good_at]) == want
    for (_, _, words), i in zip(bad, [i for i in range(len(prompts)) if i not in good_at]):
        o = outs[i]
        assert o.finish_reason == "error" and o.token_ids == []
        assert f"'req-{i}'" in o.error and words in o.error, o.error
    assert_all_free(llm)


class _CharTokenizer:
    """One token per character (enough to tell one prompt from one per character)."""

    def encode(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(ids=[ord(c) % VOCAB for c in text])

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(32 + i) for i in ids)


def test_a_single_string_is_one_prompt(target):
    llm = LLM(str(target.path), runtime=RuntimeConfig(**RUNTIME))
    llm.tokenizer = _CharTokenizer()
    (one,) = llm.generate("def f():", GREEDY)
    assert one.error is None and one.prompt_len == len("def f():")
    assert one.token_ids == llm.generate(["def f():"], GREEDY)[0].token_ids


def test_a_sampling_list_of_the_wrong_length_is_an_error(target):
    llm = LLM(str(target.path), runtime=RuntimeConfig(**RUNTIME))
    with pytest.raises(ValueError, match="1 sampling params for 2 prompts"):
        llm.generate([[1, 2], [3]], [GREEDY])
    with pytest.raises(TypeError, match="prompts must be a list"):
        llm.generate(None)  # type: ignore[arg-type]
    assert_all_free(llm)


# -- 3. capacity, preemption, abort, deadline ----------------------------------------


def test_a_request_that_can_never_fit_is_rejected_at_admission_with_the_numbers(make_llm, request):
    """4 blocks of 8 tokens. Plain decoding and the target feed every token but
    the last: 20 + 13 tokens fit, 20 + 14 do not; a draft model's cache holds
    γ - 1 = 2 drafts more, so there 20 + 11 fit."""
    is_draft = request.node.callspec.params["make_llm"] == "draft"
    edge = 11 if is_draft else 13
    prompt, small = _prompts(3, [20, 6])
    fits = SamplingParams(max_new_tokens=edge, ignore_eos=True)
    too_big = SamplingParams(max_new_tokens=edge + 1, ignore_eos=True)
    want = _tokens(make_llm().generate([prompt, small], [fits, GREEDY]))  # the default cache: ample

    llm = make_llm(num_blocks=4)
    engine = llm.new_engine()
    a = engine.add_request(prompt, fits, "fits")
    big = engine.add_request(prompt, too_big, "too-big")
    b = engine.add_request(small, GREEDY, "small")
    assert big.status is Status.REJECTED and big.finish_reason == "error"  # at once, before any step
    cache = "draft" if is_draft else "target"
    for words in ("'too-big'", "never fit", f"{20 + edge + 1} tokens", "need 5 KV blocks", f"'{cache}' cache",
                  "which has 4"):
        assert words in big.error, big.error
    engine.run()
    assert [a.generated, b.generated] == want and a.error is None and b.error is None
    assert big.generated == []
    assert_all_free(llm)


def test_a_squeezed_cache_preempts_a_few_times_and_stays_exact(make_llm):
    """6 requests of up to 53 tokens (29 blocks of 8 in all) in 8 blocks: the
    engine used to preempt 106-130 times (the newest re-admitted at once)."""
    prompts = _prompts(4, [30, 9, 45, 17, 3, 26])
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (16, 12, 8, 16, 14, 10)]
    params[3] = SamplingParams(temperature=0.9, top_k=30, seed=11, max_new_tokens=16, ignore_eos=True)
    want = _tokens(make_llm(max_batch_size=8).generate(prompts, params))
    llm = make_llm(max_batch_size=8, num_blocks=8)
    engine = llm.new_engine()
    ctxs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    engine.run()
    assert [c.generated for c in ctxs] == want
    assert all(c.error is None for c in ctxs)
    assert engine.stats.preemptions <= 6, engine.stats.preemptions
    assert_all_free(llm)


def test_abort_ends_one_request_and_frees_it(make_llm):
    prompts = _prompts(5, [8, 14, 5])
    params = [GREEDY, SAMPLED, GREEDY]
    want = _tokens(make_llm().generate(prompts, params))
    llm = make_llm(max_batch_size=2)  # the third request waits
    engine = llm.new_engine()
    a, b, c = (engine.add_request(p, sp, rid) for p, sp, rid in zip(prompts, params, "abc"))
    for _ in range(2):  # (a speculative step emits up to γ + 1 = 4 tokens)
        engine.step()
    assert b.status is Status.RUNNING and c.status is Status.WAITING and b.kv
    assert engine.abort("b") and engine.abort("c")
    assert not engine.abort("b") and not engine.abort("nope")
    for ctx, rid in ((b, "b"), (c, "c")):
        assert ctx.finish_reason == "abort" and f"'{rid}'" in ctx.error
        assert not ctx.kv and ctx.slot is None  # its blocks and state slot are back
    assert 0 < b.num_generated < GREEDY.max_new_tokens and b.generated == want[1][: b.num_generated]
    assert c.generated == []
    engine.run()
    assert a.error is None and a.generated == want[0]
    assert_all_free(llm)


def test_a_deadline_ends_its_request_between_steps(make_llm):
    prompts = _prompts(6, [8, 14, 5])
    want = _tokens(make_llm().generate(prompts, [GREEDY, SAMPLED, GREEDY]))
    llm = make_llm(max_batch_size=2)
    now = [100.0]
    engine = Engine(llm.pipeline, EngineConfig(max_batch_size=2), eos_token_ids=llm.eos_token_ids,
                    clock=lambda: now[0])
    a = engine.add_request(prompts[0], GREEDY, "a")
    late = engine.add_request(prompts[1], SamplingParams(**{**SAMPLED.__dict__, "deadline_s": 5.0}), "late")
    queued = engine.add_request(prompts[2], SamplingParams(**{**GREEDY.__dict__, "deadline_s": 5.0}), "queued")
    for _ in range(2):
        engine.step()
    assert late.status is Status.RUNNING and queued.status is Status.WAITING
    now[0] += 5.0
    ended = engine.step()
    assert set(ended) >= {late, queued}
    for ctx in (late, queued):
        assert ctx.finish_reason == "deadline" and f"'{ctx.request_id}'" in ctx.error and "5.0 s" in ctx.error
        assert not ctx.kv and ctx.slot is None
    assert 0 < late.num_generated < SAMPLED.max_new_tokens and late.generated == want[1][: late.num_generated]
    engine.run()
    assert a.error is None and a.generated == want[0]
    assert_all_free(llm)
