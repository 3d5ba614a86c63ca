"""``train.init_from`` on an EAGLE-3 head: the run keeps the loaded head's draft vocabulary
(its lm_head rows belong to it), and every use of the vocabulary — the id map that training,
τ and the saved file read — is that one, even when the run's own train stream would pick another."""

from __future__ import annotations

from pathlib import Path

import torch
from test_train_app import tiny  # noqa: F401  (tiny: the module fixture)


def test_init_from_keeps_the_loaded_heads_draft_vocabulary(tiny: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    from specdec.core.checkpoint import load_decoder
    from specdec.core.registry import Role
    from specdec.train.config import RecipeConfig
    from specdec.train.eagle import HeadRecipe

    target = load_decoder(tiny["target"], dtype=torch.float32).module.eval()
    v = target.config.vocab_size
    low, high = torch.arange(2, 60).repeat(5), torch.arange(v - 60, v - 2).repeat(5)  # disjoint top tokens
    first = HeadRecipe(RecipeConfig(recipe="eagle3", draft_vocab_size=40), target, low, seed=0)
    first.save(tmp_path / "first", tiny["target"])
    saved = load_decoder(tmp_path / "first", role=Role.DRAFT_HEAD, dtype=torch.float32).module.draft_to_target

    second = HeadRecipe(RecipeConfig(recipe="eagle3", draft_vocab_size=40, init_from=str(tmp_path / "first")),
                        target, high, seed=0)
    head = second.head
    assert torch.equal(head.draft_to_target, saved)  # the map training and τ read
    assert torch.equal(head.t2d.nonzero().flatten(), saved)  # which target argmaxes are scored
    assert second.info["draft_vocab"]["train_token_coverage"] == 0.0  # (none of the new stream's tokens)
    second.save(tmp_path / "second", tiny["target"])
    back = load_decoder(tmp_path / "second", role=Role.DRAFT_HEAD, dtype=torch.float32).module
    assert torch.equal(back.draft_to_target, saved)
