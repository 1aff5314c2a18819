"""The one module walk behind every in-place layer swap of the CPU paths.

``cpu_linear`` (oneDNN, the int8 / int4 quantised drafts) and ``cpu_f32`` (the native fp32 kernel)
each decide *which* layers to take and *what* replaces them; the walk over a model's children is
here, below both, so neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["swap_children"]


def swap_children(model: nn.Module, replacement: Callable[[str, nn.Module], nn.Module | None]) -> int:
    """Replace, in place, each child module of ``model`` (at any depth) for which
    ``replacement(qualified_name, child)`` returns a module; ``None`` keeps the child. Returns how many
    were replaced. The list of modules is taken first, so a new module's own children are not visited."""
    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            new = replacement(f"{parent_name}.{name}" if parent_name else name, child)
            if new is not None:
                setattr(parent, name, new)
                replaced += 1
    return replaced
