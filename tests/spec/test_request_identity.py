"""Requests sharing one ``LLM``: open streams, ``generate`` calls and engines at once.

The pipeline keys its per-request bookkeeping (drafts waiting in the store,
n-gram indexes, counts …) by the request, never by its id: ids repeat across
engines. Property: however streams, ``generate`` calls and raw engines with
colliding ids interleave on one ``LLM``, every request's tokens equal what it
gives alone (greedy and seeded sampling), for every drafting method. The
schedules are seeded random interleavings, a few per method (tiny models).
A speculative pipeline's state slots are shared too: a request waits for one,
or fails alone by name when only other engines' requests hold them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import drain
from specdec.spec.proposers.draft_model import DraftModelConfig
from specdec.spec.proposers.eagle import Eagle3Config, EagleConfig
from specdec.spec.proposers.medusa import MedusaConfig
from specdec.spec.proposers.ngram import NgramConfig
from specdec.spec.tree import TreeConfig

from eagle_heads import head_for  # tests/spec/eagle_heads.py
from medusa_heads import medusa_for  # tests/spec/medusa_heads.py

VOCAB = 64
SLOTS = 6  # runtime.max_batch_size: the schedules keep at most this many requests live (state slots)
RUNTIME = dict(max_batch_size=SLOTS, max_seq_len=80, block_size=8)
GAMMA = 3
METHODS: dict[str, Callable[[Any, Any], Any]] = {
    "plain": lambda t, d: None,
    "draft_model": lambda t, d: DraftModelConfig(path=str(d.path), num_speculative_tokens=GAMMA),
    "ngram": lambda t, d: NgramConfig(num_speculative_tokens=GAMMA),
    "eagle": lambda t, d: EagleConfig(path=str(head_for(t, "eagle-echo")), num_speculative_tokens=GAMMA),
    "eagle3": lambda t, d: Eagle3Config(path=str(head_for(t, "eagle3")), num_speculative_tokens=GAMMA),
    "medusa": lambda t, d: MedusaConfig(path=str(medusa_for(t, "medusa-shared")), num_speculative_tokens=GAMMA),
    "eagle-tree": lambda t, d: EagleConfig(path=str(head_for(t, "eagle")), num_speculative_tokens=6,
                                           tree=TreeConfig(kind="dynamic", top_k=2, depth=3)),
    "draft-static-tree": lambda t, d: DraftModelConfig(
        path=str(d.path), num_speculative_tokens=5,
        tree=TreeConfig(kind="static", choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])),
}


@pytest.fixture(scope="module")
def models(tiny_llama) -> tuple[Any, Any]:
    """A loopy target (n-gram and echo drafts get accepted) and a drafter close to it."""
    return (tiny_llama(vocab=VOCAB, seed=0, qk_scale=0.1),
            tiny_llama(vocab=VOCAB, seed=0, qk_scale=0.1, perturb=0.05, perturb_seed=3))


def _requests(rng: random.Random, n: int) -> list[tuple[list[int], SamplingParams]]:
    """``n`` prompts, greedy or seeded-sampled (some with top-k / top-p), of varied lengths."""
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 9))]
        new = rng.randint(4, 24)
        if i % 3 == 0:
            sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
        else:
            sp = SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=rng.choice([0.7, 1.0, 1.3]),
                                seed=rng.randrange(2**32), top_k=rng.choice([0, 0, 8]),
                                top_p=rng.choice([1.0, 1.0, 0.9]))
        out.append((prompt, sp))
    return out


@dataclass
class Client:
    """One source of requests on the shared LLM, advanced a step at a time by the schedule."""

    kind: str  # "stream" | "steps" (generate_steps) | "engine" (llm.new_engine, colliding ids)
    indices: list[int]  # which of the run's requests it carries
    advance: Callable[[], bool]  # one step; False once done
    results: dict[int, list[int]] = field(default_factory=dict)  # request index -> its tokens (at the end)
    close: Callable[[], None] = lambda: None


def _stream(llm: LLM, i: int, prompt: list[int], sp: SamplingParams) -> Client:
    gen: Iterator[Any] = llm.stream(prompt, sp)
    got: list[int] = []
    client = Client("stream", [i], lambda: False, close=gen.close)  # type: ignore[attr-defined]

    def advance() -> bool:
        chunk = next(gen, None)
        if chunk is None:
            return False
        got.extend(chunk.token_ids)
        assert chunk.error is None, chunk.error
        if chunk.finish_reason is not None:
            client.results[i] = got
            return False
        return True

    client.advance = advance
    return client


def _steps(llm: LLM, idx: list[int], reqs: list[tuple[list[int], SamplingParams]]) -> Client:
    gen = llm.generate_steps([reqs[i][0] for i in idx], [reqs[i][1] for i in idx])
    client = Client("steps", idx, lambda: False, close=gen.close)

    def advance() -> bool:
        try:
            next(gen)
            return True
        except StopIteration as done:
            for i, o in zip(idx, done.value):
                assert o.error is None, o.error
                client.results[i] = o.token_ids
            return False

    client.advance = advance
    return client


def _engine(llm: LLM, idx: list[int], reqs: list[tuple[list[int], SamplingParams]]) -> Client:
    """A raw engine whose ids ("req-0", "req-1" …) collide with the LLM's own and other engines'."""
    engine = llm.new_engine()
    ctxs = {i: engine.add_request(reqs[i][0], reqs[i][1], request_id=f"req-{k}") for k, i in enumerate(idx)}
    client = Client("engine", idx, lambda: False)

    def advance() -> bool:
        if engine.has_work():
            engine.step()
            return True
        for i, c in ctxs.items():
            assert c.error is None, c.error
            client.results[i] = c.generated
        return False

    def close() -> None:
        for c in ctxs.values():
            engine.abort(c.request_id)

    client.advance, client.close = advance, close
    return client


def _interleaved(llm: LLM, reqs: list[tuple[list[int], SamplingParams]], rng: random.Random) -> dict[int, list[int]]:
    """Runs ``reqs`` through clients opened and stepped in a random order (at most SLOTS
    requests live); now and then a whole ``generate`` call runs while the others stay open."""
    pending = list(range(len(reqs)))
    live: list[Client] = []
    out: dict[int, list[int]] = {}
    try:
        while pending or live:
            room = SLOTS - sum(len(c.indices) for c in live)
            if pending and room > 0 and (not live or rng.random() < 0.35):
                k = min(rng.randint(1, 3), room, len(pending))
                idx, pending = pending[:k], pending[k:]
                kind = rng.choice(["stream", "steps", "engine", "generate"]) if k == 1 else \
                    rng.choice(["steps", "engine", "generate"])
                if kind == "generate":  # a blocking call, run whole while the others wait mid-request
                    outs = llm.generate([reqs[i][0] for i in idx], [reqs[i][1] for i in idx])
                    for i, o in zip(idx, outs):
                        assert o.error is None, o.error
                        out[i] = o.token_ids
                    continue
                live.append(_stream(llm, idx[0], *reqs[idx[0]]) if kind == "stream"
                            else (_steps if kind == "steps" else _engine)(llm, idx, reqs))
                continue
            client = rng.choice(live)
            if not client.advance():
                live.remove(client)
                out.update(client.results)
    finally:
        for c in live:
            c.close()
    return out


@pytest.mark.parametrize("method", list(METHODS))
def test_every_request_gives_what_it_gives_alone_however_calls_streams_and_engines_interleave(models, method):
    target, drafter = models
    llm = LLM(str(target.path), METHODS[method](target, drafter), runtime=RuntimeConfig(**RUNTIME))
    reqs = _requests(random.Random(f"reqs-{method}"), 10)
    alone = [llm.generate([p], sp)[0] for p, sp in reqs]
    assert all(o.error is None for o in alone)
    alone_ids = [o.token_ids for o in alone]
    for schedule in range(3):
        got = _interleaved(llm, reqs, random.Random(f"{method}-{schedule}"))
        for i, (_, sp) in enumerate(reqs):
            assert got[i] == alone_ids[i], (f"schedule {schedule}, request {i} "
                                            f"({'greedy' if sp.greedy else 'sampled'})")
    # Every call and stream drew fresh ids: none repeats over this LLM's life.
    ids = [o.request_id for o in alone] + [o.request_id for o in llm.generate([[1, 2], [3, 4]])]
    assert len(set(ids)) == len(ids) and ids[0] == "req-0"


def test_requests_wait_for_the_state_slots_an_open_stream_holds_and_stay_exact(models):
    """Two slots, one held by an open stream: a three-prompt ``generate`` runs its requests
    through the slot left (not a 'state store full' error for the whole call), each exact."""
    target, _ = models
    llm = LLM(str(target.path), NgramConfig(num_speculative_tokens=GAMMA),
              runtime=RuntimeConfig(**{**RUNTIME, "max_batch_size": 2}))
    reqs = _requests(random.Random("wait"), 4)
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in reqs]
    stream = llm.stream(*reqs[0])
    first = next(stream).token_ids
    outs = llm.generate([p for p, _ in reqs[1:]], [sp for _, sp in reqs[1:]])
    assert [o.error for o in outs] == [None] * 3
    assert [o.token_ids for o in outs] == alone[1:]
    assert first + [t for c in stream for t in c.token_ids] == alone[0]


def test_a_request_finding_every_slot_held_outside_its_engine_is_rejected_by_name(models):
    """One slot, held by an open stream: a ``generate`` meanwhile cannot wait for it (nothing of
    its own would ever free one), so each of its requests fails alone, naming the slots; the
    stream goes on exact, and once it ends the same call runs as it does alone."""
    target, _ = models
    llm = LLM(str(target.path), NgramConfig(num_speculative_tokens=GAMMA),
              runtime=RuntimeConfig(**{**RUNTIME, "max_batch_size": 1}))
    (p0, sp0), (p1, sp1) = _requests(random.Random("held"), 2)
    alone0, alone1 = (llm.generate([p], sp)[0].token_ids for p, sp in ((p0, sp0), (p1, sp1)))
    stream = llm.stream(p0, sp0)
    first = next(stream).token_ids
    (out,) = llm.generate([p1], sp1)
    assert out.finish_reason == "error" and out.token_ids == []
    assert f"request {out.request_id!r}" in out.error and "state slots" in out.error, out.error
    assert first + [t for c in stream for t in c.token_ids] == alone0
    assert llm.generate([p1], sp1)[0].token_ids == alone1


def test_counts_of_two_engines_requests_under_one_id_add_up_to_theirs_alone(models):
    """``stats().per_request`` lists counts by request id: two engines' requests both called
    "x" (interleaved step by step) show as the sum of what each counts alone."""
    target, _ = models
    llm = LLM(str(target.path), NgramConfig(num_speculative_tokens=GAMMA), runtime=RuntimeConfig(**RUNTIME))
    reqs = _requests(random.Random("counts"), 2)
    alone = []
    for p, sp in reqs:
        llm.pipeline.reset_stats()
        engine = llm.new_engine()
        engine.add_request(p, sp, request_id="x")
        engine.run()
        alone.append(llm.pipeline.stats().per_request["x"])
    llm.pipeline.reset_stats()
    engines = [llm.new_engine(), llm.new_engine()]
    for e, (p, sp) in zip(engines, reqs):
        e.add_request(p, sp, request_id="x")
    while any(e.has_work() for e in engines):
        for e in engines:
            e.step()
    stats = llm.pipeline.stats()
    got = stats.per_request["x"]
    assert list(stats.per_request) == ["x"]
    assert (got.steps, got.proposed, got.accepted) == tuple(map(sum, zip(*[(a.steps, a.proposed, a.accepted)
                                                                             for a in alone])))
    assert alone[0].proposed > 0 and alone[1].proposed > 0


def test_a_request_admitted_but_not_yet_stepped_keeps_its_slot_from_other_engines(models):
    """Engine A admits two requests but its token budget steps only the first; engine B
    steps meanwhile. A's second request holds its slot from admission, so B cannot take it
    (and fails its request alone, by name); A then finishes both exactly as alone."""
    from specdec.engine import Engine, EngineConfig

    target, _ = models
    llm = LLM(str(target.path), NgramConfig(num_speculative_tokens=GAMMA),
              runtime=RuntimeConfig(**{**RUNTIME, "max_batch_size": 2}))
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=5)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27], [3, 4]]
    alone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    a = Engine(llm.pipeline, EngineConfig(max_batch_size=2, max_tokens_per_step=8))
    ctxs = [a.add_request(p, sp) for p in prompts[:2]]
    a.step()
    assert ctxs[0].num_generated > 0 and ctxs[1].num_generated == 0  # the second waits its turn, admitted
    b = llm.new_engine()
    other = b.add_request(prompts[2], sp, request_id="req-1")
    b.run()
    assert other.finish_reason == "error" and "'req-1'" in other.error and "state slots" in other.error
    a.run()
    assert [c.generated for c in ctxs] == alone[:2]
