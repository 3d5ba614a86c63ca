"""Shared fixtures: tiny random Hugging Face checkpoints and pipelines over them.

``transformers`` is imported only inside the fixtures that need it (it is the
reference we compare against, never a dependency of ``specdec``).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    # Tiny models: one intra-op thread is fastest, and on a shared 2-core
    # machine more threads oversubscribe the CPU (10-20x slower under load).
    torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "1")))


# The four architectures the Llama-family decoder serves, as tiny configs.
ARCHS = ("llama", "qwen2", "qwen3", "mistral")

TINY_VOCAB = 128
# A larger initializer_range than HF's 0.02 spreads the logits (max |logit|
# ~ 5-10) so that greedy argmax is decided by the model, not by float noise.
INIT_RANGE = 0.4
SLIDING_WINDOW = 8  # Mistral: smaller than every sequence the parity tests use


def tiny_hf_config(kind: str, *, tie: bool = False, **overrides: Any) -> Any:
    """A tiny random HF config for ``kind`` (one of :data:`ARCHS`)."""
    transformers = pytest.importorskip("transformers")
    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        initializer_range=INIT_RANGE,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        # No EOS / BOS / PAD: HF generate then neither stops early nor
        # suppresses tokens, and produces exactly max_new_tokens tokens.
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    if kind == "llama":
        # Llama 3.1 rope scaling (transformers 5 folds rope_theta and
        # rope_scaling into rope_parameters). original_max_position_embeddings
        # is small so that all three frequency bands (kept, blended, divided)
        # occur with head_dim 8.
        common["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        cls = transformers.LlamaConfig
    elif kind == "qwen2":
        cls = transformers.Qwen2Config  # q/k/v bias, no o_proj bias
    elif kind == "qwen3":
        common["head_dim"] = 16  # explicit, != hidden_size // num_attention_heads (8)
        cls = transformers.Qwen3Config  # q/k RMSNorm
    elif kind == "mistral":
        common["sliding_window"] = SLIDING_WINDOW
        cls = transformers.MistralConfig
    else:
        raise ValueError(f"unknown tiny architecture {kind!r}; known: {ARCHS}")
    common.update(overrides)
    return cls(**common)


def _model_cls(kind: str) -> Any:
    transformers = pytest.importorskip("transformers")
    return {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }[kind]


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Any]]:
    """Factory: ``hf_checkpoint(kind, tie=False, seed=0, max_shard_size=None,
    dtype=None, **config_overrides) -> (path, hf_model)``.

    Builds a tiny random HF model, ``save_pretrained``-s it into a temporary
    directory and returns the directory and the (fp32, eval) HF model. Cached
    per argument set for the whole session: callers must not modify either.
    ``dtype`` (e.g. ``torch.bfloat16``) casts the model before saving; the
    returned model is then that cast model.
    """
    cache: dict[tuple, tuple[Path, Any]] = {}

    def make(
        kind: str = "llama",
        *,
        tie: bool = False,
        seed: int = 0,
        max_shard_size: str | None = None,
        dtype: torch.dtype | None = None,
        **overrides: Any,
    ) -> tuple[Path, Any]:
        key = (kind, tie, seed, max_shard_size, dtype, tuple(sorted(overrides.items())))
        if key not in cache:
            cfg = tiny_hf_config(kind, tie=tie, **overrides)
            torch.manual_seed(seed)
            model = _model_cls(kind)(cfg).eval()
            if dtype is not None:
                model = model.to(dtype)
            name = f"{kind}-tie{int(tie)}-s{seed}-{max_shard_size or 'single'}-{dtype}".replace(".", "_")
            path = tmp_path_factory.mktemp(name)
            kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
            model.save_pretrained(path, **kwargs)
            cache[key] = (path, model)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def pipeline_factory() -> Callable[..., Any]:
    """Factory: ``pipeline_factory(path, **RuntimeConfig kwargs)`` -> a cached
    :class:`~specdec.core.pipeline_model.DecoderPipelineModel`.

    Cached per (path, runtime): a test that leaves requests unfinished would
    leak KV blocks into the next user, so tests that may do that build their
    own with ``registered_pipeline_model``.
    """
    from specdec.core.pipeline_model import RuntimeConfig, registered_pipeline_model

    cache: dict[tuple, Any] = {}

    def make(path: Path, **runtime: Any) -> Any:
        key = (str(path), tuple(sorted(runtime.items())))
        if key not in cache:
            cache[key] = registered_pipeline_model(path, RuntimeConfig(**runtime))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[Any, Sequence[int], int], list[int]]:
    """``hf_greedy(hf_model, prompt, n)``: the n tokens of HF ``generate(do_sample=False)``."""
    cache: dict[tuple, list[int]] = {}

    def gen(model: Any, prompt: Sequence[int], n: int) -> list[int]:
        key = (id(model), tuple(prompt), n)
        if key not in cache:
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                )
            cache[key] = out[0, len(prompt) :].tolist()
            assert len(cache[key]) == n, f"HF generate returned {len(cache[key])} tokens, wanted {n}"
        return cache[key]

    return gen


@pytest.fixture(scope="session")
def hf_logits() -> Callable[[Any, Sequence[int]], torch.Tensor]:
    """``hf_logits(hf_model, tokens)``: HF logits [len(tokens), vocab] of one full sequence."""

    def run(model: Any, tokens: Sequence[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([list(tokens)], dtype=torch.long)).logits[0].float()

    return run
