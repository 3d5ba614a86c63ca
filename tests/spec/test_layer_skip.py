"""Layer-skip self-speculation (``method=layer_skip``): the target's first ``k`` layers draft.

Exact like every method (greedy output equals plain decoding token for token, at
batch 1 and in ragged batches; seeded sampling reproducible, alone as in a batch),
the draft's weights *are* the target's, and with ``shared_kv`` (the default) its
KV is the target's first ``k`` layers: it must draft exactly what a draft with a
cache of its own drafts. The target is a tiny random Llama whose later layers are
damped, so early-layer drafts are often (not always) right: ragged acceptance.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from specdec.api import LLM
from specdec.conf_schema import ConfigError, method_configs
from specdec.core.backend import backend_of
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.spec.proposers.layer_skip import LayerSkipConfig

VOCAB = 64
LAYERS = 4
RT = RuntimeConfig(max_batch_size=8, max_seq_len=96, block_size=8)
PROMPTS = [[3, 7, 11, 2, 9], [5] * 23, [1, 2, 3, 4] * 9 + [6], [60, 1], list(range(40, 57))]
NEW = [20, 9, 16, 25, 12]  # ragged: requests end mid-step at different times


@pytest.fixture(scope="module")
def target(tiny_llama, tmp_path_factory) -> Path:
    """A 4-layer tiny Llama whose layers 2 and 3 write little into the residual stream
    (o_proj and down_proj scaled by 0.15): the first layers' guess is often the target's."""
    from safetensors.torch import load_file, save_file

    src = tiny_llama(vocab=VOCAB, layers=LAYERS, seed=0).path
    dst = tmp_path_factory.mktemp("layer-skip") / "target"
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    for i in (2, 3):
        for name in (f"model.layers.{i}.self_attn.o_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"):
            sd[name] = sd[name] * 0.15
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _run(path: Path, method: Any, prompts: list[list[int]], sampling: list[SamplingParams]) -> tuple[list, LLM]:
    llm = LLM(str(path), method, runtime=RT)
    outs = llm.generate(prompts, sampling)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize(("k", "gamma", "shared"), [(1, 3, True), (2, 4, True), (3, 2, True), (2, 4, False)])
def test_greedy_output_equals_plain_decoding(target, k, gamma, shared) -> None:
    sps = [SamplingParams(max_new_tokens=n) for n in NEW]
    plain, _ = _run(target, None, PROMPTS, sps)
    method = LayerSkipConfig(num_layers=k, num_speculative_tokens=gamma, shared_kv=shared)
    batched, llm = _run(target, method, PROMPTS, sps)
    assert batched == plain
    counts = llm.pipeline.stats().counts
    assert 0 < counts.alpha < 1  # drafts accepted and rejected: the rollback ran too
    for i, (p, sp) in enumerate(zip(PROMPTS, sps)):  # batch 1
        alone, _ = _run(target, method, [p], [sp])
        assert alone == [plain[i]], f"request {i} alone"


def test_shared_kv_drafts_what_a_cache_of_its_own_drafts(target) -> None:
    """Layers 0..k-1 of the target's cache hold what the draft would write itself: with the
    target's KV the draft proposes the very same tokens, so every request accepts the
    same drafts, step for step (ragged batch, γ past some requests' room at their end)."""
    sps = [SamplingParams(max_new_tokens=n) for n in NEW]
    hists = []
    for shared in (True, False):
        _, llm = _run(target, LayerSkipConfig(num_layers=2, num_speculative_tokens=4, shared_kv=shared), PROMPTS, sps)
        stats = llm.pipeline.stats()
        hists.append((stats.counts.accepted_hist, stats.counts.accepted_at, stats.target_forwards))
    assert hists[0] == hists[1]


def test_seeded_sampling_is_reproducible_and_the_same_alone_as_in_a_batch(target) -> None:
    sps = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_new_tokens=n) for i, n in enumerate(NEW)]
    method = LayerSkipConfig(num_layers=2, num_speculative_tokens=3)
    first, llm = _run(target, method, PROMPTS, sps)
    again, _ = _run(target, method, PROMPTS, sps)
    assert first == again
    assert llm.pipeline.stats().counts.accepted > 0
    for i in (0, 3):
        alone, _ = _run(target, method, [PROMPTS[i]], [sps[i]])
        assert alone == [first[i]], f"request {i} alone"


def test_sampled_output_follows_the_target_distribution(tiny_llama) -> None:
    """Chi-square of the first three sampled tokens against the target's exact joint
    distribution (tests/spec/test_sampling_exactness.py's harness, V = 8)."""
    from test_sampling_exactness import N, P_PASS, PROMPT, TOPK_TOPP, V, exact_joint, gof_pvalue, sample_joint

    tiny = tiny_llama(vocab=V, init=0.2, seed=0, layers=3)
    counts, llm = sample_joint(tiny, LayerSkipConfig(num_layers=1, num_speculative_tokens=3), seed0=110_000,
                               **TOPK_TOPP)
    c = llm.pipeline.stats().counts
    assert c.proposed >= N and 0 < c.alpha < 1, c.summary()
    p = gof_pvalue(counts, exact_joint(tiny.hf, PROMPT, **TOPK_TOPP))
    assert p > P_PASS, f"chi-square p = {p:.3g}"


def test_the_draft_is_the_targets_own_weights_and_cache(target) -> None:
    llm = LLM(str(target), LayerSkipConfig(num_layers=3, num_speculative_tokens=3), runtime=RT)
    proposer = llm.pipeline.proposer
    draft, tgt = proposer.drafter.decoder, llm.pipeline.target.build_module()
    assert len(draft.model.layers) == 3 and draft.config.num_hidden_layers == 3
    storage = lambda m: {t.untyped_storage().data_ptr() for t in [*m.parameters(), *m.buffers()]  # noqa: E731
                         if t.numel() and t.dim() > 0 and t is not m.rope_cos and t is not m.rope_sin}
    assert storage(draft) <= storage(tgt)  # weights, fused and packed projections: no copy
    # ... and the native forward's operands (the packed weights it runs) are the target forward's.
    d_ops, t_ops = backend_of(draft).operands, backend_of(tgt).operands
    assert _tensor_ptrs(d_ops) <= _tensor_ptrs(t_ops) and len(_tensor_ptrs(d_ops)) > 3 * 6
    for i in range(3):
        assert draft.model.layers[i] is tgt.model.layers[i]
    assert draft.lm_head is tgt.lm_head and draft.model.norm is tgt.model.norm
    # Shared KV: its cache is layers 0..2 of the target's storage, in the target's blocks.
    dk, tk = proposer.pipeline.caches[0].tensors.k, llm.pipeline.target.caches[0].tensors.k
    assert dk.data_ptr() == tk.data_ptr() and dk.shape[0] == 3
    assert proposer.pipeline.caches[0].allocator is llm.pipeline.target.caches[0].allocator


def _tensor_ptrs(x: Any) -> set[int]:
    if isinstance(x, torch.Tensor):
        return {x.data_ptr()}
    if isinstance(x, (list, tuple)):
        return set().union(*map(_tensor_ptrs, x)) if x else set()
    return set()


def test_default_num_layers_is_half_the_targets(target) -> None:
    llm = LLM(str(target), LayerSkipConfig(num_speculative_tokens=2), runtime=RT)
    assert len(llm.pipeline.proposer.drafter.decoder.model.layers) == LAYERS // 2


@pytest.mark.parametrize("k", [LAYERS, LAYERS + 3])
def test_num_layers_that_skips_nothing_fails_at_build_naming_the_key(target, k) -> None:
    with pytest.raises(ValueError, match=rf"method\.layer_skip\.num_layers must be in \[1, {LAYERS - 1}\].*got {k}"):
        LLM(str(target), LayerSkipConfig(num_layers=k), runtime=RT)


def test_a_one_layer_target_fails_naming_the_key(tiny_llama) -> None:
    with pytest.raises(ValueError, match=r"method\.layer_skip\.num_layers.*1 layer"):
        LLM(str(tiny_llama(vocab=VOCAB, layers=1).path), LayerSkipConfig(), runtime=RT)


@pytest.mark.parametrize("bad", [0, -2, True, "two", 1.5])
def test_a_bad_num_layers_fails_in_the_config_naming_the_key(bad) -> None:
    with pytest.raises(ValueError, match=r"method\.layer_skip\.num_layers"):
        LayerSkipConfig(num_layers=bad)
    with pytest.raises(ConfigError, match=r"method\.layer_skip\.num_layers"):
        method_configs({"num_speculative_tokens": 3, "layer_skip": {"num_layers": bad}})


def test_the_method_yaml_composes_and_names_a_bad_num_layers(target) -> None:
    from hydra import compose, initialize_config_dir

    from specdec.conf_schema import build_components, config_dir, to_run_config

    def run_config(*overrides: str) -> Any:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return to_run_config(compose("run", overrides=[f"target.path={target}", "method=layer_skip", *overrides],
                                         return_hydra_config=True))

    comps = build_components(run_config("method.layer_skip.num_layers=3", "method.num_speculative_tokens=2"))
    assert comps.methods["layer_skip"] == LayerSkipConfig(num_layers=3, num_speculative_tokens=2)
    assert build_components(run_config()).methods["layer_skip"] == LayerSkipConfig()
    with pytest.raises(ConfigError, match=r"method\.layer_skip\.num_layers"):
        run_config("method.layer_skip.num_layers=0")
