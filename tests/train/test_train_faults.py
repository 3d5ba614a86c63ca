"""``python -m specdec.train`` given bad files and values: a planted pickle is never run, a corrupt
state or a bad number is an error naming the file or key, and a drafter is replaced only with
``overwrite=true``, whole (never a mix of old and new files, an interrupted write keeps the old)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from test_train_app import compose, overrides, run, tiny  # noqa: F401  (tiny: the module fixture)


class Planted:
    """Unpickling this runs a command (touching ``marker``): what a malicious train_state.pt does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def short(tiny: dict[str, Path], recipe: str, run_dir: Path, *extra: str) -> list[str]:  # noqa: F811
    return overrides(tiny, recipe, run_dir, "train.steps=2", "eval.every=0", *extra)


def test_a_planted_pickle_or_a_corrupt_state_is_never_loaded_and_is_named(tiny: dict[str, Path],  # noqa: F811
                                                                           tmp_path: Path) -> None:
    from specdec.train.app import PICKLED_STATE_FILE, STATE_FILE, Stopped
    from specdec.train.state import TrainError

    run_dir = tmp_path / "run"
    args = short(tiny, "eagle", run_dir, "train.steps=3")
    with pytest.raises(Stopped):
        run([*args, "stop_after=1"])
    state = run_dir / STATE_FILE
    good = state.read_bytes()
    marker = tmp_path / "pwned"
    resume = [*args, "resume=true"]

    # an older specdec's pickle next to it (or instead of it): refused unread, naming the file
    torch.save({"step": 1, "module": Planted(marker)}, run_dir / PICKLED_STATE_FILE)
    with pytest.raises(TrainError, match=f"{run_dir / PICKLED_STATE_FILE}.*never loaded"):
        run(resume)
    (run_dir / PICKLED_STATE_FILE).unlink()

    # a pickle under the state's own name, a truncated state, an empty file: "not a readable training state"
    torch.save({"step": 1, "module": Planted(marker)}, state)
    for bad in (state.read_bytes(), good[: len(good) // 2], b""):
        state.write_bytes(bad)
        with pytest.raises(TrainError, match=f"{state}: not a readable training state"):
            run(resume)
    assert not marker.exists()  # nothing was unpickled

    # a state of another module (a tensor missing): named too
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    state.write_bytes(good)
    with safe_open(str(state), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(state))
    save_file({k: v for k, v in tensors.items() if not k.startswith("module/fc.")}, str(state), metadata=meta)
    with pytest.raises(TrainError, match=f"{state}: the training state does not fit this run"):
        run(resume)

    # the saved run config unreadable: named
    state.write_bytes(good)
    (run_dir / "train_config.json").write_text("{not json")
    with pytest.raises(TrainError, match="train_config.json: not a readable run config"):
        run(resume)


@pytest.mark.parametrize("override,key", [
    ("train.lr=nan", "train.lr"), ("train.lr=inf", "train.lr"), ("train.lr=-1e-3", "train.lr"),
    ("train.lr=0", "train.lr"), ("train.weight_decay=nan", "train.weight_decay"),
    ("train.grad_clip=-inf", "train.grad_clip"), ("train.betas=[0.9,1.5]", "train.betas"),
    ("train.kd_temperature=0", "train.kd_temperature"),
])
def test_a_bad_number_is_refused_at_config_time_naming_the_key(override: str, key: str) -> None:
    from specdec.train.config import TrainConfigError, to_train_config

    with pytest.raises(TrainConfigError, match=key.replace(".", r"\.")):
        to_train_config(compose(["target.path=/nowhere", override]))


def test_the_command_line_refuses_a_bad_value_and_a_non_empty_out_dir_with_exit_2(
        tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m specdec.train …``'s entry point, in process (a subprocess costs seconds of imports)."""
    from specdec.train.app import main

    monkeypatch.setenv("WANDB_SILENT", "true")  # main() sets it
    out = tmp_path / "drafter"
    shutil.copytree(tiny["draft"], out)
    before = sorted(p.name for p in out.iterdir())
    base = [a for a in short(tiny, "eagle", tmp_path / "r") if not a.startswith("run_dir=")] + [
        f"hydra.run.dir={tmp_path / 'r'}", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    for extra, says in (["train.lr=abc"], "full_key: train.lr"), ([f"out_dir={out}"], f"out_dir {out} is not empty"):
        monkeypatch.setattr(sys, "argv", ["specdec.train", *base, *extra])
        with pytest.raises(SystemExit) as e:
            main()
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("specdec.train: error: ") and says in err, err
    assert "overwrite=true" in err
    assert sorted(p.name for p in out.iterdir()) == before
    assert not (tmp_path / "r" / "train_state.safetensors").exists()  # refused before training


def test_a_drafter_dir_is_replaced_only_with_overwrite_whole_and_an_interrupted_write_keeps_it(
        tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from specdec.core.checkpoint import load_decoder
    from specdec.core.registry import Role
    from specdec.train.eagle import HeadRecipe
    from specdec.train.state import TrainError

    out = tmp_path / "drafter"
    shutil.copytree(tiny["draft"], out)
    (out / "stale.bin").write_bytes(b"old")
    old = {p.name: p.read_bytes() for p in out.iterdir()}

    def contents() -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in out.iterdir()}

    with pytest.raises(TrainError, match=f"out_dir {out} is not empty.*overwrite=true"):
        run(short(tiny, "eagle", tmp_path / "refused", f"out_dir={out}"))
    assert contents() == old and not (tmp_path / "refused" / "train_state.safetensors").exists()

    # interrupted while writing the new drafter: the old one stays, whole; no temporary dir left
    def broken(self: HeadRecipe, out_dir: Path) -> None:
        assert any(out_dir.iterdir())  # the new files were written (elsewhere)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(HeadRecipe, "load_saved", broken)
        with pytest.raises(KeyboardInterrupt):
            run(short(tiny, "eagle", tmp_path / "interrupted", f"out_dir={out}", "overwrite=true"))
    assert contents() == old and sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "interrupted", "refused"]

    manifest = run(short(tiny, "eagle", tmp_path / "replaced", f"out_dir={out}", "overwrite=true"))
    names = {p.name for p in out.iterdir()}
    assert names == set(manifest["files"]) | {"manifest.json"} and "stale.bin" not in names
    assert load_decoder(out, role=Role.DRAFT_HEAD).config.kind == "eagle"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "interrupted", "refused", "replaced"]


def test_a_corrupt_feature_cache_chunk_is_an_error_naming_it(tiny: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    from specdec.train.state import TrainError

    cache = tmp_path / "cache"
    run(short(tiny, "eagle", tmp_path / "a", f"data.cache_dir={cache}"))
    (chunk, *_) = sorted(cache.rglob("chunk_*.safetensors"))
    chunk.write_bytes(chunk.read_bytes()[:100])
    with pytest.raises(TrainError, match=f"{chunk}: not a readable feature cache chunk"):
        run(short(tiny, "eagle", tmp_path / "b", f"data.cache_dir={cache}"))
