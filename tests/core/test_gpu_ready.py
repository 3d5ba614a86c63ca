"""What a CUDA run relies on, checked on CPU where it can be: CUDA-graph compile options
and batch buckets (padding that leaves real rows alone), the dtype a device defaults to,
TF32, one host-to-device copy per packing, replicas on distinct devices. The tests marked
``gpu`` need a CUDA device (``experiments/bench/gpu.sh`` runs them)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specdec.api import split_settings
from specdec.core.backend import compile_options
from specdec.core.batch_processor import BatchProcessorRuntime, DecoderBatchProcessor, HostStaging
from specdec.core.context import SamplingParams, TextContext
from specdec.core.graphs import graph_bucket, graph_buckets
from specdec.core.kv_cache import BlockTable, KVCacheParams, PagedKVCache
from specdec.core.pipeline_model import RuntimeConfig, configure_device, registered_pipeline_model
from specdec.dist.replicas import replica_devices

TARGET = Path(__file__).resolve().parents[2] / "specdec" / "zoo" / "code-target"
CACHE = "target"
needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


# -- buckets and compile options ------------------------------------------------------------

def test_graph_bucket_is_the_smallest_bucket_that_holds_the_batch():
    assert graph_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert graph_buckets(24) == (1, 2, 4, 8, 16, 24)
    assert graph_buckets(1) == (1,)
    b = graph_buckets(24)
    assert [graph_bucket(n, b) for n in (1, 2, 3, 5, 8, 9, 17, 24)] == [1, 2, 4, 8, 8, 16, 24, 24]
    with pytest.raises(ValueError, match="larger than the largest graph bucket 24"):
        graph_bucket(25, b)
    with pytest.raises(ValueError, match="at least one request"):
        graph_bucket(0, b)


def test_cuda_compile_options_are_reduce_overhead_and_cpu_keeps_its_wrapper():
    """On CUDA the options are torch's own "reduce-overhead" mode (CUDA graphs); on CPU the
    C++ wrapper and no CUDA graphs."""
    from torch._inductor import list_mode_options

    cuda = compile_options("cuda")
    assert cuda is not None and list_mode_options("reduce-overhead").items() <= cuda.items()
    cpu = compile_options("cpu")
    assert cpu is not None and cpu.get("cpp_wrapper") and not cpu.get("triton.cudagraphs")


# -- dtype and TF32 -------------------------------------------------------------------------

def test_dtype_auto_is_float32_on_cpu_and_bfloat16_on_cuda():
    assert RuntimeConfig().torch_dtype == torch.float32
    assert RuntimeConfig(device="cuda").torch_dtype == torch.bfloat16
    assert replace(RuntimeConfig(), device="cuda:1").torch_dtype == torch.bfloat16  # resolved late, not at init
    assert RuntimeConfig(device="cuda", dtype="float32").torch_dtype == torch.float32  # an explicit choice stays
    assert RuntimeConfig(dtype=None).torch_dtype is None  # the checkpoint's declared dtype
    rt, _ = split_settings(None, None, {"device": "cuda"})  # LLM(target, device="cuda")
    assert rt.compute_dtype == "bfloat16"
    with pytest.raises(ValueError, match="runtime.dtype"):
        RuntimeConfig(dtype="float8")
    with pytest.raises(ValueError, match="runtime.tf32"):
        RuntimeConfig(tf32="yes")  # type: ignore[arg-type]


def test_cpu_pipeline_still_loads_float32():
    pm = registered_pipeline_model(TARGET, RuntimeConfig(max_batch_size=1, max_seq_len=32))
    assert {p.dtype for p in pm.module.parameters()} == {torch.float32}
    assert pm.caches[0].tensors.k.dtype == torch.float32


def test_tf32_is_set_for_a_cuda_runtime_only():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        configure_device(RuntimeConfig())  # CPU: leaves it
        assert torch.backends.cuda.matmul.allow_tf32 is False
        configure_device(RuntimeConfig(device="cuda"))
        assert torch.backends.cuda.matmul.allow_tf32 is True and torch.backends.cudnn.allow_tf32 is True
        configure_device(RuntimeConfig(device="cuda", tf32=False))  # strict float32 products
        assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# -- one host-to-device copy per packing ----------------------------------------------------

class CountingStaging(HostStaging):
    """HostStaging to a host "device" (a copy of its own), counting its copies."""

    copies = 0

    def _transfer(self, buf: torch.Tensor) -> torch.Tensor:
        self.copies += 1
        return super()._transfer(buf)


def _processor(buckets: tuple[int, ...] | None = None, num_blocks: int = 64) -> DecoderBatchProcessor:
    params = KVCacheParams(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4, num_blocks=num_blocks)
    rt = BatchProcessorRuntime(kv_caches=[PagedKVCache(params, CACHE)], max_batch_size=8, max_seq_len=64,
                               graph_buckets=buckets)
    return DecoderBatchProcessor(config=None, runtime=rt)


def _ctxs(cache: PagedKVCache, specs: list[tuple[int, int]]) -> list[TextContext]:
    """One context per (length, cached) with KV blocks for its whole sequence."""
    out = []
    for i, (n, cached) in enumerate(specs):
        c = TextContext(f"r{i}", [(7 * i + j) % 50 + 1 for j in range(n)], n, SamplingParams())
        c.kv[CACHE] = t = BlockTable()
        cache.reserve(t, n + 4)
        t.num_tokens = cached
        c.slot = i
        out.append(c)
    return out


def _tensors(obj, out):  # every tensor of a packed batch, in field order
    from dataclasses import fields, is_dataclass

    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, list):
        for x in obj:
            _tensors(x, out)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            _tensors(getattr(obj, f.name), out)
    return out


@pytest.mark.parametrize("specs, look", [
    ([(9, 8), (3, 2), (12, 11), (100, 0)], 0),  # decoding requests beside a prompt: two attention groups
    ([(9, 8), (5, 4)], 2),  # verification: placeholders and their draft_index
])
def test_packing_moves_its_tensors_in_one_copy(specs, look):
    """Off CPU a packing hands its index tensors to the device in one copy (here a host
    "device" standing in for CUDA): the same tensors as the packing without it."""
    from specdec.core.state_store import RequestStateStore, StateSpec

    plain, staged = _processor(), _processor()
    staged.staging = CountingStaging("cpu")
    for p in (plain, staged):
        p.state_store = RequestStateStore([StateSpec("x", torch.float32, (1,))], max_batch_size=8)
    a = plain.prepare_initial_token_inputs([_ctxs(plain.runtime.kv_caches[0], specs)], 1 + look, lookahead=look)
    b = staged.prepare_initial_token_inputs([_ctxs(staged.runtime.kv_caches[0], specs)], 1 + look, lookahead=look)
    assert staged.staging.copies == 1
    want, got = _tensors(a, []), _tensors(b, [])
    assert len(want) == len(got) > 10
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and torch.equal(g, w)
    if not look:
        assert b.inputs.attention_groups is not None  # the groups' tensors came in the one copy too
    else:
        assert b.draft_index is not None and b.state_slots is not None


# -- padding to a bucket --------------------------------------------------------------------

def _run(pm, processor: DecoderBatchProcessor, ctxs: list[TextContext], pad: bool):
    packed = processor.prepare_initial_token_inputs([ctxs], pad=pad)
    packed.inputs.kv_cache = processor.runtime.kv_caches[0].tensors
    with torch.inference_mode():
        out = processor.process_outputs([pm.module(packed.inputs)], packed)
    return packed, out


@pytest.mark.parametrize("prompts", [
    [[5, 9, 2, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 10, 12]],  # three requests: a batch of four
    [[5, 9, 2, 7, 1]],  # one: no pad request, but its one-token steps get a mask for the wider keys
])
def test_padding_to_a_bucket_leaves_the_real_rows_alone(prompts):
    """Requests padded to their batch bucket and key width (prefill, then decode steps
    reading what it cached): the real requests' logits, hidden states and KV cache
    entries are the unpadded packing's, bit for bit; a pad wrote only its scratch block."""
    pm = registered_pipeline_model(TARGET, RuntimeConfig(max_batch_size=1, max_seq_len=64, num_blocks=4))
    cfg, params = pm.config, pm.caches[0].params
    params = replace(params, num_blocks=32)

    def processor(buckets):
        rt = BatchProcessorRuntime(kv_caches=[PagedKVCache(params, CACHE)], max_batch_size=8, max_seq_len=64,
                                   graph_buckets=buckets)
        return DecoderBatchProcessor(cfg, rt)

    plain, padded = processor(None), processor((1, 2, 4, 8))
    scratch = padded._scratch.blocks[0]
    runs = {}
    for name, p in (("plain", plain), ("padded", padded)):
        cache = p.runtime.kv_caches[0]
        ctxs = []
        for i, toks in enumerate(prompts):
            c = TextContext(f"r{i}", list(toks), len(toks), SamplingParams())
            c.kv[CACHE] = BlockTable()
            cache.reserve(c.kv[CACHE], 16)
            ctxs.append(c)
        steps = []
        for step in range(3):
            packed, out = _run(pm, p, ctxs, pad=True)
            steps.append((packed, out))
            for c, tok in zip(ctxs, out.logits.argmax(-1).tolist()):
                c.tokens.append(tok)
        runs[name] = (ctxs, steps, cache)
    (pc, psteps, pcache), (qc, qsteps, qcache) = runs["plain"], runs["padded"]
    bucket = graph_bucket(len(prompts), (1, 2, 4, 8))
    for step, ((a, oa), (b, ob)) in enumerate(zip(psteps, qsteps)):
        assert a.inputs.q_index.shape[0] == len(prompts) and b.inputs.q_index.shape[0] == bucket
        if step:  # decode steps: keys padded to the context bucket
            assert b.inputs.gather_slots.shape[1] == 256 > a.inputs.gather_slots.shape[1]
        assert ob.logits.shape == oa.logits.shape and torch.equal(ob.logits, oa.logits)
        assert torch.equal(ob.hidden_states, oa.hidden_states)
    assert [c.tokens for c in qc] == [c.tokens for c in pc]
    bs = params.block_size
    for a, b in zip(pc, qc):
        sa = [blk * bs + j for blk in a.kv[CACHE].blocks for j in range(bs)][: a.kv[CACHE].num_tokens]
        sb = [blk * bs + j for blk in b.kv[CACHE].blocks for j in range(bs)][: b.kv[CACHE].num_tokens]
        assert torch.equal(qcache.tensors.k[:, sb], pcache.tensors.k[:, sa])
    written = qcache.tensors.k.flatten(2).abs().sum(-1).sum(0) != 0  # [slots] any layer wrote there
    held = {blk for c in qc for blk in c.kv[CACHE].blocks}
    assert bool(written[scratch * bs]) == (bucket > len(prompts))  # a pad wrote its scratch slot
    assert all(int(s) // bs in held | {scratch} for s in written.nonzero().flatten())


def test_unpadded_packing_without_buckets_or_past_the_largest():
    p = _processor(buckets=(1, 2))
    ctxs = _ctxs(p.runtime.kv_caches[0], [(3, 2), (4, 3), (5, 4)])  # 3 > the largest bucket
    assert p.prepare_initial_token_inputs([ctxs], pad=True).inputs.q_index.shape[0] == 3
    q = _processor()
    assert q.prepare_initial_token_inputs([_ctxs(q.runtime.kv_caches[0], [(3, 2)] * 3)],
                                          pad=True).inputs.q_index.shape[0] == 3


# -- replicas on distinct devices -----------------------------------------------------------

def test_replicas_take_distinct_cuda_devices_while_there_are_enough():
    assert replica_devices("cuda", 2, device_count=4) == ["cuda:0", "cuda:1"]
    assert replica_devices("cuda:2", 3, device_count=4) == ["cuda:2", "cuda:3", "cuda:0"]
    assert replica_devices("cuda", 3, device_count=2) == ["cuda:0", "cuda:1", "cuda:0"]  # shared past the count
    assert replica_devices("cuda", 2, device_count=0) == ["cuda", "cuda"]  # none seen: check_device names it
    assert replica_devices("cpu", 3, device_count=8) == ["cpu"] * 3


def test_plain_decoding_replicas_on_distinct_devices_are_whole_pipelines(monkeypatch):
    """Two replicas on two devices ("cpu" and "cpu:0" stand in for two GPUs): a plain
    pipeline each, on its device, with the one-replica outputs."""
    import specdec.dist.replicas as replicas
    from specdec.api import LLM

    monkeypatch.setattr(replicas, "replica_devices", lambda device, n: ["cpu", "cpu:0"][:n])
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8], [11, 4, 6]]
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = [o.token_ids for o in LLM(TARGET, max_batch_size=3, max_seq_len=32).generate(prompts, sp)]
    llm = LLM(TARGET, max_batch_size=3, max_seq_len=32, data_parallel_degree=2)
    assert [p.target.runtime.device for p in llm.pipeline.pipelines] == ["cpu", "cpu:0"]
    assert [o.token_ids for o in llm.generate(prompts, sp)] == ref


# -- on a CUDA device -----------------------------------------------------------------------

@pytest.mark.parametrize("method", [None, "ngram", "draft_model"])
@pytest.mark.parametrize("compile_", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_float32_matches_cpu_plain(compile_, method):
    """float32 without TF32, eager or with CUDA graphs (plain batches padded to buckets),
    plain or speculative: the CPU's plain greedy tokens."""
    from specdec.api import LLM

    prompts = [[5, 9, 2, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 10, 12]]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in LLM(TARGET, max_batch_size=3, max_seq_len=64).generate(prompts, sp)]
    mc = {"name": "draft_model", "path": str(TARGET), "num_speculative_tokens": 3} if method == "draft_model" \
        else method
    llm = LLM(TARGET, method=mc, max_batch_size=3, max_seq_len=64, device="cuda", dtype="float32", tf32=False,
              compile=compile_)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_defaults_to_bfloat16_and_stages_in_one_pinned_copy():
    from specdec.api import LLM

    llm = LLM(TARGET, max_batch_size=2, max_seq_len=64, device="cuda")
    assert {p.dtype for p in llm.pipeline.target.module.parameters()} == {torch.bfloat16}
    assert torch.backends.cuda.matmul.allow_tf32
    st = HostStaging("cuda")
    host = [torch.arange(6).view(2, 3), torch.tensor([7, 8]), torch.zeros(0, dtype=torch.long)]
    dev = st.copy(host)
    assert st._host.is_pinned()
    assert all(d.is_cuda and torch.equal(d.cpu(), h) for d, h in zip(dev, host))
