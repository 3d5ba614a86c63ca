"""The base class of registered decoders (:class:`DecoderModule`) and what building one takes.

Kept apart from :mod:`specdec.core.registry` so that the name table (and
``import specdec``) needs no torch; the registry re-exports both names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from specdec.core.registry import Role


@dataclass
class BuildContext:
    """What ``build_module`` gets: a config and, optionally, weights to adopt."""

    config: Any
    state_dict: dict[str, torch.Tensor] | None = None


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
