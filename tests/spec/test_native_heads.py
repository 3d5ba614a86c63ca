"""EAGLE-1 / EAGLE-3 heads and Medusa heads on the native backend (one C++ call a forward,
``specdec_cpu::eagle_forward`` / ``medusa_forward``; a greedy one-request EAGLE chain in one
more, ``eagle_steps``): the same bits as the eager Python forward on the same kernels, for
ragged batches of every kind of step, and greedy speculative output equal to plain decoding.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.core.backend import NativeEagleBackend, backend_of, load_backend
from specdec.core.batch_processor import _pack
from specdec.core.context import SamplingParams
from specdec.core.inputs import KVCacheTensors
from specdec.core.kernels import cpu_kernels_available
from specdec.core.linear import pack_layers
from specdec.models.config import LlamaConfig
from specdec.models.eagle import EagleHead, EagleHeadConfig, new_head
from specdec.models.llama import LlamaDecoder
from specdec.models.medusa import MedusaHeadConfig, MedusaHeads
from specdec.spec.proposers.eagle import Eagle3Config, EagleConfig, _one_token_step
from specdec.spec.proposers.medusa import MedusaConfig
from specdec.spec.tree import tree_attention_mask

from eagle_heads import head_for  # tests/spec/eagle_heads.py
from medusa_heads import medusa_for  # tests/spec/medusa_heads.py

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="specdec's CPU kernels did not build here")

BLOCK, TABLES = 16, [[3, 7, 1, 9, 12, 15], [5, 0, 2, 8, 13, 16], [4, 6, 10, 11, 14, 17]]  # 96 positions each
PROMPTS = [[5, 9, 2, 11, 7, 3, 8, 1, 4], [8, 1, 4], [6, 2, 13, 9, 5]]


def _target(tied: bool = False) -> LlamaDecoder:
    """(``tied``: its embedding is its head's weight, which packing keeps only packed)"""
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    m = LlamaDecoder(cfg).eval().prepare_for_inference()
    pack_layers(m)
    assert not tied or m.model.embed_tokens.packed_head() is m.lm_head
    return m


def _head(kind: str, target: LlamaDecoder, draft_vocab: int | None = None) -> EagleHead:
    cfg = EagleHeadConfig.from_target(kind, target.config, draft_vocab_size=draft_vocab)
    head = new_head(cfg, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3, generator=g)
    if draft_vocab is not None:
        head.set_draft_vocab(torch.randperm(64, generator=g)[:draft_vocab])
    head.eval().prepare_for_inference()
    head.attach_target(target.model.embed_tokens, target.lm_head)
    pack_layers(head)
    head.ensure_rope(128)
    return head


def _steps() -> list:
    flat = [t for p in PROMPTS for t in p]
    lens = [len(p) for p in PROMPTS]
    mask = tree_attention_mask(torch.tensor([[-1, -1, 0]]))  # a root, two children, a grandchild
    return [
        (flat, [0, 0, 0], lens, {}),  # three ragged prompts (causal)
        ([4, 7, 1], lens, [1, 1, 1], {}),  # a one-token step of three requests
        ([2, 3, 4, 5, 6, 9, 1, 2], [10, 4, 6], [4, 1, 3], {}),  # ragged verification rows (position mask)
        ([3], [14], [1], {}),  # one request, one token
        ([3, 5, 6, 7], [15], [4], {"tree_mask": mask, "positions": torch.tensor([15, 16, 16, 17])}),
    ]


def _run(head: EagleHead, native: bool, cache: KVCacheTensors) -> list:
    """Every step's (h, logits) with the head's native backend or its Python forward."""
    assert load_backend(head, native=native).kind == ("native" if native else "eager")
    g = torch.Generator().manual_seed(5)
    outs = []
    with torch.inference_mode():
        for toks, starts, lens, extra in _steps():
            inputs, _ = _pack(toks, starts, lens, TABLES[: len(lens)], BLOCK, 1, [0] * len(lens))
            inputs.kv_cache = cache
            inputs.logit_index = torch.arange(len(toks))
            for k, v in extra.items():
                setattr(inputs, k, v)
            if "tree_mask" in extra:
                inputs.attention_groups = None
            feature = torch.randn(len(toks), head.config.feature_size, generator=g)
            outs.append(head(inputs, head.project(feature[:, :64], feature)))
    return outs


def _cache(seed: int = 1) -> tuple[KVCacheTensors, KVCacheTensors]:
    g = torch.Generator().manual_seed(seed)
    shape = (1, 18 * BLOCK, 2, 16)
    a = KVCacheTensors(k=torch.randn(shape, generator=g), v=torch.randn(shape, generator=g))
    return a, KVCacheTensors(k=a.k.clone(), v=a.v.clone())


@pytest.mark.parametrize(("kind", "draft_vocab", "tied"),
                         [("eagle", None, False), ("eagle3", None, False), ("eagle3", 48, False),
                          ("eagle", None, True), ("eagle3", 48, True)],
                         ids=["eagle1", "eagle3", "eagle3-small-vocab", "eagle1-tied-target", "eagle3-tied-target"])
def test_the_native_head_forward_gives_the_eager_forward_s_bits(monkeypatch, kind, draft_vocab, tied) -> None:
    head = _head(kind, _target(tied), draft_vocab)
    caches = _cache()
    calls: list[int] = []
    real = NativeEagleBackend.eagle_step
    monkeypatch.setattr(NativeEagleBackend, "eagle_step", lambda self, *a: calls.append(1) or real(self, *a))
    native = _run(head, True, caches[0])
    assert len(calls) == len(_steps())  # every step one native call
    eager = _run(head, False, caches[1])
    for i, ((h, lg), (h2, lg2)) in enumerate(zip(native, eager)):
        assert torch.equal(h, h2), (i, (h - h2).abs().max())
        assert torch.equal(lg, lg2), (i, lg, lg2)
    if draft_vocab is not None:  # outside the draft vocabulary: -inf, as target_logits gives
        assert torch.isinf(native[0][1]).sum(-1).eq(64 - draft_vocab).all()
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def test_a_token_outside_the_vocabulary_is_an_error_that_names_it() -> None:
    head = _head("eagle3", _target())
    inputs, _ = _pack([5, 999], [0], [2], TABLES[:1], BLOCK, 1, [0])
    inputs.kv_cache, inputs.logit_index = _cache()[0], torch.arange(2)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="eagle_forward: token id 999 outside"):
        head(inputs, torch.zeros(2, 64))


@pytest.mark.parametrize(("kind", "draft_vocab", "tied"), [("eagle", None, False), ("eagle3", 48, False),
                                                           ("eagle3", 48, True)],
                         ids=["eagle1", "eagle3", "eagle3-tied-target"])
def test_the_native_chain_gives_the_python_chain_s_drafts_and_cache_writes(kind, draft_vocab, tied) -> None:
    # EagleDrafter._chain_steps, greedy, one request: _one_token_step inputs, a forward, max(-1).
    head = _head(kind, _target(tied), draft_vocab)
    caches = _cache(2)
    prompt, steps = PROMPTS[0], 4
    slot = [TABLES[0][p // BLOCK] * BLOCK + p % BLOCK for p in range(len(prompt) + steps + 3)]
    gather = torch.tensor([slot])  # keys: the prompt's, 3 more (a verification's, masked), then the steps'
    keys = gather.shape[1] - steps
    g = torch.Generator().manual_seed(6)
    feature = torch.randn(len(prompt), head.config.feature_size, generator=g)
    with torch.inference_mode():
        outs = []
        for cache in caches:
            inputs, _ = _pack(prompt, [0], [len(prompt)], TABLES[:1], BLOCK, 1, [0])
            inputs.kv_cache, inputs.logit_index = cache, torch.tensor([len(prompt) - 1])
            outs.append(head(inputs, head.project(feature[:, :64], feature)))
        assert torch.equal(outs[0][1], outs[1][1])
        pos0 = torch.tensor([len(prompt) - 1])
        chain = backend_of(head).head_chain
        assert chain is not None
        native = chain(outs[0][1], outs[0][0], pos0, steps, gather, caches[0])
        load_backend(head, native=False)
        (h, lg), toks, one = outs[1], [], torch.arange(1)
        for j in range(steps + 1):
            toks.append(lg.max(-1).indices)
            if j < steps:
                h, lg = head(_one_token_step(toks[-1], pos0 + 1 + j, gather, keys + j + 1, caches[1], one,
                                             one.clone(), one.view(1, 1)), h)
    assert torch.equal(native, torch.stack(toks, dim=1)), (native, toks)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


@pytest.mark.parametrize(("shared", "layers"), [(False, 1), (True, 2)], ids=["own-lm-heads", "shared-lm-head"])
def test_native_medusa_heads_give_the_eager_heads_bits(shared, layers) -> None:
    target = _target()
    heads = MedusaHeads(MedusaHeadConfig(num_heads=4, num_layers=layers, hidden_size=64, vocab_size=64,
                                         shared_lm_head=shared))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0.0, 0.3, generator=g)
    heads.attach_target(target.lm_head)
    pack_layers(heads)
    hidden = torch.randn(3, 64, generator=g)
    with torch.inference_mode():
        for num in (None, 2):
            assert load_backend(heads).kind == "native"
            native = heads(hidden, num)
            assert load_backend(heads, native=False).kind == "eager"
            eager = heads(hidden, num)
            assert native.shape == (3, 4 if num is None else 2, 64) and torch.equal(native, eager)
            assert torch.equal(heads(hidden[1:2], num), eager[1:2])  # a row's bits alone or among others


def test_unpacked_heads_stay_eager(tiny_llama) -> None:
    # Not packed for our kernels (runtime.cpu_linear=aten): the Python forward, no native chain.
    target = tiny_llama(vocab=64, seed=0)
    from specdec.api import LLM
    from specdec.core.pipeline_model import RuntimeConfig

    llm = LLM(str(target.path), EagleConfig(path=str(head_for(target, "eagle")), num_speculative_tokens=3),
              runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64, cpu_linear="aten"))
    assert backend_of(llm.pipeline.proposer.head).kind == "eager"
    assert not llm.pipeline.proposer.drafter.native_chain


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3-small-vocab", "medusa", "medusa-shared"])
def test_greedy_speculative_output_with_native_heads_equals_plain_decoding(tiny_llama, generate, monkeypatch,
                                                                            kind) -> None:
    target = tiny_llama(vocab=64, seed=0)
    chains: list[int] = []
    real = NativeEagleBackend.head_chain
    monkeypatch.setattr(NativeEagleBackend, "head_chain", lambda self, *a: chains.append(1) or real(self, *a))
    rng = random.Random(11)
    sp = SamplingParams(max_new_tokens=12)
    for n in (1, 4):  # one request (the native chain), then four (a step at a time)
        ps = [[rng.randrange(64) for _ in range(rng.randint(1, 20))] for _ in range(n)]
        ref, _ = generate(target, None, ps, sp)
        if kind.startswith("medusa"):
            method = MedusaConfig(path=str(medusa_for(target, kind)), num_speculative_tokens=3)
        else:
            method = (Eagle3Config if kind.startswith("eagle3") else EagleConfig)(
                path=str(head_for(target, kind)), num_speculative_tokens=3)
        out, llm = generate(target, method, ps, sp)
        assert out == ref
        proposer = llm.pipeline.proposer
        assert backend_of(proposer.heads if kind.startswith("medusa") else proposer.head).kind == "native"
        if n == 1 and not kind.startswith("medusa"):  # the limit's T_draft(1) times the native chain
            before = len(chains)
            assert proposer.draft_forward_time(24, repeats=2) > 0 and len(chains) > before
    assert bool(chains) == (not kind.startswith("medusa"))


def test_packing_has_a_decoder_and_its_heads_choose_their_backend_again() -> None:
    # A backend chosen before pack_layers (unpacked: eager) is stale after it: the decoder, an
    # EAGLE head and Medusa heads each choose again, native on the packed weights.
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    target = LlamaDecoder(cfg).eval().prepare_for_inference()
    head = new_head(EagleHeadConfig.from_target("eagle3", cfg), seed=3).eval().prepare_for_inference()
    head.attach_target(target.model.embed_tokens, target.lm_head)
    heads = MedusaHeads(MedusaHeadConfig(num_heads=2, num_layers=1, hidden_size=64, vocab_size=64)).eval()
    for m in (target, head, heads):
        assert backend_of(m).kind == "eager"
        pack_layers(m)
        assert backend_of(m).kind == "native"
