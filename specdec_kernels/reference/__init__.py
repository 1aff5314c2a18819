"""Plain-PyTorch references: the specification every kernel is tested against."""

from .verify import verify_reference

__all__ = ["verify_reference"]
