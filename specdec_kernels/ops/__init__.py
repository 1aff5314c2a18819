"""Fused Triton ops, one file per op."""

from .verify import VerifyOutput, verify

__all__ = ["VerifyOutput", "verify"]
