"""The device path (``runtime.device``): every method and tree, sampling and CUDA graphs
give on the device what they give on the CPU. Skipped without the device;
``experiments/bench/gpu.sh`` runs them (``-m gpu``).

- float32, TF32 off: greedy output of every method (and a dynamic EAGLE-3 / draft-model
  tree, a static Medusa tree) equals CPU plain decoding token for token (strict policy);
- bfloat16 (the device default): greedy output of every method judged against plain
  decoding on the device by the exactness policy (:mod:`specdec.spec.exactness`,
  tolerant): no real mismatch, near ties counted apart;
- seeded sampling on the device follows the target's exact distribution (chi-square,
  the CPU sampling tests' helpers), repeats itself seed for seed, and a planted
  residual bug is caught (the negative control must fail the test);
- ``runtime.compile=true`` (CUDA graphs) gives eager's tokens.

The device is ``$SPECDEC_GPU_TEST_DEVICE`` (default ``cuda``): ``SPECDEC_GPU_TEST_DEVICE=cpu``
runs the same checks on the CPU, which is how they are kept working without a GPU.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import EngineConfig
from specdec.measure import judge_outputs
from specdec.spec.proposers.draft_model import DraftModelConfig
from specdec.spec.proposers.eagle import Eagle3Config, EagleConfig
from specdec.spec.proposers.layer_skip import LayerSkipConfig
from specdec.spec.proposers.medusa import MedusaConfig
from specdec.spec.proposers.ngram import NgramConfig
from specdec.spec.tree import TreeConfig

from eagle_heads import head_for  # tests/spec/eagle_heads.py
from medusa_heads import medusa_for  # tests/spec/medusa_heads.py

DEVICE = os.environ.get("SPECDEC_GPU_TEST_DEVICE", "cuda")


def _device_available(device: str) -> bool:
    kind = device.split(":")[0]
    if kind == "cpu":
        return True
    if kind == "cuda":
        return torch.cuda.is_available()
    return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _device_available(DEVICE), reason=f"needs device {DEVICE!r} (SPECDEC_GPU_TEST_DEVICE)"),
]

VOCAB = 64
GAMMA = 3
PROMPTS = [[3, 5, 7, 3, 5, 7, 3], [1, 2], list(range(30))]
SP = SamplingParams(max_new_tokens=12, ignore_eos=True)
METHODS = ["plain", "draft_model", "ngram", "eagle", "eagle3", "medusa", "layer_skip",
           "eagle3_tree", "draft_model_tree", "medusa_tree"]


def _models(tiny_llama) -> tuple[Any, Any]:
    target = tiny_llama(vocab=VOCAB, seed=0, qk_scale=0.1)  # loopy: n-gram drafts get accepted
    draft = tiny_llama(vocab=VOCAB, seed=0, qk_scale=0.1, perturb=0.01, perturb_seed=1)
    return target, draft


def _method(name: str, target: Any, draft: Any) -> Any:
    """The config of method ``name`` (None: plain decoding) for the tiny ``target``."""
    dynamic = TreeConfig(kind="dynamic", top_k=3, depth=3, total_tokens=6)
    return {
        "plain": lambda: None,
        "draft_model": lambda: DraftModelConfig(path=str(draft.path), num_speculative_tokens=GAMMA),
        "ngram": lambda: NgramConfig(num_speculative_tokens=GAMMA),
        "eagle": lambda: EagleConfig(path=str(head_for(target, "eagle")), num_speculative_tokens=GAMMA),
        "eagle3": lambda: Eagle3Config(path=str(head_for(target, "eagle3")), num_speculative_tokens=GAMMA),
        "medusa": lambda: MedusaConfig(path=str(medusa_for(target, "medusa")), num_speculative_tokens=GAMMA),
        "layer_skip": lambda: LayerSkipConfig(num_layers=1, num_speculative_tokens=GAMMA),
        "eagle3_tree": lambda: Eagle3Config(path=str(head_for(target, "eagle3")), num_speculative_tokens=6,
                                            tree=dynamic),
        "draft_model_tree": lambda: DraftModelConfig(path=str(draft.path), num_speculative_tokens=6, tree=dynamic),
        "medusa_tree": lambda: MedusaConfig(path=str(medusa_for(target, "medusa")), num_speculative_tokens=5,
                                            tree={"kind": "static", "choices": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}),
    }[name]()


def _llm(path: Any, method: Any, **runtime: Any) -> LLM:
    rt = RuntimeConfig(**{"max_batch_size": len(PROMPTS), "max_seq_len": 64, **runtime})
    return LLM(str(path), method=method, runtime=rt, engine_config=EngineConfig(max_batch_size=len(PROMPTS)))


def _tokens(llm: LLM, prompts: list[list[int]] = PROMPTS, sp: Any = SP) -> list[list[int]]:
    outs = llm.generate(prompts, sp)
    for o in outs:
        assert o.error is None, o.error
    return [o.token_ids for o in outs]


_CPU_PLAIN: dict[str, list[list[int]]] = {}


def _cpu_plain(target: Any) -> list[list[int]]:
    """CPU plain decoding of PROMPTS (float32): the reference every device output must equal."""
    key = str(target.path)
    if key not in _CPU_PLAIN:
        _CPU_PLAIN[key] = _tokens(_llm(target.path, None, dtype="float32"))
    return _CPU_PLAIN[key]


@pytest.mark.parametrize("method", METHODS)
def test_device_fp32_greedy_equals_cpu_plain_decoding(tiny_llama, method: str) -> None:
    """float32 with TF32 off (strict: bit equality is the question): every method's greedy
    tokens on the device are CPU plain decoding's."""
    target, draft = _models(tiny_llama)
    llm = _llm(target.path, _method(method, target, draft), device=DEVICE, dtype="float32", tf32=False)
    out = _tokens(llm)
    ref = _cpu_plain(target)
    if out != ref:  # say where and by how much (strict: any difference is a mismatch)
        verdict = judge_outputs(out, ref, PROMPTS, _llm(target.path, None, dtype="float32").pipeline.target,
                                mode="strict")
        pytest.fail(f"{method} on {DEVICE}: output differs from CPU plain decoding: {verdict}")
    if method != "plain":
        assert llm.pipeline.stats().counts.proposed > 0  # speculation did happen


@pytest.mark.parametrize("method", [m for m in METHODS if m != "plain"])
def test_device_bf16_greedy_has_no_real_mismatch_under_the_exactness_policy(tiny_llama, method: str) -> None:
    """bfloat16: each method against plain decoding on the same device and dtype, judged by the
    tolerant policy (the runner's): a difference at a near tie of the target's logits is
    counted apart, any other is a failure."""
    target, draft = _models(tiny_llama)
    plain = _llm(target.path, None, device=DEVICE, dtype="bfloat16")
    ref = _tokens(plain)
    out = _tokens(_llm(target.path, _method(method, target, draft), device=DEVICE, dtype="bfloat16"))
    verdict = judge_outputs(out, ref, PROMPTS, plain.pipeline.target, mode="tolerant")
    print(f"{method} bf16 on {DEVICE}: near ties {verdict['near_ties']}")  # shown with -rP / -s
    assert verdict["equal"], f"{method} bf16 on {DEVICE}: a real mismatch: {verdict['first_mismatch']}"


# -- sampling -----------------------------------------------------------------------------------

def _sample_joint(target: Any, method: Any, seed0: int, n: int) -> tuple[np.ndarray, LLM, list[list[int]]]:
    from test_sampling_exactness import PROMPT, V  # tests/spec/test_sampling_exactness.py

    rt = RuntimeConfig(max_batch_size=256, max_seq_len=16, block_size=4, device=DEVICE, dtype="float32")
    llm = LLM(str(target.path), method, runtime=rt, engine_config=EngineConfig(max_batch_size=256))
    outs = _tokens(llm, [PROMPT] * n, [SamplingParams(seed=seed0 + i, max_new_tokens=3, temperature=1.0)
                                      for i in range(n)])
    counts = np.zeros((V, V, V))
    for o in outs:
        assert len(o) == 3, o
        counts[tuple(o)] += 1
    return counts, llm, outs


@pytest.fixture(scope="module")
def sampling_models(tiny_llama) -> dict[str, Any]:
    from test_sampling_exactness import V

    return {  # as the CPU sampling tests build them
        "target": tiny_llama(vocab=V, init=0.2, seed=0),
        "perturbed": tiny_llama(vocab=V, init=0.2, seed=0, perturb=0.005, perturb_seed=1),
        "unrelated": tiny_llama(vocab=V, init=0.2, seed=5, layers=1),
    }


@pytest.mark.parametrize("proposer", ["plain", "perturbed", "eagle3"])
def test_device_sampling_follows_the_target_distribution(sampling_models, proposer: str) -> None:
    """Seeded sampling on the device: the first three tokens follow the target's exact joint
    distribution (chi-square), and the same seeds give the same tokens again."""
    from test_sampling_exactness import N, P_PASS, PROMPT, exact_joint, gof_pvalue

    target = sampling_models["target"]
    method = {"plain": None,
              "perturbed": DraftModelConfig(path=str(sampling_models["perturbed"].path), num_speculative_tokens=GAMMA),
              "eagle3": Eagle3Config(path=str(head_for(target, "eagle3")), num_speculative_tokens=GAMMA)}[proposer]
    counts, llm, outs = _sample_joint(target, method, 200_000, N)
    p = gof_pvalue(counts, exact_joint(target.hf, PROMPT, temperature=1.0))
    print(f"{proposer} on {DEVICE}: chi-square p = {p:.3g}")
    if method is not None:
        assert llm.pipeline.stats().counts.proposed >= N  # speculation really happened
    assert p > P_PASS, f"{proposer} on {DEVICE}: chi-square p = {p:.3g}"
    again = _tokens(llm, [PROMPT] * 64, [SamplingParams(seed=200_000 + i, max_new_tokens=3, temperature=1.0)
                                        for i in range(64)])
    assert again == outs[:64]  # reproducible: a seed's tokens do not depend on the run


def test_device_sampling_test_rejects_a_residual_drawn_from_p(sampling_models, monkeypatch) -> None:
    """Negative control: the residual drawn from p instead of norm(max(0, p - q)) on the device
    must fail the chi-square test (it has teeth there too)."""
    from test_sampling_exactness import N, P_FAIL, PROMPT, _residual_is_p, exact_joint, gof_pvalue

    target = sampling_models["target"]
    _residual_is_p(monkeypatch)
    method = DraftModelConfig(path=str(sampling_models["unrelated"].path), num_speculative_tokens=GAMMA)
    counts, llm, _ = _sample_joint(target, method, 30_000, N)
    assert llm.pipeline.stats().counts.alpha < 0.6  # rejections are common: the bug shows
    p = gof_pvalue(counts, exact_joint(target.hf, PROMPT, temperature=1.0))
    print(f"planted bug on {DEVICE}: chi-square p = {p:.3g}")
    assert p < P_FAIL, f"the planted bug went unnoticed on {DEVICE}: chi-square p = {p:.3g}"


# -- compile / CUDA graphs ----------------------------------------------------------------------

@pytest.mark.parametrize("method", ["plain", "draft_model", "eagle3"])
def test_device_compiled_equals_eager(tiny_llama, method: str) -> None:
    """``runtime.compile=true`` (CUDA graphs on a GPU) gives eager's greedy tokens, float32."""
    target, draft = _models(tiny_llama)
    rt = {"device": DEVICE, "dtype": "float32", "tf32": False}
    eager = _tokens(_llm(target.path, _method(method, target, draft), **rt))
    compiled = _tokens(_llm(target.path, _method(method, target, draft), compile=True, **rt))
    assert compiled == eager
    assert eager == _cpu_plain(target)
