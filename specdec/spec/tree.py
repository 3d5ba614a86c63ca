"""Token trees: shapes, EAGLE-2 selection, lossless verification, KV compaction.

Pure functions over tensors; nothing here knows the pipeline. A tree per
request is given as in :class:`~specdec.spec.proposers.base.DraftTree`:

- ``tokens [B, N]``: node ``i``'s token;
- ``parents [B, N]``: node ``i``'s parent node, ``-1`` for the **root** (the
  request's last committed token). Parents come before their children
  (``parents[b, i] < i``);
- ``num_nodes [B]`` (optional everywhere, ``None``: all ``N``): trees are
  ragged; nodes ``i >= num_nodes[b]`` are padding and are never read.

**Rows.** The target verifies a tree in one forward over ``N + 1`` rows per
request: row 0 is the root, row ``i + 1`` is node ``i``. Row ``r``'s logits
are the target's distribution of the token *after* row ``r``'s path, so
``target_logits [B, N+1, V]`` (or ``target_probs``) is indexed by row. Each
row sits at sequence position ``root position + depth`` (root depth 0, its
children depth 1) and attends to the cached context, the root and its own
ancestors (:func:`tree_attention_mask`, ``DecoderInputs.tree_mask``).

Terms (as in :mod:`specdec.spec.verify`), per request and step:

- **accepted**: the nodes of the longest root-to-node path the target keeps,
  one per depth, found by walking down from the root;
- **recovered**: the token the target emits at the first node whose children
  are all rejected, drawn from what is left of ``p`` after those rejections;
- **bonus**: the token the target emits after a *leaf* reached with every node
  on its path accepted, drawn from ``p`` at that leaf.

Each step emits ``num_accepted + 1`` tokens: the accepted path's tokens then
one recovered or bonus token. A chain (``parents = [-1, 0, 1, …]``) gives
exactly what the chain verifiers give.

Worked example (greedy, one request, ``N = 5``)::

    tokens   = [[a, c, b, d, e]]          # node 0 = a, 1 = c, 2 = b, 3 = d, 4 = e
    parents  = [[-1, -1, 0, 0, 2]]        # root -> {a, c}; a -> {b, d}; b -> {e}
    rows     =   0    1  2  3  4  5       # row 0: root, row i+1: node i
    argmax   = [[c, x, d, y, z, w]]       # target argmax per row [B, N+1]

    depth 1: at row 0 the target wants c; children of the root: a (node 0),
             c (node 1) -> node 1 matches: accept, go to row 2
    depth 2: at row 2 the target wants argmax[2] = d; node 1 has no children
             -> stop; d is the bonus (node 1 is a leaf)
    path         = [[0, 2, -1, -1]]       # rows of the emitted tokens' contexts [B, D+1], D = 3
    out_tokens   = [[c, d, -1, -1]]       # accepted tokens, then the bonus [B, D+1]
    num_accepted = [1]

``path[b, k]`` is the row whose distribution emitted ``out_tokens[b, k]``;
``path[b, :num_accepted + 1]`` are the rows to keep (their KV entries and
hidden states: the root's and the accepted nodes'), and the row that produced
the last (recovered or bonus) token is ``path[b, num_accepted]``.

Randomness (sampled verification) uses the counter-based scheme of
:mod:`specdec.sampling`: the noise of the decision at depth ``k`` (the token
emitted at sequence position ``positions[b] + k``) is a hash of
``(seed, positions[b] + k, lane)``; the ``s``-th child tried at a node uses
lane :func:`tree_lane` ``(LANE_ACCEPT, s)`` (``LANE_ACCEPT`` itself for the
first child, as the chain verifier does). Results therefore do not depend on
batch-mates, and a chain gives bit-for-bit what ``verify_sampled`` gives.
"""

from __future__ import annotations

import heapq
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional  # noqa: UP035 (OmegaConf reads typing generics)

import torch
import torch.nn.functional as F

from specdec.core.inputs import DecoderInputs, KVCacheTensors, MaskKind
from specdec.models.config import short_repr  # (re-exported: option checks cut values the same way)
from specdec.sampling import LANE_ACCEPT, LANE_RESIDUAL, LANE_TARGET, greedy_tokens, sample_from, uniform

__all__ = [
    "TREE_KINDS",
    "check_bool",
    "check_choices",
    "check_int",
    "check_tree_fits",
    "short_repr",
    "Candidates",
    "NativeExpand",
    "native_tree_serves",
    "NodeStep",
    "Selection",
    "StaticShape",
    "StaticShapes",
    "StaticTree",
    "TreeConfig",
    "TreeVerdict",
    "accepted_slot_moves",
    "ancestor_mask",
    "children_table",
    "compact_kv",
    "depths",
    "draft_dynamic_tree",
    "draft_static_tree",
    "dynamic_tree_select",
    "expand_topk",
    "packed_tree_mask",
    "static_tree",
    "static_tree_shape",
    "static_tree_tokens",
    "tree_attention_mask",
    "tree_lane",
    "valid_nodes",
    "verify_tree_greedy",
    "verify_tree_sampled",
]


TREE_KINDS = ("chain", "static", "dynamic")
MAX_TREE_WIDTH = 64  # tree.top_k and tree.depth at most (EAGLE-2 uses 10 and 6)


# -- option checks (a method's config and its tree) ---------------------------------------------


def check_int(key: str, value: Any, lo: int, hi: int | None = None, note: str = "") -> None:
    """Raises ``ValueError`` naming ``key`` unless ``value`` is an int (not a bool: ``True``
    would run as 1) in ``[lo, hi]``."""
    span = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
    extra = f" ({note})" if note else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{key} must be an integer in {span}{extra}, got {short_repr(value)} "
                         f"({type(value).__name__})")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{key} must be in {span}{extra}, got {value}")


def check_bool(key: str, value: Any) -> None:
    """Raises ``ValueError`` naming ``key`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {short_repr(value)} ({type(value).__name__})")


def check_choices(key: str, choices: Any) -> tuple[tuple[int, ...], ...]:
    """Static-tree ``choices`` as a tuple of rank paths; raises naming ``key`` unless each is
    a non-empty list of int ranks >= 0 (not bools, not floats)."""
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
        raise ValueError(f"{key} must be a list of rank paths, e.g. [[0], [1], [0, 0]], got {short_repr(choices)}")
    out = []
    for i, c in enumerate(choices):
        if isinstance(c, (str, bytes)) or not isinstance(c, Sequence) or not c or any(
                isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in c):
            raise ValueError(f"{key}[{i}] must be a non-empty list of integer ranks >= 0, got {short_repr(c)}")
        out.append(tuple(int(r) for r in c))
    return tuple(out)


def check_tree_fits(key: str, tree: TreeConfig, budget: int, vocab: int, what: str) -> None:
    """Raises ``ValueError`` naming ``key`` (``method.<name>.tree``) when ``tree`` asks a
    drafter whose distributions span ``vocab`` tokens (``what`` says whose) for more
    top tokens than there are: a dynamic tree's ``top_k``, or a rank of the first
    ``budget`` static choices (the nodes a step drafts)."""
    if tree.kind == "dynamic" and tree.top_k > vocab:
        raise ValueError(f"{key}.top_k={tree.top_k} is more than {what} ({vocab} tokens): "
                         f"set {key}.top_k <= {vocab}")
    if tree.kind == "static" and tree.choices and budget:
        used = tree.choices[:budget]
        worst = max(used, key=max)
        if max(worst) >= vocab:
            raise ValueError(f"{key}.choices: choice {short_repr(list(worst))} asks for rank {max(worst)}, but "
                             f"{what} has {vocab} tokens (ranks 0..{vocab - 1})")


@dataclass(frozen=True)
class TreeConfig:
    """The shape of the drafts of a drafter that can branch (a field ``tree`` of its config).

    - ``kind="chain"`` (default): γ tokens one after another (no tree);
    - ``kind="static"``: the tree ``choices`` (paths of top-k ranks, the
      Medusa-choices format, see :func:`static_tree`), the same every step;
    - ``kind="dynamic"``: EAGLE-2's tree (:func:`expand_topk` then
      :func:`dynamic_tree_select`): ``depth`` levels of ``top_k`` children of
      the ``top_k`` best frontier nodes, the best ``total_tokens`` nodes kept.

    **Node budget.** For a tree, the method's γ (``num_speculative_tokens``)
    is the number of draft *nodes* a request verifies per step (its rows in
    the target's forward): ``total_tokens`` when set (> 0; the proposer's
    config then takes it as its γ), else γ. A static tree keeps its first
    ``budget`` choices as listed, so write them likeliest first, parents
    before children (:func:`best_static_tree` makes such a list from measured
    accuracies; a request with less room keeps a (depth, path)-ordered prefix
    of those). Per request the budget shrinks
    like γ does (its own ``num_speculative_tokens``, room left), so trees are
    ragged. Hydra: ``method.draft_model.tree.kind=dynamic
    method.draft_model.tree.total_tokens=16``.
    """

    kind: str = "chain"
    choices: Optional[List[List[int]]] = None  # static: paths of top-k ranks from the root (None: the drafter's
    # own list, where its checkpoint ships one: Medusa heads trained here; else an error)
    top_k: int = 4  # dynamic: children per expanded node, and the frontier's width
    depth: int = 5  # dynamic: levels drafted (the deepest node's depth)
    total_tokens: int = 0  # nodes kept per request (the node budget); 0: the method's γ

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in TREE_KINDS:
            raise ValueError(f"tree.kind must be one of {', '.join(TREE_KINDS)}, got {short_repr(self.kind)}")
        if self.choices is not None:  # hashable, and checked now (static_tree raises on a bad list)
            object.__setattr__(self, "choices", check_choices("tree.choices", self.choices))
            static_tree(self.choices)
        check_int("tree.top_k", self.top_k, 1, MAX_TREE_WIDTH)
        check_int("tree.depth", self.depth, 1, MAX_TREE_WIDTH)
        check_int("tree.total_tokens", self.total_tokens, 0, 64, "0: the method's γ")

    @property
    def is_tree(self) -> bool:
        return self.kind != "chain"

    def budget(self, gamma: int) -> int:
        """Draft nodes per request per step for a method whose γ is ``gamma``."""
        if not self.is_tree:
            return gamma
        n = self.total_tokens or gamma
        return min(n, len(self.choices)) if self.kind == "static" and self.choices else n

    def depth_at(self, nodes: int) -> int:
        """The deepest node a step of ``nodes`` draft nodes can reach: a chain's ``nodes``, a
        dynamic tree's ``min(depth, nodes)`` (its best ``nodes`` candidates), a static tree's
        deepest path among its first ``nodes`` choices (as a step drafts them)."""
        if self.kind == "dynamic":
            return min(self.depth, nodes)
        if self.kind == "static" and self.choices:
            return max((len(c) for c in self.choices[:nodes]), default=0)
        return nodes

    def scratch_rows(self, gamma: int) -> int:
        """KV rows a drafter writes per request drafting a tree past its context (0: a chain):
        a dynamic tree's frontiers, ``(depth - 1) · top_k``; a static tree's nodes, ``gamma``."""
        if not self.is_tree:
            return 0
        return (self.depth - 1) * self.top_k if self.kind == "dynamic" else gamma


def tree_lane(lane: int, sibling: int) -> int:
    """The noise lane of the ``sibling``-th draw of one kind at one position.

    Sibling 0 keeps ``lane`` (a chain uses exactly the chain verifier's
    noise); sibling ``s > 0`` gets ``lane + 256 s``, clear of the base lanes
    of :mod:`specdec.sampling`. A drafter sampling siblings i.i.d. at one
    position should use ``tree_lane(LANE_DRAFT, s)`` for the ``s``-th.
    """
    return lane if sibling == 0 else lane + (sibling << 8)


# -- tree shapes -------------------------------------------------------------------------------


def valid_nodes(parents: torch.Tensor, num_nodes: torch.Tensor | None) -> torch.Tensor:
    """``[B, N]`` bool: node ``i`` of request ``b`` is real (``i < num_nodes[b]``)."""
    b, n = parents.shape
    if num_nodes is None:
        return torch.ones(b, n, dtype=torch.bool, device=parents.device)
    return torch.arange(n, device=parents.device) < num_nodes.unsqueeze(1)


def ancestor_mask(parents: torch.Tensor, num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, N, N]`` bool: ``mask[b, i, j]`` iff node ``j`` is node ``i`` or an ancestor of it.

    The root is not a node here (every node descends from it). Padding nodes
    (``i >= num_nodes[b]``) see only themselves, and no real node sees them
    (a real node's ancestors come before it). Example::

        parents = [[-1, 0, -1, 1]]        # 0 -> 1 -> 3; 2 alone under the root
        mask[0] = [[1, 0, 0, 0],
                   [1, 1, 0, 0],
                   [0, 0, 1, 0],
                   [1, 1, 0, 1]]

    Computed as the transitive closure of "self or parent" by repeated
    squaring: ``ceil(log2 N)`` batched boolean products, no loop over nodes.
    """
    b, n = parents.shape
    if on_host(parents, HOST_WALK_NODES):
        host = _ancestor_mask_host(parents, num_nodes)
        if host is not None:
            return host
    ar = torch.arange(n, device=parents.device)
    step = (parents.unsqueeze(-1) == ar) | (ar.unsqueeze(1) == ar)  # [B, N, N] self or parent
    step &= valid_nodes(parents, num_nodes).unsqueeze(-1) | (ar.unsqueeze(1) == ar)  # padding: self only
    m = step.float()
    for _ in range(max(n - 1, 1).bit_length()):  # paths of <= 2^k edges after k squarings
        m = (m + torch.bmm(m, m)).clamp(max=1.0)
    return m > 0


def _ancestor_mask_host(parents: torch.Tensor, num_nodes: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`ancestor_mask` of a small CPU batch on host lists (a real node's row is its
    parent's row and itself), or None where a real node's parent does not come before it."""
    b, n = parents.shape
    pr = parents.tolist()
    real = num_nodes.tolist() if num_nodes is not None else [n] * b
    out = []
    for r in range(b):
        rows: list[list[bool]] = []
        for i in range(n):
            p = pr[r][i]
            if i < real[r] and p >= i:
                return None
            row = rows[p].copy() if i < real[r] and p >= 0 else [False] * n
            row[i] = True
            rows.append(row)
        out.append(rows)
    return torch.tensor(out, dtype=torch.bool).view(b, n, n)


def depths(parents: torch.Tensor, num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, N]`` int64: each node's depth (the root's children: 1; padding: 0).

    Example: ``parents = [[-1, 0, -1, 1]] -> [[1, 2, 1, 3]]``.
    """
    d = ancestor_mask(parents, num_nodes).sum(-1)  # self + ancestors = depth
    return torch.where(valid_nodes(parents, num_nodes), d, 0)


def tree_attention_mask(parents: torch.Tensor, num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, N+1, N+1]`` bool over rows (row 0 the root, row ``i+1`` node ``i``): what
    each row of a tree step sees among the step's rows. It goes into
    ``DecoderInputs.tree_mask`` (padded to the batch's ``Q``); the cached
    context before the root is visible to every row.

    Row 0 sees itself; row ``i+1`` sees the root, node ``i`` and its
    ancestors. Padding rows see the root and themselves (never an empty row).
    Example, ``parents = [[-1, -1, 0]]``::

        [[1, 0, 0, 0],      # root
         [1, 1, 0, 0],      # node 0
         [1, 0, 1, 0],      # node 1 (a sibling: does not see node 0)
         [1, 1, 0, 1]]      # node 2 under node 0

    For a chain this is the lower triangle (causal); a request in the batch
    that feeds plain rows (a prefill) uses the chain ``parents``.
    """
    b, n = parents.shape
    out = torch.zeros(b, n + 1, n + 1, dtype=torch.bool, device=parents.device)
    out[:, :, 0] = True
    out[:, 1:, 1:] = ancestor_mask(parents, num_nodes)
    return out


def packed_tree_mask(parents: torch.Tensor, num_nodes: torch.Tensor | None, root_row: torch.Tensor,
                     num_queries: int) -> torch.Tensor:
    """``DecoderInputs.tree_mask [B, Q, Q]`` of a packed step whose request ``b``
    feeds rows ``0 … root_row[b]`` as plain rows (a prompt, or just the root),
    then its tree's nodes (rows ``root_row[b] + 1 + i``).

    Plain rows are causal; a node row sees every plain row (the root and the
    rows before it), node ``i`` itself and its ancestors. A request without
    nodes (``root_row`` its last row) is plain causal. Query rows past a
    request's own are padding and see row 0 (never an empty row). Example,
    ``root_row = [1]``, ``parents = [[-1, -1]]`` (two siblings), ``Q = 4``::

        [[1, 0, 0, 0],     # plain row 0
         [1, 1, 0, 0],     # root (plain row 1)
         [1, 1, 1, 0],     # node 0
         [1, 1, 0, 1]]     # node 1 (does not see its sibling)
    """
    n = parents.shape[1]
    tm = tree_attention_mask(parents, num_nodes)  # [B, N+1, N+1], row 0 the root
    q = torch.arange(num_queries, device=parents.device)
    rel = q - root_row.unsqueeze(1)  # [B, Q] row index within the tree (<= 0: plain rows)
    r = rel.clamp(0, n)  # [B, Q]
    flat = (r.unsqueeze(2) * (n + 1) + r.unsqueeze(1)).flatten(1)  # [B, Q*Q] index of tm[b, r_i, r_j]
    in_tree = tm.flatten(1).gather(1, flat).view(-1, num_queries, num_queries)  # [B, Q, Q]
    plain = (rel <= 0).unsqueeze(2) | (rel <= 0).unsqueeze(1)
    return (q.unsqueeze(1) >= q).unsqueeze(0) & (plain | in_tree)


class StaticTree(NamedTuple):
    """A static tree's shape, nodes sorted by ``(depth, path)``."""

    parents: torch.Tensor  # [N] int64, -1: the root
    ranks: torch.Tensor  # [N] int64, node i's token = the ranks[i]-th top token of its parent's distribution
    depths: torch.Tensor  # [N] int64, 1 for the root's children
    paths: list[tuple[int, ...]]  # [N] the choice of each node, as given


def static_tree(choices: Sequence[Sequence[int]], budget: int | None = None) -> StaticTree:
    """A static tree from Medusa-style ``choices`` (also vLLM's ``speculative_token_tree``).

    Each choice is a path of top-k ranks from the root: ``[0]`` is the root's
    top-1 child, ``[0, 1]`` the second-best child of ``[0]``. Nodes are
    sorted by ``(len(path), path)`` (Medusa's ``generate_medusa_buffers``),
    so parents come before children; every prefix of a path must itself be a
    choice. Example::

        static_tree([[0], [1], [0, 0], [0, 1], [1, 0]])
        parents = [-1, -1, 0, 0, 1]
        ranks   = [ 0,  1, 0, 1, 0]
        depths  = [ 1,  1, 2, 2, 2]

    The tokens come from the drafter: node ``i``'s token is the
    ``ranks[i]``-th top token of the distribution drafted at its parent
    (:func:`static_tree_tokens`; EAGLE-1's static tree). Medusa's heads
    draft one distribution per *depth* for the whole tree, so there node
    ``i``'s token is ``head_topk[depth[i] - 1, ranks[i]]``.

    ``budget``: keep the first ``budget`` choices *as listed* (then sort them),
    so a list written likeliest first (Medusa's lists, :func:`best_static_tree`)
    cuts to the best tree of each size. The kept ones must include their
    parents::

        static_tree([[0], [0, 0], [1], [0, 0, 0]], budget=3).paths
        -> [(0,), (1,), (0, 0)]
    """
    listed = [tuple(int(r) for r in c) for c in choices]
    if budget is not None:
        if not 1 <= budget <= len(listed):
            raise ValueError(f"static_tree: budget {budget} is outside 1..{len(listed)} (the number of choices)")
        listed = listed[:budget]
    paths = sorted(set(listed), key=lambda p: (len(p), p))
    if len(paths) != len(listed):
        raise ValueError("static_tree: choices contain duplicates")
    index = {p: i for i, p in enumerate(paths)}
    parents, ranks = [], []
    for p in paths:
        if not p or min(p) < 0:
            raise ValueError(f"static_tree: a choice must be a non-empty list of ranks >= 0, got {list(p)}")
        if len(p) > 1 and p[:-1] not in index:
            cut = "" if budget is None else f" among the first {budget} (list parents before their children)"
            raise ValueError(f"static_tree: choice {list(p)} lacks its parent {list(p[:-1])}{cut}")
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
        ranks.append(p[-1])
    return StaticTree(
        parents=torch.tensor(parents, dtype=torch.long),
        ranks=torch.tensor(ranks, dtype=torch.long),
        depths=torch.tensor([len(p) for p in paths], dtype=torch.long),
        paths=paths,
    )


def best_static_tree(accuracy: Sequence[Sequence[float]], budget: int) -> list[tuple[int, ...]]:
    """The ``budget`` likeliest paths under measured rank accuracies, likeliest first
    (Medusa's way of building its sparse trees from calibration data).

    ``accuracy[d][r]``: how often the rank-``r`` candidate at depth ``d + 1`` is
    the target's token, given the path above it was accepted. Under that
    model a path is accepted with the product of its nodes' accuracies, and a
    greedy tree's expected accepted drafts per step are the sum of its paths'
    products, so the best tree of any size is the top of this list, which
    :func:`static_tree` cuts with ``budget`` (a child never beats its parent,
    so every prefix of the list is a tree). Example::

        best_static_tree([[0.6, 0.2], [0.5, 0.1]], 4)
        # products: [0] .6, [0,0] .3, [1] .2, [0,1] .06, [1,0] .1, [1,1] .02
        -> [(0,), (0, 0), (1,), (1, 0)]      # expected τ = 1 + .6 + .3 + .2 + .1 = 2.2
    """
    if budget < 1 or not accuracy or not accuracy[0]:
        raise ValueError(f"best_static_tree: need budget >= 1 and accuracies for depth 1, got {budget}, {accuracy}")
    if any(not 0.0 <= a <= 1.0 for row in accuracy for a in row):
        raise ValueError("best_static_tree: accuracies must lie in [0, 1]")
    heap = [(-float(a), (r,)) for r, a in enumerate(accuracy[0])]  # (-product, path)
    heapq.heapify(heap)
    out: list[tuple[int, ...]] = []
    while heap and len(out) < budget:
        neg, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < len(accuracy):  # its children can enter only after it
            for r, a in enumerate(accuracy[len(path)]):
                heapq.heappush(heap, (neg * float(a), (*path, r)))
    return out


def static_tree_tokens(parents: torch.Tensor, ranks: torch.Tensor, parent_topk: torch.Tensor) -> torch.Tensor:
    """Node tokens of a static tree -> ``[B, N]``.

    ``parents``, ``ranks`` ``[N]`` (from :func:`static_tree`);
    ``parent_topk [B, N+1, K]``: the top-K tokens of the draft distribution
    at each row (row 0 the root, row ``i+1`` node ``i``; K > max rank). Node
    ``i``'s token is ``parent_topk[b, parents[i] + 1, ranks[i]]``. A drafter
    that fills the tree level by level calls this per level with the rows it
    has (rows of deeper levels are not read).
    """
    b = parent_topk.shape[0]
    rows = (parents + 1).expand(b, -1)  # [B, N]
    per_node = parent_topk.gather(1, rows.unsqueeze(-1).expand(-1, -1, parent_topk.shape[-1]))  # [B, N, K]
    return per_node.gather(2, ranks.expand(b, -1).unsqueeze(-1)).squeeze(-1)


class Candidates(NamedTuple):
    """Every node an EAGLE-2 expansion scored, in expansion order (parents first)."""

    tokens: torch.Tensor  # [B, M] int64
    parents: torch.Tensor  # [B, M] int64, index into the same M; -1: the root
    scores: torch.Tensor  # [B, M] float, cumulative draft log-probability of the root-to-node path


def expand_topk(
    root_logprobs: torch.Tensor,  # [B, V] draft log-probs after the root
    draft_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    depth: int,
    top_k: int,
) -> Candidates:
    """EAGLE-2's expansion (``topK_genrate``) as a pure loop over a drafter callback.

    Level 1 is the root's ``top_k`` tokens. Then ``depth - 1`` times: the
    drafter runs the current *frontier* (``top_k`` nodes per request) in one
    call, each frontier node proposes its ``top_k`` best children with score
    ``parent score + log q(child)``, all ``top_k²`` children are recorded,
    and the best ``top_k`` of them by score become the next frontier (a beam).
    ``M = top_k + (depth - 1) top_k²`` candidates in all; pick the tree with
    :func:`dynamic_tree_select`.

    ``draft_fn(frontier_tokens [B, K], frontier_parent [B, K]) -> log-probs
    [B, K, V]``: ``frontier_parent[b, k]`` is the index, in the *previous*
    call's frontier, of node ``k``'s parent (``-1`` in the first call: the
    root's children). A drafter that keeps KV or features per frontier node
    can thus attend each node to its ancestors (the frontier of call ``c`` is
    its rows ``c·K … c·K + K - 1``). Index arithmetic, ``K = top_k = 2``::

        level 1:   candidates 0, 1        (root's top-2), frontier = [0, 1]
        call 1:    children of 0 -> candidates 2, 3; of 1 -> 4, 5
                   best two by score, say 5 and 2 -> frontier = [5, 2],
                   frontier_parent = [1, 0]  (5's parent 1 was frontier slot 1)
        call 2:    children of 5 -> 6, 7; of 2 -> 8, 9 ...
    """
    b = root_logprobs.shape[0]
    dev = root_logprobs.device
    k = top_k
    score, tok = root_logprobs.topk(k, dim=-1)  # [B, K]
    toks, pars, scores = [tok], [torch.full((b, k), -1, dtype=torch.long, device=dev)], [score]
    front_id = torch.arange(k, device=dev).expand(b, k)  # [B, K] candidate index of each frontier node
    front_parent = torch.full((b, k), -1, dtype=torch.long, device=dev)
    offset = k
    for _ in range(depth - 1):
        lp = draft_fn(tok, front_parent)  # [B, K, V]
        cs, ct = lp.topk(k, dim=-1)  # [B, K, K] each frontier node's best children
        cs = (score.unsqueeze(-1) + cs).reshape(b, k * k)  # cumulative
        ct = ct.reshape(b, k * k)
        toks.append(ct)
        scores.append(cs)
        pars.append(front_id.unsqueeze(-1).expand(b, k, k).reshape(b, k * k))
        best = cs.topk(k, dim=-1).indices  # [B, K] into the K² children
        tok, score = ct.gather(1, best), cs.gather(1, best)
        front_parent = best // k  # slot of the parent in the frontier just run
        front_id = offset + best
        offset += k * k
    return Candidates(torch.cat(toks, 1), torch.cat(pars, 1), torch.cat(scores, 1))


class Selection(NamedTuple):
    """The nodes :func:`dynamic_tree_select` keeps, as a tree (parents before children)."""

    index: torch.Tensor  # [B, K] int64, candidate index of each kept node (ascending; padding past num_nodes)
    parents: torch.Tensor  # [B, K] int64, parent among the kept nodes; -1: the root (and padding)
    num_nodes: torch.Tensor  # [B] int64, kept nodes (< K where fewer candidates have a finite score)


def dynamic_tree_select(scores: torch.Tensor, parents: torch.Tensor, total_tokens: int) -> Selection:
    """EAGLE-2 reranking: keep the ``total_tokens`` best candidates by score.

    ``scores [B, M]`` are cumulative log-probabilities (``-inf``: no
    candidate) and ``parents [B, M]`` index the same ``M``, parents before
    children. A child's score is its parent's plus a log-probability ``<= 0``,
    so a kept child's parent is kept too: the kept nodes form a tree. Ties
    are broken towards the earlier candidate (a stable sort), so a parent
    tied with its child is kept first. The kept nodes are re-indexed in
    candidate order (so parents still precede children) and their parents
    translated. Example::

        scores  = [[-0.1, -0.5, -0.3, -0.9, -0.4]]
        parents = [[  -1,   -1,    0,    0,    2]]
        total_tokens = 3  ->  keeps candidates 0, 2, 4 (scores -0.1, -0.3, -0.4)
        index   = [[0, 2, 4]];  parents = [[-1, 0, 1]];  num_nodes = [3]

    Tokens follow with ``candidates.tokens.gather(1, index)``; the kept
    nodes' draft distributions likewise.
    """
    b, m = scores.shape
    k = min(total_tokens, m)
    if on_host(scores, HOST_SELECT_CANDIDATES):
        return _select_host(scores, parents, k)
    finite = scores > float("-inf")  # NaN: not a candidate either
    order = torch.sort(scores.masked_fill(~finite, float("-inf")), dim=1, descending=True, stable=True).indices[:, :k]
    kept_ok = finite.gather(1, order)  # [B, K]
    idx = torch.where(kept_ok, order, order + m).sort(dim=1).values  # real ones first, ascending
    kept_ok = idx < m
    idx = torch.where(kept_ok, idx, idx - m)
    inv = torch.full((b, m), -1, dtype=torch.long, device=scores.device)
    inv.scatter_(1, idx, torch.arange(k, device=scores.device).expand(b, k))  # [B, M] new index of a kept node
    old_par = parents.gather(1, idx)  # [B, K]
    new_par = torch.where(old_par >= 0, inv.gather(1, old_par.clamp(min=0)), -1)
    return Selection(idx, torch.where(kept_ok, new_par, -1), kept_ok.sum(1))


# A small CPU batch selects on host lists: tens of µs, not ~15 eager tensor ops (eager only:
# a compiled drafting keeps its tensor ops, one graph without breaks).
HOST_SELECT_CANDIDATES = 1024


def on_host(t: torch.Tensor, max_numel: int) -> bool:
    """Whether ``t`` is small enough, on a CPU and eager, for a host-list path of this module
    (the tensor path's results without its eager ops; traced code keeps the tensor ops)."""
    return t.device.type == "cpu" and t.numel() <= max_numel and not torch.compiler.is_compiling()


def _select_host(scores: torch.Tensor, parents: torch.Tensor, k: int,
                 budgets: torch.Tensor | None = None) -> Selection:
    """:func:`dynamic_tree_select` on host lists (CPU tensors), the same rule: a stable sort
    by score, descending, kept ones re-indexed in candidate order, then the rest. ``budgets``
    [B]: first, as :func:`draft_dynamic_tree` does, request ``b``'s candidates past its best
    ``budgets[b]`` (that stable order) become ``-inf``."""
    neg = float("-inf")
    index, new_parents, counts = [], [], []
    caps = budgets.tolist() if budgets is not None else [None] * scores.shape[0]
    for sc, par, cap in zip(scores.tolist(), parents.tolist(), caps):
        if cap is not None:
            ranked = sorted(range(len(sc)), key=lambda i: -sc[i] if sc[i] == sc[i] else neg)  # NaN first, as torch
            sc = list(sc)
            for i in ranked[max(cap, 0):]:
                sc[i] = neg
        v = [x if x > neg else neg for x in sc]  # NaN: no candidate either
        order = sorted(range(len(v)), key=lambda i: -v[i])[:k]  # (stable: ties to the earlier)
        real = sorted(i for i in order if v[i] > neg)
        idx = real + sorted(i for i in order if not v[i] > neg)
        inv = {i: j for j, i in enumerate(idx)}
        index.append(idx)
        new_parents.append([inv.get(par[i], -1) if j < len(real) and par[i] >= 0 else -1 for j, i in enumerate(idx)])
        counts.append(len(real))
    return Selection(torch.tensor(index, dtype=torch.long).view(-1, k),
                     torch.tensor(new_parents, dtype=torch.long).view(-1, k), torch.tensor(counts, dtype=torch.long))


# -- verification ------------------------------------------------------------------------------


class TreeVerdict(NamedTuple):
    """What verification of a tree step decides, per request (``D``: the tree depth)."""

    path: torch.Tensor  # [B, D+1] int64 row of each emitted token's context: 0 root, i+1 node i; -1 past
    tokens: torch.Tensor  # [B, D+1] int64 accepted tokens, then the recovered / bonus one; -1 past
    num_accepted: torch.Tensor  # [B] int64 accepted nodes (emitted tokens - 1)


def children_table(
    parents: torch.Tensor, num_nodes: torch.Tensor | None = None, max_children: int | None = None
) -> torch.Tensor:
    """``[B, N+1, C]`` int64: the children of each row, by node index (``-1`` past them).

    Row 0 is the root, row ``i + 1`` node ``i``. ``C`` is ``max_children``
    or (``None``) the largest branching in the batch, which costs one host
    sync. Children past ``max_children`` are left out (verifying a subtree
    is still lossless). Example: ``parents = [[-1, 0, -1, 1]]`` ->
    ``[[[0, 2], [1, -1], [3, -1], [-1, -1], [-1, -1]]]``.
    """
    b, n = parents.shape
    dev = parents.device
    valid = valid_nodes(parents, num_nodes)  # [B, N]
    ar = torch.arange(n, device=dev)
    earlier = (parents.unsqueeze(-1) == parents.unsqueeze(1)) & (ar.unsqueeze(0) < ar.unsqueeze(1))  # [B, i, j<i]
    rank = (earlier & valid.unsqueeze(1)).sum(-1)  # [B, N] earlier siblings of each node
    c = max_children if max_children is not None else max(int(rank.masked_fill(~valid, 0).max()) + 1 if n else 1, 1)
    keep = valid & (rank < c)
    dummy = (n + 1) * c
    flat = torch.where(keep, (parents + 1) * c + rank, dummy)  # [B, N]
    table = torch.full((b, dummy + 1), -1, dtype=torch.long, device=dev)
    table.scatter_(1, flat, ar.expand(b, n).clone())
    return table[:, :dummy].reshape(b, n + 1, c)


def _walk_start(b: int, d: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """A walk down ``b`` trees of depth ``d`` before its first level: the current row [B] (the
    root), alive [B], the path's rows [B, d + 1] (root first, -1 past the end) and the emitted
    tokens [B, d + 1] (-1 past the end)."""
    path = torch.full((b, d + 1), -1, dtype=torch.long, device=dev)
    path[:, 0] = 0
    return (torch.zeros(b, dtype=torch.long, device=dev), torch.ones(b, dtype=torch.bool, device=dev), path,
            torch.full((b, d + 1), -1, dtype=torch.long, device=dev))


def _max_depth(parents: torch.Tensor, num_nodes: torch.Tensor | None, max_depth: int | None) -> int:
    if max_depth is not None:
        return max_depth
    if parents.shape[1] == 0:
        return 0
    return int(depths(parents, num_nodes).max())  # host sync


def verify_tree_greedy(
    *,
    tokens: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64, -1: the root
    num_nodes: torch.Tensor | None,  # [B] int64; None: all N
    target_logits: torch.Tensor,  # [B, N+1, V], row 0 the root, row i+1 node i
    max_depth: int | None = None,  # D; None: the deepest node (one host sync)
) -> TreeVerdict:
    """Greedy tree verification -> :class:`TreeVerdict` (see the module's worked example).

    From the root, follow the child whose token is the target's argmax at the
    current row (the first such child if tokens repeat); where none is, stop
    and emit that argmax (recovered, or the bonus at a leaf). Every emitted
    token is the argmax at its row, so ``out_tokens[b, k] = argmax[b, path[b, k]]``.
    A chain gives exactly :func:`~specdec.spec.verify.verify_greedy`'s output
    (with ``num_draft = num_nodes``, ``D = γ``).
    """
    b, n = tokens.shape
    dev = tokens.device
    argmax = greedy_tokens(target_logits)  # [B, N+1]
    if dev.type == "cpu" and b * n <= HOST_WALK_NODES:
        return _walk_tree_greedy(tokens, parents, num_nodes, argmax, max_depth)
    d = _max_depth(parents, num_nodes, max_depth)
    valid = valid_nodes(parents, num_nodes)  # [B, N]
    cur, alive, path, out = _walk_start(b, d, dev)
    for k in range(d + 1):
        want = argmax.gather(1, cur.unsqueeze(1))  # [B, 1] the target's token after the current row
        out[:, k] = torch.where(alive, want.squeeze(1), -1)
        if k == d:
            break
        match = valid & (parents == (cur - 1).unsqueeze(1)) & (tokens == want)  # [B, N] children holding it
        found = alive & match.any(1)
        cur = torch.where(found, match.int().argmax(1) + 1, cur)  # first matching child's row
        path[:, k + 1] = torch.where(found, cur, -1)
        alive = found
    return TreeVerdict(path, out, (path >= 0).sum(1) - 1)


# A small CPU batch walks on host lists: tens of µs, not ~0.4 ms of eager tensor ops a level.
HOST_WALK_NODES = 256


def _walk_tree_greedy(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor | None,
                      argmax: torch.Tensor, max_depth: int | None) -> TreeVerdict:
    """:func:`verify_tree_greedy`'s walk on host lists (CPU tensors: no device sync), same rule."""
    b, n = tokens.shape
    am, tk, pr = argmax.tolist(), tokens.tolist(), parents.tolist()
    real = num_nodes.tolist() if num_nodes is not None else [n] * b
    paths, deepest = [], 0
    for r in range(b):
        kids: dict[int, list[int]] = {}
        dep = [0] * real[r]
        for i in range(real[r]):
            kids.setdefault(pr[r][i], []).append(i)
            dep[i] = 1 + (dep[pr[r][i]] if pr[r][i] >= 0 else 0)
        deepest = max([deepest, *dep])
        cur, path = -1, [0]
        while max_depth is None or len(path) <= max_depth:
            want = am[r][cur + 1]
            nxt = next((i for i in kids.get(cur, ()) if tk[r][i] == want), None)
            if nxt is None:
                break
            cur = nxt
            path.append(cur + 1)
        paths.append(path)
    d = deepest if max_depth is None else max_depth
    rows = [p + [-1] * (d + 1 - len(p)) for p in paths]
    out = [[am[r][x] if x >= 0 else -1 for x in row] for r, row in enumerate(rows)]
    return TreeVerdict(torch.tensor(rows, dtype=torch.long), torch.tensor(out, dtype=torch.long),
                       torch.tensor([len(p) - 1 for p in paths], dtype=torch.long))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` [B, V]: what is left of ``p`` once a child drawn from ``q``
    was rejected (a point mass ``q`` at x: ``p`` without x). Where nothing is left
    (``p == q``, when rejection cannot happen) ``p`` itself."""
    resid = (p - q).clamp(min=0)
    mass = resid.sum(1, keepdim=True)
    return torch.where(mass > 0, resid / mass.clamp(min=torch.finfo(p.dtype).tiny), p)


def verify_tree_sampled(
    *,
    tokens: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64, -1: the root
    num_nodes: torch.Tensor | None,  # [B] int64; None: all N
    target_probs: torch.Tensor,  # [B, N+1, V] after temperature / top-k / top-p; row 0 the root
    draft_probs: torch.Tensor | None,  # [B, N, V] q each node was drawn from; None: deterministic drafts
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64, sequence position of the first emitted token (the root's + 1)
    max_depth: int | None = None,  # D; None: the deepest node (one host sync)
    max_children: int | None = None,  # C; None: the largest branching (one host sync)
) -> TreeVerdict:
    """Lossless tree verification by multi-draft speculative sampling -> :class:`TreeVerdict`.

    At the current node (first the root) let ``p`` be the target's
    distribution there. Its children ``x_1, x_2, …`` are tried in node order;
    child ``x_s`` is **accepted** with probability ``min(1, p(x_s) / q_s(x_s))``
    (test ``u · q_s(x_s) <= p(x_s)``, ``u`` the uniform of lane
    ``tree_lane(LANE_ACCEPT, s-1)`` at this depth's position), and then the walk
    descends into it with a fresh ``p``. On rejection ``p <- norm(max(0, p - q_s))``
    and the next child is tried. If every child is rejected the **recovered**
    token is drawn from the current ``p`` (lane ``LANE_RESIDUAL``); at a leaf
    the **bonus** token is drawn from the leaf's untouched ``p`` (``LANE_TARGET``).

    - ``draft_probs is None``, **deterministic drafts** (top-k trees: EAGLE-2,
      Medusa, n-gram): ``q_s`` is a point mass at ``x_s``, so ``x_s`` is
      accepted with probability ``p(x_s)`` and a rejection zeroes ``p(x_s)``
      and renormalises (EAGLE's ``evaluate_posterior``). Repeated sibling
      tokens are harmless: a rejected token has ``p = 0`` afterwards.
    - **sampled drafts**: ``draft_probs[b, i]`` is the distribution node ``i``
      was drawn from; siblings must be drawn *independently* (with
      replacement; e.g. i.i.d. from their parent's ``q``) — SpecInfer's
      multi-step speculative sampling. Siblings drawn *without* replacement
      are not covered by this rule (that needs the recursive rejection
      sampling of RSD, with ``q`` restricted per sibling).
    - Passing ``draft_probs=None`` for sampled drafts is lossless too (the
      point-mass rule is exact for *every* fixed tree, and a tree drawn
      independently of the verifier's noise is a mixture of fixed trees),
      whatever way the siblings were drawn; it only accepts less often, as
      ``p(x) <= min(1, p(x)/q(x))``. So a drafter sampling without
      replacement can be verified that way (not so a tree that depends on
      the verifier's noise; tests/spec/test_tree_verify.py checks both).

    Why it is lossless, at one node: ``x_1`` is emitted with probability
    ``min(p, q_1)(x)``, and it is rejected with probability ``β = Σ max(0, p - q_1)``,
    after which the rest of the procedure emits from ``p' = max(0, p - q_1) / β``
    (by induction over the remaining children, drawn independently of ``x_1``;
    with no children left it samples ``p'``). In all,
    ``min(p, q_1) + max(0, p - q_1) = p``.

    Index arithmetic (one request, deterministic, ``parents = [[-1, -1, 0]]``,
    ``positions = [7]``)::

        depth 0 (position 7): row 0's p; try node 0 (lane LANE_ACCEPT),
              rejected -> p(token 0) := 0, renormalise; try node 1
              (lane tree_lane(LANE_ACCEPT, 1)), accepted -> row 2
        depth 1 (position 8): row 2 (node 1) has no children: bonus from
              row 2's p, lane LANE_TARGET at position 8
        path = [[0, 2, -1]], tokens = [[tokens[1], bonus, -1]], num_accepted = [1]

    For a chain this is exactly :func:`~specdec.spec.verify.verify_sampled`
    (same noise, same tokens) with ``positions[:, k] = positions + k``.
    """
    b, n = tokens.shape
    dev = tokens.device
    d = _max_depth(parents, num_nodes, max_depth)
    kids = children_table(parents, num_nodes, max_children)  # [B, N+1, C]
    c_max = kids.shape[2]
    ar_b = torch.arange(b, device=dev)
    seeds = seeds.long()
    cur, alive, path, out = _walk_start(b, d, dev)
    for k in range(d + 1):
        pos = positions + k  # [B] position of the token emitted at this depth
        p = target_probs[ar_b, cur]  # [B, V] the current node's distribution (then its residual)
        my_kids = kids[ar_b, cur]  # [B, C]
        taken = torch.full((b,), -1, dtype=torch.long, device=dev)  # [B] accepted child (node index)
        for s in range(c_max if k < d else 0):
            child = my_kids[:, s]  # [B] node index, -1: none
            trying = alive & (child >= 0) & (taken < 0)
            node = child.clamp(min=0)
            x = tokens[ar_b, node]  # [B]
            p_x = p.gather(1, x.unsqueeze(1)).squeeze(1)  # [B]
            u = uniform(seeds, pos, tree_lane(LANE_ACCEPT, s))  # [B]
            if draft_probs is None:
                accept = trying & (u <= p_x)
                q = F.one_hot(x, p.shape[1]).to(p.dtype)  # a point mass at x
            else:
                q = draft_probs[ar_b, node]  # [B, V]
                accept = trying & (u * q.gather(1, x.unsqueeze(1)).squeeze(1) <= p_x)
            p = torch.where((trying & ~accept).unsqueeze(1), residual(p, q), p)
            taken = torch.where(accept, child, taken)
        accepted = taken >= 0
        has_kids = my_kids[:, 0] >= 0
        recovered = sample_from(p, seeds, pos, LANE_RESIDUAL)  # [B] all children rejected
        bonus = sample_from(p, seeds, pos, LANE_TARGET)  # [B] a leaf (p untouched there)
        emitted = torch.where(accepted, tokens[ar_b, taken.clamp(min=0)], torch.where(has_kids, recovered, bonus))
        out[:, k] = torch.where(alive, emitted, -1)
        if k == d:
            break
        cur = torch.where(accepted, taken + 1, cur)
        path[:, k + 1] = torch.where(accepted, cur, -1)
        alive = accepted  # (a row not alive accepts nothing: `trying` was False)
    return TreeVerdict(path, out, (path >= 0).sum(1) - 1)


# -- KV compaction -----------------------------------------------------------------------------


def accepted_slot_moves(
    path: torch.Tensor,  # [B, D+1] rows of the accepted path (TreeVerdict.path), -1 past
    row_slots: torch.Tensor,  # [B, N+1] KV slot each row of the tree step wrote (row 0 the root)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV copies that put an accepted path in place -> ``(src [B*(D+1)], dst [B*(D+1)])``.

    A tree step writes row ``r`` of request ``b`` (root, then nodes) at
    ``row_slots[b, r]``, i.e. at key index ``start_b + r``. The committed
    context must continue with the accepted path: its ``k``-th row
    ``path[b, k]`` moves to the ``k``-th row's slot. Example::

        row_slots = [[40, 41, 42, 43, 44]]   # root + 4 nodes
        path      = [[0, 2, 4, -1]]          # root, node 1, node 3 accepted
        src       = [40, 42, 44, 40]         # past the path: the root's slot onto itself
        dst       = [40, 41, 42, 40]

    Fixed size (no host sync): entries past the path copy the root's slot
    onto itself, which every path starts with, so all writes to one slot
    carry the same value. With the batch packer, ``row_slots =
    inputs.slot_mapping[inputs.q_index]`` (each request feeding exactly its
    tree rows). After :func:`compact_kv` the request's cache holds
    ``start_b + num_accepted + 1`` tokens (root and accepted path; the
    emitted recovered / bonus token is fed by the next step).
    """
    on = path >= 0  # [B, D+1]
    root = row_slots[:, :1]  # [B, 1]
    src = torch.where(on, row_slots.gather(1, path.clamp(min=0)), root)
    dst = torch.where(on, row_slots[:, : path.shape[1]], root)
    return src.reshape(-1), dst.reshape(-1)


def compact_kv(cache: KVCacheTensors, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copies the KV entries at ``src_slots [K]`` to ``dst_slots [K]``, every layer, in place.

    All sources are read before any destination is written, so moves may
    overlap (``dst[i] = src[j]``, as when an accepted path slides down over
    rejected rows). ``dst_slots`` may repeat a slot only with the same
    source (see :func:`accepted_slot_moves`).
    """
    for t in (cache.k, cache.v):  # [layers, slots, Hkv, D]
        t.index_copy_(1, dst_slots, t.index_select(1, src_slots))


# -- drafting a tree ---------------------------------------------------------------------------
#
# A drafter supplies a NodeStep: one forward of M tree nodes per request, all at one depth,
# step(tokens [B, M], state [B, M, H] | None, own [B, M], anc [B, M, A]) -> (state | None,
# logits [B, M, V]). Node (b, m) holds tokens[b, m], writes its KV row at slot own[b, m] and
# sees its request's context, then its A ancestors' slots anc[b, m] (root side first).
# ``state`` is what a node passes to its children (an EAGLE head's h; None for a draft model).

NodeStep = Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor],
                    tuple[Optional[torch.Tensor], torch.Tensor]]


def node_rows(tokens: torch.Tensor, own: torch.Tensor, anc: torch.Tensor, lens: torch.Tensor,
              gather_slots: torch.Tensor, max_ctx: int, kv_cache: KVCacheTensors, *,
              exact_context: bool) -> DecoderInputs:
    """A drafter's inputs for ``M`` tree nodes per request, all at depth ``A + 1``,
    each fed as a one-token request whose keys are exactly what it may see: its
    request's context (``gather_slots[b, :lens[b]]``), its ``A`` ancestors' slots
    ``anc[b, m]`` (root side first), then its own slot ``own[b, m]`` (written by
    this forward). So its key index is its position, ``lens[b] + A``, and no tree
    mask is needed. ``max_ctx`` >= every ``lens[b]`` (host); ``exact_context``:
    one request's context is exactly ``max_ctx`` keys (no mask needed then).

    Shapes: tokens / own [B, M], anc [B, M, A], lens [B] -> rows ``b·M + m``.
    """
    b, m = tokens.shape
    a = anc.shape[2]
    dev = tokens.device
    s = max_ctx + a + 1
    j = torch.arange(s, device=dev)
    rel = j - lens.unsqueeze(1)  # [B, S] < 0: context, [0, A): an ancestor, A: the node itself
    ctx = gather_slots.gather(1, j.clamp(max=gather_slots.shape[1] - 1).expand(b, s))  # [B, S]
    own3 = own.unsqueeze(2)  # [B, M, 1]
    if a:
        anc_part = anc.gather(2, rel.clamp(0, a - 1).unsqueeze(1).expand(b, m, s))
        tail = torch.where((rel < a).unsqueeze(1), anc_part, own3)
    else:
        tail = own3.expand(b, m, s)
    slots = torch.where((rel < 0).unsqueeze(1), ctx.unsqueeze(1), tail)  # [B, M, S] (past the node: masked)
    pos = (lens + a).unsqueeze(1).expand(b, m).reshape(-1)  # [B·M]
    bm = b * m
    ar = torch.arange(bm, device=dev)
    return DecoderInputs(
        tokens=tokens.reshape(-1), positions=pos, slot_mapping=own.reshape(-1),
        gather_slots=slots.reshape(bm, s).contiguous(), q_index=ar.unsqueeze(1), q_pos=pos.unsqueeze(1),
        out_index=ar, logit_index=ar.clone(),  # (distinct tensors: a compiled module guards on aliasing)
        kv_cache=kv_cache, single_request=bm == 1,
        mask=MaskKind.NONE if bm == 1 and exact_context else MaskKind.EXPLICIT,
    )


class StaticShape(NamedTuple):
    """A static tree cut to its first ``n`` choices, as a drafter reads it (tensors on its device)."""

    parents: torch.Tensor  # [n] int64, -1: the root
    ranks: torch.Tensor  # [n] int64, node i's token: the ranks[i]-th top token drafted at its parent
    depths: torch.Tensor  # [n] int64, 1 for the root's children
    levels: tuple[tuple[int, int], ...]  # nodes [lo, hi) of each depth 1, 2, … (nodes sorted by depth)
    ancestors: torch.Tensor  # [n, max_depth - 1] int64, each node's ancestors, root side first (0 past them)
    top_k: int  # top tokens a drafted distribution must give: the largest rank + 1
    max_depth: int
    max_children: int


def static_tree_shape(choices: Any, n: int, device: torch.device | str = "cpu") -> StaticShape:
    """The static tree of ``choices`` cut to its first ``n`` (as listed, :func:`static_tree`)."""
    st = static_tree(choices, n)
    par, ranks, dep = st.parents, st.ranks, st.depths.tolist()
    levels = []
    for d in range(1, max(dep) + 1):
        idx = [i for i, x in enumerate(dep) if x == d]
        levels.append((idx[0], idx[-1] + 1))
    anc = torch.zeros(n, max(max(dep) - 1, 0), dtype=torch.long)
    for i in range(n):
        chain, p = [], int(par[i])
        while p >= 0:
            chain.append(p)
            p = int(par[p])
        anc[i, : len(chain)] = torch.tensor(chain[::-1], dtype=torch.long)
    kids = torch.bincount(par + 1, minlength=n + 1)
    return StaticShape(parents=par.to(device), ranks=ranks.to(device), depths=st.depths.to(device),
                       levels=tuple(levels), ancestors=anc.to(device), top_k=int(ranks.max()) + 1,
                       max_depth=max(dep), max_children=int(kids.max()))


class StaticShapes:
    """The shapes of one static tree ``choices`` per node budget ``n``, each made once on
    ``device`` (a drafter asks every step; a request with less room asks a smaller ``n``)."""

    def __init__(self, choices: Any, device: torch.device | str = "cpu") -> None:
        self.choices, self.device = choices, device
        self._by_n: dict[int, StaticShape] = {}

    def __call__(self, n: int) -> StaticShape:
        shape = self._by_n.get(n)
        if shape is None:
            shape = self._by_n[n] = static_tree_shape(self.choices, n, self.device)
        return shape


def draft_static_tree(step: NodeStep, root_logits: torch.Tensor, root_state: torch.Tensor | None,
                      tree_slots: torch.Tensor, shape: StaticShape,
                      num_draft: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The static tree ``shape`` drafted level by level, one ``step`` per level but the last
    -> (tokens [B, n], parents [B, n], num_nodes [B]).

    ``root_logits`` [B, V] (and ``root_state`` [B, H]) are the drafter's at the root; node
    ``i``'s token is the ``ranks[i]``-th top token at its parent (:func:`static_tree_tokens`)
    and it writes ``tree_slots[:, i]``. ``num_draft`` [B]: each request's node budget
    (None: all ``n``); a request keeps its first ``num_draft[b]`` nodes.
    """
    par, ranks, kmax = shape.parents, shape.ranks, shape.top_k
    b, n = root_logits.shape[0], par.shape[0]
    top = root_logits.new_zeros(b, n + 1, kmax, dtype=torch.long)  # top tokens at each row (0: the root)
    top[:, 0] = root_logits.topk(kmax, dim=-1).indices
    states = None
    if root_state is not None:  # the state each row passes to its children (0: the root)
        states = root_state.new_zeros(b, n + 1, root_state.shape[-1])
        states[:, 0] = root_state
    tokens = root_logits.new_zeros(b, n, dtype=torch.long)
    for d, (lo, hi) in enumerate(shape.levels, start=1):
        tokens[:, lo:hi] = static_tree_tokens(par[lo:hi], ranks[lo:hi], top)
        if d < len(shape.levels):  # this level's nodes have children: run them
            own = tree_slots[:, lo:hi]
            anc = tree_slots.index_select(1, shape.ancestors[lo:hi, : d - 1].reshape(-1)).view(b, hi - lo, d - 1)
            feat = None if states is None else states.index_select(1, par[lo:hi] + 1)  # [B, M, H] the parents'
            state, lg = step(tokens[:, lo:hi], feat, own, anc)
            if states is not None:
                states[:, lo + 1 : hi + 1] = state
            top[:, lo + 1 : hi + 1] = lg.topk(kmax, dim=-1).indices
    num_nodes = (torch.full((b,), n, dtype=torch.long, device=root_logits.device) if num_draft is None
                 else torch.minimum(num_draft, torch.full_like(num_draft, n)))
    return tokens, par.expand(b, n), num_nodes


# A drafter's whole EAGLE-2 expansion in one native call: (root_logits [B, V], root_state [B, H] | None,
# tree_slots [B, R], depth, top_k) -> the candidates :func:`expand_topk` gives with its NodeStep.
NativeExpand = Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor, int, int],
                        tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def native_tree_serves(kv: KVCacheTensors, module: torch.nn.Module, max_position: int) -> bool:
    """Whether a drafter's native expansion (:data:`NativeExpand`) may stand in for the Python
    loop now: eager (not traced, no gradients), on a float32 CPU cache our attention kernel
    reads (head_dim a multiple of 16), ``module``'s rope table built past ``max_position``."""
    return (not torch.compiler.is_compiling() and not torch.is_grad_enabled() and kv.k.device.type == "cpu"
            and kv.k.dtype == torch.float32 and kv.k.shape[-1] % 16 == 0
            and getattr(module, "_rope_len", 0) > max_position)


def draft_dynamic_tree(step: NodeStep, root_logits: torch.Tensor, root_state: torch.Tensor | None,
                       tree_slots: torch.Tensor, tree: TreeConfig, n: int,
                       num_draft: torch.Tensor | None = None,
                       native: NativeExpand | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2's tree (:func:`expand_topk`, :func:`dynamic_tree_select`) of ``n`` nodes
    -> (tokens [B, n], parents [B, n], num_nodes [B]).

    ``tree.depth - 1`` frontiers of ``tree.top_k`` nodes each run as one ``step``; frontier
    ``c`` writes ``tree_slots[:, c·K : (c+1)·K]`` and a node sees its parent's ancestors,
    then its parent. ``num_draft`` [B]: each request keeps only its best ``num_draft[b]``
    candidates (None: the best ``n``). Fewer candidates than ``n``: padded with root
    children past ``num_nodes``. ``native``: the same expansion as one call of the
    drafter's native backend (the Python loop's bits without its host work per frontier).
    """
    k = tree.top_k
    b = root_logits.shape[0]
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []  # (anc, own, state) of each frontier

    def draft_fn(tok: torch.Tensor, front_parent: torch.Tensor) -> torch.Tensor:
        c = len(calls)
        own = tree_slots[:, c * k : (c + 1) * k]  # [B, K] rows of this frontier
        if c == 0:
            anc = own.new_zeros(b, k, 0)
            feat = None if root_state is None else root_state.unsqueeze(1).expand(b, k, root_state.shape[-1])
        else:  # the parent's ancestors, then the parent
            pa, po, ps = calls[c - 1]
            anc = torch.cat([pa.gather(1, front_parent.unsqueeze(2).expand(-1, -1, c - 1)),
                             po.gather(1, front_parent).unsqueeze(2)], 2)
            feat = None if ps is None else ps.gather(1, front_parent.unsqueeze(2).expand(-1, -1, ps.shape[-1]))
        state, lg = step(tok, feat, own, anc)
        calls.append((anc, own, state))
        return torch.log_softmax(lg.float(), -1)

    if native is not None:
        cand = Candidates(*native(root_logits, root_state, tree_slots, tree.depth, k))
    else:
        cand = expand_topk(torch.log_softmax(root_logits.float(), -1), draft_fn, tree.depth, k)
    scores = cand.scores.nan_to_num(nan=float("-inf"))
    if on_host(scores, HOST_SELECT_CANDIDATES):
        sel = _select_host(scores, cand.parents, min(n, scores.shape[1]), num_draft)
    else:
        if num_draft is not None:  # each request's own budget: its best num_draft[b] (still a tree)
            m = scores.shape[1]
            order = scores.sort(dim=1, descending=True, stable=True).indices
            rank = torch.empty_like(order).scatter_(1, order, torch.arange(m, device=scores.device).expand(b, m))
            scores = scores.masked_fill(rank >= num_draft.unsqueeze(1), float("-inf"))
        sel = dynamic_tree_select(scores, cand.parents, n)
    tokens, parents = cand.tokens.gather(1, sel.index), sel.parents
    if tokens.shape[1] < n:  # fewer candidates than the budget (small top_k · depth)
        pad = n - tokens.shape[1]
        tokens = torch.cat([tokens, tokens.new_zeros(b, pad)], 1)
        parents = torch.cat([parents, parents.new_full((b, pad), -1)], 1)
    return tokens, parents, sel.num_nodes

