"""Fused Triton ops, one file per op."""

from .tree_attention import tree_attention
from .tree_metadata import TreeMetadata, tree_metadata
from .verify import VerifyOutput, verify
from .verify_tree import TreeVerifyOutput, verify_multi, verify_tree

__all__ = [
    "TreeMetadata",
    "TreeVerifyOutput",
    "VerifyOutput",
    "tree_attention",
    "tree_metadata",
    "verify",
    "verify_multi",
    "verify_tree",
]
