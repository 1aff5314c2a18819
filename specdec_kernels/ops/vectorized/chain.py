"""Chain verification as batched PyTorch tensor ops: the ``backend="vectorized"`` path.

What ``backend="auto"`` runs on CPU tensors when the csrc CPU build cannot be compiled (no C++
compiler): the same tokens as the reference (``reference/verify.py``) for the same seeds, without
its Python loop over requests. Every step works on all requests at once; the loops are over the G+1
positions (a row's statistics are computed only for the requests whose drafts reach it), the
rounds of Philox, blocks of rows that keep float64 buffers in cache, and the widenings of top-p's
partial sort.

It follows the reference step by step, in float64 where the reference is float64:

* logits are read as fp32 with NaN / +inf -> -inf (flagged; found by the row max, which NaN and
  +inf poison, so clean rows are never copied); draft probabilities as float64 with NaN / +inf /
  negative -> 0 (flagged);
* greedy: the first index of the row max (``torch.max``), the first mismatch by a cumulative product;
* top-k: the k-th largest finite logit (``torch.topk``, ties kept); top-p: the first position of
  the descending cumulative mass reaching ``top_p`` times the total, found on a partial sort that
  widens until it holds that position (the whole row is never sorted unless it must be); with
  ``top_p_ties="by_index"`` only the highest-index entries of the boundary tie group up to that
  position stay (a count from the prefix, then one pass over the rows that use top-p: ``_tie_cut``);
* p(x) = exp((x - max) / T) / Z over the kept entries (Z from the sorted prefix when it holds every
  kept entry, else one pass over the row); the accept test u * q(x) <= p(x) with u from
  Philox(seed; 0, i, ACCEPT), position by position;
* the recovered / bonus token: the exponential race over row j with the uniforms of
  Philox(seed; x // 4, j, RECOVER | BONUS) word x % 4 (only at the entries with positive weight
  when they are few, as after top-k), keys log w(x) - log(-log u_x), lowest index on ties; an
  empty residual falls back to p with the same uniforms.

Random numbers come from the reference's Philox (``reference/philox.py``): its torch generator on
int64 tensors, or its NumPy one for a few counters. Plain tensor code (devices follow the inputs),
but tested on CPU tensors only, and ``auto`` uses it only for CPU tensors. Tree / multi-draft
verification: ``tree.py``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from ..._params import MIN_TEMPERATURE
from ..._types import DRAFT_LOGITS, DRAFT_PROBS, VerifyOutput
from ..._validation import VerifyArgs
from ...reference.philox import philox4x32, philox4x32_torch, uniform_open_torch
from ...reference.sampling import PURPOSE_ACCEPT, PURPOSE_BONUS, PURPOSE_RECOVER

_TOP_P_FIRST_WIDTH = 256  # entries of the first partial sort for top-p (doubled until enough)
_SPARSE_RACE = 0.25  # race only over the positive entries when they are at most this fraction
_BLOCK = 1 << 18  # entries per block of the float64 passes (a block's buffer stays in cache)
_PHILOX_BLOCK = 1 << 15  # counters per block of Philox (its int64 temporaries stay in cache)
_NUMPY_PHILOX = 1 << 12  # up to this many counters the reference's NumPy Philox (the same bits) is cheaper


# --------------------------------------------------------------------------------------------
# random numbers


def philox(seed: Tensor, c0: Tensor, c1: Tensor, c2: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-10 words (int64 in [0, 2**32)) of counters (c0, c1, c2, 0) under the 64-bit
    ``seed``; int64 tensors that broadcast. The reference's generators: its NumPy one for a few
    counters on the CPU (less overhead per call), else its torch one (``philox4x32_torch``)."""
    shape = torch.Size(np.broadcast_shapes(seed.shape, c0.shape, c1.shape, c2.shape))
    if seed.device.type == "cpu" and math.prod(shape) <= _NUMPY_PHILOX:
        words = philox4x32(*(v.numpy() for v in (seed, c0, c1, c2)), 0)
        return tuple(torch.from_numpy(w.astype(np.int64)).reshape(shape) for w in words)
    return philox4x32_torch(seed, c0, c1, c2, 0)


def race_noise_dense(seed: Tensor, row: Tensor, purpose: Tensor, V: int) -> Tensor:
    """log(-log u_x) [R, V] (float64) for every vocabulary entry x of R rows: u_x is word x % 4 of
    Philox(seed; x // 4, row, purpose). One Philox call per quad of entries, in blocks of quads
    small enough for Philox's int64 temporaries to stay in cache. seed, row, purpose: [R]."""
    R, Q = seed.shape[0], (V + 3) // 4
    out = torch.empty((R, 4 * Q), dtype=torch.float64, device=seed.device)
    per_block = max(256, _PHILOX_BLOCK // max(R, 1))
    for start in range(0, Q, per_block):
        quads = torch.arange(start, min(Q, start + per_block), device=seed.device, dtype=torch.int64)
        words = philox(seed[:, None], quads[None, :], row[:, None], purpose[:, None])
        u = uniform_open_torch(torch.stack(words, -1).reshape(R, -1)).to(torch.float64)
        out[:, 4 * start : 4 * start + u.shape[1]] = u.log_().neg_().log_()
    return out[:, :V]


def race_noise_at(seed: Tensor, x: Tensor, row: Tensor, purpose: Tensor) -> Tensor:
    """log(-log u_x) (float64) at given entries: seed, x, row, purpose are equal-length [M]."""
    words = philox(seed, x >> 2, row, purpose)
    lane = x & 3
    bits = torch.where(lane == 0, words[0], words[1])
    bits = torch.where(lane == 2, words[2], bits)
    bits = torch.where(lane == 3, words[3], bits)
    return torch.log(-torch.log(uniform_open_torch(bits).to(torch.float64)))


# --------------------------------------------------------------------------------------------
# logit processing (batched rows [R, V]; per-row temperature, top_k, top_p)


def sanitize(raw: Tensor, with_index: bool = False):
    """(fp32 logits with NaN / +inf -> -inf, [rows] whether a row had any, row max, and with_index
    the first index of the row max). The max propagates NaN and is +inf at +inf, so it finds the
    rows to clean: clean inputs are read once (the max), never copied."""
    x = raw.to(torch.float32)
    if with_index:
        m, idx = torch.max(x, dim=-1)  # the first index among equal maxima
    else:
        m, idx = x.amax(-1), None
    row_bad = ~(m < float("inf"))
    if bool(row_bad.any()):
        rows = row_bad.nonzero(as_tuple=True)
        x = x.clone() if x is raw else x  # never write into the caller's tensor
        clean = x[rows]
        clean.masked_fill_(~(clean < float("inf")), float("-inf"))
        x[rows] = clean
        if with_index:
            m[rows], idx[rows] = torch.max(clean, dim=-1)
        else:
            m[rows] = clean.amax(-1)
    return x, row_bad, m, idx


def usable_probs(q: Tensor) -> Tensor:
    """float64 draft probabilities with NaN / +inf / negative -> 0 (no probability)."""
    q = q.to(torch.float64, copy=True)
    return q.masked_fill_(~((q >= 0) & (q < float("inf"))), 0.0)


def unusable_prob_rows(q: Tensor) -> Tensor:
    """[rows] whether a draft_probs row holds NaN, +inf or a negative value."""
    return ~((q >= 0) & (q < float("inf"))).all(-1)


def _weights(x: Tensor, thr: Tensor, m: Tensor, t: Tensor, cut: Tensor | None = None) -> Tensor:
    """float64 exp((x - m) / T) at the kept entries (x >= thr, finite, and where x == thr an index
    >= cut), 0 elsewhere.

    x [..., V]; thr, m (a finite row max), t, cut (int64; None or 0: the whole tie group): [...].
    One float64 buffer, updated in place."""
    w = x.to(torch.float64)
    w.sub_(m[..., None]).div_(t[..., None]).exp_()  # exp(-inf) = 0: -inf logits need no mask
    if bool((thr > float("-inf")).any()):
        w.masked_fill_(x < thr[..., None], 0.0)
    if cut is not None and bool((cut > 0).any()):
        index = torch.arange(x.shape[-1], device=x.device)
        w.masked_fill_((x == thr[..., None]) & (index < cut[..., None]), 0.0)
    return w


def _kept_at(x_at: Tensor, index: Tensor, thr: Tensor, cut: Tensor) -> Tensor:
    """Whether entries with logits x_at at vocabulary indices ``index`` are kept ([M] each)."""
    return (x_at > float("-inf")) & ((x_at > thr) | ((x_at == thr) & (index >= cut)))


def _complete(vals: Tensor, thr: Tensor, V: int) -> Tensor:
    """[r] whether a descending prefix vals [r, w] of each row holds every kept entry (>= thr)."""
    if vals.shape[1] >= V:
        return torch.ones(vals.shape[0], dtype=torch.bool, device=vals.device)
    last = vals[:, -1]
    return (last < thr) | (last == float("-inf"))


def _row_stats(x: Tensor, m: Tensor, t: Tensor, top_k: Tensor, top_p: Tensor, filtered: bool, by_index=False):
    """(thresholds [R], normalisers Z [R] float64, tie cuts [R] int64) of sanitised fp32 rows x
    [R, V] with row max m (0 for rows with nothing finite), temperature t and top_p float64, top_k
    int64 (all [R]). by_index: the reference's ``top_p_ties="by_index"`` (``kept_entries``): an
    entry equal to the threshold is kept only from index cut on; else cut = 0.

    The threshold is the reference's ``filter_threshold`` (keep x >= thr; -inf: nothing filtered):
    the k-th largest finite logit (ties kept), then the kept logit at the first position of the
    descending cumulative mass reaching top_p * the total. Z = sum of exp((x - m) / T) over the kept
    entries: from the descending prefix (``topk``) when it holds all of them, else one pass over V."""
    R, V = x.shape
    thr = torch.full((R,), float("-inf"), dtype=torch.float32, device=x.device)
    z = torch.zeros(R, dtype=torch.float64, device=x.device)
    known = torch.zeros(R, dtype=torch.bool, device=x.device)
    cut = torch.zeros(R, dtype=torch.int64, device=x.device)
    if filtered:
        use_k = (top_k > 0) & (top_k < V)
        use_p = top_p < 1.0
        rows = (use_k | use_p).nonzero().squeeze(1)
        if rows.numel() > 0:
            thr[rows], z[rows], known[rows], count = _filtered_stats(
                _take(x, rows), m[rows], t[rows], top_k[rows], top_p[rows], use_k[rows], use_p[rows], by_index
            )
            if by_index:
                tied = (count >= 0).nonzero().squeeze(1)
                if tied.numel() > 0:
                    cut[rows[tied]] = _tie_cut(_take(x, rows[tied]), thr[rows[tied]], count[tied])
    if not bool(known.all()):
        rows = (~known).nonzero().squeeze(1)
        z[rows] = _exp_sums(x, rows, thr[rows], m[rows], t[rows])
    return thr, z, cut


def _tie_cut(x: Tensor, thr: Tensor, count: Tensor) -> Tensor:
    """[r] the lowest index among the ``count`` highest-index entries equal to thr of rows x [r, V]
    (0 when the count covers the whole tie group)."""
    tied = x == thr[:, None]
    from_right = tied.flip(-1).cumsum(-1).flip(-1)  # tied entries at this index or above
    cut = (tied & (from_right == count[:, None])).to(torch.int8).argmax(-1)
    return torch.where(count >= from_right[:, 0], 0, cut)


def _take(x: Tensor, rows: Tensor) -> Tensor:
    """x[rows] (no copy when rows are all of x's rows, in order)."""
    return x if rows.numel() == x.shape[0] else x[rows]


def _exp_sums(x: Tensor, rows: Tensor, thr: Tensor, m: Tensor, t: Tensor) -> Tensor:
    """Sum over the kept entries of exp((x - m) / T) (float64) of the rows ``rows`` of x [R, V];
    thr, m, t are those rows' values. In blocks of rows whose float64 buffer stays in cache."""
    per_block = max(1, _BLOCK // max(x.shape[1], 1))
    if rows.numel() <= per_block:
        return _weights(_take(x, rows), thr, m, t).sum(-1)
    parts = []
    for start in range(0, rows.numel(), per_block):
        sl = slice(start, start + per_block)
        block = x[rows[sl]] if rows.numel() < x.shape[0] else x[sl]
        parts.append(_weights(block, thr[sl], m[sl], t[sl]).sum(-1))
    return torch.cat(parts)


def _filtered_stats(x, m, t, top_k, top_p, use_k, use_p, by_index):
    """(thr, Z, Z known, count) of rows with top-k and / or top-p; see ``_row_stats``. count
    (by_index): entries of the boundary tie group kept, -1 for rows without top-p."""
    r, V = x.shape
    width = min(V, int(top_k[use_k].max())) if bool(use_k.any()) else min(V, _TOP_P_FIRST_WIDTH)
    vals = torch.topk(x, width, dim=-1).values  # descending
    # fewer than k finite logits: the k-th is -inf, which filters nothing (as the reference)
    kth = vals.gather(1, (top_k.clamp(1, width) - 1)[:, None]).squeeze(1)
    thr = torch.where(use_k, kth, torch.full_like(kth, float("-inf")))
    wts = _weights(vals, thr, m, t)
    z = wts.sum(-1)
    known = _complete(vals, thr, V)
    count = torch.full_like(top_k, -1)
    rows = use_p.nonzero().squeeze(1)
    if rows.numel() > 0:
        x_p, args = _take(x, rows), (vals[rows], thr[rows], m[rows], t[rows], top_p[rows], by_index)
        thr[rows], z[rows], known[rows], count[rows] = _top_p(x_p, *args)
    return thr, z, known, count


def _top_p(x, vals, thr, m, t, top_p, by_index):
    """top-p on rows cut at thr (top-k, or -inf): (thr, Z, Z known, count) given a descending
    prefix vals. by_index: count = the boundary tie group's entries kept (those up to the cut
    position: the mass before each is < the goal) and Z their prefix mass; else count = -1.

    The reference sorts the kept logits, takes the float64 cumulative mass of exp((x - max) / T)
    and keeps the prefix up to its first position reaching top_p * the total. Here the prefix widens
    (``topk``, 4x each time) until it holds that position; the total is the prefix's own when it
    holds every kept entry (then every number is the reference's), else one pass over the row."""
    r, V = x.shape
    out_thr, out_z = thr.clone(), torch.zeros(r, dtype=torch.float64, device=x.device)
    out_known = torch.zeros(r, dtype=torch.bool, device=x.device)
    out_count = torch.full((r,), -1, dtype=torch.int64, device=x.device)
    live = vals[:, 0] > float("-inf")  # rows with nothing finite keep their threshold
    total = torch.full((r,), float("nan"), dtype=torch.float64, device=x.device)
    incomplete = (~_complete(vals, thr, V)) & live
    if bool(incomplete.any()):
        rows = incomplete.nonzero().squeeze(1)
        total[rows] = _exp_sums(x, rows, thr[rows], m[rows], t[rows])
    pending = live.nonzero().squeeze(1)
    vals = vals if pending.numel() == r else vals[pending]
    while pending.numel() > 0:
        th = thr[pending]
        wts = _weights(vals, th, m[pending], t[pending])
        mass = torch.cumsum(wts, -1)
        complete = _complete(vals, th, V)
        goal = top_p[pending] * torch.where(complete, mass[:, -1], total[pending])
        done = complete | (mass[:, -1] >= goal)
        kept = ((vals >= th[:, None]) & (vals > float("-inf"))).sum(-1)
        first = torch.minimum((mass < goal[:, None]).sum(-1), kept - 1).clamp(min=0)  # searchsorted, left
        new_thr = vals.gather(1, first[:, None]).squeeze(1)
        finished = pending[done]
        if by_index:  # the prefix up to `first` is exactly the kept set (it lies within vals)
            z = mass.gather(1, first[:, None]).squeeze(1)
            out_count[finished] = (first + 1 - (vals > new_thr[:, None]).sum(-1))[done]
            out_known[finished] = True
        else:
            z = (wts * (vals >= new_thr[:, None])).sum(-1)
            out_known[finished] = _complete(vals, new_thr, V)[done]
        out_thr[finished], out_z[finished] = new_thr[done], z[done]
        pending = pending[~done]
        if pending.numel() > 0:
            width = min(V, vals.shape[1] * 4)
            vals = torch.topk(_take(x, pending), width, dim=-1).values
    return out_thr, out_z, out_known, out_count


class _Rows:
    """The processed distributions of the rows x[b, i] of a sanitised fp32 stack x [B, R, V] with
    row maxima m [B, R] and per-request temperature, top_k, top_p [B]: threshold, max and
    normaliser of each row (the reference's ``processed_probs``), computed by :meth:`fill` only for
    the rows a verification reaches."""

    def __init__(self, x: Tensor, m: Tensor, t: Tensor, top_k: Tensor, top_p: Tensor, filtered: bool, by_index=False):
        self.x, self.t, self.top_k, self.top_p, self.filtered = x, t, top_k, top_p, filtered
        self.by_index = by_index
        self.empty = m == float("-inf")  # nothing to sample: p = 0 everywhere
        self.m = m.masked_fill(self.empty, 0.0)
        self.thr = torch.full(m.shape, float("-inf"), dtype=torch.float32, device=x.device)
        self.z = torch.ones(m.shape, dtype=torch.float64, device=x.device)
        self.cut = torch.zeros(m.shape, dtype=torch.int64, device=x.device)

    def rows(self, b: Tensor, i) -> Tensor:
        """x[b, i] [len(b), V] (a view when b is the whole batch in order and i one row)."""
        whole = b.numel() == self.x.shape[0]
        if isinstance(i, int) and whole and bool((b == torch.arange(b.numel(), device=b.device)).all()):
            return self.x[:, i]
        return self.x[b, i]

    def fill(self, b: Tensor, i: int) -> None:
        """Compute the statistics of rows (b, i) for requests b (a [M] index) and row i."""
        rows, m = self.rows(b, i), self.m[b, i]
        thr, z, cut = _row_stats(rows, m, self.t[b], self.top_k[b], self.top_p[b], self.filtered, self.by_index)
        self.thr[b, i], self.cut[b, i] = thr, cut
        self.z[b, i] = z.masked_fill(self.empty[b, i], 1.0)

    def prob_at(self, b: Tensor, i, x_at: Tensor, index: Tensor) -> Tensor:
        """float64 p(x) of rows (b, i) at tokens ``index`` [M] with logits x_at [M]."""
        thr, m, z = self.thr[b, i], self.m[b, i], self.z[b, i]
        kept = _kept_at(x_at, index, thr, self.cut[b, i])
        p = torch.exp((x_at.to(torch.float64) - m) / self.t[b]) / z
        return p.masked_fill(~kept, 0.0)

    def probs(self, b: Tensor, i: Tensor) -> Tensor:
        """float64 probabilities [M, V] of rows (b[k], i[k])."""
        w = _weights(self.rows(b, i), self.thr[b, i], self.m[b, i], self.t[b], self.cut[b, i])
        return w.div_(self.z[b, i][:, None])


# --------------------------------------------------------------------------------------------
# chain verification


def verify_vectorized(args: VerifyArgs, sampled_rule=None) -> VerifyOutput:
    """Chain verification on checked arguments in the padded layout (``VerifyArgs.padded()``).

    sampled_rule: another rule for the sampled requests (block verification, ``block.py``):
    ``sampled_rule(args, params, x, flag_rows, tok, n, sampled) -> (accepted, token, flagged)`` of
    those requests; greedy requests stay the argmax chain, the same under both rules."""
    B, G, V = args.B, args.G, args.V
    dev = args.target_logits.device
    params = {k: v.to(dev) for k, v in args.per_request_cpu().items()}
    pos = torch.arange(G + 1, device=dev)
    drafts = args.draft_tokens.to(torch.int64)
    # A placeholder id (outside [0, V)) ends the draft: that position draws the bonus token from p.
    n = params["num_draft_tokens"].clamp(0, G)
    usable = (drafts >= 0) & (drafts < V) & (pos[None, :G] < n[:, None])
    n = usable.to(torch.int64).cumprod(-1).sum(-1)
    tok = drafts.clamp(0, max(V - 1, 0))

    x, row_bad, g_max, g_idx = sanitize(args.target_logits, with_index=True)  # [B, G+1, V]
    flag_rows = row_bad | (g_max == float("-inf"))  # nothing to choose from: token 0, flagged
    accept = tok == g_idx[:, :G]  # greedy requests
    greedy = ~(params["temperature"] >= MIN_TEMPERATURE)  # NaN / subnormal act as greedy
    sampled = (~greedy).nonzero().squeeze(1)
    chain = other = None
    if sampled.numel() > 0 and sampled_rule is not None:
        other = sampled_rule(args, params, x, flag_rows, tok, n, sampled)
    elif sampled.numel() > 0:
        chain = _SampledChain(args, params, x, g_max, tok, n, sampled)
        accept[sampled] = chain.accept
    j = (accept & (pos[None, :G] < n[:, None])).to(torch.int64).cumprod(-1).sum(-1)  # first rejection
    flagged = (flag_rows & (pos[None, :] <= j[:, None])).any(-1)
    token = g_idx.gather(1, j[:, None]).squeeze(1)
    if chain is not None:
        js = j[sampled]
        flagged[sampled] |= chain.draft_flags(js)
        token[sampled] = chain.race(js)
    if other is not None:
        j[sampled], token[sampled], flagged[sampled] = other
    out = torch.cat([drafts, drafts.new_full((B, 1), -1)], 1)
    out = torch.where(pos[None, :] < j[:, None], out, torch.full_like(out, -1))
    out = torch.where(pos[None, :] == j[:, None], token[:, None], out)
    return VerifyOutput(out, j.to(torch.int32), flagged)


class _SampledChain:
    """The sampled requests (``index``: their rows of the batch): the accept tests position by
    position (a row's statistics are computed only for the requests that reach it), then the race
    over each request's row j."""

    def __init__(self, args: VerifyArgs, params: dict, x: Tensor, g_max: Tensor, tok: Tensor, n: Tensor, index):
        G, V = args.G, args.V
        self.mode, self.V, self.G, self.index = args.draft_mode, V, G, index
        self.tok, self.n, self.seed = tok[index], n[index], params["seed"][index]
        t = params["temperature"].to(torch.float64)
        top_k, top_p = params["top_k"], params["top_p"].to(torch.float64)
        filtered = args.has_filter and bool((((top_k > 0) & (top_k < V)) | (top_p < 1.0))[index].any())
        by_index = args.sampling.ties_by_index()
        self.target = _Rows(x, g_max, t, top_k, top_p, filtered, by_index)
        self.draft, self.probs = None, args.draft
        M = index.numel()
        self.draft_bad = torch.zeros((M, G), dtype=torch.bool, device=x.device)
        if self.mode == DRAFT_LOGITS:
            xd, draft_bad, xd_max, _ = sanitize(args.draft)
            self.draft, self.draft_bad = _Rows(xd, xd_max, t, top_k, top_p, filtered, by_index), draft_bad[index]
        elif self.mode == DRAFT_PROBS:
            self.draft_bad = unusable_prob_rows(args.draft)[index]
        rows = torch.arange(G, device=x.device, dtype=torch.int64)
        u = uniform_open_torch(
            philox(self.seed[:, None], torch.zeros_like(rows), rows, torch.full_like(rows, PURPOSE_ACCEPT))[0]
        ).to(torch.float64)
        self.accept = torch.zeros((M, G), dtype=torch.bool, device=x.device)
        alive = torch.arange(M, device=x.device)  # requests whose first rejection is not found yet
        for i in range(G + 1):
            self.target.fill(index[alive], i)  # row i: a draft's accept test, or the bonus row
            testing = alive[self.n[alive] > i]
            if i == G or testing.numel() == 0:
                break
            b, x_tok = index[testing], self.tok[testing, i]
            p_tok = self.target.prob_at(b, i, x[b, i, x_tok], x_tok)
            if self.mode == DRAFT_LOGITS:
                self.draft.fill(b, i)
                q_tok = self.draft.prob_at(b, i, xd[b, i, x_tok], x_tok)
            elif self.mode == DRAFT_PROBS:
                q_tok = usable_probs(args.draft[b, i, x_tok])
            else:
                q_tok = torch.ones_like(p_tok)
            accepted = (p_tok > 0) & (u[testing, i] * q_tok <= p_tok)
            self.accept[testing, i] = accepted
            alive = testing[accepted]
            if alive.numel() == 0:
                break

    def draft_flags(self, j: Tensor) -> Tensor:
        """Unusable values in the draft rows a request used: rows 0 .. j that are drafts."""
        rows = torch.arange(self.G, device=j.device)
        used = (rows[None, :] <= j[:, None]) & (rows[None, :] < self.n[:, None])
        return (self.draft_bad & used).any(-1)

    def race(self, j: Tensor) -> Tensor:
        """The recovered (j < n: residual max(p - q, 0), else p) or bonus (p) token of row j."""
        b = self.index
        p = self.target.probs(b, j)  # [M, V]
        recover = j < self.n
        w = p  # bonus rows only: the race may consume p
        if bool(recover.any()):
            jq = j.clamp(max=max(self.G - 1, 0))  # (rows of requests with j = n are not used)
            if self.mode == DRAFT_LOGITS:
                w = self.draft.probs(b, jq).neg_().add_(p).clamp_(min=0)  # max(p - q, 0), in place
            elif self.mode == DRAFT_PROBS:
                w = usable_probs(self.probs[b, jq]).neg_().add_(p).clamp_(min=0)
            else:  # one-hot q: the residual is p without the draft token
                w = p.clone().scatter_(1, self.tok.gather(1, jq[:, None]), 0.0)
            if not bool(recover.all()):
                bonus = (~recover).nonzero().squeeze(1)
                w[bonus] = p[bonus]
        purpose = torch.where(recover, PURPOSE_RECOVER, PURPOSE_BONUS).to(torch.int64)
        best = race(w, self.seed, j, purpose)
        # an empty residual (p == q to rounding) falls back to p, with the same uniforms
        redo = (best < 0) & recover
        if bool(redo.any()):
            rows = redo.nonzero().squeeze(1)
            best[rows] = race(p[rows], self.seed[rows], j[rows], purpose[rows])
        return best.clamp(min=0)  # nothing to sample at all: token 0


def race(w: Tensor, seed: Tensor, row: Tensor, purpose: Tensor) -> Tensor:
    """argmax_x log w(x) - log(-log u_x) per row of w [M, V] (float64, >= 0; overwritten): the
    exponential race with the uniforms of Philox(seed; x // 4, row, purpose) word x % 4, lowest
    index on ties; -1 for a row with no positive weight. Only the entries with w > 0 get a uniform
    when they are few (after top-k / top-p). seed, row, purpose: [M] int64."""
    M, V = w.shape
    positive = w > 0
    count = int(positive.sum())
    if count > _SPARSE_RACE * M * V:
        keys = w.log_().sub_(race_noise_dense(seed, row, purpose, V))  # log 0 = -inf
    else:
        r, x = positive.nonzero(as_tuple=True)
        keys = torch.full((M, V), float("-inf"), dtype=torch.float64, device=w.device)
        keys[r, x] = torch.log(w[r, x]) - race_noise_at(seed[r], x, row[r], purpose[r])
    top, idx = keys.max(-1)  # the first index among equal maxima
    return torch.where(top > float("-inf"), idx, torch.full_like(idx, -1))


def processed_probs(
    x: Tensor, m: Tensor, t: Tensor, top_k: Tensor, top_p: Tensor, filtered: bool, by_index: bool = False
) -> Tensor:
    """float64 probabilities [M, V] of sanitised fp32 rows x with row maxima m (-inf: nothing
    finite, all zeros) after temperature, top-k and top-p (per-row t, top_k, top_p: [M]; by_index:
    ``top_p_ties="by_index"``)."""
    empty = m == float("-inf")
    m = m.masked_fill(empty, 0.0)
    thr, z, cut = _row_stats(x, m, t, top_k, top_p, filtered, by_index)
    return _weights(x, thr, m, t, cut).div_(z.masked_fill(empty, 1.0)[:, None])
