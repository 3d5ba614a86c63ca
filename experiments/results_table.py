"""Render README.md's results tables from the measurement records in results/*.jsonl.

Each line of a results file is one measurement: ``date`` ("YYYY-MM-DD …"),
``commit``, ``command``, ``machine`` (CPU, cores, torch …), ``figures`` and a
one-line ``note`` (format: results/README.md). Between ``<!-- results:start -->``
and ``<!-- results:end -->`` the README shows the newest ``results/real.jsonl``
record (the real target on Spec-Bench): a method table, a per-category table of
τ / speedup and its machine record; then one line from the newest ``make run``
record (the built-in pair, the smoke test). Methods and categories are whatever
the record's ``<method>/<figure>`` and ``<method>/<category>/<figure>`` keys
name; figures are never typed into the README by hand.

    python experiments/results_table.py           # rewrite the README's tables
    python experiments/results_table.py --check   # exit 1 if the README's tables are not the records'

Standard library only, so it runs before the venv exists.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- results:start -->", "<!-- results:end -->"
REQUIRED = ("date", "command", "machine", "figures")
MACHINE_REQUIRED = ("cpu", "cores", "torch")
# (header, figure key, decimals) of the README's method table; "equal" is a yes/no.
COLUMNS = (("tok/s", "tok_s", 1), ("speedup", "speedup", 2), ("τ", "tau", 2), ("α", "alpha", 3),
           ("limit", "limit", 2), ("efficiency", "efficiency", 2), ("equal", "equal", None))


class RecordError(ValueError):
    """A results record that cannot be used; the message names its file and line."""


def load_records(results_dir: Path) -> list[dict]:
    """Every record of ``results_dir/*.jsonl``, checked; raises RecordError naming file:line."""
    records = []
    for path in sorted(results_dir.glob("*.jsonl")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise RecordError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise RecordError(f"{where}: a record must be a JSON object")
            missing = [k for k in REQUIRED if k not in rec]
            if missing:
                raise RecordError(f"{where}: record lacks {', '.join(missing)}"
                                  + (" (every figure needs the machine it was measured on)"
                                     if "machine" in missing else ""))
            machine = rec["machine"]
            if not isinstance(machine, dict) or any(k not in machine for k in MACHINE_REQUIRED):
                raise RecordError(f"{where}: 'machine' must be an object with at least "
                                  f"{', '.join(MACHINE_REQUIRED)}; got {machine!r}")
            if not isinstance(rec["figures"], dict) or not rec["figures"]:
                raise RecordError(f"{where}: 'figures' must be a non-empty object")
            rec["_file"] = path.name
            records.append(rec)
    return records


def _cell(value, decimals):
    if value is None:
        return "–"
    if decimals is None:
        return "yes" if value is True else "no" if value is False else str(value)
    return f"{value:.{decimals}f}" if isinstance(value, (int, float)) else str(value)


def _machine_line(m: dict) -> str:
    parts = [f"{m['cpu']}, {m['cores']} cores"]
    parts += [str(m[k]) for k in ("isa", "hypervisor") if m.get(k)]
    parts.append(f"torch {m['torch']}")
    parts += [f"{k.replace('_', ' ')} {m[k]}" for k in m
              if k not in ("cpu", "cores", "isa", "hypervisor", "torch", "gpu") and m[k] is not None
              and not isinstance(m[k], (dict, list))]
    parts.append(f"GPU: {m.get('gpu') or 'none'}")
    return "; ".join(parts)


def _newest(records: list[dict]) -> dict:
    """The record with the latest date; the later line where dates tie."""
    return sorted(records, key=lambda r: r["date"])[-1]


def _provenance(rec: dict) -> str:
    commit = f" at commit `{rec['commit']}`" if rec.get("commit") else ""
    return f"`{rec['command']}` on {rec['date']}{commit} (`results/{rec['_file']}`)"


def _methods(figs: dict) -> list[str]:
    """The methods a record's figures name, plain (the baseline) first, then in record order."""
    names = list(dict.fromkeys(k.split("/", 1)[0] for k in figs if "/" in k))
    return sorted(names, key=lambda m: m != "plain")


def method_table(figs: dict) -> list[str]:
    """One row per method; a column only where some method has that figure. Plain's speedup
    and τ are 1 by definition (one token per target forward, the baseline) where not recorded."""
    methods = _methods(figs)
    base = {"plain/speedup": 1.0, "plain/tau": 1.0} if "plain" in methods else {}
    figs = {**base, **figs}
    cols = [c for c in COLUMNS if any(f"{m}/{c[1]}" in figs for m in methods)]
    lines = ["| method | " + " | ".join(h for h, _, _ in cols) + " |", "| --- " * (len(cols) + 1) + "|"]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(_cell(figs.get(f"{m}/{k}"), d) for _, k, d in cols) + " |")
    return lines


def category_table(figs: dict) -> list[str]:
    """Rows: the categories of ``<method>/<category>/tau|speedup`` keys; a "τ / ×speedup" column per method."""
    per = [k.split("/") for k in figs if k.count("/") == 2 and k.rsplit("/", 1)[1] in ("tau", "speedup")]
    if not per:
        return []
    methods = [m for m in _methods(figs) if any(p[0] == m for p in per)]
    cats = list(dict.fromkeys(p[1] for p in per))

    def cell(m: str, c: str) -> str:
        tau, speedup = figs.get(f"{m}/{c}/tau"), figs.get(f"{m}/{c}/speedup")
        return f"{_cell(tau, 2)} / " + ("–" if speedup is None else f"×{_cell(speedup, 2)}")

    lines = ["| category: τ / speedup | " + " | ".join(methods) + " |",
             "| --- " * (len(methods) + 1) + "|"]
    lines += [f"| {c} | " + " | ".join(cell(m, c) for m in methods) + " |" for c in cats]
    return lines


def smoke_line(rec: dict, headline_machine: dict) -> str:
    """The newest ``make run`` record in one line: plain's tok/s, each method's speedup and τ;
    its machine spelled out unless the headline's record holds every field of it."""
    figs = rec["figures"]
    parts = []
    for m in _methods(figs):
        if m == "plain":
            if "plain/tok_s" in figs:
                parts.append(f"plain {_cell(figs['plain/tok_s'], 1)} tok/s")
            continue
        speedup, tau = figs.get(f"{m}/speedup"), figs.get(f"{m}/tau")
        parts.append(f"{m} " + ("–" if speedup is None else f"×{_cell(speedup, 2)}")
                     + ("" if tau is None else f" (τ {_cell(tau, 2)})"))
    same = all(headline_machine.get(k) == v for k, v in rec["machine"].items())
    machine = ("same machine" if same
               else f"machine: {_machine_line(rec['machine'])}")
    return f"Smoke test on the built-in pair, {_provenance(rec)}, {machine}: {', '.join(parts)}."


def render(records: list[dict]) -> str:
    """The markdown between the markers: the newest real.jsonl record's tables and machine,
    then the newest ``make run`` record in one line (where there is one)."""
    real = [r for r in records if r["_file"] == "real.jsonl"]
    if not real:
        raise RecordError("no record in results/real.jsonl (experiment=real) to render")
    rec = _newest(real)
    figs = rec["figures"]
    lines = method_table(figs)
    cats = category_table(figs)
    if cats:
        lines += [""] + cats
    lines += ["", f"{_provenance(rec)}.", f"Machine: {_machine_line(rec['machine'])}."]
    if rec.get("setup"):
        lines.append(f"Setup: {rec['setup']}.")
    if rec.get("note"):
        lines.append(f"Note: {rec['note']}.")
    runs = [r for r in records if r["command"].split("|")[0].strip().startswith("make run")]
    if runs:
        lines += ["", smoke_line(_newest(runs), rec["machine"])]
    return "\n".join(lines)


def splice(readme: str, table: str, name: str = "README.md") -> str:
    """``readme`` with the text between the markers replaced by ``table``."""
    if readme.count(START) != 1 or readme.count(END) != 1 or readme.index(START) > readme.index(END):
        raise RecordError(f"{name}: needs one '{START}' followed by one '{END}'")
    head, rest = readme.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the README's tables differ from the records'")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    args = ap.parse_args(argv)
    try:
        current = args.readme.read_text(encoding="utf-8")
        wanted = splice(current, render(load_records(args.results)), str(args.readme))
    except (RecordError, OSError) as e:
        print(f"results_table: {e}", file=sys.stderr)
        return 2
    if args.check:
        if wanted != current:
            print(f"results_table: {args.readme}'s results tables are not what {args.results}/*.jsonl give; "
                  f"run python experiments/results_table.py", file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        args.readme.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
