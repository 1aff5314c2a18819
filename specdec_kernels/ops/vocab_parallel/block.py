"""Block verification on vocabulary shards (``method="block"``): ``reference/block.py`` for the
sampled requests of a chain, after ``chain.verify_chain_sharded`` has run the rows' collectives.

The weights w_i = min(w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i), 1) come from the drafts' target and
draft probabilities, which every rank holds after the chain's softmax all-reduce (replicated). The
residual masses r_i = sum_x max(w_i p_i(x) - q_i(x), 0) of the positions 1 <= i < n are sums over
the vocabulary: each rank sums its shard, and one all-reduce of every such row of the batch gives
them. A position whose uniform eta_i exceeds w_i is not summed: h_i = r_i / (r_i + 1 - w_i) <= w_i
(r_i <= w_i), so it cannot stop. Then tau = the last i with eta_i <= h_i (h_n = w_n), and the chain
races row tau over max(w_tau p_tau - q_tau, 0) as the token rule races its rejected row. Which rows
are summed depends on replicated values only: every rank runs the same collective.
"""

from __future__ import annotations

import torch

from ..vectorized.block import stop_weights
from .protocol import Shard
from .rows import Rows, draft_rows


def residual_masses(shard: Shard, target: Rows, draft: Rows | None, ids, w, need) -> torch.Tensor:
    """r_i [B, G] float64 at the positions ``need`` [B, G] (replicated; 0 elsewhere): this shard's
    sums of max(w_i p_i - q_i, 0) over its entries, all rows of the batch in one all-reduce."""
    B, G = need.shape
    r = torch.zeros((B, G), dtype=torch.float64, device=w.device)
    b, i = need.nonzero(as_tuple=True)
    if b.numel() == 0:  # replicated: no rank runs the collective
        return r
    p = target.p_rows(b * (G + 1) + i)
    q = draft_rows(shard, draft, ids, b, i, G)
    local = torch.clamp(w[b, i][:, None] * p - q, min=0).sum(-1)
    r[b, i] = shard.sum_many([local])[0]
    return r


def sharded_block_tau(shard: Shard, target: Rows, draft: Rows | None, ids, p_tok, q_tok, eta, n, sampled):
    """(tau [B], w [B, G+1]) of block verification for the ``sampled`` requests (tau 0 elsewhere).

    target / draft: the chain's processed rows (draft None: one-hot drafts at ``ids`` [B, G+1]);
    p_tok / q_tok [B, G+1]: p and q at the drafts (replicated); eta [B, G+1]: the token rule's
    accept uniforms (eta of position i is column i - 1); n [B]: the draft counts."""
    G = p_tok.shape[1] - 1
    w = stop_weights(p_tok[:, :G], q_tok[:, :G])
    pos = torch.arange(1, G + 1, device=w.device)[None, :]  # positions 1 .. G
    reach = sampled[:, None] & (pos <= n[:, None])
    eta = eta[:, :G]
    # r_i of the positions 1 <= i < n that can stop (eta_i <= w_i): rows i, column i of need
    need = torch.zeros_like(reach)
    need[:, 1:] = (reach & (pos < n[:, None]) & (eta <= w[:, 1:]))[:, :-1]
    r = residual_masses(shard, target, draft, ids, w, need)[:, 1:]
    h = torch.where(r > 0, r / (r + 1.0 - w[:, 1:G]), torch.zeros_like(r))
    stops = torch.cat([h, torch.zeros_like(h[:, :1])], 1)  # stop probability of positions 1 .. G
    stops = torch.where(pos == n[:, None], w[:, 1:], stops)  # h_n = w_n
    stop = reach & (eta <= stops)
    tau = torch.where(stop, pos, torch.zeros_like(pos)).amax(1) if G else n.new_zeros(n.shape)
    return tau, w
