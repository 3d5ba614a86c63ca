"""``python -m specdec.train train=medusa`` on the tiny target and corpus of test_train_app.py:
resumes to the uninterrupted result, the output loads in the shared-lm-head and own-lm-head
layouts, the loss falls, and the simulated τ counts the steps the real pipeline takes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_train_app import compose, overrides, run, tiny, weights  # noqa: F401  (tiny: the module fixture)


@pytest.mark.parametrize("own", [False, True], ids=["shared-lm-head", "own-lm-head"])
def test_medusa_recipe_resumes_and_loads(tiny: dict[str, Path], tmp_path: Path, own: bool) -> None:  # noqa: F811
    from specdec.train.app import Stopped
    from specdec.models.medusa import load_medusa

    extra = ["train.medusa_num_heads=3", "train.medusa_num_layers=2", f"train.medusa_own_lm_head={str(own).lower()}"]
    whole = run(overrides(tiny, "medusa", tmp_path / "whole", *extra))
    part_dir = tmp_path / "part"
    with pytest.raises(Stopped):
        run(overrides(tiny, "medusa", part_dir, "stop_after=3", *extra))
    resumed = run(overrides(tiny, "medusa", part_dir, "resume=true", *extra))
    a, b = weights(tmp_path / "whole" / "out"), weights(part_dir / "out")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert whole["losses"]["eval"] == resumed["losses"]["eval"]
    # published keys: one shared block per head (stored once), and an lm head per head only when own
    lm = {f"medusa_head.{i}.2.weight" for i in range(3)}
    assert {f"medusa_head.{i}.0.linear.weight" for i in range(3)} <= a.keys()
    assert (lm <= a.keys()) if own else not (lm & a.keys())
    out = part_dir / "out"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["version"] == ("1" if own else "2") and cfg["medusa_num_heads"] == 3
    heads = load_medusa(out)
    assert heads.config.shared_lm_head != own and heads.config.hidden_size == 32
    m = json.loads((out / "manifest.json").read_text())
    assert m["recipe"] == "medusa" and 1.0 <= m["heldout"]["shipped"]["tau"] <= 4.0
    # the shipped heads' static tree: likeliest first, each prefix a tree, τ predicted from the accuracies
    from specdec.spec.tree import static_tree

    tree = m["heldout"]["shipped"]["static_tree"]
    acc, choices = tree["rank_accuracy"], tree["choices"]
    assert len(acc) == 3 and max(len(c) for c in choices) <= 3
    static_tree(choices, budget=5)
    assert tree["expected_tau"]["1"] == pytest.approx(1 + acc[0][0], abs=1e-3)


def test_medusa_loss_falls_and_the_simulation_counts_the_pipelines_steps(tiny: dict[str, Path],  # noqa: F811
                                                                         tmp_path: Path) -> None:
    from specdec.api import LLM
    from specdec.core.checkpoint import load_decoder
    from specdec.core.context import SamplingParams
    from specdec.models.medusa import load_medusa
    from specdec.spec.proposers.medusa import MedusaConfig
    from specdec.train.app import train
    from specdec.train.config import to_train_config
    from specdec.train.data import TargetFeatures, chain_tau

    args = overrides(tiny, "medusa", tmp_path / "r", "train.steps=30", "eval.every=0", "checkpoint_every=0",
                     "train.lr=1e-2")
    cfg = to_train_config(compose(args))
    m = train(cfg, cfg.run_dir)
    losses = [r[1] for r in m["losses"]["curve"]]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    # The pipeline with the trained heads takes as many steps as the simulation says (+ the prefill).
    out = tmp_path / "r" / "out"
    g = 4
    prompt = torch.randint(3, 250, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    sp = SamplingParams(max_new_tokens=24)
    plain = LLM(str(tiny["target"]), None, max_seq_len=64).generate([prompt], sp)[0].token_ids
    llm = LLM(str(tiny["target"]), MedusaConfig(path=str(out), num_speculative_tokens=g), max_seq_len=64)
    assert llm.generate([prompt], sp)[0].token_ids == plain
    target = load_decoder(tiny["target"]).module
    heads = load_medusa(out, target=target.config)
    heads.attach_target(target.lm_head)
    seq = torch.tensor(prompt + plain)
    s = seq.numel()
    with torch.no_grad():
        h = TargetFeatures(target).run(seq[None]).hidden[0]  # final-norm hidden states [s, H]
        pred = heads(h, g).argmax(-1)  # [s, g]
    ok = torch.zeros(s - 1, g, dtype=torch.bool)
    for j in range(g):
        ok[: s - 2 - j, j] = pred[: s - 2 - j, j] == seq[j + 2 :]
    sim = chain_tau(ok, len(prompt), g)
    assert llm.pipeline.stats().counts.steps == sim["steps"] + 1


def test_medusa_argmax_target_scores_the_targets_greedy_token(tiny: dict[str, Path]) -> None:  # noqa: F811
    """``ce_target=argmax``: head i's CE is the NLL of the target's greedy token i + 1 positions on."""
    import torch.nn.functional as F

    from specdec.core.checkpoint import load_decoder
    from specdec.train.config import RecipeConfig
    from specdec.train.data import TargetFeatures
    from specdec.train.medusa import MedusaRecipe

    target = load_decoder(tiny["target"]).module.float()
    tokens = torch.randint(3, 250, (2, 10), generator=torch.Generator().manual_seed(1))
    feats = TargetFeatures(target).run(tokens)
    hidden = feats.hidden  # [2, 10, H] the target's final-norm hidden states
    losses = {}
    for kind in ("soft", "argmax"):
        recipe = MedusaRecipe(RecipeConfig(recipe="medusa", medusa_num_heads=2, ce_target=kind), target, tokens.flatten(), 0)
        with torch.no_grad():
            for p in recipe.head.parameters():  # away from the identity init, the same for both kinds
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
            losses[kind] = recipe.loss(feats, None)[1]
            if kind == "argmax":
                greedy = target.lm_head(hidden[:, 1:]).argmax(-1)  # [B, 9]: the target's token x_{t+2}
                ys = recipe.head.features(hidden, 2)
                for i in range(2):
                    n = 9 - i
                    logq = F.log_softmax(recipe.head.logits_of(i, ys[:, :n, i]).float(), -1)
                    want = F.nll_loss(logq.flatten(0, 1), greedy[:, i : i + n].flatten())
                    assert losses[kind][f"ce_{i}"] == pytest.approx(float(want), rel=1e-5)
    assert losses["soft"]["ce_0"] != pytest.approx(losses["argmax"]["ce_0"], rel=1e-5)  # the soft loss is another one


def test_rank_accuracy_counts_hits_where_a_tree_could_reach() -> None:
    from specdec.train.medusa import rank_accuracy

    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])  # prompt_len 2: roots t = 1, 2, 3
    top = torch.zeros(1, 6, 2, 2, dtype=torch.long)  # [N, L, K=2 heads, R=2 ranks]
    top[0, 1, 0] = torch.tensor([8, 0])  # head 0 at t=1: rank 0 is x_3
    top[0, 2, 0] = torch.tensor([0, 9])  # t=2: rank 1 is x_4
    top[0, 3, 0] = torch.tensor([0, 0])  # t=3: a miss
    top[0, 1, 1] = torch.tensor([0, 9])  # head 1 at t=1: rank 1 is x_4 (reached: x_3 in head 0's top)
    top[0, 2, 1] = torch.tensor([10, 0])  # t=2: rank 0 is x_5 (reached); t=3 has no x_6
    acc = rank_accuracy(top, tokens, prompt_len=2)
    assert acc == [[pytest.approx(1 / 3), pytest.approx(1 / 3)], [pytest.approx(1 / 2), pytest.approx(1 / 2)]]
    top[0, 2, 0] = 0  # head 0 misses at t=2 too: head 1 is reached only at t=1
    assert rank_accuracy(top, tokens, prompt_len=2)[1] == [0.0, 1.0]
