"""The README's results table is generated from results/*.jsonl, and every record carries its machine."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("results_table", ROOT / "experiments" / "results_table.py")
results_table = importlib.util.module_from_spec(_spec)
sys.modules["results_table"] = results_table
_spec.loader.exec_module(results_table)

MACHINE = {"cpu": "Test CPU", "cores": 2, "torch": "2.13.0+cpu"}


def _record(**over):
    rec = {"date": "2026-01-01 00:00 UTC", "commit": "abc1234", "command": "make run", "machine": MACHINE,
           "figures": {"plain/tok_s": 100.0, "plain/speedup": 1.0, "plain/tau": 1.0,
                       "ngram/tok_s": 150.0, "ngram/speedup": 1.5, "ngram/tau": 2.5, "ngram/alpha": 0.5,
                       "ngram/limit": 1.6, "ngram/efficiency": 0.94, "ngram/equal": True},
           "note": "a test record"}
    rec.update(over)
    return rec


def _write(path: Path, records) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def test_readme_table_is_what_the_records_give():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = results_table.render(results_table.load_records(ROOT / "results"))
    assert results_table.splice(readme, table) == readme
    assert results_table.main(["--check"]) == 0


def test_check_fails_on_a_hand_edited_table_and_the_generator_restores_it(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    _write(results / "make_run.jsonl", [_record(date="2025-12-31 00:00 UTC", figures={"plain/tok_s": 1.0}),
                                        _record()])
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results:start -->\n<!-- results:end -->\nrest\n")
    args = ["--readme", str(readme), "--results", str(results)]
    assert results_table.main(args + ["--check"]) == 1  # empty table
    assert results_table.main(args) == 0
    text = readme.read_text()
    assert "| ngram | 150.0 | 1.50 | 2.50 | 0.500 | 1.60 | 0.94 | yes |" in text  # the newest make run record
    assert "| plain | 100.0 | 1.00 | 1.00 | – | – | – | – |" in text
    assert "Test CPU, 2 cores" in text and text.startswith("intro\n") and text.endswith("rest\n")
    assert results_table.main(args + ["--check"]) == 0
    readme.write_text(text.replace("150.0", "160.0"))
    capsys.readouterr()
    assert results_table.main(args + ["--check"]) == 1
    assert "results table is not what" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [{"machine": None}, "no machine key", {"machine": {"cpu": "x", "cores": 2}}])
def test_a_record_without_its_machine_is_refused_naming_file_and_line(tmp_path, capsys, bad):
    results = tmp_path / "results"
    results.mkdir()
    if bad == "no machine key":
        rec = _record()
        del rec["machine"]
    else:
        rec = _record(**bad)
    _write(results / "bench.jsonl", [_record(), rec])
    with pytest.raises(results_table.RecordError, match=r"bench\.jsonl:2: .*machine"):
        results_table.load_records(results)
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results:start -->\n<!-- results:end -->\n")
    before = readme.read_text()
    assert results_table.main(["--readme", str(readme), "--results", str(results)]) == 2
    assert "bench.jsonl:2" in capsys.readouterr().err
    assert readme.read_text() == before


def test_bad_json_and_missing_markers_are_named(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    _write(results / "x.jsonl", [_record(), "{not json"])
    with pytest.raises(results_table.RecordError, match=r"x\.jsonl:2: not JSON"):
        results_table.load_records(results)
    with pytest.raises(results_table.RecordError, match=r"NOTES\.md: needs one"):
        results_table.splice("no markers here", "table", "NOTES.md")
