"""Top-k / top-p thresholds of logit rows, exact without sorting (device functions).

``filter_threshold`` (whole rows: key histogram -> pivot, candidates, selection in registers),
``chunk_candidates`` + ``select_candidates`` (the verification kernels' two launches: candidates of
each vocabulary chunk, then the selection per row), ``bisect_threshold`` (the fallback: bisection
on the float order key over the row). The ``*_ties`` variants also count the boundary tie group's
entries that ``top_p_ties="by_index"`` keeps (``tie_need``), and ``tie_index`` turns that count into
the index cut (``helpers.kept_at``). Same thresholds as ``reference.sampling``.
"""

import triton
import triton.language as tl

from .helpers import (
    LOG2E,
    allowed_at,
    key_to_float,
    lane_softmax_update,
    lanes_softmax,
    load_logits,
    online_softmax_update,
    order_key,
    safe_max,
)


@triton.jit
def _unsigned_key(x):
    """uint32 key with the same order as the float32 values, unsigned (bins from the top bits)."""
    return (order_key(x) ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _bin_floor(bins, BIN_SHIFT: tl.constexpr):
    """The smallest float32 value of each key bin (bins of the top 32 - BIN_SHIFT key bits)."""
    u = bins.to(tl.uint32) << BIN_SHIFT
    return key_to_float(u.to(tl.int32, bitcast=True) ^ -2147483648)


@triton.jit
def _unsigned_to_float(u):
    return key_to_float(u.to(tl.int32, bitcast=True) ^ -2147483648)


@triton.jit
def _kth_largest(vals, k):
    """Exact k-th largest of each row of vals [R, CAP] (-inf = empty), by bisection on the
    unsigned key in registers (32-bit: no int64 pairs): the largest key t with #{v >= t} >= k."""
    keys = _unsigned_key(vals)
    live = vals > float("-inf")
    lo = tl.zeros(k.shape, tl.uint32)  # invariant: #{v >= lo} >= k (every entry is >= key 0)
    hi = tl.full(k.shape, 0xFFFFFFFF, tl.uint32)  # the answer is < hi or equals it (checked last)
    for _step in range(32):
        mid = lo + ((hi - lo) >> 1)
        ok = tl.sum(((keys >= mid[:, None]) & live).to(tl.int32), axis=1) >= k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    top = tl.sum(((keys >= hi[:, None]) & live).to(tl.int32), axis=1) >= k
    return _unsigned_to_float(tl.where(top, hi, lo))


@triton.jit
def _mass_threshold(vals, weights, goal, lo_val, hi_val):
    """Largest value t in [lo_val, hi_val] with sum_{v >= t} weights >= goal, by bisection on the
    unsigned key in registers. vals, weights: [R, CAP]; goal, lo_val, hi_val: [R]."""
    keys = _unsigned_key(vals)
    lo = _unsigned_key(lo_val)
    hi = _unsigned_key(hi_val)
    for _step in range(32):
        mid = lo + ((hi - lo) >> 1)
        ok = tl.sum(tl.where(keys >= mid[:, None], weights, 0.0), axis=1) >= goal
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    top = tl.sum(tl.where(keys >= hi[:, None], weights, 0.0), axis=1) >= goal
    return _unsigned_to_float(tl.where(top, hi, lo))


@triton.jit
def pivot_histogram(
    row_ptrs, active, start, end, inv_t, BLOCK: tl.constexpr, NB_BITS: tl.constexpr, mask_rows, HAS_MASK: tl.constexpr
):
    """Pass 1 of ``filter_threshold`` over [start, end) of each row: counts [R, 2**NB_BITS] int32
    of the key bins of the finite entries, and the range's (max, sum-exp) per row."""
    NB: tl.constexpr = 1 << NB_BITS
    R: tl.constexpr = row_ptrs.shape[0]
    offs = tl.arange(0, BLOCK)[None, :]
    m = tl.full([R, BLOCK], float("-inf"), tl.float32)
    z = tl.zeros([R, BLOCK], tl.float32)
    counts = tl.zeros([R * NB], tl.int32)
    slot = (tl.arange(0, R) * NB)[:, None]
    for begin in range(start, end, BLOCK):
        cols = begin + offs
        x, _bad = load_logits(row_ptrs + cols, allowed_at(mask_rows, cols, active[:, None] & (cols < end), HAS_MASK))
        m, z = lane_softmax_update(m, z, x, x > float("-inf"), inv_t[:, None])
        b = slot + (_unsigned_key(x) >> (32 - NB_BITS)).to(tl.int32)
        counts += tl.histogram(tl.reshape(b, [R * BLOCK]), R * NB, mask=tl.reshape(x > float("-inf"), [R * BLOCK]))
    row_m, row_z = lanes_softmax(m, z, inv_t)
    return tl.reshape(counts, [R, NB]), row_m, row_z


@triton.jit
def at_or_above(counts):
    """Suffix sums of key histograms [R, NB]: entries in bins >= b, for every bin b."""
    return tl.sum(counts, axis=1)[:, None] - tl.cumsum(counts, axis=1) + counts


@triton.jit
def choose_pivot(above, use_k, use_p, top_k, CAP: tl.constexpr):
    """(pivot bin, has top-k, fast) from a row's suffix counts [R, NB] (``at_or_above``): the pivot
    is the lowest bin whose entries at or above it fit CAP candidate slots; a top-k row is fast
    when its k-th largest lies at or above the pivot (top-p is checked after the copy,
    ``select_thresholds``). The largest bin b with above[b] >= k holds the k-th largest (an empty
    bin repeats the count of the bin above it, so the largest such b is never empty)."""
    NB: tl.constexpr = above.shape[1]
    bins = tl.arange(0, NB)[None, :]
    pivot_bin = tl.min(tl.where(above <= CAP, bins, NB), axis=1)
    bin_k = tl.max(tl.where(above >= top_k[:, None], bins, -1), axis=1)
    has_k = use_k & (bin_k >= 0)  # fewer than k finite entries: no top-k
    fast = (has_k | use_p) & (pivot_bin < NB) & (~has_k | (bin_k >= pivot_bin))
    return pivot_bin, has_k, fast


@triton.jit
def copy_candidates(
    row_ptrs,
    buf_ptrs,
    rows_ok,
    pivot_bin,
    start,
    end,
    filled,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    NB_BITS: tl.constexpr,
    mask_rows,
    HAS_MASK: tl.constexpr,
):
    """Pass 2 of ``filter_threshold`` over [start, end): append the entries in bins >= pivot_bin to
    each row's scratch buffer from slot `filled` on; returns the new fill."""
    offs = tl.arange(0, BLOCK)[None, :]
    for begin in range(start, end, BLOCK):
        cols = begin + offs
        x, _bad = load_logits(row_ptrs + cols, allowed_at(mask_rows, cols, rows_ok[:, None] & (cols < end), HAS_MASK))
        # the key, not the float compare: -0.0 sits in the bin below +0.0
        in_bins = (_unsigned_key(x) >> (32 - NB_BITS)).to(tl.int32) >= pivot_bin[:, None]
        take = in_bins & (x > float("-inf")) & rows_ok[:, None]
        if tl.max(tl.max(take.to(tl.int32), axis=1), axis=0) > 0:  # most tiles hold no candidate: no scan
            pos = filled[:, None] + tl.cumsum(take.to(tl.int32), axis=1) - 1
            tl.store(buf_ptrs + pos, x, mask=take & (pos < CAP))
            filled += tl.sum(take.to(tl.int32), axis=1)
    return filled


@triton.jit
def select_thresholds(
    buf_ptrs,
    filled,
    fast,
    has_k,
    use_p,
    top_k,
    top_p,
    row_m,
    row_z,
    pivot_bin,
    inv_t,
    CAP: tl.constexpr,
    NB_BITS: tl.constexpr,
    TIES: tl.constexpr,
):
    """The exact thresholds among the copied candidates, in registers: (threshold, fast, need) where a
    top-p row stays fast only if the candidates hold the goal's mass; need: ``tie_need`` (TIES)."""
    slots = tl.arange(0, CAP)[None, :]
    vals = tl.load(buf_ptrs + slots, mask=fast[:, None] & (slots < filled[:, None]), other=float("-inf"))
    t_k = tl.where(has_k, _kth_largest(vals, top_k), float("-inf"))
    kept = (vals >= t_k[:, None]) & (vals > float("-inf"))
    weights = tl.where(kept, tl.exp((vals - safe_max(row_m)[:, None]) * inv_t[:, None]), 0.0)
    kept_mass = tl.sum(weights, axis=1)
    goal = top_p * tl.where(has_k, kept_mass, row_z)
    # top-p alone: the candidates must hold the goal's mass, else the threshold lies below the pivot
    fast = fast & (has_k | ~use_p | (kept_mass >= goal))
    pivot = _bin_floor(pivot_bin, 32 - NB_BITS)
    t_p = _mass_threshold(vals, weights, goal, tl.maximum(t_k, pivot), row_m)
    do_p = use_p & (goal > 0.0)
    need = tl.zeros(top_k.shape, tl.int32)
    if TIES:  # every entry equal to t_p is a candidate (t_p >= the pivot)
        above = tl.sum(tl.where(vals > t_p[:, None], weights, 0.0), axis=1)
        n_tie = tl.sum((kept & (vals == t_p[:, None])).to(tl.int32), axis=1)
        w = tl.exp((t_p - safe_max(row_m)) * inv_t)
        need = tie_need(above, w, goal, n_tie, do_p)
    return tl.where(do_p, t_p, t_k), fast, need


@triton.jit
def filter_threshold(
    row_ptrs, buf_ptrs, row_ok, V, inv_t, top_k, top_p, BLOCK: tl.constexpr, CAP: tl.constexpr, NB_BITS: tl.constexpr
):
    """``filter_threshold_ties`` without the tie count: (threshold, took the two-pass path)."""
    thr, fast, _need = filter_threshold_ties(
        row_ptrs, buf_ptrs, row_ok, V, inv_t, top_k, top_p, BLOCK, CAP, NB_BITS, False
    )
    return thr, fast


@triton.jit
def filter_threshold_ties(
    row_ptrs, buf_ptrs, row_ok, V, inv_t, top_k, top_p, BLOCK: tl.constexpr, CAP: tl.constexpr,
    NB_BITS: tl.constexpr, TIES: tl.constexpr, mask_rows=None, HAS_MASK: tl.constexpr = False,
):  # fmt: skip
    """Raw-logit threshold per row implementing top-k then top-p (keep x >= threshold).

    row_ptrs: [R, 1] pointers to the start of each row; buf_ptrs: [R, 1] pointers to a CAP-entry
    fp32 scratch row each; row_ok, inv_t, top_k, top_p: [R].
      top-k: the k-th largest value t (largest t with #{x >= t} >= k); ties at t are kept.
      top-p: after top-k, the largest t with sum_{x >= t} p(x) >= top_p; ties at t are kept.
    Rows with top_k in {0} or >= V and top_p >= 1 get -inf (no filtering). HAS_MASK: the rows are
    read under their token_bitmask rows mask_rows ([R, 1] pointers; ``helpers.allowed_at``).

    Exact, without sorting, in two passes over the row (pivot, then compaction):
    1. the row max, its sum-exp and a histogram of the float order key's top NB_BITS bits (sign,
       exponent, leading mantissa bits). The pivot is the lowest bin whose entries at or above it
       still fit CAP: the largest candidate set the buffer holds.
    2. the candidates are copied to the scratch row; the exact thresholds are then found among
       them in registers (bisection on the key: no memory traffic). The candidates hold every
       kept entry when the k-th largest lies at or above the pivot (top-k) or, for top-p alone,
       when their mass reaches top_p (checked exactly on the copies).
    Other rows (a very flat top-p row, a huge k) fall back to bisection over the row
    (``bisect_threshold``, 32 passes per selection). Returns (threshold, took the two-pass path,
    need): need is the by_index tie count (``tie_need``; TIES only, else 0).
    The verification kernels read each row once instead (``chunk_candidates``, ``select_candidates``).
    """
    use_k = row_ok & (top_k > 0) & (top_k < V)
    use_p = row_ok & (top_p < 1.0)
    active = use_k | use_p
    thr = tl.full(inv_t.shape, float("-inf"), tl.float32)
    need = tl.zeros(inv_t.shape, tl.int32)
    fast = active & False
    if tl.max(active.to(tl.int32), axis=0) > 0:
        counts, row_m, row_z = pivot_histogram(row_ptrs, active, 0, V, inv_t, BLOCK, NB_BITS, mask_rows, HAS_MASK)
        pivot_bin, has_k, fast = choose_pivot(at_or_above(counts), use_k, use_p, top_k, CAP)
        if tl.max(fast.to(tl.int32), axis=0) > 0:
            filled = copy_candidates(
                row_ptrs,
                buf_ptrs,
                fast,
                pivot_bin,
                0,
                V,
                tl.zeros(inv_t.shape, tl.int32),
                BLOCK,
                CAP,
                NB_BITS,
                mask_rows,
                HAS_MASK,
            )
            tl.debug_barrier()  # the copies of other threads must be visible before reading back
            fast_thr, fast, fast_need = select_thresholds(
                buf_ptrs, filled, fast, has_k, use_p, top_k, top_p, row_m, row_z, pivot_bin, inv_t, CAP, NB_BITS, TIES
            )
            thr = tl.where(fast, fast_thr, thr)
            need = tl.where(fast, fast_need, need)
        slow = (has_k | use_p) & ~fast
        if tl.max(slow.to(tl.int32), axis=0) > 0:
            slow_thr, slow_need = bisect_threshold_ties(
                row_ptrs, slow, V, inv_t, top_k, top_p, BLOCK, TIES, mask_rows, HAS_MASK
            )
            thr = tl.where(slow, slow_thr, thr)
            need = tl.where(slow, slow_need, need)
    return thr, fast, need


@triton.jit
def chunk_candidates(
    row_ptr,
    cand_ptr,
    active,
    start,
    end,
    inv_t,
    CW: tl.constexpr,
    L: tl.constexpr,
    NB: tl.constexpr,
    E: tl.constexpr,
    WITH_Z: tl.constexpr,
    mask_row=None,
    HAS_MASK: tl.constexpr = False,
):
    """The top-k/top-p candidates of one vocabulary chunk [start, end) of one row (end - start <= CW),
    read once and kept in registers (the threshold phases of threshold_phases.py).

    row_ptr: [1] pointer to the row; cand_ptr: [1] pointer to L fp32 slots (L / E groups of E
    consecutive entries, then -inf); active, inv_t: [1]. The chunk is cut into groups of E entries
    (one vector load per thread: nothing crosses threads), groups are binned by the distance of
    their max below the chunk max in steps of the float key's top 16 bits (one bf16 step per bin,
    8 per bin past NB / 2; bin NB - 1 collects everything farther), and the chunk keeps the
    nearest bins whose groups fit the
    slots, written whole (vector stores; entries below the bound ride along). Returns (max,
    sum-exp relative to it if WITH_Z else 0, tau) as [1] tensors: every finite entry whose key16
    (``_unsigned_key >> 16``) is >= tau was written, so the union of a row's chunks holds every entry
    of the row at or above the largest tau (``select_candidates``)."""
    cols = start + tl.arange(0, CW)
    bits = None
    if HAS_MASK:  # the chunk's words, expanded in registers (as ``allowed_tile``, one row)
        if CW >= 32:
            w = start // 32 + tl.arange(0, CW // 32)
            words = tl.load(mask_row + w, mask=active & (w * 32 < end), other=0)
            bits = tl.reshape((words[:, None] & (1 << tl.arange(0, 32))[None, :]) != 0, [CW])
        else:
            bits = allowed_at(mask_row, cols, active & (cols < end), HAS_MASK)
    x, _bad = load_logits(row_ptr + cols, active & (cols < end), bits)
    groups = tl.reshape(x, [CW // E, E])
    g_max = tl.max(groups, axis=1)
    m = tl.max(g_max, axis=0)
    z = 0.0
    if WITH_Z:  # only top-p without top-k needs the row's sum-exp
        z = tl.sum(tl.exp2((x - safe_max(m)) * (inv_t * LOG2E)), axis=0)
    top16 = (_unsigned_key(m) >> 16).to(tl.int32)
    # bins: one key16 step each for the first NB / 2 steps below the max, then 8 steps each (heavy
    # tails: a chunk whose max stands far above the rest still keeps its L / E nearest groups)
    FINE: tl.constexpr = NB // 2
    steps = top16 - (_unsigned_key(g_max) >> 16).to(tl.int32)
    d = tl.where(steps < FINE, steps, tl.minimum(FINE + ((steps - FINE) >> 3), NB - 1))  # -inf groups: far
    near = tl.max(tl.where(tl.cumsum(tl.histogram(d, NB), axis=0) <= L // E, tl.arange(0, NB), -1), axis=0)
    take = d <= near
    g_pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(cand_ptr + (g_pos * E)[:, None] + tl.arange(0, E)[None, :], groups, mask=take[:, None])
    filled = tl.sum(take.to(tl.int32), axis=0) * E
    slots = tl.arange(0, L)
    tl.store(cand_ptr + slots, float("-inf"), mask=active & (slots >= filled))
    # near = NB - 1: the whole chunk (the far bin too); near = -1: nothing (more than L / E groups
    # hold the max)
    farthest = tl.where(near < FINE, near, FINE + ((near - FINE + 1) << 3) - 1)  # steps of the last bin kept
    tau = tl.where(near == NB - 1, 0, tl.maximum(top16 - farthest, 0))
    zero = tl.zeros_like(inv_t)
    return zero + m, zero + z, zero.to(tl.int32) + tau


@triton.jit
def _bisect_count(keys, live, k, lo, hi):
    """Largest key t in [lo, hi) with #{live keys >= t} >= k, given that lo has it and hi has not
    (uint32 [1]; done when hi - lo <= 1)."""
    while tl.max(hi - lo, axis=0) > 1:
        mid = lo + ((hi - lo) >> 1)
        ok = tl.sum(((keys >= mid) & live).to(tl.int32), axis=0) >= k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit
def _bisect_mass(keys, weights, goal, lo, hi):
    """Largest key t in [lo, hi) with sum_{keys >= t} weights >= goal, given that lo has it and hi
    has not (uint32 [1]; done when hi - lo <= 1)."""
    while tl.max(hi - lo, axis=0) > 1:
        mid = lo + ((hi - lo) >> 1)
        ok = tl.sum(tl.where(keys >= mid, weights, 0.0), axis=0) >= goal
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit
def select_candidates(
    cand_ptr, rec_ptr, tau_ptr, TC, ok, V, inv_t, top_k, top_p, TCP2: tl.constexpr, L: tl.constexpr,
    NB: tl.constexpr, SHIFT: tl.constexpr,
):  # fmt: skip
    """``select_candidates_ties`` without the tie count: (threshold, fast)."""
    thr, fast, _need = select_candidates_ties(
        cand_ptr, rec_ptr, tau_ptr, TC, ok, V, inv_t, top_k, top_p, TCP2, L, NB, SHIFT, False
    )
    return thr, fast


@triton.jit
def select_candidates_ties(
    cand_ptr,
    rec_ptr,
    tau_ptr,
    TC,
    ok,
    V,
    inv_t,
    top_k,
    top_p,
    TCP2: tl.constexpr,
    L: tl.constexpr,
    NB: tl.constexpr,
    SHIFT: tl.constexpr,
    TIES: tl.constexpr,
):
    """Exact top-k/top-p thresholds of one row from its TC chunks' candidates (``chunk_candidates``):
    (threshold, fast) as [1] tensors. cand_ptr: [1] -> [TC, L] fp32 candidates; rec_ptr: [1] ->
    [TC, 2] (max, sum-exp) per chunk; tau_ptr: [1] -> [TC] int32; ok, inv_t, top_k, top_p: [1].

    Every entry of the row with key16 >= P = max(tau) is a candidate, so the candidates at or above
    P decide a row whose k-th largest lies there (at least k of them) or, for top-p alone, whose
    goal mass they hold; other rows are not fast (the caller bisects over the row). The k-th largest
    is found from a histogram of key16 steps below the row max (for bf16 its step is its value;
    fp16 / fp32 bisect the low key bits inside the step: SHIFT = 13 / 0, 16 for bf16), the top-p
    threshold by bisection between it and the max. Same thresholds and tie rule as
    ``bisect_threshold`` and the reference. Returns (threshold, fast, need): need is the by_index
    tie count (``tie_need``; TIES only, else 0)."""
    SH: tl.constexpr = 16 - SHIFT
    use_k = ok & (top_k > 0) & (top_k < V)
    use_p = ok & (top_p < 1.0)
    active = use_k | use_p
    ch = tl.arange(0, TCP2)
    rec_ok = active & (ch < TC)
    m_c = tl.load(rec_ptr + ch * 2, mask=rec_ok, other=float("-inf"))
    z_c = tl.load(rec_ptr + ch * 2 + 1, mask=rec_ok, other=0.0)
    tau = tl.max(tl.load(tau_ptr + ch, mask=rec_ok, other=0), axis=0)
    m = tl.max(m_c, axis=0)
    ref = safe_max(m)
    scale = tl.exp2((m_c - ref) * (inv_t * LOG2E))
    row_z = tl.sum(tl.where(m_c > float("-inf"), z_c * scale, 0.0), axis=0)
    j = tl.arange(0, TCP2 * L)
    v = tl.load(cand_ptr + j, mask=active & (j < TC * L), other=float("-inf"))
    key = _unsigned_key(v)
    key16 = (key >> 16).to(tl.int32)
    valid = (v > float("-inf")) & (key16 >= tau)
    v = tl.where(valid, v, float("-inf"))
    has_k = use_k & (tl.sum(valid.to(tl.int32), axis=0) >= top_k)
    fast = has_k | (use_p & ~use_k)  # top-k rows with fewer than k candidates at or above P: not fast
    # the k-th largest: its key16 step below the max (d_k = NB - 1: farther, between P and there)
    top16 = (_unsigned_key(m) >> 16).to(tl.int32)
    d = tl.where(valid, tl.minimum(top16 - key16, NB - 1), NB - 1)
    above = tl.cumsum(tl.histogram(d, NB), axis=0)
    d_k = tl.min(tl.where(above[None, :] >= top_k[:, None], tl.arange(0, NB)[None, :], NB - 1), axis=1)
    far = d_k >= NB - 1
    lo_k = tl.where(has_k, tl.where(far, tau, top16 - d_k), 0).to(tl.uint32) << SH
    hi_k = tl.where(has_k, tl.where(far, top16 - (NB - 2), top16 - d_k + 1), 0).to(tl.uint32) << SH
    keys = key >> SHIFT
    lo_k = _bisect_count(keys, valid, top_k, lo_k, hi_k)
    t_k = tl.min(tl.where(valid & (keys >= lo_k), v, float("inf")), axis=0)
    t_k = tl.where(has_k, t_k, float("-inf"))
    kept = valid & (v >= t_k)
    weights = tl.where(kept, tl.exp((v - ref) * inv_t), 0.0)
    kept_mass = tl.sum(weights, axis=0)
    goal = top_p * tl.where(has_k, kept_mass, row_z)
    # top-p alone: the candidates must hold the goal's mass, else the threshold lies below P
    fast = fast & (has_k | ~use_p | (kept_mass >= goal))
    do_p = fast & use_p & (goal > 0.0)
    lo_p = tl.where(do_p, tl.where(has_k, lo_k, tau.to(tl.uint32) << SH), 0)
    hi_p = tl.where(do_p, (_unsigned_key(m) >> SHIFT) + 1, 0)
    lo_p = _bisect_mass(keys, weights, goal, lo_p, hi_p)
    t_p = tl.min(tl.where(kept & (keys >= lo_p), v, float("inf")), axis=0)
    need = tl.zeros(inv_t.shape, tl.int32)
    if TIES:  # every entry equal to t_p is a candidate (its key16 is >= P)
        above = tl.sum(tl.where(v > t_p, weights, 0.0), axis=0)
        n_tie = tl.sum((kept & (v == t_p)).to(tl.int32), axis=0)
        need = tie_need(above, tl.exp((t_p - ref) * inv_t), goal, n_tie, do_p)
    return tl.where(do_p, t_p, t_k), fast, need


@triton.jit
def bisect_threshold(
    row_ptrs, row_ok, V, inv_t, top_k, top_p, BLOCK_V: tl.constexpr, mask_rows=None, HAS_MASK: tl.constexpr = False
):
    """``bisect_threshold_ties`` without the tie count."""
    thr, _need = bisect_threshold_ties(row_ptrs, row_ok, V, inv_t, top_k, top_p, BLOCK_V, False, mask_rows, HAS_MASK)
    return thr


@triton.jit
def bisect_threshold_ties(
    row_ptrs, row_ok, V, inv_t, top_k, top_p, BLOCK_V: tl.constexpr, TIES: tl.constexpr, mask_rows,
    HAS_MASK: tl.constexpr,
):  # fmt: skip
    """``filter_threshold`` by bisection on the float order key: 32 passes over the row per
    selection. The fallback for rows whose candidate set does not fit the selection buffer.

    row_ptrs: [R, 1] pointers to the start of each row; row_ok, inv_t, top_k, top_p: [R].
    Exact, without sorting: bisection on the float order key (32 passes each for top-k and
    top-p, only for the rows of a tile that ask for them).
      top-k: the k-th largest value t (largest t with #{x >= t} >= k); ties at t are kept.
      top-p: after top-k, the largest t with sum_{x >= t} p(x) >= top_p; ties at t are kept.
    Rows with top_k in {0} or >= V and top_p >= 1 get -inf (no filtering).
    Returns (threshold, need): need is the by_index tie count (``tie_need``; TIES only: one more
    pass over the top-p rows, else 0).
    """
    offs = tl.arange(0, BLOCK_V)[None, :]
    use_k = row_ok & (top_k > 0) & (top_k < V)
    use_p = row_ok & (top_p < 1.0)
    thr = tl.full(inv_t.shape, float("-inf"), tl.float32)
    need = tl.zeros(inv_t.shape, tl.int32)
    if tl.max(use_k.to(tl.int32), axis=0) > 0:
        lo = order_key(thr).to(tl.int64)
        hi = order_key(tl.full(inv_t.shape, float("inf"), tl.float32)).to(tl.int64)
        lo = _bisect_key(row_ptrs, mask_rows, use_k, lo, hi, top_k, thr, thr, inv_t, V, BLOCK_V, False, HAS_MASK)
        thr = tl.where(use_k, key_to_float(lo), thr)
    if tl.max(use_p.to(tl.int32), axis=0) > 0:
        m = tl.full(inv_t.shape, float("-inf"), tl.float32)
        z = tl.zeros(inv_t.shape, tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            x, _bad = load_logits(row_ptrs + cols, allowed_at(mask_rows, cols, use_p[:, None] & (cols < V), HAS_MASK))
            m, z = online_softmax_update(m, z, x, x >= thr[:, None], inv_t)
        goal = top_p * z
        m_ref = safe_max(m)
        lo = order_key(thr).to(tl.int64)
        hi = order_key(m).to(tl.int64) + 1
        t_p = key_to_float(
            _bisect_key(row_ptrs, mask_rows, use_p, lo, hi, goal, thr, m_ref, inv_t, V, BLOCK_V, True, HAS_MASK)
        )
        if TIES:  # the mass above t_p and the entries equal to it (all >= the top-k threshold)
            above = tl.zeros(inv_t.shape, tl.float32)
            n_tie = tl.zeros(inv_t.shape, tl.int32)
            for start in range(0, V, BLOCK_V):
                cols = start + offs
                ok = allowed_at(mask_rows, cols, use_p[:, None] & (cols < V), HAS_MASK)
                x, _bad = load_logits(row_ptrs + cols, ok)
                hit = x > t_p[:, None]
                above += tl.sum(tl.where(hit, tl.exp((x - m_ref[:, None]) * inv_t[:, None]), 0.0), axis=1)
                n_tie += tl.sum((x == t_p[:, None]).to(tl.int32), axis=1)
            w = tl.exp((t_p - m_ref) * inv_t)
            need = tie_need(above, w, goal, n_tie, use_p & (goal > 0.0))
        thr = tl.where(use_p, t_p, thr)
    return thr, need


@triton.jit
def _bisect_key(
    row_ptrs, mask_rows, use, lo, hi, goal, thr, m_ref, inv_t, V, BLOCK_V: tl.constexpr, MASS: tl.constexpr,
    HAS_MASK: tl.constexpr,
):  # fmt: skip
    """``bisect_threshold_ties``'s search: the largest order key in [lo, hi) (32 passes over each row)
    whose entries at or above it reach the goal: their count (top-k; -inf entries never count), or
    with MASS their weight exp((x - m_ref) * inv_t) among the entries >= thr (top-p after top-k)."""
    offs = tl.arange(0, BLOCK_V)[None, :]
    for _step in range(32):
        mid = lo + (hi - lo) // 2
        if MASS:
            total = tl.zeros(inv_t.shape, tl.float32)
        else:
            total = tl.zeros(inv_t.shape, tl.int32)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            x, _bad = load_logits(row_ptrs + cols, allowed_at(mask_rows, cols, use[:, None] & (cols < V), HAS_MASK))
            at_or_above = order_key(x).to(tl.int64) >= mid[:, None]
            if MASS:
                weight = tl.exp((x - m_ref[:, None]) * inv_t[:, None])
                total += tl.sum(tl.where(at_or_above & (x >= thr[:, None]), weight, 0.0), axis=1)
            else:
                total += tl.sum((at_or_above & (x > float("-inf"))).to(tl.int32), axis=1)
        ok = total >= goal
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit
def tie_need(above, w, goal, n_tie, active):
    """The by_index top-p rule (``SamplingParams.top_p_ties``): how many entries of the boundary tie
    group (n_tie entries of weight w each, mass `above` before them) stay: the fewest m >= 1 with
    above + m * w >= goal (the reference's first cumulative mass reaching the goal). 0 where the
    whole group stays (m = n_tie, w = 0) or the row has no top-p cut (not active): no cut."""
    q = tl.minimum((goal - above) / tl.where(w > 0.0, w, 1.0), n_tie.to(tl.float32))
    m = q.to(tl.int32)
    m = tl.maximum(m + (m.to(tl.float32) < q).to(tl.int32), 1)  # the ceiling, at least one
    return tl.where(active & (w > 0.0) & (m < n_tie), m, 0)


@triton.jit
def tie_index(row_ptrs, need, thr, V, BLOCK: tl.constexpr, mask_rows, HAS_MASK: tl.constexpr):
    """The by_index cut of each row: the index of the need-th highest-index entry equal to thr
    (``tie_need``), 0 where need = 0 (the whole tie group stays). Kept entries are then x > thr,
    and x == thr at an index >= the cut (``kept_at``). Reads the row's blocks from its end until
    every row found its cut. row_ptrs: [R, 1]; need, thr: [R]."""
    offs = tl.arange(0, BLOCK)[None, :]
    cut = tl.zeros(need.shape, tl.int32)
    left = tl.where(V > 0, need, 0)
    blk = (V - 1) // BLOCK
    while tl.max(left, axis=0) > 0:
        cols = blk * BLOCK + offs
        looking = left > 0
        ok = allowed_at(mask_rows, cols, looking[:, None] & (cols < V), HAS_MASK)
        x = tl.load(row_ptrs + cols, mask=ok, other=float("-inf")).to(tl.float32)
        tie = ((x == thr[:, None]) & looking[:, None]).to(tl.int32)
        count = tl.sum(tie, axis=1)
        at_or_after = count[:, None] - tl.cumsum(tie, axis=1) + tie  # ties of the block at columns >= col
        found = looking & (count >= left)
        hit = (tie > 0) & (at_or_after == left[:, None])
        cut = tl.where(found, tl.max(tl.where(hit, cols, -1), axis=1), cut)
        left = tl.where(found, 0, left - count)
        blk -= 1
        left = tl.where(blk >= 0, left, 0)  # never past the row's start (need <= the tie count)
    return cut
