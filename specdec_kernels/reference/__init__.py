"""Plain-PyTorch references: the specification every kernel is tested against."""

from .verify import verify_reference
from .verify_tree import verify_multi_reference, verify_tree_reference

__all__ = ["verify_multi_reference", "verify_reference", "verify_tree_reference"]
