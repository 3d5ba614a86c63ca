"""The research studies (experiments/studies/) on tiny random checkpoints: each writes its
plot and results file, and the figures in them agree with their definitions."""

from __future__ import annotations

import json
import logging
import math
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from specdec.measure import load_config, random_checkpoint
from specdec.studies import StudyConfig, iid_tau, quick
from tests.scripts import load_script

STUDIES = Path(__file__).resolve().parents[1] / "experiments" / "studies"


def _study(name: str) -> types.ModuleType:
    """``experiments/studies/<name>.py`` as a module (the scripts are not a package)."""
    return load_script(STUDIES / f"{name}.py")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, draft): a random 1-layer Llama and a noisy copy of it (acceptance in between 0 and 1)."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("studies")
    target = random_checkpoint(layers=1, hidden=32, vocab=128, heads=2, kv_heads=1, out=root / "target")
    model = transformers.LlamaForCausalLM.from_pretrained(target)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.03)
    model.save_pretrained(root / "draft")
    return target, root / "draft"


def _tiny(pair: tuple[Path, Path], out: Path, **kw: Any) -> dict[str, Any]:
    """Config keys of a tiny run on ``pair``: 3 prompts x 12 tokens, one timed pass, no W&B."""
    return {"target": str(pair[0]), "draft": str(pair[1]), "prompts": "random", "num_prompts": 3,
            "new_tokens": 12, "repeats": 1, "logger": "none", "threads": None, "out": str(out), **kw}


def _written(res: dict[str, Any], study: str) -> dict[str, Any]:
    """The results file, after checking it and the plot are there and it is what ``run`` returned."""
    js, png = Path(res["files"]["json"]), Path(res["files"]["plot"])
    assert js.name == f"{study}.json" and png.name == f"{study}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(js.read_text())
    assert data["study"] == study and data["rows"] == res["rows"]
    return data


def _counts_agree(r: dict[str, Any], gamma: int) -> None:
    """τ and α are the counters' ratios, within their bounds."""
    assert r["tau"] == pytest.approx((r["accepted"] + r["steps"]) / r["steps"])
    assert r["alpha"] == pytest.approx(r["accepted"] / r["proposed"] if r["proposed"] else 0.0)
    assert 1.0 <= r["tau"] <= gamma + 1 and 0.0 <= r["alpha"] <= 1.0
    assert r["proposed"] <= gamma * r["steps"]


def test_iid_tau_is_leviathans_formula() -> None:
    assert iid_tau(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert iid_tau(1.0, 4) == 5.0 and iid_tau(0.0, 4) == 1.0


def test_gamma_study(pair: tuple[Path, Path], tmp_path: Path) -> None:
    gamma = _study("gamma")
    res = gamma.run(gamma.GammaStudyConfig(**_tiny(pair, tmp_path, gammas=[1, 2, 4])))
    rows = _written(res, "gamma")["rows"]
    assert [r["gamma"] for r in rows] == [1, 2, 4]
    for r in rows:
        g, pp, reached, acc = r["gamma"], r["per_position"], r["reached"], r["accepted_at"]
        _counts_agree(r, g)
        a = r["alpha_token"]
        assert a == pytest.approx(sum(acc) / sum(reached))
        assert r["iid_tau"] == pytest.approx((1 - a ** (g + 1)) / (1 - a))  # from the measured α, by the formula
        assert 1 <= len(pp) <= g and pp == pytest.approx([x / n for x, n in zip(acc, reached)])
        assert r["tau_per_position"] == pytest.approx(1 + sum(math.prod(pp[:k]) for k in range(1, len(pp) + 1)))
        assert all(a1 >= a2 for a1, a2 in zip(reached, reached[1:])) and reached[0] <= r["steps"]
        assert sum(acc) == r["accepted"]
    assert any(0 < r["alpha"] < 1 for r in rows)  # the noisy draft is neither always right nor always wrong


def test_gamma_study_with_the_target_as_its_own_draft_accepts_everything(pair: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    gamma = _study("gamma")
    cfg = gamma.GammaStudyConfig(**_tiny((pair[0], pair[0]), tmp_path, gammas=[3]))
    (r,) = gamma.run(cfg)["rows"]
    assert r["per_position"] == [1.0, 1.0, 1.0] and r["alpha_token"] == 1.0
    assert r["iid_tau"] == r["tau_per_position"] == 4.0
    assert r["tau"] <= 4.0 and r["drafts_per_step"] <= 3.0  # short last steps only lower τ


def test_temperature_study(pair: tuple[Path, Path], tmp_path: Path) -> None:
    temperature = _study("temperature")
    cfg = temperature.TemperatureStudyConfig(**_tiny(pair, tmp_path, temperatures=[0.0, 1.0], gamma=3))
    data = _written(temperature.run(cfg), "temperature")
    rows = data["rows"]
    assert [(r["temperature"], r["method"]) for r in rows] == [
        (0.0, "draft_model"), (0.0, "ngram"), (1.0, "draft_model"), (1.0, "ngram")]
    for r in rows:
        _counts_agree(r, 3)
        assert r["speedup"] > 0 and r["tok_s"] > 0
        # Greedy speculation reproduces plain decoding; sampled outputs are not compared.
        assert r["equal"] is (True if r["temperature"] == 0 else None)
    assert data["outputs_equal"] is True


def test_batch_study(pair: tuple[Path, Path], tmp_path: Path) -> None:
    batch = _study("batch")
    cfg = batch.BatchStudyConfig(**_tiny(pair, tmp_path, methods=["draft_model"], batch_sizes=[1, 4], gamma=3,
                                          min_requests=4))
    data = _written(batch.run(cfg), "batch")
    rows = data["rows"]
    assert [(r["batch_size"], r["gamma_mode"]) for r in rows] == [
        (1, "fixed"), (1, "adaptive"), (4, "fixed"), (4, "adaptive")]
    for r in rows:
        _counts_agree(r, 3)
        assert r["speedup"] > 0 and r["equal"] is True
    assert data["outputs_equal"] is True


def test_tree_budget_study(pair: tuple[Path, Path], tmp_path: Path) -> None:
    tb = _study("tree_budget")
    cfg = tb.TreeBudgetStudyConfig(**_tiny(pair, tmp_path, budgets=[2, 4], top_k=2, depth=3))
    data = _written(tb.run(cfg), "tree_budget")
    rows = data["rows"]
    assert [(r["budget"], r["shape"]) for r in rows] == [(2, "chain"), (2, "tree"), (4, "chain"), (4, "tree")]
    for r in rows:
        _counts_agree(r, r["budget"])
        assert r["speedup"] > 0 and r["equal"] is True and r["tree_size"] <= r["budget"]
    assert data["outputs_equal"] is True


class _FakeRun:
    id = "fake-1"

    def __init__(self, calls: list[tuple[str, Any]], broken: bool) -> None:
        self.calls, self.broken, self.summary = calls, broken, self

    def update(self, d: dict[str, Any]) -> None:
        self.calls.append(("summary", d))

    def log(self, d: dict[str, Any], step: int | None = None) -> None:
        if self.broken:
            raise ConnectionError("api.wandb.ai unreachable")
        self.calls.append(("log", d))

    def finish(self, *a: Any, **k: Any) -> None:
        self.calls.append(("finish", None))


def _fake_wandb(calls: list[tuple[str, Any]], broken: bool) -> types.ModuleType:
    fake = types.ModuleType("wandb")
    fake.Settings = lambda **k: k  # type: ignore[attr-defined]
    fake.Table = lambda columns, data: ("table", columns, data)  # type: ignore[attr-defined]
    fake.Image = lambda path: ("image", path)  # type: ignore[attr-defined]

    def init(**k: Any) -> _FakeRun:
        calls.append(("init", k))
        return _FakeRun(calls, broken)

    fake.init = init  # type: ignore[attr-defined]
    return fake


@pytest.mark.parametrize("broken", [False, True])
def test_a_study_logs_to_wandb_and_a_failing_wandb_does_not_stop_it(
    broken: bool, pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls, broken))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    gamma = _study("gamma")
    with caplog.at_level(logging.WARNING):
        res = gamma.run(gamma.GammaStudyConfig(**_tiny(pair, tmp_path, gammas=[2], logger="wandb")))
    _written(res, "gamma")  # written either way
    init = dict(calls)["init"]
    assert init["mode"] == "offline" and init["name"] == "study-gamma" and init["config"]["gammas"] == [2]
    warnings = [r for r in caplog.records if "W&B" in r.getMessage()]
    if broken:
        assert len(warnings) == 1
        return
    assert not warnings
    logged = [v for kind, d in calls if kind == "log" for v in d.values()]
    (table,) = [v for v in logged if v[0] == "table"]
    assert "iid_tau" in table[1] and len(table[2]) == 1  # one row per γ
    assert ("image", res["files"]["plot"]) in logged
    assert dict(calls)["summary"]["method"] == "draft_model" and calls[-1] == ("finish", None)


@pytest.mark.parametrize("name,cls", [("gamma", "GammaStudyConfig"), ("temperature", "TemperatureStudyConfig"),
                                      ("batch", "BatchStudyConfig")])
def test_command_line_overrides_compose_and_quick_keeps_them(name: str, cls: str) -> None:
    config_cls: Callable[..., StudyConfig] = getattr(_study(name), cls)
    cfg = load_config(config_cls, ["quick=true", "target=/ckpt/t", "draft=/ckpt/d", "logger=none", "new_tokens=7"])
    assert (cfg.target, cfg.draft, cfg.logger, cfg.new_tokens) == ("/ckpt/t", "/ckpt/d", "none", 7)
    small = quick(cfg, new_tokens=3, num_prompts=2)
    assert small.new_tokens == 7 and small.num_prompts == 2  # what the user set stays
    with pytest.raises(SystemExit, match="gammma"):
        load_config(config_cls, ["gammma=3"])
    with pytest.raises(ValueError, match="logger must be wandb or none"):  # before any model loads
        getattr(_study(name), "run")(load_config(config_cls, ["logger=tensorboard", "target=/nowhere"]))
