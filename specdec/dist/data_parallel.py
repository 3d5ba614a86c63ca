"""Data parallelism across processes, and the distributed part of an experiment.

Under ``torchrun`` the ``dp = WORLD_SIZE / tensor_parallel_degree`` groups of
ranks each serve one replica. Work is split deterministically: an ``LLM``'s
prompts ``i`` go to replica ``i % dp``; an experiment's batches (of
``batch_size`` requests, numbered as a single process numbers them) go round
by round, batch ``k * dp + d`` to replica ``d``. Every rank of a replica runs
the same engine loop on the same requests (tensor-parallel ranks must: they
meet in every forward). Records come back to rank 0, in batch order, which
alone writes ``results.jsonl``, the summary, logs and W&B: the merged results
hold the same requests, outputs and counts as a single-process run's.

Faults: a collective that fails (a rank died, or waited past
``$SPECDEC_DIST_TIMEOUT``) raises :class:`~specdec.dist.group.DistError`
naming this rank and what it waited for; rank 0 has then saved every batch
finished so far, and ``resume_dir=`` continues the run (torchrun also names
the rank that exited first).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from specdec.core.pipeline_model import RuntimeConfig
from specdec.dist.group import DistContext, DistError, current, env_world_size, init_from_env

if TYPE_CHECKING:
    from specdec.api import LLM
    from specdec.engine import GenerationOutput

log = logging.getLogger(__name__)


def localize(runtime: RuntimeConfig) -> tuple[DistContext, RuntimeConfig]:
    """Joins the torchrun launch (if any) and returns this process's context and
    runtime: under torchrun one replica per process (``data_parallel_degree=1``
    inside it; the launch's degree is ``ctx.dp``)."""
    world = env_world_size()
    if world <= 1 and runtime.tensor_parallel_degree == 1:
        return current(), runtime
    ctx = init_from_env(tensor_parallel_degree=runtime.tensor_parallel_degree,
                        data_parallel_degree=runtime.data_parallel_degree if world > 1 else None,
                        device=runtime.device)
    if ctx.distributed:
        runtime = replace(runtime, data_parallel_degree=1)
    return ctx, runtime


def _collective(ctx: DistContext, what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except DistError:
        raise
    except RuntimeError as e:  # gloo / nccl: a peer closed its connection, or the timeout passed
        raise DistError(f"rank {ctx.rank} of {ctx.world_size}: {what} with the other ranks failed "
                        f"(a rank died or timed out; torchrun's log names the rank that exited first): {e}") from e


# -- LLM.generate across processes ------------------------------------------------------------
def generate_sharded(llm: LLM, prompts: Sequence[Any], params: Sequence[Any]) -> list[GenerationOutput]:
    """``LLM.generate`` under process data parallelism: prompt ``i`` on replica
    ``i % dp``; every rank returns all outputs, in prompt order. Seeds of
    requests without one are drawn in prompt order, as one engine draws them."""
    ctx = llm.dist
    rng = random.Random(llm.engine_config.seed)
    params = [p if p.seed is not None else replace(p, seed=rng.getrandbits(63)) for p in params]
    mine = [i for i in range(len(prompts)) if i % ctx.dp == ctx.dp_rank]
    engine = llm.new_engine()
    ids = llm.request_ids(len(prompts))  # (every rank numbers the call's prompts alike)
    ctxs = {i: llm._add(engine, prompts[i], params[i], ids[i]) for i in mine}
    engine.run()
    from specdec.engine import GenerationOutput

    outs = {i: GenerationOutput.from_context(c, llm._text(engine, c)) for i, c in ctxs.items()}
    parts = _collective(ctx, "gathering the outputs", ctx.all_gather_object, outs)
    merged: dict[int, Any] = {}
    for rank, part in enumerate(parts):
        if rank % ctx.tp == 0:  # a replica's tensor-parallel ranks hold the same outputs
            merged.update(part)
    return [merged[i] for i in range(len(prompts))]


# -- experiments ------------------------------------------------------------------------------
def run_batches(runner: Any, reqs: Sequence[Any], batch_size: int, first_batch: int,
                ctx: DistContext) -> Iterator[list[dict[str, Any]]]:
    """Each batch's records (``runner.run_batch``), in batch order, on rank 0;
    other ranks run their share and yield nothing."""
    batches = [list(reqs[i : i + batch_size]) for i in range(0, len(reqs), batch_size)]
    if ctx.dp == 1:  # every rank runs every batch (tensor-parallel peers, or one process)
        for b, batch in enumerate(batches, start=first_batch):
            done = runner.run_batch(batch, b)
            if ctx.is_writer:
                yield done
        return
    for start in range(0, len(batches), ctx.dp):
        k = start + ctx.dp_rank
        done = runner.run_batch(batches[k], first_batch + k) if k < len(batches) else []
        parts = _collective(ctx, f"gathering the records of batches {first_batch + start}..", ctx.all_gather_object,
                            (k, done))
        if ctx.is_writer:
            got = {kk: recs for rank, (kk, recs) in enumerate(parts) if rank % ctx.tp == 0 and kk < len(batches)}
            for kk in sorted(got):
                yield got[kk]


def follow(rc: Any, comps: Any, runner_cls: Any) -> dict[str, Any]:
    """The experiment on a rank other than 0: the same requests, models and
    steps as rank 0 decides (it broadcasts them), nothing written. ``runner_cls``:
    the experiment's ``Runner`` (passed in: dist imports nothing of the experiment)."""
    from specdec.data.prompts import load_prompts

    ctx = current()
    plan = _collective(ctx, "receiving the run plan", ctx.broadcast_object, None)
    if plan is None:  # rank 0 found nothing to run
        return {}
    by_id = {p.id: p for p in load_prompts(comps.data)}
    pending = [by_id[i] for i in plan["pending"]]
    runner = runner_cls(comps, save_outputs=rc.save_outputs)
    reqs = runner.encode(pending, comps.data.max_prompt_tokens)
    if rc.warmup and reqs:
        runner.warmup(reqs, rc.warmup, rc.warmup_tokens)
    for _ in run_batches(runner, reqs, rc.batch_size, plan["first_batch"], ctx):
        pass
    return {}


def lead(ctx: DistContext, pending: Sequence[Any], first_batch: int) -> None:
    """Rank 0 tells the other ranks what to run (see :func:`follow`)."""
    if ctx.distributed:
        plan = {"pending": [p.id for p in pending], "first_batch": first_batch} if pending else None
        _collective(ctx, "sending the run plan", ctx.broadcast_object, plan)
