"""Non-finite numbers never leave the request that made them.

Attention reads padded and stale KV slots (other requests' blocks, freed
blocks, rejected drafts) and masks them; masked by *selection*, a NaN there
cannot reach a row that does not see it. Flex attention (``runtime.attention
=flex``) reads them in place, weighted by 0, so it never stores a non-finite
value (specdec/core/flex.py): the faults run over it too. A request whose logits (or, under
sampling, draft probabilities) go non-finite ends with ``finish_reason
'error'`` naming itself and the sequence position; every other request of
the batch comes out token-identical to a run without the fault.

The faults are planted in copies of tiny checkpoints: NaN written into every
KV-cache slot before a run, one token whose embedding row is NaN (used in one
prompt only), a drafter whose weights are NaN.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import EngineConfig, GenerationOutput
from specdec.spec.proposers.draft_model import DraftModelConfig

NAN = float("nan")
# Lengths 7, 2, 20, 10, 3: every batch has padding; 3 run at once, so
# requests join as others leave and reuse their freed blocks.
PROMPTS = [[3, 5, 7, 11, 13, 17, 19], [1, 2], [9] * 20, list(range(30, 40)), [40, 41, 42]]
RT = RuntimeConfig(max_batch_size=3, max_seq_len=64, block_size=4)
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.9, seed=7)


def _edited_copy(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of checkpoint ``src`` whose tensors went through ``edit(state_dict)``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    sd = load_file(str(f))
    edit(sd)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(f), metadata={"format": "pt"})
    return dst


def _nan_embedding(token: int) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(sd: dict[str, torch.Tensor]) -> None:
        sd["model.embed_tokens.weight"][token] = NAN

    return edit


def _always_drafts(x: int) -> Callable[[dict[str, torch.Tensor]], None]:
    """A drafter that drafts token ``x`` whatever the context: layers all zero, every
    embedding row ones, so the final hidden state is ones and only lm_head row ``x`` sees it."""
    def edit(sd: dict[str, torch.Tensor]) -> None:
        for name, t in sd.items():
            t.fill_(1.0 if name == "model.embed_tokens.weight" or name.endswith("norm.weight") else 0.0)
        sd["lm_head.weight"][x] = 1.0

    return edit


def _method(draft: Path | None, gamma: int = 3) -> DraftModelConfig | None:
    return None if draft is None else DraftModelConfig(path=str(draft), num_speculative_tokens=gamma)


def _run(target: Path, draft: Path | None, prompts: list[list[int]], sp: SamplingParams,
         poison_kv: bool = False, batch: int = RT.max_batch_size, attention: str = "auto") -> list[GenerationOutput]:
    rt = replace(RT, max_batch_size=batch, attention=attention)
    llm = LLM(str(target), _method(draft), runtime=rt, engine_config=EngineConfig(max_batch_size=batch))
    if poison_kv:
        pipe = llm.pipeline
        models = [pipe.target] + ([pipe.spec.model] if getattr(pipe, "spec", None) and pipe.spec.model else [])
        for m in models:
            for cache in m.caches:
                cache.tensors.k.fill_(NAN)
                # Flex attention never stores a non-finite value: a forward that makes one
                # stores key NaN, value 0 (specdec/core/flex.py). That is what it may find.
                cache.tensors.v.fill_(NAN if attention == "auto" else 0.0)
    return llm.generate(prompts, sp)


@pytest.fixture(scope="module")
def pair(tiny_llama) -> tuple[Path, Path]:
    """A target and a drafter that agrees with it often (so drafts get accepted and rejected)."""
    return tiny_llama(vocab=64, seed=0).path, tiny_llama(vocab=64, seed=0, perturb=0.05, perturb_seed=1).path


CASES = [("plain", GREEDY), ("plain", SAMPLED), ("spec", GREEDY), ("spec", SAMPLED)]
IDS = ["plain-greedy", "plain-sampled", "spec-greedy", "spec-sampled"]


# Flex attention (runtime.attention=flex) reads whole 128-slot tiles of the cache, every
# request's slots in one: a compile per padded row count, so it runs the speculative cases.
ATTENTION = [pytest.param(a, kind, sp, id=f"{a}-{i}") for a in ("auto", "flex")
             for (kind, sp), i in zip(CASES, IDS) if a == "auto" or kind == "spec"]


@pytest.mark.parametrize(("attention", "kind", "sp"), ATTENTION)
def test_nan_in_free_kv_slots_changes_nothing(pair, attention: str, kind: str, sp: SamplingParams) -> None:
    target, draft = pair
    draft = draft if kind == "spec" else None
    clean = _run(target, draft, PROMPTS, sp, attention=attention)
    poisoned = _run(target, draft, PROMPTS, sp, poison_kv=True, attention=attention)
    assert [o.error for o in poisoned] == [None] * len(PROMPTS)
    assert [o.token_ids for o in poisoned] == [o.token_ids for o in clean]
    assert all(len(o.token_ids) == sp.max_new_tokens for o in clean)


@pytest.mark.parametrize(("attention", "kind", "sp"), ATTENTION)
def test_nan_activations_fail_only_their_request(pair, tmp_path: Path, attention: str, kind: str,
                                                 sp: SamplingParams) -> None:
    target, draft = pair
    draft = draft if kind == "spec" else None
    # Request 0 holds KV block 0, which the shorter requests' gathers pad with;
    # token x (its index 2) is in no other prompt and in no clean output.
    clean = _run(target, draft, PROMPTS, sp)
    x = min(set(range(64)) - {t for p, o in list(zip(PROMPTS, clean))[1:] for t in p + o.token_ids})
    prompts = [[1, 2, x, 4]] + PROMPTS[1:]
    clean = _run(target, draft, prompts, sp, attention=attention)
    assert x not in {t for o in clean[1:] for t in o.token_ids}
    nan_target = _edited_copy(target, tmp_path / "nan-target", _nan_embedding(x))
    out = _run(nan_target, draft, prompts, sp, attention=attention)
    bad = out[0]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert bad.error is not None
    assert "'req-0'" in bad.error and "position 4" in bad.error and "target's logits went non-finite" in bad.error
    assert [o.error for o in out[1:]] == [None] * (len(prompts) - 1)
    assert [o.token_ids for o in out[1:]] == [o.token_ids for o in clean[1:]]


# 1: a request alone (its causal fast path), 3: packed; flex: one tile holds every row
@pytest.mark.parametrize(("attention", "batch"), [("auto", 1), ("auto", 3), ("flex", 3)])
def test_draft_that_drives_the_target_non_finite_is_only_rejected(tiny_llama, tmp_path: Path, attention: str,
                                                                   batch: int) -> None:
    """Every draft is token x, whose embedding in the target is NaN: the target's
    rows after it go NaN; the rows before it (what verification uses) must not."""
    src = tiny_llama(vocab=64, seed=0).path
    clean = _run(src, None, PROMPTS, GREEDY)
    x = min(set(range(64)) - {t for p, o in zip(PROMPTS, clean) for t in p + o.token_ids})
    nan_target = _edited_copy(src, tmp_path / "nan-target", _nan_embedding(x))

    x_drafter = _edited_copy(src, tmp_path / "x-drafter", _always_drafts(x))
    out = _run(nan_target, x_drafter, PROMPTS, GREEDY, batch=batch, attention=attention)
    assert [o.error for o in out] == [None] * len(PROMPTS)
    assert [o.token_ids for o in out] == [o.token_ids for o in clean]


def test_nan_drafter_fails_its_sampled_requests_and_greedy_stays_exact(pair, tmp_path: Path) -> None:
    target, draft = pair

    def all_nan(sd: dict[str, torch.Tensor]) -> None:
        for t in sd.values():
            t.fill_(NAN)

    nan_draft = _edited_copy(draft, tmp_path / "nan-draft", all_nan)
    sampled = _run(target, nan_draft, PROMPTS, SAMPLED)
    for i, (p, o) in enumerate(zip(PROMPTS, sampled)):
        assert o.finish_reason == "error" and o.token_ids == []
        assert o.error is not None
        assert f"'req-{i}'" in o.error and "drafter's probabilities went non-finite" in o.error
        assert f"position {len(p)}" in o.error
    # Greedy drafts are only proposals: NaN ones are rejected and the output stays exact.
    plain = _run(target, None, PROMPTS, GREEDY)
    greedy = _run(target, nan_draft, PROMPTS, GREEDY)
    assert [o.token_ids for o in greedy] == [o.token_ids for o in plain]


def test_a_tiny_temperature_samples_the_argmax_not_nan() -> None:
    from specdec.sampling import probs_from_logits, sampling_tensors

    logits = torch.tensor([[[1.0, 3.0, 2.0, 3.0 - 1e-3]]])  # [B=1, n=1, V=4]
    st = sampling_tensors([SamplingParams(temperature=1e-40)], [0])
    probs = probs_from_logits(logits, st)
    assert torch.isfinite(probs).all()
    assert probs[0, 0].tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.slow  # compiles the tiny target's graphs (about a minute on 2 cores)
@pytest.mark.parametrize("batch", [1, 3])  # 1: the fused verification graph, 3: a batched forward
def test_compiled_verification_rechecks_rows_that_went_non_finite(tiny_llama, tmp_path: Path, batch: int) -> None:
    """Compiled on a CPU, a chain is verified by a forward that does not hide a row's
    non-finite keys from the rows before it, and again with hiding when a verification
    read a non-finite number (DecoderInputs.isolate_rows). As in the eager test above:
    every draft drives the target NaN, is rejected, and the output is exact; the
    rerun must have happened, and a clean run must not need it."""
    src = tiny_llama(vocab=64, seed=0).path
    rt = replace(RT, max_batch_size=batch, compile=True)
    ec = EngineConfig(max_batch_size=batch)
    clean = LLM(str(src), runtime=rt, engine_config=ec).generate(PROMPTS, GREEDY)
    x = min(set(range(64)) - {t for p, o in zip(PROMPTS, clean) for t in p + o.token_ids})
    nan_target = _edited_copy(src, tmp_path / "nan-target", _nan_embedding(x))

    x_drafter = _edited_copy(src, tmp_path / "x-drafter", _always_drafts(x))
    same = _edited_copy(src, tmp_path / "same-drafter", lambda sd: None)
    for drafter, reruns in ((x_drafter, True), (same, False)):
        llm = LLM(str(nan_target if reruns else src), _method(drafter), runtime=rt, engine_config=ec)
        isolated: list[bool] = []
        target = llm.pipeline.module.target
        forward = target.forward

        def seen(inputs, forward=forward):
            isolated.append(inputs.isolate_rows)
            return forward(inputs)

        target.forward = seen  # (traced into the fused graph at batch 1: counts its compiles there)
        out = llm.generate(PROMPTS, GREEDY)
        assert [o.error for o in out] == [None] * len(PROMPTS)
        assert [o.token_ids for o in out] == [o.token_ids for o in clean]
        assert False in isolated and (True in isolated) == reruns
