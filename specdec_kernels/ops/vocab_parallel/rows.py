"""Row math on vocabulary shards, shared by the chain and the tree: sanitise, filter (global
thresholds) and exponentiate rows, look up probabilities at global ids, and the exponential race
whose winner is the (max key, lowest index) over ranks. float64, elementwise as the reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._params import MIN_TEMPERATURE, SamplingParams
from ...reference.philox import philox4x32_torch, uniform_open_torch
from ...reference.sampling import PURPOSE_ACCEPT, sanitize_probs
from .protocol import NEG_INF, NO_INDEX, Shard
from .selection import thresholds


def sanitize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits with NaN / +inf -> -inf, and whether each row held any."""
    x = x.to(torch.float32)
    bad = torch.isnan(x) | (x == float("inf"))
    return x.masked_fill(bad, NEG_INF), bad.any(-1)


def row_stats(shard: Shard, x: torch.Tensor, bad: torch.Tensor, extra: torch.Tensor | None) -> tuple:
    """Global (max, first argmax, any NaN / +inf) of rows x [R, V_r] (sanitised fp32; bad: the
    local flags), and the OR over ranks of the extra flags (another row set), in one all-gather."""
    R = x.shape[0]
    if shard.size:
        mx, first = x.max(-1)  # the first index of the max (documented for torch.max)
        first = first.double() + shard.offset
    else:
        mx = torch.full((R,), NEG_INF, device=x.device)
        first = torch.full((R,), NO_INDEX, dtype=torch.float64, device=x.device)
    rec = torch.stack([mx.double(), first, bad.double()], -1)
    extra = torch.zeros(0, dtype=torch.bool, device=x.device) if extra is None else extra
    allr, all_extra = shard.gather_many([rec, extra])  # [world, R, 3], [world, ...]
    gmax = allr[..., 0].max(0).values
    at_max = allr[..., 0] == gmax[None]
    argmax = torch.where(at_max, allr[..., 1], NO_INDEX).min(0).values.long()
    return gmax.float(), argmax, allr[..., 2].amax(0) > 0, all_extra.amax(0) > 0


def kept_weights(x, thr, gmax, temp) -> torch.Tensor:
    """exp((x - max) / T) on the kept entries (x >= thr, finite), 0 elsewhere: float64, computed
    as the reference does (x and max in float64, then / T, then exp)."""
    kept = (x >= thr[:, None]) & (x > NEG_INF)
    m = torch.where(gmax > NEG_INF, gmax.double(), torch.zeros_like(gmax, dtype=torch.float64))
    w = x.double()
    w.sub_(m[:, None]).div_(temp[:, None]).exp_()
    return w.masked_fill_(~kept, 0.0)


@dataclass
class Rows:
    """Processed rows on this shard: weights w (p = w / Z) and global stats."""

    w: torch.Tensor  # [R, V_r] float64
    Z: torch.Tensor  # [R] float64, global sum of w
    gmax: torch.Tensor  # [R] fp32 global max (greedy argmax value)
    argmax: torch.Tensor  # [R] int64 global first argmax
    bad: torch.Tensor  # [R] bool: NaN / +inf somewhere in the row
    at_ids: torch.Tensor  # [R, J] float64: p (or q) at the looked-up ids (0 where id < 0)

    @property
    def p(self) -> torch.Tensor:
        return self.p_rows(slice(None))

    def p_rows(self, idx) -> torch.Tensor:
        """p = w / Z of the rows idx (all zeros where nothing is kept; probabilities: Z = 1)."""
        Z = self.Z[idx]
        return self.w[idx] / torch.where(Z > 0, Z, torch.ones_like(Z))[:, None]

    @property
    def empty(self) -> torch.Tensor:
        return self.gmax == NEG_INF

    def take(self, rows: slice) -> Rows:
        return Rows(*(getattr(self, f)[rows] for f in ("w", "Z", "gmax", "argmax", "bad", "at_ids")))


def process_rows(shard: Shard, logits, params, sampled, ids, probs=None, probs_ids=None) -> tuple[Rows, Rows | None]:
    """Sanitise, filter (global thresholds) and exponentiate logit rows [R, V_r] and look up p at
    the global ids [R, J] (negative: none); optionally also draft-probability rows probs [Rq, V_r]
    (used as given) with their ids [Rq, Jq]. Both row sets share each collective.
    params: (temperature f64 [R], top_k int64 [R], top_p f64 [R]); sampled: [R] bool."""
    temp, top_k, top_p = params
    x, bad = sanitize(logits)
    q, q_bad = sanitize_probs(probs) if probs is not None else (None, None)
    gmax, argmax, bad, q_bad = row_stats(shard, x, bad, q_bad)
    if q is None and not bool(sampled.any()):  # greedy rows only need the argmax: no weights, no sums
        zeros = torch.zeros((), dtype=torch.float64, device=x.device)
        none = zeros.expand(x.shape[0])
        return Rows(zeros.expand(x.shape), none, gmax, argmax, bad, zeros.expand(ids.shape)), None
    t = torch.where(sampled, temp, torch.ones_like(temp))
    thr = thresholds(shard, x, gmax, t, top_k, top_p, sampled)
    w = kept_weights(x, thr, gmax, t)
    w.masked_fill_(~sampled[:, None], 0.0)
    local = torch.cat([w.sum(-1, keepdim=True), shard.lookup(w, ids.clamp(min=0))], -1)
    parts = [local] if q is None else [local, shard.lookup(q, probs_ids.clamp(min=0))]
    sums = shard.sum_many(parts)
    Z = sums[0][:, 0]
    at = sums[0][:, 1:] / torch.where(Z > 0, Z, torch.ones_like(Z))[:, None]
    rows = Rows(w, Z, gmax, argmax, bad, torch.where(ids >= 0, at, torch.zeros_like(at)))
    if q is None:
        return rows, None
    ones = torch.ones(q.shape[0], dtype=torch.float64, device=q.device)
    q_at = torch.where(probs_ids >= 0, sums[1], torch.zeros_like(sums[1]))
    return rows, Rows(q, ones, ones.float(), ones.long(), q_bad, q_at)


def draft_rows(shard: Shard, draft: Rows | None, ids, b, i, G: int) -> torch.Tensor:
    """q rows [R, V_r] float64 of the draft positions (b, i) [R]: the draft's rows (i clamped to
    G - 1: a bonus row has none), or one-hot at the global draft id ids[b, i] (draft None; its
    owner holds the 1, an id < 0 none)."""
    if draft is not None:
        return draft.p_rows(b * G + i.clamp(max=G - 1))
    q = torch.zeros((b.numel(), shard.size), dtype=torch.float64, device=ids.device)
    own, loc = shard.local(ids[b, i])
    if shard.size:
        q[own, loc[own]] = 1.0
    return q


def race_uniforms(seeds, rows, purposes, start: int, count: int) -> torch.Tensor:
    """[R, count] float32: the race uniforms of global vocab entries start .. start+count-1 for
    (seed, row, purpose) of each of the R rows, as ``reference.sampling.race_uniforms``."""
    R = seeds.shape[0]
    dev = seeds.device
    if count == 0:
        return torch.empty((R, 0), dtype=torch.float32, device=dev)
    b0, b1 = start // 4, (start + count - 1) // 4 + 1
    c0 = torch.arange(b0, b1, device=dev)[None, :]
    words = philox4x32_torch(seeds[:, None], c0, rows[:, None], purposes[:, None], 0)
    words = torch.stack(words, -1).reshape(R, -1)[:, start - 4 * b0 : start - 4 * b0 + count]
    return uniform_open_torch(words)


def _live_uniforms(live: torch.Tensor, seeds, rows, purposes, start: int) -> torch.Tensor:
    """float64 race uniforms [R, V_r] where ``live`` (an entry with weight 0 loses whatever its
    number: 0.5 stands in). Sparse rows (top-k / top-p keep few entries) draw Philox for their live
    entries only (one block per entry) instead of one block per 4 entries of the shard."""
    R, count = live.shape
    n_live = int(live.sum())
    if 4 * n_live >= R * count:  # dense: every block once
        return race_uniforms(seeds, rows, purposes, start, count).double()
    u = torch.full((R, count), 0.5, dtype=torch.float64, device=live.device)
    if n_live:
        r, c = live.nonzero(as_tuple=True)
        x = c + start
        words = torch.stack(philox4x32_torch(seeds[r], x // 4, rows[r], purposes[r], 0), -1)
        u[r, c] = uniform_open_torch(words.gather(1, (x % 4)[:, None])[:, 0]).double()
    return u


def accept_uniforms(seeds, c0, rows) -> torch.Tensor:
    """float64 accept-test uniforms of counters (c0, row, ACCEPT, 0), as ``reference.sampling.uniforms``."""
    bits, _, _, _ = philox4x32_torch(seeds, c0, rows, PURPOSE_ACCEPT, 0)
    return uniform_open_torch(bits).double()


def race(shard: Shard, log_ws: list[torch.Tensor], seeds, rows, purposes) -> list[torch.Tensor]:
    """Global exponential-race winners (lowest index on exact ties; -1 when every weight is 0) of
    each log-weight tensor [R, V_r] in ``log_ws``; all share the uniforms of (seed, row, purpose)."""
    R = seeds.shape[0]
    dev = seeds.device
    live = torch.zeros((R, shard.size), dtype=torch.bool, device=dev)
    for lw in log_ws:
        live |= lw > NEG_INF
    u = _live_uniforms(live, seeds, rows, purposes, shard.offset)
    noise = torch.log(-torch.log(u))
    recs = []
    for lw in log_ws:
        keys = lw.double() - noise
        keys = torch.where(torch.isnan(keys), torch.full_like(keys, NEG_INF), keys)
        if shard.size:
            best, idx = keys.max(-1)  # the first index of the max (documented for torch.max)
            idx = idx.double() + shard.offset
        else:
            best = torch.full((R,), NEG_INF, dtype=torch.float64, device=dev)
            idx = torch.full((R,), NO_INDEX, dtype=torch.float64, device=dev)
        recs += [best, idx]
    allr = shard.gather(torch.stack(recs, -1).to(shard.device)).to(dev)  # [world, R, 2 * len]
    out = []
    for i in range(len(log_ws)):
        best = allr[..., 2 * i].max(0).values
        idx = torch.where(allr[..., 2 * i] == best[None], allr[..., 2 * i + 1], NO_INDEX).min(0).values.long()
        out.append(torch.where(best > NEG_INF, idx, torch.full_like(idx, -1)))
    return out


def request_params(sampling: SamplingParams, B: int, device):
    """Per-request (temperature f64, top_k, top_p f64, seed, greedy) [B] on ``device``."""
    pr = sampling.per_request_cpu(B)
    temp = pr["temperature"].double().to(device)
    greedy = ~(temp >= MIN_TEMPERATURE)
    return temp, pr["top_k"].to(device), pr["top_p"].double().to(device), pr["seed"].to(device), greedy


def row_min(x: torch.Tensor, empty: int) -> torch.Tensor:
    """Minimum of each row of x [R, C]; ``empty`` when C = 0 (no drafts / no tree nodes)."""
    if x.shape[1] == 0:
        return torch.full((x.shape[0],), empty, dtype=x.dtype, device=x.device)
    return x.min(1).values
