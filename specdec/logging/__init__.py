"""Run loggers (Weights & Biases, or none) and the console summary table.

``LOGGERS`` maps ``logger.name`` to a class with the :class:`RunLogger`
interface; every logger is best-effort: a failure never stops the run.
"""

from specdec.logging.base import NullLogger, RunLogger, flatten
from specdec.logging.console import format_table, summary_table
from specdec.logging.wandb_logger import WandbConfig, WandbLogger

LOGGERS: dict[str, type[RunLogger]] = {"none": NullLogger, "wandb": WandbLogger}

__all__ = [
    "LOGGERS",
    "NullLogger",
    "RunLogger",
    "WandbConfig",
    "WandbLogger",
    "flatten",
    "format_table",
    "summary_table",
]
