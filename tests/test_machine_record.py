"""``summary.json``'s ``machine`` record: the machine, torch build and source commit of a run."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest
import torch

from specdec.experiment.machine import git_commit, machine_record


def test_machine_record_names_the_machine_torch_build_and_device():
    m = machine_record("cpu")
    assert m["cpu"] and isinstance(m["cpu"], str) and m["cores"] >= 1
    assert m["python"] == platform.python_version() and m["os"] == platform.platform()
    assert m["torch"] == torch.__version__
    assert m["torch_build"] == (f"cuda {torch.version.cuda}" if torch.version.cuda else "cpu") or torch.version.hip
    assert m["device"] == "cpu" and m["gpu"] is None  # a GPU's name only when the run is on it
    if torch.cuda.is_available():
        assert machine_record("cuda")["gpu"] == torch.cuda.get_device_name(0)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_commit_of_a_checkout_and_its_dirty_flag_none_outside_one(tmp_path, monkeypatch):
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              check=True, capture_output=True, text=True).stdout.strip()

    pkg = tmp_path / "specdec"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    git("init", "-q")
    assert git_commit(pkg) is None  # a repo that does not track the package (a venv inside some project)
    git("add", "specdec/__init__.py")
    git("commit", "-q", "-m", "x")
    head = git("rev-parse", "HEAD")
    assert git_commit(pkg) == {"commit": head, "dirty": False}
    (pkg / "new.py").write_text("")  # untracked: not dirty
    assert git_commit(pkg) == {"commit": head, "dirty": False}
    (pkg / "__init__.py").write_text("x = 1\n")
    assert git_commit(pkg) == {"commit": head, "dirty": True}

    assert git_commit(tmp_path / "elsewhere") is None  # no such dir: git fails, no error
    monkeypatch.setenv("PATH", str(tmp_path / "no_bin"))  # no git at all: None, never an error
    assert git_commit(pkg) is None
    assert machine_record("cpu")["git"] is None
