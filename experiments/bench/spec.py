"""Speculative decoding against our own plain decoding, per proposer and γ.

    python experiments/bench/spec.py quick=true
    python experiments/bench/spec.py batch_size=4 gammas=[1,2,4,8]

For each proposer and γ: τ, α, tokens/s, speedup over our plain decoding of
the same target (same prompts, same batch size, same run, interleaved
repeats, medians) and efficiency = speedup / analytic limit, where

    limit = τ · T_target(1) / (T_target(γ+1) + γ · T_draft(1))

from bare forward times measured in the same run (T_draft = 0 for n-gram).
Last line (JSON): ``efficiency_batch1`` (of the fastest proposer/γ at batch
1), ``outputs_equal`` (every greedy output matched plain decoding), and the
best speedups.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    builtin_pair,
    builtin_prompts,
    emit_json,
    median,
    parse_overrides,
    print_table,
    random_checkpoint,
    timed,
)

from specdec.api import LLM  # noqa: E402
from specdec.core.context import SamplingParams  # noqa: E402
from specdec.core.pipeline_model import RuntimeConfig  # noqa: E402
from specdec.engine import EngineConfig  # noqa: E402
from specdec.spec.forward_time import forward_times  # noqa: E402
from specdec.spec.metrics import analytic_limit  # noqa: E402
from specdec.spec.proposers.draft_model import DraftModelConfig  # noqa: E402
from specdec.spec.proposers.ngram import NgramConfig  # noqa: E402


@dataclass
class SpecBenchConfig:
    quick: bool = False
    target: str = "builtin"  # "builtin", "random" or a checkpoint dir
    draft: str = "builtin"
    proposers: list[str] = field(default_factory=lambda: ["draft_model", "ngram"])
    gammas: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    num_prompts: int = 8
    new_tokens: int = 64
    batch_size: int = 1
    repeats: int = 3
    threads: int = 2
    device: str = "cpu"  # cuda: see gpu.sh
    compile: bool = False  # runtime.compile for every pipeline


def method_config(name: str, gamma: int, draft: Path):
    if name == "draft_model":
        return DraftModelConfig(path=str(draft), num_speculative_tokens=gamma)
    if name == "ngram":
        return NgramConfig(num_speculative_tokens=gamma)
    raise SystemExit(f"unknown proposer {name!r} (draft_model, ngram)")


def main(argv: list[str]) -> None:
    cfg = parse_overrides(SpecBenchConfig, argv)
    torch.set_num_threads(cfg.threads)
    if cfg.quick:
        cfg.repeats, cfg.num_prompts, cfg.new_tokens, cfg.gammas = 2, 4, 64, [1, 2, 4, 8]
    pair = builtin_pair()
    if cfg.target == "builtin" and pair is not None:
        target, draft = pair
    else:
        target = Path(cfg.target) if cfg.target not in ("builtin", "random") else random_checkpoint(layers=6)
        draft = Path(cfg.draft) if cfg.draft not in ("builtin", "random") else random_checkpoint(layers=1, seed=1)
    prompts = builtin_prompts(target, cfg.num_prompts) if pair is not None and cfg.target == "builtin" else None
    if prompts is None:
        g = torch.Generator().manual_seed(0)
        # Repetitive prompts give n-gram lookup something to find.
        prompts = [(torch.randint(3, 200, (16,), generator=g).tolist() * 4) for _ in range(cfg.num_prompts)]
    max_len = max(len(p) for p in prompts) + cfg.new_tokens + 16
    runtime = RuntimeConfig(max_batch_size=cfg.batch_size, max_seq_len=max_len, device=cfg.device,
                            compile=cfg.compile)
    engine_cfg = EngineConfig(max_batch_size=cfg.batch_size)
    sp = SamplingParams(max_new_tokens=cfg.new_tokens, ignore_eos=True)

    plain = LLM(target, runtime=runtime, engine_config=engine_cfg)
    runs = {(n, gm): LLM(target, method=method_config(n, gm, draft), runtime=runtime, engine_config=engine_cfg)
            for n in cfg.proposers for gm in cfg.gammas}
    for llm in [plain, *runs.values()]:  # warm-up
        llm.generate(prompts[:1], SamplingParams(max_new_tokens=8, ignore_eos=True))
    times: dict[object, list[float]] = {k: [] for k in ["plain", *runs]}
    outputs: dict[object, list[list[int]]] = {}
    for _ in range(cfg.repeats):  # interleaved repeats
        for key, llm in [("plain", plain), *runs.items()]:
            if key != "plain":
                llm.pipeline.counts.clear()
            t, outs = timed(lambda: llm.generate(prompts, sp))
            times[key].append(t)
            outputs[key] = [o.token_ids for o in outs]
    n_tokens = sum(len(o) for o in outputs["plain"])
    plain_tps = n_tokens / median(times["plain"])

    # Bare forward times at a typical context length, for the analytic limit.
    ctx_len = max(len(p) for p in prompts) + cfg.new_tokens // 2
    sizes = sorted({1, *(g + 1 for g in cfg.gammas)})
    bare = {f"target/{n}": (plain.pipeline.target, n) for n in sizes}
    if "draft_model" in cfg.proposers:
        bare["draft"] = (runs[("draft_model", cfg.gammas[0])].pipeline.proposer.pipeline, 1)
    times_bare = forward_times(bare, ctx_len, rounds=3 if cfg.quick else 5)  # interleaved
    t_target = {n: times_bare[f"target/{n}"] for n in sizes}
    t_draft = times_bare.get("draft", 0.0)

    rows, equal = [], True
    best = None
    for (name, gm), llm in runs.items():
        counts = llm.pipeline.run_counts()
        tps = n_tokens / median(times[(name, gm)])
        speedup = tps / plain_tps
        limit = analytic_limit(tau=counts.tau, gamma=gm, t_target_1=t_target[1], t_target_g1=t_target[gm + 1],
                               t_draft_1=t_draft if name == "draft_model" else 0.0)
        eff = speedup / limit if limit else 0.0
        same = outputs[(name, gm)] == outputs["plain"]
        equal &= same
        rows.append({"proposer": name, "gamma": gm, "tau": counts.tau, "alpha": counts.alpha, "tok_s": tps,
                     "speedup": speedup, "limit": limit, "efficiency": eff, "equal": same})
        if best is None or speedup > best["speedup"]:
            best = rows[-1]
    print_table([{"method": "plain", "tok_s": plain_tps, "T_target(1)_ms": t_target[1] * 1e3,
                  "T_draft(1)_ms": t_draft * 1e3}], f"plain decoding, batch {cfg.batch_size}, {target}")
    print_table(rows, f"speculation, batch {cfg.batch_size}, {len(prompts)} prompts x {cfg.new_tokens} tokens, "
                f"medians of {cfg.repeats}")
    best_by = {}
    for r in rows:
        if r["proposer"] not in best_by or r["speedup"] > best_by[r["proposer"]]["speedup"]:
            best_by[r["proposer"]] = r
    key = "efficiency_batch1" if cfg.batch_size == 1 else f"efficiency_batch{cfg.batch_size}"
    emit_json({
        key: round(best["efficiency"], 4),
        "best": f"{best['proposer']} gamma={best['gamma']}",
        "speedup": {p: round(r["speedup"], 3) for p, r in best_by.items()},
        "tau": {p: round(r["tau"], 3) for p, r in best_by.items()},
        "outputs_equal": equal,
    })


if __name__ == "__main__":
    main(sys.argv[1:])
