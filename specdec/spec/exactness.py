"""When a greedy output that differs from plain decoding's is an error: the exactness policy.

On CPU the project's kernels give a row the same bits whatever its batch-mates, so
greedy speculation reproduces plain decoding bit for bit and any difference is a bug.
On a GPU in bfloat16 the library picks kernels by shape: a row verified among γ+1
can round differently from the same row decoded alone, and where the target's top
two logits are within that rounding of each other the argmax may flip. Such a flip
is not a bug of the method, and everything after it differs too.

So a differing request is described by :func:`difference` (policy-free facts: the
first differing position, the target's logit ``margin`` there, the ``ulp`` of the
compute dtype at the top logit's size) and judged by :class:`ExactnessPolicy`:

- ``strict``: any difference is a ``mismatch`` (bit equality; the default on CPU).
  On a GPU bit equality also needs float32 and batch-invariant kernels;
- ``tolerant``: a difference whose margin is at most the tie bound is a
  ``near_tie``, reported as such; anything else is a ``mismatch``;
- ``auto``: strict on CPU, tolerant on any other device.

The tie bound is ``exactness_tie_margin`` (an absolute logit difference) or, left
null, :data:`TIE_ULPS` ulps of the compute dtype at the top logit's magnitude.
Why 4: a logit is a dot product of a hidden state that was rounded to the dtype
after every layer; another reduction order moves each rounding by up to half an
ulp, and those do not all cancel, so a logit moves by about an ulp or two of its
own size, and the gap between two logits by twice that. In bfloat16 (8 significant
bits) at logits of 16-32 an ulp is 0.125, so the bound is 0.5; in float32 it is
~1e-5 (float32 with TF32 matmuls counts TF32's 11 significant bits).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

EQUAL, NEAR_TIE, MISMATCH = "equal", "near_tie", "mismatch"
MODES = ("auto", "strict", "tolerant")
TIE_ULPS = 4.0  # the default tie bound, in ulps of the compute dtype at the top logit (see the module doc)


def compute_eps(dtype: torch.dtype, device: str = "cpu") -> float:
    """Relative spacing (machine epsilon) of the numbers a forward in ``dtype`` rounds to:
    float32 on CUDA with TF32 matmuls allowed rounds its matmul inputs to TF32's 2^-10."""
    if dtype == torch.float32 and device.startswith("cuda") and torch.backends.cuda.matmul.allow_tf32:
        return 2.0**-10
    return float(torch.finfo(dtype).eps)


def target_eps(pm: Any) -> float:
    """:func:`compute_eps` of a target's (:class:`~specdec.core.pipeline_model.DecoderPipelineModel`)
    forward: its runtime's compute dtype or, left to the checkpoint, its weights', on its device."""
    dtype = pm.runtime.torch_dtype or next(
        (p.dtype for p in pm.module.parameters() if p.is_floating_point()), torch.float32)
    return compute_eps(dtype, pm.runtime.device)


def ulp_at(value: float, eps: float) -> float:
    """The spacing of numbers of relative spacing ``eps`` at ``|value|`` (at least 1's)."""
    return eps * 2.0 ** math.floor(math.log2(max(abs(value), 1.0)))


def difference(out: Sequence[int], ref: Sequence[int], logits_at: Callable[[int], torch.Tensor | None],
               eps: float) -> dict[str, Any] | None:
    """Where ``out`` first differs from the reference ``ref``, and the target's margin there; None: equal.

    ``logits_at(i)``: the target's logits ``[V]`` that chose ``ref[i]`` (after the prompt and
    ``ref[:i]``), or None where they cannot be had. ``margin`` = the top logit minus the lower
    of the logits of ``ref[i]`` and ``out[i]``: both tokens must be near the top for a tie
    (it is top-1 minus top-2 when the two are the target's first and second choice). Where one
    output ends first (a prefix of the other) there is no token to weigh: ``margin`` None.
    Returns ``{"position", "margin", "ulp"}``; :meth:`ExactnessPolicy.judge` adds the verdict.
    """
    i = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
    if i is None:
        if len(out) == len(ref):
            return None
        return {"position": min(len(out), len(ref)), "margin": None, "ulp": None}
    logits = logits_at(i)
    if logits is None:
        return {"position": i, "margin": None, "ulp": None}
    row = logits.detach().float().reshape(-1)
    top = row.max().item()
    margin = top - min(row[ref[i]].item(), row[out[i]].item())
    return {"position": i, "margin": margin, "ulp": ulp_at(top, eps)}


@dataclass(frozen=True)
class ExactnessPolicy:
    """How a differing greedy output is judged (see the module doc); ``mode`` resolved:
    strict or tolerant. ``tie_margin``: the tie bound as a logit difference; None: TIE_ULPS ulps."""

    mode: str = "strict"
    tie_margin: float | None = None

    @classmethod
    def resolve(cls, mode: str, device: str, tie_margin: float | None = None) -> ExactnessPolicy:
        """``mode`` of :data:`MODES` for a run on ``device`` (auto: strict on CPU, else tolerant)."""
        if mode not in MODES:
            raise ValueError(f"exactness must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "auto":
            mode = "strict" if device.split(":")[0] == "cpu" else "tolerant"
        return cls(mode, tie_margin)

    def bound(self, ulp: float | None) -> float | None:
        """The largest margin that is a near tie, for a difference whose ``ulp`` is given (None:
        strict, where none is)."""
        if self.mode == "strict":
            return None
        if self.tie_margin is not None:
            return self.tie_margin
        return None if ulp is None else TIE_ULPS * ulp

    def classify(self, diff: Mapping[str, Any] | None) -> str:
        """``equal`` (no difference), ``near_tie`` or ``mismatch``."""
        if diff is None:
            return EQUAL
        bound, margin = self.bound(diff.get("ulp")), diff.get("margin")
        if self.mode == "tolerant" and margin is not None and bound is not None and margin <= bound:
            return NEAR_TIE
        return MISMATCH

    def judge(self, diff: Mapping[str, Any] | int | None) -> dict[str, Any] | None:
        """``diff`` (:func:`difference`'s) with its ``bound`` and ``class``; a bare position (a
        record from before margins were kept) is a mismatch with no margin."""
        if diff is None:
            return None
        d = {"position": diff, "margin": None, "ulp": None} if isinstance(diff, int) else dict(diff)
        return {**d, "bound": self.bound(d.get("ulp")), "class": self.classify(d)}

    def judge_record(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Sets the verdict on every method entry (and turn) of a ``results.jsonl`` record, in place."""
        for e in rec["methods"].values():
            for x in [e, *e.get("turns", ())]:
                if "first_mismatch" in x:
                    x["first_mismatch"] = self.judge(x["first_mismatch"])
        return rec


def target_logits(pm: Any, tokens: Sequence[int]) -> torch.Tensor:
    """The logits ``[V]`` a target (:class:`~specdec.core.pipeline_model.DecoderPipelineModel`)
    gives after ``tokens``: one prefill forward of a throwaway request, its KV blocks freed
    after. It is not the plain run's own decode step (another shape), so on a GPU its margin
    may differ from that step's by the same few ulps the policy allows for."""
    from specdec.core.context import SamplingParams, TextContext

    ctx = TextContext(request_id="__exactness__", tokens=list(tokens), prompt_len=len(tokens),
                      sampling=SamplingParams())
    try:
        pm.reserve(ctx, len(tokens))
        batches: list[list[TextContext]] = [[ctx]] + [[] for _ in pm.caches[1:]]
        with torch.inference_mode():
            packed = pm.processor.prepare_initial_token_inputs(batches, return_n_logits=1, with_state=False)
            return pm.execute(packed).logits[-1].float().cpu()
    finally:
        pm.free(ctx)
