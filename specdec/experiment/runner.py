"""Plain decoding and every method over the same requests, batch by batch.

Each batch runs once per pipeline, the pipelines by turns of a few steps
(:func:`specdec.measure.lockstep`; the order rotated batch to batch), and
comes back as one record per request (the layout of ``results.jsonl``). The
analytic limit's bare forwards are contestants of every batch too (as in the
benchmarks: :func:`specdec.measure.limit_runs`); :meth:`Runner.forward_times` takes
their medians over the batches.

Prompts go through the target's chat template with ``data.chat=true``
(:mod:`specdec.data.chat`). A conversation (``data.turn=null``) runs turn by
turn: each pipeline's answer to turn i, decoded, goes into its own prompt for
turn i+1, so plain decoding and every method each continue their own
conversation (greedy: the same one). Its record keeps every turn's figures in
``turns`` (with its ``prompt_len``, and when outputs are saved its ``prompt``
text and ``output_ids``) and, in the entry itself, the totals over the turns:
tokens, times, speculation counts; ``equal_to_plain`` and ``first_mismatch``
compare all turns' outputs, concatenated.

A greedy output that differs from plain decoding's gets, in ``first_mismatch``,
the first differing position and the target's logit margin there (one target
forward over plain decoding's prefix, :func:`specdec.spec.exactness.difference`);
the run judges it by its exactness policy (a near tie or a mismatch).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import torch

from specdec.api import LLM
from specdec.conf_schema import Components
from specdec.core.context import SamplingParams, TextContext
from specdec.core.kv_cache import OutOfBlocks
from specdec.data.chat import ChatTemplate, ChatTemplateError, conversation_prompt, load_chat_template
from specdec.data.prompts import Prompt
from specdec.dist.group import current
from specdec.engine import drain
from specdec.experiment.rundir import PLAIN, ExperimentError
from specdec.experiment.summary import Repetition, merge_counts
from specdec.measure import (
    LIMIT_RUN,
    ForwardTimes,
    Run,
    limit_context,
    limit_from,
    limit_runs,
    lockstep,
    warm_up,
    with_room_for_bare,
)
from specdec.spec.exactness import difference, target_eps, target_logits
from specdec.spec.metrics import SpecCounts

log = logging.getLogger(__name__)

Item = tuple[str, list[int], SamplingParams]  # request id, prompt ids, sampling
LIMIT_CHUNKS = 4  # rounds of each bare forward of the analytic limit per batch (per turn)


@dataclass
class Request:
    prompt: Prompt
    ids: list[int]  # the prompt of the first (or only) turn
    sampling: SamplingParams
    text: str | None = None  # the text ``ids`` encode (rendered through the chat template); None: token ids

    @property
    def num_turns(self) -> int:
        return max(1, len(self.prompt.turns))


def request_seed(engine_seed: int, request_id: str) -> int:
    """A request's RNG seed from the run seed and its id (the same in a resumed run)."""
    h = hashlib.sha256(f"{engine_seed}:{request_id}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def _generate(llm: LLM, items: Sequence[Item]) -> list[TextContext]:
    """One pass: the requests through a fresh engine, under their own ids."""
    return drain(_generate_steps(llm, items, time.perf_counter))


def _generate_steps(llm: LLM, items: Sequence[Item],
                    clock: Callable[[], float]) -> Generator[object, None, list[TextContext]]:
    """:func:`_generate`, one engine step per ``next()``, its requests timed by ``clock`` (lockstep's)."""
    engine = llm.new_engine(clock)
    ctxs = [engine.add_request(ids, sp, request_id=rid) for rid, ids, sp in items]
    yield from engine.steps()
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
    e = {
        "output_len": len(gen),
        "finish_reason": ctx.finish_reason,
        "error": ctx.error,
        "time_s": lat,
        "time_share_s": wall / n,
        "tokens_per_s": len(gen) / lat if lat else None,
    }
    if ctx.error is None and None not in (ctx.t_first_token, ctx.t_finished):
        # After its first step (the prefill): what the analytic limit models.
        e["decode_s"] = ctx.t_finished - ctx.t_first_token  # type: ignore[operator]
        e["decode_tokens"] = ctx.num_generated - ctx.num_first_tokens
    if ctx.error is None:
        e["repetition"] = asdict(Repetition.of(gen))
    return e


def _failed_turn(error: str) -> dict[str, Any]:
    """The entry of a turn whose prompt could not be made (its chat template failed): no output."""
    return {"output_len": 0, "finish_reason": "error", "error": error, "time_s": 0.0, "time_share_s": 0.0,
            "tokens_per_s": None}


def _total(turns: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One pipeline's entry for a conversation: the totals over its ``turns`` (kept under ``turns``)."""
    out_len = sum(t["output_len"] for t in turns)
    lats = [t["time_s"] for t in turns]
    lat = None if None in lats else sum(lats)
    err = next((f"turn {i + 1}: {t['error']}" for i, t in enumerate(turns) if t["error"]), None)
    e: dict[str, Any] = {
        "output_len": out_len,
        "finish_reason": turns[-1]["finish_reason"],
        "error": err,
        "time_s": lat,
        "time_share_s": sum(t["time_share_s"] for t in turns),
        "tokens_per_s": out_len / lat if lat else None,
    }
    if all("decode_s" in t for t in turns):
        e["decode_s"] = sum(t["decode_s"] for t in turns)
        e["decode_tokens"] = sum(t["decode_tokens"] for t in turns)
    if err is None:
        e["repetition"] = asdict(sum((Repetition(**t["repetition"]) for t in turns), Repetition()))
    if "gamma" in turns[0]:
        e["gamma"] = turns[0]["gamma"]
        if all("steps" in t for t in turns):
            e.update(_counts_dict(merge_counts(turns)[0]))
        e["draft_time_s"] = sum(t.get("draft_time_s", 0.0) for t in turns)
        e["target_time_s"] = sum(t.get("target_time_s", 0.0) for t in turns)
        if all("phase_s" in t for t in turns):
            e["phase_s"] = {p: sum(t["phase_s"][p] for t in turns) for p in turns[0]["phase_s"]}
            e["spec_steps"] = sum(t["spec_steps"] for t in turns)
    e["turns"] = list(turns)
    return e


def _compare(e: dict[str, Any], out: Sequence[int], plain: dict[str, Any], plain_out: Sequence[int],
             logits_at: Callable[[int], Any], eps: float) -> None:
    """Sets ``e``'s ``equal_to_plain`` (bit equality; None: not compared, a side failed) and
    ``first_mismatch`` (None, or :func:`~specdec.spec.exactness.difference`'s position and margin)."""
    compared = not (e["error"] or plain["error"])  # a failed side has no output to compare
    diff = difference(out, plain_out, logits_at, eps) if compared else None
    e["equal_to_plain"] = diff is None if compared else None
    e["first_mismatch"] = diff


def _conversation_logits(turn_logits: Callable[[int, int], Any], outs: Sequence[Sequence[int]], i: int) -> Any:
    """``turn_logits`` at position ``i`` of the turns' outputs concatenated."""
    for t, o in enumerate(outs):
        if i < len(o):
            return turn_logits(t, i)
        i -= len(o)
    return None


class Runner:
    """The plain pipeline and one per method, over the same target and runtime."""

    def __init__(self, comps: Components, *, save_outputs: bool) -> None:
        self.comps = comps
        self.save_outputs = save_outputs
        self.max_prompt_tokens: int | None = comps.data.max_prompt_tokens
        # before any model loads: a missing template fails at once, naming the file
        self.chat: ChatTemplate | None = load_chat_template(
            comps.target, time_limit_s=comps.data.chat_time_limit_s, max_chars=comps.data.chat_max_chars
        ) if comps.data.chat else None
        self.llms: dict[str, LLM] = {}
        # Room in each cache for the limit's bare forwards, timed beside a batch's requests.
        runtime = with_room_for_bare(comps.runtime)
        for name, mcfg in {PLAIN: None, **comps.methods}.items():
            try:
                self.llms[name] = LLM(comps.target, mcfg, runtime, comps.engine)
            except (ValueError, KeyError, OSError) as e:
                what = "plain decoding of the target" if mcfg is None else f"method {name!r}"
                raise ExperimentError(f"cannot build {what}: {e}") from e
        self.gammas = {name: int(m.num_speculative_tokens) for name, m in comps.methods.items()}
        # Every batch's rounds of the analytic limit's bare forwards (measure.limit_runs), by contestant.
        self.bare_rounds: dict[str, list[list[float]]] = {}
        self.no_room_for_bare = False  # a bare forward did not fit in the KV cache: no limit
        # A differing greedy output's margin: the plain target's logits, in its compute dtype's precision.
        self.eps = target_eps(self.plain.pipeline.target)  # type: ignore[attr-defined]

    @property
    def plain(self) -> LLM:
        return self.llms[PLAIN]

    def encode(self, prompts: Sequence[Prompt], max_prompt_tokens: int | None) -> list[Request]:
        """The requests of ``prompts``: their (first turn's) prompt ids and sampling."""
        self.max_prompt_tokens = max_prompt_tokens
        out = []
        for p in prompts:
            if p.token_ids is not None:
                if self.chat is not None:
                    raise ExperimentError(f"prompt {p.id!r} is token ids: data.chat=true renders text prompts "
                                          "through the chat template; give text, or set data.chat=false")
                text, ids = None, list(p.token_ids)[-max_prompt_tokens:] if max_prompt_tokens else list(p.token_ids)
            else:
                text = self.prompt_text(p, [])
                ids = self.prompt_ids(p, text)
            sp = self.comps.sampling
            seed = sp.seed if sp.seed is not None else request_seed(self.comps.engine.seed, p.id)
            out.append(Request(p, ids, replace(sp, seed=seed), text))
        return out

    def prompt_text(self, p: Prompt, answers: Sequence[str]) -> str:
        """The text of the prompt for turn ``len(answers)`` of ``p``, after those answers."""
        assert p.text is not None
        turns = p.turns or (p.text,)
        return conversation_prompt(turns[: len(answers) + 1], answers, self.chat, prompt_id=p.id)

    def prompt_ids(self, p: Prompt, text: str) -> list[int]:
        """``p``'s prompt ``text`` encoded (a rendered chat template brings its own special tokens), the
        last ``max_prompt_tokens`` kept."""
        tok = self.plain.tokenizer
        if tok is None:
            raise ExperimentError(
                f"target.path {str(self.comps.target)!r} has no tokenizer.json: prompt {p.id!r} is text; "
                "give token ids in the prompt file instead"
            )
        ids = list(tok.encode(text, add_special_tokens=self.chat is None).ids)
        return ids[-self.max_prompt_tokens:] if self.max_prompt_tokens else ids

    def warmup(self, reqs: Sequence[Request], n: int, tokens: int) -> None:
        """``n`` untimed requests of ``tokens`` new tokens through every pipeline."""
        if not n or not reqs:
            return
        items = [(f"warmup-{i}", reqs[i % len(reqs)].ids, replace(reqs[i % len(reqs)].sampling, max_new_tokens=tokens))
                 for i in range(n)]
        warm_up({name: Run(partial(_generate, llm, items)) for name, llm in self.llms.items()})

    def run_batch(self, reqs: Sequence[Request], batch_index: int) -> list[dict[str, Any]]:
        """One batch through every pipeline, interleaved, turn by turn; one record per request."""
        by_id = {r.prompt.id: r for r in reqs}
        # per pipeline and request: each turn's entry, output ids and prompt (its own conversation)
        turns: dict[str, dict[str, list[dict[str, Any]]]] = {name: {rid: [] for rid in by_id} for name in self.llms}
        outs: dict[str, dict[str, list[list[int]]]] = {name: {rid: [] for rid in by_id} for name in self.llms}
        prompts: dict[str, dict[str, tuple[str | None, list[int]]]] = {
            name: {rid: (r.text, r.ids) for rid, r in by_id.items()} for name in self.llms}
        ended: dict[str, set[str]] = {name: set() for name in self.llms}  # a failed turn ends its conversation
        plain_prompts: dict[str, list[list[int]]] = {rid: [] for rid in by_id}  # each turn's, for margins
        for t in range(max(r.num_turns for r in reqs)):
            items = {name: [(rid, prompts[name][rid][1], r.sampling) for rid, r in by_id.items()
                            if r.num_turns > t and rid not in ended[name]]
                     for name in self.llms}
            if not any(items.values()):
                break
            self._run_turn(items, batch_index + t, turns, outs)
            for rid, ids, _ in items[PLAIN]:
                plain_prompts[rid].append(ids)
            for name, its in items.items():
                for rid, ids, _ in its:
                    e, r = turns[name][rid][t], by_id[rid]
                    if e["error"]:
                        ended[name].add(rid)
                    if r.num_turns == 1:
                        continue
                    e["prompt_len"] = len(ids)
                    if self.save_outputs:
                        e["prompt"] = prompts[name][rid][0]
                    if not e["error"] and t + 1 < r.num_turns:
                        answers = [self.plain.decode(o) or "" for o in outs[name][rid]]  # up to this turn's
                        try:
                            text = self.prompt_text(r.prompt, answers)
                        except ChatTemplateError as exc:  # renders this pipeline's own answers: its turn fails
                            turns[name][rid].append(_failed_turn(str(exc)))
                            outs[name][rid].append([])
                            ended[name].add(rid)
                            continue
                        prompts[name][rid] = text, self.prompt_ids(r.prompt, text)
        now = time.time()
        return [self._record(r, turns, outs, plain_prompts[r.prompt.id], batch_index, len(reqs), now) for r in reqs]

    def _run_turn(
        self,
        items: dict[str, list[Item]],
        offset: int,
        turns: dict[str, dict[str, list[dict[str, Any]]]],
        outs: dict[str, dict[str, list[list[int]]]],
    ) -> None:
        """One turn: each pipeline's ``items`` (interleaved, timed); appends each request's entry and output."""
        runs = {name: Run(partial(_generate, llm, items[name]), before=llm.pipeline.reset_stats,
                          steps=partial(_generate_steps, llm, items[name]))
                for name, llm in self.llms.items()}
        runs |= self._limit_runs(items[PLAIN])
        # Tensor-parallel ranks run every forward together: each turn ends where rank 0's clock ends it.
        timing = lockstep(runs, baseline=PLAIN, repeats=1, warmup=0, offset=offset, decide=current().decide)
        for key, rounds in timing.outputs.items():
            if key.startswith(LIMIT_RUN):
                self.bare_rounds.setdefault(key, []).extend(rounds)
        for name, llm in self.llms.items():
            n = len(items[name])
            if not n:
                continue
            wall = timing.times[name][0]
            stats = llm.pipeline.stats() if name != PLAIN else None
            for c in timing.last(name):
                e = _entry(c, wall, n)
                if stats is not None:
                    e["gamma"] = self.gammas[name]
                    counts = stats.per_request.get(c.request_id)
                    if counts is not None:
                        e.update(_counts_dict(counts))
                    e["draft_time_s"] = stats.draft_time_s / n
                    e["target_time_s"] = stats.target_time_s / n
                    # The step-time breakdown (spec/metrics.py PhaseTimes): this request's share.
                    e["phase_s"] = {p: v / n for p, v in stats.phase_s.items()}
                    e["spec_steps"] = stats.spec_steps / n
                turns[name][c.request_id].append(e)
                outs[name][c.request_id].append(list(c.generated) if c.error is None else [])

    def _record(
        self,
        r: Request,
        turns: dict[str, dict[str, list[dict[str, Any]]]],
        outs: dict[str, dict[str, list[list[int]]]],
        plain_prompts: Sequence[list[int]],
        batch_index: int,
        batch_size: int,
        now: float,
    ) -> dict[str, Any]:
        """The ``results.jsonl`` line of ``r``: plain's and each method's entry (totals over turns)."""
        rid, multi = r.prompt.id, r.num_turns > 1
        plain_outs = outs[PLAIN][rid]
        turn_logits = self._logits_cache(rid, plain_prompts, plain_outs)

        def entry(name: str) -> tuple[dict[str, Any], list[int]]:
            ts, os_ = turns[name][rid], outs[name][rid]
            if self.save_outputs:
                for e, o in zip(ts, os_):
                    e["output_ids"] = o
                    if name == PLAIN:
                        e["text"] = self.plain.decode(o)
            return (_total(ts) if multi else ts[0]), [tok for o in os_ for tok in o]

        plain, plain_ids = entry(PLAIN)
        rec: dict[str, Any] = {
            "id": rid, "source": r.prompt.source, "prompt_len": len(r.ids), "num_turns": r.num_turns,
            "seed": r.sampling.seed, "batch": batch_index, "batch_size": batch_size, "completed_at": now,
            PLAIN: plain, "methods": {},
        }
        for name in self.comps.methods:
            e, out = entry(name)
            if multi:
                for t, (te, o, pe, po) in enumerate(zip(e["turns"], outs[name][rid], plain["turns"], plain_outs)):
                    _compare(te, o, pe, po, partial(turn_logits, t), self.eps)
            _compare(e, out, plain, plain_ids, partial(_conversation_logits, turn_logits, plain_outs), self.eps)
            rec["methods"][name] = e
        return rec

    def _logits_cache(self, rid: str, prompts: Sequence[list[int]],
                      outs: Sequence[list[int]]) -> Callable[[int, int], torch.Tensor | None]:
        """``(turn, i) ->`` the plain target's logits after turn ``turn``'s prompt and its first ``i``
        output tokens (the ones that chose token ``i``), each computed once; None in a sampled
        run (nothing to weigh) or where the forward cannot run (it says why)."""
        memo: dict[tuple[int, int], torch.Tensor | None] = {}

        def at(turn: int, i: int) -> torch.Tensor | None:
            if not self.comps.sampling.greedy or turn >= len(prompts):
                return None
            if (turn, i) not in memo:
                try:
                    memo[turn, i] = target_logits(self.plain.pipeline.target,  # type: ignore[attr-defined]
                                                  [*prompts[turn], *outs[turn][:i]])
                except (OutOfBlocks, RuntimeError, ValueError) as e:
                    log.warning("request %s: no logit margin for its first difference from plain decoding: %s",
                                rid, e)
                    memo[turn, i] = None
            return memo[turn, i]
        return at

    def _limit_runs(self, plain_items: Sequence[Item]) -> dict[str, Run[list[float]]]:
        """The bare forwards of each method's analytic limit as contestants of a turn
        (:func:`specdec.measure.limit_runs`, as the benchmarks time them): ``LIMIT_CHUNKS``
        rounds each, at the turn's mean decode context, each forward feeding as many requests
        as the turn has (a batch's step). A forward that does not fit beside the batch in
        the KV cache (a ``runtime.num_blocks`` set too small) says so once and
        leaves the limit missing; the batch's own results stand."""
        if not self.comps.methods or not plain_items or self.no_room_for_bare:
            return {}
        ctx_len = limit_context([len(ids) for _, ids, _ in plain_items], self.comps.sampling.max_new_tokens)
        methods = {name: self.llms[name] for name in self.comps.methods}
        return {k: replace(run, steps=self._no_room_ends(run)) for k, run in
                limit_runs(methods, ctx_len, requests=len(plain_items), chunks=LIMIT_CHUNKS).items()}

    def _no_room_ends(self, run: Run[list[float]]) -> Callable[[Callable[[], float]], Generator[None, None, Any]]:
        """``run``'s steps, ending with no rounds (and the warning, once) where a bare forward does not fit."""
        def steps(clock: Callable[[], float]) -> Generator[None, None, list[float]]:
            assert run.steps is not None
            try:
                return (yield from run.steps(clock))
            except OutOfBlocks as e:
                if not self.no_room_for_bare:
                    log.warning("no analytic limit: %s", e)
                self.no_room_for_bare = True
                return []
        return steps

    def forward_times(self) -> dict[str, ForwardTimes]:
        """Each method's bare forward times for its analytic limit, from the rounds timed
        within the batches run so far (empty: none timed, or one did not fit)."""
        if self.no_room_for_bare or not self.bare_rounds:
            return {}
        return limit_from(self.bare_rounds, {name: self.llms[name] for name in self.comps.methods})
