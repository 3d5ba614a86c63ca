"""Fixtures of the speculation tests: tiny random Llama checkpoints and drafters for them.

A *good* drafter for a target is the target itself (greedy τ = γ + 1), an
in-between one the target with perturbed weights, a bad one an unrelated
random model of the same vocabulary.

``transformers`` is the reference that builds the checkpoints (never a
dependency of ``specdec``); it is imported inside the fixtures.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared, busy
    CPU OpenMP spin-waiting makes them 10-50x slower; run single-threaded."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@dataclass(frozen=True)
class Tiny:
    """One saved tiny checkpoint and the HF model it was saved from (fp32, eval)."""

    path: Path
    hf: Any  # transformers.LlamaForCausalLM; callers must not modify it
    vocab_size: int


def _llama(*, vocab: int, layers: int, init: float, seed: int, eos: int | None, qk_scale: float) -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        # Large init: logits well separated, so greedy argmax is the model's
        # choice and not float noise.
        initializer_range=init,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    if qk_scale != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(qk_scale)
                layer.self_attn.k_proj.weight.mul_(qk_scale)
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Tiny]:
    """Factory: ``tiny_llama(vocab=64, layers=2, init=0.4, seed=0, eos=None,
    qk_scale=1.0, perturb=0.0, perturb_seed=0) -> Tiny``, cached per argument set.

    ``qk_scale < 1`` shrinks the attention queries and keys: attention then
    averages the context almost uniformly, and greedy output tends to fall
    into loops (so n-gram drafting gets accepted). The context still matters.

    ``perturb > 0`` adds N(0, perturb²) noise to every weight of the model
    built from the other arguments (a drafter that agrees with it often).
    """
    cache: dict[tuple, Tiny] = {}

    def make(
        *,
        vocab: int = 64,
        layers: int = 2,
        init: float = 0.4,
        seed: int = 0,
        eos: int | None = None,
        qk_scale: float = 1.0,
        perturb: float = 0.0,
        perturb_seed: int = 0,
    ) -> Tiny:
        key = (vocab, layers, init, seed, eos, qk_scale, perturb, perturb_seed)
        if key not in cache:
            model = _llama(vocab=vocab, layers=layers, init=init, seed=seed, eos=eos, qk_scale=qk_scale)
            if perturb:
                g = torch.Generator().manual_seed(perturb_seed)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * perturb)
            name = f"llama-v{vocab}-l{layers}-s{seed}-e{eos}-qk{qk_scale}-p{perturb}-{perturb_seed}".replace(".", "_")
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            cache[key] = Tiny(path, model, vocab)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def with_eos(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Tiny, int], Path]:
    """``with_eos(tiny, eos)``: a copy of ``tiny``'s checkpoint directory whose
    config names ``eos`` as the EOS token (same weights)."""
    import shutil

    def make(tiny: Tiny, eos: int) -> Path:
        dst = tmp_path_factory.mktemp(f"eos{eos}") / "ckpt"
        shutil.copytree(tiny.path, dst)
        cfg = json.loads((dst / "config.json").read_text())
        cfg["eos_token_id"] = eos
        (dst / "config.json").write_text(json.dumps(cfg))
        return dst

    return make


@pytest.fixture(scope="session")
def greedy_margin() -> Callable[[Any, Sequence[int], Sequence[int]], float]:
    """``greedy_margin(hf_model, prompt, output)``: the smallest top-1 − top-2
    logit gap over the positions that chose ``output`` (HF forward).

    A tiny margin means the argmax is a near tie that float noise (batch shape,
    summation order) may decide either way; exactness is asserted only where
    the target's choice is clear.
    """

    def run(model: Any, prompt: Sequence[int], output: Sequence[int]) -> float:
        if not output:
            return float("inf")
        seq = list(prompt) + list(output)
        with torch.no_grad():
            logits = model(torch.tensor([seq[:-1]], dtype=torch.long)).logits[0].float()
        rows = logits[len(prompt) - 1 :]  # [len(output), V]: the rows that chose each output token
        top2 = rows.topk(2, dim=-1).values
        return float((top2[:, 0] - top2[:, 1]).min())

    return run


@pytest.fixture(scope="session")
def generate() -> Callable[..., tuple[list[list[int]], Any]]:
    """``generate(target, method, prompts, sampling, engine=None, **runtime)
    -> (token ids per prompt, llm)``: a fresh :class:`~specdec.api.LLM`
    (fresh counters) run once. ``method=None`` is plain decoding.
    """
    from specdec.api import LLM
    from specdec.core.pipeline_model import RuntimeConfig
    from specdec.engine import EngineConfig

    def run(target: Tiny | Path, method: Any, prompts: Sequence[Sequence[int]], sampling: Any,
            engine: EngineConfig | None = None, **runtime: Any) -> tuple[list[list[int]], Any]:
        rt = RuntimeConfig(**{"max_batch_size": 16, "max_seq_len": 128, "block_size": 8, **runtime})
        ec = engine if engine is not None else EngineConfig(max_batch_size=rt.max_batch_size)
        path = target.path if isinstance(target, Tiny) else target
        llm = LLM(str(path), method, runtime=rt, engine_config=ec)
        outs = llm.generate([list(p) for p in prompts], sampling)
        for o in outs:
            assert o.error is None, o.error
        return [o.token_ids for o in outs], llm

    return run
