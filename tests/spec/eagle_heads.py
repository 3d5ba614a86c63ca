"""Random EAGLE-1 / EAGLE-3 heads for a tiny target, saved in the published layouts.

``eagle_head(target_dir, kind, seed=0, draft_vocab=None, echo=False) -> Path``.
A random head agrees with the target about 1/V of the time (the rejection
path). ``echo=True`` makes an EAGLE-1 head whose output is its input
feature (fc passes the feature through, the layer adds nothing): its first
draft is the target's own next token after the last one, i.e. it proposes
"the bonus token repeats" — accepted whenever the target repeats a token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.models.config import LlamaConfig
from specdec.models.eagle import EagleHeadConfig, new_head, save_head


def eagle_head(target_dir: Path, out_dir: Path, kind: str, *, seed: int = 0, draft_vocab: int | None = None,
               echo: bool = False, std: float = 0.3) -> Path:
    tcfg = LlamaConfig.from_dict(json.loads((Path(target_dir) / "config.json").read_text()))
    cfg = EagleHeadConfig.from_target(kind, tcfg, draft_vocab_size=draft_vocab)
    head = new_head(cfg, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, std, generator=g)
        if echo:
            assert kind == "eagle"
            h = tcfg.hidden_size
            head.fc.weight.zero_()
            head.fc.weight[:, h:] = torch.eye(h)
            head.fc.bias.zero_()
            head.layers[0].self_attn.o_proj.weight.zero_()
            head.layers[0].mlp.down_proj.weight.zero_()
    if kind == "eagle3" and draft_vocab is not None:
        head.set_draft_vocab(torch.randperm(tcfg.vocab_size, generator=g)[:draft_vocab])
    save_head(head, out_dir, num_target_layers=tcfg.num_hidden_layers)
    return Path(out_dir)


_HEADS: dict[tuple[str, str], Path] = {}
_BASE: Path | None = None  # one temporary directory for the session's heads, removed at exit


def _base() -> Path:
    global _BASE
    if _BASE is None:
        import atexit
        import shutil
        import tempfile

        _BASE = Path(tempfile.mkdtemp(prefix="specdec-test-heads-"))
        atexit.register(shutil.rmtree, _BASE, True)
    return _BASE


def scratch_dir(name: str) -> Path:
    """A new directory under the session's temporary one (removed at exit): for test
    checkpoints that outlive a test (cached per target), so none is left in /tmp."""
    out = _base() / f"{sum(1 for _ in _base().iterdir())}-{name}"
    out.mkdir()
    return out


def head_for(target: object, kind: str) -> Path:
    """A head for the tiny target ``target`` (a conftest ``Tiny``), made once per
    (target, kind): ``eagle``, ``eagle-echo``, ``eagle3`` or ``eagle3-small-vocab``
    (a draft vocabulary of 3/4 of the target's, a random subset)."""
    path = Path(target.path)  # type: ignore[attr-defined]
    key = (str(path), kind)
    if key not in _HEADS:
        out = _base() / f"{len(_HEADS)}-{kind}"
        vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
        base = "eagle3" if kind.startswith("eagle3") else "eagle"
        _HEADS[key] = eagle_head(path, out, base, echo=kind == "eagle-echo",
                                 draft_vocab=vocab * 3 // 4 if kind == "eagle3-small-vocab" else None)
    return _HEADS[key]
