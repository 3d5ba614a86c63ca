"""Structured configs of an experiment: the schema Hydra checks ``conf/`` against.

Every config group has a dataclass here, registered in Hydra's ConfigStore
(``run_schema`` is the first entry of ``conf/run.yaml``'s defaults), so a
misspelt key or a value of the wrong type fails when the config is composed,
naming the key (``full_key: method.num_speculativ_tokens``). Value checks
(ranges, choices) run in ``__post_init__`` when :func:`to_run_config` turns the
composed config into these objects, and name the key too.

Components never see this run config: :func:`build_components` turns it into
each component's own typed config (:class:`RuntimeConfig`,
:class:`EngineConfig`, :class:`SamplingParams`, the proposers'
``DraftModelConfig`` / ``NgramConfig`` …).

Custom OmegaConf resolvers (registered on import):

- ``${zoo:NAME}``: absolute path of ``specdec/zoo/NAME`` in the installed package;
- ``${uid:}``: a short random hex id, the same everywhere within one config
  (cached, and Hydra copies the cache into every job of a sweep);
- ``${or_else:A,B}``: ``A`` unless it is null or empty, else ``B``.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.data.prompts import DataConfig
from specdec.engine import EngineConfig

PACKAGE_DIR = Path(__file__).resolve().parent
ZOO_DIR = PACKAGE_DIR / "zoo"


# --------------------------------------------------------------------------------------
# where the config lives
# --------------------------------------------------------------------------------------
def config_dir() -> Path:
    """The Hydra config directory (``run.yaml`` and the groups).

    ``$SPECDEC_CONF_DIR`` if set; else ``conf/`` shipped inside the installed
    package (``specdec/conf``); else the repository checkout's ``conf/`` next
    to the package (editable installs, running from the source tree).
    """
    env = os.environ.get("SPECDEC_CONF_DIR")
    candidates = [Path(env)] if env else []
    candidates += [PACKAGE_DIR / "conf", PACKAGE_DIR.parent / "conf"]
    for c in candidates:
        if (c / "run.yaml").is_file():
            return c.resolve()
    raise FileNotFoundError(
        "specdec's Hydra config (run.yaml) was not found in " + ", ".join(str(c) for c in candidates)
        + "; set SPECDEC_CONF_DIR to the conf/ directory"
    )


# --------------------------------------------------------------------------------------
# resolvers
# --------------------------------------------------------------------------------------
def _zoo(name: str) -> str:
    return str(ZOO_DIR / name)


def _uid() -> str:
    return secrets.token_hex(3)


def _or_else(a: Any, b: Any) -> Any:
    return b if a is None or a == "" else a


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("zoo", _zoo, replace=True)
    OmegaConf.register_new_resolver("uid", _uid, replace=True, use_cache=True)
    OmegaConf.register_new_resolver("or_else", _or_else, replace=True)


# --------------------------------------------------------------------------------------
# group schemas
# --------------------------------------------------------------------------------------
@dataclass
class TargetSchema:
    """``target/``: the model whose output speculation must reproduce."""

    path: str = MISSING  # a Hugging Face-format checkpoint directory

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("target.path must name a checkpoint directory")


@dataclass
class DraftSchema:
    """``draft/``: the draft checkpoint (``method.draft_model.path`` defaults to it)."""

    path: Optional[str] = None


@dataclass
class DraftModelMethod:
    """``method/draft_model``: an independent draft model sharing the target's vocabulary."""

    path: str = MISSING  # the draft checkpoint directory
    num_speculative_tokens: Optional[int] = None  # None: method.num_speculative_tokens

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("method.draft_model.path (the draft checkpoint directory) is required")

    def to_component(self, gamma: int, adaptive: bool) -> Any:
        from specdec.spec.proposers.draft_model import DraftModelConfig

        return DraftModelConfig(path=self.path, num_speculative_tokens=gamma, adaptive_gamma=adaptive)


@dataclass
class NgramMethod:
    """``method/ngram``: prompt-lookup drafting, no model."""

    max_n: int = 3
    min_n: int = 1
    num_speculative_tokens: Optional[int] = None  # None: method.num_speculative_tokens

    def __post_init__(self) -> None:
        if not (1 <= self.min_n <= self.max_n):
            raise ValueError(
                f"method.ngram.min_n / method.ngram.max_n need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}"
            )

    def to_component(self, gamma: int, adaptive: bool) -> Any:
        from specdec.spec.proposers.ngram import NgramConfig

        return NgramConfig(num_speculative_tokens=gamma, max_n=self.max_n, min_n=self.min_n, adaptive_gamma=adaptive)


# name -> schema of that method's options. A new proposer adds a field to
# MethodSchema and an entry here (its conf/method/<name>.yaml fills the field).
METHOD_SCHEMAS: dict[str, type] = {"draft_model": DraftModelMethod, "ngram": NgramMethod}


@dataclass
class MethodSchema:
    """``method/``: the speculative methods compared with plain decoding in one run.

    Options are selected as a list (``method=[draft_model,ngram]``, the
    default; ``method=ngram``; ``method=none`` for the plain baseline only);
    each selected option fills its own sub-node. ``num_speculative_tokens``
    (γ) applies to every selected method unless the method sets its own.
    """

    num_speculative_tokens: int = 4
    # true: each step drafts the γ <= num_speculative_tokens that pays best
    # (0 where speculation cannot pay: big batches, low acceptance); spec/gamma.py
    adaptive_gamma: bool = False
    draft_model: Optional[DraftModelMethod] = None
    ngram: Optional[NgramMethod] = None

    def __post_init__(self) -> None:
        for key, g in self._gammas().items():
            if not (0 <= g <= 64):
                raise ValueError(f"{key} must be in [0, 64], got {g}")

    def _gammas(self) -> dict[str, int]:
        out = {"method.num_speculative_tokens": self.num_speculative_tokens}
        for name in METHOD_SCHEMAS:
            m = getattr(self, name)
            if m is not None and m.num_speculative_tokens is not None:
                out[f"method.{name}.num_speculative_tokens"] = m.num_speculative_tokens
        return out

    def selected(self) -> dict[str, Any]:
        """The selected methods, in declaration order: name -> its schema."""
        return {n: getattr(self, n) for n in METHOD_SCHEMAS if getattr(self, n) is not None}

    def gamma(self, name: str) -> int:
        m = getattr(self, name)
        return self.num_speculative_tokens if m.num_speculative_tokens is None else m.num_speculative_tokens

    def components(self) -> dict[str, Any]:
        """name -> the proposer's own config (``DraftModelConfig``, ``NgramConfig`` …)."""
        return {n: m.to_component(self.gamma(n), self.adaptive_gamma) for n, m in self.selected().items()}


@dataclass
class SamplingSchema:
    """``sampling/``: mirrors :class:`specdec.core.context.SamplingParams`."""

    temperature: float = 0.0  # 0: greedy (outputs must equal plain decoding's)
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None  # None: one per request, derived from engine.seed and the request id
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.to_component().validate()  # raises naming sampling.<key>

    def to_component(self) -> SamplingParams:
        return SamplingParams(
            temperature=float(self.temperature),
            top_k=self.top_k,
            top_p=float(self.top_p),
            seed=self.seed,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )


@dataclass
class DataSchema:
    """``data/``: mirrors :class:`specdec.data.prompts.DataConfig`."""

    path: str = MISSING  # a JSONL file of prompts
    text_field: str = "auto"  # "auto": prompt, text, turns, question, instruction, input
    id_field: str = "auto"  # "auto": id, question_id, else the line number
    source_field: str = "auto"  # "auto": source, category (optional)
    turn: int = 0  # which element when the text field is a list (Spec-Bench "turns")
    limit: Optional[int] = None  # the first `limit` prompts only
    max_prompt_tokens: Optional[int] = None  # keep the last N prompt tokens

    def __post_init__(self) -> None:
        self.to_component()

    def to_component(self) -> DataConfig:
        return DataConfig(**asdict(self))


class WandbMode(str, Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class LoggerSchema:
    """``logger/``: ``wandb`` (offline by default) or ``none``."""

    name: str = "none"  # "wandb" | "none"
    mode: WandbMode = WandbMode.offline
    project: str = "specdec"
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    dir: Optional[str] = None  # None: $WANDB_DIR, else the run directory
    init_timeout_s: float = 15.0
    log_requests: bool = True  # one W&B step per completed request

    def __post_init__(self) -> None:
        from specdec.logging import LOGGERS

        if self.name not in LOGGERS:
            raise ValueError(f"logger.name must be one of {sorted(LOGGERS)}, got {self.name!r}")
        if self.init_timeout_s <= 0:
            raise ValueError(f"logger.init_timeout_s must be > 0, got {self.init_timeout_s}")


@dataclass
class RuntimeSchema:
    """``runtime/``: mirrors :class:`specdec.core.pipeline_model.RuntimeConfig`."""

    max_batch_size: int = 1
    max_seq_len: int = 1024
    block_size: int = 16
    num_blocks: Optional[int] = None  # None: enough for max_batch_size full sequences
    dtype: Optional[str] = "float32"  # None: the checkpoint's dtype
    device: str = "cpu"
    threads: Optional[int] = None  # torch.set_num_threads; None: torch's default
    compile: bool = False  # torch.compile the decoders (first calls compile; see docs)

    def __post_init__(self) -> None:
        self.to_component()
        if self.dtype is not None and self.dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise ValueError(f"runtime.dtype must be float32, float16, bfloat16, float64 or null, got {self.dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"runtime.threads must be >= 1, got {self.threads}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"runtime.num_blocks must be >= 1, got {self.num_blocks}")

    def to_component(self) -> RuntimeConfig:
        return RuntimeConfig(
            max_batch_size=self.max_batch_size,
            max_seq_len=self.max_seq_len,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            dtype=self.dtype,
            device=self.device,
            compile=self.compile,
        )


@dataclass
class EngineSchema:
    """Mirrors :class:`specdec.engine.EngineConfig` (``max_batch_size`` is the run's ``batch_size``)."""

    max_tokens_per_step: int = 2048
    seed: int = 0

    def to_component(self, max_batch_size: int) -> EngineConfig:
        return EngineConfig(
            max_batch_size=max_batch_size, max_tokens_per_step=self.max_tokens_per_step, seed=self.seed
        )


@dataclass
class RunConfig:
    """``conf/run.yaml``: one experiment (plain baseline + every selected method)."""

    name: str = "default"  # the run's name (output dir, W&B run name)
    target: TargetSchema = field(default_factory=TargetSchema)
    draft: DraftSchema = field(default_factory=DraftSchema)
    method: MethodSchema = field(default_factory=MethodSchema)
    sampling: SamplingSchema = field(default_factory=SamplingSchema)
    data: DataSchema = field(default_factory=DataSchema)
    runtime: RuntimeSchema = field(default_factory=RuntimeSchema)
    engine: EngineSchema = field(default_factory=EngineSchema)
    logger: LoggerSchema = field(default_factory=LoggerSchema)
    batch_size: int = 1  # requests run together (1: one at a time, cleanest timing)
    warmup: int = 1  # warm-up generations per pipeline before timing (not recorded)
    warmup_tokens: int = 8  # new tokens per warm-up generation
    run_dir: Optional[str] = None  # where results go; None: Hydra's run dir
    resume: bool = False  # continue the results already in the run dir
    resume_dir: Optional[str] = None  # continue the run in this directory (implies resume)
    save_outputs: bool = True  # store output token ids (and text) per request
    plots: bool = True
    progress: bool = True  # tqdm progress bars

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.batch_size > self.runtime.max_batch_size:
            raise ValueError(
                f"batch_size {self.batch_size} exceeds runtime.max_batch_size {self.runtime.max_batch_size}"
            )
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.warmup_tokens < 1:
            raise ValueError(f"warmup_tokens must be >= 1, got {self.warmup_tokens}")
        if not self.name or "/" in self.name:
            raise ValueError(f"name must be a non-empty string without '/', got {self.name!r}")


# --------------------------------------------------------------------------------------
# from the composed config to the components' configs
# --------------------------------------------------------------------------------------
@dataclass
class Components:
    """Each component's own typed config, built from one :class:`RunConfig`."""

    target: str
    methods: dict[str, Any]  # name -> proposer config
    sampling: SamplingParams
    runtime: RuntimeConfig
    engine: EngineConfig
    data: DataConfig


class ConfigError(ValueError):
    """A config value that fails its check (the message names the key)."""


def to_run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """Validates a composed config (every value check, naming the key) -> :class:`RunConfig`.

    Raises :class:`ConfigError`.
    """
    if isinstance(cfg, RunConfig):
        return cfg
    if not isinstance(cfg, DictConfig):
        raise TypeError(f"expected a composed DictConfig or RunConfig, got {type(cfg).__name__}")
    try:
        body = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), body)
        obj = OmegaConf.to_object(merged)
    except (ValueError, OmegaConfBaseException) as e:
        raise ConfigError(str(e)) from e
    assert isinstance(obj, RunConfig)
    return obj


def build_components(rc: RunConfig) -> Components:
    return Components(
        target=rc.target.path,
        methods=rc.method.components(),
        sampling=rc.sampling.to_component(),
        runtime=rc.runtime.to_component(),
        engine=rc.engine.to_component(rc.batch_size),
        data=rc.data.to_component(),
    )


def to_plain_dict(rc: RunConfig) -> dict[str, Any]:
    """The run config as JSON-able data (enums as their values)."""
    return OmegaConf.to_container(OmegaConf.structured(rc), resolve=True, enum_to_str=True)  # type: ignore[return-value]


# --------------------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------------------
def register_configs() -> None:
    """Stores the schema in Hydra's ConfigStore (``conf/run.yaml`` starts from ``run_schema``)."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)


register_resolvers()
register_configs()
