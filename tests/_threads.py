"""A helper for tests that check a native CPU kernel gives the same bits at any thread count."""

from __future__ import annotations

import torch


def under_threads(fn, *counts: int) -> list:
    """``fn()`` run with each of ``counts`` torch threads in turn (the count restored afterwards)."""
    before = torch.get_num_threads()
    try:
        out = []
        for n in counts:
            torch.set_num_threads(n)
            out.append(fn())
        return out
    finally:
        torch.set_num_threads(before)
