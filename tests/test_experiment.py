"""End to end: the real composed config, two random tiny Llama checkpoints, a tmp prompt file.

Checks the files a run writes (results.jsonl, summary.json, plots, the offline
W&B run), that greedy speculation reproduces plain decoding, that an
interrupted run resumes without redoing or losing requests, and that prompt
files in Spec-Bench's layout load.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdec.conf_schema import config_dir
from specdec.data import DataConfig, PromptDataError, load_prompts
from specdec.experiment import ExperimentError, run_experiment

VOCAB = 128
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return ",
    "for i in range(10):\n    print(i)\nfor j in range(",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "import os\nimport sys\nimport json\nimport ",
]


def _tokenizer_json() -> str:
    """A character-level tokenizer (WordLevel over printable ASCII) with < VOCAB tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = ["<unk>", *sorted(set(string.printable))]
    tok = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok.to_str()


def _tiny_llama(path: Path, *, layers: int, seed: int, noise: float = 0.0) -> Path:
    """A random tiny Llama; ``noise`` > 0 perturbs every weight (a draft that agrees often, not always)."""
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = transformers.LlamaConfig(  # max_position_embeddings: room for runtime.max_seq_len's default
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3, max_position_embeddings=1024,
        eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    if noise:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(_tokenizer_json())
    return path


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("tiny_pair")
    target = _tiny_llama(root / "target", layers=2, seed=0)
    draft = _tiny_llama(root / "draft", layers=2, seed=0, noise=0.03)  # the target, perturbed
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p, "source": "test"}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    return target, draft, prompts


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("run", overrides=overrides)


def _overrides(tiny_pair: tuple[Path, Path, Path], run_dir: Path, *extra: str) -> list[str]:
    target, draft, prompts = tiny_pair
    return [
        f"target.path={target}",
        f"draft.path={draft}",
        "data=jsonl",
        f"data.path={prompts}",
        "sampling.max_new_tokens=8",
        "method.num_speculative_tokens=3",
        "runtime.max_seq_len=128",
        f"run_dir={run_dir}",
        "progress=false",
        "runtime.threads=1",
        # the tiny pair's methods (the default list also has heads shipped for the built-in target only)
        *([] if any(e.startswith("method=") for e in extra) else ["method=[draft_model,ngram]"]),
        *extra,
    ]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_end_to_end_files_wandb_and_resume(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    run_dir = tmp_path / "run"
    summary = run_experiment(_compose(_overrides(tiny_pair, run_dir, "logger=wandb", "logger.mode=offline")))

    # --- files -------------------------------------------------------------------------
    recs = _lines(run_dir / "results.jsonl")
    assert [r["id"] for r in recs] == ["p0", "p1", "p2", "p3"]
    for r in recs:
        assert r["prompt_len"] == len(PROMPTS[int(r["id"][1:])])  # one token per character
        assert r["plain"]["output_len"] == 8
        assert set(r["methods"]) == {"draft_model", "ngram"}
        for e in r["methods"].values():
            assert e["output_len"] == 8 and e["gamma"] == 3
            assert e["equal_to_plain"] is True  # greedy: lossless
            assert 0 <= e["accepted"] <= e["proposed"]
            assert e["tau"] == pytest.approx((e["accepted"] + e["bonus"]) / e["steps"])
            assert e["time_s"] > 0
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["complete"] and on_disk["num_requests"] == 4
    for name in ("draft_model", "ngram"):
        m = on_disk["methods"][name]
        for key in ("tau", "alpha", "speedup", "outputs_equal", "per_position_acceptance", "tokens_per_s"):
            assert key in m, key
        assert m["outputs_equal"] is True
        assert m["tokens"] == 32 and m["speedup"] > 0
        assert 1.0 <= m["tau"] <= 4.0 and 0.0 <= m["alpha"] <= 1.0
        assert sum(m["accepted_hist"]) == m["steps"]
        # The step-time breakdown: every phase counted, the target's forward and (draft model) a catch-up in it.
        ph = m["step_time_ms"]
        assert min(ph.values()) >= 0 and ph["target_forward"] > 0 and 0 < m["step_time_accounted"] <= 1
        assert (ph["draft_catch_up"] > 0) == (name == "draft_model")
    dm = on_disk["methods"]["draft_model"]
    assert 0 < dm["alpha"] < 1 and dm["tau"] > 1  # the perturbed target: some drafts kept, some not
    assert len(dm["per_position_acceptance"]) == 3
    assert on_disk["outputs_equal"] is True and summary["outputs_equal"] is True
    assert on_disk["methods"]["draft_model"]["first_mismatch"] is None
    machine = on_disk["machine"]  # what the figures were measured on (tests/test_machine_record.py)
    assert machine["cpu"] and machine["cores"] >= 1 and machine["python"] and machine["os"]
    assert machine["device"] == "cpu" and machine["gpu"] is None and machine["torch_build"]
    assert machine["git"] is None or len(machine["git"]["commit"]) == 40
    for png in ("acceptance_per_position", "tau_speedup", "accepted_hist"):
        assert (run_dir / "plots" / f"{png}.png").stat().st_size > 1000
    assert "draft_model" in (run_dir / "summary.txt").read_text()
    assert "step time (ms per speculative step" in (run_dir / "summary.txt").read_text()
    offline = list((tmp_path / "wandb_dir").rglob("offline-run-*"))
    assert offline and any(p.is_dir() for p in offline), "no offline W&B run directory"

    # --- a second start without resume refuses to overwrite ---------------------------------
    with pytest.raises(ExperimentError, match="resume"):
        run_experiment(_compose(_overrides(tiny_pair, run_dir, "logger=none")))

    # --- interruption: keep 2 complete lines and half a third, then resume -----------------
    lines = (run_dir / "results.jsonl").read_text().splitlines()
    (run_dir / "results.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:40])
    before = {r["id"]: r for r in _lines_safe(run_dir / "results.jsonl")}
    assert set(before) == {"p0", "p1"}
    resumed = run_experiment(_compose(_overrides(tiny_pair, run_dir, "logger=none", f"resume_dir={run_dir}")))
    after = _lines(run_dir / "results.jsonl")
    ids = [r["id"] for r in after]
    assert sorted(ids) == ["p0", "p1", "p2", "p3"] and len(ids) == len(set(ids))
    by_id = {r["id"]: r for r in after}
    for rid in ("p0", "p1"):  # not regenerated
        assert by_id[rid]["completed_at"] == before[rid]["completed_at"]
        assert by_id[rid] == before[rid]
    assert by_id["p2"]["completed_at"] > before["p1"]["completed_at"]
    assert resumed["num_requests"] == 4 and resumed["complete"]
    assert resumed["methods"]["ngram"]["tokens"] == 32
    # same tokens as the uninterrupted run (greedy): figures recomputed over all requests
    assert resumed["methods"]["draft_model"]["accepted"] == summary["methods"]["draft_model"]["accepted"]

    # --- resuming with a config that changes results is refused, naming the key ------------
    with pytest.raises(ExperimentError, match="method.num_speculative_tokens"):
        run_experiment(_compose(_overrides(tiny_pair, run_dir, "logger=none", f"resume_dir={run_dir}",
                                           "method.num_speculative_tokens=2")))


def _lines_safe(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def test_limit_then_resume_extends_batched_sampled_run(tiny_pair, tmp_path, monkeypatch, caplog):
    """A run limited to 2 prompts, resumed without the limit, batch of 2, sampling, one method;
    W&B fails at init: the run goes on and says so once."""
    wandb = pytest.importorskip("wandb")

    def broken_init(*args, **kwargs):
        raise RuntimeError("network unreachable")

    monkeypatch.setattr(wandb, "init", broken_init)
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    extra = ("method=ngram", "sampling=sample", "batch_size=2", "plots=false", "warmup=0")
    with caplog.at_level("WARNING"):
        s1 = run_experiment(_compose(_overrides(tiny_pair, run_dir, *extra, "logger=wandb", "data.limit=2")))
    warnings = [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()]
    assert len(warnings) == 1 and "network unreachable" in warnings[0]
    extra = (*extra, "logger=none")
    assert s1["num_requests"] == 2 and s1["complete"]
    assert set(s1["methods"]) == {"ngram"} and s1["methods"]["ngram"]["outputs_equal"] is None  # sampled
    first = {r["id"]: r["completed_at"] for r in _lines(run_dir / "results.jsonl")}
    s2 = run_experiment(_compose(_overrides(tiny_pair, run_dir, *extra, "resume=true")))
    recs = _lines(run_dir / "results.jsonl")
    assert [r["id"] for r in recs] == ["p0", "p1", "p2", "p3"]
    assert all(r["batch_size"] == 2 for r in recs)
    assert {r["id"]: r["completed_at"] for r in recs[:2]} == first
    assert s2["num_requests"] == 4 and s2["methods"]["ngram"]["requests"] == 4


def test_spec_bench_question_jsonl_loads(tmp_path):
    f = tmp_path / "question.jsonl"
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Compose a travel blog post.", "Rewrite it."]},
        {"question_id": 82, "category": "math", "turns": ["What is 2+2?"]},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    auto = load_prompts(DataConfig(path=str(f)))
    assert [(p.id, p.text, p.source) for p in auto] == [
        ("81", "Compose a travel blog post.", "writing"), ("82", "What is 2+2?", "math")]
    cfg = _compose(["data=spec_bench", f"data.path={f}"])
    from specdec.conf_schema import build_components, to_run_config

    explicit = load_prompts(build_components(to_run_config(cfg)).data)
    assert [p.text for p in explicit] == [p.text for p in auto]
    with pytest.raises(PromptDataError, match="has 1 turns"):  # question 82 has no second turn
        load_prompts(DataConfig(path=str(f), text_field="turns", turn=1))
    assert [p.text for p in load_prompts(DataConfig(path=str(f), turn=1, limit=1))] == ["Rewrite it."]


def test_builtin_prompts_load():
    from specdec.conf_schema import build_components, to_run_config

    prompts = load_prompts(build_components(to_run_config(_compose([]))).data)
    assert len(prompts) >= 4 and all(p.text and p.id for p in prompts)


def test_cli_multirun_sweep_dirs_and_sweep_plots(tiny_pair, tmp_path):
    """``python -m specdec.run -m ...``: one dir per job, never colliding, and the sweep plots."""
    import os
    import subprocess
    import sys

    target, draft, prompts = tiny_pair
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "specdec.run", "-m", f"target.path={target}", "data=jsonl", f"data.path={prompts}",
           "data.limit=1", "method=ngram", "method.num_speculative_tokens=1,2", "sampling.max_new_tokens=4",
           "logger=none", "warmup=0", "progress=false", "runtime.threads=1", "name=sweep",
           f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summaries = sorted((tmp_path / "sweep").glob("*/summary.json"))
    assert [p.parent.name for p in summaries] == ["0", "1"]
    gammas = [json.loads(p.read_text())["methods"]["ngram"]["gamma"] for p in summaries]
    assert gammas == [1, 2]
    assert (tmp_path / "sweep" / "sweep_tau_speedup.png").is_file()
    assert "ngram" in (tmp_path / "sweep" / "sweep_summary.txt").read_text()
