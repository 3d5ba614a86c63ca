"""Shared helpers of the benchmark scripts: ``key=value`` overrides, checkpoints, tables.

Each benchmark prints a table and ends with one line of JSON holding its
headline figures. Ratios are measured side by side in one run (interleaved
repeats) and medians are quoted.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "specdec" / "zoo"
C = TypeVar("C")


def parse_overrides(cls: type[C], argv: Sequence[str]) -> C:
    """``key=value`` arguments into dataclass ``cls``; unknown keys are an error."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for arg in argv:
        if "=" not in arg:
            raise SystemExit(f"expected key=value, got {arg!r}; keys: {', '.join(fields)}")
        key, value = arg.split("=", 1)
        if key not in fields:
            raise SystemExit(f"unknown key {key!r}; keys: {', '.join(fields)}")
        kwargs[key] = json.loads(value) if value[:1] in "[{0123456789-" or value in ("true", "false", "null") else value
    return cls(**kwargs)


def random_checkpoint(*, layers: int, hidden: int = 256, vocab: int = 4096, seed: int = 0,
                      heads: int = 8, kv_heads: int = 4, out: Path | None = None) -> Path:
    """Saves a random Llama checkpoint in HF format (with transformers) and returns its dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
        tie_word_embeddings=True, initializer_range=0.3,
    )
    out = out or Path(tempfile.mkdtemp(prefix="specdec-bench-"))
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def builtin_pair() -> tuple[Path, Path] | None:
    t, d = ZOO / "code-target", ZOO / "code-draft"
    return (t, d) if (t / "model.safetensors").is_file() and (d / "model.safetensors").is_file() else None


def builtin_prompts(tokenizer_dir: Path, n: int) -> list[list[int]] | None:
    f = ZOO / "prompts.jsonl"
    if not f.is_file():
        return None
    from specdec.core.checkpoint import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return [tok.encode(r["prompt"]).ids for r in rows[:n]]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``fn()`` takes, and its result.

    First it moves every object alive now (models, compiled graphs, the
    libraries' own) out of the garbage collector's view (``gc.freeze``, as
    serving engines do after start-up). Otherwise a full collection over the
    benchmark process's ~600k objects (200-350 ms each, several per run) lands
    inside whichever pass it happens to, ours or transformers', at random.
    """
    gc.freeze()
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def print_table(rows: list[dict[str, Any]], title: str = "") -> None:
    if title:
        print(f"\n{title}")
    if not rows:
        return
    cols = list(rows[0])
    fmt = {c: (lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)) for c in cols}
    cells = [[fmt[c](r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    sys.stdout.flush()


def emit_json(figures: dict[str, Any]) -> None:
    """The last line of every benchmark: its headline figures."""
    print(json.dumps(figures, sort_keys=True))
