"""The plain-PyTorch pipelines engines run today, which the microbenchmarks compare against.

* Chain verification (``bench_verify.py``'s ``eager`` provider): temperature scaling, softmax to
  full probability tensors for target and draft, sort-based top-k/top-p masking (``torch.sort`` +
  ``cumsum``), gather p(x)/q(x), compare with ``torch.rand``, first rejection via ``cumprod``,
  residual ``max(p - q, 0)`` normalised and sampled with ``torch.multinomial``, bonus sampled from
  p. Vectorised, no per-request loop.
* Tree masks (``bench_tree_attention.py``): the dense ancestor-or-self mask Hugging Face, EAGLE and
  Medusa build for SDPA, and the same tree as a flex_attention ``BlockMask``.
"""

from __future__ import annotations

import torch

# --------------------------------------------------------------------------------------------
# Eager chain verification
# --------------------------------------------------------------------------------------------


def mask_top_k_top_p(logits, top_k: int, top_p: float):
    """Set logits outside top-k, then outside the top-p nucleus, to -inf (sort-based, as engines do)."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if 0 < top_k < V:
        kth_largest = sorted_logits[..., V - top_k : V - top_k + 1]
        drop = sorted_logits < kth_largest
    if top_p < 1.0:
        # Ascending order: the tail whose total mass is <= 1 - top_p is what the nucleus leaves out.
        cum = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
        drop = drop | (cum <= 1.0 - top_p)
        drop[..., -1] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def probs_from_logits(logits, temperature: float, top_k: int, top_p: float):
    """fp32 probabilities of the processed distribution: temperature, top-k, top-p, softmax."""
    x = logits.float() / temperature
    if top_k > 0 or top_p < 1.0:
        x = mask_top_k_top_p(x, top_k, top_p)
    return x.softmax(dim=-1)


def _assemble_tokens(draft_tokens, accepted_prefix, emitted):
    """[B, G+1]: accepted drafts, the emitted token at index num_accepted, then -1."""
    B, G = draft_tokens.shape
    num_accepted = accepted_prefix.sum(dim=1)
    tokens = torch.full((B, G + 1), -1, dtype=torch.int64, device=draft_tokens.device)
    tokens[:, :G] = torch.where(accepted_prefix.bool(), draft_tokens, -1)
    tokens.scatter_(1, num_accepted.view(B, 1), emitted.view(B, 1))
    return tokens, num_accepted.to(torch.int32)


def eager_verify_greedy(target_logits, draft_tokens):
    target_argmax = target_logits.argmax(dim=-1)  # [B, G+1]
    G = draft_tokens.shape[1]
    accepted_prefix = (draft_tokens == target_argmax[:, :G]).long().cumprod(dim=1)
    num_accepted = accepted_prefix.sum(dim=1)
    emitted = target_argmax.gather(1, num_accepted.view(-1, 1))
    return _assemble_tokens(draft_tokens, accepted_prefix, emitted)


def eager_verify(target_logits, draft_tokens, draft_logits=None, *, temperature=1.0, top_k=0, top_p=1.0):
    """Standard rejection-sampling verification with full probability tensors. Returns (tokens, num_accepted)."""
    if temperature == 0.0:
        return eager_verify_greedy(target_logits, draft_tokens)
    B, G = draft_tokens.shape
    V = target_logits.shape[-1]
    target_probs = probs_from_logits(target_logits, temperature, top_k, top_p)  # [B, G+1, V]
    p_rows = target_probs[:, :G]
    index = draft_tokens.unsqueeze(-1)
    p_x = p_rows.gather(-1, index).squeeze(-1)
    if draft_logits is None:  # one-hot q: q(x) = 1, residual = p without x
        q_x = torch.ones_like(p_x)
        residual = p_rows.clone().scatter_(-1, index, 0.0)
    else:
        draft_probs = probs_from_logits(draft_logits, temperature, top_k, top_p)
        q_x = draft_probs.gather(-1, index).squeeze(-1)
        residual = (p_rows - draft_probs).clamp_min_(0.0)

    u = torch.rand((B, G), device=target_logits.device)
    accepted_prefix = (u * q_x <= p_x).long().cumprod(dim=1)
    num_accepted = accepted_prefix.sum(dim=1)

    total = residual.sum(dim=-1, keepdim=True)
    # A row with p <= q everywhere is never rejected, but multinomial refuses all-zero rows:
    # give those rows a dummy unit mass that is never used.
    residual[..., :1] += (total == 0).to(residual.dtype)
    residual /= total.clamp_min_(torch.finfo(residual.dtype).tiny)
    recovered = torch.multinomial(residual.view(B * G, V), 1).view(B, G)
    bonus = torch.multinomial(target_probs[:, G], 1).view(B)

    first_rejection = num_accepted.clamp(max=G - 1).view(B, 1)
    emitted = torch.where(num_accepted == G, bonus, recovered.gather(1, first_rejection).view(B))
    return _assemble_tokens(draft_tokens, accepted_prefix, emitted)


# --------------------------------------------------------------------------------------------
# Tree masks
# --------------------------------------------------------------------------------------------


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool: [b, n, j] iff node j is node n or one of its ancestors (parents come first)."""
    B, N = parents.shape
    anc = torch.eye(N, dtype=torch.bool).repeat(B, 1, 1)
    rows = torch.arange(B)
    for n in range(N):
        p = parents[:, n]
        inherited = anc[rows, p.clamp(min=0)] & (p >= 0)[:, None]  # the parent's row is complete
        anc[:, n] |= inherited
    return anc


def key_and_query_positions(parents: torch.Tensor, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, prefix + N] key positions, [B, N] query positions): prefix key s at s, node n at
    prefix + depth(n) - 1 (depth = size of its ancestor-or-self set)."""
    B, N = parents.shape
    node_pos = prefix + ancestor_matrix(parents).sum(-1) - 1
    keys = torch.cat([torch.arange(prefix).expand(B, prefix), node_pos], dim=1)
    return keys, node_pos


def dense_tree_mask(parents: torch.Tensor, prefix: int, device: str, window: int | None = None) -> torch.Tensor:
    """[B, 1, N, prefix + N] bool, True = may attend: ones over the prefix, the tree matrix after it
    (and, with a sliding window, only keys at positions > the query's - window)."""
    B, N = parents.shape
    tree = ancestor_matrix(parents)
    mask = torch.cat([torch.ones(B, N, prefix, dtype=torch.bool), tree], dim=-1)
    if window is not None:
        keys, queries = key_and_query_positions(parents, prefix)
        mask &= keys[:, None, :] > queries[:, :, None] - window
    return mask[:, None].to(device)


def flex_block_mask(parents: torch.Tensor, prefix: int, Hq: int, device: str, window: int | None = None):
    """A BlockMask for the tree: keys < prefix always, tree key prefix + j iff j is an ancestor-or-self
    (with a sliding window: and the key's position > the query's - window)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, N = parents.shape
    tree = ancestor_matrix(parents.cpu()).to(device)  # [B, N, N]
    key_pos, query_pos = (t.to(device) for t in key_and_query_positions(parents.cpu(), prefix))

    def mask_mod(b, h, q_idx, kv_idx):
        j = (kv_idx - prefix).clamp(0, N - 1)
        allowed = (kv_idx < prefix) | tree[b, q_idx, j]
        if window is None:
            return allowed
        return allowed & (key_pos[b, kv_idx] > query_pos[b, q_idx] - window)

    return create_block_mask(mask_mod, B, None, N, prefix + N, device=device)
