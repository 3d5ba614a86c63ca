"""specdec: a speculative-decoding research framework.

    from specdec import LLM, SamplingParams
    from specdec.spec.proposers.draft_model import DraftModelConfig
    llm = LLM("target_dir", method=DraftModelConfig(path="draft_dir"))
    print(llm.generate(["def fib(n):"], SamplingParams(max_new_tokens=32))[0].text)

``import specdec`` stays light (about 0.1 s): it imports neither torch, ``transformers``
nor Hydra; the registry and ``SamplingParams`` need none of them.
"""

from __future__ import annotations

from typing import Any

from specdec.core.context import SamplingParams
from specdec.core.registry import Role, lookup, register, registered_names

__version__ = "0.1.0"
__all__ = ["LLM", "Role", "SamplingParams", "lookup", "register", "registered_names", "__version__"]


def __getattr__(name: str) -> Any:  # lazy: the engine stack loads on first use
    if name == "LLM":
        from specdec.api import LLM

        return LLM
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
