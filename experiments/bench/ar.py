"""Plain (autoregressive) decoding: engine overhead and throughput against transformers.

    python experiments/bench/ar.py quick=true
    python experiments/bench/ar.py model=/path/to/hf/checkpoint batch_sizes=[1,8,32]

Figures (last line, JSON):
- ``batch1_overhead_ratio``: engine time per decode step at batch 1 divided by
  a bare forward call of the same module on the same inputs (each step is
  followed by a bare call on that step's inputs; medians). Goal <= 1.15.
- ``ours_vs_hf``: our tokens/s over transformers ``generate`` tokens/s on the
  same checkpoint, greedy, same prompts, keyed by batch size. Goal > 1.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    builtin_pair,
    emit_json,
    median,
    parse_overrides,
    print_table,
    random_checkpoint,
    timed,
)

from specdec.core.context import SamplingParams  # noqa: E402
from specdec.core.pipeline_model import PlainGeneration, RuntimeConfig, registered_pipeline_model  # noqa: E402
from specdec.engine import Engine, EngineConfig, generate_ids  # noqa: E402


@dataclass
class ArBenchConfig:
    quick: bool = False
    model: str = "builtin"  # "builtin", "random" or a checkpoint dir
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    prompt_len: int = 64
    new_tokens: int = 64
    repeats: int = 3
    overhead_steps: int = 100
    threads: int = 2


def overhead_ratio(path: Path, steps: int) -> tuple[float, float, float]:
    """(median engine step, median bare forward, ratio) at batch 1, seconds."""
    pm = registered_pipeline_model(path, RuntimeConfig(max_batch_size=1, max_seq_len=64 + steps + 8))
    engine = Engine(PlainGeneration(pm, pm.processor.runtime.max_seq_len), EngineConfig(max_batch_size=1))
    engine.add_request(list(range(1, 65)), SamplingParams(max_new_tokens=steps + 2, ignore_eos=True))
    engine.step()  # prefill
    captured = {}
    execute = pm.execute

    def spy(batch):  # remember the step's inputs for the bare call
        captured["inputs"] = batch.inputs
        return execute(batch)

    pm.execute = spy  # type: ignore[method-assign]
    step_t, fwd_t = [], []
    with torch.inference_mode():
        for _ in range(steps):
            t, _ = timed(engine.step)
            step_t.append(t)
            inp = captured["inputs"]
            inp.kv_cache = pm.caches[0].tensors
            t, _ = timed(lambda: pm.module(inp))  # rewrites the same KV slot with the same values
            fwd_t.append(t)
    s, f = median(step_t), median(fwd_t)
    return s, f, s / f


def ours_tps(path: Path, prompts: list[list[int]], new_tokens: int) -> float:
    b = len(prompts)
    pm = registered_pipeline_model(path, RuntimeConfig(max_batch_size=b, max_seq_len=len(prompts[0]) + new_tokens + 8))
    engine = Engine(PlainGeneration(pm, pm.processor.runtime.max_seq_len), EngineConfig(max_batch_size=b))
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    generate_ids(engine, prompts[:1], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    t, ctxs = timed(lambda: generate_ids(engine, prompts, sp))
    return b * new_tokens / t, [c.generated for c in ctxs]


def hf_tps(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        t, out = timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kw))
    return len(prompts) * new_tokens / t, out[:, ids.shape[1]:].tolist()


def main(argv: list[str]) -> None:
    cfg = parse_overrides(ArBenchConfig, argv)
    torch.set_num_threads(cfg.threads)
    if cfg.quick:
        cfg.repeats, cfg.new_tokens, cfg.overhead_steps = 1, 32, 60
    if cfg.model == "builtin" and builtin_pair() is not None:
        path = builtin_pair()[0]
    elif cfg.model in ("builtin", "random"):
        path = random_checkpoint(layers=6)
    else:
        path = Path(cfg.model)
    step, fwd, ratio = overhead_ratio(path, cfg.overhead_steps)
    print_table([{"engine_step_ms": step * 1e3, "bare_forward_ms": fwd * 1e3, "ratio": ratio}],
                f"batch-1 decode step, {path}")

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows, ratios, equal = [], {}, True
    for b in cfg.batch_sizes:
        prompts = torch.randint(3, vocab, (b, cfg.prompt_len), generator=g).tolist()
        ours, theirs = [], []
        for _ in range(cfg.repeats):  # interleaved
            o, o_out = ours_tps(path, prompts, cfg.new_tokens)
            h, h_out = hf_tps(hf, prompts, cfg.new_tokens)
            ours.append(o)
            theirs.append(h)
            equal &= o_out == h_out
        ratios[str(b)] = median(ours) / median(theirs)
        rows.append({"batch": b, "ours_tok_s": median(ours), "hf_tok_s": median(theirs), "ours_vs_hf": ratios[str(b)]})
    print_table(rows, f"greedy throughput, prompt {cfg.prompt_len}, {cfg.new_tokens} new tokens, medians of {cfg.repeats}")
    emit_json({"batch1_overhead_ratio": round(ratio, 4), "ours_vs_hf": {k: round(v, 3) for k, v in ratios.items()},
               "outputs_equal": equal, "model": str(path)})


if __name__ == "__main__":
    main(sys.argv[1:])
