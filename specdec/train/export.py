"""Saving a trained :class:`~specdec.models.llama.LlamaDecoder` in Hugging Face format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specdec.models.config import hf_config_dict
from specdec.models.llama import LlamaDecoder


def bf16_state_dict(model: LlamaDecoder) -> dict[str, torch.Tensor]:
    """HF-named bf16 tensors; ``lm_head.weight`` omitted when tied to the embedding."""
    sd = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        sd[name] = t.detach().to(torch.bfloat16).contiguous().clone()
    return sd


def round_to_bf16_(model: LlamaDecoder) -> None:
    """Rounds the parameters in place to bf16 values (kept in their dtype)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def save_hf(model: LlamaDecoder, tokenizer: Any, out_dir: str | Path) -> list[Path]:
    """Writes ``config.json``, ``model.safetensors`` (bf16) and ``tokenizer.json``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config_dict(model.config), indent=2) + "\n")
    save_file(bf16_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    return [out / "config.json", out / "model.safetensors", out / "tokenizer.json"]
