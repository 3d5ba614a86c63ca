"""One JSON of a ``gpu.sh`` run: each step's status, its closing JSON line, and the device record.

    python experiments/bench/gpu_summary.py OUT_DIR [STEP ...] > OUT_DIR/summary.json

``gpu.sh`` leaves, per step ``NAME``, ``NAME.log`` (its output) and ``NAME.rc`` (``<exit status>
<seconds>``, or ``skip <seconds>`` with the reason in the log). A step's ``status`` is ``ok``
(exit 0), ``timeout`` (124 or 137: ``timeout`` stopped it), ``failed`` (any other status),
``skipped``, or ``missing`` (no ``.rc``: the script died before the step ended). ``json``: the
last line of its log that parses as a JSON object (a benchmark's closing line), else null;
``last_line``: its log's last line (pytest's count of passed and failed tests).
The step named ``device`` is the device record (``machine_record``): it becomes ``device``.
Standard library only, so it summarises whatever the steps left, even a broken environment.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TAIL_LINES = 15  # of a step that did not succeed, so the summary shows why


def last_json(lines: list[str]) -> dict[str, Any] | None:
    """The last line of ``lines`` that is a JSON object, or None."""
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


def step_record(out: Path, name: str) -> dict[str, Any]:
    """What step ``name`` left in ``out`` (module doc)."""
    log = out / f"{name}.log"
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    rc_file = out / f"{name}.rc"
    rc: int | None = None
    seconds: float | None = None
    if not rc_file.is_file():
        status = "missing"
    else:
        fields = rc_file.read_text().split()
        try:
            seconds = float(fields[1]) if len(fields) > 1 else None
        except ValueError:
            seconds = None
        if fields and fields[0] == "skip":
            status = "skipped"
        else:
            try:
                rc = int(fields[0])
                status = "ok" if rc == 0 else "timeout" if rc in (124, 137) else "failed"
            except (IndexError, ValueError):
                status = "missing"
    last = next((line.strip() for line in reversed(lines) if line.strip()), None)
    rec: dict[str, Any] = {"status": status, "rc": rc, "seconds": seconds, "json": last_json(lines), "last_line": last}
    if status != "ok":
        rec["tail"] = lines[-TAIL_LINES:]
    return rec


def summarise(out: Path, steps: list[str]) -> dict[str, Any]:
    """The summary of the steps ``steps`` (default: every ``*.rc`` or ``*.log`` in ``out``, by name)."""
    if not steps:
        steps = sorted({p.stem for p in out.glob("*.rc")} | {p.stem for p in out.glob("*.log")})
    records = {name: step_record(out, name) for name in steps}
    device = records.get("device", {}).get("json")
    bad = [n for n, r in records.items() if r["status"] not in ("ok", "skipped")]
    return {"ok": not bad, "failed": bad, "skipped": [n for n, r in records.items() if r["status"] == "skipped"],
            "device": device, "steps": records}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    if not out.is_dir():
        print(f"gpu_summary: {out} is not a directory of step logs", file=sys.stderr)
        return 2
    print(json.dumps(summarise(out, argv[1:]), indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
