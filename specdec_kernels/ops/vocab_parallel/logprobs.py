"""Logprobs of the emitted tokens on vocabulary shards (``return_logprobs=True`` with
``process_group=``): the scorer that ``ops/logprobs.py``'s post-pass calls on this rank's shard of
the emitted rows. Rows, positions and results are those of the unsharded call.

Collectives per call (every rank runs the same ones: the emitted positions are replicated): the
row stats' all-gather (global max), the thresholds of ``selection`` (top-k / top-p), one
all-reduce of the normaliser with the owner's logit at the emitted token folded in, and with
``num_logprobs=n`` one all-gather of every rank's top-n (value, global id), merged by value, ties
by lower id.
"""

from __future__ import annotations

import torch

from ..logprobs import top_n
from .protocol import NEG_INF, Shard
from .rows import kept_weights, row_stats, sanitize
from .selection import thresholds


def sharded_scorer(shard: Shard):
    """``emitted_logprobs`` of ``ops/logprobs.py`` for this rank's shard of the rows (global ids)."""

    def score(rows, tok, t, top_k, top_p, filtered, by_index, n):
        # filtered: thresholds finds the rows without filters itself. by_index: sampled requests are
        # refused before any work (check_sharded_ties); greedy ones reach here, scored with top-p at
        # temperature 1, where the rule matters. top_p is replicated: every rank raises.
        if by_index and bool((top_p < 1.0).any()):
            raise ValueError(
                "top_p_ties='by_index' is not implemented for vocabulary shards (process_group=) yet: the "
                "logprobs of greedy requests apply top-p"
            )
        x, bad = sanitize(rows)
        gmax, _, _, _ = row_stats(shard, x, bad, None)
        everyone = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        thr = thresholds(shard, x, gmax, t, top_k, top_p, everyone)
        kept_x = torch.where((x >= thr[:, None]) & (x > NEG_INF), x, NEG_INF)
        w = kept_weights(x, thr, gmax, t)
        at_tok = shard.lookup(kept_x.double(), tok[:, None])[:, 0]  # the owner's kept logit, 0 elsewhere
        z, x_tok = shard.sum_many([w.sum(-1), at_tok])
        empty = gmax == NEG_INF
        m = torch.where(empty, 0.0, gmax.double())
        log_z = torch.log(z)
        lp = ((x_tok - m) / t - log_z).masked_fill(empty, float("nan")).float()
        if n == 0:
            return lp, None, None
        vals, ids = top_n(kept_x, n)
        vals_all, ids_all = shard.gather_many([vals.double(), (ids + shard.offset).double()])  # [world, M, n]
        M = x.shape[0]
        merged = vals_all.permute(1, 0, 2).reshape(M, -1)  # rank order: ties at equal values by lower id
        best, at = top_n(merged, n)
        ids = ids_all.permute(1, 0, 2).reshape(M, -1).gather(1, at).long()
        top = ((best - m[:, None]) / t[:, None] - log_z[:, None]).float()
        absent = (best == NEG_INF) | empty[:, None]
        return lp, ids.masked_fill(absent, -1), top.masked_fill(absent, float("nan"))

    return score
