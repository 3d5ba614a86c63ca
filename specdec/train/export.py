"""Saving a trained :class:`~specdec.models.llama.LlamaDecoder` in Hugging Face format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specdec.models.config import LlamaConfig
from specdec.models.llama import LlamaDecoder


def hf_config_dict(cfg: LlamaConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """The HF ``LlamaConfig`` layout of ``cfg`` (what ``config.json`` holds)."""
    eos = cfg.eos_token_id[0] if len(cfg.eos_token_id) == 1 else list(cfg.eos_token_id)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope.theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "torch_dtype": dtype,
    }


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
