"""The README's results tables are generated from results/*.jsonl, and every record carries its machine."""

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
    """A ``make run`` record (the built-in pair)."""
    rec = {"date": "2026-01-01 00:00 UTC", "commit": "abc1234", "command": "make run", "machine": MACHINE,
           "figures": {"plain/tok_s": 100.0, "plain/speedup": 1.0, "plain/tau": 1.0,
                       "ngram/tok_s": 150.0, "ngram/speedup": 1.5, "ngram/tau": 2.5, "ngram/alpha": 0.5,
                       "ngram/limit": 1.6, "ngram/efficiency": 0.94, "ngram/equal": True},
           "note": "a test record"}
    rec.update(over)
    return rec


def _real(**over):
    """An ``experiment=real`` record: methods and categories as its keys name them, plain listed last."""
    figs = {"ngram/speedup": 1.24, "ngram/tau": 1.72, "ngram/equal": True, "ngram/efficiency": 0.93,
            "eagle3_tree/speedup": 0.8, "eagle3_tree/tau": 2.1, "eagle3_tree/equal": False,
            "ngram/mt_bench/tau": 1.56, "ngram/mt_bench/speedup": 1.25, "ngram/rag/tau": 1.96,
            "ngram/rag/speedup": 1.22, "eagle3_tree/mt_bench/tau": 2.0, "eagle3_tree/mt_bench/speedup": 0.75,
            "eagle3_tree/rag/tau": 2.2, "plain/tok_s": 59.0}
    rec = {"date": "2026-01-02 00:00 UTC", "commit": "def5678", "machine": {**MACHINE, "blas": "MKL"},
           "command": "python -m specdec.run experiment=real", "setup": "Spec-Bench, batch 1", "figures": figs}
    rec.update(over)
    return rec


def _write(path: Path, records) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def _dirs(tmp_path: Path, readme_text: str = "<!-- results:start -->\n<!-- results:end -->\n"):
    """An empty results dir and a README holding only the markers: (results, readme, CLI args)."""
    results, readme = tmp_path / "results", tmp_path / "README.md"
    results.mkdir()
    readme.write_text(readme_text)
    return results, readme, ["--readme", str(readme), "--results", str(results)]


def test_readme_table_is_what_the_records_give():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = results_table.render(results_table.load_records(ROOT / "results"))
    assert results_table.splice(readme, table) == readme
    assert results_table.main(["--check"]) == 0


def test_the_newest_real_record_is_the_headline_and_make_run_a_smoke_line(tmp_path, capsys):
    results, readme, args = _dirs(tmp_path, "intro\n<!-- results:start -->\n<!-- results:end -->\nrest\n")
    _write(results / "real.jsonl", [_real(date="2026-01-03 00:00 UTC", figures={"other/tau": 9.0}),
                                    _real(date="2026-01-04 00:00 UTC")])  # the newest is the later date
    _write(results / "make_run.jsonl", [_record(date="2025-12-31 00:00 UTC", figures={"plain/tok_s": 1.0}),
                                        _record()])
    assert results_table.main(args + ["--check"]) == 1  # empty block
    assert results_table.main(args) == 0
    text = readme.read_text()
    block = text.split("<!-- results:start -->\n")[1].split("\n<!-- results:end -->")[0].splitlines()
    # plain first; a column only where some method has the figure (no α, no limit here)
    assert block[:5] == ["| method | tok/s | speedup | τ | efficiency | equal |",
                         "| --- | --- | --- | --- | --- | --- |",
                         "| plain | 59.0 | 1.00 | 1.00 | – | – |",
                         "| ngram | – | 1.24 | 1.72 | 0.93 | yes |",
                         "| eagle3_tree | – | 0.80 | 2.10 | – | no |"]
    assert block[6:10] == ["| category: τ / speedup | ngram | eagle3_tree |", "| --- | --- | --- |",
                           "| mt_bench | 1.56 / ×1.25 | 2.00 / ×0.75 |", "| rag | 1.96 / ×1.22 | 2.20 / – |"]
    assert "`python -m specdec.run experiment=real` on 2026-01-04 00:00 UTC at commit `def5678`" in text
    assert "Test CPU, 2 cores; torch 2.13.0+cpu; blas MKL" in text and "Setup: Spec-Bench, batch 1." in text
    assert "other" not in text  # the older real record is not shown
    assert block[-1].startswith("Smoke test on the built-in pair, `make run` on 2026-01-01")
    assert "same machine: plain 100.0 tok/s, ngram ×1.50 (τ 2.50)." in block[-1]
    assert text.startswith("intro\n") and text.endswith("rest\n")
    assert results_table.main(args + ["--check"]) == 0


def test_check_fails_on_a_stale_or_hand_edited_readme(tmp_path, capsys):
    results, readme, args = _dirs(tmp_path)
    _write(results / "real.jsonl", [_real()])
    assert results_table.main(args) == 0 and results_table.main(args + ["--check"]) == 0
    text = readme.read_text()
    readme.write_text(text.replace("1.24", "1.42"))  # a hand-edited figure
    capsys.readouterr()
    assert results_table.main(args + ["--check"]) == 1
    assert "results tables are not what" in capsys.readouterr().err
    readme.write_text(text)
    _write(results / "real.jsonl", [_real(), _real(date="2026-02-01 00:00 UTC",
                                                   figures={**_real()["figures"], "medusa/speedup": 1.1})])
    assert results_table.main(args + ["--check"]) == 1  # a newer record with another method: stale
    assert results_table.main(args) == 0 and "| medusa | – | 1.10 |" in readme.read_text()


def test_no_real_record_is_named(tmp_path, capsys):
    results, readme, args = _dirs(tmp_path)
    _write(results / "make_run.jsonl", [_record()])
    assert results_table.main(args + ["--check"]) == 2
    assert "results/real.jsonl" in capsys.readouterr().err


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
