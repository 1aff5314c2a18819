"""Plain-PyTorch references: the specification every kernel is tested against."""

from .tree_attention import tree_attention_mask, tree_attention_reference
from .verify import verify_reference
from .verify_tree import tree_metadata_reference, verify_multi_reference, verify_tree_reference

__all__ = [
    "tree_attention_mask",
    "tree_attention_reference",
    "tree_metadata_reference",
    "verify_multi_reference",
    "verify_reference",
    "verify_tree_reference",
]
