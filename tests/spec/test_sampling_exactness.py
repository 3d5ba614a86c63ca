"""Speculative *sampling* is lossless: the output distribution is the target's.

On a tiny-vocabulary target (V = 8) the joint distribution of the first three
generated tokens has only 8³ = 512 cells, so it is computed *exactly* by
enumerating every continuation with the HF model's softmax (after the same
temperature / top-k / top-p). Thousands of requests, each with its own fixed
seed, are sampled through ``LLM.generate`` and compared with that exact
distribution by a chi-square goodness-of-fit test (cells with an expected
count below 5 pooled into one). Everything is seeded: the p-values are the
same on every run.

The test is shown to have teeth: with the residual distribution
``norm(max(0, p - q))`` replaced by the target's ``p`` (a classic bug), the
same test rejects for a drafter that rarely agrees with the target.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import EngineConfig
from specdec.sampling import LANE_RESIDUAL, LANE_TARGET, sample_from, uniform
from specdec.spec import draft_and_verify as spec_pipeline
from specdec.spec import verify as spec_verify
from specdec.spec.proposers.draft_model import DraftModelConfig
from specdec.spec.proposers.eagle import Eagle3Config, EagleConfig
from specdec.spec.proposers.medusa import MedusaConfig
from specdec.spec.proposers.ngram import NgramConfig

from eagle_heads import head_for  # tests/spec/eagle_heads.py
from medusa_heads import medusa_for  # tests/spec/medusa_heads.py
from echo_drafter import EchoConfig  # tests/spec/echo_drafter.py

V = 8
N = 4000  # requests per case
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive: n-gram lookup proposes "3, 1, 2"
P_PASS = 1e-3  # a correct sampler must not be rejected at this level ...
P_FAIL = 1e-3  # ... and the planted bug must be
GAMMA = 3
TOPK_TOPP = dict(temperature=0.8, top_k=5, top_p=0.9)


@pytest.fixture(scope="module")
def models(tiny_llama) -> dict[str, Any]:
    # init 0.2: first-token entropy high enough that ~90 of the 512 cells
    # expect >= 5 of 4000 samples.
    return {
        "target": tiny_llama(vocab=V, init=0.2, seed=0),
        # Perturbed target: agrees often (α ≈ 0.85 at temperature 1).
        "perturbed": tiny_llama(vocab=V, init=0.2, seed=0, perturb=0.005, perturb_seed=1),
        # Unrelated random model: agrees rarely (α ≈ 0.3).
        "unrelated": tiny_llama(vocab=V, init=0.2, seed=5, layers=1),
    }


def _filter(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Reference temperature / top-k / top-p on logits [..., V] (written independently)."""
    p = torch.softmax(logits.double() / temperature, -1)
    if top_k:
        kth = p.topk(top_k, dim=-1).values[..., -1:]
        p = torch.where(p >= kth, p, torch.zeros_like(p))
        p = p / p.sum(-1, keepdim=True)
    if top_p < 1.0:
        srt, idx = p.sort(dim=-1, descending=True)
        before = srt.cumsum(-1) - srt  # mass of the tokens ranked above
        keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, idx, before < top_p)
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum(-1, keepdim=True)
    return p


def exact_joint(hf: Any, prompt: list[int], **sampling: Any) -> np.ndarray:
    """P(t1, t2, t3 | prompt) for every (t1, t2, t3): [V, V, V], from HF logits."""
    seqs = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])  # [V², n+2]
    with torch.no_grad():
        logits = hf(seqs).logits.double()  # [V², n+2, V]
    n = len(prompt)
    p1 = _filter(logits[0, n - 1], **sampling)  # [V]
    p2 = _filter(logits[::V, n], **sampling)  # [V]: row a = P(t2 | a)
    p3 = _filter(logits[:, n + 1], **sampling).view(V, V, V)  # [a, b, :]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    assert abs(float(joint.sum()) - 1.0) < 1e-9
    return joint.numpy()


def sample_joint(target: Any, method: Any, *, seed0: int, n: int = N, **sampling: Any) -> tuple[np.ndarray, Any]:
    """Counts [V, V, V] of the first three tokens over ``n`` seeded requests."""
    rt = RuntimeConfig(max_batch_size=256, max_seq_len=16, block_size=4)
    llm = LLM(str(target.path), method, runtime=rt, engine_config=EngineConfig(max_batch_size=256))
    sps = [SamplingParams(seed=seed0 + i, max_new_tokens=3, **sampling) for i in range(n)]
    outs = llm.generate([PROMPT] * n, sps)
    counts = np.zeros((V, V, V))
    for o in outs:
        assert len(o.token_ids) == 3, o
        counts[tuple(o.token_ids)] += 1
    return counts, llm


def gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells expecting < 5 are pooled into one."""
    assert not counts[probs == 0].any(), "sampled a continuation of probability 0"
    exp = probs.reshape(-1) * counts.sum()
    obs = counts.reshape(-1)
    big = exp >= 5
    small = ~big & (exp > 0)  # cells of probability 0 were checked above and drop out
    f_obs, f_exp = obs[big], exp[big]
    if exp[small].sum() > 0:
        f_obs = np.append(f_obs, obs[small].sum())
        f_exp = np.append(f_exp, exp[small].sum())
    f_exp = f_exp * (f_obs.sum() / f_exp.sum())  # equal totals, as chisquare wants
    assert big.sum() >= 30  # enough cells for the test to mean something
    return float(chisquare(f_obs, f_exp).pvalue)


def plant_uniform_tree_q(monkeypatch: Any) -> None:
    """Planted bug for the tree tests' negative controls: a top-k tree's nodes verified
    as if drawn from the uniform distribution (q = 1/V), not as the point masses they
    are; nodes are accepted too often and the residual is wrong."""
    real = spec_pipeline.verify_tree_sampled

    def buggy(**kw: Any) -> Any:
        b, n = kw["tokens"].shape
        kw["draft_probs"] = torch.full((b, n, V), 1.0 / V)
        return real(**kw)

    monkeypatch.setattr(spec_pipeline, "verify_tree_sampled", buggy)


def _method(models, name: str, gamma: int = GAMMA) -> Any:
    if name == "plain":
        return None
    if name == "ngram":
        return NgramConfig(num_speculative_tokens=gamma, max_n=3, min_n=1)
    if name == "echo":  # drafts after verification, from the target's hidden states
        return EchoConfig(num_speculative_tokens=gamma)
    if name.startswith("eagle") and not name.startswith("eagle3"):  # EAGLE-1 heads (sampled drafts):
        # random, or echo (its q is the target's own p one position back)
        return EagleConfig(path=str(head_for(models["target"], name)), num_speculative_tokens=gamma)
    if name == "medusa-tree":  # random heads, a static Medusa-choices tree of deterministic top-k drafts
        return MedusaConfig(path=str(medusa_for(models["target"], "medusa")), num_speculative_tokens=gamma,
                            tree={"kind": "static", "choices": [[0], [1], [0, 0]]})
    if name.startswith("medusa"):  # Medusa heads (sampled drafts): random own lm heads, or echo (q = p one back)
        return MedusaConfig(path=str(medusa_for(models["target"], name)), num_speculative_tokens=gamma)
    if name == "eagle3":  # a random EAGLE-3 head, draft vocabulary 6 of the 8 tokens
        return Eagle3Config(path=str(head_for(models["target"], "eagle3-small-vocab")), num_speculative_tokens=gamma)
    return DraftModelConfig(path=str(models[name].path), num_speculative_tokens=gamma)


CASES = [
    # (proposer, sampling, seed0, expected α range)
    pytest.param("plain", dict(temperature=1.0), 0, None, id="plain"),
    pytest.param("plain", TOPK_TOPP, 10_000, None, id="plain-topk-topp"),
    pytest.param("perturbed", dict(temperature=1.0), 20_000, (0.7, 1.0), id="perturbed"),
    pytest.param("unrelated", dict(temperature=1.0), 30_000, (0.1, 0.45), id="unrelated"),
    pytest.param("perturbed", TOPK_TOPP, 40_000, (0.7, 1.0), id="perturbed-topk-topp"),
    pytest.param("unrelated", TOPK_TOPP, 50_000, (0.1, 0.5), id="unrelated-topk-topp"),
    pytest.param("ngram", dict(temperature=1.0), 60_000, (0.0, 1.0), id="ngram"),
    pytest.param("echo", dict(temperature=1.0), 70_000, (0.0, 1.0), id="echo-after-verify"),
    pytest.param("eagle", dict(temperature=1.0), 80_000, (0.05, 0.9), id="eagle"),
    pytest.param("eagle-echo", TOPK_TOPP, 85_000, (0.05, 0.95), id="eagle-echo-topk-topp"),
    pytest.param("eagle3", TOPK_TOPP, 90_000, (0.05, 0.9), id="eagle3-topk-topp"),
    pytest.param("medusa", dict(temperature=1.0), 95_000, (0.05, 0.9), id="medusa"),
    pytest.param("medusa-echo", TOPK_TOPP, 97_000, (0.05, 0.95), id="medusa-echo-topk-topp"),
    pytest.param("medusa-tree", dict(temperature=1.0), 98_000, (0.05, 0.95), id="medusa-static-tree"),
]


@pytest.mark.parametrize(("proposer", "sampling", "seed0", "alpha_range"), CASES)
def test_first_three_tokens_follow_the_target_distribution(models, proposer, sampling, seed0, alpha_range) -> None:
    target = models["target"]
    probs = exact_joint(target.hf, PROMPT, **sampling)
    counts, llm = sample_joint(target, _method(models, proposer), seed0=seed0, **sampling)
    p = gof_pvalue(counts, probs)
    print(f"chi-square p = {p:.3g}")  # shown with -rP / -s
    if alpha_range is not None:
        c = llm.pipeline.stats().counts
        print(f"alpha = {c.alpha:.3f}, tau = {c.tau:.3f}")
        lo, hi = alpha_range
        assert lo <= c.alpha <= hi, f"drafter premise: α = {c.alpha:.3f} not in {alpha_range}"
        assert c.proposed >= N  # speculation really happened (at least one draft per request)
    assert p > P_PASS, f"{proposer} {sampling}: chi-square p = {p:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["perturbed", "unrelated"])
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=6, top_p=0.95)])
def test_first_three_tokens_many_samples(models, proposer, sampling) -> None:
    # 5x the samples (more cells tested, finer deviations visible), γ = 2.
    target = models["target"]
    probs = exact_joint(target.hf, PROMPT, **sampling)
    counts, _ = sample_joint(target, _method(models, proposer, gamma=2), seed0=100_000, n=5 * N, **sampling)
    p = gof_pvalue(counts, probs)
    print(f"chi-square p = {p:.3g}")
    assert p > P_PASS, f"{proposer} {sampling}: chi-square p = {p:.3g}"


def _residual_is_p(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plants the bug: the recovered token is drawn from p instead of norm(max(0, p - q)).

    The pipeline calls ``verify_sampled`` through its module attribute; the
    wrapper runs the real one with ``sample_from`` (which ``verify`` calls
    through its module attribute) swapped, for the residual lane only, to
    sample the target's p.
    """
    real_verify, real_sample = spec_verify.verify_sampled, spec_verify.sample_from

    def buggy_verify(**kw: Any) -> Any:
        g = kw["draft_tokens"].shape[1]
        p = kw["target_probs"][:, :g]  # [B, γ, V]

        def sample(probs, seeds, positions, lane):
            return real_sample(p if lane == LANE_RESIDUAL else probs, seeds, positions, lane)

        with monkeypatch.context() as m:
            m.setattr(spec_verify, "sample_from", sample)
            return real_verify(**kw)

    monkeypatch.setattr(spec_pipeline, "verify_sampled", buggy_verify)


@pytest.mark.parametrize(("proposer", "seed0"), [("unrelated", 30_000), ("eagle3", 90_000)])
def test_the_test_rejects_a_residual_drawn_from_p(models, monkeypatch, proposer, seed0) -> None:
    target = models["target"]
    probs = exact_joint(target.hf, PROMPT, temperature=1.0)
    _residual_is_p(monkeypatch)
    counts, llm = sample_joint(target, _method(models, proposer), seed0=seed0, temperature=1.0)
    assert llm.pipeline.stats().counts.alpha < 0.6  # rejections are common: the bug shows
    p = gof_pvalue(counts, probs)
    print(f"chi-square p = {p:.3g}")
    assert p < P_FAIL, f"the planted bug went unnoticed: chi-square p = {p:.3g}"


# -- the counter-based sampler itself --------------------------------------------------------------

# (seed, position, lane, vocabulary entry) whose hash has all top 24 bits set.
# The former formula ((hash >> 8) + 0.5) / 2**24 rounded that to exactly 1.0
# in float32, so -log(u) = 0 and the exponential race returned this entry
# whatever its probability (nan for p = 0: argmax takes nan as the maximum);
# ~V / 2**24 of all draws, 0.8% of tokens at V = 128k. Found by brute force
# over seeds; kept as a regression case next to the hash-independent test.
U_ONE = (3045661, 4, LANE_TARGET, 3)


@pytest.mark.parametrize("hash_value", [0, 0xFFFFFFFF])
def test_uniform_of_the_extreme_hashes_is_strictly_inside_the_unit_interval(monkeypatch, hash_value) -> None:
    # Whatever the hash, u must lie in (0, 1): force every hash to its
    # smallest / largest 32-bit value (uniform calls _mix32 through the module).
    import specdec.sampling as sampling_mod

    monkeypatch.setattr(sampling_mod, "_mix32", lambda x: torch.full_like(x, hash_value))
    u = sampling_mod.uniform(torch.tensor([[7]]), torch.tensor([[3]]), LANE_TARGET, width=4)
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0, u


def test_uniform_is_strictly_inside_the_unit_interval() -> None:
    seed, pos, lane, j = U_ONE
    u = uniform(torch.tensor([seed]), torch.tensor([pos]), lane, width=V)  # [1, V]
    assert float(u.min()) > 0.0
    assert float(u[0, j]) < 1.0, "uniform() returned exactly 1.0 (then -log(u) = 0 in the exponential race)"


def test_sample_from_never_draws_a_zero_probability_token() -> None:
    # All mass on token 0. Entry 3's noise is the u = 1.0 above: p / -log(u) is
    # 0 / 0 = nan there, and argmax takes nan for the maximum.
    seed, pos, lane, j = U_ONE
    probs = torch.zeros(1, V)
    probs[0, 0] = 1.0
    tok = sample_from(probs, torch.tensor([seed]), torch.tensor([pos]), lane).item()
    assert tok == 0, f"drew token {tok} of probability 0"


def test_top_k_1_sampling_equals_greedy_for_every_seed(models, generate) -> None:
    # top_k = 1 leaves one token of probability 1: sampling must be greedy,
    # whatever the seed (including the U_ONE one: the first sampled token sits
    # at position len(prompt) = 4, lane TARGET).
    target = models["target"]
    seed, pos, _, j = U_ONE
    prompt = [5, 6, 7, 0]
    assert len(prompt) == pos
    (greedy,), _ = generate(target, None, [prompt], SamplingParams(max_new_tokens=3))
    assert greedy[0] != j  # so a draw of j is visibly wrong
    seeds = [0, 1, 2, seed]
    outs, _ = generate(target, None, [prompt] * len(seeds),
                       [SamplingParams(temperature=1.0, top_k=1, seed=s, max_new_tokens=3) for s in seeds])
    assert outs == [greedy] * len(seeds)


@pytest.mark.parametrize("proposer", ["draft_model", "ngram"])
def test_gamma_0_sampling_with_prefill_chunks_equals_plain_sampling_seed_for_seed(models, generate, proposer) -> None:
    # γ = 0: a step's prefill chunks share its target forward (their rows are
    # sampled and dropped). Counter-based draws: the same seeds give plain
    # decoding's tokens exactly.
    target = models["target"]
    method = (DraftModelConfig(path=str(models["perturbed"].path), num_speculative_tokens=0)
              if proposer == "draft_model" else NgramConfig(num_speculative_tokens=0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, V, int(rng.integers(3, 12))).tolist() for _ in range(12)]
    sps = [SamplingParams(seed=100 + i, max_new_tokens=6, **TOPK_TOPP) for i in range(len(prompts))]
    ec = EngineConfig(max_batch_size=8, max_tokens_per_step=9)  # prompts arrive in chunks beside decoding
    ref, _ = generate(target, None, prompts, sps, engine=ec, max_seq_len=32)
    out, _ = generate(target, method, prompts, sps, engine=ec, max_seq_len=32)
    assert out == ref
