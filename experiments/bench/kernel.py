"""Our projection kernel (``specdec_cpu::row_linear``) against the machine's roofline.

    python experiments/bench/kernel.py quick=true
    python experiments/bench/kernel.py rows=[1,2,3,4,5,6,7,8] threads=1
    python experiments/bench/kernel.py quick=true target=smollm2   # the real target's shapes, float32

One pass is a target forward's projections back to back — per layer the fused q/k/v,
o, fused gate/up and down products, then the vocabulary head — on bfloat16 panels in one
huge-page arena (as ``specdec.core.linear.pack_layers`` lays out a bf16 model's weights),
timed inside C++ (``specdec_cpu::row_linear_timed``: no Python between the products), each
product alone: a pass's time is the sum of its products' median times, so on a shared machine
the time slices other processes take drop out.
Shapes are the built-in target's (its ``config.json``), else a random model of the same size;
``target=`` a fetchable name (``smollm2``), a ``.gguf`` file or a checkpoint dir takes that
model's shapes, and its panels' dtype as our runtime packs them: bfloat16 where its
``torch_dtype`` is, else float32 (a GGUF's quantized values dequantize to float32).

For each row count: the median time per pass (and the range of the repeats' medians),
achieved GB/s (weight bytes / time) and GFLOP/s (2 * rows * sum of N * K / time), the
roofline bound = max(weight bytes / copy bandwidth, FLOPs / FLOP peak) and time / bound.
The peaks are measured in the same run on one thread, each the best of many tries, and
scaled by the thread count: the bandwidth (bytes read + written / time) of a copy the size
of the weights, so from the cache level they sit in (a large copy's DRAM figure is printed
too), and the larger of a large float32 ``torch.mm`` and a loop of independent FMAs
(``specdec_cpu::fma_peak``; MKL's sgemm on an AMD CPU can sit far below the FMA units).
Row counts are interleaved within each repeat, so their ratios share the machine's load.

Last line (JSON): ``T5_over_T1``, ``T17_over_T1`` (goals <= 1.3 and <= 2.5), the
roofline's own ratios ``bound5_over_bound1`` and ``bound17_over_bound1`` (the least those
can be here: where the weights sit in cache, 5 rows' FLOPs can take longer than one row's
weight read, and no kernel gets T(5)/T(1) under that), the ``worst_roofline_ratio`` (goal
<= 1.5) and the table's rows.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.core.kernels import cpu_kernels_available
from specdec.measure import builtin_pair, emit_json, load_config, print_table


@dataclass
class KernelBenchConfig:
    quick: bool = False
    rows: list[int] = field(default_factory=lambda: [1, 5, 9, 17, 33, 64])
    threads: int = 2
    repeats: int = 7  # interleaved rounds over the row counts; quick: 3
    passes: int = 200  # timed passes per row count and round (median); quick: 60
    target: str = "builtin"  # whose shapes: "builtin", a fetchable name ("smollm2"), a .gguf file or a checkpoint dir


def target_config(target: str = "builtin") -> dict:
    """The ``config.json`` keys of ``target`` (see ``KernelBenchConfig.target``); for "builtin"
    the shipped target's, else a random model's of its size."""
    from specdec.core.gguf import is_gguf, open_gguf
    from specdec.zoo_fetch import resolve_target

    if target != "builtin":
        path = Path(resolve_target(target))
        return open_gguf(path).hf_config() if is_gguf(path) else json.loads((path / "config.json").read_text())
    cfg = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 10, "num_attention_heads": 4,
           "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 4096, "torch_dtype": "bfloat16"}
    pair = builtin_pair()
    if pair is not None:
        cfg.update(json.loads((pair[0] / "config.json").read_text()))
    return cfg


def panel_dtype(cfg: dict) -> torch.dtype:
    """The dtype our runtime packs ``cfg``'s weights in: bfloat16 values stay bf16, others float32."""
    return torch.bfloat16 if cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16" else torch.float32


def target_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(out, in) of a forward's products in call order for model config ``cfg``."""
    d, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // heads
    layer = [((heads + 2 * kv) * hd, d), (d, heads * hd), (2 * cfg["intermediate_size"], d),
             (d, cfg["intermediate_size"])]
    return layer * cfg["num_hidden_layers"] + [(cfg["vocab_size"], d)]


def packed_arena(shapes: list[tuple[int, int]], dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """Random ``dtype`` weights of ``shapes``, packed, in one huge-page arena, in call order."""
    g = torch.Generator().manual_seed(0)
    panels = [torch.ops.specdec_cpu.row_linear_pack((torch.randn(n, k, generator=g) * k**-0.5).to(dtype))
              for n, k in shapes]
    offsets, total = [], 0
    for p in panels:
        total = -(-total // 64) * 64
        offsets.append(total)
        total += p.numel() * p.element_size()
    arena = torch.ops.specdec_cpu.huge_empty(total)
    out = []
    for p, off in zip(panels, offsets):
        view = arena[off : off + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        view.copy_(p)
        out.append(view)
    return out


def copy_gbps(nbytes: int, reps: int) -> float:
    """Copy bandwidth, GB/s of bytes read + written: the best of ``reps`` copies of ``nbytes``."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / min(times) / 1e9


def matmul_gflops(n: int, reps: int) -> float:
    """float32 ``torch.mm`` of two n x n matrices, GFLOP/s: the best of ``reps``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times) / 1e9


def main(argv: list[str]) -> None:
    cfg = load_config(KernelBenchConfig, argv)
    if not cpu_kernels_available():
        sys.exit("kernel.py: specdec's CPU kernels did not build here (see the warning above)")
    repeats, passes = (3, 60) if cfg.quick else (cfg.repeats, cfg.passes)
    model = target_config(cfg.target)
    shapes, dtype = target_shapes(model), panel_dtype(model)
    weights = packed_arena(shapes, dtype)
    wbytes = sum(w.numel() * w.element_size() for w in weights)
    macs = sum(n * k for n, k in shapes)
    outs = [n for n, _ in shapes]
    # Peaks on one thread, times the thread count: on a shared machine a many-thread peak
    # measure waits on the scheduler (a copy or FMA loop on 2 threads read ~1-2 GB/s or GFLOP/s
    # with 7 processes on 2 cores), while the kernel's back-to-back products keep their threads.
    torch.set_num_threads(1)
    dram_gbps = copy_gbps((128 if cfg.quick else 512) * 2**20, 5 if cfg.quick else 9)
    gbps = copy_gbps(wbytes // 2, 41)  # source + destination = the weights' bytes: their cache level
    mm_gflops = matmul_gflops(1024 if cfg.quick else 2048, 5 if cfg.quick else 9)
    gflops = max(mm_gflops, max(torch.ops.specdec_cpu.fma_peak(20_000) for _ in range(200)))
    kind = str(dtype).removeprefix("torch.")
    print(f"{len(shapes)} products, {wbytes / 1e6:.1f} MB of {kind} panels, {macs / 1e6:.1f} M multiply-adds a row; "
          f"peaks of one thread: copy {dram_gbps:.1f} GB/s (large), {gbps:.1f} GB/s (weights' size), "
          f"torch.mm {mm_gflops:.1f} GFLOP/s, FMA loop {gflops:.1f} GFLOP/s; the roofline takes "
          f"{cfg.threads} x the weights'-size copy and the larger FLOP/s", flush=True)
    gbps, gflops = gbps * cfg.threads, gflops * cfg.threads
    torch.set_num_threads(cfg.threads)

    g = torch.Generator().manual_seed(1)
    xs = {m: [torch.randn(m, k, generator=g) for _, k in shapes] for m in cfg.rows}
    for m in cfg.rows:  # warm-up: first touch, caches, threads
        torch.ops.specdec_cpu.row_linear_timed(xs[m], weights, outs, 5)
    medians: dict[int, list[float]] = {m: [] for m in cfg.rows}
    for _ in range(repeats):
        for m in cfg.rows:
            secs = torch.ops.specdec_cpu.row_linear_timed(xs[m], weights, outs, passes)  # [passes, products]
            medians[m].append(secs.median(0).values.sum().item())

    rows = []
    for m in cfg.rows:
        t = statistics.median(medians[m])
        flops = 2 * m * macs
        bound = max(wbytes / (gbps * 1e9), flops / (gflops * 1e9))
        rows.append({"rows": m, "ms": t * 1e3, "ms_range": f"{min(medians[m]) * 1e3:.3f}-{max(medians[m]) * 1e3:.3f}",
                     "GB/s": wbytes / t / 1e9, "GFLOP/s": flops / t / 1e9, "bound_ms": bound * 1e3,
                     "vs_bound": t / bound})
    print_table(rows, f"projections of one forward, {cfg.threads} threads (T / T(1): "
                + ", ".join(f"{r['rows']}: {r['ms'] / rows[0]['ms']:.2f}" for r in rows) + ")")
    t = {r["rows"]: r["ms"] for r in rows}
    b = {r["rows"]: r["bound_ms"] for r in rows}
    emit_json({
        "T5_over_T1": t[5] / t[1] if 5 in t and 1 in t else None,
        "T17_over_T1": t[17] / t[1] if 17 in t and 1 in t else None,
        "bound5_over_bound1": b[5] / b[1] if 5 in b and 1 in b else None,
        "bound17_over_bound1": b[17] / b[1] if 17 in b and 1 in b else None,
        "worst_roofline_ratio": max(r["vs_bound"] for r in rows),
        "copy_gbps": gbps, "copy_gbps_large": dram_gbps, "peak_gflops": gflops, "matmul_gflops": mm_gflops,
        "weight_mb": wbytes / 1e6, "threads": cfg.threads, "target": cfg.target, "dtype": str(dtype),
        "rows": [{k: v for k, v in r.items() if k != "ms_range"} for r in rows],
    })


if __name__ == "__main__":
    main(sys.argv[1:])
