"""Every drafting method's options are checked when the pipeline is built, naming
``method.<name>.<option>`` and the bad value: their types (a bool is not an int, 2.5
is not an int) and ranges in the config classes, and what they must fit in the loaded
models (vocabulary, heads, layers) in the proposers. None waits for the first batch
to fail with a bare ``selected index k out of range``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
from hydra import compose, initialize_config_dir

from eagle_heads import eagle_head, head_for, scratch_dir  # tests/spec/eagle_heads.py
from medusa_heads import medusa_for  # tests/spec/medusa_heads.py
from specdec.api import LLM
from specdec.conf_schema import ConfigError, build_components, config_dir, to_run_config
from specdec.core.pipeline_model import RuntimeConfig

RT = RuntimeConfig(max_batch_size=2, max_seq_len=64)
VOCAB = 64  # the tiny target's


def _bad_d2t(target: Any) -> Path:
    """An EAGLE-3 head (draft vocabulary 48) whose d2t sends its last draft id past the target's vocabulary."""
    from safetensors.torch import load_file, save_file

    out = eagle_head(target.path, scratch_dir("eagle3-bad-d2t"), "eagle3", draft_vocab=48)
    sd = load_file(str(out / "model.safetensors"))
    sd["d2t"][-1] += 1000
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    return out


# (method options from the tiny target, what the error must name)
CASES: list[tuple[str, Callable[[Any], dict[str, Any]], list[str]]] = [
    # -- types and ranges (the config classes) --
    ("gamma-float", lambda t: {"name": "ngram", "num_speculative_tokens": 2.5},
     ["method.ngram.num_speculative_tokens", "2.5"]),
    ("gamma-bool", lambda t: {"name": "ngram", "num_speculative_tokens": True},
     ["method.ngram.num_speculative_tokens", "True"]),
    ("gamma-too-big", lambda t: {"name": "ngram", "num_speculative_tokens": 65},
     ["method.ngram.num_speculative_tokens", "65", "64"]),
    ("adaptive-gamma-str", lambda t: {"name": "ngram", "adaptive_gamma": "yes"}, ["method.ngram.adaptive_gamma"]),
    ("ngram-max-n-float", lambda t: {"name": "ngram", "max_n": 2.5}, ["method.ngram.max_n", "2.5"]),
    ("ngram-max-n-huge", lambda t: {"name": "ngram", "max_n": 10**6}, ["method.ngram.max_n", "1000000"]),
    ("ngram-min-n-bool", lambda t: {"name": "ngram", "min_n": True}, ["method.ngram.min_n", "True"]),
    ("ngram-min-over-max", lambda t: {"name": "ngram", "min_n": 4, "max_n": 3}, ["method.ngram.min_n", "4"]),
    ("ngram-branches", lambda t: {"name": "ngram", "branches": 0}, ["method.ngram.branches", "0"]),
    ("path-not-str", lambda t: {"name": "draft_model", "path": 5}, ["method.draft_model.path", "5"]),
    ("tree-kind", lambda t: {"name": "draft_model", "path": str(t.path), "tree": {"kind": "bushy"}},
     ["method.draft_model.tree.kind", "bushy"]),
    ("tree-top-k-float", lambda t: {"name": "draft_model", "path": str(t.path),
                                    "tree": {"kind": "dynamic", "top_k": 2.0}},
     ["method.draft_model.tree.top_k", "2.0"]),
    ("tree-depth-bool", lambda t: {"name": "eagle", "path": str(head_for(t, "eagle")),
                                   "tree": {"kind": "dynamic", "depth": True}},
     ["method.eagle.tree.depth", "True"]),
    ("tree-total-tokens", lambda t: {"name": "draft_model", "path": str(t.path),
                                     "tree": {"kind": "dynamic", "total_tokens": 65}},
     ["method.draft_model.tree.total_tokens", "65"]),
    ("tree-choice-float", lambda t: {"name": "draft_model", "path": str(t.path),
                                     "tree": {"kind": "static", "choices": [[0], [0.5]]}},
     ["method.draft_model.tree.choices[1]", "0.5"]),
    ("tree-unknown-key", lambda t: {"name": "draft_model", "path": str(t.path), "tree": {"top_kk": 2}},
     ["method.draft_model.tree", "top_kk"]),
    ("eagle3-aux-bool", lambda t: {"name": "eagle3", "path": str(head_for(t, "eagle3")), "aux_layers": [0, True, 1]},
     ["method.eagle3.aux_layers", "True"]),
    # -- facts of the loaded models (the proposers) --
    ("draft-rank-past-vocab", lambda t: {"name": "draft_model", "path": str(t.path),
                                         "tree": {"kind": "static", "choices": [[5000]]}},
     ["method.draft_model.tree.choices", "5000", str(VOCAB)]),
    ("eagle-rank-past-vocab", lambda t: {"name": "eagle", "path": str(head_for(t, "eagle")),
                                         "tree": {"kind": "static", "choices": [[0], [1], [0, 70]]}},
     ["method.eagle.tree.choices", "70", str(VOCAB)]),
    ("eagle3-top-k-past-draft-vocab", lambda t: {"name": "eagle3", "path": str(head_for(t, "eagle3-small-vocab")),
                                                 "tree": {"kind": "dynamic", "top_k": 50, "depth": 2}},
     ["method.eagle3.tree.top_k=50", "48"]),
    ("eagle3-aux-past-layers", lambda t: {"name": "eagle3", "path": str(head_for(t, "eagle3")),
                                          "aux_layers": [0, 1, 99]},
     ["method.eagle3.aux_layers", "99"]),
    ("eagle3-d2t-past-vocab", lambda t: {"name": "eagle3", "path": str(_bad_d2t(t))},
     ["method.eagle3.path", "'d2t'", "draft id 47", str(VOCAB - 1)]),
    ("medusa-rank-past-vocab", lambda t: {"name": "medusa", "path": str(medusa_for(t, "medusa")),
                                          "tree": {"kind": "static", "choices": [[5000]]}},
     ["method.medusa.tree.choices", "5000", str(VOCAB)]),
    ("medusa-deeper-than-heads", lambda t: {"name": "medusa", "path": str(medusa_for(t, "medusa")),
                                            "tree": {"kind": "static", "choices": [[0], [0, 0], [0, 0, 0],
                                                                                   [0, 0, 0, 0], [0, 0, 0, 0, 0]]},
                                            "num_speculative_tokens": 5},
     ["method.medusa.tree.choices", "depth 5", "4 levels"]),
    ("medusa-dynamic", lambda t: {"name": "medusa", "path": str(medusa_for(t, "medusa")),
                                  "tree": {"kind": "dynamic"}},
     ["method.medusa.tree.kind"]),
]


@pytest.mark.parametrize(("options", "named"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_method_option_fails_at_build_naming_it(tiny_llama, options, named: list[str]) -> None:
    target = tiny_llama(vocab=VOCAB)
    with pytest.raises(ValueError) as e:  # LLM(...) builds the pipeline: no batch has run
        LLM(target.path, method=options(target), runtime=RT)
    msg = str(e.value)
    assert all(n in msg for n in named), msg
    assert len(msg) < 1000


def test_the_bounds_themselves_build(tiny_llama) -> None:
    """The edges of the checks are allowed: top_k = the whole vocabulary, rank vocab - 1."""
    target = tiny_llama(vocab=VOCAB)
    LLM(target.path, method={"name": "draft_model", "path": str(target.path), "num_speculative_tokens": 3,
                             "tree": {"kind": "dynamic", "top_k": VOCAB, "depth": 1}}, runtime=RT)
    LLM(target.path, method={"name": "medusa", "path": str(medusa_for(target, "medusa")),
                             "tree": {"kind": "static", "choices": [[VOCAB - 1]]}}, runtime=RT)


def _compose(overrides: list[str]) -> Any:
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("run", overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [(["method=ngram", "method.ngram.max_n=2.5"], "method.ngram.max_n"),
     (["method=ngram", "method.num_speculative_tokens=true"], "num_speculative_tokens"),
     (["method=ngram", "method.ngram.min_n=5"], "method.ngram.min_n"),
     (["method=draft_model", "method.draft_model.path=/x", "method.draft_model.tree.kind=dynamic",
       "method.draft_model.tree.top_k=0"], "method.draft_model.tree.top_k")],
    ids=["max_n-float", "gamma-bool", "min_n-over-max_n", "tree-top_k-zero"],
)
def test_hydra_config_names_the_bad_option_at_start(overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        to_run_config(_compose(overrides))


def test_hydra_run_fails_at_build_naming_a_tree_the_heads_cannot_draft(tiny_llama) -> None:
    """The experiment runner's path (compose, components, LLM): a rank past the vocabulary."""
    target = tiny_llama(vocab=VOCAB)
    heads = medusa_for(target, "medusa")
    cfg = _compose([f"target.path={target.path}", "method=medusa", f"method.medusa.path={heads}",
                    "method.medusa.tree.kind=static", "method.medusa.tree.choices=[[0],[5000]]",
                    "runtime.max_batch_size=2", "runtime.max_seq_len=64", "batch_size=2"])
    comps = build_components(to_run_config(cfg))
    with pytest.raises(ValueError, match=r"method\.medusa\.tree\.choices.*5000"):
        LLM(comps.target, comps.methods["medusa"], comps.runtime, comps.engine)
