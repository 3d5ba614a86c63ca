"""Decoder registration by role (after MAX's ``registration_graph_api``).

A decoder module class registers under a :class:`Role` and one or more Hugging
Face ``architectures`` names::

    @register(Role.DECODER, "LlamaForCausalLM", "Qwen2ForCausalLM")
    class LlamaDecoder(DecoderModule): ...

Later code finds it with :func:`lookup` (by role and HF name) and never
dispatches on names itself. The base class, :class:`DecoderModule` (its class
attributes are the knobs the seed page lists), lives in
:mod:`specdec.core.decoder_module` and is re-exported here on first use: the
registry itself needs no torch, so ``import specdec`` does not load it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from torch import nn

    from specdec.core.decoder_module import BuildContext, DecoderModule


class Role(enum.Enum):
    """What a registered module is for."""

    DECODER = "decoder"  # a causal LM: target, or independent draft model
    DRAFT_HEAD = "draft_head"  # a head on the target's hidden states (EAGLE-style)
    MEDUSA_HEAD = "medusa_head"  # parallel heads on the last hidden state (Medusa-style)


M = TypeVar("M", bound="type[nn.Module]")

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


def __getattr__(name: str) -> Any:
    # The base class needs torch; the registry itself does not (``import specdec`` stays light).
    if name in ("BuildContext", "DecoderModule"):
        from specdec.core import decoder_module

        return getattr(decoder_module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
