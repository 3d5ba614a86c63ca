"""Progress a piped run shows, and what the plots draw (context, counts, intervals, limit, categories)."""

from __future__ import annotations

import copy
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from specdec import plots
from specdec.logging.progress import Progress
from specdec.plots import plot_run, run_context, wilson_interval

from test_experiment import tiny_pair  # noqa: F401  (a fixture)


# --------------------------------------------------------------------------------------
# progress
# --------------------------------------------------------------------------------------
def test_progress_off_a_terminal_prints_lines_at_most_every_interval():
    out = io.StringIO()
    p = Progress(4, 1, stream=out, interval_s=3600.0, tty=False)
    with p.phase("loading models"):
        pass
    p.start_requests("plain + ngram; batch 1")
    summary = {"plain": {"tokens_per_s": 100.0}, "methods": {"ngram": {"tokens_per_s": 150.0, "tau": 2.5,
                                                                        "speedup": 1.5}}}
    p.update(1, summary)
    p.update(1, summary)  # within the interval: no line
    p.update(1, summary)  # the last request: always a line
    p.close()
    lines = out.getvalue().splitlines()
    assert all(line.startswith("[specdec ") for line in lines)
    assert "loading models …" in lines[0] and "loading models: done in" in lines[1]
    assert "3 to run of 4" in lines[2]
    assert len(lines) == 4, lines
    assert "requests 4/4 (100%)" in lines[3] and "ngram 150 tok/s τ 2.50 ×1.50" in lines[3]
    assert "plain 100 tok/s" in lines[3]

    out = io.StringIO()
    p = Progress(3, stream=out, interval_s=0.0, tty=False)
    p.start_requests("x")
    for _ in range(3):
        p.update(1)
    counts = [line.split("requests ")[1].split(" ")[0] for line in out.getvalue().splitlines()[1:]]
    assert counts == ["1/3", "2/3", "3/3"]  # interval 0: a line per update
    assert "ETA" in out.getvalue().splitlines()[1] and "ETA" not in out.getvalue().splitlines()[-1]


def test_progress_phase_says_when_it_stopped_and_disabled_is_silent():
    out = io.StringIO()
    p = Progress(1, stream=out, tty=False)
    with pytest.raises(RuntimeError), p.phase("warm-up"):
        raise RuntimeError("boom")
    assert "warm-up: stopped after" in out.getvalue()
    quiet = io.StringIO()
    q = Progress(2, stream=quiet, tty=False, enabled=False)
    with q.phase("loading"):
        q.start_requests("x")
        q.update(2)
    assert quiet.getvalue() == ""


def test_piped_run_prints_progress_before_the_table(tiny_pair, tmp_path):  # noqa: F811
    """``specdec experiment=quick | cat``: stdout and stderr both pipes; progress comes before the table."""
    target, draft, prompts = tiny_pair
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env.pop("PYTHONUNBUFFERED", None)  # piped stdout is block-buffered, as `make run | cat` without make's env
    cmd = [sys.executable, "-m", "specdec.run", "experiment=quick", f"target.path={target}", f"draft.path={draft}",
           "data=jsonl", f"data.path={prompts}", "sampling.max_new_tokens=8", "method.num_speculative_tokens=3",
           "runtime.max_seq_len=128", "runtime.threads=1", "plots=false", f"run_dir={tmp_path / 'run'}",
           "method=[draft_model,ngram]"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    text = out.stdout
    table = text.index("method  ")  # the summary table's header
    before = [line for line in text[:table].splitlines() if line.startswith("[specdec ")]
    for phase in ("loading models", "warm-up"):  # a line at the start and at the end
        assert any(phase in line and line.endswith("…") for line in before), (phase, text[:table])
        assert any(phase in line and "done in" in line for line in before), (phase, text[:table])
    last = [line for line in before if "requests 4/4" in line]
    assert last and "τ" in last[0] and "tok/s" in last[0], text[:table]


# --------------------------------------------------------------------------------------
# Wilson intervals
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("k", "n", "lo", "hi"), [
    (5, 10, 0.2366, 0.7634),   # symmetric around 1/2
    (0, 10, 0.0, 0.2775),      # z²/(n+z²): never accepted is not "exactly 0"
    (10, 10, 0.7225, 1.0),
    (1, 4, 0.0456, 0.6994),
    (0, 2, 0.0, 0.6576),       # two samples say little
    (81, 263, 0.2553, 0.3662),
])
def test_wilson_interval_on_hand_made_numbers(k, n, lo, hi):
    got = wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-4)
    # the interval's ends solve (p̂ - p)² = z² p (1 - p) / n
    z, ph = plots.Z_95, k / n
    for p in got:
        if 0 < p < 1:
            assert (ph - p) ** 2 == pytest.approx(z * z * p * (1 - p) / n, rel=1e-9)


def test_wilson_interval_edges():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)
    with pytest.raises(ValueError):
        wilson_interval(-1, 2)
    lo, hi = wilson_interval(50, 100)
    assert lo < 0.5 < hi and math.isclose(0.5 - lo, hi - 0.5)


# --------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------
SUMMARY: dict[str, Any] = {
    "name": "exp", "target": "/ckpt/code-target", "sampling": {"temperature": 0.7}, "batch_size": 4,
    "num_prompts": 32, "num_requests": 32,
    "plain": {"tokens_per_s": 100.0},
    "methods": {
        "draft_model": {
            "gamma": 4, "tau": 3.1, "speedup": 1.4, "analytic_limit": 1.7, "accepted_hist": [3, 2, 1, 1, 5],
            "per_position_acceptance": [0.9, 0.5, 0.0, 0.0], "reached": [40, 36, 4, 0], "accepted_at": [36, 18, 0, 0],
            "by_category": {"code": {"requests": 16, "tau": 3.3, "speedup": 1.5},
                            "math": {"requests": 16, "tau": 2.9, "speedup": 1.3}},
        },
        "ngram": {
            "gamma": 4, "tau": 2.0, "speedup": 1.2, "accepted_hist": [5, 2, 1, 0, 0],
            "per_position_acceptance": [0.5, 0.25, 0.0, 0.0], "reached": [20, 10, 2, 0],
            "by_category": {"code": {"requests": 16, "tau": 2.2, "speedup": 1.3},
                            "math": {"requests": 16, "tau": 1.8, "speedup": 1.1}},
        },
    },
}


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Every figure a plot function saves, by file stem, inspected before it is closed."""
    seen: dict[str, Any] = {}
    save = plots.save_figure

    def spy(fig: Any, path: Path) -> Path:
        texts = [fig._suptitle.get_text()] if fig._suptitle else []
        for ax in fig.axes:
            texts.append(ax.get_title())
            texts += [t.get_text() for t in ax.texts]
            leg = ax.get_legend()
            texts += [t.get_text() for t in leg.get_texts()] if leg else []
        seen[path.stem] = {"text": "\n".join(texts), "axes": fig.axes}
        return save(fig, path)

    monkeypatch.setattr(plots, "save_figure", spy)
    return seen


def test_run_plots_carry_context_counts_intervals_limit_and_categories(tmp_path, figures):
    made = plot_run(SUMMARY, tmp_path)
    assert set(made) == {"acceptance_per_position", "tau_speedup", "accepted_hist", "by_category"}
    for path in made.values():
        assert path.stat().st_size > 1000
    ctx = run_context(SUMMARY)
    assert ctx == "code-target · T=0.7 · batch 4 · 32 prompts · γ=4"
    for stem in made:
        assert ctx in figures[stem]["text"], stem

    pp = figures["acceptance_per_position"]
    assert "95% Wilson" in pp["text"]
    assert "n=40" in pp["text"] and "n=4" in pp["text"] and "n=0" not in pp["text"]
    ax = pp["axes"][0]
    assert sorted(t.get_text() for t in ax.texts) == sorted(["n=40", "n=36", "n=4", "n=20", "n=10", "n=2"])
    bars = {c.get_label(): c for c in ax.containers}
    data, _caps, (vlines,) = bars["draft_model (γ=4)"].lines
    assert len(data.get_xdata()) == 3  # position 4 was never reached: not drawn at 0.0
    assert list(data.get_ydata()) == pytest.approx([0.9, 0.5, 0.0])
    ends = [(float(seg[:, 1].min()), float(seg[:, 1].max())) for seg in vlines.get_segments()]
    want = [wilson_interval(36, 40), wilson_interval(18, 36), wilson_interval(0, 4)]
    # the error bars are the Wilson intervals (0 of 4 reaches up to 0.49)
    assert [x for e in ends for x in e] == pytest.approx([x for w in want for x in w])

    ts = figures["tau_speedup"]
    assert "analytic limit" in ts["text"]
    speed_ax = ts["axes"][1]
    heights = sorted(round(p.get_height(), 3) for p in speed_ax.patches)
    assert 1.7 in heights and 1.4 in heights  # measured and limit side by side

    cat = figures["by_category"]["axes"]
    assert [t.get_text() for t in cat[0].get_xticklabels()] == ["code\n(n=16)", "math\n(n=16)"]
    assert sorted(round(p.get_height(), 2) for p in cat[0].patches) == [1.8, 2.2, 2.9, 3.3]


def test_plots_without_counts_limit_or_categories(tmp_path, figures):
    s = copy.deepcopy(SUMMARY)
    for m in s["methods"].values():
        for k in ("reached", "accepted_at", "analytic_limit"):
            m.pop(k, None)
        m["by_category"] = {"code": m["by_category"]["code"]}  # one category: no per-category plot
    s["num_requests"] = 10
    made = plot_run(s, tmp_path)
    assert set(made) == {"acceptance_per_position", "tau_speedup", "accepted_hist"}
    assert "10 of 32 prompts" in figures["tau_speedup"]["text"]
    assert "no per-position counts" in figures["acceptance_per_position"]["text"]
    assert "analytic limit" not in figures["tau_speedup"]["text"]


def test_sweep_plots_have_context_and_limits(tmp_path, figures):
    for g in (2, 4):
        d = tmp_path / str(g)
        d.mkdir()
        s = copy.deepcopy(SUMMARY)
        for m in s["methods"].values():
            m["gamma"] = g
        (d / "summary.json").write_text(json.dumps(s))
    made = plots.plot_sweep([tmp_path], tmp_path)
    assert set(made) == {"sweep_tau_speedup", "sweep_acceptance_per_position"}
    assert "code-target · batch 4 · 32 prompts · 2 runs" in figures["sweep_tau_speedup"]["text"]
    assert "analytic limit" in figures["sweep_tau_speedup"]["text"]
    lines = figures["sweep_acceptance_per_position"]["axes"][0].lines
    assert all(len(line.get_xdata()) == 3 for line in lines)  # position 4: never reached


def test_progress_on_a_terminal_is_a_bar_with_the_figures():
    out = io.StringIO()
    p = Progress(2, stream=out, interval_s=0.0, tty=True)
    p.start_requests("plain + ngram")
    assert "requests:   0%|" in out.getvalue()  # the bar
    p.update(1, {"methods": {"ngram": {"tau": 2.25}}})
    p.update(1)
    assert "[specdec" not in out.getvalue().split("to run of 2")[1]  # no log lines while the bar runs
    p.close()
    assert "2/2" in out.getvalue()
    assert out.getvalue().rstrip().splitlines()[-1].split("] ")[1].startswith("requests 2/2 (100%)")
    assert "τ 2.25" in out.getvalue()
