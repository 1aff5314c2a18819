"""Reference tree attention: an explicit boolean mask through plain PyTorch attention (fp64).

The specification of :func:`specdec_kernels.tree_attention`: request b's query node n attends key s iff
s < prefix_lens[b], or s = prefix_lens[b] + j for a tree node j that is n or an ancestor of n.
Padding nodes (n >= num_nodes[b]) output zeros; NaN/inf in a key's value reaches only the queries
that attend that key. With a sliding window W, positions are s for prefix
key s and prefix_lens[b] + depth - 1 for a node, and a query at position p sees only keys at
positions > p - W.
"""

from __future__ import annotations

import math

import torch

from .verify_tree import tree_metadata_reference


def tree_attention_mask(prefix_lens, parents, S: int, num_nodes=None, sliding_window=None) -> torch.Tensor:
    """[B, N, S] bool: the dense mask the kernel never builds (used by tests and the HF check)."""
    B, N = parents.shape
    n = num_nodes.cpu().long() if num_nodes is not None else torch.full((B,), N, dtype=torch.long)
    meta = tree_metadata_reference(parents.cpu(), n)
    anc = meta.ancestor_mask
    bits = ((anc[:, :, None] >> torch.arange(N)) & 1).bool()  # [B, N, N]
    mask = torch.zeros(B, N, S, dtype=torch.bool)
    for b in range(B):
        p = int(prefix_lens[b])
        real = torch.arange(N) < int(n[b])
        mask[b, real, :p] = True
        mask[b, :, p : p + N] = bits[b, :, : min(N, S - p)] & real[:, None]
        if sliding_window is not None:
            depth = meta.depth[b].long()
            q_pos = p + depth - 1  # [N]
            k_pos = torch.arange(S)
            tree = (k_pos >= p) & (k_pos < p + N)
            k_pos = torch.where(tree, p + depth[(k_pos - p).clamp(0, N - 1)] - 1, k_pos)
            mask[b] &= k_pos[None, :] > q_pos[:, None] - int(sliding_window)
    return mask


def tree_attention_reference(
    q, k, v, prefix_lens, parents, *, num_nodes=None, scale=None, sliding_window=None
) -> torch.Tensor:
    """[B, Hq, N, D] in q's dtype, computed in fp64 on the CPU from the dense mask."""
    B, Hq, N, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    mask = tree_attention_mask(prefix_lens.cpu(), parents.cpu(), S, num_nodes, sliding_window)  # [B, N, S]
    qf, kf, vf = (t.detach().cpu().double() for t in (q, k, v))
    kf = kf.repeat_interleave(Hq // Hkv, dim=1)
    vf = vf.repeat_interleave(Hq // Hkv, dim=1)
    scores = torch.einsum("bhnd,bhsd->bhns", qf, kf) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padding rows: all -inf -> zeros
    # A NaN/inf value reaches exactly the rows that attend its key (not the others through 0 * NaN).
    good = vf.isfinite()
    poisoned = (mask[:, None] & ~good.all(-1)[:, :, None, :]).any(-1)  # [B, Hq, N]
    out = torch.einsum("bhns,bhsd->bhnd", weights, torch.where(good, vf, 0.0))
    out = out.masked_fill(poisoned[..., None], float("nan"))
    return out.to(q.dtype).to(q.device)
