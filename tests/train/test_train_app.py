"""``python -m specdec.train``: the three recipes on a tiny random target and a tiny corpus.

A few steps each: the loss is finite and recorded, an interrupted run resumes
to the same weights as an uninterrupted one, the output loads through the
framework's loader with the right config, and the manifest records it all.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from specdec.train import lm

REPO = Path(__file__).resolve().parents[2]
CODE = '''def add_{i}(a, b):
    """Return the sum of a and b plus {i}."""
    total = a + b + {i}
    if total > 10:
        return total - 1
    return total


class Thing{i}:
    def __init__(self, value):
        self.value = value

    def double(self):
        return self.value * 2

'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A corpus dir of small .py files and a tiny random 4-layer target with a tokenizer trained on it."""
    from specdec.train.export import save_hf
    from specdec.train.tokenizer import EOS_TOKEN, train_tokenizer

    root = tmp_path_factory.mktemp("tiny-train")
    corpus = root / "corpus"
    corpus.mkdir()
    for f in range(6):
        (corpus / f"mod{f}.py").write_text("".join(CODE.format(i=f * 10 + i) for i in range(4)))
    texts = [p.read_text() for p in sorted(corpus.glob("*.py"))]
    tok = train_tokenizer(texts, vocab_size=300)
    eos = tok.token_to_id(EOS_TOKEN)
    spec = lm.ModelSpec(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=256)
    cfg = spec.config(tok.get_vocab_size(with_added_tokens=True), eos, eos)
    target = lm.build_model(cfg, seed=3)
    with torch.no_grad():  # a less flat random target: its argmax is decided by the model
        target.model.embed_tokens.weight.mul_(20)
    save_hf(target, tok, root / "target")
    draft = lm.build_model(dataclasses.replace(cfg, num_hidden_layers=1), seed=4)
    save_hf(draft, tok, root / "draft")
    return {"root": root, "corpus": corpus, "target": root / "target", "draft": root / "draft"}


def overrides(tiny: dict[str, Path], recipe: str, run_dir: Path, *extra: str) -> list[str]:
    return [f"train={recipe}", f"target.path={tiny['target']}", f"data.corpus={tiny['corpus']}", "data.held_out_modulus=3",
            "data.chunk_windows=4", "train.steps=6", "train.batch_size=2", "train.seq_len=32", "train.warmup_steps=2",
            "train.lr=3e-3", "eval.prompts=2", "eval.prompt_len=16", "eval.new_tokens=8", "eval.loss_windows=2",
            "eval.every=3", "checkpoint_every=2", "logger=none", "progress=false", "threads=1",
            f"run_dir={run_dir}", *extra]


def compose(args: list[str]) -> Any:
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    from specdec.conf_schema import config_dir
    from specdec.train.config import register_schema

    register_schema()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return hcompose(config_name="train", overrides=args)


def run(args: list[str]) -> dict[str, Any]:
    from specdec.train.app import train
    from specdec.train.config import to_train_config

    cfg = to_train_config(compose(args))
    return train(cfg, cfg.run_dir)


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("recipe", ["eagle3", "eagle", "draft_model"])
def test_recipe_resumes_to_the_uninterrupted_result_and_loads(tiny: dict[str, Path], tmp_path: Path,
                                                              recipe: str) -> None:
    from specdec.core.checkpoint import load_decoder
    from specdec.core.registry import Role
    from specdec.train.app import STATE_FILE, Stopped
    from specdec.train.state import read_state

    extra = ["train.ttt_steps=3", "train.draft_vocab_size=200", "train.aux_layers=[0,1,3]"] if recipe == "eagle3" else []
    if recipe == "eagle":
        extra = ["train.feature_noise=0.1"]  # noise from a saved generator: resume must restore it
    # uninterrupted
    whole = run(overrides(tiny, recipe, tmp_path / "whole", *extra))
    # interrupted after 3 steps, then resumed
    part_dir = tmp_path / "part"
    with pytest.raises(Stopped):
        run(overrides(tiny, recipe, part_dir, "stop_after=3", *extra))
    saved = read_state(part_dir / STATE_FILE)
    assert saved["step"] == 3 and len(saved["history"]["train"]) == 3
    resumed = run(overrides(tiny, recipe, part_dir, "resume=true", *extra))
    a, b = weights(tmp_path / "whole" / "out"), weights(part_dir / "out")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert whole["losses"]["eval"] == resumed["losses"]["eval"]  # held-out loss and τ at steps 0, 3, 6
    assert whole["losses"]["curve"] == resumed["losses"]["curve"]
    train_rows = resumed["losses"]["curve"]
    assert len(train_rows) >= 1 and all(torch.isfinite(torch.tensor(l)) for _, l in train_rows)
    assert resumed["steps"] == 6 and whole["losses"]["first"]["loss"] >= 0
    assert [r["step"] for r in whole["losses"]["eval"]] == [0, 3, 6]
    # the manifest: files with their hashes, split, figures
    out = part_dir / "out"
    m = json.loads((out / "manifest.json").read_text())
    assert m["recipe"] == recipe and m["seed"] == 0 and m["steps"] == 6
    assert set(m["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert m["data"]["train_files"] + m["data"]["held_out_files"] == 6 and m["data"]["held_out_files"] >= 1
    assert 1.0 <= m["heldout"]["shipped"]["tau"] <= 5.0
    # it loads through the framework's loader
    if recipe == "draft_model":
        ld = load_decoder(out)
        assert ld.config.num_hidden_layers == 2
        return
    ld = load_decoder(out, role=Role.DRAFT_HEAD)
    cfg = ld.config
    assert cfg.kind == recipe and cfg.hidden_size == 32
    if recipe == "eagle3":
        assert cfg.num_draft_vocab == 200 and cfg.fused_layers(4) == (0, 1, 3)
        assert int(ld.module.t2d.sum()) == 200
    else:
        assert cfg.fc_bias and "fc.bias" in weights(out)


def test_eagle3_loss_goes_down_and_the_simulation_is_exact(tiny: dict[str, Path], tmp_path: Path) -> None:
    """More steps at a high learning rate: the training loss falls. The simulated τ equals a
    step-by-step chain drafted with the head's own argmax tokens."""
    from specdec.train.app import train
    from specdec.train.config import to_train_config
    from specdec.train.data import chain_tau

    args = overrides(tiny, "eagle3", tmp_path / "r", "train.steps=30", "eval.every=0", "train.ttt_steps=2",
                     "checkpoint_every=0", "train.lr=1e-2")
    cfg = to_train_config(compose(args))
    m = train(cfg, cfg.run_dir)
    losses = [r[1] for r in m["losses"]["curve"]]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    # Exactness of the unrolled simulation: redo one chain by hand with the loaded head.
    from specdec.core.checkpoint import load_decoder
    from specdec.core.registry import Role
    from specdec.train.data import TargetFeatures
    from specdec.train.eagle import unrolled

    target = load_decoder(tiny["target"]).module
    head = load_decoder(tmp_path / "r" / "out", role=Role.DRAFT_HEAD).module
    head.attach_target(target.model.embed_tokens, target.lm_head)
    head.prepare_for_inference()
    seq = torch.randint(3, 250, (1, 20), generator=torch.Generator().manual_seed(0))
    aux_ids = head.config.fused_layers(4)
    b, s = seq.shape
    feats = TargetFeatures(target, aux_ids).run(seq)  # what training reads: final norm, fused layers' inputs
    gamma = 3
    hs = unrolled(head, feats, gamma)
    # by hand: root r, step 0 over positions 0..r (dense causal), then steps 1..γ-1 one row at a time
    r = 10
    prefix = head.forward_dense(seq[:, 1 : r + 2], head.project(feats.hidden[:, : r + 1], feats.aux[:, : r + 1]))
    assert torch.allclose(prefix[0, r], hs[0][0, r], atol=1e-5)
    # steps > 0: attention over step-0 keys 0..r and the chain's own keys, fed the true next tokens
    from specdec.train.eagle import UnrolledAttend

    att = UnrolledAttend(1, s - 1)
    x = head.project(feats.hidden[:, : s - 1], feats.aux[:, : s - 1]).reshape(s - 1, -1)
    inp = seq[0, 1:]
    c2, s2 = head.rope_for(torch.arange(s - 1))
    outs = []
    for _ in range(gamma):
        y = head.step(inp, x, c2, s2, att)
        outs.append(y)
        x = torch.nn.functional.pad(y, (0, 0, 1, 0))[: s - 1]
    for k in range(gamma):
        assert torch.allclose(outs[k], hs[k][0], atol=1e-5)
    # chain_tau: all drafts right -> γ + 1 tokens per step
    ok = torch.ones(40, gamma, dtype=torch.bool)
    res = chain_tau(ok, 10, gamma)
    assert res["tokens"] == 40 - 10 and res["steps"] == 30 // (gamma + 1) + (1 if 30 % (gamma + 1) else 0)


def test_command_line_trains_stops_and_resumes(tiny: dict[str, Path], tmp_path: Path) -> None:
    """``python -m specdec.train train=eagle3 …`` end to end, as a user runs it."""
    run_dir = tmp_path / "cli"
    args = overrides(tiny, "eagle3", run_dir, "train.aux_layers=[0,1,3]")
    args = [a for a in args if not a.startswith("run_dir=")] + [f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "SPECDEC_TEST_THREADS": "1"}
    cmd = [sys.executable, "-m", "specdec.train", *args]
    p = subprocess.run([*cmd, "stop_after=2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "stopped after step 2" in p.stderr
    p = subprocess.run([sys.executable, "-m", "specdec.train", *args[:-1], f"resume_dir={run_dir}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    m = json.loads((run_dir / "out" / "manifest.json").read_text())
    assert m["steps"] == 6 and m["recipe"] == "eagle3"
    # a bad key is refused, naming it
    p = subprocess.run([*cmd, "train.ttt_stepz=2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "ttt_stepz" in p.stderr


class _FakeRun:
    id = "fake01"

    def __init__(self, calls: list[tuple[str, Any]], broken: bool) -> None:
        self.calls, self.broken = calls, broken
        self.summary = self

    def define_metric(self, name: str, **k: Any) -> None:
        self.calls.append(("define", name))

    def log(self, d: dict[str, Any], *a: Any, **k: Any) -> None:
        if self.broken:
            raise ConnectionError("api.wandb.ai unreachable")
        self.calls.append(("log", d))

    def update(self, d: dict[str, Any]) -> None:
        self.calls.append(("summary", d))

    def log_artifact(self, art: Any) -> None:
        self.calls.append(("artifact", art))

    def finish(self, *a: Any, **k: Any) -> None:
        self.calls.append(("finish", None))


@pytest.mark.parametrize("broken", [False, True])
def test_curves_go_to_wandb_and_a_failing_wandb_does_not_stop_training(
    tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: bool,
) -> None:
    import types

    calls: list[tuple[str, Any]] = []
    fake = types.ModuleType("wandb")
    fake.Settings = lambda **k: k  # type: ignore[attr-defined]
    fake.Table = lambda columns, data: ("table", columns, data)  # type: ignore[attr-defined]

    class Artifact:
        def __init__(self, name: str, type: str, metadata: Any = None) -> None:
            self.name, self.files = name, []

        def add_file(self, path: str, name: str) -> None:
            self.files.append(name)

    fake.Artifact = Artifact  # type: ignore[attr-defined]
    fake.init = lambda **k: calls.append(("init", k)) or _FakeRun(calls, broken)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    args = [a for a in overrides(tiny, "eagle", tmp_path / "w") if a != "logger=none"] + ["train.steps=3"]
    m = run(args)
    assert (tmp_path / "w" / "out" / "manifest.json").is_file() and m["steps"] == 3  # written either way
    init = dict(calls)["init"]
    assert init["mode"] == "offline" and init["job_type"] == "train" and init["config"]["train"]["recipe"] == "eagle"
    if broken:
        assert not any(k == "log" for k, _ in calls)  # every log raised; the run went on and wrote its output
        return
    logged = [d for k, d in calls if k == "log"]
    assert [d["train/step"] for d in logged if "train/loss" in d] == [1, 2, 3]
    assert any("eval/tau" in d for d in logged) and ("define", "train/*") in calls
    (art,) = [a for k, a in calls if k == "artifact"]
    assert {"config.json", "model.safetensors", "manifest.json"} <= set(art.files)
    assert calls[-1] == ("finish", None)


def test_self_distillation_text_is_the_targets_greedy_output_and_a_head_fine_tunes_from_it(
        tiny: dict[str, Path], tmp_path: Path) -> None:
    """``data.generate``: train-stream windows continued by the engine equal the target's dense
    greedy continuations; the run trains on them alone (``only``) and a resumed run reads them
    back. ``train.init_from`` then starts a second run from the first's head: its step-0 figures
    are the first head's, and a head of another shape is refused naming the key."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from specdec.core.checkpoint import load_decoder, load_tokenizer
    from specdec.train import data as D

    gen = ["data.generate.prompts=3", "data.generate.prompt_len=12", "data.generate.new_tokens=10",
           "data.generate.batch_size=2", "data.generate.only=true"]
    first = tmp_path / "first"
    m = run(overrides(tiny, "eagle3", first, "train.steps=4", *gen))
    docs = load_file(str(first / "generated.safetensors"))["tokens"]
    assert m["data"]["generated"]["tokens"] == docs.numel() and m["data"]["train_tokens"] == docs.numel()
    # the documents: separator, window, greedy continuation (dense re-forward, no cache)
    target = load_decoder(tiny["target"]).module.eval()
    tok = load_tokenizer(tiny["target"], vocab_size=target.config.vocab_size)
    sep = D.document_separator(tok, target.config.bos_token_id, target.config.eos_token_id)
    split = D.load_corpus(D.DataConfig(corpus=str(tiny["corpus"]), held_out_modulus=3))
    stream = D.encode(tok, split.train, sep)
    starts = torch.linspace(0, stream.numel() - 12, 3).long().tolist()
    expected = []
    for s in starts:  # the engine stops after an EOS (kept), the dense reference runs on
        window = stream[s : s + 12]
        dense = D.greedy_continue(target, window[None], 10)[0, 12:].tolist()
        cut = next((i + 1 for i, t in enumerate(dense) if t in target.config.eos_token_id), len(dense))
        expected += [sep, *window.tolist(), *dense[:cut]]
    assert docs.tolist() == expected
    # an interrupted run resumes on the saved documents (the file is read back, not regenerated)
    part = tmp_path / "part"
    from specdec.train.app import Stopped

    with pytest.raises(Stopped):
        run(overrides(tiny, "eagle3", part, "train.steps=4", "stop_after=2", *gen))
    with safe_open(str(part / "generated.safetensors"), "pt") as f:
        meta = f.metadata()
    save_file(load_file(str(part / "generated.safetensors")) | {"probe": torch.ones(1)}, str(part / "generated.safetensors"),
              metadata=meta)
    resumed = run(overrides(tiny, "eagle3", part, "train.steps=4", "resume=true", *gen))
    assert "probe" in load_file(str(part / "generated.safetensors")) and resumed["losses"]["eval"] == m["losses"]["eval"]
    # fine-tuning from the first head
    second = run(overrides(tiny, "eagle3", tmp_path / "second", "train.steps=2",
                           f"train.init_from={first / 'out'}"))
    start = second["losses"]["eval"][0]
    assert start["step"] == 0 and start["tau"] == m["heldout"]["shipped"]["tau"]
    assert start["heldout_loss"] == pytest.approx(m["heldout"]["shipped"]["loss"], abs=1e-4)
    with pytest.raises(ValueError, match="train.init_from"):
        run(overrides(tiny, "eagle3", tmp_path / "third", "train.aux_layers=[0,1,3]",
                      f"train.init_from={first / 'out'}"))
