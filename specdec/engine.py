"""The engine: continuous batching over a :class:`GenerationPipeline`.

Each :meth:`Engine.step` ends requests past their deadline, admits waiting
requests in order up to ``max_batch_size`` while the KV cache has room for
them and headroom for the running ones, gives each running request its tokens
for this step within a token budget (whole decode steps first, then prefill
chunks), reserves KV blocks — preempting the newest request on the replica
when blocks run out, to recompute it later — runs one pipeline step and
appends the new tokens, stopping each request exactly at EOS, a stop id,
a stop string (with a tokenizer: the output text ends before it) or
``max_new_tokens``.

Faults stay with their request: a bad request is rejected when added (its
error names it and the field), one that can never fit the cache too; a
pipeline's :class:`RequestFailure` ends that request only; and whatever
raises inside a step leaves every KV block and state slot free.
"""

from __future__ import annotations

import itertools
import operator
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from specdec.core.context import RequestError, RequestFailure, SamplingParams, Status, TextContext
from specdec.core.kv_cache import OutOfBlocks
from specdec.core.pipeline_model import GenerationPipeline
from specdec.detokenize import RequestText
from specdec.dist.group import current


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32
    max_tokens_per_step: int = 2048  # token budget of one step (prefill chunks share it)
    seed: int = 0  # draws the seeds of requests that bring none

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"engine.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_tokens_per_step < 1:
            raise ValueError(f"engine.max_tokens_per_step must be >= 1, got {self.max_tokens_per_step}")


@dataclass
class GenerationOutput:
    request_id: str
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    error: str | None = None
    prompt_len: int = 0
    # Timing (seconds, host clock; None for a rejected request). ttft_s: queued
    # to the first emitted tokens. decode_s: from then to the end, in which the
    # request emitted decode_tokens more (the first step's are not counted).
    ttft_s: float | None = None
    decode_s: float | None = None
    decode_tokens: int = 0

    @classmethod
    def from_context(cls, ctx: TextContext, text: str | None = None) -> GenerationOutput:
        timed = None not in (ctx.t_added, ctx.t_first_token, ctx.t_finished)
        return cls(
            request_id=ctx.request_id,
            token_ids=ctx.generated,
            text=text,
            finish_reason=ctx.finish_reason,
            error=ctx.error,
            prompt_len=ctx.prompt_len,
            ttft_s=ctx.t_first_token - ctx.t_added if timed else None,  # type: ignore[operator]
            decode_s=ctx.t_finished - ctx.t_first_token if timed else None,  # type: ignore[operator]
            decode_tokens=ctx.num_generated - ctx.num_first_tokens if timed else 0,
        )


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    tokens_generated: int = 0
    step_batch_sizes: list[int] = field(default_factory=list)


class Engine:
    """Continuous batching: requests join and leave the running batch.

    ``clock``: the host clock of every timestamp and deadline (tests pass their own).
    ``tokenizer``: decodes the output of requests with stop strings (and of those
    added with ``detokenize=True``) as it grows; without one, a request with
    stop strings is rejected.
    """

    def __init__(
        self,
        pipeline: GenerationPipeline,
        config: EngineConfig = EngineConfig(),
        *,
        eos_token_ids: Sequence[int] = (),
        num_replicas: int = 1,
        clock: Callable[[], float] = time.perf_counter,
        tokenizer: Any | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_replicas = num_replicas
        self.clock = clock
        self.tokenizer = tokenizer
        self._texts: dict[TextContext, RequestText] = {}  # requests whose text is followed
        self.waiting: deque[TextContext] = deque()
        self.running: list[TextContext] = []
        self.finished: list[TextContext] = []
        self.stats = EngineStats()
        self._live: dict[str, TextContext] = {}  # waiting or running, by id
        self._deadlines = 0  # of them, those with a deadline (none: no clock read to expire them)
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._next_replica = itertools.count()  # round-robin, apart from admission order

    # -- requests ------------------------------------------------------------------
    def add_request(
        self, prompt: Sequence[int], sampling: SamplingParams = SamplingParams(), request_id: str | None = None,
        *, detokenize: bool = False,
    ) -> TextContext:
        """Queues a request; a bad one is rejected (``status == REJECTED``, its
        ``error`` names it and what is wrong), never raised: a prompt that is not
        token ids, a bad sampling value, stop strings without a tokenizer, an id
        already queued or running, or a request too big for the whole KV cache.
        ``sampling.deadline_s`` counts from here. ``detokenize``: follow its
        text as it grows (:meth:`output_text`) even without stop strings (streaming)."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        try:
            tokens, bad_prompt = _token_ids(prompt), None
        except ValueError as e:
            tokens, bad_prompt = [], str(e)
        ctx = TextContext(
            request_id=rid, tokens=tokens, prompt_len=len(tokens), sampling=sampling,
            eos_token_ids=self.eos_token_ids,
        )
        try:
            if bad_prompt is not None:
                raise RequestError(f"request {rid!r}: {bad_prompt}")
            self._validate(ctx)
        except RequestError as e:
            ctx.reject(str(e))
            self.finished.append(ctx)
            return ctx
        ctx.t_added = self.clock()
        ctx.seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        ctx.replica = next(self._next_replica) % self.num_replicas
        if self.tokenizer is not None and (detokenize or sampling.stop_strings):
            self._texts[ctx] = RequestText(self.tokenizer, sampling.stop_strings)
        self.waiting.append(ctx)
        self._live[rid] = ctx
        self._deadlines += sampling.deadline_s is not None
        return ctx

    def _validate(self, ctx: TextContext) -> None:
        rid = ctx.request_id
        if not isinstance(ctx.sampling, SamplingParams):
            raise RequestError(f"request {rid!r}: sampling must be a SamplingParams, got {type(ctx.sampling).__name__}")
        try:
            ctx.sampling.validate()
        except ValueError as e:
            raise RequestError(f"request {rid!r}: {e}") from None
        if ctx.sampling.stop_strings and self.tokenizer is None:
            raise RequestError(f"request {rid!r}: sampling.stop {ctx.sampling.stop!r} needs the model's tokenizer "
                               "to find stop strings in the text, and there is none (no tokenizer.json)")
        if rid in self._live:
            raise RequestError(f"request {rid!r}: a request with this id is already queued or running")
        if not ctx.tokens:
            raise RequestError(f"request {rid!r}: empty prompt")
        vocab = self.pipeline.vocab_size
        bad = [t for t in ctx.tokens if not (0 <= t < vocab)]
        if bad:
            raise RequestError(f"request {rid!r}: token ids out of vocabulary [0, {vocab}): {bad[:5]}")
        max_seq = self.pipeline.max_seq_len
        if len(ctx.tokens) >= max_seq:
            raise RequestError(
                f"request {rid!r}: prompt of {len(ctx.tokens)} tokens does not fit max_seq_len "
                f"{max_seq} (needs room for at least one new token)"
            )
        total = self.pipeline.total_blocks()
        for name, need in self.pipeline.max_blocks(ctx).items():
            if need > total[name]:
                raise RequestError(
                    f"request {rid!r} can never fit the KV cache: {ctx.max_length(max_seq)} tokens (prompt "
                    f"{ctx.prompt_len} + max_new_tokens {ctx.sampling.max_new_tokens}, at most max_seq_len "
                    f"{max_seq}) with the step's lookahead need {need} KV blocks of the {name!r} cache, "
                    f"which has {total[name]}; raise runtime.num_blocks or lower max_new_tokens"
                )

    def output_text(self, ctx: TextContext) -> RequestText | None:
        """The output text the engine follows for ``ctx`` (None: it follows none)."""
        return self._texts.get(ctx)

    def abort(self, request_id: str) -> bool:
        """Ends a queued or running request now (finish_reason ``"abort"``, its
        tokens so far kept), freeing its KV blocks and state slot; the others go
        on untouched. False if no such request is queued or running."""
        ctx = self._live.get(request_id)
        if ctx is None:
            return False
        self._end(ctx, "abort", f"request {request_id!r} aborted after {ctx.num_generated} new tokens")
        return True

    # -- stepping ------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _end(self, ctx: TextContext, reason: str, error: str) -> None:
        ctx.end_early(reason, error)
        self._retire(ctx)

    def _retire(self, ctx: TextContext) -> None:
        """Takes an ended request out of the queue or the batch and frees what it holds."""
        if ctx in self.running:
            self.running.remove(ctx)
        else:
            self.waiting.remove(ctx)
        del self._live[ctx.request_id]
        self._deadlines -= ctx.sampling.deadline_s is not None
        self.pipeline.free(ctx)
        if ctx.t_finished is None:
            ctx.t_finished = self.clock()
        self.finished.append(ctx)

    def _expire(self) -> list[TextContext]:
        """Ends the requests whose deadline has passed (under tensor parallelism, those the
        group's first rank finds late: each rank reads its own clock, all must end the same)."""
        if not self._deadlines:
            return []
        now = self.clock()
        late_ids = current().decide(
            [k for k, c in self._live.items()  # (every queued request has its t_added)
             if c.sampling.deadline_s is not None and now - (c.t_added or 0.0) >= c.sampling.deadline_s],
            "the requests past their deadline")
        late = [self._live[k] for k in late_ids]
        for ctx in late:
            self._end(ctx, "deadline", f"request {ctx.request_id!r} passed its deadline of "
                                       f"{ctx.sampling.deadline_s} s after {ctx.num_generated} new tokens")
        return late

    def _admit(self) -> None:
        """Admits queued requests in order (per replica) while the batch has room
        and the replica's free KV blocks hold the request's whole context with
        headroom left for the next step of every request running there.
        Admitting past that only gets the newest preempted again at once: the
        engine would thrash. A request alone on its replica is always admitted
        (:meth:`_validate` made sure it fits an empty cache).

        A pipeline's state slots are shared by every engine on it (open streams,
        other calls on the same LLM), so a request claims its slot here: it waits
        for one while requests of this engine run (they free theirs as they end);
        with none running it could wait forever, so it is rejected, naming the slots."""
        if not self.waiting:
            return
        # The pipeline's own bound (state slots, KV sizing) caps the engine's.
        limit = min(self.config.max_batch_size, self.pipeline.max_batch_size)
        claim = getattr(self.pipeline, "claim_slot", None)  # (a speculative pipeline's state store)
        pending: dict[int, Counter[str]] = {}  # per replica: blocks the running requests' next steps need
        blocked: set[int] = set()  # replicas whose first queued request waits for room
        for ctx in list(self.waiting):
            if len(self.running) >= limit or len(blocked) == self.num_replicas:
                break
            r = ctx.replica
            if r in blocked:
                continue
            if r not in pending:
                pending[r] = Counter()
                for c in self.running:
                    if c.replica == r:
                        pending[r].update(self.pipeline.blocks_needed(c))
            need = pending[r] + Counter(self.pipeline.blocks_needed(ctx))
            free = self.pipeline.free_blocks(r)
            if any(c.replica == r for c in self.running) and any(n > free[k] for k, n in need.items()):
                blocked.add(r)
                continue
            if claim is not None and not claim(ctx):  # every state slot of its replica is held
                if any(c.replica == r for c in self.running):  # they free theirs as they end
                    blocked.add(r)
                    continue
                ctx.reject(f"request {ctx.request_id!r}: all {self.pipeline.max_batch_size} state slots of the "
                           "pipeline (runtime.max_batch_size) are held by requests outside this engine (open "
                           "streams or other engines on the same LLM): finish or close them, or raise max_batch_size")
                self._retire(ctx)
                continue
            pending[r] = need
            self.waiting.remove(ctx)
            ctx.status = Status.RUNNING
            ctx.arrival = next(self._arrivals)
            self.running.append(ctx)

    def _preempt(self, ctx: TextContext) -> None:
        """Frees a request's KV and state slot and sends it back to the head of the
        queue, to recompute when there is room again."""
        self.running.remove(ctx)
        self.pipeline.free(ctx)
        ctx.status = Status.WAITING
        self.waiting.appendleft(ctx)

    def _schedule(self) -> tuple[list[TextContext], list[int]]:
        budget = self.config.max_tokens_per_step
        batch: list[TextContext] = []
        num_new: list[int] = []
        unprocessed = self.pipeline.unprocessed
        wants = [(unprocessed(c), c) for c in self.running]
        if len(wants) > 1:  # requests in decode first (oldest first), then prefills in arrival order
            wants.sort(key=lambda w: (w[0] > 1, w[1].arrival))
        for want, ctx in wants:
            n = min(want, budget) if want > 1 else want
            if n < 1 or (n > budget and batch):
                continue
            batch.append(ctx)
            num_new.append(n)
            budget -= n
        return batch, num_new

    def _reserve(self, batch: list[TextContext], num_new: list[int]) -> tuple[list[TextContext], list[int]]:
        """Reserves KV for the step. When a request's replica runs out of blocks,
        preempts the newest request running there (last in line: first come,
        first served) and retries; the blocks reserved so far stay reserved."""
        batch, num_new = list(batch), list(num_new)
        i = 0
        while i < len(batch):
            try:
                self.pipeline.reserve(batch[i], num_new[i])
            except OutOfBlocks as e:
                rivals = [c for c in self.running if c.replica == batch[i].replica]
                victim = max(rivals, key=lambda c: c.arrival)
                if len(rivals) == 1:
                    # Alone and still short: something outside this engine holds
                    # blocks. Reject it (the queue goes on) rather than spin.
                    victim.reject(
                        f"request {victim.request_id!r} cannot get KV blocks with the cache to itself ({e}): "
                        "blocks are held outside this engine"
                    )
                    self._retire(victim)
                else:
                    self._preempt(victim)
                    self.stats.preemptions += 1
                if victim in batch:
                    j = batch.index(victim)
                    del batch[j], num_new[j]
                    if j < i:
                        i -= 1
                continue
            i += 1
        return batch, num_new

    def step(self) -> list[TextContext]:
        """One engine step; returns the requests that ended in it.

        Exception-safe: if anything raises inside (the pipeline, a
        KeyboardInterrupt), every running request frees its KV blocks and state
        slot and goes back to the queue (to recompute, as after a preemption)
        before the exception propagates: the pipeline holds nothing of the
        failed step and the engine can go on.
        """
        try:
            return self._step()
        except BaseException:
            for ctx in sorted(self.running, key=lambda c: c.arrival, reverse=True):
                if ctx.done:  # ended in the step, before it was retired
                    self._retire(ctx)
                else:
                    self._preempt(ctx)
            raise

    def _step(self) -> list[TextContext]:
        ended = self._expire()
        self._admit()
        batch, num_new = self._schedule()
        if not batch:
            return ended
        batch, num_new = self._reserve(batch, num_new)
        while not batch and self.running:
            # Every scheduled request was preempted (they held too few blocks to
            # make room): schedule the running ones the budget left out, which
            # hold the blocks. Each round preempts at least one, so this ends.
            batch, num_new = self._schedule()
            if not batch:
                return ended
            batch, num_new = self._reserve(batch, num_new)
        if not batch:
            return ended
        new_tokens = self.pipeline.step(batch, num_new)
        now = self.clock()
        self.stats.steps += 1
        self.stats.step_batch_sizes.append(len(batch))
        done = []
        for ctx, toks in zip(batch, new_tokens):
            if isinstance(toks, RequestFailure):  # this request only: the others go on
                ctx.reject(toks.reason)
                ctx.t_finished = now
                done.append(ctx)
                continue
            if not toks:
                continue
            before = ctx.num_generated
            ctx.append(toks)
            self._stop_at_text(ctx)
            added = ctx.num_generated - before  # (< 0 when a stop string began in an earlier step's tokens)
            if ctx.t_first_token is None:
                ctx.t_first_token, ctx.num_first_tokens = now, added
            self.stats.tokens_generated += added
            if not ctx.done and len(ctx.tokens) >= self.pipeline.max_seq_len:
                ctx.finish("length")
            if ctx.done:
                ctx.t_finished = now
                done.append(ctx)
        for ctx in done:
            self._retire(ctx)
        return ended + done

    def _stop_at_text(self, ctx: TextContext) -> None:
        """Ends ``ctx`` at a stop string in its new text: its tokens are cut to
        those whose text precedes it (also when EOS or the length limit came in
        the same step, later in the text)."""
        text = self._texts.get(ctx)
        keep = text.update(ctx.generated) if text is not None else None
        if keep is not None:
            del ctx.tokens[ctx.prompt_len + keep :]
            ctx.finish("stop")

    def run(self) -> list[TextContext]:
        """Steps until every request has ended; returns all ended requests.

        If a step raises, every request not yet ended is ended (finish_reason
        ``"abort"``, its error names the exception) before the exception
        propagates: the pipeline keeps nothing of this run, and serves the next
        as a fresh one would.
        """
        for _ in self.steps():
            pass
        return self.finished

    def steps(self) -> Iterator[list[TextContext]]:
        """:meth:`run`, one step per ``next()``: yields each step's ended requests.
        Closing it early (or an exception in a step) aborts every request not yet
        ended, as :meth:`run` does when a step raises."""
        try:
            while self.has_work():
                yield self.step()
        except BaseException as e:
            for ctx in [*self.running, *self.waiting]:
                self._end(ctx, "abort", f"request {ctx.request_id!r}: the run stopped: {type(e).__name__}: {e}")
            raise


R = TypeVar("R")


def drain(steps: Generator[object, None, R]) -> R:
    """Runs a stepped generation (:meth:`Engine.steps`, ``LLM.generate_steps``) to its end;
    returns the generator's return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def _is_bool(t: object) -> bool:
    return isinstance(t, bool) or getattr(t, "dtype", None) is torch.bool


def _token_ids(prompt: object) -> list[int]:
    """``prompt`` as a list of ints (numpy / torch integers converted); raises
    ``ValueError`` for anything else: text or bytes (not token ids), a prompt
    that is not a sequence, bool or non-integer elements."""
    if isinstance(prompt, (str, bytes, bytearray)) or not isinstance(prompt, Iterable):
        raise ValueError(f"prompt must be a sequence of token ids, got {type(prompt).__name__}")
    tokens, bad = [], []
    for t in prompt:
        try:
            if _is_bool(t):
                raise TypeError
            tokens.append(operator.index(t))
        except TypeError:
            bad.append(t)
    if bad:
        raise ValueError(f"token ids must be integers (not bool), got {bad[:5]}")
    return tokens

