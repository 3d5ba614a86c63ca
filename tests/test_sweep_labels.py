"""A sweep over any option is labelled and plotted by the keys it swept (read from each job's
Hydra overrides), not only by γ and temperature."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specdec import plots
from specdec.experiment.sweep import main as sweep_main
from specdec.experiment.sweep import sweep_table


def fake_sweep(root: Path, jobs: list[tuple[list[str], dict[str, float]]], *, method: str = "ngram",
               gamma: int = 4) -> Path:
    """A sweep dir as Hydra leaves it: ``<n>/.hydra/overrides.yaml`` and ``<n>/summary.json``;
    ``jobs``: (overrides, {tau, speedup, temperature})."""
    for n, (overrides, fig) in enumerate(jobs):
        d = root / str(n)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        summary = {"name": "quick", "target": "/zoo/code-target", "batch_size": 1, "num_prompts": 4, "num_requests": 4,
                   "complete": True,
                   "sampling": {"temperature": fig.get("temperature", 0.0)},
                   "methods": {method: {"gamma": gamma, "tau": fig["tau"], "speedup": fig["speedup"], "alpha": 0.5,
                                        "per_position_acceptance": [0.8, 0.5]}}}
        (d / "summary.json").write_text(json.dumps(summary))
    return root


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The first axes of every figure a sweep plot saves, by file stem."""
    seen: dict[str, Any] = {}
    save = plots.save_figure

    def spy(fig: Any, path: Path) -> Path:
        seen[path.stem] = fig.axes[0]
        return save(fig, path)

    monkeypatch.setattr(plots, "save_figure", spy)
    return seen


def _lines(ax: Any) -> dict[str, tuple[list[Any], list[float]]]:
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.lines
            if not ln.get_label().startswith("_")}


def test_a_sweep_over_max_n_is_labelled_and_plotted_against_max_n(tmp_path, figures, capsys):
    sweep = fake_sweep(tmp_path, [(["method=ngram", "experiment=quick", f"method.ngram.max_n={n}"],
                                   {"tau": 1.0 + n / 10, "speedup": 1.0 + n / 20}) for n in (2, 3, 4, 10)])
    table = sweep_table(sweep).splitlines()
    assert table[0].split() == ["max_n", "method", "T", "γ", "τ", "α", "speedup"]
    assert [r.split()[:5] for r in table[2:]] == [["2", "ngram", "0", "4", "1.20"], ["3", "ngram", "0", "4", "1.30"],
                                                  ["4", "ngram", "0", "4", "1.40"], ["10", "ngram", "0", "4", "2.00"]]
    made = plots.plot_sweep([sweep], sweep)
    assert made["sweep_tau_speedup"].stat().st_size > 1000
    ax = figures["sweep_tau_speedup"]
    assert ax.get_xlabel() == "method.ngram.max_n" and ax.get_title() == "τ against max_n"
    xs, taus = _lines(ax)["ngram"]
    assert xs == [2, 3, 4, 10] and taus == pytest.approx([1.2, 1.3, 1.4, 2.0])  # not a vertical line at γ=4
    per_pos = _lines(figures["sweep_acceptance_per_position"])
    assert sorted(per_pos) == [f"ngram, max_n={n}, γ=4" for n in (10, 2, 3, 4)]
    sweep_main([str(sweep)])  # python -m specdec.experiment.sweep <dir>: the same table, then the jobs' states
    out = capsys.readouterr().out
    assert out.startswith("\n".join(table)) and "4 of 4 jobs finished" in out


def test_a_sweep_over_a_head_path_gets_one_tick_per_path(tmp_path, figures):
    heads = ["/ckpt/eagle-a", "/ckpt/eagle-b"]
    sweep = fake_sweep(tmp_path, [([f"method.head_path={h}", "experiment=quick"], {"tau": t, "speedup": t - 0.5})
                                  for h, t in zip(heads, (2.5, 3.0))], method="eagle")
    assert [r.split()[:2] for r in sweep_table(sweep).splitlines()[2:]] == [[h, "eagle"] for h in heads]
    plots.plot_sweep([sweep], sweep)
    ax = figures["sweep_tau_speedup"]
    assert [t.get_text() for t in ax.get_xticklabels()] == heads
    assert _lines(ax)["eagle"] == ([0, 1], pytest.approx([2.5, 3.0]))


def test_two_swept_keys_one_line_per_value_of_the_other(tmp_path, figures):
    jobs = [([f"method.ngram.max_n={n}", f"sampling.temperature={t}"], {"tau": n + t, "speedup": 1.0, "temperature": t})
            for n in (2, 3) for t in (0, 0.7)]
    sweep = fake_sweep(tmp_path, jobs)
    rows = [r.split()[:3] for r in sweep_table(sweep).splitlines()[2:]]
    assert rows == [["2", "ngram", "0"], ["2", "ngram", "0.7"], ["3", "ngram", "0"], ["3", "ngram", "0.7"]]
    plots.plot_sweep([sweep], sweep)
    lines = _lines(figures["sweep_tau_speedup"])
    assert lines == {"ngram, T=0": ([2, 3], pytest.approx([2.0, 3.0])),
                     "ngram, T=0.7": ([2, 3], pytest.approx([2.7, 3.7]))}


def test_a_gamma_sweep_still_runs_along_gamma(tmp_path, figures):
    sweep = tmp_path
    for n, g in enumerate((1, 2, 4)):
        fake_sweep(sweep / f"x{n}", [([f"method.num_speculative_tokens={g}", "method=draft_model"],
                                      {"tau": 1 + g / 4, "speedup": 1.1})], method="draft_model", gamma=g)
    plots.plot_sweep([sweep], sweep)
    ax = figures["sweep_tau_speedup"]
    assert ax.get_xlabel() == "γ (num_speculative_tokens)"
    assert _lines(ax)["draft_model"][0] == [1, 2, 4]
    assert sweep_table(sweep).splitlines()[0].split() == ["method", "T", "γ", "τ", "α", "speedup"]
