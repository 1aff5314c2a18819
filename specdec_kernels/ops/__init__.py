"""Kernels and their launchers, one file per op (the public verification functions are in ``api``)."""

from .tree_attention import tree_attention
from .tree_metadata import tree_metadata

__all__ = ["tree_attention", "tree_metadata"]
