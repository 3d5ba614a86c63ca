"""A bare forward's time, for the analytic speedup limit and adaptive γ's cost model.

``forward_time(pm, n, ctx_len)`` times one module call that feeds ``n`` new
tokens to a single request whose cache already holds ``ctx_len - n`` tokens:
``T(1)`` is a decode step, ``T(γ+1)`` a verification step. ``requests=B``
feeds ``B`` such requests at once (a batched decode or verification step:
``B`` contexts read, not one).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from specdec.core.context import SamplingParams, TextContext
from specdec.core.inputs import DecoderInputs
from specdec.core.kv_cache import BlockTable
from specdec.core.pipeline_model import DecoderPipelineModel


def time_calls(fn: Callable[[], object], device: torch.device, *, repeats: int, stat: str = "median",
               warmup: int = 3, between: Callable[[], object] | None = None) -> float:
    """Seconds of one call of ``fn`` (after ``warmup`` untimed calls): the median, or the
    least (``stat="min"``), of ``repeats`` timed calls, each synchronised to its end on a GPU.
    ``between``: untimed, before every timed call (say another model's forward, whose
    reads then evict some of ``fn``'s weights from the caches, as in a speculative step)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if between is not None:
            between()
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)  # device work is asynchronous: time it to the end
        times.append(time.perf_counter() - t)
    return min(times) if stat == "min" else statistics.median(times)


@torch.inference_mode()
def forward_time(pm: DecoderPipelineModel, n: int, ctx_len: int, *, repeats: int = 30, stat: str = "median",
                 requests: int = 1, between: Callable[[], object] | None = None, warmup: int = 3) -> float:
    """Seconds of one bare forward of ``n`` tokens for each of ``requests`` requests at context ``ctx_len``.

    ``stat="median"`` for reporting; ``"min"`` for a cost model that must
    shrug off a busy machine (the least time is the intrinsic cost).
    ``between``: untimed, before each timed forward; ``warmup``: untimed calls first
    (:func:`time_calls`; ``repeats=1, warmup=0`` runs the forward once).
    """
    with bare_batch(pm, n, max(ctx_len, n), requests=requests) as (_, inputs):
        return time_calls(lambda: pm.module(inputs), inputs.kv_cache.k.device, repeats=repeats, stat=stat,
                          between=between, warmup=warmup)


@contextmanager
def bare_batch(pm: DecoderPipelineModel, n: int, ctx_len: int, *, requests: int = 1, extra_tokens: int = 0,
               return_n_logits: int | None = None) -> Iterator[tuple[list[TextContext], DecoderInputs]]:
    """``requests`` throwaway requests of ``ctx_len`` tokens whose last ``n`` are not yet
    in ``pm``'s cache (room kept for ``extra_tokens`` more), and the packed inputs of
    feeding those ``n`` (logits of the last ``return_n_logits``, default all ``n``);
    their blocks are freed on exit."""
    cache = pm.caches[0]
    ctxs = [TextContext(request_id=f"__timing_{i}__", tokens=[1] * ctx_len, prompt_len=ctx_len,
                        sampling=SamplingParams()) for i in range(requests)]
    tables = [c.kv.setdefault(pm.cache_name, BlockTable()) for c in ctxs]
    try:
        for table in tables:
            cache.reserve(table, ctx_len + extra_tokens)
            table.num_tokens = ctx_len - n
        # A bare forward reads no per-request state: no state slots.
        logits = n if return_n_logits is None else return_n_logits
        inputs = pm.processor.prepare_initial_token_inputs([ctxs], return_n_logits=logits, with_state=False).inputs
        inputs.kv_cache = cache.tensors
        yield ctxs, inputs
    finally:
        for table in tables:
            cache.free(table)
