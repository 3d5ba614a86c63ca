"""Plain (autoregressive) decoding: engine overhead and throughput against transformers.

    python experiments/bench/ar.py quick=true
    python experiments/bench/ar.py quick=true compile=true   # ours through torch.compile
    python experiments/bench/ar.py quick=true target=smollm2  # the real target (SmolLM2-135M, GGUF)
    python experiments/bench/ar.py target=/path/to/hf/checkpoint batch_sizes=[1,8,32]

``target=``: ``builtin`` (the shipped code target; random where absent), ``random``, a
fetchable model's name (``smollm2``: :mod:`specdec.zoo_fetch`, fetched on first use), a
``.gguf`` file or a checkpoint dir. transformers' peer of a GGUF target is built from the
same file's weights, dequantized to float32 as ours are (:func:`hf_peer`).

Figures (last line, JSON):
- ``batch1_overhead_ratio``: engine time per decode step at batch 1 divided by
  a bare forward call of the same module at the same context length (medians).
  Both are timed in steady state, as decoding runs them: blocks of ``block``
  consecutive engine steps, each block followed by as many consecutive bare forwards
  (:func:`specdec.spec.forward_time.forward_time`) at the block's last context. Timing
  one step right after bare forwards of a throwaway request instead charges the step
  for the caches those forwards took (the built-in target's weights and KV fill most of
  the last-level cache), a cost plain decoding never pays. Goal <= 1.15.
  ``host_us_per_step``: the same step minus that bare forward, microseconds: the
  engine's host work per step (scheduling, packing, reading the token, bookkeeping)
  and what it costs the forward after it (caches it left cold).
- ``ours_vs_hf``: our tokens/s over transformers ``generate`` tokens/s on the
  same checkpoint, greedy, same prompts, keyed by batch size (median of
  per-pass ratios, interleaved passes). Goal > 1.
- ``weight_read_bound_ms``: the least time a batch-1 decode step can take if
  it reads every weight once from memory: bytes of the target's weights as a
  step reads them (:func:`weight_bytes`: the packed copies, bfloat16 where the
  values are bf16 ones, each value once) / memory read bandwidth, the bandwidth measured here
  (``torch.sum`` over a 512 MB fp32 tensor with the run's thread count,
  median of 7). ``bare_forward_ms``: the median bare batch-1 forward above;
  ``forward_vs_bound`` = bare forward / bound (goal <= 2.5). Weights that fit
  in the last-level cache can be read faster than memory bandwidth, so the
  ratio can fall below 1. Our packed weights sit on transparent huge pages
  (``specdec.core.linear``), where a read stream meets no TLB miss and no
  prefetcher stop every 4 KiB; ``torch.sum`` over ordinary pages reads slower
  than the same sum over huge pages, so ``weight_read_bound_huge_ms`` /
  ``forward_vs_bound_huge`` give the stricter bound from that sum (where THP is
  available; else equal to the first).
- ``outputs_equal``, ``model``, ``compile`` and the ``machine``.

``cpu_linear=`` picks the kernel of our projections (``specdec/core/linear.py``):
``specdec`` (the default, our own packed kernel), ``onednn``, or ``aten``
(``F.linear``: MKL's sgemm, as transformers runs).

``compile=true`` runs ours with ``runtime.compile`` (the bare forward is then
the compiled graph's; each shape compiles in an untimed warm-up first).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import EngineConfig
from specdec.measure import (
    Run,
    Timing,
    builtin_pair,
    checkpoint,
    emit_json,
    hf_model,
    interleave,
    load_config,
    outputs_equal,
    print_table,
    timed,
)
from specdec.spec.forward_time import forward_time
from specdec.zoo_fetch import resolve_target


@dataclass
class ArBenchConfig:
    quick: bool = False
    target: str = "builtin"  # "builtin", "random", a fetchable name ("smollm2"), a .gguf file or a checkpoint dir
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    prompt_len: int = 64
    new_tokens: int = 64
    repeats: int = 3
    overhead_steps: int = 100
    threads: int = 2
    compile: bool = False  # runtime.compile for ours
    cpu_linear: str = RuntimeConfig.cpu_linear  # runtime.cpu_linear for ours: "specdec", "onednn" or "aten"


def overhead_ratio(path: Path, steps: int, prompt_len: int, compile_: bool = False,
                   cpu_linear: str = RuntimeConfig.cpu_linear, block: int = 10) -> tuple[float, float, float, int]:
    """(median engine step, median bare forward, ratio) at batch 1, seconds, and the target's weight bytes.

    ``steps`` decode steps in blocks of ``block`` consecutive ones; after each block, ``block``
    consecutive bare forwards of one token at the block's last context on the same model,
    through a block table of its own (the cache holds room for both).
    """
    max_len = prompt_len + steps + 8
    blocks = 2 * RuntimeConfig(max_batch_size=1, max_seq_len=max_len).blocks()
    llm = LLM(path, runtime=RuntimeConfig(max_batch_size=1, max_seq_len=max_len, num_blocks=blocks, compile=compile_,
                                          cpu_linear=cpu_linear),
              engine_config=EngineConfig(max_batch_size=1))
    if compile_:  # compile the prefill and decode graphs outside the timed steps
        llm.generate([list(range(1, prompt_len + 1))], SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine = llm.new_engine()
    ctx = engine.add_request(list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=steps + 4, ignore_eos=True))
    engine.step()  # prefill
    engine.step()  # the first decode step (its buffers are made here)
    step_t, fwd_t = [], []
    for _ in range(max(1, steps // block)):
        step_t += [timed(engine.step)[0] for _ in range(block)]
        fwd_t.append(forward_time(llm.pipeline.target, 1, len(ctx.tokens), repeats=block))  # a block's median
    s, f = statistics.median(step_t), statistics.median(fwd_t)
    return s, f, s / f, weight_bytes(llm.pipeline.target.module)


def read_bandwidth(mb: int = 512, repeats: int = 7, huge_pages: bool = False) -> float:
    """Memory read bandwidth, bytes/s: median time of ``torch.sum`` over an ``mb`` MB
    fp32 tensor (too large to stay in a CPU's caches), with torch's current thread count;
    ``huge_pages``: the tensor on memory madvised for transparent huge pages, as our packed
    weights are (``specdec_cpu::huge_empty``; ordinary memory where our kernels did not build)."""
    from specdec.core.kernels import cpu_kernels_available

    if huge_pages and cpu_kernels_available():
        x = torch.ops.specdec_cpu.huge_empty(mb * 2**20).view(torch.float32).fill_(1.0)
    else:
        x = torch.ones(mb * 2**20 // 4)
    x.sum()  # first touch: the pages are mapped here, not in a timed pass
    times = [timed(x.sum)[0] for _ in range(repeats)]
    return x.numel() * x.element_size() / statistics.median(times)


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s weights as a decode step reads them: a packed projection's packed
    copy (bfloat16 where its values allow, :func:`specdec.core.linear.lossless_bf16`), every
    other parameter in the run's dtype (tied ones once). The parts of a packed fused layer
    ([q; k; v], [gate; up]) are counted in its packed copy only: their weights are
    placeholders or views the forward never reads."""
    from specdec.core.linear import Linear

    # (a fused layer's parts carry ``fused_in``: ``called_linears`` tells them by storage, which
    # the placeholders of a freed dense weight no longer share)
    linears = [m for m in module.modules() if isinstance(m, Linear) and m.packed is not None and m.fused_in is None]
    total = sum(m.packed.numel() * m.packed.element_size() for m in linears)
    packed = {id(w) for m in linears for w in (m.weight, *(p.weight for p in m.parts))}
    # Parameters no packed layer reads for them (norms, embeddings that are not a tied head).
    return total + sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in packed)


def hf_peer(path: Path) -> Any:
    """transformers' model of ``path`` (float32, eval): a GGUF file's built from the config and
    the dequantized weights our loader reads (:mod:`specdec.core.gguf`: transformers' own GGUF
    path needs ``accelerate``), anything else by :func:`specdec.measure.hf_model`."""
    from specdec.core.gguf import is_gguf, open_gguf

    if not is_gguf(path):
        return hf_model(path)
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = open_gguf(path)
    cfg = AutoConfig.for_model(**ckpt.hf_config())
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {name: load() for name, _, _, load in ckpt.iter_tensors(cfg)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{path}: transformers' model of it lacks {missing} / does not take {unexpected}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def hf_generate(model: Any, ids: torch.Tensor, new_tokens: int) -> list[list[int]]:
    """transformers ``generate``, greedy, exactly ``new_tokens`` per prompt; the new token ids."""
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def ours_and_hf(
    path: Path, hf: Any, prompts: list[list[int]], new_tokens: int, repeats: int, compile_: bool = False,
    cpu_linear: str = RuntimeConfig.cpu_linear,
) -> Timing[list[list[int]]]:
    """Our plain decoding and transformers ``generate`` over ``prompts`` in one batch, interleaved (baseline: hf)."""
    b = len(prompts)
    ours = LLM(path, runtime=RuntimeConfig(max_batch_size=b, max_seq_len=len(prompts[0]) + new_tokens + 8,
                                           compile=compile_, cpu_linear=cpu_linear),
               engine_config=EngineConfig(max_batch_size=b))
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    ids = torch.tensor(prompts)
    runs = {
        "ours": Run(lambda: [o.token_ids for o in ours.generate(prompts, sp)],  # the warm-up meets every shape kind
                    warmup=lambda: ours.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))),
        "hf": Run(lambda: hf_generate(hf, ids, new_tokens), warmup=lambda: hf_generate(hf, ids[:1, :8], 4)),
    }
    return interleave(runs, baseline="hf", repeats=repeats)


def main(argv: list[str]) -> None:
    cfg = load_config(ArBenchConfig, argv)
    torch.set_num_threads(cfg.threads)
    if cfg.quick:
        cfg.repeats, cfg.new_tokens, cfg.overhead_steps = 1, 32, 60
    pair = builtin_pair()
    path = Path(resolve_target(checkpoint(cfg.target, pair and pair[0], layers=6)))  # "smollm2": its cached file
    step, fwd, ratio, nbytes = overhead_ratio(path, cfg.overhead_steps, cfg.prompt_len, cfg.compile,
                                           cfg.cpu_linear)
    bound = nbytes / read_bandwidth()  # seconds to read every weight once
    huge = nbytes / read_bandwidth(huge_pages=True)  # the same over huge pages (as the weights sit)
    print_table([{"engine_step_ms": step * 1e3, "bare_forward_ms": fwd * 1e3, "ratio": ratio,
                  "host_us_per_step": (step - fwd) * 1e6,
                  "weight_read_bound_ms": bound * 1e3, "forward_vs_bound": fwd / bound,
                  "bound_huge_ms": huge * 1e3, "forward_vs_bound_huge": fwd / huge}],
                f"batch-1 decode step, {path}, {torch.get_num_threads()} threads, "
                f"{'compiled' if cfg.compile else 'eager'}, linears through {cfg.cpu_linear}")

    hf = hf_peer(path)
    g = torch.Generator().manual_seed(0)
    rows, ratios, equal = [], {}, True
    for b in cfg.batch_sizes:
        prompts = torch.randint(3, hf.config.vocab_size, (b, cfg.prompt_len), generator=g).tolist()
        timing = ours_and_hf(path, hf, prompts, cfg.new_tokens, cfg.repeats, cfg.compile, cfg.cpu_linear)
        equal &= outputs_equal(timing.last("ours"), timing.last("hf"))
        ratios[str(b)] = timing.speedup("ours")
        tokens = b * cfg.new_tokens
        rows.append({"batch": b, "ours_tok_s": tokens / timing.median("ours"),
                     "hf_tok_s": tokens / timing.median("hf"), "ours_vs_hf": ratios[str(b)]})
    print_table(rows, f"greedy throughput, prompt {cfg.prompt_len}, {cfg.new_tokens} new tokens, "
                      f"{cfg.repeats} interleaved passes (tok/s: medians; ours_vs_hf: median of per-pass ratios)")
    emit_json({"batch1_overhead_ratio": round(ratio, 4), "host_us_per_step": round((step - fwd) * 1e6, 1),
               "ours_vs_hf": {k: round(v, 3) for k, v in ratios.items()},
               "weight_read_bound_ms": round(bound * 1e3, 3), "bare_forward_ms": round(fwd * 1e3, 3),
               "forward_vs_bound": round(fwd / bound, 3), "weight_read_bound_huge_ms": round(huge * 1e3, 3),
               "forward_vs_bound_huge": round(fwd / huge, 3), "outputs_equal": equal, "model": str(path),
               "compile": cfg.compile, "cpu_linear": cfg.cpu_linear})


if __name__ == "__main__":
    main(sys.argv[1:])
