"""Run by the tests under ``torchrun --nproc-per-node N``: each rank's outputs to ``<out_dir>/rank<r>.json``.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist/worker.py <scenario> <out_dir> <json args>

Scenarios: ``tp`` (tensor parallel N), ``dp`` (data parallel N across processes: ``LLM.generate``
merged). Args: ``cases``: a list of ``{target, methods: {name: method}}``; ``prompts``,
``max_new_tokens``, ``runtime`` (RuntimeConfig fields), ``sampling`` (SamplingParams fields).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main() -> None:
    scenario, out_dir, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
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
