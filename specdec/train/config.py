"""The schema of ``conf/train.yaml`` (``python -m specdec.train``): one dataclass per node.

Values are checked in ``__post_init__`` when the composed config becomes
objects (:func:`to_train_config`), naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from specdec.logging import LoggerConfig
from specdec.train.data import DataConfig

RECIPES = ("draft_model", "eagle", "eagle3", "medusa")


@dataclass
class RecipeConfig:
    """``train/``: the recipe and its optimisation (conf/train/<recipe>.yaml)."""

    recipe: str = "eagle3"  # draft_model | eagle | eagle3
    steps: int = 400
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay to lr * this
    warmup_steps: int = 20
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5  # 0: none
    precision: str = "fp32"  # fp32 | bf16 (autocast for the target's features and the module's forward and
    # backward; weights, optimizer and losses stay fp32; a CPU with AMX runs bf16 matmuls ~4x faster)
    # eagle / eagle3 heads
    ttt_steps: int = 1  # unrolled draft steps per batch (training-time test; eagle3: k)
    step_decay: float = 0.8  # loss weight of unrolled step s: step_decay ** s
    ce_weight: float = 1.0  # token loss: CE against the target's distribution at the next position
    ce_target: str = "soft"  # eagle/eagle3/medusa: soft: the target's distribution | argmax: its greedy token (what
    # greedy accepts)
    feature_weight: float = 0.0  # eagle: SmoothL1(h_t, f_{t+1}) feature regression
    feature_noise: float = 0.0  # uniform noise U(-a, a) added to the step-0 features while training
    draft_vocab_size: Optional[int] = None  # eagle3: the N most frequent train tokens (None: the target's vocab)
    aux_layers: Optional[list[int]] = None  # eagle3: target layers whose inputs are fused (None: (2, L//2, L-3))
    fc_bias: bool = True  # eagle: fc has a bias (the published EAGLE-1 default)
    init_from_target: bool = True  # eagle3: lm_head rows and norm from the target's; eagle/eagle3: the layer
    # from the target's last layer (where shapes allow)
    init_from: Optional[str] = None  # eagle/eagle3: start from this head checkpoint (fine-tuning; its fused
    # layers and draft vocabulary are kept, train.aux_layers and train.draft_vocab_size must agree or be null)
    # draft_model (distillation)
    layers: int = 2  # the student's depth (width, heads, vocab: the target's)
    init_layers: Optional[list[int]] = None  # teacher layers copied into the student (None: spread evenly)
    kd_weight: float = 1.0  # KL(target || draft) weight; 1 - kd_weight on the hard labels
    kd_temperature: float = 1.0
    # medusa heads (specdec/train/medusa.py); step_decay weighs head i's loss
    medusa_num_heads: int = 4  # K: head i predicts the token i + 2 ahead
    medusa_num_layers: int = 1  # ResBlock applications per head (one shared block)
    medusa_own_lm_head: bool = False  # False: the heads share the target's lm_head (Medusa-2 format)

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"train.recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        for key in ("steps", "batch_size", "seq_len", "ttt_steps", "layers", "medusa_num_heads", "medusa_num_layers"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key} must be >= 1, got {getattr(self, key)}")
        if self.ce_target not in ("soft", "argmax"):
            raise ValueError(f"train.ce_target must be soft or argmax, got {self.ce_target!r}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"train.precision must be fp32 or bf16, got {self.precision!r}")
        for key in ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "step_decay", "ce_weight", "feature_weight",
                    "feature_noise", "kd_weight", "kd_temperature"):
            if not math.isfinite(getattr(self, key)):
                raise ValueError(f"train.{key} must be a finite number, got {getattr(self, key)}")
        if len(self.betas) != 2 or not all(math.isfinite(b) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"train.betas must be two numbers in [0, 1), got {list(self.betas)}")
        if self.lr <= 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0 or self.kd_temperature <= 0:
            raise ValueError(f"train.weight_decay must be >= 0 and train.kd_temperature > 0, got "
                             f"{self.weight_decay} and {self.kd_temperature}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.feature_noise < 0:
            raise ValueError("train.warmup_steps, train.grad_clip and train.feature_noise must be >= 0")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"train.draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        if self.aux_layers is not None and len(self.aux_layers) != 3:
            raise ValueError(f"train.aux_layers names three target layers, got {list(self.aux_layers)}")


@dataclass
class EvalConfig:
    """``eval.*``: held-out figures, per epoch and every ``every`` steps."""

    every: int = 0  # steps between evaluations (0: at each epoch's end only; always at the end)
    gamma: int = 4  # draft tokens per simulated speculative step
    prompts: int = 16  # held-out prompts for the simulated τ
    prompt_len: int = 128
    new_tokens: int = 64  # greedy target tokens after each prompt
    loss_windows: int = 8  # held-out windows of train.seq_len for the held-out loss
    compare_draft: Optional[str] = None  # a draft model checkpoint simulated on the same prompts (once)

    def __post_init__(self) -> None:
        if self.every < 0 or self.loss_windows < 0:
            raise ValueError("eval.every and eval.loss_windows must be >= 0")
        for key in ("gamma", "prompts", "prompt_len", "new_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"eval.{key} must be >= 1, got {getattr(self, key)}")


@dataclass
class TargetDir:
    """``target/``: the target checkpoint (config.json, safetensors, tokenizer.json), as conf/run.yaml's."""

    path: Optional[str] = None


@dataclass
class TrainAppConfig:
    """``conf/train.yaml``: one training run."""

    train: RecipeConfig = field(default_factory=RecipeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    name: str = "train"
    target: TargetDir = field(default_factory=lambda: TargetDir())  # target.path: the target checkpoint dir
    seed: int = 0
    out_dir: Optional[str] = None  # the trained drafter (published layout + manifest.json); None: <run dir>/out
    run_dir: Optional[str] = None  # None: Hydra's run dir
    checkpoint_every: int = 50  # steps between checkpoints (train_state.safetensors in the run dir); 0: only at the end
    stop_after: Optional[int] = None  # stop (as if interrupted) once this many steps are done and saved
    resume: bool = False  # continue from the run dir's train_state.safetensors
    resume_dir: Optional[str] = None  # a previous run dir to continue in place (implies resume)
    overwrite: bool = False  # replace a non-empty out_dir (whole; a resumed run may always replace <run dir>/out)
    threads: Optional[int] = 2  # torch threads (None: leave as is)
    progress: bool = True  # a bar on a terminal, else a line every few seconds

    def __post_init__(self) -> None:
        if not self.target.path:
            raise ValueError("target.path must name a checkpoint directory")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"stop_after must be >= 1, got {self.stop_after}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


class TrainConfigError(ValueError):
    """A config value that fails its check (the message names the key)."""


def to_train_config(cfg: DictConfig | TrainAppConfig) -> TrainAppConfig:
    """The composed config (every value checked, naming the key) -> :class:`TrainAppConfig`."""
    if isinstance(cfg, TrainAppConfig):
        return cfg
    try:
        node = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
        body = OmegaConf.to_container(node, resolve=True)
        merged = OmegaConf.merge(writable(OmegaConf.structured(TrainAppConfig)), body)
        obj = OmegaConf.to_object(merged)
    except (ValueError, OmegaConfBaseException) as e:
        raise TrainConfigError(str(e)) from e
    assert isinstance(obj, TrainAppConfig)
    return obj


def to_plain(cfg: TrainAppConfig) -> dict[str, Any]:
    """JSON-able data of the config."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)  # type: ignore[return-value]


def writable(node: DictConfig) -> DictConfig:
    """The schema with the read-only flag of frozen dataclasses' nodes lifted (LoggerConfig)."""
    OmegaConf.set_readonly(node, False)
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            writable(child)
    return node


def register_schema() -> None:
    """``train_schema`` in Hydra's ConfigStore (the first entry of conf/train.yaml's defaults)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=writable(OmegaConf.structured(TrainAppConfig)))
