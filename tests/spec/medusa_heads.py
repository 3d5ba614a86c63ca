"""Medusa heads for tiny targets, written in the published layouts.

``medusa_checkpoint(dir, ...)`` writes safetensors exactly as FasterDecoding/Medusa
names them (``medusa_head.{i}.{j}.linear.{weight,bias}``, ``medusa_head.{i}.{L}.weight``),
with a published-style ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``,
no sizes, no architectures) unless asked otherwise.

``medusa_for(target, kind)`` makes one per (target, kind), cached:

- ``medusa``: random blocks and own random lm heads (K = 4, L_m = 1): rejections;
- ``medusa-shared``: Medusa-2 format (``version: "2"``, the target's lm_head), random
  blocks repeated L_m = 2 times;
- ``medusa-echo``: zero blocks (each head is the identity) sharing the target's lm_head:
  every head proposes the bonus token again, so its acceptance is fixed by plain
  decoding's output (``echo_drafter.expected_counts``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle_heads import scratch_dir  # tests/spec/eagle_heads.py: one session dir, removed at exit


def medusa_checkpoint(d: Path, *, hidden: int, vocab: int, heads: int = 4, layers: int = 1, shared: bool = False,
                      version_key: bool = True, sizes: bool = False, arch: bool = False, std: float = 0.3,
                      seed: int = 0, echo: bool = False, all_block_keys: bool = False,
                      distinct_blocks: bool = False) -> Path:
    g = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {}
    for i in range(heads):
        w = torch.zeros(hidden, hidden) if echo else torch.randn(hidden, hidden, generator=g) * std
        b = torch.zeros(hidden) if echo else torch.randn(hidden, generator=g) * std
        for j in range(layers if all_block_keys else 1):  # torch state_dict repeats the shared block's keys
            jw = w + 1.0 if distinct_blocks and j else w
            t[f"medusa_head.{i}.{j}.linear.weight"] = jw.clone()
            t[f"medusa_head.{i}.{j}.linear.bias"] = b.clone()
        if not shared:
            t[f"medusa_head.{i}.{layers}.weight"] = torch.randn(vocab, hidden, generator=g) * std
    cfg: dict[str, Any] = {"medusa_num_heads": heads, "medusa_num_layers": layers,
                           "base_model_name_or_path": "tiny", "transformers_version": "4.40.0"}
    if shared and version_key:
        cfg["version"] = "2"
    if sizes:
        cfg.update(hidden_size=hidden, vocab_size=vocab)
    if arch:
        cfg["architectures"] = ["MedusaModel"]
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in t.items()}, str(d / "model.safetensors"))
    return d


_HEADS: dict[tuple[str, str], Path] = {}


def medusa_for(target: Any, kind: str) -> Path:
    path = Path(target.path)
    key = (str(path), kind)
    if key not in _HEADS:
        tc = json.loads((path / "config.json").read_text())
        out = scratch_dir(kind)
        h, v = int(tc["hidden_size"]), int(tc["vocab_size"])
        if kind == "medusa":
            medusa_checkpoint(out, hidden=h, vocab=v, heads=4, layers=1)
        elif kind == "medusa-shared":
            medusa_checkpoint(out, hidden=h, vocab=v, heads=4, layers=2, shared=True, std=0.1, seed=1)
        elif kind == "medusa-echo":
            medusa_checkpoint(out, hidden=h, vocab=v, heads=8, layers=1, shared=True, echo=True)
        else:
            raise ValueError(kind)
        _HEADS[key] = out
    return _HEADS[key]
