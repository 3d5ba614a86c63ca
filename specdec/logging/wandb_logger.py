"""Weights & Biases logging, best-effort and offline by default.

- ``wandb`` is imported lazily (only when a W&B run starts);
- ``WANDB_SILENT`` is set, console capture and system stats are off, and
  ``wandb.init`` gets a short timeout, so nothing waits on the network in
  offline mode and an unreachable server costs at most ``init_timeout_s``;
- any failure (import, init, logging, finish) disables W&B for the rest of
  the run with a single warning line; the experiment goes on;
- ``WANDB_MODE=disabled`` in the environment turns W&B off whatever
  ``logger.mode`` says (a kill switch for CI and test suites).

Offline runs are written under ``<dir>/wandb/offline-run-*`` (``dir``:
``logger.dir``, else ``$WANDB_DIR``, else the run directory); upload them
later with ``wandb sync <that dir>``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.logging.base import RunLogger, flatten

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id.txt"


@dataclass(frozen=True)
class WandbConfig:
    mode: str = "offline"  # online | offline | disabled
    project: str = "specdec"
    entity: str | None = None
    group: str | None = None  # None: <name>-<sweep> in a multirun
    tags: tuple[str, ...] = ()
    dir: str | None = None  # None: $WANDB_DIR, else the run directory
    init_timeout_s: float = 15.0
    log_requests: bool = True  # one W&B step per completed request

    def __post_init__(self) -> None:
        if self.mode not in ("online", "offline", "disabled"):
            raise ValueError(f"logger.mode must be online, offline or disabled, got {self.mode!r}")
        if self.init_timeout_s <= 0:
            raise ValueError(f"logger.init_timeout_s must be > 0, got {self.init_timeout_s}")


class WandbLogger(RunLogger):
    def __init__(self, config: WandbConfig | None = None) -> None:
        super().__init__(config or WandbConfig())
        self.config: WandbConfig
        self.run: Any = None
        self._wandb: Any = None
        self._failed = False

    @property
    def active(self) -> bool:
        return self.run is not None and not self._failed

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as e:  # noqa: BLE001 - W&B must never stop the run
            if not self._failed:
                log.warning("W&B %s failed (%s: %s); continuing without W&B", what, type(e).__name__, e)
            self._failed = True
            self._close_quietly()

    def _close_quietly(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            with contextlib.suppress(Exception):
                run.finish(exit_code=1)

    def start(self, *, name: str, run_dir: Path, config: Mapping[str, Any], resume: bool = False) -> None:
        cfg = self.config
        if cfg.mode == "disabled":
            return
        if os.environ.get("WANDB_MODE") == "disabled":
            log.info("W&B off: WANDB_MODE=disabled in the environment (it overrides logger.mode)")
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_CONSOLE", "off")
        with self._guard("init"):
            import wandb

            self._wandb = wandb
            wdir = Path(cfg.dir or os.environ.get("WANDB_DIR") or run_dir)
            wdir.mkdir(parents=True, exist_ok=True)
            id_file = Path(run_dir) / RUN_ID_FILE
            run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
            settings = wandb.Settings(
                init_timeout=cfg.init_timeout_s,
                silent=True,
                console="off",
                x_disable_stats=True,
            )
            self.run = wandb.init(
                mode=cfg.mode,
                project=cfg.project,
                entity=cfg.entity,
                group=cfg.group,
                tags=list(cfg.tags) or None,
                name=name,
                dir=str(wdir),
                config=dict(config),
                id=run_id,
                resume="allow" if run_id else None,
                settings=settings,
                reinit="finish_previous",
            )
            if self.run is not None and getattr(self.run, "id", None):
                id_file.write_text(str(self.run.id) + "\n")

    def log_request(self, metrics: Mapping[str, Any], step: int) -> None:
        if not self.active or not self.config.log_requests:
            return
        with self._guard("log"):
            self.run.log(dict(metrics), step=step)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        if not self.active:
            return
        with self._guard("summary"):
            flat = {k: v for k, v in flatten(summary).items() if v is not None}
            self.run.summary.update(flat)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        if not self.active:
            return
        with self._guard("table"):
            self.run.log({name: self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])})

    def log_histogram(self, name: str, counts: Sequence[int]) -> None:
        if not self.active or not counts:
            return
        with self._guard("histogram"):
            edges = [i - 0.5 for i in range(len(counts) + 1)]
            self.run.log({name: self._wandb.Histogram(np_histogram=(list(counts), edges))})

    def log_images(self, images: Mapping[str, Path]) -> None:
        if not self.active or not images:
            return
        with self._guard("images"):
            self.run.log({k: self._wandb.Image(str(p)) for k, p in images.items()})

    def finish(self) -> None:
        if not self.active:
            return
        with self._guard("finish"):
            run, self.run = self.run, None
            run.finish()
