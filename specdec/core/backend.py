"""How a loaded model runs: natively, compiled, or eager, chosen once per module.

A model the step runs (target, draft model, EAGLE head, Medusa heads) is called as a
module, ``module(inputs)``; what runs behind that call is its :class:`Backend`, chosen
once when the model is loaded (:func:`load_backend`, after its weights are packed):

- ``native``: the module's whole forward is one C++ call on our float32 CPU kernels
  (:mod:`specdec.core.kernels`: ``decoder_forward`` for a decoder, ``eagle_forward`` for an
  EAGLE head, ``medusa_forward`` for Medusa heads; the module's ``native_kind`` says which).
  A module offers it by a ``native_operands()`` method (the op's weight operands, or None
  where it cannot serve); the backend gathers them once and holds the only calls of the
  ops. Such a backend may also run a greedy draft chain's one-token steps as one more call
  (:meth:`NativeBackend.draft_chain`, :meth:`NativeEagleBackend.head_chain`). Compiling buys
  nothing there, and a compiled
  graph around its calls would only break at the call: ``compile_around`` is False.
- ``compiled``: ``torch.compile`` of the module's class ``forward``, a copy of its code
  of its own (:func:`compile_decoder`).
- ``eager``: the module's Python forward.

Callers ask the backend (:func:`backend_of`), never the module's attributes. It also
holds the one path that reruns a CPU forward whose rows went non-finite
(:func:`forward_checking_rows`).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import nn

if TYPE_CHECKING:
    from specdec.core.inputs import DecoderInputs, KVCacheTensors

R = TypeVar("R")


class Backend:
    """How one module runs (see the module doc). Eager or compiled: its own Python."""

    compile_around: ClassVar[bool] = True  # a compiled graph around the module's calls pays (dynamo's cost per call)
    # A greedy one-request draft chain's steps in one call, where the backend has one (NativeBackend).
    draft_chain: Callable[..., torch.Tensor] | None = None
    # The same for an EAGLE head's chain (NativeEagleBackend).
    head_chain: Callable[..., torch.Tensor] | None = None
    # A dynamic token tree's whole expansion in one call (specdec.spec.tree.expand_topk's
    # candidates), where the backend has one: a draft decoder's, an EAGLE head's.
    draft_tree: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    head_tree: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def __init__(self, module: nn.Module, kind: str = "eager") -> None:
        self.module = module
        self.kind = kind

    def stack(self, inputs: DecoderInputs, groups: list[Any], rows: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]] | None:
        """The forward's layers as one native call (see :class:`NativeBackend`); None: the
        module runs its Python."""
        return None

    def eagle_step(self, inputs: DecoderInputs, feature: torch.Tensor, groups: list[Any]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """An EAGLE head's forward as one native call (:class:`NativeEagleBackend`); None: the
        head runs its Python."""
        return None

    def medusa_heads(self, hidden: torch.Tensor, num: int) -> torch.Tensor | None:
        """Medusa heads' forward as one native call (:class:`NativeMedusaBackend`); None: the
        heads run their Python."""
        return None

    def __repr__(self) -> str:
        return f"Backend({self.kind}, {type(self.module).__name__})"


class NativeBackend(Backend):
    """A module whose forward is one ``specdec_cpu::decoder_forward`` call (module doc)."""

    compile_around = False

    def __init__(self, module: nn.Module, operands: tuple[Any, ...]) -> None:
        super().__init__(module, "native")
        # (embedding, weights, biases, dims, eps, final norm, head, its bias, vocabulary, attention scale)
        self.operands = operands

    def stack(self, inputs: DecoderInputs, groups: list[Any], rows: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The module's eager forward as one call (``specdec/core/kernels/cpu.cpp``):
        embedding, rope rows, each layer's norms, projections, rope, cache writes, attention
        over ``groups`` (the forward's ``PagedAttend``s: slots, masks, row indices) and
        residuals, the final norm and the head, in the eager forward's order -> (h [T, d],
        h at the logit rows [N, d], logits [N, V], the captured layers' inputs at ``rows``)."""
        run = _stack_traced if torch.compiler.is_compiling() else _stack
        return run(self.module, self.operands, inputs, groups, rows)

    def draft_chain(self, logits: torch.Tensor, step_positions: torch.Tensor,  # type: ignore[override]
                    step_slots: torch.Tensor, gather_slots: torch.Tensor, kv: KVCacheTensors) -> torch.Tensor:
        """One request's greedy chain after its catch-up ``logits`` [1, V]: the argmax, then
        ``len(step_positions)`` one-token steps (each writing its key/value at ``step_slots``
        [γ-1, 1], reading ``gather_slots`` [1, S] through it) and their argmax -> drafts [1, γ],
        the bits the Python chain (``DraftModelDrafter._chain_steps``) gets."""
        m = self.module
        return torch.ops.specdec_cpu.decoder_steps.default(
            logits, step_positions, step_slots, gather_slots, kv.k, kv.v, m.rope_cos, m.rope_sin, *self.operands)

    def draft_tree(self, logits: torch.Tensor, tree_slots: torch.Tensor,  # type: ignore[override]
                   gather_slots: torch.Tensor, lens: torch.Tensor, max_ctx: int, depth: int, top_k: int,
                   exact_context: bool, kv: KVCacheTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EAGLE-2's expansion (:func:`~specdec.spec.tree.expand_topk`) after the catch-up
        ``logits`` [B, V] in one call, each frontier one forward fed as
        :func:`~specdec.spec.tree.node_rows` feeds it (context ``gather_slots[b, :lens[b]]``,
        then ``tree_slots``) -> the candidates' (tokens, parents, scores), the Python's bits."""
        m = self.module
        window = m.config.sliding_window or 0
        return torch.ops.specdec_cpu.decoder_tree.default(
            logits, tree_slots, gather_slots, lens, max_ctx, depth, top_k, exact_context, window, kv.k, kv.v,
            m.rope_cos, m.rope_sin, *self.operands)


class _NativeHead(Backend):
    """A draft head whose forward is one native call on ``operands`` (its ``native_operands()``)."""

    compile_around = False

    def __init__(self, module: nn.Module, operands: tuple[Any, ...]) -> None:
        super().__init__(module, "native")
        self.operands = operands


class NativeEagleBackend(_NativeHead):
    """An EAGLE head (``specdec/models/eagle.py``) whose forward is one
    ``specdec_cpu::eagle_forward`` call, and whose greedy one-request chain is one
    ``specdec_cpu::eagle_steps`` call: the eager forward's bits."""

    def eagle_step(self, inputs: DecoderInputs, feature: torch.Tensor, groups: list[Any]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EagleHead.forward's step over ``inputs`` (tokens, positions, the head's cache,
        attention ``groups``) and ``feature`` [T, d'] -> (h [T, d], h at the logit rows [N, d],
        target-vocabulary logits [N, V])."""
        run = _eagle_traced if torch.compiler.is_compiling() else _eagle
        return run(self.module, self.operands, inputs, feature, groups)

    def head_chain(self, logits: torch.Tensor, h: torch.Tensor, pos0: torch.Tensor,  # type: ignore[override]
                   steps: int, gather: torch.Tensor, kv: KVCacheTensors) -> torch.Tensor:
        """One request's greedy chain after its catch-up (``logits`` [1, V], state ``h`` [1, d]
        at the bonus row's position ``pos0`` [1]): the argmax, then ``steps`` one-token steps
        reading head slots ``gather`` [1, K + steps] -> drafts [1, steps + 1], the bits
        ``EagleDrafter._chain_steps`` gets."""
        m = self.module
        return torch.ops.specdec_cpu.eagle_steps.default(logits, h, pos0, steps, gather, kv.k, kv.v, m.rope_cos,
                                                         m.rope_sin, *self.operands)

    def head_tree(self, logits: torch.Tensor, h: torch.Tensor, tree_slots: torch.Tensor,  # type: ignore[override]
                  gather_slots: torch.Tensor, lens: torch.Tensor, max_ctx: int, depth: int, top_k: int,
                  kv: KVCacheTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EAGLE-2's expansion (:func:`~specdec.spec.tree.expand_topk`) after the catch-up
        (``logits`` [B, V], state ``h`` [B, d]) in one call, each frontier one head forward
        fed as :func:`~specdec.spec.tree.node_rows` feeds it -> the candidates' (tokens,
        parents, scores), the Python's bits."""
        m = self.module
        return torch.ops.specdec_cpu.eagle_tree.default(logits, h, tree_slots, gather_slots, lens, max_ctx, depth,
                                                        top_k, kv.k, kv.v, m.rope_cos, m.rope_sin, *self.operands)


class NativeMedusaBackend(_NativeHead):
    """Medusa heads (``specdec/models/medusa.py``) whose forward (every head's ResBlocks and
    logits) is one ``specdec_cpu::medusa_forward`` call: the eager forward's bits."""

    def medusa_heads(self, hidden: torch.Tensor, num: int) -> torch.Tensor:
        """Logits [B, num, V] of the first ``num`` heads on ``hidden`` [B, H] (float32)."""
        blocks, biases, layers, heads, vocab = self.operands
        own = heads if len(heads) == 1 else heads[:num]
        return _medusa(hidden, blocks[:num], biases[:num], layers, own, vocab)


def _medusa(hidden: torch.Tensor, blocks: list[torch.Tensor], biases: list[torch.Tensor | None], layers: int,
            heads: list[torch.Tensor], vocab: int) -> torch.Tensor:
    return torch.ops.specdec_cpu.medusa_forward.default(hidden, blocks, biases, layers, heads, vocab)


def _eagle(module: nn.Module, operands: tuple[Any, ...], inputs: DecoderInputs, feature: torch.Tensor,
           groups: list[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cache = groups[0].cache
    return torch.ops.specdec_cpu.eagle_forward.default(
        inputs.tokens, feature, inputs.positions, cache.k, cache.v, inputs.logit_index, *_per_group(groups),
        module.rope_cos, module.rope_sin, *operands)


def _per_group(groups: list[Any]) -> tuple[list[Any], ...]:
    """The native ops' per-group operands of the forward's ``PagedAttend`` ``groups``: slot
    mappings, slots, masks, (causal, single) flags, q and out indices, row counts."""
    if len(groups) == 1:  # (most steps: the lists without a loop)
        g = groups[0]
        return ([g.inputs.slot_mapping], [g.slots], [g.mask], [int(g.causal), int(g.single)], [g.inputs.q_index],
                [g.inputs.out_index], [g.inputs.positions.shape[0]])
    return ([g.inputs.slot_mapping for g in groups], [g.slots for g in groups], [g.mask for g in groups],
            [f for g in groups for f in (int(g.causal), int(g.single))], [g.inputs.q_index for g in groups],
            [g.inputs.out_index for g in groups], [g.inputs.positions.shape[0] for g in groups])


def _stack(module: nn.Module, operands: tuple[Any, ...], inputs: DecoderInputs, groups: list[Any],
           rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    cache = groups[0].cache
    h, hl, logits, seen = torch.ops.specdec_cpu.decoder_forward.default(
        inputs.tokens, inputs.positions, cache.k, cache.v, inputs.logit_index, *_per_group(groups),
        list(inputs.capture_layers), rows, module.rope_cos, module.rope_sin, *operands)
    return h, hl, logits, list(seen)


# Traced (a compiled graph around a native module's call), the call runs as it is, between
# two graphs: the same bits as eager, never a traced copy of the forward.
_stack_traced = torch.compiler.disable(_stack)
_eagle_traced = torch.compiler.disable(_eagle)

# The native backend of each kind of module (its ``native_kind``; a decoder by default).
_NATIVE: dict[str, type[NativeBackend] | type[_NativeHead]] = {"decoder": NativeBackend, "eagle": NativeEagleBackend,
                                           "medusa": NativeMedusaBackend}


def _choose(module: nn.Module) -> Backend:
    """Native where the module offers operands for it (packed for our kernels), else eager."""
    offer = getattr(module, "native_operands", None)
    operands = offer() if callable(offer) else None
    if operands is None:
        return Backend(module)
    return _NATIVE[getattr(module, "native_kind", "decoder")](module, operands)


def backend_of(module: nn.Module) -> Backend:
    """``module``'s backend: the one :func:`load_backend` chose, or (a module never loaded
    through it: built and packed by hand) native or eager as its packed weights allow."""
    b = getattr(module, "_backend", None)
    if b is None:
        b = module._backend = _choose(module)
    return b


def forget_backend(module: nn.Module) -> None:
    """Its weights changed (``pack_layers``): the next :func:`backend_of` chooses again."""
    module._backend = None


def load_backend(module: nn.Module, *, compile: bool = False, native: bool = True) -> Backend:
    """Chooses ``module``'s backend, once, after its weights are packed: native where it
    serves (unless ``native`` is False), else compiled (``compile``: ``runtime.compile``)
    or eager."""
    b = module._backend = _choose(module) if native else Backend(module)
    if compile and b.compile_around:
        compile_decoder(module)
    return backend_of(module)


def forward_checking_rows(run: Callable[[bool], tuple[R, torch.Tensor, bool]], device: torch.device,
                          isolate_rows: bool = True) -> R:
    """A paged forward that hides each row's non-finite new keys from the rows before it
    (``PagedAttend``'s ``isolate_rows``) only when it must: the one non-finite rerun path.

    ``run(isolate)`` runs the forward with or without that hiding -> (result, its final
    states h, whether rows of one request meet). The hiding is costly on a CPU (about 15%
    of a verification forward), so there an eager forward runs without it, and runs again
    with it only when some row went non-finite: a residual stream that went NaN or inf
    stays so to the last layer, so ``h`` tells. Compiled (traced), or on another device,
    it runs once as ``isolate_rows`` asks (a compiled CPU verification is checked by the
    pipeline after verifying, ``DecoderInputs.isolate_rows``)."""
    check = device.type == "cpu" and not torch.compiler.is_compiling()
    out, h, rows_meet = run(isolate_rows and not check)
    if check and rows_meet and not math.isfinite(h.sum().item()):  # (NaN and ±inf survive the sum)
        out = run(True)[0]
    return out


# -- compiled ------------------------------------------------------------------------------

def compile_decoder(module: nn.Module) -> None:
    """``torch.compile`` in place, shapes dynamic (one graph serves every batch
    and context length; sizes 0/1 get their own). Weights and ``state_dict``
    are untouched. On CPU the gain comes from fusing the many small ops of a
    small model; the first call of each shape kind pays the compile. A module whose
    backend is native stays as it is (the built-in target's one-token forward, 2-core
    Zen 1: 2.65 ms compiled through Inductor, 1.7-1.8 as one C++ call).

    On CPU the graph runs through Inductor's C++ wrapper (``cpp_wrapper``):
    the generated code that calls each fused kernel and matmul is C++, not
    Python. A small model's compiled forward is mostly those calls; on the
    built-in target the bare one-token forward took 2.15 ms instead of 2.63
    (5 tokens: 3.07 instead of 3.74) for about 1.7x the compile time."""
    import torch._dynamo

    from specdec.core.linear import register_compiled_lowering

    if not backend_of(module).compile_around:
        return
    # A graph per shape kind (decode, verify, prefill; one request or many; ...): past the
    # default limit of 8, later shapes would silently run eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    register_compiled_lowering()
    devices = {p.device.type for p in module.parameters()}
    device_type = devices.pop() if len(devices) == 1 else "cpu"
    module.forward = _own_compiled(module, type(module).forward, compile_options(device_type))
    module._backend = Backend(module, "compiled")


def _own_compiled(module: nn.Module, fn: Callable[..., Any], options: dict[str, Any] | None) -> Callable[..., Any]:
    """``fn`` (``module``'s class's ``forward``, or another function taking ``module``
    first) compiled as ``module``'s bound method, with a cache of graphs and guards of its own.

    Dynamo keeps its compiled graphs per code object, each behind guards that a call
    checks in turn until one holds. Every decoder of a class shares ``forward``'s code,
    so the target's and the drafter's graphs (and every pipeline's in one process: 12 in
    a benchmark sweep) sat in one list, told apart by guards on each module's attributes
    and on every weight tensor: on the built-in target a graph's guards took 67 us to
    pass (a compiled one-token forward is about 1 ms), and a call walked past other
    modules' graphs first. So each module compiles a copy of ``forward``'s code (its own
    list: its own shape kinds only), and its guards leave out the module's own attributes
    (``skip_guard_on_all_nn_modules_unsafe``): nothing changes a decoder after it is
    prepared (weights packed, rope tables built, then compiled), and a module's graphs
    serve that module alone. Guards on the inputs (shapes, the cache) stay."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__qualname__, own.__doc__ = fn.__qualname__, fn.__doc__
    opts = dict(options or {}, guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe)
    return torch.compile(types.MethodType(own, module), dynamic=True, options=opts)


def compile_options(device_type: str) -> dict[str, Any] | None:
    """Inductor's options for a graph on ``device_type``: on CPU its C++ wrapper
    (:func:`compile_decoder`); on CUDA, CUDA graphs (``triton.cudagraphs``, what
    ``mode="reduce-overhead"`` sets: ``torch.compile`` takes a mode or options, not both,
    and ours carry a guard filter), so a step replays its recorded kernels in one launch
    instead of launching each from Python. A CUDA graph serves one set of sizes: the batch
    sizes a step meets are bounded by :func:`specdec.core.graphs.graph_bucket`."""
    if device_type == "cpu":
        return {"cpp_wrapper": True}
    if device_type == "cuda":
        return {"triton.cudagraphs": True}
    return None


def compile_function(fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """``fn`` under ``torch.compile`` as :func:`compile_decoder` compiles a decoder (shapes
    dynamic, Inductor's C++ wrapper on CPU). A decoder called inside ``fn`` is traced
    into ``fn``'s graph: several forwards become one call."""
    from specdec.core.linear import register_compiled_lowering

    register_compiled_lowering()
    return torch.compile(fn, dynamic=True, options=compile_options(device.type))


def compile_method(module: nn.Module, fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """``fn`` (a function taking ``module`` first) as ``module``'s bound method under
    ``torch.compile``, as :func:`compile_function`, but with graphs and guards of its own
    (as a compiled decoder's ``forward``, :func:`_own_compiled`): each instance's calls
    check its own graphs only, and no guard walks the modules' weights."""
    from specdec.core.linear import register_compiled_lowering

    register_compiled_lowering()
    return _own_compiled(module, fn, compile_options(device.type))
