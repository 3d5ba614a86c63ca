"""A dynamic (EAGLE-2) token tree drafted by one native call (``Backend.head_tree`` /
``draft_tree``: ``specdec_cpu::eagle_tree`` / ``decoder_tree``) gives the Python loop's
candidates bit for bit, and so the same trees; the small-batch host paths of
:func:`~specdec.spec.tree.ancestor_mask` and :func:`~specdec.spec.tree.dynamic_tree_select`
give the tensor paths' results.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import specdec.spec.proposers.draft_model as draft_model_mod
import specdec.spec.proposers.eagle as eagle_mod
from specdec.api import LLM
from specdec.core.context import SamplingParams
from specdec.core.kernels import cpu_kernels_available
from specdec.core.pipeline_model import RuntimeConfig
from specdec.engine import EngineConfig
from specdec.spec import tree as tree_mod
from specdec.spec.tree import ancestor_mask, dynamic_tree_select

ZOO = Path(__file__).parents[2] / "specdec" / "zoo"
PROMPTS = ["def fib(n):\n    if n < 2:\n        return n\n", "import os\nimport sys\n\n\ndef main(argv):\n"]
METHODS = {
    "eagle3": {"name": "eagle3", "path": str(ZOO / "code-eagle3")},
    "draft_model": {"name": "draft_model", "path": str(ZOO / "code-draft")},
}


@pytest.mark.skipif(not cpu_kernels_available(), reason="specdec's CPU kernels did not build here")
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_native_tree_expansion_drafts_the_python_loop_s_trees(method, batch, monkeypatch) -> None:
    # Every step's drafted tree (tokens, parents, sizes) with the native expansion, then with
    # the Python loop (native_tree_serves patched off), from the same engine state.
    mod = eagle_mod if method == "eagle3" else draft_model_mod
    tree = {"kind": "dynamic", "depth": 4, "top_k": 3, "total_tokens": 6}
    llm = LLM(str(ZOO / "code-target"), method={**METHODS[method], "num_speculative_tokens": 6, "tree": tree},
              runtime=RuntimeConfig(max_batch_size=batch, max_seq_len=256),
              engine_config=EngineConfig(max_batch_size=batch))
    real_draft, real_serves = mod.draft_dynamic_tree, mod.native_tree_serves
    seen: dict[bool, list] = {True: [], False: []}
    natives = []

    def both(step, logits, state, slots, cfg, n, num_draft=None, native=None):  # noqa: ANN001, ANN202
        natives.append(native is not None)
        out = real_draft(step, logits, state, slots, cfg, n, num_draft, native=native)
        seen[True].append([t.clone() for t in out])
        seen[False].append([t.clone() for t in real_draft(step, logits, state, slots, cfg, n, num_draft)])
        return out

    monkeypatch.setattr(mod, "draft_dynamic_tree", both)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS[:batch], sp)
    assert natives and all(natives)
    for a, b in zip(seen[True], seen[False]):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), (a, b)
    monkeypatch.setattr(mod, "native_tree_serves", lambda *a: False)
    monkeypatch.setattr(mod, "draft_dynamic_tree", real_draft)
    assert [o.token_ids for o in llm.generate(PROMPTS[:batch], sp)] == [o.token_ids for o in outs]
    assert real_serves is tree_mod.native_tree_serves


def _random_tree(g: torch.Generator, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    parents = torch.stack([torch.randint(-1, max(i, 0), (b,), generator=g) if i else torch.full((b,), -1)
                           for i in range(n)], 1)
    return parents, torch.randint(n + 1, (b,), generator=g)


def test_host_ancestor_mask_equals_the_tensor_closure(monkeypatch) -> None:
    g = torch.Generator().manual_seed(5)
    for trial in range(150):
        b, n = 3, int(torch.randint(1, 10, (1,), generator=g))
        parents, num_nodes = _random_tree(g, b, n)
        nodes = None if trial % 4 == 0 else num_nodes
        host = ancestor_mask(parents, nodes)
        monkeypatch.setattr(tree_mod, "HOST_WALK_NODES", -1)
        dev = ancestor_mask(parents, nodes)
        monkeypatch.undo()
        assert host.dtype == torch.bool and torch.equal(host, dev), (parents, nodes)


def test_host_dynamic_tree_select_equals_the_tensor_path(monkeypatch) -> None:
    # Ties (scores drawn from a few values), -inf, NaN and +inf candidates, budgets past M.
    g = torch.Generator().manual_seed(6)
    values = torch.tensor([-0.5, -1.0, -2.0, float("-inf"), float("nan"), float("inf"), -3.0])
    for trial in range(200):
        b, m = 2, int(torch.randint(1, 12, (1,), generator=g))
        parents, _ = _random_tree(g, b, m)
        scores = values[torch.randint(len(values), (b, m), generator=g)]
        k = int(torch.randint(1, m + 1, (1,), generator=g))
        host = dynamic_tree_select(scores, parents, k)
        monkeypatch.setattr(tree_mod, "HOST_SELECT_CANDIDATES", -1)
        dev = dynamic_tree_select(scores, parents, k)
        monkeypatch.undo()
        for x, y in zip(host, dev):
            assert x.dtype == y.dtype and torch.equal(x, y), (scores, parents, k, host, dev)


def test_host_budgeted_selection_equals_the_tensor_path(monkeypatch) -> None:
    # draft_dynamic_tree with per-request budgets (num_draft) over given candidates (a stand-in
    # native expansion), on host lists and as tensor ops: the same trees.
    from specdec.spec.tree import TreeConfig, draft_dynamic_tree

    g = torch.Generator().manual_seed(7)
    values = torch.tensor([-0.5, -1.0, -2.0, float("-inf"), float("nan"), -3.0])
    k, depth = 2, 3
    m = k + (depth - 1) * k * k
    cfg = TreeConfig(kind="dynamic", top_k=k, depth=depth)
    for trial in range(150):
        b = 3
        parents, _ = _random_tree(g, b, m)
        scores = values[torch.randint(len(values), (b, m), generator=g)]
        tokens = torch.randint(50, (b, m), generator=g)
        n = int(torch.randint(1, m + 3, (1,), generator=g))
        num_draft = None if trial % 5 == 0 else torch.randint(0, n + 2, (b,), generator=g)
        outs = []
        for host in (True, False):
            if not host:
                monkeypatch.setattr(tree_mod, "HOST_SELECT_CANDIDATES", -1)
            outs.append(draft_dynamic_tree(None, torch.zeros(b, 50), None, torch.zeros(b, 0, dtype=torch.long), cfg,
                                           n, num_draft, native=lambda *a: (tokens, parents, scores)))
            monkeypatch.undo()
        for x, y in zip(*outs):
            assert torch.equal(x, y), (scores, parents, n, num_draft, outs)
