"""Run loggers (Weights & Biases, or none), the console summary table and progress (progress.py).

``LOGGERS`` maps ``logger.name`` to a class with the :class:`RunLogger`
interface; every logger is best-effort: a failure never stops the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.logging.base import NullLogger, RunLogger, flatten
from specdec.logging.console import format_table, summary_table
from specdec.logging.wandb_logger import WandbConfig, WandbLogger

LOGGERS: dict[str, type[RunLogger]] = {"none": NullLogger, "wandb": WandbLogger}


@dataclass(frozen=True)
class LoggerConfig(WandbConfig):
    """``logger/``: which logger (a key of ``LOGGERS``), and W&B's settings."""

    name: str = "none"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.name not in LOGGERS:
            raise ValueError(f"logger.name must be one of {sorted(LOGGERS)}, got {self.name!r}")


def build_logger(config: LoggerConfig) -> RunLogger:
    """The run logger ``config.name`` selects, with its config."""
    return LOGGERS[config.name](config)

__all__ = [
    "LOGGERS",
    "LoggerConfig",
    "build_logger",
    "NullLogger",
    "RunLogger",
    "WandbConfig",
    "WandbLogger",
    "flatten",
    "format_table",
    "summary_table",
]
