"""Typed architecture config parsed from an HF ``config.json``.

One dataclass covers the Llama family (Llama, Qwen2, Qwen3, Mistral); the
differences are flags read from the HF config: ``attention_bias`` (Qwen2: q/k/v
bias), ``qk_norm`` (Qwen3), ``sliding_window`` (Mistral), ``rope_scaling``
(Llama 3).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Integer keys of config.json (the first five required): checked up front, so a
# string or a float there is named, not met later deep inside module construction.
_INT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "max_window_layers")


# Sane upper bounds of config.json's sizes, generous (several times the largest published
# models: Llama 3.1 405B has 126 layers, hidden 16384, MLP 53248, 128 heads; vocabularies
# reach 256k). A value past one is a typo or a corrupt file: it fails here, naming the key,
# before a module is built (a million layers would otherwise build for hours).
MAX_SIZES = {
    "vocab_size": 1 << 22,  # 4M tokens
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 19,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "max_position_embeddings": 1 << 26,
}


def short_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters, so a message about a huge value stays short."""
    r = repr(value)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r)} characters)"


def _check_types(d: dict[str, Any]) -> None:
    """Raises ``ValueError`` naming the first key of ``d`` whose JSON type is wrong."""
    for k in _INT_KEYS:
        v = d.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"config.{k} must be an integer, got {short_repr(v)}")
        if v is not None and k in MAX_SIZES and v > MAX_SIZES[k]:
            raise ValueError(f"config.{k}={v} is more than any model this loads (at most {MAX_SIZES[k]}); "
                             "config.json is mistyped or corrupt")
    archs = d.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise ValueError(f"config.architectures must be a list of class names, got {short_repr(archs)}")
    for k in ("rope_parameters", "rope_scaling"):
        if d.get(k) is not None and not isinstance(d[k], dict):
            raise ValueError(f"config.{k} must be an object (or null), got {short_repr(d[k])}")
    eos = d.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    if eos is not None and not all(isinstance(e, int) and not isinstance(e, bool) for e in ids):
        raise ValueError(f"config.eos_token_id must be a token id or a list of them, got {short_repr(eos)}")


@dataclass
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "llama3"):
            raise ValueError(
                f"rope_scaling.rope_type {self.rope_type!r} is not supported (supported: default, llama3)"
            )

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Inverse frequencies [head_dim // 2], float64, with Llama 3 scaling."""
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if self.rope_type == "default":
            return inv
        if self.rope_type != "llama3":
            raise ValueError(f"rope_scaling.rope_type {self.rope_type!r} is not supported")
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend between.
        low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(mid, blended, scaled)


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (and o for Llama's flag)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    architecture: str = "LlamaForCausalLM"
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"config.{name} must be positive, got {getattr(self, name)!r}")
        for name, hi in MAX_SIZES.items():
            if getattr(self, name) > hi:
                raise ValueError(f"config.{name}={getattr(self, name)} is more than any model this loads "
                                 f"(at most {hi}); config.json is mistyped or corrupt")
        bad_eos = [e for e in self.eos_token_id if not 0 <= e < self.vocab_size]
        if bad_eos:
            raise ValueError(f"config.eos_token_id {short_repr(bad_eos)} is outside the vocabulary "
                             f"(token ids 0..{self.vocab_size - 1}): generation could never stop on it")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of config.num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.torch_dtype not in _DTYPES:
            raise ValueError(f"config.torch_dtype {self.torch_dtype!r} not in {sorted(_DTYPES)}")

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    def min_weight_elements(self) -> int:
        """A lower bound of the weights this config's checkpoint must hold: the embedding
        and every layer's projections (norms, biases and the output head left out), so a
        config.json whose sizes the files cannot back fails before a module is built."""
        return self.vocab_size * self.hidden_size + self.num_hidden_layers * self.layer_weight_elements()

    def layer_weight_elements(self) -> int:
        """Elements of one decoder layer's projections (q, k, v, o, gate, up, down)."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Parses an HF ``config.json`` dict (transformers 4.x or 5.x layout)."""
        if not isinstance(d, dict):
            raise ValueError(f"config.json must hold a JSON object, got {d!r}")
        _check_types(d)
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        model_type = d.get("model_type", "")
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                               "num_attention_heads", "intermediate_size") if k not in d]
        if missing:
            raise ValueError(f"config.json lacks required key(s): {', '.join(missing)}")
        heads = d["num_attention_heads"]
        if heads < 1:
            raise ValueError(f"config.num_attention_heads must be positive, got {heads}")
        if not d.get("head_dim") and d["hidden_size"] % heads:
            raise ValueError(f"config.hidden_size ({d['hidden_size']}) must be a multiple of "
                             f"config.num_attention_heads ({heads}) when config.json gives no head_dim")
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rp.get("rope_type", rp.get("type", "default")) or "default"
        rope = RopeConfig(
            theta=float(rp.get("rope_theta", d.get("rope_theta", 10000.0))),
            rope_type=rope_type,
            factor=float(rp.get("factor", 1.0)),
            low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rp.get("original_max_position_embeddings", 8192)),
        )
        is_qwen2 = model_type == "qwen2" or arch.startswith("Qwen2")
        is_qwen3 = model_type == "qwen3" or arch.startswith("Qwen3")
        attention_bias = True if is_qwen2 else bool(d.get("attention_bias", False))
        sliding = d.get("sliding_window")
        if (is_qwen2 or is_qwen3) and not d.get("use_sliding_window", False):
            sliding = None
        if sliding:
            # One window for every layer; HF may window only some (Qwen2/3:
            # layers >= max_window_layers, listed in layer_types by transformers 5).
            kinds = d.get("layer_types")
            if not kinds and (is_qwen2 or is_qwen3):
                first = int(d.get("max_window_layers", 28))  # HF's default
                kinds = ["sliding_attention" if i >= first else "full_attention"
                         for i in range(int(d["num_hidden_layers"]))]
            if kinds and all(k == "full_attention" for k in kinds):
                sliding = None
            elif kinds and any(k != "sliding_attention" for k in kinds):
                raise ValueError(
                    f"config.layer_types {kinds} mixes full and sliding-window attention; "
                    "a per-layer sliding window is not supported"
                )
        eos = d.get("eos_token_id")
        eos_list = [] if eos is None else (list(eos) if isinstance(eos, list) else [int(eos)])
        dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            # Llama's and Qwen3's attention_bias cover o_proj too; Qwen2's is q/k/v only.
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=is_qwen3,
            sliding_window=int(sliding) if sliding else None,
            rope=rope,
            architecture=arch,
            torch_dtype=dtype if dtype in _DTYPES else "float32",
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_list,
            pad_token_id=d.get("pad_token_id"),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
