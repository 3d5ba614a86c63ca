"""Medusa heads: both published layouts load, mismatched heads fail by name, the
drafts made inside the step are exactly the heads' top-1 on the target's hidden
state at the bonus row, and γ never exceeds the number of heads.

Greedy equality with plain decoding: tests/spec/test_greedy_exactness.py;
the sampled distribution: tests/spec/test_sampling_exactness.py.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from specdec.api import LLM
from specdec.core.checkpoint import CheckpointError, load_decoder
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.core.registry import Role
from specdec.engine import EngineConfig
from specdec.models.llama import DenseCausalAttend
from specdec.models.medusa import MedusaHeadConfig, MedusaHeads, load_medusa, new_medusa, save_medusa
from specdec.spec.proposers.medusa import MedusaConfig, MedusaDrafter

from echo_drafter import expected_counts  # tests/spec/echo_drafter.py
from medusa_heads import medusa_checkpoint, medusa_for  # tests/spec/medusa_heads.py

VOCAB = 64
H = 64  # the tiny targets' hidden size (tests/spec/conftest.py)


def _prompts(seed: int, n: int, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, hi))] for _ in range(n)]


# -- published layouts ------------------------------------------------------------------------------


def test_medusa1_layout_loads_as_published(tmp_path) -> None:
    # Published config.json: medusa_num_heads / medusa_num_layers only (no architectures,
    # no sizes): sizes are read off the tensors, the layout off the lm head keys.
    path = medusa_checkpoint(tmp_path / "m1", hidden=H, vocab=VOCAB, heads=3, layers=1)
    heads = load_medusa(path)
    assert isinstance(heads, MedusaHeads)
    c = heads.config
    assert (c.num_heads, c.num_layers, c.hidden_size, c.vocab_size, c.shared_lm_head) == (3, 1, H, VOCAB, False)
    # Head i: its block then its own lm head, as the file has them.
    from safetensors.torch import load_file

    t = load_file(str(path / "model.safetensors"))
    x = torch.randn(5, H)
    y = x + torch.nn.functional.silu(x @ t["medusa_head.1.0.linear.weight"].T + t["medusa_head.1.0.linear.bias"])
    torch.testing.assert_close(heads(x)[:, 1], y @ t["medusa_head.1.1.weight"].T)


@pytest.mark.parametrize("version_key", [True, False], ids=["version-2", "inferred-from-tensors"])
@pytest.mark.parametrize("all_block_keys", [False, True], ids=["block-once", "block-per-application"])
def test_shared_lm_head_layout_loads_and_repeats_one_block(tmp_path, version_key, all_block_keys) -> None:
    # Medusa-2 format: no medusa_head.{i}.{L}.weight, the target's lm_head; L_m = 3
    # applications of ONE block per head (stored once, or under every index as
    # torch's state_dict of Sequential(*[block] * L) writes it).
    path = medusa_checkpoint(tmp_path / "m2", hidden=H, vocab=VOCAB, heads=2, layers=3, shared=True,
                             version_key=version_key, all_block_keys=all_block_keys, std=0.1)
    lm = torch.nn.Linear(H, VOCAB, bias=False)
    heads = load_medusa(path, target=type("T", (), {"hidden_size": H, "vocab_size": VOCAB})())
    assert heads.config.shared_lm_head and heads.config.vocab_size == VOCAB
    assert sum(p.numel() for p in heads.parameters()) == 2 * (H * H + H)  # one block per head, no lm head
    assert heads.medusa_head[0][0] is heads.medusa_head[0][2]
    heads.attach_target(lm)
    x = torch.randn(4, H)
    blk = heads.block(1)
    y = blk(blk(blk(x)))
    torch.testing.assert_close(heads(x)[:, 1], lm(y))
    with pytest.raises(RuntimeError, match="attach_target"):
        load_medusa(path, target=type("T", (), {"hidden_size": H, "vocab_size": VOCAB})())(x)


def test_distinct_block_weights_are_refused(tmp_path) -> None:
    path = medusa_checkpoint(tmp_path / "m", hidden=H, vocab=VOCAB, heads=2, layers=2, all_block_keys=True,
                             distinct_blocks=True)
    with pytest.raises(CheckpointError, match="medusa_head.0.1.linear.weight differs"):
        load_medusa(path)


def test_load_decoder_with_the_medusa_role_and_save_roundtrip(tmp_path) -> None:
    cfg = MedusaHeadConfig(num_heads=3, num_layers=2, hidden_size=H, vocab_size=VOCAB)
    heads = new_medusa(cfg, lm_head=torch.randn(VOCAB, H))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    save_medusa(heads, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == ["MedusaModel"] and saved["version"] == "1"
    loaded = load_decoder(tmp_path / "out", role=Role.MEDUSA_HEAD, dtype=torch.float32).module
    assert isinstance(loaded, MedusaHeads)
    x = torch.randn(3, H)
    torch.testing.assert_close(loaded(x), heads.to(torch.bfloat16).float()(x))


@pytest.mark.parametrize(("kw", "needle"), [
    (dict(hidden=32, vocab=VOCAB), "hidden_size is 32, the target's 64"),
    (dict(hidden=H, vocab=80), "vocab_size is 80, the target's 64"),
    (dict(hidden=H, vocab=80, shared=True, sizes=True), "vocab_size is 80, the target's 64"),
], ids=["hidden-size", "vocabulary", "stated-vocabulary-shared"])
def test_mismatched_heads_fail_at_build_naming_the_mismatch(tiny_llama, tmp_path, kw, needle) -> None:
    target = tiny_llama(vocab=VOCAB, seed=0)
    path = medusa_checkpoint(tmp_path / "h", **kw)
    with pytest.raises((ValueError, CheckpointError)) as e:
        LLM(str(target.path), MedusaConfig(path=str(path)), runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64))
    assert needle in str(e.value) and str(path) in str(e.value)


# -- in the step ------------------------------------------------------------------------------------


def test_drafts_are_the_heads_top1_on_the_bonus_rows_hidden_state(tiny_llama, monkeypatch) -> None:
    # Four ragged requests, prompts fed in chunks of 7 beside other requests'
    # verification rows, γ = 3 of K = 4 heads. Every chain a step leaves must be
    # each head's argmax on the target's final-norm hidden state at the row
    # that produced the bonus token (computed densely from the committed sequence).
    target = tiny_llama(vocab=VOCAB, seed=0)
    hpath = medusa_for(target, "medusa")
    seen: list[tuple[str, int, list[int]]] = []
    real = MedusaDrafter.draft_after

    def spy(self, step, gamma, sampling):
        tree = real(self, step, gamma, sampling)
        owner = step.state._owner
        pos = (step.first_position + step.num_accepted).tolist()
        for slot, p, d in zip(step.slots.tolist(), pos, tree.tokens.tolist()):
            seen.append((owner[slot], p, d))
        return tree

    monkeypatch.setattr(MedusaDrafter, "draft_after", spy)
    llm = LLM(str(target.path), MedusaConfig(path=str(hpath), num_speculative_tokens=3),
              runtime=RuntimeConfig(max_batch_size=4, max_seq_len=64, block_size=4),
              engine_config=EngineConfig(max_batch_size=4, max_tokens_per_step=7))
    engine = llm.new_engine()
    ctxs = [engine.add_request(p, SamplingParams(max_new_tokens=12)) for p in _prompts(5, 4, hi=20)]
    engine.run()
    seqs = {c.request_id: list(c.tokens) for c in ctxs}
    ref = load_decoder(target.path, dtype=torch.float32).module
    heads = load_medusa(hpath, target=ref.config, dtype=torch.float32)
    checked = 0
    for rid, pos, drafts in seen:
        seq = seqs[rid][: pos + 1]  # the bonus row is position pos
        if len(seq) < pos + 1:
            continue
        with torch.no_grad():
            x = ref.model.embed_tokens(torch.tensor(seq))
            s = len(seq)
            cos, sin = ref._rope(torch.arange(s), s - 1)
            hid, _ = ref._layers(x, cos, sin, DenseCausalAttend(1, s, None), ())
            want = heads(hid[-1], 3).argmax(-1).tolist()
        assert drafts == want, f"request {rid} at position {pos}"
        checked += 1
    assert checked >= 4 * 3


def test_echo_heads_accept_exactly_the_repeats(tiny_llama, generate) -> None:
    # Identity blocks sharing the target's lm_head: every head proposes the bonus
    # token again, so acceptance is fixed by plain decoding's output; a hidden state
    # from the wrong row or request would change the counts.
    target = tiny_llama(vocab=VOCAB, seed=0, qk_scale=0.1)  # loopy: repeats happen
    ps, sp = _prompts(7, 12), SamplingParams(max_new_tokens=20)
    ref, _ = generate(target, None, ps, sp)
    for g in (1, 4):
        out, llm = generate(target, MedusaConfig(path=str(medusa_for(target, "medusa-echo")),
                                                 num_speculative_tokens=g), ps, sp)
        assert out == ref
        per = llm.pipeline.stats().per_request
        for i, r in enumerate(ref):
            got, want = per[f"req-{i}"], expected_counts(r, g)
            assert (got.accepted_hist, got.reached) == (want.accepted_hist, want.reached), f"request {i}, γ={g}"
        assert llm.pipeline.stats().counts.accepted > 0


@pytest.mark.parametrize("kind", ["medusa", "medusa-shared"])
def test_published_layouts_run_exactly_and_gamma_is_at_most_k(tiny_llama, generate, kind) -> None:
    target = tiny_llama(vocab=VOCAB, seed=0)
    ps, sp = _prompts(3, 6), SamplingParams(max_new_tokens=10)
    ref, _ = generate(target, None, ps, sp)
    out, llm = generate(target, MedusaConfig(path=str(medusa_for(target, kind)), num_speculative_tokens=7), ps, sp)
    assert out == ref
    assert llm.pipeline.config.num_speculative_tokens == 4  # K = 4 heads: γ = min(K, 7)
    assert len(llm.pipeline.stats().counts.reached) <= 4


def test_the_shared_heads_borrow_the_targets_lm_head(tiny_llama) -> None:
    target = tiny_llama(vocab=VOCAB, seed=0)
    llm = LLM(str(target.path), MedusaConfig(path=str(medusa_for(target, "medusa-shared")), num_speculative_tokens=2),
              runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64))
    heads = llm.pipeline.proposer.heads
    assert heads._lm_head.weight.data_ptr() == llm.pipeline.target.build_module().lm_head.weight.data_ptr()


MEDUSA_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


@pytest.mark.parametrize("kind", ["medusa", "medusa-echo"])
def test_static_tree_runs_exactly(tiny_llama, generate, greedy_margin, kind) -> None:
    # Medusa choices: 9 nodes, depth 4 (K = 4 / 8 heads); budgets 9 and 5 (a prefix of the tree).
    # Requests whose greedy choice is a near tie (< 1e-4, float noise decides) are not compared.
    target = tiny_llama(vocab=VOCAB, seed=0, qk_scale=0.1)
    ps, sp = _prompts(11, 8), SamplingParams(max_new_tokens=16)
    ref, _ = generate(target, None, ps, sp)
    clear = [i for i, (p, r) in enumerate(zip(ps, ref)) if greedy_margin(target.hf, p, r) > 1e-4]
    assert len(clear) >= 6
    for n in (9, 5):
        cfg = MedusaConfig(path=str(medusa_for(target, kind)), num_speculative_tokens=n,
                           tree={"kind": "static", "choices": MEDUSA_TREE})
        out, llm = generate(target, cfg, ps, sp)
        assert [out[i] for i in clear] == [ref[i] for i in clear], f"{kind}, {n} nodes"
        if kind == "medusa-echo":  # the repeats it proposes are accepted along the tree
            assert llm.pipeline.stats().counts.accepted > 0


def test_a_static_tree_without_choices_takes_the_heads_shipped_list(tiny_llama, generate, greedy_margin,
                                                                     tmp_path) -> None:
    import shutil

    from specdec.spec.proposers.draft_model import DraftModelConfig

    target = tiny_llama(vocab=VOCAB, seed=0, qk_scale=0.1)
    heads = tmp_path / "heads"
    shutil.copytree(medusa_for(target, "medusa-echo"), heads)
    with pytest.raises(ValueError, match=r"manifest.json lists no static tree"):
        MedusaConfig(path=str(heads), num_speculative_tokens=4, tree={"kind": "static"})
    shipped = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [2], [0, 0, 0, 0]]  # likeliest first, as training lists it
    (heads / "manifest.json").write_text(json.dumps({"heldout": {"shipped": {"static_tree": {"choices": shipped}}}}))
    cfg = MedusaConfig(path=str(heads), num_speculative_tokens=5, tree={"kind": "static"})
    assert [list(c) for c in cfg.tree.choices] == shipped and cfg.num_speculative_tokens == 5
    ps, sp = _prompts(6, 8), SamplingParams(max_new_tokens=16)
    ref, _ = generate(target, None, ps, sp)
    out, llm = generate(target, cfg, ps, sp)
    clear = [i for i, (p, r) in enumerate(zip(ps, ref)) if greedy_margin(target.hf, p, r) > 1e-4]
    assert len(clear) >= 3 and [out[i] for i in clear] == [ref[i] for i in clear]
    # the budget kept the first 5 listed: depth 3 through [0, 0, 0], not the 3 root children first
    assert llm.pipeline.proposer.drafter.static_shape(5).max_depth == 3
    with pytest.raises(ValueError, match="required for tree.kind=static"):
        DraftModelConfig(path=str(heads), tree={"kind": "static"})


def test_a_tree_deeper_than_the_heads_or_dynamic_is_refused(tiny_llama) -> None:
    target = tiny_llama(vocab=VOCAB, seed=0)
    deep = MedusaConfig(path=str(medusa_for(target, "medusa")), num_speculative_tokens=5,
                        tree={"kind": "static", "choices": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0] * 5]})
    with pytest.raises(ValueError, match="reach depth 5"):
        LLM(str(target.path), deep, runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64))
    with pytest.raises(ValueError, match="one distribution per depth"):
        MedusaConfig(path="x", tree={"kind": "dynamic"})


def test_static_tree_tokens_are_each_depths_head_top_k(tmp_path) -> None:
    # Medusa's candidates: node i = the ranks[i]-th top token of head depth[i] - 1.
    from specdec.spec.tree import static_tree

    heads = load_medusa(medusa_checkpoint(tmp_path / "m", hidden=H, vocab=VOCAB, heads=3))
    d = MedusaDrafter(heads)
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    d.choices = tuple(tuple(c) for c in choices)
    t = static_tree(choices)
    h = torch.randn(2, H)
    tree = d.tree_tokens(h, 7)
    top = heads(h).topk(3, dim=-1).indices  # [B, K, 3]
    want = [[int(top[b, len(p) - 1, p[-1]]) for p in t.paths] for b in range(2)]
    assert tree.tokens.tolist() == want and not tree.is_chain
    assert tree.parents.tolist() == [t.parents.tolist()] * 2
    assert (tree.max_depth, tree.max_children) == (3, 3)
