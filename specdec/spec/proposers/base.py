"""The proposer interface: how a drafting method plugs into speculation.

A drafting method is **one module file plus one yaml** (``conf/method/<name>.yaml``).
The module defines a config dataclass (a :class:`ProposerConfig`: it is the
Hydra schema of ``method.<name>`` and the ``LLM(method=...)`` argument) and a
:class:`Proposer`, registered together::

    @register_proposer("ngram", NgramConfig)
    class NgramProposer(Proposer): ...

Nothing else names it: built-in proposers are found by importing every module
of this package, others by importing the module a method's yaml names
(``_module_: my_pkg.my_drafter``) or through the ``specdec.proposers`` entry
point group. See docs/adding-a-drafter.md.

A proposer has two halves:

- the **host half** (:class:`Proposer`) keeps per-request bookkeeping (its KV
  cache, n-gram tables …, keyed by ``ctx.key``, never the user's request id) and, each step, packs what its device half needs
  into a :class:`DraftBatch`;
- the **device half** (``Proposer.drafter``, a :class:`Drafter`) runs inside
  the draft-and-verify module, in one of two places of the step:

  * before verification (``spec.drafts_after_verify`` False): ``drafter(batch,
    sampling)`` drafts from tokens alone (draft model, n-gram);
  * after verification (``spec.drafts_after_verify`` True): ``drafter.draft_after
    (step, sampling)`` drafts the *next* step's tree from what the target just
    computed (:class:`TargetStep`: hidden states of the layers the proposer
    asks for, at every verified row), without a second target pass. Those
    drafts wait in the shared :class:`RequestStateStore` until the next step
    verifies them.

Drafts are a :class:`DraftTree` per request: tokens plus a parent index; a
chain is the degenerate tree.

What a drafter *is* (where it drafts, what the step keeps for it, which draft
decoder it runs) is one frozen :class:`DrafterSpec`, returned once by
``Proposer.drafter_spec()`` after the config is read. Its costs follow from it:
a drafter naming its draft decoder (``DrafterSpec(model=...)``) is timed through
that decoder's bare forwards, one per draft (``draft_forwards``); a drafter with
weights of another kind times itself (``draft_cost``, ``draft_forward_time``) or
fails at build, never costing a silent 0.
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
import time
from abc import ABC
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from importlib.metadata import entry_points
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from specdec.core.batch_processor import PackedBatch
from specdec.core.context import TextContext
from specdec.core.inputs import DecoderInputs
from specdec.core.pipeline_model import DecoderPipelineModel, RuntimeConfig
from specdec.core.state_store import RequestStateStore, StateSpec
from specdec.sampling import SamplingTensors
from specdec.spec.tree import TreeConfig, check_bool, check_int, short_repr

ENTRY_POINT_GROUP = "specdec.proposers"  # name -> "module" that registers that proposer


@dataclass(frozen=True)
class ProposerConfig:
    """Settings every drafting method has; a method's config subclasses it.

    In an experiment, options a method's node does not set come from the
    ``method`` group itself (``method.num_speculative_tokens=8`` sets γ for
    every selected method).
    """

    num_speculative_tokens: int = 4  # γ: draft tokens per request per step (the most; 0 is plain decoding)
    adaptive_gamma: bool = False  # pick γ <= num_speculative_tokens per step where it pays (spec/gamma.py)
    method_name: ClassVar[str] = ""  # the name it is registered under (register_proposer sets it)
    # Its checkpoint shipped for the built-in target: specdec/zoo/<zoo_dir> ("": code-<name>, '_' as '-').
    zoo_dir: ClassVar[str] = ""
    # True: its checkpoint is a whole model, good for any target of its vocabulary; False:
    # a head over one target's features (a shipped one fits the shipped target only).
    any_target: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_int(self.key("num_speculative_tokens"), self.num_speculative_tokens, 0, 64)
        check_bool(self.key("adaptive_gamma"), self.adaptive_gamma)

    @classmethod
    def key(cls, option: str) -> str:
        """``method.<name>.<option>``, how errors name an option of this method."""
        return f"method.{cls.method_name}.{option}" if cls.method_name else f"method.{option}"


@dataclass(frozen=True)
class CheckpointProposerConfig(ProposerConfig):
    """A drafter that loads a checkpoint (``path``) and may draft token trees.

    ``tree``: a chain of γ tokens (default), or a static / dynamic top-k tree
    (:class:`~specdec.spec.tree.TreeConfig`) whose node budget is γ
    (``tree.total_tokens``, when set, becomes γ).
    """

    path: str = ""  # the drafter's checkpoint directory
    tree: TreeConfig = field(default_factory=TreeConfig)
    path_is: ClassVar[str] = "the drafter's checkpoint directory"  # for the error when path is missing

    def __post_init__(self) -> None:
        if isinstance(self.path, os.PathLike):
            object.__setattr__(self, "path", os.fspath(self.path))
        if not isinstance(self.path, str):
            raise ValueError(f"{self.key('path')} must be a directory path, got {short_repr(self.path)}")
        if isinstance(self.tree, Mapping):  # LLM(method={"name": ..., "tree": {...}})
            self._set_tree(lambda: TreeConfig(**self.tree))
        if not isinstance(self.tree, TreeConfig):
            raise ValueError(f"{self.key('tree')} must be a TreeConfig or a dict of its options, "
                             f"got {short_repr(self.tree)}")
        if self.tree.kind == "static" and not self.tree.choices:
            self._set_tree(lambda: replace(self.tree, choices=self.shipped_tree_choices()))
        super().__post_init__()  # (γ's type first: the budget below computes with it)
        if self.tree.is_tree:  # γ counts the tree's nodes (rows verified per request)
            object.__setattr__(self, "num_speculative_tokens", self.tree.budget(self.num_speculative_tokens))
        if not self.path:
            raise ValueError(f"{self.key('path')} ({self.path_is}) is required")

    def _set_tree(self, make: Callable[[], TreeConfig]) -> None:
        """``tree = make()``; its errors name ``method.<name>.tree.<option>``."""
        try:
            object.__setattr__(self, "tree", make())
        except TypeError as e:  # an unknown key
            raise ValueError(f"{self.key('tree')}: {e}") from None
        except ValueError as e:
            msg = str(e)  # TreeConfig's messages name tree.<option>
            raise ValueError(msg if msg.startswith("method.") else self.key(msg)) from None

    def shipped_tree_choices(self) -> list[list[int]]:
        """A static tree's ``choices`` when the config gives none: the checkpoint's own list."""
        raise ValueError(f"{self.key('tree.choices')} (paths of top-k ranks, e.g. [[0], [1], [0, 0]]) is "
                         "required for tree.kind=static")


@dataclass
class ProposerDeps:
    """What a proposer may need from the run, bundled (never the whole run config)."""

    runtime: RuntimeConfig  # sizes for a draft model's own cache
    target: DecoderPipelineModel  # the target it drafts for (vocab, tokenizer checks, its head)


@dataclass
class DraftBatch:
    """Inputs of a drafter for one step (fields beyond these are the proposer's own)."""

    gamma: int  # padded number of draft tokens per request this step
    num_draft: torch.Tensor  # [B] int64, drafts each request really proposes (<= gamma)
    first_position: torch.Tensor  # [B] int64, sequence position of each request's first draft
    # num_draft on the host where the proposer knows it (the step verifies that many rows
    # each); None: the step reads it from num_draft. Keyword-only, so a proposer's subclass
    # can add fields without defaults.
    num_draft_host: list[int] | None = field(default=None, kw_only=True)


@dataclass
class DraftTree:
    """One step's drafts: a token tree per request, padded to ``N`` nodes.

    Node ``i`` of request ``b`` holds ``tokens[b, i]``; its parent is node
    ``parents[b, i]``, or ``-1`` for the request's last committed token (the
    root). Parents come before their children. A chain of γ tokens is the
    degenerate tree ``parents = [-1, 0, 1, …, γ-2]``. Example, two branches
    under the root, the first one two deep::

        tokens  = [[a, b, c]]      # a and c follow the root, b follows a
        parents = [[-1, 0, -1]]

    A branching tree (``is_chain=False``) is verified whole in one target
    forward (specdec/spec/tree.py; the step packs ``DraftBatch.num_draft[b]``
    rows for request ``b``). Its nodes must come in an order where every
    prefix is a tree (parents first; level order does it): a request whose
    budget is smaller keeps a prefix. ``num_nodes`` makes trees ragged
    (nodes past it are padding, never read); ``max_depth`` / ``max_children``
    are host facts bounding the deepest node and the widest branching, so
    verification needs no host sync (None: derived, one sync each).
    ``probs`` of a tree: each node's q, its siblings drawn independently
    (tree.verify_tree_sampled); None for deterministic (top-k) trees.
    """

    tokens: torch.Tensor  # [B, N] int64
    parents: torch.Tensor | None  # [B, N] int64, -1: the root; None: a chain (is_chain; nothing reads them)
    probs: torch.Tensor | None = None  # [B, N, V] the draft distribution each node was drawn from; None: deterministic
    is_chain: bool = True  # host fact: parents[b, i] == i - 1 for every node
    num_nodes: torch.Tensor | None = None  # [B] real nodes per request (trees); None: all N
    max_depth: int | None = None  # host fact (trees): no node is deeper
    max_children: int | None = None  # host fact (trees): no node (root included) has more children

    @staticmethod
    def chain(tokens: torch.Tensor, probs: torch.Tensor | None = None) -> DraftTree:
        """The tree of ``tokens`` [B, γ] drafted one after another: its parents (each node the
        one before) go unbuilt, as a chain's verification and drafting read its tokens alone."""
        return DraftTree(tokens=tokens, parents=None, probs=probs, is_chain=True)


@dataclass
class TargetStep:
    """What the target computed in this step, for a drafter that drafts after
    verification. Row ``j`` of a request is its ``j``-th verified input: row 0
    its last committed token, row ``j > 0`` its ``j``-th draft; the row at
    ``num_accepted`` produced the bonus token, so a drafter continuing the
    request reads that row.

    A proposer with ``spec.needs_all_rows`` also gets every *packed* row the target
    was fed this step (a whole prompt at a request's first step, prefill chunks
    of other requests, and each request's verified rows), to catch up on them:
    ``rows``, ``aux_rows``, ``inputs``, ``bonus_row``. Worked example, one
    request fed [c, d1, d2] (last committed token, two drafts) that accepted
    d1: ``num_accepted = 1``, ``tokens = [d1, b, -1]``, ``bonus_row`` = the
    packed row of d1, whose target features gave the bonus token b.
    """

    tokens: torch.Tensor  # [B, γ+1] emitted tokens: accepted drafts then the bonus; -1 past them
    num_accepted: torch.Tensor  # [B]
    hidden: torch.Tensor  # [B, γ+1, H] target's final-norm hidden state of each verified row
    aux_hidden: torch.Tensor | None  # [B, γ+1, k·H] inputs of the proposer's target_layers at those rows
    first_position: torch.Tensor  # [B] sequence position of row 0
    slots: torch.Tensor  # [B] each request's slot in ``state``
    state: RequestStateStore  # the shared per-request store (the proposer's state_specs live here)
    bonus_row: torch.Tensor | None = None  # [B] packed row that produced each request's bonus token
    rows: torch.Tensor | None = None  # [T, H] final-norm hidden state of every packed row (needs_all_rows)
    aux_rows: torch.Tensor | None = None  # [T, k·H] inputs of target_layers at every packed row (needs_all_rows)
    inputs: DecoderInputs | None = None  # the target's packed inputs (drafts filled in) (needs_all_rows)
    host: Any = None  # what the proposer's prepare_after packed on the host for this step
    # A tree step (the verified drafts branched): [B, D+1] packed row of each
    # row of the accepted path (root first, the bonus row at num_accepted), -1
    # past it; row j of ``hidden`` / ``tokens`` is path row j. None: chains.
    path: torch.Tensor | None = None


class Drafter(nn.Module):
    """Device half of a proposer: override ``forward`` (drafts before
    verification) or ``draft_after`` (after), as the proposer declares.

    A drafter whose first forward catches up on tokens (or target rows) calls
    :meth:`caught_up` when it returns: the step-time breakdown then splits
    ``draft_catch_up`` from ``draft_steps`` (spec/metrics.py)."""

    caught_up_at: float | None = None  # host clock at the end of this step's catch-up forward
    # A model drafter under runtime.compile: its chain of the method's γ, and its tree of the
    # method's budget, each drafted as one compiled graph (None: step by step).
    _fused: Any = None
    _fused_tree: Any = None

    def caught_up(self) -> None:
        self.caught_up_at = time.perf_counter()

    @property
    def compiled_chain(self) -> bool:
        """Whether a chain of the method's γ drafts as one compiled graph."""
        return self._fused is not None

    @property
    def compiled_tree(self) -> bool:
        """Whether a tree of the method's budget drafts as one compiled graph."""
        return self._fused_tree is not None

    def forward(self, batch: DraftBatch, sampling: SamplingTensors) -> DraftTree:  # pragma: no cover
        raise NotImplementedError(f"{type(self).__name__} does not draft before verification")

    def draft_after(self, step: TargetStep, gamma: int, sampling: SamplingTensors) -> DraftTree:  # pragma: no cover
        """The next step's drafts (``gamma`` nodes per request) from this step's target."""
        raise NotImplementedError(f"{type(self).__name__} does not draft after verification")


@dataclass(frozen=True)
class DrafterSpec:
    """What a drafter is, for the step, the engine and the cost model: returned once by
    :meth:`Proposer.drafter_spec` after the config is read, read as ``proposer.spec``.
    The defaults describe a model-free drafter of chains that drafts before verification."""

    # The draft decoder its forwards run: a step's drafting costs ``draft_forwards(γ)`` of
    # its bare one-token forwards, its catch-up a forward of the unseen tokens, its KV
    # cache follows the request (Proposer's defaults). None: no such decoder.
    model: DecoderPipelineModel | None = None
    # True: it drafts after verification, from the target's features
    # (``Drafter.draft_after``); its drafts wait in the state store for the next step.
    drafts_after_verify: bool = False
    # True (with drafts_after_verify): its drafts carry their distribution q
    # (sampled drafts), kept in the store beside them ([max_batch, γ, vocab]).
    samples_drafts: bool = False
    # True (with drafts_after_verify): it catches up on every packed row the target
    # was fed (TargetStep.rows …), prefill chunks included.
    needs_all_rows: bool = False
    # Target layers whose inputs it reads (``TargetStep.aux_hidden``); the final-norm
    # hidden state always comes. ``num_layers`` names the last layer's output before the final norm.
    target_layers: tuple[int, ...] = ()
    # True (with drafts_after_verify): the drafts left in the store are trees (parents and
    # node counts kept too); ``tree_facts``: their host facts (max_depth, max_children).
    drafts_trees: bool = False
    tree_facts: tuple[int | None, int | None] = (None, None)
    # True: γ is a tree's node budget. The nodes sit side by side and only the depth
    # adds tokens, so a request's last steps keep their whole tree (gamma_for).
    node_budget: bool = False
    max_speculative_tokens: int | None = None  # the most drafts a step can hold (Medusa: K heads); None: γ
    depth: int | None = None  # drafter forwards of every step, whatever γ (a dynamic tree's levels); None: one a draft

    def drafts(self, gamma: int) -> int:
        """Drafts per request of a step of ``gamma``."""
        m = self.max_speculative_tokens
        return gamma if m is None else min(gamma, m)

    def draft_forwards(self, gamma: int) -> int:
        """Drafter forwards a step of ``gamma`` runs, each charged T_draft(1) (spec/cost.py)."""
        return self.depth if self.depth is not None else self.drafts(gamma)


_SPEC_FLAGS = ("drafts_after_verify", "samples_drafts", "needs_all_rows", "target_layers", "drafts_trees",
               "tree_facts", "node_budget", "max_speculative_tokens")
_TIMERS = ("draft_cost", "draft_forward_time")  # what a drafter with weights and no spec.model must define


class Proposer(ABC):
    """Host half of a drafting method. Built as ``cls(config, deps)``; what it is,
    :meth:`drafter_spec` (read as :attr:`spec`)."""

    name: ClassVar[str] = ""
    config_cls: ClassVar[type[ProposerConfig]] = ProposerConfig
    drafter: Drafter

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        old = [f for f in _SPEC_FLAGS if f in vars(cls)]
        if old:
            raise TypeError(f"proposer {cls.__qualname__} sets {', '.join(old)} on the class; "
                            "return them from drafter_spec() (a DrafterSpec)")

    def drafter_spec(self) -> DrafterSpec:
        """What this drafter is (:class:`DrafterSpec`), from its config; called once, after ``__init__``."""
        return DrafterSpec()

    @functools.cached_property
    def spec(self) -> DrafterSpec:
        """:meth:`drafter_spec`, checked: a drafter with weights must have a cost (see :meth:`draft_cost`)."""
        spec = self.drafter_spec()
        if not isinstance(spec, DrafterSpec):
            raise TypeError(f"proposer {self.name!r}: drafter_spec() must return a DrafterSpec, got {short_repr(spec)}")
        missing = [h for h in _TIMERS if getattr(type(self), h) is getattr(Proposer, h)]
        if spec.model is None and missing and any(True for _ in self.drafter.parameters()):
            raise TypeError(
                f"drafter {self.name!r} declares no cost: its {type(self.drafter).__name__} has weights but "
                f"drafter_spec() names no draft decoder (DrafterSpec(model=...)) and it defines no "
                f"{' / '.join(missing)}; its drafting would be charged 0 s in the limit and adaptive γ")
        return spec

    @property
    def draft_model(self) -> DecoderPipelineModel | None:
        """The draft decoder whose one-token forward is T_draft(1) of the analytic limit (None: none)."""
        return self.spec.model

    def has_draft_cost(self) -> bool:
        """Whether its drafting takes time the limit charges: a draft decoder, or a timer of its own."""
        return self.spec.model is not None or type(self).draft_forward_time is not Proposer.draft_forward_time

    def state_specs(self) -> list[StateSpec]:
        """The per-request state this method keeps in the shared store (default none)."""
        return []

    def prepare(self, batch: list[TextContext], gamma: int, num_draft: list[int]) -> DraftBatch:
        """Packs this step's drafter inputs. ``num_draft[i] <= gamma`` per request.

        The returned batch's ``gamma`` may be smaller than asked (a model-free
        proposer that found fewer tokens): the step then verifies only that
        many. A proposer that drafts after verification is not asked.
        """
        raise NotImplementedError(f"{type(self).__name__} drafts after verification; prepare is not called")

    def prepare_after(self, batch: list[TextContext], packed: PackedBatch, gamma: int) -> Any:
        """Host packing for ``draft_after`` (a proposer with ``spec.needs_all_rows``):
        called once the target's ``packed`` batch of ``batch`` is built and
        before the step runs; its result arrives as ``TargetStep.host``. A
        request in ``batch`` past ``packed.num_new`` … is a prefill chunk that
        emits nothing this step. ``gamma``: drafts the step leaves per request."""
        return None

    # -- the draft decoder's KV cache (defaults for a spec.model; nothing without one) --
    def reserve(self, ctx: TextContext, gamma: int) -> None:
        """Makes room (KV blocks …) for drafting ``gamma`` tokens; may raise OutOfBlocks."""
        if self.spec.model is not None:
            self.spec.model.reserve(ctx, self.kv_tokens(len(ctx.tokens), gamma))

    def kv_tokens(self, num_tokens: int, gamma: int) -> int:
        """Tokens the ``draft_model``'s cache holds while drafting ``gamma`` tokens for a
        request of ``num_tokens`` (the engine's capacity planning; 0: no cache). Default
        with a spec.model: the request and its drafts."""
        return num_tokens + gamma if self.spec.model is not None else 0

    def commit(self, ctx: TextContext, num_committed: int) -> None:
        """After verification: forget state past the request's ``num_committed`` tokens
        (a spec.model's cache keeps every committed token but the last, fed next step)."""
        m = self.spec.model
        if m is not None:
            m.truncate(ctx, min(ctx.processed(m.cache_name), num_committed - 1))

    def free(self, ctx: TextContext) -> None:
        """Releases everything held for the request."""
        if self.spec.model is not None:
            self.spec.model.free(ctx)

    # -- costs: derived from spec.model, or the drafter's own (never a silent 0) ------------
    def draft_forward_time(self, ctx_len: int, repeats: int = 10, *,
                           between: Callable[[], object] | None = None, warmup: int = 3,
                           requests: int = 1) -> float:
        """Seconds of one bare drafting forward for ``requests`` requests (the run's batch)
        at context ``ctx_len`` as a step charges it (T_draft(1) of the analytic limit; 0:
        model-free). ``between``: untimed, before each timed call of the drafting that
        follows the target's forward in a step (say that forward: its reads evict some of
        the drafter's weights from a CPU's caches); ``warmup``: untimed calls first
        (``repeats=1, warmup=0``: one drafting, as a step's). Default: the spec.model's
        bare one-token forward."""
        from specdec.spec.forward_time import forward_time

        dm = self.spec.model
        return (forward_time(dm, 1, ctx_len, repeats=repeats, between=between, warmup=warmup, requests=requests)
                if dm is not None else 0.0)

    def draft_cost(self, batch_size: int, context_len: int) -> float:
        """Seconds one drafting forward takes for ``batch_size`` requests, for adaptive γ
        (default: the spec.model's one-token forward; 0: model-free)."""
        from specdec.spec.forward_time import forward_time

        dm = self.spec.model
        return (forward_time(dm, 1, context_len, repeats=7, stat="min", requests=batch_size)
                if dm is not None else 0.0)

    def fused_draft_cost(self, batch_size: int, context_len: int) -> float | None:
        """Seconds of all γ drafts of the method's full γ for ``batch_size`` requests where
        its steps run as one compiled graph; None: they do not (each draft costs
        :meth:`draft_cost`)."""
        return None

    def unseen_tokens(self, ctx: TextContext) -> int:
        """Tokens of ``ctx`` the drafter must read before it can draft (a spec.model's
        catch-up; 0: a drafter that keeps up with the target on its own, or none)."""
        m = self.spec.model
        return len(ctx.tokens) - ctx.processed(m.cache_name) if m is not None else 0

    def catch_up_cost(self, num_tokens: int) -> float:
        """Seconds the drafter takes to read ``num_tokens`` unseen tokens of one request
        (the spec.model's forward of them on an empty cache; 0 without one)."""
        from specdec.spec.forward_time import forward_time

        dm = self.spec.model
        return forward_time(dm, num_tokens, num_tokens, repeats=3, stat="min") if dm is not None else 0.0


P = TypeVar("P", bound=type[Proposer])
_PROPOSERS: dict[str, type[Proposer]] = {}


def register_proposer(name: str, config: type[ProposerConfig]) -> Callable[[P], P]:
    """Class decorator: registers a proposer under ``name`` with its config dataclass."""
    if not (isinstance(config, type) and issubclass(config, ProposerConfig)):
        raise TypeError(f"proposer {name!r}: its config must subclass ProposerConfig, got {config!r}")

    def deco(cls: P) -> P:
        old = _PROPOSERS.get(name)
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise ValueError(f"proposer {name!r} is already registered to {old.__qualname__}")
        taken = [n for n, c in _PROPOSERS.items() if c.config_cls is config and n != name]
        if taken:
            raise ValueError(f"proposer {name!r}: config {config.__qualname__} already belongs to {taken[0]!r}")
        cls.name = name
        cls.config_cls = config
        config.method_name = name  # its errors name method.<name>.<option>
        _PROPOSERS[name] = cls  # (re-importing a module re-registers its class)
        return cls

    return deco


def _load_builtin() -> None:
    """Imports every module of this package (each registers its proposer)."""
    import specdec.spec.proposers as pkg

    for m in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{m.name}")


def import_proposer_module(module: str, *, where: str) -> None:
    """Imports ``module`` (a drafter outside the package); errors name ``where`` it was asked for."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise KeyError(f"{where}: cannot import drafter module {module!r}: {e}") from None


def proposer_class(name: str) -> type[Proposer]:
    """The proposer registered as ``name`` (built-in, already imported, or an entry point)."""
    _load_builtin()
    if name not in _PROPOSERS:
        for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
            import_proposer_module(ep.value.split(":")[0], where=f"entry point {ep.name!r}")
    try:
        return _PROPOSERS[name]
    except KeyError:
        raise KeyError(f"unknown drafting method {name!r}; registered: {', '.join(registered_proposers())}") from None


def config_class(name: str) -> type[ProposerConfig]:
    """The config dataclass of the proposer registered as ``name``."""
    return proposer_class(name).config_cls


def proposer_for(config: ProposerConfig) -> type[Proposer]:
    """The proposer whose config class ``config`` is an instance of."""
    _load_builtin()
    for cls in _PROPOSERS.values():
        if type(config) is cls.config_cls:
            return cls
    raise KeyError(f"{type(config).__qualname__} is no registered proposer's config; "
                   f"registered: {', '.join(registered_proposers())}")


def registered_proposers() -> list[str]:
    _load_builtin()
    return sorted(_PROPOSERS)
