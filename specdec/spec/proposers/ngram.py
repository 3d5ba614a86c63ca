"""N-gram / prompt-lookup drafting: no model.

Each request's own tokens (prompt and output) make an n-gram model of it:
for every n-gram seen (``n`` from ``min_n`` to ``max_n``), the tokens that
followed it, counted. A draft token is the most frequent follower of the
longest n-gram ending the sequence so far (the most recent follower among
equally frequent ones); appended, it is part of the context of the next draft
token, until ``k`` are drafted or no n-gram ending the context was seen.

Why not copy what followed one earlier occurrence (transformers' prompt
lookup takes the earliest): in the loops greedy outputs fall into, the most
recent occurrence is one period back, so its continuation runs into the
present end after a token or two, and the earliest occurrence may continue
differently from what the loop repeats. The n-gram model runs on through the
loop (``1 2 1 2 1 2`` drafts ``1 2 1 2 …``) and follows the majority; on the
built-in pair it accepts more than either (tests/spec/test_ngram_lookup.py
holds it to at least prompt lookup's τ).

Each request keeps its counts (``NgramIndex``), grown by the tokens added since
the last step, so a step costs O(max_n) per new token and O(k · max_n) dict
look-ups to draft, whatever the sequence length.

**Branches** (``branches > 1``): the longest matched n-gram may have been
followed by several different tokens. Each of them (most frequent first, up to
``branches``) starts a branch under the root, continued as a chain by the rule
above, and the γ nodes go to the likeliest: a node's score is the product of
the follower frequencies along its path (count / all followers of the n-gram
it was looked up by), and the γ best nodes are kept, as EAGLE-2 keeps its
dynamic tree (scores only fall along a path, so the kept nodes form a tree).
Examples (max_n = 2): in ``5 6 1 7 8 5 6 1 7 8 5 6 2 9 5 6`` the ending
``5 6`` was followed by 1 twice and 2 once; branch 1 (2/3) continues ``1 7 8
…`` with nothing left in doubt (2/3 each), branch 2 (1/3) ``2 9 …``, and at
γ = 3 the kept nodes are the chain ``1 7 8``. In ``5 6 2 9 5 6 1 7 3 5 6``,
1 and 2 followed ``5 6`` once each (1/2 each, 1 the most recent): at γ = 4 the
tree is ``1 → 7`` and ``2 → 9``, nodes in that order. The tree is verified in
one target forward (specdec/spec/tree.py); greedy outputs stay exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.core.context import TextContext
from specdec.core.inputs import move_tensors
from specdec.sampling import SamplingTensors
from specdec.spec.proposers.base import (
    DraftBatch,
    Drafter,
    DrafterSpec,
    DraftTree,
    Proposer,
    ProposerConfig,
    ProposerDeps,
    register_proposer,
)
from specdec.spec.tree import check_int


MAX_NGRAM = 64  # longest n-gram a request's index may count (each new token costs O(max_n))


@dataclass(frozen=True)
class NgramConfig(ProposerConfig):
    max_n: int = 3  # longest n-gram looked up
    min_n: int = 1  # shortest
    branches: int = 1  # >1: a tree of up to this many different first tokens (γ: its node budget)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.key("max_n"), self.max_n, 1, MAX_NGRAM)
        check_int(self.key("min_n"), self.min_n, 1, self.max_n, f"at most {self.key('max_n')}")
        check_int(self.key("branches"), self.branches, 1, 64)


@dataclass
class NgramIndex:
    """A request's n-gram counts over its tokens before position ``upto``.

    ``follow[n][g]``: for the n-gram ``g`` (a tuple of ``n`` tokens), how many
    times each token followed it; ``best[n][g]``: the most frequent of those
    tokens, the most recent among equals. (Lists indexed by ``n``; entries
    below ``min_n`` stay empty.)
    """

    upto: int = 0
    follow: list[dict[tuple[int, ...], dict[int, int]]] = field(default_factory=list)
    best: list[dict[tuple[int, ...], int]] = field(default_factory=list)

    def grow(self, tokens: list[int], max_n: int, min_n: int) -> None:
        """Counts the followers ``tokens[e]`` for every ``e`` not counted yet."""
        if not self.follow:
            self.follow = [{} for _ in range(max_n + 1)]
            self.best = [{} for _ in range(max_n + 1)]
        for e in range(max(self.upto, 1), len(tokens)):  # tokens[e] follows the n-grams ending at e
            t = tokens[e]
            for n in range(min_n, min(max_n, e) + 1):
                g = tuple(tokens[e - n : e])
                counts = self.follow[n].setdefault(g, {})
                counts[t] = counts.get(t, 0) + 1
                if counts[t] >= counts[self.best[n].get(g, t)]:  # ">=": the most recent wins a tie
                    self.best[n][g] = t
        self.upto = max(self.upto, len(tokens))


@dataclass
class NgramDraftBatch(DraftBatch):
    tokens: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # [B, γ]
    # Trees (some request branched): [B, γ] parent of each node (-1: the root; padding -1) and
    # the host facts of DraftTree. None: every request drafted a chain.
    parents: torch.Tensor | None = None
    max_depth: int = 0
    max_children: int = 0


class NgramDrafter(Drafter):
    """The proposals were found on the host; they are deterministic (q one-hot)."""

    def forward(self, batch: NgramDraftBatch, sampling: SamplingTensors) -> DraftTree:  # type: ignore[override]
        if batch.parents is None:
            return DraftTree.chain(batch.tokens)
        return DraftTree(tokens=batch.tokens, parents=batch.parents, is_chain=False, num_nodes=batch.num_draft,
                         max_depth=batch.max_depth, max_children=batch.max_children)


def lookup(tokens: list[int], index: NgramIndex, max_n: int, min_n: int, k: int) -> list[int]:
    """Grows ``index`` by ``tokens`` and drafts up to ``k`` tokens to follow them.

    Draft token i is ``index.best`` of the longest n-gram (``max_n`` down to
    ``min_n``) that ends ``tokens + drafts[:i]`` and was seen in ``tokens``;
    drafting stops at the first position with none.
    """
    index.grow(tokens, max_n, min_n)
    drafts: list[int] = []
    context = tokens[-max_n:]  # the last max_n tokens, then the drafts after them
    while len(drafts) < k:
        nxt = None
        for n in range(min(max_n, len(context)), min_n - 1, -1):
            nxt = index.best[n].get(tuple(context[len(context) - n :]))
            if nxt is not None:
                break
        if nxt is None:
            break
        drafts.append(nxt)
        context.append(nxt)
    return drafts


def _next(index: NgramIndex, context: list[int], max_n: int, min_n: int) -> tuple[int, dict[int, int]] | None:
    """The draft token after ``context`` and the follower counts it was chosen from (None: no match)."""
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        g = tuple(context[len(context) - n :])
        nxt = index.best[n].get(g)
        if nxt is not None:
            return nxt, index.follow[n][g]
    return None


def lookup_tree(tokens: list[int], index: NgramIndex, max_n: int, min_n: int, k: int,
                branches: int) -> tuple[list[int], list[int]]:
    """Grows ``index`` by ``tokens`` and drafts a tree of up to ``k`` nodes (module doc):
    (node tokens, node parents; -1 the root), parents before children, branch by branch.

    The root's branches are the followers of the longest matched n-gram, the
    drafted one (:func:`lookup`'s first token) first, then by count (ties: the
    first seen). Each branch is a chain of up to ``k`` nodes; the ``k`` nodes of
    highest score (ties: shallower, then earlier branch) are kept. With one
    branch (or one follower) this is :func:`lookup`'s chain.
    """
    index.grow(tokens, max_n, min_n)
    context = tokens[-max_n:]
    first = _next(index, context, max_n, min_n) if k else None
    if first is None:
        return [], []
    best, counts = first
    total = sum(counts.values())
    heads = [best] + sorted((t for t in counts if t != best), key=lambda t: -counts[t])  # stable: first seen
    cand: list[tuple[float, int, int, int]] = []  # (-score, depth, branch, token)
    for bi, head in enumerate(heads[:branches]):
        score = counts[head] / total
        ctx = context + [head]
        cand.append((-score, 0, bi, head))
        for depth in range(1, k):
            nxt = _next(index, ctx, max_n, min_n)
            if nxt is None:
                break
            t, c = nxt
            score *= c[t] / sum(c.values())
            cand.append((-score, depth, bi, t))
            ctx.append(t)
    kept = sorted(sorted(cand)[:k], key=lambda c: (c[2], c[1]))  # branch by branch, root to leaf
    out, parents = [], []
    for i, (_, depth, bi, t) in enumerate(kept):
        out.append(t)
        parents.append(-1 if depth == 0 else i - 1)  # a branch's kept nodes are a prefix of its chain
    return out, parents


@register_proposer("ngram", NgramConfig)
class NgramProposer(Proposer):
    def __init__(self, config: NgramConfig, deps: ProposerDeps | None = None) -> None:
        self.config = config
        self.drafter = NgramDrafter()
        self._index: dict[int, NgramIndex] = {}  # by TextContext.key (ids may repeat across engines)
        self.device = torch.device(deps.runtime.device if deps is not None else "cpu")

    def drafter_spec(self) -> DrafterSpec:
        return DrafterSpec(node_budget=self.config.branches > 1)  # branches: γ is the tree's node budget

    def prepare(self, batch: list[TextContext], gamma: int, num_draft: list[int]) -> NgramDraftBatch:
        cfg = self.config
        props, parents = [], []
        for ctx, k in zip(batch, num_draft):
            idx = self._index.setdefault(ctx.key, NgramIndex())
            if cfg.branches == 1:
                props.append(lookup(ctx.tokens, idx, cfg.max_n, cfg.min_n, k) if k else [])
            else:
                toks, par = lookup_tree(ctx.tokens, idx, cfg.max_n, cfg.min_n, k, cfg.branches)
                props.append(toks)
                parents.append(par)
        found = [len(p) for p in props]
        gamma = max(found)  # the step verifies only as many rows as were found
        rows = [p + [0] * (gamma - len(p)) for p in props]
        b = len(batch)
        tree = {}
        if any(par != list(range(-1, len(par) - 1)) for par in parents):  # some request branched (chains: none)
            depth = [[0] * len(par) for par in parents]
            for par, dep in zip(parents, depth):
                for i, p in enumerate(par):
                    dep[i] = 1 if p < 0 else dep[p] + 1
            tree = dict(
                parents=torch.tensor([p + [-1] * (gamma - len(p)) for p in parents], dtype=torch.long).view(b, gamma),
                max_depth=max(max(d, default=0) for d in depth),
                max_children=max(max(par.count(i) for i in range(-1, len(par))) for par in parents if par),
            )
        return move_tensors(NgramDraftBatch(
            gamma=gamma,
            num_draft=torch.tensor(found, dtype=torch.long),
            num_draft_host=found,
            first_position=torch.tensor([len(c.tokens) for c in batch], dtype=torch.long),
            tokens=torch.tensor(rows, dtype=torch.long).view(b, gamma),
            **tree,
        ), self.device)

    def free(self, ctx: TextContext) -> None:
        self._index.pop(ctx.key, None)
