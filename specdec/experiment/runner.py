"""Plain decoding and every method over the same requests, batch by batch.

Each batch runs once per pipeline, interleaved by :func:`specdec.measure.interleave`
(the order rotated batch to batch, so no pipeline always goes first), and
comes back as one record per request (the layout of ``results.jsonl``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from specdec.api import LLM
from specdec.conf_schema import Components
from specdec.core.context import SamplingParams, TextContext
from specdec.data.prompts import Prompt
from specdec.experiment.rundir import PLAIN, ExperimentError
from specdec.measure import ForwardTimes, Run, first_mismatch, interleave, limit_forward_times, warm_up
from specdec.spec.metrics import SpecCounts

Item = tuple[str, list[int], SamplingParams]  # request id, prompt ids, sampling


@dataclass
class Request:
    prompt: Prompt
    ids: list[int]
    sampling: SamplingParams


def request_seed(engine_seed: int, request_id: str) -> int:
    """A request's RNG seed from the run seed and its id (the same in a resumed run)."""
    h = hashlib.sha256(f"{engine_seed}:{request_id}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def _generate(llm: LLM, items: Sequence[Item]) -> list[TextContext]:
    """One pass: the requests through a fresh engine, under their own ids."""
    engine = llm.new_engine()
    ctxs = [engine.add_request(ids, sp, request_id=rid) for rid, ids, sp in items]
    engine.run()
    return ctxs


def _counts_dict(c: SpecCounts) -> dict[str, Any]:
    return {
        "steps": c.steps, "proposed": c.proposed, "accepted": c.accepted, "bonus": c.bonus,
        "tau": c.tau, "alpha": c.alpha, "reached": list(c.reached), "accepted_at": list(c.accepted_at),
        "accepted_hist": list(c.accepted_hist),
    }


def _entry(ctx: TextContext, wall: float, n: int) -> dict[str, Any]:
    """A request's figures in one pipeline's pass of ``n`` requests that took ``wall`` seconds."""
    gen = list(ctx.generated) if ctx.error is None else []
    lat = ctx.t_finished - ctx.t_added if ctx.t_finished is not None and ctx.t_added is not None else None
    return {
        "output_len": len(gen),
        "finish_reason": ctx.finish_reason,
        "error": ctx.error,
        "time_s": lat,
        "time_share_s": wall / n,
        "tokens_per_s": len(gen) / lat if lat else None,
    }


class Runner:
    """The plain pipeline and one per method, over the same target and runtime."""

    def __init__(self, comps: Components, *, save_outputs: bool) -> None:
        self.comps = comps
        self.save_outputs = save_outputs
        self.llms: dict[str, LLM] = {}
        for name, mcfg in {PLAIN: None, **comps.methods}.items():
            try:
                self.llms[name] = LLM(comps.target, mcfg, comps.runtime, comps.engine)
            except (ValueError, KeyError, OSError) as e:
                what = "plain decoding of the target" if mcfg is None else f"method {name!r}"
                raise ExperimentError(f"cannot build {what}: {e}") from e
        self.gammas = {name: int(m.num_speculative_tokens) for name, m in comps.methods.items()}

    @property
    def plain(self) -> LLM:
        return self.llms[PLAIN]

    def encode(self, prompts: Sequence[Prompt], max_prompt_tokens: int | None) -> list[Request]:
        out = []
        for p in prompts:
            if p.token_ids is not None:
                ids = list(p.token_ids)
            else:
                if self.plain.tokenizer is None:
                    raise ExperimentError(
                        f"target.path {str(self.comps.target)!r} has no tokenizer.json: prompt {p.id!r} is text; "
                        "give token ids in the prompt file instead"
                    )
                ids = self.plain.encode(p.text)
            if max_prompt_tokens is not None:
                ids = ids[-max_prompt_tokens:]
            sp = self.comps.sampling
            seed = sp.seed if sp.seed is not None else request_seed(self.comps.engine.seed, p.id)
            out.append(Request(p, ids, replace(sp, seed=seed)))
        return out

    def warmup(self, reqs: Sequence[Request], n: int, tokens: int) -> None:
        """``n`` untimed requests of ``tokens`` new tokens through every pipeline."""
        if not n or not reqs:
            return
        items = [(f"warmup-{i}", reqs[i % len(reqs)].ids, replace(reqs[i % len(reqs)].sampling, max_new_tokens=tokens))
                 for i in range(n)]
        warm_up({name: Run(partial(_generate, llm, items)) for name, llm in self.llms.items()})

    def run_batch(self, reqs: Sequence[Request], batch_index: int) -> list[dict[str, Any]]:
        """One batch through every pipeline, interleaved; one record per request."""
        items = [(r.prompt.id, r.ids, r.sampling) for r in reqs]
        runs = {name: Run(partial(_generate, llm, items), before=llm.pipeline.reset_stats)
                for name, llm in self.llms.items()}
        timing = interleave(runs, baseline=PLAIN, repeats=1, warmup=0, offset=batch_index)
        n = len(reqs)
        entries: dict[str, dict[str, dict[str, Any]]] = {}
        ids: dict[str, dict[str, list[int]]] = {}
        for name, llm in self.llms.items():
            wall = timing.times[name][0]
            ctxs = {c.request_id: c for c in timing.last(name)}
            entries[name] = {rid: _entry(c, wall, n) for rid, c in ctxs.items()}
            ids[name] = {rid: list(c.generated) if c.error is None else [] for rid, c in ctxs.items()}
            if name == PLAIN:
                continue
            stats = llm.pipeline.stats()
            for rid, e in entries[name].items():
                e["gamma"] = self.gammas[name]
                c = stats.per_request.get(rid)
                if c is not None:
                    e.update(_counts_dict(c))
                e["draft_time_s"] = stats.draft_time_s / n
                e["target_time_s"] = stats.target_time_s / n
        now = time.time()
        recs = []
        for r in reqs:
            rid = r.prompt.id
            plain, plain_ids = entries[PLAIN][rid], ids[PLAIN][rid]
            rec: dict[str, Any] = {
                "id": rid, "source": r.prompt.source, "prompt_len": len(r.ids), "seed": r.sampling.seed,
                "batch": batch_index, "batch_size": n, "completed_at": now,
                PLAIN: plain, "methods": {},
            }
            if self.save_outputs:
                plain["output_ids"] = plain_ids
                plain["text"] = self.plain.decode(plain_ids)
            for name in self.comps.methods:
                e, out = entries[name][rid], ids[name][rid]
                compared = not (e["error"] or plain["error"])  # a failed side has no output to compare
                mismatch = first_mismatch(out, plain_ids) if compared else None
                e["equal_to_plain"] = mismatch is None if compared else None
                e["first_mismatch"] = mismatch
                if self.save_outputs:
                    e["output_ids"] = out
                rec["methods"][name] = e
            recs.append(rec)
        return recs

    def forward_times(self, ctx_len: int) -> dict[str, ForwardTimes]:
        """Bare forward times of each method's models at ``ctx_len``, for its analytic limit."""
        return limit_forward_times({name: self.llms[name] for name in self.comps.methods}, ctx_len)
