"""The logger interface an experiment reports through.

Two kinds of figures, kept apart so that a dashboard never mixes them up:
per-request values (:meth:`RunLogger.log_request`: a series over requests, never
a run's headline) and run-level figures (:meth:`RunLogger.log_summary`,
tables, charts, files).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class RunLogger:
    """Best-effort sink for one run's config, metrics, tables and images (does nothing)."""

    def __init__(self, config: Any = None) -> None:
        self.config = config

    @property
    def active(self) -> bool:
        return False

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
        """Opens the run (``config`` is the resolved run config; ``tags``, ``group`` and
        ``job_type`` label it for comparison with other runs; the logger's own settings add to them)."""

    def log_request(self, metrics: Mapping[str, Any], step: int) -> None:
        """One request's metrics (flat ``{key: number}``); ``step``: requests done so far.

        Per-request values only: they form a series and must never stand as a run figure."""

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Run-level figures (nested; flattened to ``a/b`` keys)."""

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """A table (e.g. one row per request and method)."""

    def log_bar_chart(self, name: str, table: str, label: str, value: str, title: str = "") -> None:
        """A bar chart of column ``value`` per ``label`` of the table ``table`` logged before."""

    def log_line_chart(self, name: str, table: str, x: str, y: str, series: str | None = None,
                       title: str = "") -> None:
        """A line chart of ``y`` against ``x`` of the table ``table`` logged before, one line per ``series``."""

    def log_histogram(self, name: str, counts: Sequence[int]) -> None:
        """A histogram of small non-negative integers given as counts per value."""

    def log_images(self, images: Mapping[str, Path]) -> None:
        """PNG files, by name."""

    def log_artifact(self, name: str, kind: str, files: Mapping[str, Path],
                     metadata: Mapping[str, Any] | None = None) -> None:
        """Files kept with the run (``{name in the artifact: local path}``; missing ones are skipped)."""

    def finish(self) -> None:
        """Closes the run."""


class NullLogger(RunLogger):
    """``logger=none``."""


def flatten(d: Mapping[str, Any], prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """Nested dict -> ``{"a/b": scalar}``; lists of numbers become ``a/b/0``, ``a/b/1`` …"""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, key, sep))
        elif isinstance(v, (list, tuple)):
            if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v) and len(v) <= 64:
                for i, x in enumerate(v):
                    out[f"{key}{sep}{i}"] = x
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[key] = v
    return out
