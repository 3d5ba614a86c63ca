"""Plots of a run's ``summary.json`` and of sweeps over several runs (matplotlib, Agg).

One run (written to ``<run_dir>/plots/`` by the experiment):

- ``acceptance_per_position.png``: P(draft token i accepted | tokens < i accepted), per method;
- ``tau_speedup.png``: τ and speedup per method (plain decoding: τ = 1, speedup = 1);
- ``accepted_hist.png``: how many draft tokens each verification step accepted, per method.

Several runs (a γ / temperature sweep)::

    python -m specdec.plots outputs/gamma_sweep/multirun/<stamp>   # any dirs holding summary.json files
    python -m specdec.plots RUN_DIR [RUN_DIR ...] --out DIR

writes ``sweep_tau_speedup.png`` (τ and speedup against γ, one line per
method and temperature) and ``sweep_acceptance_per_position.png``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

SUMMARY_FILE = "summary.json"


def _int_x(ax: Any) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _methods(summary: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return dict(summary.get("methods", {}))


def plot_per_position(summary: Mapping[str, Any], path: Path) -> Path | None:
    methods = {n: m for n, m in _methods(summary).items() if m.get("per_position_acceptance")}
    if not methods:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, m in methods.items():
        pp = m["per_position_acceptance"]
        ax.plot(range(1, len(pp) + 1), pp, marker="o", label=f"{name} (γ={m.get('gamma')})")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accepted | earlier accepted)")
    ax.set_ylim(0, 1.05)
    _int_x(ax)
    ax.set_title("Per-position acceptance")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_tau_speedup(summary: Mapping[str, Any], path: Path) -> Path | None:
    methods = _methods(summary)
    if not methods:
        return None
    names = ["plain", *methods]
    taus = [1.0] + [m.get("tau") or 0.0 for m in methods.values()]
    speed = [1.0] + [m.get("speedup") or 0.0 for m in methods.values()]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.6))
    for ax, vals, title in ((a1, taus, "τ (tokens per target forward)"), (a2, speed, "speedup vs plain")):
        bars = ax.bar(names, vals, color=["0.6"] + [f"C{i}" for i in range(len(methods))])
        ax.bar_label(bars, fmt="%.2f")
        ax.set_title(title)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_ylim(0, max(vals + [1.0]) * 1.2)
    return _save(fig, path)


def plot_accepted_hist(summary: Mapping[str, Any], path: Path) -> Path | None:
    methods = {n: m for n, m in _methods(summary).items() if m.get("accepted_hist")}
    if not methods:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(methods)
    for j, (name, m) in enumerate(methods.items()):
        hist = m["accepted_hist"]
        total = sum(hist) or 1
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(hist))]
        ax.bar(xs, [h / total for h in hist], width=width, label=f"{name} (γ={m.get('gamma')})")
    ax.set_xlabel("draft tokens accepted in a step")
    _int_x(ax)
    ax.set_ylabel("fraction of steps")
    ax.set_title("Accepted length per verification step")
    ax.legend()
    return _save(fig, path)


def plot_run(summary: Mapping[str, Any], out_dir: Path) -> dict[str, Path]:
    """Every single-run plot into ``out_dir``; name -> file (plots with no data are skipped)."""
    out_dir = Path(out_dir)
    made = {
        "acceptance_per_position": plot_per_position(summary, out_dir / "acceptance_per_position.png"),
        "tau_speedup": plot_tau_speedup(summary, out_dir / "tau_speedup.png"),
        "accepted_hist": plot_accepted_hist(summary, out_dir / "accepted_hist.png"),
    }
    return {k: v for k, v in made.items() if v is not None}


# --------------------------------------------------------------------------------------
# sweeps
# --------------------------------------------------------------------------------------
def find_summaries(paths: Iterable[str | Path]) -> list[Path]:
    """``summary.json`` files: given directly, in a run dir, or anywhere under a sweep dir."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            out.append(p)
        elif (p / SUMMARY_FILE).is_file():
            out.append(p / SUMMARY_FILE)
        elif p.is_dir():
            out.extend(sorted(p.rglob(SUMMARY_FILE)))
    return sorted(set(out))


def load_summaries(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    return [json.loads(f.read_text()) for f in find_summaries(paths)]


def sweep_points(summaries: Sequence[Mapping[str, Any]]) -> dict[tuple[str, float], list[dict[str, Any]]]:
    """(method, temperature) -> points ``{gamma, tau, speedup, alpha, per_position_acceptance}`` sorted by γ.

    Runs of different experiments (``name``) are kept apart: their method is shown as ``name/method``.
    """
    names = {s.get("name") for s in summaries}
    series: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for s in summaries:
        temp = float(s.get("sampling", {}).get("temperature", 0.0))
        for name, m in _methods(s).items():
            label = f"{s.get('name')}/{name}" if len(names) > 1 else name
            series.setdefault((label, temp), []).append(
                {k: m.get(k) for k in ("gamma", "tau", "speedup", "alpha", "per_position_acceptance")}
            )
    for pts in series.values():
        pts.sort(key=lambda p: p["gamma"] or 0)
    return series


def plot_sweep(paths: Iterable[str | Path], out_dir: str | Path) -> dict[str, Path]:
    """τ and speedup against γ (and per-position acceptance per γ) over many runs."""
    summaries = load_summaries(paths)
    series = sweep_points(summaries)
    if not series:
        return {}
    out_dir = Path(out_dir)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.8))
    for (name, temp), pts in sorted(series.items()):
        g = [p["gamma"] for p in pts]
        label = f"{name}, T={temp:g}"
        a1.plot(g, [p["tau"] for p in pts], marker="o", label=label)
        a2.plot(g, [p["speedup"] for p in pts], marker="o", label=label)
    a1.set_title("τ against γ")
    a2.set_title("speedup against γ")
    for ax in (a1, a2):
        ax.set_xlabel("γ (num_speculative_tokens)")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
        _int_x(ax)
    a2.legend(fontsize=8)
    made = {"sweep_tau_speedup": _save(fig, out_dir / "sweep_tau_speedup.png")}
    fig, ax = plt.subplots(figsize=(6, 4))
    for (name, temp), pts in sorted(series.items()):
        for p in pts:
            pp = p["per_position_acceptance"] or []
            if pp:
                ax.plot(range(1, len(pp) + 1), pp, marker=".", label=f"{name}, T={temp:g}, γ={p['gamma']}")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accepted | earlier accepted)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    _int_x(ax)
    ax.set_title("Per-position acceptance")
    ax.legend(fontsize=7)
    made["sweep_acceptance_per_position"] = _save(fig, out_dir / "sweep_acceptance_per_position.png")
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Plot τ / speedup against γ over run or sweep directories.")
    ap.add_argument("paths", nargs="+", help="run dirs, sweep dirs or summary.json files")
    ap.add_argument("--out", default=None, help="output dir (default: the first path)")
    args = ap.parse_args(argv)
    out = Path(args.out or args.paths[0])
    made = plot_sweep(args.paths, out)
    if not made:
        print(f"no {SUMMARY_FILE} with speculative methods under {', '.join(args.paths)}")
        return 1
    for p in made.values():
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
