"""Random token trees with genuinely sampled drafts, shared by the tree tests."""

from __future__ import annotations

import torch


def tree_parents(shape: str, N: int, gen: torch.Generator) -> torch.Tensor:
    """[N] parents: 'chain', 'star', or 'random' (each node under a random earlier node or the root)."""
    i = torch.arange(N)
    if shape == "chain":
        return i - 1
    if shape == "star":
        return torch.full((N,), -1)
    parents = torch.empty(N, dtype=torch.int64)
    for n in range(N):
        parents[n] = int(torch.randint(-1, n, (1,), generator=gen)) if n > 0 else -1
    return parents


def make_tree_problem(
    B,
    N,
    V,
    *,
    shape="random",
    dtype=torch.float32,
    device="cpu",
    seed=0,
    closeness=0.6,
    without_replacement=False,
    num_nodes=None,
):
    """target [B, N+1, V], tokens [B, N], parents [B, N], draft logits [B, N, V].

    Every position (root or node) has its own target and draft rows; node i's draft row is the
    draft row of its parent position, and siblings are sampled from it (with or without
    replacement), so the trees are what a real drafter would produce, duplicates included.
    """
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(B, N + 1, V, generator=gen) * 2.0
    draft_at = target + torch.randn(B, N + 1, V, generator=gen) * 2.0 * closeness  # per position
    parents = torch.stack([tree_parents(shape, N, gen) for _ in range(B)])
    tokens = torch.zeros(B, N, dtype=torch.int64)
    draft = torch.zeros(B, N, V)
    for b in range(B):
        for pos in range(-1, N):
            kids = (parents[b] == pos).nonzero().flatten()
            if kids.numel() == 0:
                continue
            q = torch.softmax(draft_at[b, pos + 1], dim=-1)
            wor = without_replacement and kids.numel() <= V
            tokens[b, kids] = torch.multinomial(q, kids.numel(), replacement=not wor, generator=gen)
            draft[b, kids] = draft_at[b, pos + 1]
    if num_nodes is not None:  # ragged: padding nodes get junk that must be ignored
        pad = torch.arange(N)[None, :] >= num_nodes[:, None]
        tokens = torch.where(pad, torch.full_like(tokens, 10**6), tokens)
        parents = torch.where(pad, torch.full_like(parents, 99), parents)
    to = lambda t: t.to(device)  # noqa: E731
    return to(target.to(dtype)), to(tokens), to(parents), to(draft.to(dtype))
