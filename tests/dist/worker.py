"""Run by the tests under ``torchrun --nproc-per-node N``: each rank's outputs to ``<out_dir>/rank<r>.json``.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist/worker.py <scenario> <out_dir> <json args>

Scenarios: ``tp`` (tensor parallel N), ``dp`` (data parallel N across processes: ``LLM.generate``
merged). Args: ``cases``: a list of ``{target, methods: {name: method}}``; ``prompts``,
``max_new_tokens``, ``runtime`` (RuntimeConfig fields), ``sampling`` (SamplingParams fields).
``run``: ``python -m specdec.run <args["argv"]>`` in this process (no result file); ``stall``:
rank 1 skips an all-reduce that rank 0 enters (no result file).
Any scenario: ``clock_rate`` ``{rank: r}`` makes ``time.perf_counter`` run ``r`` times as fast
on that rank (ranks that read different times).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    scenario, out_dir, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    rate = float(args.get("clock_rate", {}).get(os.environ["RANK"], 1.0))
    if rate != 1.0:
        real, t0 = time.perf_counter, time.perf_counter()
        time.perf_counter = lambda: t0 + rate * (real() - t0)
    if scenario == "stall":  # rank 1 skips the second of two all-reduces; rank 0 waits in it
        from specdec.dist.group import init_from_env

        ctx = init_from_env(tensor_parallel_degree=int(os.environ["WORLD_SIZE"]))
        ctx.all_reduce(torch.ones(4))
        if ctx.rank == 0:
            ctx.all_reduce(torch.ones(4))
        else:
            time.sleep(3 * ctx.timeout_s)
        return
    if scenario == "run":
        from specdec.run import main as run_main

        sys.argv[1:] = args["argv"]
        run_main()
        return
    from specdec import LLM, SamplingParams
    from specdec.dist import current, shutdown

    world = int(os.environ["WORLD_SIZE"])
    runtime = dict(args.get("runtime", {}))
    runtime["tensor_parallel_degree" if scenario == "tp" else "data_parallel_degree"] = world
    sp = SamplingParams(max_new_tokens=args["max_new_tokens"], **args.get("sampling", {}))
    result: dict[str, object] = {}
    for i, case in enumerate(args["cases"]):
        for name, method in case["methods"].items():
            llm = LLM(case["target"], method=method, **runtime)
            outs = llm.generate(args["prompts"], sp)
            key = f"{i}/{name}"
            result[key] = [o.token_ids for o in outs]
            result[key + "/errors"] = [o.error for o in outs]
            target = llm.pipeline.target
            result[key + "/params"] = sum(p.numel() for p in target.module.parameters())
            result[key + "/kv_heads"] = target.caches[0].params.num_kv_heads
    ctx = current()
    result["ctx"] = {"rank": ctx.rank, "tp": ctx.tp, "dp": ctx.dp, "backend": ctx.backend}
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":
    main()
