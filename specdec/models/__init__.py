"""Built-in architectures; importing this package registers them."""

from specdec.models import eagle, llama, medusa  # noqa: F401  (registers the Llama family, EAGLE and Medusa heads)
from specdec.models.config import LlamaConfig
from specdec.models.llama import LlamaDecoder

__all__ = ["LlamaConfig", "LlamaDecoder"]
