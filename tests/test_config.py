"""The real Hydra config (conf/run.yaml) composes, and every group option becomes typed configs.

Misspelt keys and bad values fail naming the key; run dirs never collide.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from specdec.conf_schema import ZOO_DIR, RunConfig, build_components, config_dir, to_run_config
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.data import DataConfig
from specdec.engine import EngineConfig
from specdec.experiment import build_logger
from specdec.logging import NullLogger, WandbLogger
from specdec.spec.proposers import config_class
from specdec.spec.proposers.draft_model import DraftModelConfig
from specdec.spec.proposers.ngram import NgramConfig

CONF = config_dir()
GROUPS = ("target", "draft", "method", "sampling", "data", "runtime", "logger", "experiment")
# Options that need a value the config cannot know (a user's file).
NEEDS = {("data", "jsonl"): ["data.path=/tmp/prompts.jsonl"], ("data", "spec_bench"): ["data.path=/tmp/q.jsonl"],
         ("target", "smollm2"): ["method=ngram"]}  # (the shipped heads fit the built-in target only)


def _compose(overrides: list[str] = (), hydra: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("run", overrides=list(overrides), return_hydra_config=hydra)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _error_text(e: BaseException) -> str:
    parts = []
    while e is not None:
        parts.append(str(e))
        e = e.__cause__ or e.__context__
    return " | ".join(parts)


def test_conf_dir_is_the_repo_conf():
    assert (CONF / "run.yaml").is_file()
    assert all((CONF / g).is_dir() for g in GROUPS)


def test_shipped_heads_with_another_target_fail_at_start_saying_what_to_do(tmp_path):
    # The default method list has heads trained for the built-in target only:
    # with another target the run stops before loading anything, naming the key.
    from specdec.conf_schema import ConfigError

    rc = to_run_config(_compose([f"target.path={tmp_path}"]))
    with pytest.raises(ConfigError, match=r"method\.eagle\.path .*code-eagle.*method=\[draft_model,ngram\]"):
        build_components(rc)
    rc = to_run_config(_compose([f"target.path={tmp_path}", "method=[draft_model,ngram]"]))
    assert list(build_components(rc).methods) == ["draft_model", "ngram"]


def test_default_run_compares_every_shipped_method_on_the_builtin_pair():
    rc = to_run_config(_compose())
    assert isinstance(rc, RunConfig)
    comps = build_components(rc)
    assert Path(comps.target) == ZOO_DIR / "code-target"
    assert list(comps.methods) == ["draft_model", "ngram", "eagle", "eagle3", "medusa"]
    dm, ng = comps.methods["draft_model"], comps.methods["ngram"]
    assert isinstance(dm, DraftModelConfig) and Path(dm.path) == ZOO_DIR / "code-draft"
    assert isinstance(ng, NgramConfig) and dm.num_speculative_tokens == ng.num_speculative_tokens == 4
    for name in ("eagle", "eagle3", "medusa"):  # the shipped heads, at the same γ
        m = comps.methods[name]
        assert Path(m.path) == ZOO_DIR / f"code-{name}" and (Path(m.path) / "model.safetensors").is_file()
        assert m.num_speculative_tokens == 4
    assert comps.sampling.greedy and comps.engine.max_batch_size == 1 == comps.runtime.max_batch_size
    assert Path(comps.data.path) == ZOO_DIR / "prompts.jsonl"
    assert rc.logger.name == "wandb" and rc.logger.mode == "offline"


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_group_option_builds_typed_components(group, option):
    cfg = _compose([f"{group}={option}", *NEEDS.get((group, option), [])])
    rc = to_run_config(cfg)
    comps = build_components(rc)
    assert isinstance(comps.sampling, SamplingParams)
    assert isinstance(comps.runtime, RuntimeConfig)
    assert isinstance(comps.engine, EngineConfig)
    assert isinstance(comps.data, DataConfig)
    for name, m in comps.methods.items():
        assert type(m) is config_class(name)
    logger = build_logger(rc.logger)
    assert isinstance(logger, WandbLogger if rc.logger.name == "wandb" else NullLogger)
    if group == "method":
        assert list(comps.methods) == ([] if option == "none" else [option])


def test_method_selection_and_per_method_gamma():
    comps = build_components(to_run_config(_compose(
        ["method=[draft_model,ngram]", "method.num_speculative_tokens=2", "method.ngram.num_speculative_tokens=5",
         "method.ngram.max_n=4", "draft.path=/ckpt/draft"])))
    assert comps.methods["draft_model"].num_speculative_tokens == 2
    assert comps.methods["draft_model"].path == "/ckpt/draft"
    assert comps.methods["ngram"].num_speculative_tokens == 5 and comps.methods["ngram"].max_n == 4
    comps = build_components(to_run_config(_compose(["method=draft_model", "method.draft_model.path=/x"])))
    assert list(comps.methods) == ["draft_model"] and comps.methods["draft_model"].path == "/x"


def test_experiment_presets_state_only_what_changes():
    quick = to_run_config(_compose(["experiment=quick"]))
    assert (quick.name, quick.data.limit, quick.sampling.max_new_tokens, quick.logger.name) == ("quick", 4, 16, "none")
    assert quick.method["num_speculative_tokens"] == 4  # untouched
    sweep = _compose(["experiment=gamma_sweep"], hydra=True)
    assert str(sweep.hydra.mode) == "RunMode.MULTIRUN"
    assert sweep.hydra.sweeper.params["method.num_speculative_tokens"] == "1,2,4,8"


@pytest.mark.parametrize(
    "override,key",
    [
        ("sampling.temprature=0.5", "sampling.temprature"),
        ("sampling.temperature=hot", "sampling.temperature"),
        ("runtime.max_seq_len=long", "runtime.max_seq_len"),
        ("batch_size=1.5", "batch_size"),
    ],
)
def test_misspelt_key_or_wrong_type_fails_at_compose_naming_the_key(override, key):
    with pytest.raises(ConfigCompositionException) as e:
        _compose([override])
    assert key in _error_text(e.value)


@pytest.mark.parametrize(
    "override,key",
    [
        ("sampling.temperature=-1", "sampling.temperature"),
        ("sampling.top_p=0", "sampling.top_p"),
        ("sampling.max_new_tokens=0", "sampling.max_new_tokens"),
        ("method.num_speculative_tokens=100", "method.num_speculative_tokens"),
        ("method.ngram.min_n=0", "method.ngram.min_n"),
        ("runtime.max_seq_len=0", "runtime.max_seq_len"),
        ("runtime.dtype=float8", "runtime.dtype"),
        ("batch_size=4", "batch_size"),  # > runtime.max_batch_size given explicitly below
        ("data.limit=0", "data.limit"),
        ("logger.name=tensorboard", "logger.name"),
        ("logger.mode=sometimes", "logger.mode"),
        # Checked at start against the schema (the method node against each method's own dataclass):
        ("+foo=1", "foo"),
        ("method.num_speculativ_tokens=3", "method.num_speculativ_tokens"),
        ("method.ngram.max_nn=2", "method.ngram.max_nn"),
        ("method.ngram.max_n=oops", "method.ngram.max_n"),
        ("+method.no_such_method.x=1", "no_such_method"),
    ],
)
def test_bad_value_fails_at_start_naming_the_key(override, key):
    extra = ["runtime.max_batch_size=2"] if override.startswith("batch_size") else []
    cfg = _compose([override, *extra], hydra=True)
    with pytest.raises(ValueError) as e:
        to_run_config(cfg)
    assert key in str(e.value)


def test_an_option_for_a_method_that_does_not_run_is_an_error():
    cfg = _compose(["method=ngram", "method.draft_model.path=/x"], hydra=True)
    with pytest.raises(ValueError, match=r"method\.draft_model is set, but method 'draft_model' is not selected"):
        to_run_config(cfg)
    comps = build_components(to_run_config(_compose(["method=[ngram,draft_model]", "method.draft_model.path=/x"],
                                                    hydra=True)))
    assert comps.methods["draft_model"].path == "/x"


def test_run_dirs_never_collide_and_resume_dir_is_reused():
    a = _compose([], hydra=True).hydra
    b = _compose([], hydra=True).hydra
    assert a.run.dir != b.run.dir and a.run.dir.startswith("outputs/default/")
    assert OmegaConf.to_container(a.sweep)["subdir"] == "${hydra.job.num}"
    assert _compose(["resume_dir=/runs/old"], hydra=True).hydra.run.dir == "/runs/old"
    assert _compose(["name=abc"], hydra=True).hydra.sweep.dir.startswith("outputs/abc/multirun/")


@pytest.mark.parametrize(("override", "named"), [
    ("foo=1", "full_key: foo"),
    ("sampling.temprature=0.5", "full_key: sampling.temprature"),
    ("data=nosuch", "Could not find 'data/nosuch'"),
])
def test_an_override_hydra_cannot_compose_exits_2_naming_the_key(tmp_path, monkeypatch, capsys, override, named):
    """The command line (``specdec foo=1``): Hydra's own composition errors end as every bad key does."""
    import os

    from specdec.run import main

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr("sys.argv", ["specdec", override, f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("specdec: error: ") and named in err and "Traceback" not in err, err
    assert "To append to your config use" not in err  # Hydra's hint, which fails the same way
    assert not (tmp_path / "run").exists()
    assert "HYDRA_FULL_ERROR" not in os.environ
