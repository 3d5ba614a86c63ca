"""W&B must never stop a run: a failing init or log is one warning, and the run goes on."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest

from specdec.logging import LoggerConfig, build_logger


class _BrokenRun:
    id = "run-1"

    def log(self, *a, **k):
        raise ConnectionError("api.wandb.ai unreachable")

    def finish(self, *a, **k):
        pass


@pytest.mark.parametrize("where", ["init", "log"])
def test_a_failing_wandb_is_one_warning_and_the_run_goes_on(where, tmp_path: Path, monkeypatch, caplog) -> None:
    fake = types.ModuleType("wandb")
    fake.Settings = lambda **k: k

    def init(**k):
        if where == "init":
            raise TimeoutError("wandb.init timed out")
        return _BrokenRun()

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = build_logger(LoggerConfig(name="wandb", mode="offline"))
    with caplog.at_level(logging.WARNING):
        logger.start(name="r", run_dir=tmp_path, config={})
        for step in range(3):  # no exception reaches the caller, however often it is used
            logger.log_request({"x": 1.0}, step=step)
        logger.log_summary({"tau": 2.0})
        logger.finish()
    warnings = [r for r in caplog.records if "W&B" in r.getMessage()]
    assert len(warnings) == 1 and where in warnings[0].getMessage()
    assert not logger.active
