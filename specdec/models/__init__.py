"""Built-in architectures; importing this package registers them."""

from specdec.models import llama  # noqa: F401  (registers the Llama family)
from specdec.models.config import LlamaConfig
from specdec.models.llama import LlamaDecoder

__all__ = ["LlamaConfig", "LlamaDecoder"]
