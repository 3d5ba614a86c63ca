"""Batch-size buckets for CUDA graphs.

On CUDA, ``runtime.compile=true`` compiles with CUDA graphs (``compile_options`` in
:mod:`specdec.core.backend`): a step replays the kernels recorded for its sizes in one
launch. A graph is recorded per distinct set of sizes, so the sizes a run meets must be
few: a batch of ``n`` requests is padded up to ``graph_bucket(n, buckets)``, one of a
handful of sizes (1, 2, 4, 8, ... up to ``max_batch_size``), and a recording serves every
batch of its bucket.

The key width (longest context) is padded the same way, to a multiple of 256
(:func:`context_bucket`): masked keys past each request's context. Batches are padded so
by ``DecoderBatchProcessor.prepare_initial_token_inputs(pad=True)``: plain decoding's, and
a speculative pipeline's chain verification, whose rows are spread to B x (γ + 1) however
ragged the drafts (spare rows write only a scratch block; ``drop_pad_rows`` drops the pad
requests' outputs). Not padded: drafting batches, tree verification, drafters that read
every target row (EAGLE), and prompt (prefill) steps; there each new size records a graph
of its own (Inductor's cudagraph trees).
"""

from __future__ import annotations

from collections.abc import Sequence


def graph_buckets(max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes graphs are recorded for: powers of two below ``max_batch_size``,
    then ``max_batch_size`` itself (32 -> 1, 2, 4, 8, 16, 32; 24 -> 1, 2, 4, 8, 16, 24)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    out.append(max_batch_size)
    return tuple(out)


def context_bucket(s: int, step: int = 256) -> int:
    """The key width a padded packing's ``gather_slots`` is widened to for a longest context
    of ``s`` tokens: the next multiple of ``step`` (a decode step's context grows by one
    token a step; padded this way, a graph serves ``step`` steps)."""
    return -(-s // step) * step


def graph_bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds a batch of ``n`` requests (``buckets`` ascending).
    A batch larger than the largest bucket is a caller's error: the engine never packs
    more than ``max_batch_size`` requests, the largest bucket."""
    if n < 1:
        raise ValueError(f"a batch has at least one request, got {n}")
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"a batch of {n} requests is larger than the largest graph bucket {max(buckets)} "
                     f"(runtime.max_batch_size)")
