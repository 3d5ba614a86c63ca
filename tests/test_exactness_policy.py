"""The exactness policy: a greedy difference from plain decoding at a near tie of the target's
logits is reported as such (tolerant), anything else is a mismatch (and strict: every one).

Synthetic logits for the classification; then runs on the tiny pair of :mod:`test_experiment`
whose method gets one token wrong on purpose: the target's runner-up there (a near tie
under a bound above its margin) or its last choice (far beyond it).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_experiment import _compose, _lines, _overrides, tiny_pair  # noqa: F401 (a fixture)

from specdec.conf_schema import ConfigError, to_run_config
from specdec.experiment import OutputsDiffer, run_experiment, summarize
from specdec.spec.exactness import ExactnessPolicy, compute_eps, difference, target_logits

BF16 = compute_eps(torch.bfloat16)
# The target's logits at position 1: token 0 first, token 1 a close second (0.1 below), token 2 far below.
LOGITS = torch.tensor([20.0, 19.9, 3.0, 0.0])
REF = [0, 0, 1]  # plain decoding chose token 0 at position 1


def _judge(policy: ExactnessPolicy, out: list[int], logits: torch.Tensor = LOGITS) -> dict:
    return policy.judge(difference(out, REF, lambda i: logits if i == 1 else None, BF16))


def test_a_difference_at_a_near_tie_is_a_near_tie_with_its_margin_and_anything_else_a_mismatch():
    tolerant = ExactnessPolicy.resolve("tolerant", "cuda")
    tie = _judge(tolerant, [0, 1, 1])  # the runner-up, 0.1 below: within 4 bf16 ulps at 20 (0.5)
    assert tie["class"] == "near_tie" and tie["position"] == 1
    assert tie["margin"] == pytest.approx(0.1, abs=1e-5) and tie["bound"] == pytest.approx(4 * 0.125)
    far = _judge(tolerant, [0, 2, 1])  # 17 below the top
    assert far["class"] == "mismatch" and far["margin"] == pytest.approx(17.0)
    # A close top two do not excuse a token far below them: the margin weighs the method's token.
    assert _judge(tolerant, [0, 3, 1])["class"] == "mismatch"
    assert _judge(ExactnessPolicy("tolerant", tie_margin=0.05), [0, 1, 1])["class"] == "mismatch"  # a stated bound
    assert _judge(ExactnessPolicy("tolerant", tie_margin=0.2), [0, 1, 1])["class"] == "near_tie"
    # One output ends where the other goes on: no token to weigh, a mismatch.
    short = ExactnessPolicy("tolerant").judge(difference([0, 0], REF, lambda i: LOGITS, BF16))
    assert (short["position"], short["margin"], short["class"]) == (2, None, "mismatch")
    assert difference(REF, REF, lambda i: LOGITS, BF16) is None


def test_strict_makes_a_near_tie_a_mismatch_and_auto_is_strict_on_cpu_only():
    for strict in (ExactnessPolicy.resolve("strict", "cuda"), ExactnessPolicy.resolve("auto", "cpu")):
        tie = _judge(strict, [0, 1, 1])
        assert tie["class"] == "mismatch" and tie["margin"] == pytest.approx(0.1, abs=1e-5) and tie["bound"] is None
    assert ExactnessPolicy.resolve("auto", "cuda:1").mode == "tolerant"
    with pytest.raises(ValueError, match="exactness must be one of auto, strict, tolerant, got 'loose'"):
        ExactnessPolicy.resolve("loose", "cpu")


def test_the_summary_counts_near_ties_apart_and_only_a_mismatch_makes_outputs_unequal():
    def rec(rid: str, verdict: str | None) -> dict:
        fm = None if verdict is None else {"position": 3, "margin": 0.1, "ulp": 0.1, "bound": 0.4, "class": verdict}
        return {"id": rid, "prompt_len": 3, "plain": {"output_len": 4, "time_share_s": 0.1, "error": None},
                "methods": {"m": {"output_len": 4, "time_share_s": 0.05, "error": None, "steps": 2, "proposed": 4,
                                  "accepted": 2, "bonus": 2, "equal_to_plain": verdict is None,
                                  "first_mismatch": fm}}}

    s = summarize([rec("a", None), rec("b", "near_tie")], gammas={"m": 2}, greedy=True)
    m = s["methods"]["m"]
    assert s["outputs_equal"] is True and s["near_ties"] == 1 and m["near_ties"] == 1 and m["num_equal"] == 1
    assert m["first_near_tie"] == {"id": "b", "position": 3, "margin": 0.1, "bound": 0.4}
    assert m["first_mismatch"] is None
    s = summarize([rec("a", None), rec("b", "near_tie"), rec("c", "mismatch")], gammas={"m": 2}, greedy=True)
    assert s["outputs_equal"] is False and s["near_ties"] == 1
    assert s["methods"]["m"]["first_mismatch"] == {"id": "c", "position": 3, "margin": 0.1, "bound": 0.4}
    old = rec("d", None)  # a record from before verdicts: a bare position differs
    old["methods"]["m"].update(equal_to_plain=False, first_mismatch=3)
    assert summarize([old], gammas={"m": 2}, greedy=True)["outputs_equal"] is False


@pytest.mark.parametrize(("key", "value", "message"), [
    ("exactness", "loose", "exactness must be auto, strict or tolerant, got 'loose'"),
    ("exactness_tie_margin", "-0.5", "exactness_tie_margin must be a logit difference >= 0"),
])
def test_a_bad_exactness_setting_is_refused_naming_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        to_run_config(_compose([f"{key}={value}"]))


def test_strict_exactness_turns_tf32_off_and_the_others_leave_it():
    from specdec.conf_schema import build_components

    assert build_components(to_run_config(_compose(["exactness=strict"]))).runtime.tf32 is False
    assert build_components(to_run_config(_compose(["exactness=auto"]))).runtime.tf32 is True


# request id -> the target's rank (0: its choice; -1: its last) of the token the method puts at output
# position 2, and the least prompt length it does so at (a later turn's: a longer prompt)
_FLIPS: dict[str, tuple[int, int]] = {}


@pytest.fixture
def wrong_method(monkeypatch):
    """Every speculative pipeline's output of the requests in ``_FLIPS`` gets, at position 2, the
    token the target ranks there as said (the last rank: -1), as a GPU's rounding would at a tie."""
    from specdec.engine import Engine

    steps = Engine.steps

    def flipping(self):
        for ended in steps(self):
            for c in ended:
                rank, min_prompt = _FLIPS.get(c.request_id, (None, 0))
                if (rank is not None and hasattr(self.pipeline, "proposer") and c.num_generated > 2
                        and c.prompt_len >= min_prompt):
                    i = c.prompt_len + 2
                    order = target_logits(self.pipeline.target, c.tokens[:i]).argsort(descending=True)
                    c.tokens[i] = int(order[rank])
            yield ended

    monkeypatch.setattr(Engine, "steps", flipping)
    yield _FLIPS
    _FLIPS.clear()


def _first_mismatch(run_dir) -> dict[str, dict]:
    return {r["id"]: r["methods"]["ngram"]["first_mismatch"] for r in _lines(run_dir / "results.jsonl")}


def test_a_flip_at_a_near_tie_is_reported_and_a_flip_far_below_the_top_fails_the_run(tiny_pair, tmp_path,
                                                                                        wrong_method):
    def over(name: str, *extra: str) -> list[str]:
        return _overrides(tiny_pair, tmp_path / name, "logger=none", "plots=false", "warmup=0", "method=ngram",
                          *extra)

    # p0 gets the target's runner-up, p1 its last choice. Strict (CPU's default): both are mismatches.
    wrong_method.update(p0=(1, 0), p1=(-1, 0))
    with pytest.raises(OutputsDiffer, match=r"ngram \(request p0, position 2, logit margin [0-9.e-]+\)"):
        run_experiment(_compose(over("strict", "data.limit=2")))
    fm = _first_mismatch(tmp_path / "strict")
    assert [fm[r]["class"] for r in ("p0", "p1")] == ["mismatch", "mismatch"]
    tie, far = fm["p0"]["margin"], fm["p1"]["margin"]
    assert 0 < tie < far  # top-1 minus top-2, and minus the last

    # Tolerant, with a bound just above p0's margin: p0 a near tie, p1 still a mismatch (exit 3).
    bound = tie * 1.01 + 1e-6
    assert bound < far
    tolerant = ("exactness=tolerant", f"exactness_tie_margin={bound}")
    with pytest.raises(OutputsDiffer, match=r"ngram \(request p1, position 2, logit margin .* \(tie bound") as err:
        run_experiment(_compose(over("tolerant", "data.limit=2", *tolerant)))
    s = err.value.summary
    assert s["near_ties"] == 1 and s["methods"]["ngram"]["first_near_tie"]["id"] == "p0"
    fm = _first_mismatch(tmp_path / "tolerant")
    assert (fm["p0"]["class"], fm["p1"]["class"]) == ("near_tie", "mismatch")
    assert fm["p0"]["margin"] == pytest.approx(tie) and fm["p0"]["bound"] == pytest.approx(bound)

    # Only the near tie: the run ends well (exit 0), saying so.
    wrong_method.pop("p1")
    s = run_experiment(_compose(over("tie_only", "data.limit=2", *tolerant)))
    assert s["outputs_equal"] is True and s["near_ties"] == 1
    saved = json.loads((tmp_path / "tie_only" / "summary.json").read_text())
    assert saved["exactness"] == {"mode": "tolerant", "tie_margin": pytest.approx(bound)}
    assert saved["methods"]["ngram"]["near_ties"] == 1 and saved["methods"]["ngram"]["num_equal"] == 1
    assert _first_mismatch(tmp_path / "tie_only")["p1"] is None


def test_a_difference_in_a_later_turn_is_weighed_at_that_turns_prompt(tiny_pair, tmp_path, wrong_method):
    """A conversation's first difference (in its second turn): the conversation's position counts the
    turns before, and its margin is the one of that turn (the target's logits after its own prompt)."""
    from test_chat_and_categories import CONV, _conversation_run

    f = tmp_path / "question.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in CONV[:2]))
    wrong_method.update({"82": (1, len(CONV[1]["turns"][0]) + 1)})  # turn 2 only: the runner-up
    with pytest.raises(OutputsDiffer, match=r"ngram \(request 82, position 10, logit margin"):
        run_experiment(_compose(_conversation_run(tiny_pair, tmp_path / "run", f, "method=ngram")))
    e = {r["id"]: r for r in _lines(tmp_path / "run" / "results.jsonl")}["82"]["methods"]["ngram"]
    first, second = e["turns"]
    assert first["first_mismatch"] is None and second["first_mismatch"]["position"] == 2
    assert e["first_mismatch"]["position"] == first["output_len"] + 2 == 10
    assert e["first_mismatch"]["margin"] == pytest.approx(second["first_mismatch"]["margin"])
    # the runner-up after turn 2's prompt: within the target's top two, not far below
    assert 0 < e["first_mismatch"]["margin"] < 1.0


def test_benchmarks_judge_outputs_by_the_targets_logits_after_the_reference_prefix(tiny_pair):
    """:func:`specdec.measure.judge_outputs` (spec.py, compare_hf.py): the logits it weighs are those
    that chose the reference's token there (their argmax), and a runner-up there is a near tie
    under a bound above its margin, a mismatch when strict."""
    from specdec.api import LLM
    from specdec.core.context import SamplingParams
    from specdec.measure import judge_outputs

    llm = LLM(tiny_pair[0], max_seq_len=64, threads=1)
    target = llm.pipeline.target
    prompt = [5, 17, 33, 9, 41]
    ref = llm.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    logits = target_logits(target, [*prompt, *ref[:3]])
    top2 = logits.topk(2)
    assert int(top2.indices[0]) == ref[3]  # the logits that chose token 3
    margin = float(top2.values[0] - top2.values[1])
    out = [*ref[:3], int(top2.indices[1]), *ref[4:]]

    assert judge_outputs([ref], [ref], [prompt], target) == {"equal": True, "near_ties": 0, "first_mismatch": None}
    strict = judge_outputs([out], [ref], [prompt], target)  # auto: strict on CPU
    assert strict["equal"] is False and strict["near_ties"] == 0
    assert strict["first_mismatch"] == {"index": 0, "position": 3, "margin": pytest.approx(margin), "bound": None}
    tie = judge_outputs([ref, out], [ref, ref], [prompt, prompt], target, "tolerant", tie_margin=margin * 1.01)
    assert tie == {"equal": True, "near_ties": 1, "first_mismatch": None}
    below = judge_outputs([out], [ref], [prompt], target, "tolerant", tie_margin=margin * 0.99)
    assert below["equal"] is False and below["first_mismatch"]["position"] == 3
