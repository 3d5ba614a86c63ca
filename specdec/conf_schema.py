"""Structured configs of an experiment: the schema Hydra checks ``conf/`` against.

The schema of each config group is the component's own config dataclass
(:class:`SamplingParams`, :class:`RuntimeConfig`, :class:`EngineConfig`,
:class:`DataConfig`, :class:`LoggerConfig`, each drafting method's registered config), so every
default and every check is written once, there. :class:`RunConfig` adds what
only a run has and is registered in Hydra's ConfigStore (``run_schema`` is the
first entry of ``conf/run.yaml``'s defaults): a misspelt key or a value of the
wrong type fails naming the key (``full_key: runtime.max_seq_lne``). Value
checks run in the dataclasses' ``__post_init__`` when :func:`to_run_config`
turns the composed config into objects. The ``method`` node is checked per
selected method against that method's dataclass (:func:`method_configs`), so
a drafter added as one module and one yaml needs no edit here.

Components never see this run config: :func:`build_components` hands each
its own typed config.

Custom OmegaConf resolvers (registered on import):

- ``${zoo:NAME}``: absolute path of ``specdec/zoo/NAME`` in the installed package;
- ``${pkg:PATH}``: absolute path of ``specdec/PATH`` (shipped data: ``data/spec_bench/question.jsonl``);
- ``${uid:}``: a short random hex id, the same everywhere within one config
  (cached, and Hydra copies the cache into every job of a sweep);
- ``${or_else:A,B}``: ``A`` unless it is null or empty, else ``B``.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.data.prompts import DataConfig
from specdec.engine import EngineConfig
from specdec.logging import LoggerConfig
from specdec.spec.proposers.base import ProposerConfig, config_class, import_proposer_module

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


def _pkg(path: str) -> str:
    return str(PACKAGE_DIR / path)


def _uid() -> str:
    return secrets.token_hex(3)


def _or_else(a: Any, b: Any) -> Any:
    return b if a is None or a == "" else a


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("zoo", _zoo, replace=True)
    OmegaConf.register_new_resolver("pkg", _pkg, replace=True)
    OmegaConf.register_new_resolver("uid", _uid, replace=True, use_cache=True)
    OmegaConf.register_new_resolver("or_else", _or_else, replace=True)


# --------------------------------------------------------------------------------------
# group schemas: the components' own config dataclasses, plus what only a run has
# --------------------------------------------------------------------------------------
@dataclass
class CheckpointDir:
    """``target/`` and ``draft/``: a Hugging Face-format checkpoint directory."""

    path: Optional[str] = None  # target: required; draft: only methods that read ${draft.path}


def _method_defaults() -> dict[str, Any]:
    # The settings every method shares, with ProposerConfig's own defaults.
    return {f.name: f.default for f in fields(ProposerConfig)}


@dataclass
class RunConfig:
    """``conf/run.yaml``: one experiment (plain baseline + every selected method)."""

    name: str = "default"  # the run's name (output dir, W&B run name)
    target: CheckpointDir = field(default_factory=CheckpointDir)
    draft: CheckpointDir = field(default_factory=CheckpointDir)
    # method.<name>: one node per selected method, each checked against its
    # registered config dataclass (see method_configs); plus the shared
    # settings (num_speculative_tokens, adaptive_gamma) those nodes inherit.
    method: dict[str, Any] = field(default_factory=_method_defaults)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    data: DataConfig = MISSING
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    batch_size: int = 1  # requests run together (1: one at a time, cleanest timing)
    warmup: int = 1  # warm-up generations per pipeline before timing (not recorded)
    warmup_tokens: int = 8  # new tokens per warm-up generation
    run_dir: Optional[str] = None  # where results go; None: Hydra's run dir
    resume: bool = False  # continue the results already in the run dir
    resume_dir: Optional[str] = None  # continue the run in this directory (implies resume)
    save_outputs: bool = True  # store output token ids (and text) per request
    plots: bool = True
    progress: bool = True  # a bar on a terminal, else log lines (requests, tokens/s, τ; loading, warm-up, timing)
    allow_mismatch: bool = False  # greedy outputs unequal to plain decoding's: a log line, not exit code 3
    # When a greedy difference from plain decoding is an error (specdec/spec/exactness.py): strict, any
    # (bit equality); tolerant, not where the target's logits tie within exactness_tie_margin; auto,
    # strict on CPU and tolerant on GPUs (whose kernels round a row by its batch's shape)
    exactness: str = "auto"
    exactness_tie_margin: Optional[float] = None  # a near tie's largest logit margin; null: 4 ulps of the dtype

    def __post_init__(self) -> None:
        if not self.target.path:
            raise ValueError("target.path must name a checkpoint directory")
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
        if self.exactness not in ("auto", "strict", "tolerant"):
            raise ValueError(f"exactness must be auto, strict or tolerant, got {self.exactness!r}")
        tie = self.exactness_tie_margin
        if tie is not None and not (tie >= 0 and tie != float("inf")):
            raise ValueError(f"exactness_tie_margin must be a logit difference >= 0 (or null), got {tie}")


# --------------------------------------------------------------------------------------
# from the composed config to the components' configs
# --------------------------------------------------------------------------------------
@dataclass
class Components:
    """Each component's own typed config, from one :class:`RunConfig`."""

    target: str
    methods: dict[str, ProposerConfig]  # name -> the proposer's config, in selection order
    sampling: SamplingParams
    runtime: RuntimeConfig
    engine: EngineConfig
    data: DataConfig


class ConfigError(ValueError):
    """A config value that fails its check (the message names the key)."""


def method_configs(node: dict[str, Any], selected: list[str] | None = None) -> dict[str, ProposerConfig]:
    """The ``method`` node -> each selected method's config, checked against its dataclass.

    Keys of ``node``: the shared settings (a :class:`ProposerConfig` field,
    inherited by every method that does not set it) and one sub-node per
    selected method, named as its proposer is registered. A sub-node may name
    the module that registers a drafter living outside the package
    (``_module_: my_pkg.my_drafter``). ``selected``: the methods the ``method``
    group chose, when known; a sub-node for any other is an error (an option
    set for a method that does not run). Raises :class:`ConfigError` naming the key.
    """
    shared_keys = {f.name for f in fields(ProposerConfig)}
    shared = {k: v for k, v in node.items() if k in shared_keys}
    try:
        ProposerConfig(**shared)
    except (TypeError, ValueError) as e:  # (its messages name method.<option>)
        raise ConfigError(str(e) if str(e).startswith("method.") else f"method.{e}") from None
    out: dict[str, ProposerConfig] = {}
    for name, sub in node.items():
        if name in shared_keys:
            continue
        if selected is not None and name not in selected:
            raise ConfigError(f"method.{name} is set, but method {name!r} is not selected (method="
                              f"[{','.join(selected)}]); select it with method=[{','.join([*selected, name])}]")
        if not isinstance(sub, dict):
            raise ConfigError(f"method.{name}: neither a setting every method shares "
                              f"({', '.join(sorted(shared_keys))}) nor a drafting method's options (got {sub!r})")
        sub = dict(sub)
        module = sub.pop("_module_", None)
        try:
            if module is not None:
                import_proposer_module(str(module), where=f"method.{name}._module_")
            cls = config_class(name)
        except KeyError as e:
            raise ConfigError(f"method.{name}: {e.args[0]}") from None
        try:
            merged = OmegaConf.merge(_writable(OmegaConf.structured(cls)), {**shared, **sub})  # (nested: tree)
            out[name] = OmegaConf.to_object(merged)  # type: ignore[assignment]
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None)
            raise ConfigError(f"method.{name}.{key}: {e.msg}" if key else f"method.{name}: {e}") from None
        except ValueError as e:  # (a method's config names method.<name>.<option> itself)
            raise ConfigError(str(e) if str(e).startswith("method.") else f"method.{name}.{e}") from None
    return out


def _selected_methods(cfg: DictConfig) -> list[str] | None:
    """The ``method`` group's choice when the composed config or Hydra records it."""
    choices: Any = None
    if "hydra" in cfg:
        choices = OmegaConf.select(cfg, "hydra.runtime.choices")
    else:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            choices = HydraConfig.get().runtime.choices
    if choices is None or "method" not in choices:
        return None  # the defaults list's choice: its nodes are the selection
    chosen = choices["method"]
    if isinstance(chosen, str):
        chosen = chosen.strip("[]").split(",") if chosen.startswith("[") else [chosen]
    return [str(c).strip() for c in chosen if str(c).strip() not in ("", "none")]


def to_run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """Validates a composed config (every value check, naming the key) -> :class:`RunConfig`.

    Raises :class:`ConfigError`.
    """
    if isinstance(cfg, RunConfig):
        return cfg
    if not isinstance(cfg, DictConfig):
        raise TypeError(f"expected a composed DictConfig or RunConfig, got {type(cfg).__name__}")
    try:
        # As plain data, so a key the schema lacks (``+foo=1``) is an error here too.
        node = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
        body = OmegaConf.to_container(node, resolve=True)
        merged = OmegaConf.merge(_writable(OmegaConf.structured(RunConfig)), body)
        obj = OmegaConf.to_object(merged)
    except (ValueError, OmegaConfBaseException) as e:
        raise ConfigError(str(e)) from e
    assert isinstance(obj, RunConfig)
    method_configs(obj.method, _selected_methods(cfg))  # every selected method's options checked now, at start
    try:
        obj.sampling.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return obj


def build_components(rc: RunConfig) -> Components:
    methods = target_heads(str(rc.target.path), method_configs(rc.method))
    _check_zoo_heads(str(rc.target.path), methods)
    return Components(
        target=str(rc.target.path),
        methods=methods,
        sampling=replace(rc.sampling, stop_token_ids=tuple(rc.sampling.stop_token_ids)),
        # exactness=strict asks for bit equality: no TF32 rounding of float32 matmuls (CUDA)
        runtime=replace(rc.runtime, tf32=False) if rc.exactness == "strict" else rc.runtime,
        engine=rc.engine,
        data=rc.data,
    )


def target_heads(target: str, methods: dict[str, ProposerConfig]) -> dict[str, ProposerConfig]:
    """A fetchable target (``target=smollm2``) drafts with its own shipped checkpoint where there is
    one: a method left at the built-in target's (``specdec/zoo/code-eagle3``, its default) takes
    ``specdec/zoo/<target>-<method>`` (``smollm2-eagle3``) instead."""
    from specdec.zoo_fetch import MODELS

    if target not in MODELS or Path(target).exists():
        return methods
    out = {}
    for name, cfg in methods.items():
        path = getattr(cfg, "path", None)
        if path and Path(path).resolve().parent == ZOO_DIR.resolve() and Path(path).name.startswith("code-"):
            own = zoo_drafter(name, target)
            if own is not None:
                cfg = replace(cfg, path=str(own))  # type: ignore[type-var]
        out[name] = cfg
    return out


def zoo_drafter(method: str, target: str | None = None) -> Path | None:
    """The checkpoint shipped in ``specdec/zoo`` for drafting method ``method``: a fetchable
    ``target``'s own (``smollm2-eagle3``) or, with no target, the built-in target's (its
    config's ``zoo_dir``, by default ``code-<method>``: ``code-eagle`` …); None where none is."""
    name = method.replace("_", "-")
    d = ZOO_DIR / (f"{target}-{name}" if target else config_class(method).zoo_dir or f"code-{name}")
    return d if (d / "model.safetensors").is_file() else None


def _check_zoo_heads(target: str, methods: dict[str, ProposerConfig]) -> None:
    """A shipped head (``specdec/zoo/code-eagle`` …) fits only the shipped target:
    with another target, say so before anything loads, and how to go on."""
    if Path(target).resolve() == (ZOO_DIR / "code-target").resolve():
        return
    def shipped_head(cfg: ProposerConfig) -> bool:
        path = getattr(cfg, "path", None)
        return (not cfg.any_target and bool(path) and Path(path).resolve().parent == ZOO_DIR.resolve()
                and not Path(path).name.startswith(f"{target}-"))  # a fetchable target's own (smollm2-eagle3)

    for name, cfg in methods.items():
        if shipped_head(cfg):
            others = ",".join(n for n, c in methods.items() if not shipped_head(c))
            raise ConfigError(
                f"method.{name}.path is {getattr(cfg, 'path')}, the head shipped for the built-in target, but "
                f"target.path is {target}: set method.{name}.path to a head trained for your target "
                f"(python -m specdec.train), or leave the shipped heads out: method=[{others}]")


def to_plain_dict(rc: RunConfig) -> dict[str, Any]:
    """The run config as JSON-able data (enums as their values)."""
    return OmegaConf.to_container(OmegaConf.structured(rc), resolve=True, enum_to_str=True)  # type: ignore[return-value]


# --------------------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------------------
def register_configs() -> None:
    """Stores the schema in Hydra's ConfigStore (``conf/run.yaml`` starts from ``run_schema``)."""
    cs = ConfigStore.instance()
    schema = _writable(OmegaConf.structured(RunConfig))
    # Open: a selected method's options are checked against its own dataclass
    # (method_configs), so method.ngram.max_n=4 needs no '+'.
    OmegaConf.set_struct(schema.method, False)
    cs.store(name="run_schema", node=schema)


def _writable(node: DictConfig) -> DictConfig:
    """The schema with OmegaConf's read-only flag lifted from frozen dataclasses'
    nodes (the components' configs are frozen; composing must still fill them)."""
    OmegaConf.set_readonly(node, False)
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _writable(child)
    return node


register_resolvers()
register_configs()
