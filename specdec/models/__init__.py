"""Built-in architectures; importing this package registers them."""

from specdec.models import eagle, llama  # noqa: F401  (registers the Llama family and the EAGLE heads)
from specdec.models.config import LlamaConfig
from specdec.models.llama import LlamaDecoder

__all__ = ["LlamaConfig", "LlamaDecoder"]
