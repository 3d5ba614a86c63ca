"""Render README.md's results table from the measurement records in results/*.jsonl.

Each line of a results file is one measurement: ``date`` ("YYYY-MM-DD …"),
``commit``, ``command``, ``machine`` (CPU, cores, torch …), ``figures`` and a
one-line ``note`` (format: results/README.md). The README shows the newest
``make run`` record as a table, its machine record under it, between
``<!-- results:start -->`` and ``<!-- results:end -->``; figures are never
typed into the README by hand.

    python experiments/results_table.py           # rewrite the README's table
    python experiments/results_table.py --check   # exit 1 if the README's table is not the records'

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


def render(records: list[dict]) -> str:
    """The markdown between the markers: the newest ``make run`` record's table and its machine."""
    runs = [r for r in records if r["command"].split("|")[0].strip().startswith("make run")]
    if not runs:
        raise RecordError("no 'make run' record in results/*.jsonl to render")
    rec = max(runs, key=lambda r: r["date"])
    figs = rec["figures"]
    methods = list(dict.fromkeys(k.split("/", 1)[0] for k in figs if "/" in k))
    lines = ["| method | " + " | ".join(h for h, _, _ in COLUMNS) + " |",
             "| --- " * (len(COLUMNS) + 1) + "|"]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(_cell(figs.get(f"{m}/{k}"), d) for _, k, d in COLUMNS) + " |")
    commit = f" at commit `{rec['commit']}`" if rec.get("commit") else ""
    lines += ["", f"`{rec['command']}` on {rec['date']}{commit} (`results/{rec['_file']}`).",
              f"Machine: {_machine_line(rec['machine'])}."]
    if rec.get("setup"):
        lines.append(f"Setup: {rec['setup']}.")
    if rec.get("note"):
        lines.append(f"Note: {rec['note']}.")
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
    ap.add_argument("--check", action="store_true", help="exit 1 if the README's table differs from the records'")
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
            print(f"results_table: {args.readme}'s results table is not what {args.results}/*.jsonl give; "
                  f"run python experiments/results_table.py", file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        args.readme.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
