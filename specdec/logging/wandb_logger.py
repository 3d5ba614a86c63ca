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

What a run holds, and why it is laid out so:

- the run summary (the runs-table columns) holds run-level figures only
  (``methods/<m>/tau`` …, from :meth:`WandbLogger.log_summary`). Per-request
  values go to history under ``request/`` (``request/<m>/tau`` …) against the
  step axis ``request/index``, each key defined with ``summary="none"``: W&B
  would otherwise copy a key's last history value into the summary, and a
  single request's τ would sit in the runs table looking like the run's;
- tables under ``tables/``, native charts (W&B bar / line plots of those
  tables) and histograms under ``charts/``, images under ``plots/``;
- files (results, summary, plots) as one artifact of type ``run-results``;
- labels for comparing runs: ``job_type`` (the experiment), ``group`` (the
  sweep), tags (method, γ, temperature, target, batch size) and ``notes``
  (the Hydra overrides); ``logger.tags`` / ``logger.group`` add or override.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
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


REQUEST_PREFIX = "request/"
STEP_KEY = "request/index"  # the x axis of every per-request series (requests done so far)
MAX_TAG_LEN = 64  # W&B refuses longer tags


def request_key(key: str) -> str:
    """``key`` under ``request/`` (kept as is when it is there already)."""
    return key if key.startswith(REQUEST_PREFIX) else REQUEST_PREFIX + key


def artifact_name(name: str) -> str:
    """``name`` with what W&B refuses in artifact names (anything but letters, digits, ``-_.``) as ``-``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"


class WandbLogger(RunLogger):
    """A W&B run laid out as the module docstring says; every call guarded so W&B never stops the run."""

    def __init__(self, config: WandbConfig | None = None) -> None:
        super().__init__(config or WandbConfig())
        self.config: WandbConfig
        self.run: Any = None
        self._wandb: Any = None
        self._failed = False
        self._defined: set[str] = set()  # per-request keys given their summary="none" definition
        self._tables: dict[str, Any] = {}

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

    def start(
        self,
        *,
        name: str,
        run_dir: Path,
        config: Mapping[str, Any],
        resume: bool = False,
        tags: Sequence[str] = (),
        group: str | None = None,
        job_type: str | None = None,
        notes: str | None = None,
    ) -> None:
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
            all_tags = list(dict.fromkeys(t[:MAX_TAG_LEN] for t in (*tags, *cfg.tags) if t))
            self.run = wandb.init(
                mode=cfg.mode,
                project=cfg.project,
                entity=cfg.entity,
                group=cfg.group or group,
                job_type=job_type,
                tags=all_tags or None,
                notes=notes,
                name=name,
                dir=str(wdir),
                config=dict(config),
                id=run_id,
                resume="allow" if run_id else None,
                settings=settings,
                reinit="finish_previous",
            )
            self._defined.clear()
            self._tables.clear()
            if self.run is not None and getattr(self.run, "id", None):
                id_file.write_text(str(self.run.id) + "\n")

    def _define_request_metrics(self, keys: Sequence[str]) -> None:
        """Each new per-request key: plotted against ``request/index``, never copied into the summary.

        Defined by name as it first appears (in every session, resumed ones too: a
        definition lives in the session that makes it); the glob covers the rest."""
        new = [k for k in keys if k not in self._defined]
        if not new:
            return
        if not self._defined:
            self.run.define_metric(STEP_KEY, summary="none", hidden=True)
            self.run.define_metric(REQUEST_PREFIX + "*", step_metric=STEP_KEY, summary="none")
            self._defined.add(STEP_KEY)
        for k in new:
            if k != STEP_KEY:
                self.run.define_metric(k, step_metric=STEP_KEY, summary="none")
            self._defined.add(k)

    def log_request(self, metrics: Mapping[str, Any], step: int) -> None:
        if not self.active or not self.config.log_requests:
            return
        with self._guard("log"):
            data = {request_key(k): v for k, v in metrics.items() if v is not None}
            data[STEP_KEY] = step
            self._define_request_metrics(list(data))
            # No step=: W&B's own step keeps counting across a resume (a step below the
            # last one would be dropped); request/index is the axis the charts use.
            self.run.log(data)

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
            table = self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])
            self._tables[name] = table
            self.run.log({f"tables/{name}": table})

    def log_bar_chart(self, name: str, table: str, label: str, value: str, title: str = "") -> None:
        if not self.active or table not in self._tables:
            return
        with self._guard("chart"):
            chart = self._wandb.plot.bar(self._tables[table], label, value, title=title)
            self.run.log({f"charts/{name}": chart})

    def log_line_chart(self, name: str, table: str, x: str, y: str, series: str | None = None,
                       title: str = "") -> None:
        if not self.active or table not in self._tables:
            return
        with self._guard("chart"):
            chart = self._wandb.plot.line(self._tables[table], x, y, stroke=series, title=title)
            self.run.log({f"charts/{name}": chart})

    def log_histogram(self, name: str, counts: Sequence[int]) -> None:
        if not self.active or not counts:
            return
        with self._guard("histogram"):
            edges = [i - 0.5 for i in range(len(counts) + 1)]
            self.run.log({f"charts/{name}": self._wandb.Histogram(np_histogram=(list(counts), edges))})

    def log_images(self, images: Mapping[str, Path]) -> None:
        if not self.active or not images:
            return
        with self._guard("images"):
            self.run.log({k: self._wandb.Image(str(p)) for k, p in images.items()})

    def log_artifact(self, name: str, kind: str, files: Mapping[str, Path],
                     metadata: Mapping[str, Any] | None = None) -> None:
        present = {k: Path(p) for k, p in files.items() if Path(p).is_file()}
        if not self.active or not present:
            return
        with self._guard("artifact"):
            # run-<id>-<name>, as W&B names a run's own table artifacts: one per run, new versions on resume
            art = self._wandb.Artifact(artifact_name(f"run-{self.run.id}-{name}"), type=kind,
                                       metadata=dict(metadata or {}))
            for arc_name, path in present.items():
                art.add_file(str(path), name=arc_name)  # copied now: a resumed run may change the file
            self.run.log_artifact(art)

    def finish(self) -> None:
        if not self.active:
            return
        with self._guard("finish"):
            run, self.run = self.run, None
            run.finish()
