"""The analytic limit is one computation in every tool: the run summary (``make run``),
experiments/bench/spec.py and experiments/bench/compare_hf.py all take it from
:func:`specdec.measure.spec_limit` (τ from the run's counts and outputs, S_plain from its
plain passes, C_spec from bare forwards timed by turns within those passes, each for the
run's batch of requests), so the same run gives the same limit whichever tool reports it."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import specdec.experiment.summary as summary
import specdec.measure as measure
from specdec.experiment import run_experiment, summarize
from specdec.experiment.runner import LIMIT_CHUNKS, Runner
from specdec.measure import ForwardTimes, Timing, efficiency, pass_limit, random_checkpoint
from specdec.spec.metrics import SpecCounts
from tests.test_experiment import _compose, _overrides, tiny_pair  # noqa: F401 (a fixture)
from tests.scripts import load_script

BENCH = Path(__file__).resolve().parents[1] / "experiments" / "bench"

# γ = 4 chain: T_t(1) 10 ms, T_t(5) 20 ms, T_d(1) 1 ms: C_spec = 24 ms at 4 drafts a step.
BARE = ForwardTimes(t_target_1=0.010, t_target_g1=0.020, t_draft_1=0.001, max_rows=5, draft_forwards=4,
                    max_drafts=4)
C_SPEC = 0.024


def _bench(name: str) -> types.ModuleType:
    """``experiments/bench/<name>.py`` as a module (the scripts are not a package)."""
    return load_script(BENCH / f"{name}.py")


def test_the_run_summary_and_the_benchmarks_take_the_same_limit_from_the_same_run() -> None:
    # One run of two requests, as the run summary reads it (results.jsonl records) and as a
    # benchmark does (one lockstep pass: GenerationOutputs and the pipeline's counts). Plain
    # decoding's decode step is 15 ms, but its first step (the prefill) 200 ms: a limit that
    # took S_plain from whole requests, or from anything but these plain passes' decode
    # phase, would differ. Speculation: a first step, then 10 steps of τ = 3, 30 ms each.
    tokens, steps = 31, 11
    plain = {"output_len": tokens, "time_share_s": 0.2 + 30 * 0.015, "error": None,
             "decode_s": 30 * 0.015, "decode_tokens": 30}
    spec = {"output_len": tokens, "time_share_s": 0.2 + 10 * 0.030, "error": None, "steps": steps,
            "proposed": 4 * steps, "accepted": tokens - steps, "bonus": steps, "equal_to_plain": True,
            "decode_s": 10 * 0.030, "decode_tokens": 30}
    records = [{"id": f"r{i}", "prompt_len": 3, "plain": dict(plain), "methods": {"m": dict(spec)}}
               for i in range(2)]
    # An older forward_times.json also held a plain step timed after the run: not S_plain any more.
    saved = {**dataclasses.asdict(BARE), "plain_step_s": 0.5}
    run = summarize(records, gammas={"m": 4}, greedy=True, forward_times={"m": saved})["methods"]["m"]

    counts = SpecCounts()
    for _ in records:
        counts.merge(SpecCounts(steps=steps, proposed=4 * steps, accepted=tokens - steps, bonus=steps))
    outs = {k: [SimpleNamespace(decode_s=e["decode_s"], decode_tokens=e["decode_tokens"]) for _ in records]
            for k, e in (("plain", plain), ("m", spec))}
    timing = Timing("plain", {"plain": [0.9], "m": [0.7]}, {k: [v] for k, v in outs.items()},
                    {"plain": [1.0], "m": [0.9 / 0.7]})
    bench = pass_limit(timing, "m", BARE, counts)

    assert run["analytic_limit"] == pytest.approx(3 * 0.015 / C_SPEC)  # τ_decode 3, S_plain 15 ms
    assert bench == pytest.approx(run["analytic_limit"])
    assert efficiency(timing.decode_speedup("m"), bench) == pytest.approx(run["efficiency"])
    assert run["efficiency"] == pytest.approx(C_SPEC / 0.030)  # at batch 1: C_spec ÷ the measured step


def test_a_benchmarks_s_plain_is_the_median_of_its_plain_passes() -> None:
    counts = SpecCounts(steps=11, proposed=44, accepted=20, bonus=11)
    spec = [SimpleNamespace(decode_s=0.3, decode_tokens=30)]
    passes = [[SimpleNamespace(decode_s=30 * s, decode_tokens=30)] for s in (0.015, 0.015, 0.021)]
    timing = Timing("plain", {}, {"plain": passes, "m": [spec]}, {})
    assert pass_limit(timing, "m", BARE, counts) == pytest.approx(3 * 0.015 / C_SPEC)
    passes[1] = [SimpleNamespace(decode_s=None, decode_tokens=0)]  # a pass without decode timing
    assert pass_limit(timing, "m", BARE, counts) is None  # missing, not the other passes' figure


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """Every limit :func:`specdec.measure.spec_limit` returns, wherever a tool calls it."""
    seen: list[float | None] = []
    real = measure.spec_limit

    def spec_limit(*a: Any, **k: Any) -> float | None:
        seen.append(real(*a, **k))
        return seen[-1]

    monkeypatch.setattr(measure, "spec_limit", spec_limit)
    monkeypatch.setattr(summary, "spec_limit", spec_limit)
    return seen


@pytest.fixture(scope="module")
def bench_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("bench_pair")
    small = {"hidden": 32, "vocab": 256, "heads": 2, "kv_heads": 1}
    return (random_checkpoint(layers=1, seed=0, out=root / "target", **small),
            random_checkpoint(layers=1, seed=1, out=root / "draft", **small))


def test_spec_bench_reports_the_shared_limit(bench_pair, spy, capsys) -> None:
    target, draft = bench_pair
    _bench("spec").main([f"target={target}", f"draft={draft}", "proposers=[draft_model]", "gammas=[4]",
                         "trees=[]", "num_prompts=1", "new_tokens=8", "repeats=1", "threads=1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    limit = out["at_gamma4"]["draft_model"]["limit"]
    assert limit is not None and limit == round(spy[-1], 3)


def test_compare_hf_reports_the_shared_limit(bench_pair, spy) -> None:
    target, draft = bench_pair
    hf = _bench("compare_hf")
    cfg = hf.CompareConfig(num_prompts=2, new_tokens=8, repeats=1, hf_repeats=1, compile=False,
                           batch1_eager=False, sweep_aa=False, threads=1)
    prompts = [[5, 6, 7, 8, 9] * 4, [9, 8, 7] * 5]
    res = hf.batch1(cfg, "random", target, draft, prompts)
    assert res["analytic_limit"] is not None and res["analytic_limit"] in spy


def test_the_run_times_its_bare_forwards_within_its_batches_and_reports_the_shared_limit(
        tiny_pair, tmp_path, spy, monkeypatch) -> None:  # noqa: F811 (the fixture)
    rounds: dict[str, int] = {}
    own = Runner.forward_times

    def forward_times(self: Runner) -> dict[str, ForwardTimes]:
        rounds.update({k: sum(map(len, v)) for k, v in self.bare_rounds.items()})
        return own(self)

    monkeypatch.setattr(Runner, "forward_times", forward_times)
    s = run_experiment(_compose(_overrides(tiny_pair, tmp_path / "run", "logger=none", "data.limit=2",
                                           "method=[draft_model]")))
    # Each batch (2 of one request) timed LIMIT_CHUNKS rounds of every bare forward by turns.
    assert rounds and all(n == 2 * LIMIT_CHUNKS for n in rounds.values())
    limit = s["methods"]["draft_model"]["analytic_limit"]
    assert limit is not None and limit == spy[-1]
    saved = json.loads((tmp_path / "run" / "forward_times.json").read_text())["draft_model"]
    assert "plain_step_s" not in saved  # S_plain comes from the run's own plain decoding


@pytest.fixture
def bare_requests(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``requests`` of every bare forward timed through ``forward_time`` (the target's, and a
    draft model's: measure's binding, the module's own, draft_model's)."""
    import specdec.spec.forward_time as ft
    import specdec.spec.proposers.draft_model as draft_model

    seen: list[int] = []
    real = ft.forward_time

    def forward_time(*a: Any, requests: int = 1, **k: Any) -> float:
        seen.append(requests)
        return real(*a, requests=requests, **k)

    for mod in (ft, measure, draft_model):
        monkeypatch.setattr(mod, "forward_time", forward_time)
    return seen


def test_a_batch_runs_limit_times_every_bare_forward_for_the_whole_batch(bench_pair, bare_requests,
                                                                         capsys) -> None:
    # A step of 4 requests is charged forwards of 4 (the target's T(1) and T(γ+1), the
    # draft model's), as plain decoding's S_plain is a step of 4; the cache holds them
    # beside the passes' own 4 (with_room_for_bare).
    target, draft = bench_pair
    _bench("spec").main([f"target={target}", f"draft={draft}", "proposers=[draft_model]", "gammas=[2]",
                         "trees=[]", "num_prompts=4", "batch_size=4", "new_tokens=8", "repeats=1", "threads=1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert bare_requests and set(bare_requests) == {4}
    assert out["efficiency_max"] is not None and out["efficiency_max"] <= 1.0


def test_the_limits_bare_forward_is_the_forward_a_batch_step_runs() -> None:
    # At batch 8 the plain loop's forward call feeds 8 requests; the limit's T_t(1) must be
    # that forward, not one request's (on a 2-core VM: 1.8 ms for 8, 0.6 ms for one), else
    # the limit at τ = 1, S_plain / T_t(1), reads several times what a step can gain.
    import time

    import torch

    from specdec.api import LLM
    from specdec.core.context import SamplingParams
    from specdec.core.pipeline_model import RuntimeConfig
    from specdec.engine import EngineConfig
    from specdec.spec.proposers.ngram import NgramConfig

    pytest.importorskip("transformers")
    path = random_checkpoint(layers=4, hidden=256, vocab=4096, heads=4, kv_heads=4)
    rt = measure.with_room_for_bare(RuntimeConfig(max_batch_size=8, max_seq_len=96, threads=1))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (16,), generator=g).tolist() * 2 for _ in range(8)]
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = LLM(path, runtime=rt, engine_config=EngineConfig(max_batch_size=8))
    spec = {"m": LLM(path, method=NgramConfig(num_speculative_tokens=2), runtime=rt,
                     engine_config=EngineConfig(max_batch_size=8))}
    modules, calls = plain.pipeline.target.modules, []

    class Timed:  # the plain loop's module, its decode steps' calls timed
        def __init__(self, module: Any) -> None:
            self.module = module

        def __getattr__(self, name: str) -> Any:
            return getattr(self.module, name)

        def __call__(self, inp: Any) -> Any:
            t = time.perf_counter()
            out = self.module(inp)
            if inp.tokens.numel() == 8:  # a decode step of the 8
                calls.append(time.perf_counter() - t)
            return out

    modules[0] = Timed(modules[0])
    runs = {"plain": measure.Run(lambda: plain.generate(prompts, sp),
                                 steps=lambda clock: plain.generate_steps(prompts, sp, clock=clock))}
    runs |= measure.limit_runs(spec, 48, requests=8, chunks=4, repeats=5)
    timing = measure.lockstep(runs, baseline="plain", repeats=2, turn_s=0.01)
    assert measure.limit_from(timing, spec)["m"].t_target_1 is not None
    # The least of each (a busy machine's preemptions only add): the forwards' own cost.
    bare = min(x for r in timing.outputs["bare m: t1"] for x in r)
    assert 0.6 < bare / min(calls) < 2.0, (bare, min(calls))


def test_a_batched_run_times_its_bare_forwards_for_the_batch(tiny_pair, tmp_path, bare_requests,
                                                             spy) -> None:  # noqa: F811 (the fixture)
    s = run_experiment(_compose(_overrides(tiny_pair, tmp_path / "run", "logger=none", "data.limit=2",
                                           "batch_size=2", "method=[draft_model]")))
    assert bare_requests and set(bare_requests) == {2}  # one batch of the two requests
    assert s["methods"]["draft_model"]["analytic_limit"] == spy[-1] is not None


def test_a_drafter_timer_that_cannot_time_a_batch_leaves_its_limit_missing_naming_the_method() -> None:
    # A drafter of another package whose draft_forward_time predates `requests`: timed for one
    # request it would charge a batch's drafting at a single request's cost.
    class Proposer:
        def has_draft_cost(self) -> bool:
            return True

        def draft_forward_time(self, ctx_len: int, repeats: int = 10, *, between=None, warmup: int = 3) -> float:
            return 1e-3

    llm = SimpleNamespace(pipeline=SimpleNamespace(target=None, proposer=Proposer()),
                          method=SimpleNamespace(num_speculative_tokens=2))
    assert measure.limit_timers({"mine": llm})["mine", "td"](16, 1) == 1e-3  # one request: as before
    with pytest.warns(UserWarning, match="method 'mine': its drafter's draft_forward_time takes no `requests`"):
        timers = measure.limit_timers({"mine": llm}, requests=4, after_other=True)
    assert ("mine", "td") not in timers and ("mine", "tg_after") not in timers  # untimed: its limit is missing
