"""The Hydra callback of multiruns (``conf/run.yaml`` names ``specdec.experiment.SweepPlots``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class SweepPlots(Callback):
    """Hydra callback: after a multirun, plots τ / speedup against γ over its runs."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            from specdec.logging import format_table
            from specdec.plots import load_summaries, plot_sweep, sweep_points

            sweep_dir = Path(str(config.hydra.sweep.dir))
            made = plot_sweep([sweep_dir], sweep_dir)
            rows = [{"method": m, "temperature": t, **p} for (m, t), pts in sorted(
                sweep_points(load_summaries([sweep_dir])).items()) for p in pts]
            if rows:
                table = format_table(rows, [("method", "method", ""), ("temperature", "T", "g"), ("gamma", "γ", "d"),
                                            ("tau", "τ", ".2f"), ("alpha", "α", ".3f"), ("speedup", "speedup", ".2f")])
                (sweep_dir / "sweep_summary.txt").write_text(table + "\n", encoding="utf-8")
                print(f"\n{table}\n\nsweep plots: {', '.join(str(p) for p in made.values())}", flush=True)
        except Exception as e:  # noqa: BLE001 - plotting must not fail the sweep
            log.warning("sweep plots failed: %s: %s", type(e).__name__, e)
