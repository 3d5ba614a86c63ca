"""specdec: a speculative-decoding research framework.

``import specdec`` stays light: it never imports ``transformers``.
"""

from specdec.core.registry import Role, lookup, register, registered_names

__version__ = "0.1.0"
__all__ = ["Role", "lookup", "register", "registered_names", "__version__"]
