"""EAGLE-1 / EAGLE-3: published layouts load, mismatched heads fail by name, and
the drafts made inside the step are exactly what the head computes from the
committed sequence (the catch-up sees the right features, tokens and positions).

Greedy equality with plain decoding: tests/spec/test_greedy_exactness.py;
the sampled distribution: tests/spec/test_sampling_exactness.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from specdec.api import LLM
from specdec.core.checkpoint import CheckpointError, load_decoder
from specdec.core.context import SamplingParams
from specdec.core.pipeline_model import RuntimeConfig
from specdec.core.registry import Role
from specdec.engine import EngineConfig
from specdec.models.eagle import Eagle1Head, Eagle3Head, EagleHead
from specdec.models.llama import DenseCausalAttend, LlamaDecoder
from specdec.spec.proposers.eagle import Eagle3Config, EagleConfig, EagleDrafter

from eagle_heads import head_for  # tests/spec/eagle_heads.py
from echo_drafter import expected_counts  # tests/spec/echo_drafter.py

VOCAB = 64
H = 64  # the tiny targets' hidden size (tests/spec/conftest.py)


def _prompts(seed: int, n: int, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, hi))] for _ in range(n)]


def _config(kind: str, path: Path, g: int) -> Any:
    return (Eagle3Config if kind.startswith("eagle3") else EagleConfig)(path=str(path), num_speculative_tokens=g)


# -- the drafts are the head's own computation -------------------------------------------------


def _reference_drafts(target: LlamaDecoder, head: EagleHead, seq: list[int], gamma: int) -> list[int]:
    """Drafts for the committed sequence ``seq`` (its last token the bonus), dense and
    from scratch: pairs (target feature at p, token p + 1) for every p, then γ - 1
    steps each feeding the head's own state back with the token it drafted."""
    with torch.no_grad():
        s = len(seq) - 1
        x = target.model.embed_tokens(torch.tensor(seq[:-1]))
        cos, sin = target._rope(torch.arange(s), s - 1)
        hid, aux = target._layers(x, cos, sin, DenseCausalAttend(1, s, None), head.aux_layers)
        feats = head.project(hid, torch.cat(aux, -1) if aux else None)  # [s, H]
        toks = list(seq[1:])
        drafts: list[int] = []
        for _ in range(gamma):
            h = head.forward_dense(torch.tensor([toks]), feats.unsqueeze(0))[0, -1]
            d = int(head.target_logits(h).argmax())
            drafts.append(d)
            toks.append(d)
            feats = torch.cat([feats, h.unsqueeze(0)])
        return drafts


@pytest.mark.parametrize("kind", ["eagle", "eagle3-small-vocab"])
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole-prompts", "prefill-chunks-of-7"])
def test_drafts_equal_the_heads_dense_computation(tiny_llama, monkeypatch, kind, chunk) -> None:
    # Four ragged requests, γ = 3, greedy; prompts fed whole or in chunks of 7
    # tokens (beside other requests' verification rows). Every draft any step
    # makes must be what the head computes densely from that request's
    # committed sequence: the catch-up got each row's feature and next token,
    # and the head's own KV cache was rolled back with the target's.
    target = tiny_llama(vocab=VOCAB, seed=0)
    hpath = head_for(target, kind)
    g = 3
    seen: list[tuple[str, int, list[int]]] = []  # (request id, bonus position, drafts)
    real = EagleDrafter.draft_after

    def spy(self, step, gamma, sampling):
        tree = real(self, step, gamma, sampling)
        owner = step.state._owner
        pos = step.inputs.positions.index_select(0, step.bonus_row)
        for slot, p, d in zip(step.slots.tolist(), pos.tolist(), tree.tokens.tolist()):
            seen.append((owner[slot], p, d))
        return tree

    monkeypatch.setattr(EagleDrafter, "draft_after", spy)
    ps = _prompts(5, 4, hi=20)
    ec = EngineConfig(max_batch_size=4, **({"max_tokens_per_step": chunk} if chunk else {}))
    llm = LLM(str(target.path), _config(kind, hpath, g),
              runtime=RuntimeConfig(max_batch_size=4, max_seq_len=64, block_size=4), engine_config=ec)
    engine = llm.new_engine()
    ctxs = [engine.add_request(p, SamplingParams(max_new_tokens=12)) for p in ps]
    engine.run()
    seqs = {c.request_id: list(c.tokens) for c in ctxs}  # prompt then output

    ref_target = load_decoder(target.path, dtype=torch.float32).module
    head = load_decoder(hpath, role=Role.DRAFT_HEAD, dtype=torch.float32).module
    head.attach_target(ref_target.model.embed_tokens, ref_target.lm_head)
    checked = 0
    for rid, pos, drafts in seen:
        # Committed through pos + 1: the bonus token, or (a prefill chunk) the next prompt token.
        seq = seqs[rid][: pos + 2]
        if len(seq) < pos + 2:  # the request's last step: its tokens past max_new_tokens were cut
            continue
        assert drafts == _reference_drafts(ref_target, head, seq, g), f"request {rid} at position {pos}"
        checked += 1
    assert checked >= 4 * 3


def test_echo_head_accepts_exactly_the_repeats(tiny_llama, generate) -> None:
    # An EAGLE-1 head whose output is its input feature drafts the bonus token
    # γ times (the target's lm_head on the bonus row's feature). Its acceptance
    # is then fixed by plain decoding's output alone (echo_drafter.expected_counts):
    # any feature from the wrong row or request would change the counts.
    target = tiny_llama(vocab=VOCAB, seed=0, qk_scale=0.1)  # loopy: repeats happen
    ps = _prompts(7, 12)
    sp = SamplingParams(max_new_tokens=20)
    ref, _ = generate(target, None, ps, sp)
    for g in (1, 4):
        out, llm = generate(target, _config("eagle", head_for(target, "eagle-echo"), g), ps, sp)
        assert out == ref
        per = llm.pipeline.stats().per_request
        for i, r in enumerate(ref):
            got = per[f"req-{i}"]
            want = expected_counts(r, g)
            assert (got.accepted_hist, got.reached) == (want.accepted_hist, want.reached), f"request {i}, γ={g}"
        assert llm.pipeline.stats().counts.accepted > 0


# -- published layouts --------------------------------------------------------------------------


def _write(dirpath: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dirpath / "model.safetensors"))
    return dirpath


def _llama_cfg(**kw: Any) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": H,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "float32", **kw}


def _layer(prefix: str, d_in: int, norms: tuple[str, ...]) -> dict[str, torch.Tensor]:
    r = torch.randn
    t = {f"{prefix}.self_attn.q_proj.weight": r(64, d_in) * 0.1, f"{prefix}.self_attn.k_proj.weight": r(32, d_in) * 0.1,
         f"{prefix}.self_attn.v_proj.weight": r(32, d_in) * 0.1, f"{prefix}.self_attn.o_proj.weight": r(H, 64) * 0.1,
         f"{prefix}.mlp.gate_proj.weight": r(128, H) * 0.1, f"{prefix}.mlp.up_proj.weight": r(128, H) * 0.1,
         f"{prefix}.mlp.down_proj.weight": r(H, 128) * 0.1}
    t.update({f"{prefix}.{n}.weight": torch.ones(H) for n in norms})
    return t


def eagle1_checkpoint(d: Path, *, bias: bool | None = True, hidden: int = H, with_embed: bool = True) -> Path:
    """EAGLE-1 as published (SafeAILab/EAGLE cnets1): fc [H, 2H] (+ bias), layers.0.* with
    no input_layernorm, a one-layer LlamaForCausalLM config; the target's embedding
    sometimes stored too (not read)."""
    t = {"fc.weight": torch.randn(H, H + hidden) * 0.1, **_layer("layers.0", H, ("post_attention_layernorm",))}
    if bias is not False:
        t["fc.bias"] = torch.zeros(H)
    if with_embed:
        t["embed_tokens.weight"] = torch.randn(VOCAB, H)
    cfg = _llama_cfg() if bias is None else _llama_cfg(bias=bias)
    return _write(d, cfg, t)


def eagle3_checkpoint(d: Path, *, draft_vocab: int = 48, layer_ids: list[int] | None = None,
                      vocab: int = VOCAB) -> Path:
    """EAGLE-3 as published (EAGLE traineagle3 / SpecForge): fc [H, 3H], midlayer.* over 2H,
    its own norm and lm_head over a draft vocabulary, d2t [V_draft] int64, t2d [V] bool."""
    used = torch.randperm(vocab)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    t = {"fc.weight": torch.randn(H, 3 * H) * 0.1,
         **_layer("midlayer", 2 * H, ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
         "norm.weight": torch.ones(H), "lm_head.weight": torch.randn(draft_vocab, H) * 0.1,
         "d2t": used - torch.arange(draft_vocab), "t2d": t2d}
    cfg = _llama_cfg(architectures=["LlamaForCausalLMEagle3"], vocab_size=vocab, draft_vocab_size=draft_vocab,
                     target_hidden_size=H)
    if layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True}
    return _write(d, cfg, t)


@pytest.mark.parametrize("bias", [True, False, None], ids=["bias", "no-bias", "bias-key-absent"])
def test_published_eagle1_layout_loads(tmp_path, bias) -> None:
    # bias: false in config.json and no fc.bias; true and fc.bias; no key: fc.bias (EAGLE's default).
    path = eagle1_checkpoint(tmp_path / "e1", bias=bias)
    head = load_decoder(path, role=Role.DRAFT_HEAD).module
    assert isinstance(head, Eagle1Head) and head.config.kind == "eagle"
    assert (head.fc.bias is not None) == (bias is not False)
    assert not hasattr(head.layers[0].input_layernorm, "weight")  # layer 0 has no input norm
    assert "embed_tokens.weight" not in head.state_dict()  # borrowed from the target, never loaded


def test_published_eagle3_layout_loads_with_its_vocabulary_map(tmp_path) -> None:
    path = eagle3_checkpoint(tmp_path / "e3", layer_ids=[0, 1, 1])
    head = load_decoder(path, role=Role.DRAFT_HEAD).module
    assert isinstance(head, Eagle3Head)
    assert head.config.aux_layers == (0, 1, 1) and head.config.num_draft_vocab == 48
    head.prepare_for_inference()
    assert head.d2t.dtype == torch.long and head.t2d.dtype == torch.bool
    # Draft id i is target id i + d2t[i], and exactly those target ids are marked in t2d.
    assert torch.equal(head.t2d.nonzero().squeeze(1), head.draft_to_target)
    lg = head.target_logits(torch.randn(2, H))
    assert torch.isinf(lg[:, ~head.t2d]).all() and torch.isfinite(lg[:, head.t2d]).all()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_published_layouts_run_exactly(tiny_llama, generate, tmp_path, kind) -> None:
    target = tiny_llama(vocab=VOCAB, seed=0)
    path = (eagle1_checkpoint(tmp_path / "h") if kind == "eagle"
            else eagle3_checkpoint(tmp_path / "h", layer_ids=[1, 0, 1]))
    ps, sp = _prompts(3, 6), SamplingParams(max_new_tokens=10)
    ref, _ = generate(target, None, ps, sp)
    out, llm = generate(target, _config(kind, path, 3), ps, sp)
    assert out == ref
    if kind == "eagle3":
        assert llm.pipeline.proposer.spec.target_layers == (1, 0, 1)  # the ids its eagle_config names


@pytest.mark.parametrize(("make", "needle"), [
    (lambda d: eagle1_checkpoint(d, hidden=32), "mis-shaped: fc.weight"),
    (lambda d: eagle3_checkpoint(d, vocab=80), "vocab_size is 80, the target's 64"),
    (lambda d: eagle3_checkpoint(d, layer_ids=[0, 1, 5]), "aux layer ids [5] are not layers of the target"),
], ids=["hidden-size", "vocabulary", "layer-ids"])
def test_mismatched_head_fails_at_build_naming_the_mismatch(tiny_llama, tmp_path, make, needle) -> None:
    target = tiny_llama(vocab=VOCAB, seed=0)
    path = make(tmp_path / "h")
    kind = json.loads((path / "config.json").read_text())["architectures"][0]
    cfg = _config("eagle3" if kind.endswith("Eagle3") else "eagle", path, 2)
    with pytest.raises((ValueError, CheckpointError)) as e:
        LLM(str(target.path), cfg, runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64, block_size=4))
    assert needle in str(e.value) and str(path) in str(e.value)


def test_a_head_of_the_other_kind_is_refused(tiny_llama, tmp_path) -> None:
    target = tiny_llama(vocab=VOCAB, seed=0)
    path = eagle1_checkpoint(tmp_path / "h")
    with pytest.raises(ValueError, match="use method=eagle"):
        LLM(str(target.path), Eagle3Config(path=str(path)), runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64))


def test_the_head_borrows_the_targets_embedding(tiny_llama) -> None:
    target = tiny_llama(vocab=VOCAB, seed=0)
    llm = LLM(str(target.path), _config("eagle", head_for(target, "eagle"), 2),
              runtime=RuntimeConfig(max_batch_size=2, max_seq_len=64))
    head = llm.pipeline.proposer.head
    module = llm.pipeline.target.build_module()
    assert head.embed.weight.data_ptr() == module.model.embed_tokens.weight.data_ptr()
    assert head._target[1].weight.data_ptr() == module.lm_head.weight.data_ptr()
