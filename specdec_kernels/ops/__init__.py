"""Fused Triton ops, one file per op."""

from .verify import VerifyOutput, verify
from .verify_tree import TreeVerifyOutput, verify_multi, verify_tree

__all__ = ["TreeVerifyOutput", "VerifyOutput", "verify", "verify_multi", "verify_tree"]
