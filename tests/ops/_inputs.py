"""Random verification problems shared by the verify tests."""

from __future__ import annotations

import torch


def make_problem(
    B: int,
    G: int,
    V: int,
    *,
    dtype=torch.float32,
    device="cpu",
    closeness: float = 0.5,
    scale: float = 2.0,
    seed: int = 0,
):
    """Target logits [B, G+1, V], draft logits [B, G, V] near the target, drafts sampled from q."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(B, G + 1, V, generator=gen) * scale
    draft = target[:, :G] + torch.randn(B, G, V, generator=gen) * scale * closeness
    if G > 0 and B > 0:
        q = torch.softmax(draft.reshape(-1, V), dim=-1)
        tokens = torch.multinomial(q, 1, generator=gen).reshape(B, G)
    else:
        tokens = torch.zeros(B, G, dtype=torch.int64)
    return target.to(dtype).to(device), tokens.to(device), draft.to(dtype).to(device)


# (temperature, top_k, top_p) of the threshold tests: each filter alone, both, neither, extremes
THRESHOLD_SETTINGS = [
    (1.0, 5, 1.0),
    (0.7, 0, 0.9),
    (0.7, 50, 0.9),
    (1.3, 1, 0.5),
    (0.5, 0, 1e-6),
    (2.0, 7, 0.999),
    (1.0, 0, 1.0),
    (0.9, 10_000, 0.3),
]


def reference_thresholds(x, temperature, top_k, top_p):
    """[R] fp32: reference.sampling.filter_threshold of each row of x [R, V] (sanitised first) with
    its own (temperature, top_k, top_p)."""
    from specdec_kernels.reference.sampling import filter_threshold, sanitize_logits

    return torch.tensor(
        [
            filter_threshold(sanitize_logits(row)[0], t, k, p)
            for row, t, k, p in zip(x, temperature, top_k, top_p, strict=True)
        ],
        dtype=torch.float32,
    )


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """int32 words [..., ceil(V/32)] of a bool [..., V] allow-mask: bit j of word w = token 32w + j
    (xgrammar's / llguidance's layout), written independently of specdec_kernels._bitmask."""
    V = allowed.shape[-1]
    W = (V + 31) // 32
    padded = torch.zeros(*allowed.shape[:-1], W * 32, dtype=torch.int64, device=allowed.device)
    padded[..., :V] = allowed.to(torch.int64)
    words = (padded.view(*allowed.shape[:-1], W, 32) << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def flattened_problem(V: int, seed: int):
    """A flattened-layout call of 3 requests drafting 3, 0 and 2 tokens: (cu [4], target rows [8, V],
    draft ids [5], draft logits [5, V] near the rows they were drafted at)."""
    counts = torch.tensor([3, 0, 2])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    gen = torch.Generator().manual_seed(seed)
    rows, ids = torch.randn(8, V, generator=gen), torch.randint(0, V, (5,), generator=gen)
    draft = rows[torch.tensor([0, 1, 2, 4, 5])] + 0.3 * torch.randn(5, V, generator=gen)
    return cu, rows, ids, draft
