"""A drafter written as one .py and one .yaml outside the repository runs both
through ``python -m specdec.run method=<its name>`` and through ``LLM(...)``; a
model drafter's costs come from its draft decoder, with no cost code, and a
drafter with weights but no cost fails at build.

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
    assert sorted(p.name for p in files) == ["my_draft.py", "my_draft.yaml", "my_lookup.py", "my_lookup.yaml"]
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


def test_the_guides_model_drafter_is_exact_and_costed_from_its_model(plugin_dir: Path, tiny_llama) -> None:
    # The guide's my_draft defines no cost hook: its T_draft, adaptive γ's draft cost and
    # its catch-up come from the draft decoder it names in its DrafterSpec.
    from my_draft import OneDraftConfig, OneDraftProposer

    from specdec.measure import limit_from, limit_runs, step_shape
    from specdec.spec.proposers import Proposer

    assert all(getattr(OneDraftProposer, h) is getattr(Proposer, h)
               for h in ("draft_cost", "draft_forward_time", "catch_up_cost", "unseen_tokens"))
    target = tiny_llama(vocab=64, seed=0, qk_scale=0.1)
    draft = tiny_llama(vocab=64, seed=0, qk_scale=0.1, perturb=0.02)  # agrees with the target often
    prompts = [[5, 6, 7, 5, 6, 7, 5], [1, 2, 3, 4], [9] * 12]
    rt = RuntimeConfig(max_batch_size=4, max_seq_len=96, block_size=8)
    sp = SamplingParams(max_new_tokens=24)
    plain = [o.token_ids for o in LLM(str(target.path), runtime=rt).generate(prompts, sp)]
    llm = LLM(str(target.path), method=OneDraftConfig(path=str(draft.path), num_speculative_tokens=3), runtime=rt)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == plain
    counts = llm.pipeline.stats().counts
    assert counts.accepted > 0 and len(counts.reached) == 1  # at most one draft a step (γ capped at 1)
    proposer = llm.pipeline.proposer
    assert proposer.draft_cost(2, 16) > 0 and proposer.catch_up_cost(8) > 0
    assert step_shape(llm) == (4, 1.0, 1)  # one forward, one draft a step
    rounds = {k: [r.fn()] for k, r in limit_runs({"my_draft": llm}, 16, chunks=1, repeats=2).items()}
    bare = limit_from(rounds, {"my_draft": llm})["my_draft"]
    assert bare.t_draft_1 > 0 and bare.step_s(1.0) > bare.t_target_1


def test_a_drafter_with_weights_and_no_cost_fails_at_build(tiny_llama) -> None:
    # Weights that are no DrafterSpec.model and no timer of its own: its drafting would
    # cost 0 in the limit and adaptive γ. The build stops, naming the drafter.
    from dataclasses import dataclass

    import torch

    from specdec.spec.proposers import Drafter, Proposer, ProposerConfig, register_proposer

    @dataclass(frozen=True)
    class HeadConfig(ProposerConfig):
        pass

    class HeadDrafter(Drafter):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(4, 4)

    @register_proposer("uncosted_test", HeadConfig)
    class HeadProposer(Proposer):
        def __init__(self, config: HeadConfig, deps) -> None:
            self.drafter = HeadDrafter()

    target = tiny_llama(vocab=64, seed=0)
    with pytest.raises(TypeError, match=r"drafter 'uncosted_test' declares no cost: its HeadDrafter has weights"):
        LLM(str(target.path), method=HeadConfig(num_speculative_tokens=2),
            runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64, block_size=8))


def test_a_spec_flag_set_on_the_class_is_refused() -> None:
    # The old way (drafts_after_verify = True on the class) would shadow the spec silently.
    from specdec.spec.proposers import Proposer

    with pytest.raises(TypeError, match=r"sets drafts_after_verify on the class; return them from drafter_spec"):
        type("OldStyle", (Proposer,), {"drafts_after_verify": True})
