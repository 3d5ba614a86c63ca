"""Command-line entry point: ``python -m specdec.run`` / ``specdec``.

Composes ``conf/run.yaml`` (see :func:`specdec.conf_schema.config_dir` for
where it is found) and calls :func:`specdec.experiment.run_experiment`::

    specdec                                            # built-in pair: plain vs draft_model vs ngram
    specdec experiment=quick                           # 4 prompts, 16 new tokens
    specdec method=ngram sampling=sample batch_size=4
    specdec target.path=/ckpt/target method=draft_model method.draft_model.path=/ckpt/draft
    specdec data=jsonl data.path=question.jsonl        # e.g. Spec-Bench
    specdec -m method.num_speculative_tokens=1,2,4,8 sampling.temperature=0,0.7
    specdec experiment=gamma_sweep                     # the same sweep, as a preset
    specdec resume_dir=outputs/default/<stamp>_<uid>   # continue an interrupted run
    specdec logger=none | logger.mode=online
"""

from __future__ import annotations

import os
import sys
from typing import Any

import hydra
from omegaconf import DictConfig

from specdec.conf_schema import config_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")


@hydra.main(config_path=str(config_dir()), config_name="run", version_base="1.3")
def _main(cfg: DictConfig) -> dict[str, Any]:
    from specdec.conf_schema import ConfigError
    from specdec.core.checkpoint import CheckpointError
    from specdec.data import PromptDataError
    from specdec.experiment import ExperimentError, run_experiment

    try:
        return run_experiment(cfg)
    except (ConfigError, ExperimentError, PromptDataError, CheckpointError) as e:
        # A run that cannot start: the message names the key or file; no traceback.
        print(f"specdec: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def main() -> None:
    """The ``specdec`` console script (arguments: Hydra overrides)."""
    _main()


if __name__ == "__main__":
    main()
