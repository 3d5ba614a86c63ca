"""A drafter written as one .py and one .yaml outside the repository runs both
through ``python -m specdec.run method=<its name>`` and through ``LLM(...)``.

The two files are taken from docs/adding-a-drafter.md (each fenced block whose
first line is ``# <path>``), so the guide's example is what is tested.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.api import LLM
from specdec.conf_schema import ZOO_DIR
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "adding-a-drafter.md"


def _write_guide_files(root: Path) -> list[Path]:
    """Writes every ``# <path>``-headed code block of the guide under ``root``."""
    written = []
    for body in re.findall(r"```(?:python|yaml)\n(.*?)```", GUIDE.read_text(), flags=re.S):
        first, _, rest = body.partition("\n")
        m = re.fullmatch(r"# (\S+\.(?:py|yaml))", first.strip())
        if m:
            path = root / m.group(1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(rest if m.group(1).endswith(".py") else body)
            written.append(path)
    return written


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    files = _write_guide_files(tmp_path)
    assert sorted(p.name for p in files) == ["my_lookup.py", "my_lookup.yaml"]
    assert not str(tmp_path).startswith(str(GUIDE.parents[1]))  # outside the repository
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_the_guides_drafter_runs_through_llm_exactly(plugin_dir: Path, tiny_llama) -> None:
    from my_lookup import LookupConfig  # registers "my_lookup"

    target = tiny_llama(vocab=64, seed=0, qk_scale=0.1)  # loopy output: lookups find something
    prompts = [[5, 6, 7, 5, 6, 7, 5], [1, 2, 3, 4], [9] * 12]
    rt = RuntimeConfig(max_batch_size=4, max_seq_len=96, block_size=8)
    sp = SamplingParams(max_new_tokens=24)
    plain = [o.token_ids for o in LLM(str(target.path), runtime=rt).generate(prompts, sp)]
    llm = LLM(str(target.path), method=LookupConfig(num_speculative_tokens=3, window=32), runtime=rt)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == plain
    counts = llm.pipeline.stats().counts
    assert counts.proposed > 0 and counts.accepted > 0


def test_the_guides_drafter_runs_from_the_command_line(plugin_dir: Path, tmp_path: Path) -> None:
    if not (ZOO_DIR / "code-target" / "model.safetensors").is_file():
        pytest.skip("the built-in pair is not shipped in this checkout")
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")]),
           "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "specdec.run", "method=my_lookup", "experiment=quick",
           f"hydra.searchpath=[file://{plugin_dir / 'my_conf'}]", "method.my_lookup.window=64",
           "data.limit=2", f"run_dir={run_dir}", "plots=false"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    m = summary["methods"]["my_lookup"]
    assert m["outputs_equal"] is True and m["proposed"] > 0
    assert summary["methods_config"]["my_lookup"]["window"] == 64
