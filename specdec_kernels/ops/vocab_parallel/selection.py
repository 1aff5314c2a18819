"""Top-k / top-p thresholds across vocabulary shards: ``reference.sampling.filter_threshold`` of
every row, exactly (ties included), from a few collectives: an all-gather of each rank's k largest
values for small k, radix select over all-reduced key histograms otherwise."""

from __future__ import annotations

import torch

from .protocol import NEG_INF, Shard

_DIGIT_BITS = 8
_BINS = 1 << _DIGIT_BITS
_SHIFTS = (24, 16, 8, 0)  # radix select over 32-bit keys, most significant digit first
TOPK_GATHER_MAX = 256  # top-k up to this: all-gather each rank's k largest values (else radix select)


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2**32) ordered like the fp32 values (-0.0 counts as +0.0)."""
    bits = (x + 0.0).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, 0xFFFFFFFF - bits, bits + 2**31)


def _key_to_float(key: torch.Tensor) -> torch.Tensor:
    bits = torch.where(key >= 2**31, key - 2**31, 0xFFFFFFFF - key)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32)


def _radix_select(shard: Shard, keys: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor | None, goal):
    """Per row, the key of the threshold entry, by 4 all-reduced 256-bin histograms.

    weights None: the goal-th largest key (goal [R] int64 >= 1; counts). Else: the largest key v
    with mass(keys >= v) >= goal (the top-p pivot; goal [R] float64, or a function of the first
    level's row totals: top_p * total). Returns (keys [R], the first level's row totals [R])."""
    R = keys.shape[0]
    dev = keys.device
    prefix = torch.zeros(R, dtype=torch.int64, device=dev)
    vals = valid.to(torch.int64) if weights is None else torch.where(valid, weights, torch.zeros_like(weights))
    bins = torch.arange(_BINS, device=dev)
    total = None
    need = goal
    for level, shift in enumerate(_SHIFTS):
        match = valid & ((keys >> (shift + _DIGIT_BITS)) == (prefix >> (shift + _DIGIT_BITS))[:, None])
        digit = (keys >> shift) & (_BINS - 1)
        hist = torch.zeros((R, _BINS), dtype=vals.dtype, device=dev)
        hist.scatter_add_(1, digit, torch.where(match, vals, torch.zeros_like(vals)))
        hist = shard.sum(hist.to(shard.device)).to(dev)
        suffix = hist.flip(1).cumsum(1).flip(1)  # suffix[d] = sum over bins >= d
        if level == 0:
            total = suffix[:, 0]
            if callable(need):
                need = need(total)
        ok = suffix >= need[:, None]
        d = ok.sum(1) - 1
        if weights is not None:  # rounding left the goal above the group's mass: its lowest entry
            lowest = torch.where(hist > 0, bins, _BINS).min(1).values.clamp(max=_BINS - 1)
            d = torch.where(d < 0, lowest, d)
        d = d.clamp(0, _BINS - 1)
        above = suffix.gather(1, d[:, None])[:, 0] - hist.gather(1, d[:, None])[:, 0]
        need = need - above
        prefix = prefix | (d << shift)
    return prefix, total


def _gathered_top(shard: Shard, x: torch.Tensor, k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's k_max largest values of each row, merged: (values [R, M] float64 sorted
    descending, multiplicities [R, M] float64), in one all-gather.

    A rank's entries tied with its k_max-th value that did not fit are added as one extra entry
    (that value, their count). Then the multiset is exact at and above the global k-th largest
    value for any k <= k_max: a rank holding an entry >= that value which it did not send would
    hold k_max >= k entries above it."""
    R, dev = x.shape[0], x.device
    take = min(k_max, shard.size)
    vals = torch.full((R, k_max), NEG_INF, dtype=torch.float64, device=dev)
    bound = torch.full((R, 1), NEG_INF, dtype=torch.float64, device=dev)
    extra = torch.zeros((R, 1), dtype=torch.float64, device=dev)
    if take:
        top = torch.topk(x, take, dim=-1).values
        vals[:, :take] = top.double()
        if take == k_max:
            b = top[:, -1:]
            ties = ((x == b).sum(-1, keepdim=True) - (top == b).sum(-1, keepdim=True)).double()
            bound = torch.where(b > NEG_INF, b, NEG_INF).double()
            extra = torch.where(b > NEG_INF, ties, 0.0)
    (allr,) = shard.gather_many([torch.cat([vals, bound, extra], -1)])  # [world, R, k_max + 2]
    sent = allr[..., :k_max].permute(1, 0, 2).reshape(R, -1)
    values = torch.cat([sent, allr[..., k_max].T], -1)
    mult = torch.cat([torch.ones_like(sent), allr[..., k_max + 1].T], -1)
    mult = torch.where(values > NEG_INF, mult, 0.0)
    values = torch.where(mult > 0, values, NEG_INF)  # empty slots sort last
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return values, mult.gather(1, order)


def _top_p_pivot(values, weights, kept, top_p) -> torch.Tensor:
    """The top-p pivot of sorted values [R, M] (descending; the kept ones first) with weights (0
    past the kept ones), as the reference: the first value whose cumulative mass reaches
    top_p * total (the last kept one if rounding leaves the goal above every partial sum)."""
    mass = torch.cumsum(weights, -1)
    goal = top_p * mass[:, -1]
    n_kept = kept.sum(-1)
    first = torch.minimum((mass < goal[:, None]).sum(-1), (n_kept - 1).clamp(min=0))
    return values.gather(1, first[:, None])[:, 0]


def thresholds(shard: Shard, x, gmax, temp, top_k, top_p, sampled) -> torch.Tensor:
    """``reference.sampling.filter_threshold`` of every row, globally: fp32 [R] (-inf = no filter).

    Rows with top-k <= TOPK_GATHER_MAX: one all-gather of each rank's k largest values gives the
    k-th largest value and the kept set itself, so top-p is computed on it exactly as the reference
    does (same sorted order, same cumulative sum). Other rows: radix select over all-reduced key
    histograms (counts for top-k, softmax mass for top-p). Decisions depend on replicated
    parameters and gathered values only: every rank runs the same collectives."""
    R = x.shape[0]
    dev = x.device
    thr = torch.full((R,), NEG_INF, dtype=torch.float32, device=dev)
    finite = x > NEG_INF
    use_k = sampled & (top_k > 0) & (top_k < shard.V)
    use_p = sampled & (top_p < 1.0)
    small = use_k & (top_k <= TOPK_GATHER_MAX)
    if bool(small.any()):
        values, mult = _gathered_top(shard, x, int(top_k[small].max()))
        cum = torch.cumsum(mult, -1)
        idx = (cum < top_k[:, None]).sum(-1).clamp(max=values.shape[1] - 1)
        kth = values.gather(1, idx[:, None])[:, 0]
        thr = torch.where(small & (cum[:, -1] >= top_k), kth.float(), thr)
        if bool((small & use_p).any()):
            kept = (values >= thr[:, None].double()) & (values > NEG_INF)
            t = torch.where(use_p, temp, torch.ones_like(temp))
            w = torch.where(kept, torch.exp((values - gmax.double()[:, None]) / t[:, None]), 0.0) * mult
            has = gmax > NEG_INF
            pivot = _top_p_pivot(values, w, kept, top_p.double())
            thr = torch.where(small & use_p & has, pivot.float(), thr)
    keys = None
    big_k = use_k & ~small
    if bool(big_k.any()):
        keys = _order_keys(x)
        k = torch.where(big_k, top_k, torch.ones_like(top_k))
        kth_key, count = _radix_select(shard, keys, finite, None, k)
        thr = torch.where(big_k & (count >= top_k), _key_to_float(kth_key), thr)
    big_p = use_p & ~small
    if bool(big_p.any()):
        keys = _order_keys(x) if keys is None else keys
        kept = finite & (x >= thr[:, None])
        t = torch.where(big_p, temp, torch.ones_like(temp))
        w = torch.exp((x.double() - gmax.double()[:, None]) / t[:, None])
        frac = top_p.double()

        def goal(total):
            return frac * total

        pivot, _ = _radix_select(shard, keys, kept, w, goal)
        has = gmax > NEG_INF  # some finite entry (then some kept)
        thr = torch.where(big_p & has, _key_to_float(pivot), thr)
    return thr
