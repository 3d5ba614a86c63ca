"""A forward repeated (as bare times are taken) against the same forward run as the loop runs it.

    python experiments/bench/interleaved.py quick=true
    python experiments/bench/interleaved.py gamma=8 compile=true

The analytic limit charges bare forward times: one module call timed again and
again. A speculative step runs the target's verification (γ+1 rows) and the
drafter's γ one-token forwards one after another, so each model starts on
caches the other one just used. This times, on the built-in pair at batch 1:

- ``target``: T_target(γ+1) repeated, and each target call right after γ draft
  forwards (as in the loop);
- ``draft``: T_draft(1) repeated, and the first draft forward right after a
  target forward (the loop's catch-up position).

Rounds alternate the two ways; each figure is the median over calls of all
rounds. Last line (JSON): ``target_in_turn_vs_repeated`` and
``draft_first_vs_repeated`` (ratios of medians; > 1: the bare time undercounts
what the loop pays), the times in ms, and the ``machine``.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch

from specdec.api import LLM
from specdec.core.context import SamplingParams, TextContext
from specdec.core.inputs import DecoderInputs
from specdec.core.kv_cache import BlockTable
from specdec.core.pipeline_model import DecoderPipelineModel, RuntimeConfig
from specdec.measure import builtin_pair, emit_json, load_config, print_table
from specdec.spec.proposers import config_class


@dataclass
class InterleavedConfig:
    quick: bool = False
    gamma: int = 4
    ctx_len: int = 200  # keys each forward reads
    rounds: int = 5
    calls: int = 40  # timed calls per way per round
    threads: int = 2
    compile: bool = False


def bare_inputs(pm: DecoderPipelineModel, n: int, ctx_len: int, rid: str) -> DecoderInputs:
    """Inputs of one forward of ``n`` new tokens for a request whose cache holds ``ctx_len - n``
    (as :func:`specdec.spec.forward_time.forward_time` builds them)."""
    ctx = TextContext(request_id=rid, tokens=[1] * ctx_len, prompt_len=ctx_len, sampling=SamplingParams())
    table = ctx.kv.setdefault(pm.cache_name, BlockTable())
    pm.caches[0].reserve(table, ctx_len)
    table.num_tokens = ctx_len - n
    inputs = pm.processor.prepare_initial_token_inputs([[ctx]], return_n_logits=n, with_state=False).inputs
    inputs.kv_cache = pm.caches[0].tensors
    return inputs


def clock(fn: object, *args: object) -> float:
    t = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    return time.perf_counter() - t


@torch.inference_mode()
def main(argv: list[str]) -> None:
    cfg = load_config(InterleavedConfig, argv)
    torch.set_num_threads(cfg.threads)
    if cfg.quick:
        cfg.rounds, cfg.calls = 3, 30
    pair = builtin_pair()
    if pair is None:
        sys.exit("the built-in pair is not shipped in this checkout (specdec/zoo)")
    target, draft = pair
    g = cfg.gamma
    llm = LLM(target, method=config_class("draft_model")(path=str(draft), num_speculative_tokens=g),
              runtime=RuntimeConfig(max_batch_size=1, max_seq_len=cfg.ctx_len + 16, threads=cfg.threads,
                                    compile=cfg.compile))
    tp, dp = llm.pipeline.target, llm.pipeline.proposer.draft_model
    assert dp is not None
    t_in, d_in = bare_inputs(tp, g + 1, cfg.ctx_len, "target"), bare_inputs(dp, 1, cfg.ctx_len, "draft")
    t_mod, d_mod = tp.module, dp.module
    for _ in range(5):  # warm-up (compiled: the graphs compile here)
        t_mod(t_in)
        d_mod(d_in)
    times: dict[str, list[float]] = {"target repeated": [], "target in turn": [], "draft repeated": [],
                                     "draft first after target": []}
    for _ in range(cfg.rounds):
        times["target repeated"] += [clock(t_mod, t_in) for _ in range(cfg.calls)]
        times["draft repeated"] += [clock(d_mod, d_in) for _ in range(cfg.calls)]
        for _ in range(cfg.calls):  # as the loop: verify, then γ draft forwards
            times["target in turn"].append(clock(t_mod, t_in))
            times["draft first after target"].append(clock(d_mod, d_in))
            for _ in range(g - 1):
                d_mod(d_in)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print_table([{"forward": k, "median_ms": v} for k, v in ms.items()],
                f"built-in pair, batch 1, γ = {g}, context {cfg.ctx_len}, {cfg.threads} threads, "
                f"{'compiled' if cfg.compile else 'eager'}; {cfg.rounds} rounds × {cfg.calls} calls")
    emit_json({
        "target_in_turn_vs_repeated": round(ms["target in turn"] / ms["target repeated"], 3),
        "draft_first_vs_repeated": round(ms["draft first after target"] / ms["draft repeated"], 3),
        "ms": {k: round(v, 3) for k, v in ms.items()},
        "gamma": g, "compile": cfg.compile,
    })


if __name__ == "__main__":
    main(sys.argv[1:])
