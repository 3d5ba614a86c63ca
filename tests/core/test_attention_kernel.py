"""``specdec_cpu::paged_attention``: one layer's attention read by slot from the paged cache.

What it must keep, besides SDPA's values: a row's result depends only on the keys it
sees (so a token verified among γ + 1 rows gets the bits it gets decoded alone, at any
thread count), keys it does not see are never read (a NaN there changes nothing), and a
bad slot is an error that names it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.core.kernels import cpu_kernels_available
from specdec.core.linear import pack_layers
from specdec.models.config import LlamaConfig
from specdec.models.llama import LlamaDecoder, PagedAttend

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="specdec's CPU kernels did not build here")

SLOTS = 200


def _op(q, kc, vc, slots, mask=None, causal=False):
    return torch.ops.specdec_cpu.paged_attention.default(q, kc, vc, slots, mask, causal, q.shape[-1] ** -0.5)


def _sdpa(q, kc, vc, slots, mask=None, causal=False):
    """The same attention through index_select and SDPA, in float64."""
    b, s = slots.shape
    keys = kc.double().index_select(0, slots.reshape(-1)).view(b, s, *kc.shape[1:]).transpose(1, 2)
    vals = vc.double().index_select(0, slots.reshape(-1)).view(b, s, *vc.shape[1:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.double().transpose(1, 2), keys, vals, attn_mask=mask,
                                         is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2)


def _case(b, nq, s, h, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, h, d, generator=g)
    kc, vc = torch.randn(SLOTS, hkv, d, generator=g), torch.randn(SLOTS, hkv, d, generator=g)
    slots = torch.stack([torch.randperm(SLOTS, generator=g)[:s] for _ in range(b)])
    return g, q, kc, vc, slots


@pytest.mark.parametrize("d", [16, 64, 128, 48])
@pytest.mark.parametrize("h,hkv", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_it_computes_sdpa(d, h, hkv):
    g, q, kc, vc, slots = _case(3, 5, 37, h, hkv, d)
    mask = torch.rand(3, 1, 5, 37, generator=g) < 0.6
    mask[..., 0] = True
    for m, causal, nq in ((None, False, 1), (None, True, 5), (mask, False, 5)):
        qq = q[:, :nq].contiguous()
        assert torch.allclose(_op(qq, kc, vc, slots, m, causal).double(), _sdpa(qq, kc, vc, slots, m, causal),
                              atol=2e-6), (m is None, causal)


def test_a_row_gets_the_bits_it_gets_alone_at_any_thread_count():
    """Row i of a causal verification = the same query decoded alone over keys 0..i."""
    _, q, kc, vc, slots = _case(2, 6, 30, 4, 2, 64, seed=1)
    mask = torch.zeros(2, 1, 6, 30, dtype=torch.bool)
    for i in range(6):
        mask[:, :, i, : 25 + i] = True  # 24 cached keys, then the new rows up to row i
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        rows = _op(q, kc, vc, slots, mask)
        torch.set_num_threads(1)
        assert torch.equal(_op(q, kc, vc, slots, mask), rows)
    finally:
        torch.set_num_threads(threads)
    for i in range(6):
        alone = _op(q[:, i : i + 1].contiguous(), kc, vc, slots[:, : 25 + i].contiguous())
        assert torch.equal(alone, rows[:, i : i + 1]), i


def test_unseen_keys_are_not_read_and_a_seen_nan_stays_in_its_rows():
    _, q, kc, vc, slots = _case(2, 4, 12, 4, 4, 16, seed=2)
    clean = _op(q, kc, vc, slots, causal=True)
    kc[slots[0, 2]] = float("nan")  # request 0's key 2: rows 2, 3 see it under causality
    vc[slots[1, 3]] = float("inf")  # request 1's value 3: row 3 only
    out = _op(q, kc, vc, slots, causal=True)
    for b, bad in ((0, {2, 3}), (1, {3})):
        for i in range(4):
            if i in bad:
                assert not out[b, i].isfinite().all(), (b, i)
            else:
                assert torch.equal(out[b, i], clean[b, i]), (b, i)


def test_a_row_that_sees_nothing_gets_zeros_as_in_sdpa():
    _, q, kc, vc, slots = _case(1, 2, 8, 4, 4, 16)
    mask = torch.ones(1, 1, 2, 8, dtype=torch.bool)
    mask[0, 0, 1] = False
    out = _op(q, kc, vc, slots, mask)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1])) and out[0, 0].abs().sum() > 0


def test_bad_operands_name_what_is_wrong():
    _, q, kc, vc, slots = _case(1, 1, 8, 4, 4, 16)
    bad = slots.clone()
    bad[0, 3] = SLOTS + 5
    with pytest.raises(RuntimeError, match=f"slot {SLOTS + 5} outside the cache's {SLOTS}"):
        _op(q, kc, vc, bad)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        _op(q, kc, vc, slots, torch.ones(1, 1, 1, 7, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="D a multiple of 16"):
        _op(q[..., :8].contiguous(), kc[..., :8].contiguous(), vc[..., :8].contiguous(), slots)


def test_pack_layers_gives_a_cpu_decoder_the_kernel_and_its_forward_keeps_sdpa_s_values():
    """The whole paged path (cache write, hiding, packing, out_index) with the kernel
    against the same decoder on SDPA: a ragged prefill, then a ragged verification."""
    from packing import pack_rows  # tests/packing.py
    from specdec.core.inputs import KVCacheTensors

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    torch.manual_seed(0)
    ours = LlamaDecoder(cfg).eval()
    pack_layers(ours)
    assert ours.attention_kernel == "specdec"
    ref = LlamaDecoder(cfg).eval()
    ref.load_state_dict(ours.state_dict())
    block, tables = 4, [[3, 7, 1, 9], [5, 0, 2, 8]]
    shape = (2, 16 * block, 2, 16)
    caches = [KVCacheTensors(k=torch.randn(shape), v=torch.randn(shape)) for _ in range(2)]
    caches[1].k.copy_(caches[0].k), caches[1].v.copy_(caches[0].v)
    prompts = [[5, 9, 2, 11, 7, 3], [8, 1, 4]]
    steps = [([t for p in prompts for t in p], [0, 0], [6, 3]),  # prefill
             ([1, 2, 3, 4, 5, 6], [6, 3], [2, 4])]  # a verification of 2 and 4 rows
    with torch.no_grad():
        for toks, starts, lens in steps:
            outs = []
            for model, cache in zip((ours, ref), caches):
                inputs = pack_rows(toks, starts, lens, tables, block)
                inputs.kv_cache = cache
                inputs.logit_index = torch.arange(len(toks))
                outs.append(model(inputs).logits)
            assert torch.allclose(outs[0], outs[1], atol=1e-5)
    # The kernel ran: with SDPA forced, the two would be the same bits.
    g = torch.Generator().manual_seed(3)
    attend = PagedAttend(inputs, caches[0], None, kernel="specdec")
    assert attend.own_kernel
    q, k, v = torch.randn(6, 4, 16, generator=g), torch.randn(6, 2, 16, generator=g), torch.randn(6, 2, 16, generator=g)
    a = attend(0, q, k, v)
    b = PagedAttend(inputs, caches[0], None)(0, q, k, v)
    assert torch.allclose(a, b, atol=2e-6) and not torch.equal(a, b)


def test_compiled_it_is_one_opaque_call_with_the_same_bits():
    """In a compiled graph (dynamic shapes, Inductor's C++ wrapper) the op runs as it does eager."""
    from specdec.core.pipeline_model import compile_function

    def attend(q, kc, vc, slots, mask):
        return _op(q * 0.5, kc, vc, slots, mask) + 1  # (exact arithmetic around it: Inductor and ATen agree)

    fn = compile_function(attend, torch.device("cpu"))
    with torch.inference_mode():
        for b, nq, s in ((2, 3, 20), (3, 5, 33), (1, 2, 9)):
            g, q, kc, vc, slots = _case(b, nq, s, 4, 2, 16, seed=b)
            mask = torch.rand(b, 1, nq, s, generator=g) < 0.7
            assert torch.equal(fn(q, kc, vc, slots, mask), attend(q, kc, vc, slots, mask)), (b, nq, s)
