"""Decoder registration by role (after MAX's ``registration_graph_api``).

A decoder module class registers under a :class:`Role` and one or more Hugging
Face ``architectures`` names::

    @register(Role.DECODER, "LlamaForCausalLM", "Qwen2ForCausalLM")
    class LlamaDecoder(DecoderModule): ...

Later code finds it with :func:`lookup` (by role and HF name) and never
dispatches on names itself. The class attributes of :class:`DecoderModule`
are the knobs the seed page lists; each has a documented default.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn


@dataclass
class BuildContext:
    """What ``build_module`` gets: a config and, optionally, weights to adopt."""

    config: Any
    state_dict: dict[str, torch.Tensor] | None = None


class Role(enum.Enum):
    """What a registered module is for."""

    DECODER = "decoder"  # a causal LM: target, or independent draft model
    DRAFT_HEAD = "draft_head"  # a head on the target's hidden states (EAGLE-style)
    MEDUSA_HEAD = "medusa_head"  # parallel heads on the last hidden state (Medusa-style)


class DecoderModule(nn.Module):
    """Base class of a registered decoder: ``forward`` takes tensors only.

    Class attributes (override in a subclass; all optional):

    - ``supports_data_parallel``: may run as several replicas, each on its
      slice of the batch (``data_parallel_splits``).
    - ``strict_state_dict_loading``: ``False`` when the checkpoint may hold
      weights the decoder does not read (they are ignored); a parameter the
      checkpoint lacks is an error either way.
    - ``override_quantization_encoding``: the checkpoint's dtype wins over the
      dtype a weight declares (otherwise weights are cast to the declared one).
    - ``tp_plan``: how the decoder splits across tensor-parallel ranks
      (module-name patterns -> styles, see :mod:`specdec.dist.tensor_parallel`).
    """

    supports_data_parallel: ClassVar[bool] = False
    strict_state_dict_loading: ClassVar[bool] = True
    override_quantization_encoding: ClassVar[bool] = False
    # Tensor parallelism: module-name pattern -> style (specdec/dist/tensor_parallel.py);
    # None: the decoder runs on one device only.
    tp_plan: ClassVar[dict[str, str] | None] = None

    # Filled by ``register``.
    role: ClassVar[Role | None] = None
    architectures: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def build_module(cls, context: Any, config_cls: type) -> nn.Module:
        """Builds the module a speculative-decoding module calls as its target.

        ``context`` has ``config`` (an instance of ``config_cls``, or a dict
        its ``from_dict`` parses) and optionally ``state_dict``. With a state
        dict the module is built without storage and takes the given tensors
        as its own (``assign=True``): a target built from a loaded decoder
        shares its weights instead of copying them.
        """
        if isinstance(context, dict):  # a plain mapping works as well as a BuildContext
            context = BuildContext(config=context["config"], state_dict=context.get("state_dict"))
        config = context.config
        if not isinstance(config, config_cls):
            config = config_cls.from_dict(config)
        state_dict = getattr(context, "state_dict", None)  # any object with .config works
        if state_dict is None:
            return cls(config)
        with torch.device("meta"):
            module = cls(config)
        module.load_state_dict(state_dict, strict=cls.strict_state_dict_loading, assign=True)
        for sub in module.modules():  # non-persistent buffers come back empty
            for name, buf in list(sub._buffers.items()):
                if buf is not None and buf.is_meta:
                    sub._buffers[name] = torch.empty(0)
        if getattr(config, "tie_word_embeddings", False) and hasattr(module, "lm_head"):
            module.lm_head.weight = module.model.embed_tokens.weight  # type: ignore[union-attr]
        return module.eval()

    def prepare_for_inference(self) -> nn.Module:
        """Inference-only rewrites after loading (fusing projections …); default none."""
        return self


M = TypeVar("M", bound=type[nn.Module])

# (role, architecture name) -> class. Module-level but append-only: it is the
# name -> class table the design asks for, filled at import by decorators.
_REGISTRY: dict[tuple[Role, str], type[nn.Module]] = {}


def register(role: Role, *architectures: str) -> Callable[[M], M]:
    """Class decorator: registers ``cls`` under ``role`` for each HF name."""
    if not architectures:
        raise ValueError("register() needs at least one architecture name")

    def deco(cls: M) -> M:
        for name in architectures:
            key = (role, name)
            if key in _REGISTRY and _REGISTRY[key] is not cls:
                raise ValueError(
                    f"{role.value} architecture {name!r} is already registered "
                    f"to {_REGISTRY[key].__qualname__}"
                )
            _REGISTRY[key] = cls
        cls.role = role  # type: ignore[attr-defined]
        own = tuple(cls.__dict__.get("architectures", ()))  # not a parent's names
        cls.architectures = own + tuple(a for a in architectures if a not in own)  # type: ignore[attr-defined]
        return cls

    return deco


def registered_names(role: Role | None = None) -> list[str]:
    """Sorted architecture names registered (under ``role`` if given)."""
    _ensure_builtin_models()
    return sorted(name for (r, name) in _REGISTRY if role is None or r == role)


def lookup(architecture: str, role: Role = Role.DECODER) -> type[nn.Module]:
    """The class registered for ``architecture`` under ``role``."""
    _ensure_builtin_models()
    try:
        return _REGISTRY[(role, architecture)]
    except KeyError:
        known = ", ".join(registered_names(role)) or "(none)"
        raise KeyError(
            f"unknown {role.value} architecture {architecture!r}; registered: {known}"
        ) from None


def _ensure_builtin_models() -> None:
    # Importing the model package runs the @register decorators of the
    # built-in architectures; cheap after the first time.
    import specdec.models  # noqa: F401
