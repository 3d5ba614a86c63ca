"""A speculative pipeline's verification batches padded to CUDA-graph buckets, checked on
CPU with the padding forced on (it is on only where graphs are: ``cuda_graphs``): real rows
keep their bits, greedy speculation stays plain decoding, seeded sampling draws what it draws
unpadded, and a run meets only bucket sizes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import specdec.core.pipeline_model as pipeline_model
from specdec.api import LLM
from specdec.core.batch_processor import BatchProcessorRuntime, DecoderBatchProcessor, drop_pad_rows
from specdec.core.context import SamplingParams, TextContext
from specdec.core.inputs import MaskKind
from specdec.core.kv_cache import BlockTable, PagedKVCache
from specdec.core.pipeline_model import RuntimeConfig, registered_pipeline_model
from specdec.engine import EngineConfig
from specdec.spec.proposers.draft_model import DraftModelConfig
from specdec.spec.proposers.ngram import NgramConfig

ZOO = Path(__file__).resolve().parents[2] / "specdec" / "zoo"
TARGET, DRAFT = ZOO / "code-target", ZOO / "code-draft"
CACHE = "target"
BUCKETS = (1, 2, 4, 8)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _at(packed, rows: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed.inputs.tokens[rows], packed.inputs.positions[rows]])


def test_padded_verification_leaves_the_real_rows_alone():
    """Three requests verifying ragged drafts (2, 1, 2 placeholders, γ = 2), padded to a
    batch of four and 256 keys: after ``drop_pad_rows`` each real request's γ+1 logit rows,
    hidden states and KV entries are the unpadded packing's, bit for bit."""
    pm = registered_pipeline_model(TARGET, RuntimeConfig(max_batch_size=1, max_seq_len=64, num_blocks=4))
    params = replace(pm.caches[0].params, num_blocks=32)
    # r1 fills its one block exactly (15 tokens + 1 draft, 16-slot blocks): spread to γ + 1
    # rows, its last row lies past every block it holds
    prompts = [[5, 9, 2, 7, 1, 4], [3, 3, 8, 1, 2, 5, 8, 13, 21, 3, 4, 7, 11, 18, 29], [11, 4, 6, 2, 9, 10, 12, 1, 1]]
    drafts = [[7, 7], [2], [13, 5]]
    runs = {}
    for name, buckets in (("plain", None), ("padded", BUCKETS)):
        rt = BatchProcessorRuntime(kv_caches=[PagedKVCache(params, CACHE)], max_batch_size=8, max_seq_len=64,
                                   graph_buckets=buckets)
        p = DecoderBatchProcessor(pm.config, rt)
        scratch = p._scratch.blocks[0] if buckets else -1
        cache = rt.kv_caches[0]
        ctxs = []
        for i, toks in enumerate(prompts):  # each prompt cached but its last token
            c = TextContext(f"r{i}", list(toks), len(toks), SamplingParams())
            c.kv[CACHE] = BlockTable()
            cache.reserve(c.kv[CACHE], len(toks) + len(drafts[i]))  # what the scheduler reserves
            ctxs.append(c)
        with torch.inference_mode():
            pre = p.prepare_initial_token_inputs([ctxs], num_tokens=[len(t) - 1 for t in prompts])
            pre.inputs.kv_cache = cache.tensors
            pm.module(pre.inputs)
            look = [len(d) for d in drafts]
            packed = p.prepare_initial_token_inputs([ctxs], 3, lookahead=look, pad=True)
            rows = packed.draft_index.reshape(-1).tolist()
            want = [t for d in drafts for t in d + [0] * (2 - len(d))]
            toks = packed.inputs.tokens.clone()
            for r, (row, t) in enumerate(zip(rows, want)):
                if r % 2 < look[r // 2]:
                    toks[row] = t
            packed.inputs.tokens = toks
            packed.inputs.kv_cache = cache.tensors
            out = drop_pad_rows(pm.module(packed.inputs), packed.inputs, len(ctxs))
        runs[name] = (packed, out, ctxs, cache)
    (a, oa, ca, qa), (b, ob, cb, qb) = runs["plain"], runs["padded"]
    assert a.inputs.q_index.shape[0] == 3 and b.inputs.q_index.shape[0] == 4  # a pad request
    assert params.block_size == 16
    assert a.inputs.tokens.shape[0] == 3 + 5 and b.inputs.tokens.shape[0] == 4 * 3  # rows: B x (γ + 1)
    # what reads rows by index after the forward (draft and logit rows) names the same tokens and positions
    assert b.draft_index.shape == a.draft_index.shape and torch.equal(_at(b, b.draft_index), _at(a, a.draft_index))
    assert b.inputs.gather_slots.shape[1] == 256 > a.inputs.gather_slots.shape[1]
    assert ob.logits.shape == oa.logits.shape == (9, pm.config.vocab_size)
    assert torch.equal(ob.logits, oa.logits) and torch.equal(ob.hidden_states, oa.hidden_states)
    assert torch.equal(_at(b, b.inputs.logit_index), _at(a, a.inputs.logit_index))
    bs = params.block_size
    for x, y in zip(ca, cb):
        n = x.kv[CACHE].num_tokens
        assert n == y.kv[CACHE].num_tokens
        sa = [blk * bs + j for blk in x.kv[CACHE].blocks for j in range(bs)][:n]
        sb = [blk * bs + j for blk in y.kv[CACHE].blocks for j in range(bs)][:n]
        assert torch.equal(qb.tensors.k[:, sb], qa.tensors.k[:, sa])
    # spare rows and the pad wrote only the scratch block, never a request's block
    written = qb.tensors.k.flatten(2).abs().sum(-1).sum(0) != 0  # [slots] any layer wrote there
    held = {blk for c in cb for blk in c.kv[CACHE].blocks} | {scratch}
    assert all(int(s) // bs in held for s in written.nonzero().flatten())
    assert bool(written[scratch * bs])


def _generate(method, prompts, sps, forced: bool, monkeypatch, attention: str = "auto"
              ) -> tuple[list[list[int]], list[tuple[int, ...]]]:
    """Token ids per prompt, and (real requests, packed requests, key width, logit rows per
    request, packed rows) of the target's decode and verification packings (``forced``: as if CUDA graphs
    were on; prompt steps are not padded)."""
    shapes: list[tuple[int, ...]] = []
    with monkeypatch.context() as m:
        if forced:
            m.setattr(pipeline_model, "cuda_graphs", lambda runtime: True)
            orig = DecoderBatchProcessor.prepare_initial_token_inputs

            def spy(self, replica_batches, *args, **kw):
                packed = orig(self, replica_batches, *args, **kw)
                inp = packed.inputs
                if self.runtime.cache_name == CACHE and inp.attention_groups is None and inp.mask == MaskKind.EXPLICIT:
                    shapes.append((len(packed.contexts), inp.q_index.shape[0], inp.gather_slots.shape[1],
                                   packed.return_n_logits, inp.tokens.shape[0]))
                return packed

            m.setattr(DecoderBatchProcessor, "prepare_initial_token_inputs", spy)
        rt = RuntimeConfig(max_batch_size=8, max_seq_len=96, block_size=8, attention=attention)
        llm = LLM(str(TARGET), method, runtime=rt, engine_config=EngineConfig(max_batch_size=8))
        outs = llm.generate([list(p) for p in prompts], sps)
    for o in outs:
        assert o.error is None, o.error
    return [o.token_ids for o in outs], shapes


@pytest.mark.parametrize("method, attention", [
    (DraftModelConfig(path=str(DRAFT), num_speculative_tokens=3), "auto"),
    (NgramConfig(num_speculative_tokens=3, max_n=3, min_n=1), "auto"),
    (DraftModelConfig(path=str(DRAFT), num_speculative_tokens=3), "flex"),  # keys masked by slot owner
], ids=["draft_model", "ngram", "draft_model-flex"])
def test_greedy_speculation_with_padding_equals_plain_decoding(method, attention, monkeypatch):
    """Five requests of staggered lengths (the batch shrinks 5, 4, 3, ...), verification
    padded to the buckets: every output is plain greedy decoding's, and every decode or
    verification step met a bucket's batch size, B x (γ + 1) rows and a multiple of 256 keys."""
    prompts = [[(7 * i + j) % 50 + 3 for j in range(4 + 3 * i)] + [5, 6, 5, 6] * (i % 2) for i in range(5)]
    sps = [SamplingParams(max_new_tokens=6 + 3 * i) for i in range(5)]
    ref, _ = _generate(None, prompts, sps, False, monkeypatch)
    out, shapes = _generate(method, prompts, sps, True, monkeypatch, attention)
    assert out == ref
    verify = [s for s in shapes if s[3] > 1]
    assert verify and {b for _, b, _, _, _ in shapes} <= set(BUCKETS)
    assert all(w % 256 == 0 for _, _, w, _, _ in shapes)
    assert all(t == b * n for _, b, _, n, t in verify)  # ragged drafts too: B x (γ + 1) rows
    assert any(real < b for real, b, _, _, _ in verify)  # a verification padded (5 and 3 requests: to 8 and 4)


def test_seeded_sampling_with_padding_is_the_unpadded_run(monkeypatch):
    """Sampled speculation (seeded) draws the same tokens padded as unpadded: the real rows'
    logits are the same bits, so every acceptance and resample is too."""
    method = DraftModelConfig(path=str(DRAFT), num_speculative_tokens=5)
    prompts = [[(5 * i + j) % 40 + 3 for j in range(3 + 2 * i)] for i in range(7)]
    sps = [SamplingParams(max_new_tokens=5 + 2 * i, temperature=0.8, seed=i) for i in range(7)]
    want, _ = _generate(method, prompts, sps, False, monkeypatch)
    got, shapes = _generate(method, prompts, sps, True, monkeypatch)
    assert got == want
    assert any(real < b and n > 1 for real, b, _, n, _ in shapes)  # a verification was padded
