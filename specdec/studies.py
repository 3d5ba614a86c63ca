"""What the research studies in ``experiments/studies/`` share, so each script reads as its experiment only.

A study is a Hydra app over :class:`StudyConfig` (or a subclass) with a
``run(cfg) -> dict`` function; this module gives it its inputs (checkpoints,
prompts, method configs, ``LLM`` s), timing against plain decoding
(:func:`specdec.measure.lockstep`), and its outputs: ``<study>.json``,
``<study>.png`` and a W&B run (offline by default; ``logger=none`` turns it
off; a W&B failure is one warning and the study goes on).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from specdec.api import LLM
from specdec.core.checkpoint import load_tokenizer
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import EngineConfig, GenerationOutput
from specdec.measure import (
    Run,
    Timing,
    builtin_pair,
    builtin_prompts,
    checkpoint,
    lockstep,
    load_config,
    machine,
    print_table,
)
from specdec.plots import save_figure  # noqa: F401  (re-exported for the study scripts)
from specdec.spec.proposers import ProposerConfig, config_class

log = logging.getLogger(__name__)
C = TypeVar("C", bound="StudyConfig")


@dataclass
class StudyConfig:
    """Settings every study has (``key=value`` on the command line)."""

    quick: bool = False  # smaller defaults, about a minute on 2 cores (keys you set yourself win)
    target: str = "builtin"  # "builtin" (the shipped code-target; random when absent), "random" or a checkpoint dir
    draft: str = "builtin"  # the `path` of methods that take a checkpoint: "builtin", "random" or a dir
    # "builtin": the shipped held-out prompts through the target's tokenizer (random
    # repetitive token ids when it has none), "random", or a .jsonl file with a "prompt" field.
    prompts: str = "builtin"
    num_prompts: int = 8
    new_tokens: int = 64
    seed: int = 0  # sampling seed of prompt i is seed + i
    repeats: int = 3  # timed passes (interleaved with plain decoding)
    out: str | None = None  # None: outputs/studies/<study>/<time>_<id>
    logger: str = "wandb"  # "wandb" or "none"
    wandb_mode: str = "offline"  # offline (sync later: wandb sync <out>/wandb/offline-run-*) or online
    threads: int | None = 2  # torch threads (None: leave as is)
    device: str = "cpu"
    compile: bool = False  # runtime.compile for every pipeline


@dataclass
class Inputs:
    """What a study runs on."""

    target: Path
    draft: Path
    prompts: list[list[int]]


def quick(cfg: C, **smaller: Any) -> C:
    """With ``cfg.quick``, ``smaller`` replaces the fields still at their class default."""
    if not cfg.quick:
        return cfg
    defaults = type(cfg)()
    keep = {k: v for k, v in smaller.items() if getattr(cfg, k) == getattr(defaults, k)}
    return dataclasses.replace(cfg, **keep)


def inputs(cfg: StudyConfig) -> Inputs:
    """The study's checkpoints and ``num_prompts`` prompts (token ids)."""
    pair = builtin_pair() if cfg.target == "builtin" else None
    target = checkpoint(cfg.target, pair and pair[0], layers=6)
    draft = checkpoint(cfg.draft, pair and pair[1], layers=1, seed=1)
    for what, p in (("target", target), ("draft", draft)):
        if not (p / "config.json").is_file():
            raise SystemExit(f"{what}={str(p)!r} is not a checkpoint directory (no config.json there)")
    prompts = load_prompts(cfg.prompts, target, cfg.num_prompts, cfg.seed)
    if not prompts:
        raise SystemExit(f"prompts={cfg.prompts!r} gave no prompts")
    return Inputs(target, draft, prompts)


def load_prompts(option: str, target: Path, n: int, seed: int) -> list[list[int]]:
    """``n`` prompts as token ids (see :attr:`StudyConfig.prompts`)."""
    if option not in ("builtin", "random"):
        tok = load_tokenizer(target)
        rows = [json.loads(line) for line in Path(option).read_text().splitlines() if line.strip()]
        if any("prompt" not in r for r in rows[:n]):
            raise SystemExit(f"prompts={option!r}: every line needs a \"prompt\" field")
        return [tok.encode(r["prompt"]).ids for r in rows[:n]]
    if option == "builtin" and (target / "tokenizer.json").is_file():
        return builtin_prompts(target, n) or []
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    # Repeated chunks give n-gram lookup something to find.
    return [torch.randint(3, min(vocab, 200), (8,), generator=g).tolist() * 3 for _ in range(n)]


def method_config(name: str, gamma: int, draft: Path, **settings: Any) -> ProposerConfig:
    """Method ``name``'s registered config at γ (``path=draft`` when it takes a checkpoint)."""
    cls = config_class(name)
    if any(f.name == "path" for f in dataclasses.fields(cls)):
        settings.setdefault("path", str(draft))
    return cls(num_speculative_tokens=gamma, **settings)


def make_llm(cfg: StudyConfig, target: Path, method: ProposerConfig | None,
             prompts: Sequence[Sequence[int]], batch: int) -> LLM:
    """An ``LLM`` sized for ``prompts`` plus the study's new tokens, at most ``batch`` requests at once."""
    gamma = method.num_speculative_tokens if method is not None else 0
    max_len = max(len(p) for p in prompts) + cfg.new_tokens + gamma + 16
    rt = RuntimeConfig(max_batch_size=batch, max_seq_len=max_len, device=cfg.device, compile=cfg.compile,
                       threads=cfg.threads)
    return LLM(target, method=method, runtime=rt, engine_config=EngineConfig(max_batch_size=batch))


def sampling(cfg: StudyConfig, n: int, temperature: float = 0.0) -> list[SamplingParams]:
    """One per prompt: exactly ``new_tokens`` tokens each, prompt i seeded ``seed + i``."""
    return [SamplingParams(temperature=temperature, seed=cfg.seed + i, max_new_tokens=cfg.new_tokens,
                           ignore_eos=True) for i in range(n)]


def time_against_plain(llms: Mapping[str, LLM], prompts: list[list[int]], params: list[SamplingParams],
                       repeats: int, offset: int = 0) -> Timing[list[GenerationOutput]]:
    """Every ``LLM`` (one named ``plain``) over ``prompts``, timed side by side (each pass by
    turns, :func:`~specdec.measure.lockstep`); stats are the last pass's."""
    warm = [dataclasses.replace(p, max_new_tokens=4) for p in params]
    runs = {k: Run(lambda llm=llm: llm.generate(prompts, params), warmup=lambda llm=llm: llm.generate(prompts, warm),
                   before=llm.pipeline.reset_stats,
                   steps=lambda clock, llm=llm: llm.generate_steps(prompts, params, clock=clock))
            for k, llm in llms.items()}
    return lockstep(runs, baseline="plain", repeats=repeats, offset=offset)


def counts_row(llm: LLM) -> dict[str, Any]:
    """τ, α and the counters they come from, of ``llm``'s pipeline since its last reset."""
    c = llm.pipeline.stats().counts
    return {"tau": c.tau, "alpha": c.alpha, "steps": c.steps, "proposed": c.proposed, "accepted": c.accepted}


def iid_tau(alpha: float, gamma: int) -> float:
    """E[τ] when every draft token is accepted with probability α independently
    (Leviathan et al. 2023, eq. 1): (1 − α^(γ+1)) / (1 − α)."""
    return float(gamma + 1) if math.isclose(alpha, 1.0) else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def out_dir(cfg: StudyConfig, study: str) -> Path:
    """``cfg.out``, or a fresh ``outputs/studies/<study>/<time>_<id>`` (runs never collide)."""
    if cfg.out:
        return Path(cfg.out)
    return Path("outputs/studies") / study / f"{time.strftime('%Y%m%d-%H%M%S')}_{uuid.uuid4().hex[:6]}"


def finish(cfg: StudyConfig, study: str, out: Path, data: Inputs, rows: list[dict[str, Any]],
           plot: Path, **extra: Any) -> dict[str, Any]:
    """Writes ``<study>.json`` (config, machine, inputs, ``rows`` and ``extra``), logs it
    all to W&B, prints the table; returns what was written."""
    results = {"study": study, "config": dataclasses.asdict(cfg), "machine": machine(),
               "target": str(data.target), "draft": str(data.draft), "num_prompts": len(data.prompts),
               **extra, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{study}.json").write_text(json.dumps(results, indent=2) + "\n")
    log_wandb(cfg, study, out, results, plot)
    scalars = [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows]
    print_table(scalars, f"{study} study, {data.target}")
    print(f"\nwrote {out / f'{study}.json'} and {plot}")
    return {**results, "files": {"json": str(out / f"{study}.json"), "plot": str(plot)}}


def log_wandb(cfg: StudyConfig, study: str, out: Path, results: Mapping[str, Any], plot: Path) -> None:
    """The results as a W&B run: config, summary, a table of the rows, the plot. Never raises."""
    from specdec.logging import LoggerConfig, build_logger

    try:
        logger = build_logger(LoggerConfig(name=cfg.logger, mode=cfg.wandb_mode))
        logger.start(name=f"study-{study}", run_dir=out, config=results["config"])
        rows = results["rows"]
        cells = [[json.dumps(v) if isinstance(v, list) else v for v in r.values()] for r in rows]
        logger.log_table(f"{study}_rows", list(rows[0]) if rows else [], cells)
        logger.log_summary({k: v for k, v in results.items() if k not in ("config", "rows")})
        logger.log_images({f"{study}_plot": plot})
        logger.finish()
    except Exception as e:  # noqa: BLE001 - the loggers guard themselves; this guards the rest
        log.warning("W&B logging failed (%s: %s); the results are in %s", type(e).__name__, e, out)


def start(cfg: StudyConfig) -> None:
    """Checks what Hydra's types cannot, before any model loads; sets the torch threads."""
    if cfg.logger not in ("wandb", "none"):
        raise ValueError(f"logger must be wandb or none, got {cfg.logger!r}")
    if cfg.wandb_mode not in ("offline", "online", "disabled"):
        raise ValueError(f"wandb_mode must be offline, online or disabled, got {cfg.wandb_mode!r}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)


def main(run: Callable[[C], dict[str, Any]], cls: type[C], argv: Sequence[str]) -> dict[str, Any]:
    """A study's command line: ``key=value`` overrides into ``cls``, then ``run``."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run(load_config(cls, argv))
