"""Tree attention in the packed paged path (``DecoderInputs.tree_mask``) and KV compaction.

A tree step feeds each request's root (its last committed token) and its
draft nodes as rows at key indices ``start, start + 1, …`` of its paged
context, at rope positions ``start + depth``, each row attending to the cached
context, the root and its own ancestors. Every node's logits must then equal
those of running its root-to-node path as a plain chain. After verification,
:func:`~specdec.spec.tree.compact_kv` moves the accepted path's KV entries
into place, and the next step must continue as if the path had been decoded
as a chain.
"""

from __future__ import annotations

import pytest
import torch

from specdec.core.inputs import DecoderInputs, KVCacheTensors
from specdec.models.config import LlamaConfig
from specdec.models.llama import LlamaDecoder, PagedAttend
from specdec.spec.tree import (
    accepted_slot_moves,
    compact_kv,
    tree_attention_mask,
    valid_nodes,
)

from packing import pack_rows  # tests/packing.py
from tree_helpers import tree_positions  # tests/spec/tree_helpers.py

VOCAB, BLOCK, NUM_BLOCKS = 64, 4, 16
ATOL = 2e-5


def _model(window: int | None) -> LlamaDecoder:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=window,
                      max_position_embeddings=128)
    torch.manual_seed(0)
    return LlamaDecoder(cfg).eval()


def _cache(cfg: LlamaConfig) -> KVCacheTensors:
    shape = (cfg.num_hidden_layers, NUM_BLOCKS * BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    # Stale garbage everywhere: only what a step writes may be read.
    return KVCacheTensors(k=torch.randn(shape) * 100, v=torch.randn(shape) * 100)


def _prefill(model: LlamaDecoder, cache: KVCacheTensors, prefixes: list[list[int]], tables: list[list[int]]) -> None:
    """Caches every prefix but its last token (the root of the tree step)."""
    toks = [t for p in prefixes for t in p[:-1]]
    inputs = pack_rows(toks, [0] * len(prefixes), [len(p) - 1 for p in prefixes], tables, BLOCK)
    inputs.kv_cache = cache
    with torch.no_grad():
        model(inputs)


def _tree_inputs(prefixes: list[list[int]], tokens: torch.Tensor, parents: torch.Tensor,
                 num_nodes: torch.Tensor, tables: list[list[int]], cache: KVCacheTensors) -> DecoderInputs:
    """The packed tree step: per request its root then its real nodes; every row's logits."""
    b = len(prefixes)
    starts = [len(p) - 1 for p in prefixes]
    lens = [int(n) + 1 for n in num_nodes]
    rows = [[p[-1]] + tokens[i, : lens[i] - 1].tolist() for i, p in enumerate(prefixes)]
    inputs = pack_rows([t for r in rows for t in r], starts, lens, tables, BLOCK)
    # Rope positions: root + depth (the packer wrote key indices, which q_pos keeps).
    pos = tree_positions(parents, torch.tensor(starts), num_nodes)  # [B, N+1]
    inputs.positions = torch.cat([pos[i, : lens[i]] for i in range(b)])
    q = inputs.q_index.shape[1]
    inputs.tree_mask = tree_attention_mask(parents, num_nodes)[:, :q, :q]  # [B, Q, Q]
    inputs.logit_index = torch.arange(sum(lens))
    inputs.kv_cache = cache
    return inputs


def _dense_last(model: LlamaDecoder, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_dense(torch.tensor([seq]))[0, -1]


def _path(parents: list[int], node: int) -> list[int]:
    out = [node]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


CASES = {
    # two requests, ragged trees (request 1: 4 real nodes, padding after)
    "batch": (
        [[5, 9, 2, 11, 7, 3], [8, 1, 4]],
        [[-1, -1, 0, 0, 2, 1], [-1, 0, -1, 1, 0, 0]],
        [6, 4],
        [[3, 7, 1], [5, 0]],
    ),
    # one request (single_request path), a deep branch
    "single": ([[5, 9, 2, 11, 7, 3, 30, 31]], [[-1, 0, 1, 2, -1, 4]], [6], [[2, 9, 6, 12]]),
}


@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
@pytest.mark.parametrize("case", list(CASES))
def test_tree_logits_equal_chain_logits(case: str, window: int | None) -> None:
    prefixes, parents_l, nn_l, tables = CASES[case]
    model = _model(window)
    cache = _cache(model.config)
    g = torch.Generator().manual_seed(1)
    parents, num_nodes = torch.tensor(parents_l), torch.tensor(nn_l)
    tokens = torch.randint(VOCAB, parents.shape, generator=g)
    _prefill(model, cache, prefixes, tables)
    inputs = _tree_inputs(prefixes, tokens, parents, num_nodes, tables, cache)
    with torch.no_grad():
        logits = model(inputs).logits  # [T, V], rows packed: request 0's root, nodes, request 1's …
    row = 0
    for b, prefix in enumerate(prefixes):
        assert torch.allclose(logits[row], _dense_last(model, prefix), atol=ATOL), (b, "root")
        for i in range(nn_l[b]):
            chain = prefix + [int(tokens[b, j]) for j in _path(parents_l[b], i)]
            assert torch.allclose(logits[row + 1 + i], _dense_last(model, chain), atol=ATOL), (b, i)
        row += nn_l[b] + 1


def test_isolated_rows_same_output_and_nan_stays_in_its_branch() -> None:
    """PagedAttend's per-row hiding (isolate_rows) under a tree mask: the same output
    on finite inputs; a node whose new key is NaN poisons itself and its descendants
    only, not its siblings or their subtrees."""
    prefixes, parents_l, nn_l, tables = CASES["batch"]
    cfg = _model(None).config
    cache = _cache(cfg)
    g = torch.Generator().manual_seed(2)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    parents, num_nodes = torch.tensor(parents_l), torch.tensor(nn_l)
    inputs = _tree_inputs(prefixes, torch.zeros_like(parents), parents, num_nodes, tables, cache)
    t = inputs.tokens.shape[0]
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(t, h, d, generator=g)
    k, v = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    plain = PagedAttend(inputs, cache, None, isolate_rows=False)(0, q, k, v)
    hidden = PagedAttend(inputs, cache, None, isolate_rows=True)(0, q, k, v)
    assert torch.allclose(plain, hidden, atol=1e-6) and plain.isfinite().all()
    # Request 0: node 0 (packed row 1) gets a NaN key. Its subtree: nodes 0, 2, 3, 4 (rows 1, 3, 4, 5).
    k_bad = k.clone()
    k_bad[1, 0, 0] = float("nan")
    out = PagedAttend(inputs, cache, None, isolate_rows=True)(0, q, k_bad, v)
    bad_rows = {1, 3, 4, 5}
    for r in range(t):
        assert out[r].isnan().all() == (r in bad_rows), r
        if r not in bad_rows:
            assert torch.allclose(out[r], plain[r], atol=1e-6), r


def test_compact_kv_moves_every_layer_and_overlaps() -> None:
    g = torch.Generator().manual_seed(3)
    cache = KVCacheTensors(k=torch.randn(3, 20, 2, 4, generator=g), v=torch.randn(3, 20, 2, 4, generator=g))
    k0, v0 = cache.k.clone(), cache.v.clone()
    # Request 0's rows at slots 10..14, path root, node 1, node 3 (rows 0, 2, 4); request 1 accepted nothing.
    path = torch.tensor([[0, 2, 4, -1], [0, -1, -1, -1]])
    row_slots = torch.tensor([[10, 11, 12, 13, 14], [3, 4, 5, 6, 7]])
    src, dst = accepted_slot_moves(path, row_slots)
    compact_kv(cache, src, dst)
    # Slot 11 <- 12 and 12 <- 14: 12 is read before it is overwritten.
    for t, t0 in ((cache.k, k0), (cache.v, v0)):
        assert t[:, 10].equal(t0[:, 10]) and t[:, 11].equal(t0[:, 12]) and t[:, 12].equal(t0[:, 14])
        untouched = [s for s in range(20) if s not in (11, 12)]
        assert t[:, untouched].equal(t0[:, untouched])


@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
def test_step_after_compaction_continues_the_chain(window: int | None) -> None:
    """Tree step, keep one root-to-node path per request (as verification would),
    compact its KV, then decode the next token as a plain step: its logits equal
    the chain's."""
    prefixes, parents_l, nn_l, tables = CASES["batch"]
    model = _model(window)
    cache = _cache(model.config)
    g = torch.Generator().manual_seed(4)
    parents, num_nodes = torch.tensor(parents_l), torch.tensor(nn_l)
    tokens = torch.randint(VOCAB, parents.shape, generator=g)
    _prefill(model, cache, prefixes, tables)
    inputs = _tree_inputs(prefixes, tokens, parents, num_nodes, tables, cache)
    with torch.no_grad():
        model(inputs)
    # Accepted: request 0 the path to node 4 (0 -> 2 -> 4), request 1 node 3's (1 -> 3 under 0).
    accepted = [_path(parents_l[0], 4), _path(parents_l[1], 3)]
    d = parents.shape[1]
    path = torch.full((2, d + 1), -1)
    for b, nodes in enumerate(accepted):
        path[b, : len(nodes) + 1] = torch.tensor([0] + [i + 1 for i in nodes])
    row_slots = inputs.slot_mapping[inputs.q_index]  # [B, Q] each row's slot (padding: the last row's)
    compact_kv(cache, *accepted_slot_moves(path, row_slots))
    # Next step: each request feeds one new token after root + accepted path.
    nxt = [50, 51]
    starts = [len(p) - 1 + len(a) + 1 for p, a in zip(prefixes, accepted)]
    step = pack_rows(nxt, starts, [1, 1], tables, BLOCK)
    step.kv_cache = cache
    with torch.no_grad():
        logits = model(step).logits
    for b, prefix in enumerate(prefixes):
        chain = prefix + [int(tokens[b, j]) for j in accepted[b]] + [nxt[b]]
        assert torch.allclose(logits[b], _dense_last(model, chain), atol=ATOL), b
    assert valid_nodes(parents, num_nodes).sum().item() == sum(nn_l)
