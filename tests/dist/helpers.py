"""Helpers of the distributed tests: tiny random checkpoints (no transformers) and torchrun launches."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")


def tiny_checkpoint(path: Path, arch: str = "llama", *, vocab: int = 131, tie: bool = False, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, hidden: int = 32, seed: int = 0) -> Path:
    """A random HF-format checkpoint of our own decoder (written with safetensors).

    ``arch``: llama (GQA), qwen2 (q/k/v bias), qwen3 (q/k norm, head_dim 16).
    An odd ``vocab`` exercises the vocabulary padding of the parallel embedding and head.
    """
    from safetensors.torch import save_file

    from specdec.models.config import LlamaConfig
    from specdec.models.llama import LlamaDecoder

    hf: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": arch, "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": tie, "eos_token_id": None, "bos_token_id": None,
    }
    if arch == "qwen3":
        hf["head_dim"] = 16
    torch.manual_seed(seed)
    model = LlamaDecoder(LlamaConfig.from_dict(hf))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.4)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if tie:
        sd.pop("lm_head.weight")
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf))
    return path


def tiny_pair(d: Path) -> list[str]:
    """Overrides for a tiny target and draft with the built-in pair's tokenizer (text prompts)."""
    import shutil

    from specdec.conf_schema import ZOO_DIR

    paths = {}
    for name, layers, seed in (("target", 2, 6), ("draft", 1, 7)):
        paths[name] = tiny_checkpoint(d / f"tiny-{name}", "llama", vocab=4096, layers=layers, seed=seed)
        shutil.copy(ZOO_DIR / "code-target" / "tokenizer.json", paths[name] / "tokenizer.json")
    return [f"target.path={paths['target']}", f"draft.path={paths['draft']}"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(args: list[str], *, nproc: int = 2, cwd: Path | None = None, timeout: float = 300,
             env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --nproc-per-node nproc <args>`` on this machine (Gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECDEC_DIST_TIMEOUT": "120", "WANDB_MODE": "disabled",
                **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
    out = subprocess.run(cmd, cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"torchrun failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}")
    return out


def run_worker(tmp: Path, scenario: str, args: dict[str, Any], nproc: int = 2) -> list[dict[str, Any]]:
    """Runs tests/dist/worker.py under torchrun; returns each rank's result."""
    tmp.mkdir(parents=True, exist_ok=True)
    torchrun([str(WORKER), scenario, str(tmp), json.dumps(args)], nproc=nproc)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(nproc)]
