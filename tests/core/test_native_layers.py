"""``specdec_cpu::decoder_forward``: a Llama decoder's whole forward as one C++ call.

It must give what the eager Python loop over the same kernels gives, bit for bit (logits,
hidden states, captured layers, and every value it writes to the paged cache), for every
kind of step the packer makes: a ragged prefill (one group, or a prompt beside decoding
requests in groups), one-token decode steps of one request or several, verification of
several rows with a position mask, token trees, a sliding window, biases, GQA. Where it
cannot serve (gradients, Qwen3's q/k norms, unpacked layers) the Python loop runs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec.core.backend import backend_of, load_backend
from specdec.core.inputs import KVCacheTensors
from specdec.core.kernels import cpu_kernels_available
from specdec.core.linear import pack_layers
from specdec.models.config import LlamaConfig
from specdec.models.llama import LlamaDecoder
from specdec.spec.tree import tree_attention_mask

from packing import pack_rows  # tests/packing.py

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="specdec's CPU kernels did not build here")

BLOCK, TABLES = 16, [[3, 7, 1, 9, 12, 15], [5, 0, 2, 8, 13, 16], [4, 6, 10, 11, 14, 17]]  # 96 positions each


def _decoder(bf16_values: bool = True, **kw: object) -> LlamaDecoder:
    cfg = LlamaConfig(**{"vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                         "max_position_embeddings": 128, **kw})  # type: ignore[arg-type]
    torch.manual_seed(0)
    m = LlamaDecoder(cfg).eval().prepare_for_inference()
    if bf16_values:  # weights a bf16 checkpoint could hold: the kernel's bf16 panels serve them
        for p in m.parameters():
            p.data = p.data.to(torch.bfloat16).float() + 0.0
    m.ensure_rope(128)
    pack_layers(m)
    return m


def _run(model: LlamaDecoder, native: bool, steps: list, cache: KVCacheTensors, **fields: object) -> list:
    """Every step's outputs, with the C++ stack (``native``) or the Python loop."""
    assert load_backend(model, native=native).kind == ("native" if native else "eager")
    outs = []
    with torch.inference_mode():
        for toks, starts, lens, extra in steps:
            inputs = pack_rows(toks, starts, lens, TABLES[: len(lens)], BLOCK)
            inputs.kv_cache = cache
            inputs.logit_index = torch.arange(len(toks))
            for k, v in {**fields, **extra}.items():
                setattr(inputs, k, v)
            if "tree_mask" in extra:
                inputs.attention_groups = None
            o = model(inputs)
            outs.append((o.logits, o.hidden_states, o.aux_hidden_states, o.row_hidden_states))
    return outs


def _both(model: LlamaDecoder, steps: list, **fields: object) -> None:
    shape = (model.num_layers, 18 * BLOCK, model.config.num_key_value_heads, model.config.head_dim)
    g = torch.Generator().manual_seed(1)
    caches = [KVCacheTensors(k=torch.randn(shape, generator=g), v=torch.randn(shape, generator=g))]
    caches.append(KVCacheTensors(k=caches[0].k.clone(), v=caches[0].v.clone()))
    native, loop = _run(model, True, steps, caches[0], **fields), _run(model, False, steps, caches[1], **fields)
    for i, (a, b) in enumerate(zip(native, loop)):
        for x, y in zip(a, b):
            assert (x is None) == (y is None), i
            assert x is None or torch.equal(x, y), (i, (x - y).abs().max())
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


PROMPTS = [[5, 9, 2, 11, 7, 3, 8, 1, 4], [8, 1, 4], [6, 2, 13, 9, 5]]


def _steps() -> list:
    flat = [t for p in PROMPTS for t in p]
    lens = [len(p) for p in PROMPTS]
    return [
        (flat, [0, 0, 0], lens, {}),  # three prompts (causal)
        ([4, 7, 1], lens, [1, 1, 1], {}),  # a decode step of three requests
        ([2, 3, 4, 5, 6, 9, 1, 2], [10, 4, 6], [4, 1, 3], {}),  # ragged verification rows (position mask)
        ([3], [14], [1], {}),  # one request, one token
        ([1, 2, 3, 4, 5], [15], [5], {}),  # one request verifying five rows
    ]


def test_the_stack_gives_the_python_loop_s_bits_for_every_kind_of_step():
    _both(_decoder(), _steps())


def test_and_with_biases_a_window_and_captured_layers():
    _both(_decoder(attention_bias=True, mlp_bias=True, sliding_window=6), _steps(),
          capture_layers=(0, 2, 3), all_hidden=True)


def test_a_prompt_beside_decoding_requests_attends_in_groups_with_the_same_bits():
    model = _decoder()
    long = [t % 60 + 1 for t in range(90)]
    inputs = pack_rows([4, 7] + long, [80, 70, 0], [1, 1, len(long)], TABLES, BLOCK)
    assert inputs.attention_groups, "the packer should have split this batch"
    _both(model, [(long[:80] + long[:70], [0, 0], [80, 70], {}),  # two prompts, then a third beside them
                  ([4, 7] + long, [80, 70, 0], [1, 1, len(long)], {})])


def test_a_token_tree_step_has_the_same_bits():
    model = _decoder()
    # the root, two children of it, and a grandchild under the first child
    mask = tree_attention_mask(torch.tensor([[-1, -1, 0]]))
    positions = torch.tensor([9, 10, 10, 11])
    _both(model, [(PROMPTS[0], [0], [9], {}),
                  ([3, 5, 6, 7], [9], [4], {"tree_mask": mask, "positions": positions})])


def test_it_stands_aside_where_it_cannot_serve(monkeypatch: pytest.MonkeyPatch):
    calls = []
    model = _decoder()
    backend = backend_of(model)
    assert backend.kind == "native" and not backend.compile_around
    assert load_backend(model, compile=True) is not backend  # chosen afresh, and still native: not compiled
    backend = backend_of(model)
    assert backend.kind == "native" and "forward" not in vars(model)
    real = backend.stack
    monkeypatch.setattr(backend, "stack", lambda *a: calls.append(1) or real(*a))
    qwen3 = backend_of(_decoder(qk_norm=True))  # Qwen3's q/k norms: the loop
    assert qwen3.kind == "eager" and qwen3.draft_chain is None and qwen3.compile_around
    inputs = pack_rows(PROMPTS[0], [0], [9], TABLES[:1], BLOCK)
    shape = (3, 18 * BLOCK, 2, 16)
    inputs.kv_cache = KVCacheTensors(k=torch.zeros(shape), v=torch.zeros(shape))
    with torch.inference_mode():
        model(inputs)
    assert calls == [1]
    with torch.enable_grad():  # gradients: the loop, which autograd can follow
        model(dataclasses.replace(inputs))
    assert calls == [1]


def test_a_token_outside_the_vocabulary_is_an_error_that_names_it():
    model = _decoder()
    inputs = pack_rows([5, 999], [0], [2], TABLES[:1], BLOCK)
    shape = (3, 18 * BLOCK, 2, 16)
    inputs.kv_cache = KVCacheTensors(k=torch.zeros(shape), v=torch.zeros(shape))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="token id 999 outside"):
        model(inputs)


def test_the_draft_steps_give_the_python_chain_s_drafts_and_cache_writes():
    """specdec_cpu::decoder_steps (a greedy chain's one-token steps of one request) against
    DraftModelDrafter._chain_steps' loop: _one_token_step inputs, a forward, max(-1)."""
    from specdec.spec.proposers.draft_model import _one_token_step

    model = _decoder()
    shape = (model.num_layers, 18 * BLOCK, 2, 16)
    g = torch.Generator().manual_seed(2)
    caches = [KVCacheTensors(k=torch.randn(shape, generator=g), v=torch.randn(shape, generator=g))]
    caches.append(KVCacheTensors(k=caches[0].k.clone(), v=caches[0].v.clone()))
    prompt, steps = PROMPTS[0], 3
    slot = [TABLES[0][p // BLOCK] * BLOCK + p % BLOCK for p in range(len(prompt) + steps)]
    positions = torch.arange(len(prompt), len(prompt) + steps).view(steps, 1)
    step_slots = torch.tensor(slot[len(prompt):]).view(steps, 1)
    gather = torch.tensor([slot])
    with torch.inference_mode():
        logits = []
        for cache in caches:
            inputs = pack_rows(prompt, [0], [len(prompt)], TABLES[:1], BLOCK)
            inputs.kv_cache = cache
            logits.append(model(inputs).logits)
        assert torch.equal(logits[0], logits[1])
        chain = backend_of(model).draft_chain
        assert chain is not None
        native = chain(logits[0], positions, step_slots, gather, caches[0])
        load_backend(model, native=False)  # the Python loop, as _chain_steps runs it
        lg, toks = logits[1], []
        one = torch.arange(1)
        for j in range(steps + 1):
            toks.append(lg.max(-1).indices)
            if j < steps:
                step = _one_token_step(toks[-1], positions[j], step_slots[j], gather[:, : len(prompt) + j + 1],
                                       caches[1], one, one.clone(), one.view(1, 1))
                lg = model(step).logits
    assert torch.equal(native, torch.stack(toks, dim=1)), (native, toks)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def test_a_head_size_our_attention_kernel_does_not_read_keeps_sdpa_and_no_native_forward(tmp_path):
    # Our attention kernel reads a head 16 floats at a time: a model of 8-float heads (the tiny
    # pair below) must not reach it, nor the native forward whose attention it is (that overran
    # the heap: glibc aborted the run with "free(): invalid next size").
    from specdec.api import LLM
    from specdec.core.context import SamplingParams
    from tests.dist.test_data_parallel import tiny_pair

    target, draft = (a.split("=", 1)[1] for a in tiny_pair(tmp_path))
    spec = LLM(target, method={"name": "draft_model", "path": draft, "num_speculative_tokens": 3}, max_seq_len=128)
    assert spec.pipeline.target.module.config.head_dim == 8
    assert spec.pipeline.target.module.attention_kernel is None
    assert backend_of(spec.pipeline.spec.model.module).kind != "native"
    sp = SamplingParams(max_new_tokens=16)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert [o.token_ids for o in spec.generate(prompts, sp)] == \
        [o.token_ids for o in LLM(target, max_seq_len=128).generate(prompts, sp)]


@pytest.mark.parametrize("bf16_values", [True, False])
def test_a_tied_model_reads_its_embedding_from_the_packed_head_with_the_same_bits(bf16_values):
    # (61 rows: the last panel is part padding, whichever panel width this CPU packs)
    model = _decoder(bf16_values, vocab_size=61, tie_word_embeddings=True)
    assert model.lm_head.dense_freed and model.model.embed_tokens.weight is model.lm_head.weight
    with torch.inference_mode():  # every row, as unpacking the head gives it back
        assert torch.equal(model.model.embed_tokens(torch.arange(61)), model.lm_head.dense_weight())
    _both(model, _steps())
    inputs = pack_rows([5, 61], [0], [2], TABLES[:1], BLOCK)  # 61: in the head's padding, not the vocabulary
    shape = (3, 18 * BLOCK, 2, 16)
    inputs.kv_cache = KVCacheTensors(k=torch.zeros(shape), v=torch.zeros(shape))
    with torch.inference_mode(), pytest.raises(IndexError):  # the Python loop (left loaded by _both)
        model(inputs)
    load_backend(model, native=True)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="token id 61 outside"):
        model(inputs)
