"""Peak resident memory of loading a target, against the size of its weights.

Each model loads in a fresh subprocess, as ``LLM`` loads a target on CPU
(``keep_large_allocations``, then ``registered_pipeline_model``: read, fuse,
pack), with a KV cache of one short sequence. Per model:

- ``weights_bytes``: the module's weights in the runtime dtype (float32);
- ``peak_rss_load_bytes``: the child's peak RSS (``ru_maxrss``) minus its RSS
  after ``import specdec, torch``, less the KV cache's bytes;
- ``steady_rss_bytes``: its RSS once loaded, on the same baseline (also less the cache).

Prints a table, then one line of JSON (one object per model).

    .venv/bin/python experiments/bench/load_memory.py [code-target] [smollm2]
"""

from __future__ import annotations

import json
import subprocess
import sys

MODELS = {"code-target": "specdec/zoo/code-target", "smollm2": "smollm2"}

CHILD = r"""
import json, resource, sys
import torch, specdec

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

torch.set_num_threads(1)
from specdec.core.pipeline_model import RuntimeConfig, keep_large_allocations, registered_pipeline_model
from specdec.zoo_fetch import resolve_target

path = resolve_target(sys.argv[1])  # (fetched, if it must be, before the baseline)
base = rss()
keep_large_allocations()  # as LLM does on CPU
model = registered_pipeline_model(path, RuntimeConfig(max_batch_size=1, max_seq_len=64, threads=1))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
steady = rss()
module = model.module
# (parameters keep their shapes once packed: a freed dense weight is a placeholder of its shape)
weights = sum(p.numel() for p in module.parameters()) * torch.empty(0, dtype=torch.float32).element_size()
weights += sum(b.numel() * b.element_size() for m in module.modules() for n, b in m._buffers.items()
               if b is not None and n not in m._non_persistent_buffers_set)
kv = sum(t.numel() * t.element_size() for c in model.caches for t in (c.tensors.k, c.tensors.v))
print(json.dumps({"weights_bytes": weights, "peak_rss_load_bytes": peak - base - kv,
                  "steady_rss_bytes": steady - base - kv, "kv_bytes": kv}))
"""


def measure(name: str, path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True,
                         env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"})
    if out.returncode != 0:
        raise SystemExit(f"{name}: the child failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["peak_over_weights"] = round(r["peak_rss_load_bytes"] / r["weights_bytes"], 3)
    return {"model": name, **r}


def main(names: list[str]) -> None:
    rows = [measure(n, MODELS[n]) for n in names or list(MODELS)]
    mib = 1 << 20
    print(f"{'model':<12} {'weights MiB':>12} {'peak MiB':>10} {'peak/weights':>13} {'steady MiB':>11}")
    for r in rows:
        print(f"{r['model']:<12} {r['weights_bytes'] / mib:12.1f} {r['peak_rss_load_bytes'] / mib:10.1f} "
              f"{r['peak_over_weights']:13.3f} {r['steady_rss_bytes'] / mib:11.1f}")
    print(json.dumps([{k: r[k] for k in ("model", "weights_bytes", "peak_rss_load_bytes", "peak_over_weights",
                                          "steady_rss_bytes")} for r in rows]))


if __name__ == "__main__":
    main(sys.argv[1:])
