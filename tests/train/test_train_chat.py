"""``data.corpus=instructions`` (a chat target's self-distillation): the generated requests are a
pure function of the seed, and the held-out set of requests of different lengths (right-padded)
simulates τ exactly as each request alone would."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_train_app import tiny  # noqa: F401  (tiny: the module fixture)

from specdec.train.data import DataConfig, GenerateConfig, TargetFeatures, chat_eval_set, instruction_split


def test_requests_are_fixed_by_the_seed_and_split_without_overlap() -> None:
    cfg = DataConfig(corpus="instructions", generate=GenerateConfig(prompts=60))
    a, b, c = instruction_split(cfg, 0), instruction_split(cfg, 0), instruction_split(cfg, 1)
    assert a.train == b.train and a.held_out == b.held_out
    assert [t for _, t in a.train] != [t for _, t in c.train]
    texts = [t for _, t in a.train + a.held_out]
    assert len(texts) == 60 == len(set(texts)) and a.held_out and not set(a.train) & set(a.held_out)


@pytest.mark.parametrize("recipe", ["eagle3", "medusa"])
def test_padded_held_out_rows_simulate_as_each_request_alone(tiny: dict[str, Path], recipe: str) -> None:  # noqa: F811
    from specdec.core.checkpoint import load_decoder
    from specdec.train.config import RecipeConfig
    from specdec.train.eagle import HeadRecipe
    from specdec.train.medusa import MedusaRecipe

    target = load_decoder(tiny["target"], dtype=torch.float32).module.eval()
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(2, 250, (400,), generator=g)
    if recipe == "medusa":
        r = MedusaRecipe(RecipeConfig(recipe="medusa", medusa_num_heads=3), target, stream, seed=0)
        with torch.no_grad():  # heads that guess differently per position, so spans matter
            for p in r.module.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    else:
        r = HeadRecipe(RecipeConfig(recipe="eagle3", ttt_steps=1), target, stream, seed=0)
    feats = TargetFeatures(target, r.capture)
    # (prompt, answer) pairs of different lengths; the answers: the target's own greedy tokens
    from specdec.train.data import greedy_continue

    pairs = []
    for plen, alen in ((7, 20), (12, 9), (5, 30)):
        seq = greedy_continue(target, stream[None, plen * 3 : plen * 4], alen)[0].tolist()
        pairs.append((seq[:plen], seq[plen:]))
    held = torch.cat([torch.tensor([0, *p, *a]) for p, a in pairs])
    together = r.tau(chat_eval_set(feats, pairs, held, prompts=3, loss_windows=0, seq_len=16, pad=0), 3)
    alone = [r.tau(chat_eval_set(feats, [pr], held, prompts=1, loss_windows=0, seq_len=16, pad=0), 3)
             for pr in pairs]
    for key in ("tokens", "steps"):
        assert together[key] == sum(a[key] for a in alone)
    assert together["tokens"] == sum(len(a) - 1 for _, a in pairs)  # every answer token after the prefill's


def test_medusa_trains_on_chat_requests(tiny: dict[str, Path], tmp_path: Path,  # noqa: F811
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from test_train_app import overrides, run

    from specdec.models.medusa import load_medusa
    from specdec.train import instructions as I

    # the tiny target (256 positions, a code tokenizer) fits no passage-reading request: the others only
    monkeypatch.setattr(I, "FAMILIES", tuple(f for f in I.FAMILIES if f[0] not in (I._extraction, I._summarize,
                                                                                    I._passage)))

    chat_target = tmp_path / "target"  # the tiny target with a chat template of its own
    shutil.copytree(tiny["target"], chat_target)
    (chat_target / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}")
    m = run([*overrides({**tiny, "target": chat_target}, "medusa", tmp_path / "r", "train.medusa_num_heads=3"),
             "data.corpus=instructions",
             "data.generate.prompts=24", "data.generate.prompt_len=240", "data.generate.new_tokens=12", "eval.prompts=4"])
    assert m["recipe"] == "medusa" and m["data"]["root"] == "specdec.train.instructions"
    ev = m["data"]["heldout_eval"]
    assert "chat template" in ev["rule"] and 0 < ev["new_tokens"] <= 12 * ev["prompts"]
    shipped = m["heldout"]["shipped"]
    assert 1.0 <= shipped["tau"] <= 4.0 and m["losses"]["eval"][-1]["tau"] >= 1.0
    acc = shipped["static_tree"]["rank_accuracy"]
    assert len(acc) == 3 and all(0.0 <= a <= 1.0 for row in acc for a in row)
    assert load_medusa(tmp_path / "r" / "out").config.num_heads == 3
