"""Plots of a run's ``summary.json`` and of sweeps over several runs (matplotlib, Agg).

Every figure says what it was measured on (target, temperature, batch size,
number of prompts, γ) so that a PNG read alone, or in a W&B panel next to
another run's, cannot be mistaken for a different setting.

One run (written to ``<run_dir>/plots/`` by the experiment):

- ``acceptance_per_position.png``: P(draft token i accepted | tokens < i accepted), per method,
  with 95% Wilson intervals and the number of times each position was reached
  (a rate from a handful of samples shows as such; a position never reached is not drawn);
- ``tau_speedup.png``: τ and speedup per method (plain decoding: τ = 1, speedup = 1), the
  analytic limit beside each measured speedup when it was measured;
- ``accepted_hist.png``: how many draft tokens each verification step accepted, per method;
- ``by_category.png``: τ and speedup per prompt category and method (when the summary has
  ``methods.<m>.by_category`` with more than one category).

Several runs (a sweep over any option)::

    python -m specdec.plots outputs/gamma_sweep/multirun/<stamp>   # any dirs holding summary.json files
    python -m specdec.plots RUN_DIR [RUN_DIR ...] --out DIR

writes ``sweep_tau_speedup.png`` (τ and speedup against the swept key, one line per
method and combination of the other swept keys) and ``sweep_acceptance_per_position.png``.
The swept keys are those whose values differ between the runs' Hydra overrides
(``.hydra/overrides.yaml``): γ, a temperature, ``method.ngram.max_n``, a head path …;
runs without overrides are plotted against γ, one line per method and temperature.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

SUMMARY_FILE = "summary.json"
Z_95 = 1.959963984540054  # two-sided 95% normal quantile


def _int_x(ax: Any) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def save_figure(fig: Any, path: Path) -> Path:
    """Writes ``fig`` to ``path`` (parents made) and closes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _methods(summary: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return dict(summary.get("methods", {}))


# --------------------------------------------------------------------------------------
# figures the plots need
# --------------------------------------------------------------------------------------
def wilson_interval(k: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``k / n`` (95% by default).

    Unlike p ± z·sqrt(p(1-p)/n) it stays inside [0, 1] and does not collapse to a
    point at 0 or n successes, which is what a deep draft position, reached a few
    times and never accepted, needs. ``n == 0`` says nothing: (0, 1).
    """
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = k / n
    z2 = z * z
    denom = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def position_counts(m: Mapping[str, Any]) -> list[tuple[int, int]] | None:
    """Per draft position (accepted, reached) of a method's summary, or None without ``reached``.

    ``accepted`` comes from ``accepted_at`` when the summary has it, else from the
    acceptance rate times ``reached`` (exact: the rate is their ratio)."""
    reached = m.get("reached")
    if not reached:
        return None
    acc = m.get("accepted_at")
    if not acc:
        pp = m.get("per_position_acceptance") or []
        acc = [round(p * n) for p, n in zip(pp, reached)]
    return [(int(a), int(n)) for a, n in zip(acc, reached)]


def _target_name(target: Any) -> str | None:
    return Path(str(target)).name if target else None


def _temperature(summary: Mapping[str, Any]) -> float | None:
    t = (summary.get("sampling") or {}).get("temperature")
    return float(t) if t is not None else None


def _temp_text(t: float) -> str:
    return "T=0 (greedy)" if t == 0 else f"T={t:g}"


def run_context(summary: Mapping[str, Any], *, with_gamma: bool = True) -> str:
    """``code-target · T=0 (greedy) · batch 1 · 32 prompts · γ=4``: what a run's figures were measured on."""
    parts = []
    if name := _target_name(summary.get("target")):
        parts.append(name)
    if (t := _temperature(summary)) is not None:
        parts.append(_temp_text(t))
    if summary.get("batch_size") is not None:
        parts.append(f"batch {summary['batch_size']}")
    n, done = summary.get("num_prompts"), summary.get("num_requests")
    if n is not None:
        parts.append(f"{done} of {n} prompts" if done is not None and done != n else f"{n} prompts")
    gammas = sorted({m.get("gamma") for m in _methods(summary).values() if m.get("gamma") is not None})
    if with_gamma and gammas:
        parts.append("γ=" + "/".join(str(g) for g in gammas))
    return " · ".join(parts)


def _title(ax: Any, title: str, context: str) -> None:
    ax.set_title(f"{title}\n{context}" if context else title, fontsize=10)


# --------------------------------------------------------------------------------------
# one run
# --------------------------------------------------------------------------------------
def plot_per_position(summary: Mapping[str, Any], path: Path) -> Path | None:
    methods = {n: m for n, m in _methods(summary).items() if m.get("per_position_acceptance")}
    if not methods:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    shift = 0.08
    any_counts = False
    for j, (name, m) in enumerate(methods.items()):
        pp = m["per_position_acceptance"]
        dx = (j - (len(methods) - 1) / 2) * shift
        counts = position_counts(m)
        label = f"{name} (γ={m.get('gamma')})"
        if counts is None:  # an older summary: rates only
            ax.plot([i + 1 + dx for i in range(len(pp))], pp, marker="o", label=label)
            continue
        any_counts = True
        pts = [(i + 1 + dx, k / n, *wilson_interval(k, n), n) for i, (k, n) in enumerate(counts) if n > 0]
        if not pts:
            continue
        xs, ps, los, his, ns = zip(*pts)
        bars = ax.errorbar(xs, ps, yerr=[[p - lo for p, lo in zip(ps, los)], [hi - p for p, hi in zip(ps, his)]],
                           marker="o", capsize=3, label=label)
        for x, p, n in zip(xs, ps, ns):
            ax.annotate(f"n={n}", (x, p), textcoords="offset points", xytext=(5, 2), fontsize=7,
                        color=bars[0].get_color(), bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none",
                                                         "alpha": 0.8})
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accepted | earlier accepted)")
    ax.set_ylim(0, 1.08)
    # every drafted position on the axis, also those never reached (left empty, not drawn at 0)
    ax.set_xlim(0.5, max(len(m["per_position_acceptance"]) for m in methods.values()) + 0.7)
    _int_x(ax)
    what = "95% Wilson intervals, n = times reached" if any_counts else "no per-position counts in the summary"
    _title(ax, f"Per-position acceptance ({what})", run_context(summary))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    return save_figure(fig, path)


def plot_tau_speedup(summary: Mapping[str, Any], path: Path) -> Path | None:
    methods = _methods(summary)
    if not methods:
        return None
    names = ["plain", *methods]
    colors = ["0.6"] + [f"C{i}" for i in range(len(methods))]
    taus = [1.0] + [m.get("tau") or 0.0 for m in methods.values()]
    speed = [1.0] + [m.get("speedup") or 0.0 for m in methods.values()]
    limits = [None] + [m.get("analytic_limit") for m in methods.values()]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4))
    bars = a1.bar(names, taus, color=colors)
    a1.bar_label(bars, fmt="%.2f")
    a1.set_title("τ (tokens per target forward)", fontsize=10)
    a1.set_ylim(0, max(taus + [1.0]) * 1.2)
    xs = list(range(len(names)))
    has_limit = any(v is not None for v in limits)
    w = 0.38 if has_limit else 0.8
    mx = [x - w / 2 if lim is not None else x for x, lim in zip(xs, limits)]
    bars = a2.bar(mx, speed, width=w, color=colors, label="measured")
    a2.bar_label(bars, fmt="%.2f")
    if has_limit:
        lx = [x + w / 2 for x, lim in zip(xs, limits) if lim is not None]
        lv = [lim for lim in limits if lim is not None]
        lc = [c for c, lim in zip(colors, limits) if lim is not None]
        lb = a2.bar(lx, lv, width=w, color=lc, alpha=0.35, hatch="//", edgecolor="k", label="analytic limit")
        a2.bar_label(lb, fmt="%.2f")
        a2.legend(fontsize=8, loc="lower right")
    a2.set_xticks(xs, names)
    a2.set_title("speedup vs plain" + (" (measured | analytic limit)" if has_limit else ""), fontsize=10)
    a2.set_ylim(0, max(speed + [v for v in limits if v is not None] + [1.0]) * 1.2)
    for ax in (a1, a2):
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
    fig.suptitle(run_context(summary), fontsize=10)
    return save_figure(fig, path)


def plot_accepted_hist(summary: Mapping[str, Any], path: Path) -> Path | None:
    methods = {n: m for n, m in _methods(summary).items() if m.get("accepted_hist")}
    if not methods:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    width = 0.8 / len(methods)
    for j, (name, m) in enumerate(methods.items()):
        hist = m["accepted_hist"]
        total = sum(hist) or 1
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(hist))]
        ax.bar(xs, [h / total for h in hist], width=width, label=f"{name} (γ={m.get('gamma')}, {sum(hist)} steps)")
    ax.set_xlabel("draft tokens accepted in a step")
    _int_x(ax)
    ax.set_ylabel("fraction of steps")
    _title(ax, "Accepted length per verification step", run_context(summary))
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def categories(summary: Mapping[str, Any]) -> list[str]:
    """The prompt categories any method has figures for (``methods.<m>.by_category``), sorted."""
    cats: set[str] = set()
    for m in _methods(summary).values():
        cats.update((m.get("by_category") or {}).keys())
    return sorted(cats)


def plot_by_category(summary: Mapping[str, Any], path: Path) -> Path | None:
    """τ and speedup per category and method; None unless there are at least two categories."""
    cats = categories(summary)
    methods = {n: m["by_category"] for n, m in _methods(summary).items() if m.get("by_category")}
    if len(cats) < 2 or not methods:
        return None
    reqs = {c: max((bc.get(c) or {}).get("requests") or 0 for bc in methods.values()) for c in cats}
    fig, axes = plt.subplots(1, 2, figsize=(max(9.0, 1.1 * len(cats) * 2), 4.4))
    width = 0.8 / len(methods)
    for ax, key, title in ((axes[0], "tau", "τ per category"), (axes[1], "speedup", "speedup per category")):
        for j, (name, bc) in enumerate(methods.items()):
            xs = [i - 0.4 + width * (j + 0.5) for i in range(len(cats))]
            vals = [(bc.get(c) or {}).get(key) for c in cats]
            bars = ax.bar(xs, [v if v is not None else math.nan for v in vals], width=width, color=f"C{j}",
                          label=name)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(cats)), [f"{c}\n(n={reqs[c]})" for c in cats],
                      rotation=30 if len(cats) > 5 else 0, fontsize=8)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[1].legend(fontsize=8)
    fig.suptitle(run_context(summary), fontsize=10)
    return save_figure(fig, path)


def plot_run(summary: Mapping[str, Any], out_dir: Path) -> dict[str, Path]:
    """Every single-run plot into ``out_dir``; name -> file (plots with no data are skipped)."""
    out_dir = Path(out_dir)
    made = {
        "acceptance_per_position": plot_per_position(summary, out_dir / "acceptance_per_position.png"),
        "tau_speedup": plot_tau_speedup(summary, out_dir / "tau_speedup.png"),
        "accepted_hist": plot_accepted_hist(summary, out_dir / "accepted_hist.png"),
        "by_category": plot_by_category(summary, out_dir / "by_category.png"),
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


def _natural(path: Path) -> list[Any]:
    """Sort key: job dirs in job order (``2`` before ``10``)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.parts]


def run_overrides(run_dir: str | Path) -> list[str]:
    """The Hydra overrides a run was started with (``.hydra/overrides.yaml``); [] without them."""
    import yaml

    f = Path(run_dir) / ".hydra" / "overrides.yaml"
    return [str(o) for o in (yaml.safe_load(f.read_text()) or [])] if f.is_file() else []


def _value(text: str | None) -> Any:
    """An override's value as a number where it reads as one (``4`` -> 4, ``0.7`` -> 0.7), else the text."""
    if text is None:
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip("'\"")


def swept_settings(overrides: Sequence[Sequence[str]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The keys whose values differ between runs (in the order the overrides name them), and each
    run's values of them; ``method.ngram.max_n=2`` / ``3`` -> (``["method.ngram.max_n"]``, ``[{…: 2}, {…: 3}]``)."""
    parsed = []
    for ov in overrides:
        pairs = (o.lstrip("+").split("=", 1) for o in ov if "=" in o and not o.startswith("~"))
        parsed.append({k: v for k, v in pairs})
    keys = [k for k in dict.fromkeys(k for d in parsed for k in d) if len({d.get(k) for d in parsed}) > 1]
    return keys, [{k: _value(d.get(k)) for k in keys} for d in parsed]


GAMMA_KEY = "method.num_speculative_tokens"


def short_key(key: str) -> str:
    """A swept key as a label shows it: ``γ``, ``T``, else its last part (``method.ngram.max_n`` -> ``max_n``)."""
    last = key.rsplit(".", 1)[-1]
    return {"num_speculative_tokens": "γ", "temperature": "T"}.get(last, last)


def sweep_points(summaries: Sequence[Mapping[str, Any]],
                 settings: Sequence[Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One point per run and method: ``{method, temperature, setting, gamma, tau, speedup, alpha, …}``.

    ``setting``: the run's values of the swept keys (:func:`swept_settings`). Runs of
    different experiments (``name``) are kept apart: their method is shown as ``name/method``.
    """
    names = {s.get("name") for s in summaries}
    keys = ("gamma", "tau", "speedup", "alpha", "per_position_acceptance", "analytic_limit", "reached", "accepted_at")
    points = []
    for i, s in enumerate(summaries):
        temp = float((s.get("sampling") or {}).get("temperature", 0.0))
        for name, m in _methods(s).items():
            points.append({"method": f"{s.get('name')}/{name}" if len(names) > 1 else name, "temperature": temp,
                           "setting": dict(settings[i]) if settings else {}, **{k: m.get(k) for k in keys}})
    return points


def load_sweep(paths: Iterable[str | Path]) -> tuple[list[dict[str, Any]], list[str], list[dict[str, Any]]]:
    """The runs under ``paths`` (summaries, in job order), the keys swept between them and the points.

    A swept ``method=`` is left out of the keys: a point's method already says it."""
    files = sorted(find_summaries(paths), key=_natural)
    summaries = [json.loads(f.read_text()) for f in files]
    keys, settings = swept_settings([run_overrides(f.parent) for f in files])
    keep = [k for k in keys if k != "method"]
    settings = [{k: st[k] for k in keep} for st in settings]
    return summaries, keep, sweep_points(summaries, settings)


def sweep_x(keys: Sequence[str]) -> str | None:
    """The swept key the sweep plots run along: γ when swept, else the first swept key; None: γ
    as the summaries give it (no overrides, or nothing but the method swept)."""
    return GAMMA_KEY if GAMMA_KEY in keys else (keys[0] if keys else None)


def sweep_context(summaries: Sequence[Mapping[str, Any]]) -> str:
    """What every run of a sweep shares (target, batch size, prompts), for the titles."""
    def common(values: Iterable[Any]) -> Any:
        vals = set(values)
        return vals.pop() if len(vals) == 1 else None

    parts = []
    if name := common(_target_name(s.get("target")) for s in summaries):
        parts.append(name)
    if (bs := common(s.get("batch_size") for s in summaries)) is not None:
        parts.append(f"batch {bs}")
    if (n := common(s.get("num_prompts") for s in summaries)) is not None:
        parts.append(f"{n} prompts")
    parts.append(f"{len(summaries)} runs")
    return " · ".join(parts)


def _series(points: Sequence[dict[str, Any]], x_key: str | None,
            keys: Sequence[str]) -> dict[str, list[tuple[Any, dict[str, Any]]]]:
    """Label -> (x, point) pairs: one line per method, temperature and combination of the other swept keys."""
    others = [k for k in keys if k != x_key]
    temps = {p["temperature"] for p in points}
    series: dict[str, list[tuple[Any, dict[str, Any]]]] = {}
    for p in points:
        parts = [p["method"], *(f"{short_key(k)}={p['setting'].get(k)}" for k in others)]
        if "sampling.temperature" not in keys and (x_key is None or len(temps) > 1):
            parts.append(_temp_text(p["temperature"]))
        x = p["gamma"] if x_key is None else p["setting"].get(x_key)
        series.setdefault(", ".join(parts), []).append((x, p))
    return series


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def plot_sweep(paths: Iterable[str | Path], out_dir: str | Path) -> dict[str, Path]:
    """τ and speedup against the swept key (γ unless something else was swept), and per-position
    acceptance per run, over many runs. A numeric key gets a numeric axis, any other (a head path,
    a method name) one tick per value; several swept keys: one line per combination of the others."""
    summaries, keys, points = load_sweep(paths)
    if not points:
        return {}
    x_key = sweep_x(keys)
    series = _series(points, x_key, keys)
    xs_all = [x for pts in series.values() for x, _ in pts]
    numeric = all(_is_number(x) or x is None for x in xs_all)
    ticks = [] if numeric else list(dict.fromkeys(str(x) for x in xs_all))
    where = (lambda x: x) if numeric else (lambda x: ticks.index(str(x)))
    x_name = "γ (num_speculative_tokens)" if x_key in (None, GAMMA_KEY) else x_key
    context = sweep_context(summaries)
    out_dir = Path(out_dir)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4))
    any_limit = False
    for i, (label, pts) in enumerate(sorted(series.items())):
        pts = sorted(pts, key=lambda xp: (where(xp[0]) if xp[0] is not None else 0))
        xs = [where(x) for x, _ in pts]
        a1.plot(xs, [p["tau"] for _, p in pts], marker="o", color=f"C{i}", label=label)
        a2.plot(xs, [p["speedup"] for _, p in pts], marker="o", color=f"C{i}", label=label)
        lim = [(x, p["analytic_limit"]) for x, (_, p) in zip(xs, pts) if p.get("analytic_limit") is not None]
        if lim:
            any_limit = True
            a2.plot(*zip(*lim), ls=":", marker="x", color=f"C{i}", alpha=0.7)
    against = "γ" if x_key in (None, GAMMA_KEY) else short_key(x_key)
    a1.set_title(f"τ against {against}", fontsize=10)
    a2.set_title(f"speedup against {against}" + (" (dotted: analytic limit)" if any_limit else ""), fontsize=10)
    for ax in (a1, a2):
        ax.set_xlabel(x_name)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
        if not numeric:
            long = max(len(t) for t in ticks) > 12
            ax.set_xticks(range(len(ticks)), ticks, rotation=25 if long else 0, ha="right" if long else "center",
                          fontsize=8)
            ax.set_xlim(-0.5, len(ticks) - 0.5)
        elif all(isinstance(x, int) for x in xs_all if x is not None):
            _int_x(ax)
    a2.legend(fontsize=8)
    fig.suptitle(context, fontsize=10)
    made = {"sweep_tau_speedup": save_figure(fig, out_dir / "sweep_tau_speedup.png")}
    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    for label, pts in sorted(series.items()):
        for x, p in pts:
            pp = p["per_position_acceptance"] or []
            counts = position_counts(p)
            # with counts, a position never reached is left out instead of drawn at 0
            xy = [(i + 1, k / n) for i, (k, n) in enumerate(counts) if n > 0] if counts else list(
                enumerate(pp, start=1))
            if xy:
                here = f"γ={p['gamma']}" if x_key in (None, GAMMA_KEY) else f"{short_key(x_key)}={x}, γ={p['gamma']}"
                ax.plot(*zip(*xy), marker=".", label=f"{label}, {here}")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accepted | earlier accepted)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    _int_x(ax)
    _title(ax, "Per-position acceptance", context)
    ax.legend(fontsize=7)
    made["sweep_acceptance_per_position"] = save_figure(fig, out_dir / "sweep_acceptance_per_position.png")
    return made


def sweep_rows(paths: Iterable[str | Path]) -> tuple[list[str], list[dict[str, Any]]]:
    """The swept keys and one row per run and method (in job order): the run's value of each swept
    key, method, temperature, γ, τ, α, speedup; what the sweep's table prints."""
    _, keys, points = load_sweep(paths)
    return keys, [{**p["setting"], **{k: p[k] for k in ("method", "temperature", "gamma", "tau", "alpha",
                                                        "speedup")}} for p in points]


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
