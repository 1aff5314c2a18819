"""Phase 3 of tree verification, K-SEQ: the rho search of every position with siblings, before the
walk and split over the vocabulary (``reference.verify_tree.rho_search``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..helpers import (
    DRAFT_LOGITS,
    LOG2E,
    allowed_tile,
    fast_div,
    inverse_temperature,
    kept_at,
    load_probs,
    per_request,
    safe_max,
)
from .common import (
    POS_FIRST,
    POS_K,
    POS_REC,
    RB_DONE,
    RB_GHI,
    RB_GLO,
    RB_HI,
    RB_LO,
    RB_PTS,
    RB_REC,
    RHO_BISECT,
    RHO_EPS,
    RHO_MARGIN,
    RHO_TOL,
    _mask_rows,
    _pick,
    _position_stats,
    _position_tile,
    _record,
    _row_ptr,
)


@triton.jit
def _kseq_f(rho, g, kf):
    """f = 1 - (1 - beta)^k - rho beta, beta = g / rho (reference.verify_tree.kseq_f)."""
    return 1.0 - tl.exp(kf * tl.log(tl.maximum(1.0 - g / rho, 0.0))) - g


@triton.jit
def _kseq_acceptance(rho, g, kf):
    return 1.0 - tl.exp(kf * tl.log(tl.maximum(1.0 - g / rho, 0.0)))


@triton.jit
def _rho_first_points(kf, RHO_P: tl.constexpr):
    pts_i = tl.arange(0, RHO_P)[None, :]
    return 1.0 + (kf[:, None] - 1.0) * (pts_i.to(tl.float32) / (RHO_P - 1))


@triton.jit
def _rho_bisect(a, b, ga, gb, s_left, s_right, chord, kf, UPPER: tl.constexpr):
    """Root of f on [a, b] with g replaced by its chord (lower bound) or by the neighbours' extended
    chords (UPPER): RHO_BISECT bisection steps, the upper end."""
    x_lo = a
    x_hi = b
    for _ in tl.static_range(RHO_BISECT):
        mid = 0.5 * (x_lo + x_hi)
        if UPPER:
            g = tl.minimum(ga + s_left * (mid - a), gb - s_right * (b - mid))
        else:
            g = ga + chord * (mid - a)
        pos = _kseq_f(mid, g, kf) > 0.0
        x_lo = tl.where(pos, mid, x_lo)
        x_hi = tl.where(pos, x_hi, mid)
    return x_hi


@triton.jit
def _rho_step(pts, gs, kf, lo, glo, RHO_P: tl.constexpr):
    """One round of the rho search (reference.verify_tree.rho_step) on [BP, RHO_P] tiles: the
    bracket (lo, g(lo), hi, g(hi)), whether it is done, and the next round's points."""
    pts_i = tl.arange(0, RHO_P)[None, :]
    nonpos = _kseq_f(pts, gs, kf[:, None]) <= 0.0
    m = tl.min(tl.where(nonpos, pts_i, RHO_P - 1), axis=1)
    a = tl.where(m > 0, _pick(pts, pts_i, m - 1), lo)
    ga = tl.where(m > 0, _pick(gs, pts_i, m - 1), glo)
    b = _pick(pts, pts_i, m)
    gb = _pick(gs, pts_i, m)
    done = _kseq_acceptance(a, ga, kf) - _kseq_acceptance(b, gb, kf) <= RHO_TOL
    an = _pick(pts, pts_i, m - 2)
    left = (m >= 2) & (an < a)
    an = tl.where(left, an, 0.0)
    gan = tl.where(left, _pick(gs, pts_i, m - 2), 0.0)
    s_left = (ga - gan) / (a - an)
    bn = _pick(pts, pts_i, m + 1)
    right = (m + 1 < RHO_P) & (bn > b)
    s_right = tl.where(right, (_pick(gs, pts_i, m + 1) - gb) / tl.where(right, bn - b, 1.0), 0.0)
    w = b - a
    chord = (gb - ga) / tl.where(w > 0.0, w, 1.0)
    r_lower = _rho_bisect(a, b, ga, gb, s_left, s_right, chord, kf, False)
    r_upper = _rho_bisect(a, b, ga, gb, s_left, s_right, chord, kf, True)
    x0 = tl.minimum(r_lower, r_upper)
    x1 = tl.maximum(r_lower, r_upper)
    f_drop = tl.minimum(tl.maximum(_kseq_f(a, ga, kf) - _kseq_f(b, gb, kf), RHO_EPS), 1.0)
    margin = RHO_MARGIN * (x1 - x0) + w * (RHO_EPS / f_drop)
    x0 = tl.maximum(a, x0 - margin)
    x1 = tl.minimum(b, x1 + margin)
    nxt = x0[:, None] + (x1 - x0)[:, None] * (pts_i.to(tl.float32) / (RHO_P - 2))
    nxt = tl.where(pts_i == RHO_P - 1, b[:, None], nxt)
    return a, ga, b, gb, done, nxt


@triton.jit
def _rho_active(pos_ptr, temperature_ptr, brk_ptr, pos, in_range, b, rnd, temperature, PER_REQ_T: tl.constexpr):
    """(k, lanes whose search runs this round): positions with siblings of sampled requests, not
    done after an earlier round."""
    k = tl.load(pos_ptr + pos * POS_REC + POS_K, mask=in_range, other=0)
    t_req = per_request(temperature_ptr, temperature, b, in_range, PER_REQ_T).to(tl.float32)
    greedy, _inv_t = inverse_temperature(t_req)
    active = in_range & ~greedy & (k > 1)
    if rnd > 0:
        done = tl.load(brk_ptr + pos * RB_REC + RB_DONE, mask=active, other=1.0)
        active = active & (done == 0.0)
    return k, active


@triton.jit(do_not_specialize=["B", "num_chunks", "rnd"])  # per-call scalars: triton/helpers.py
def _tree_rho_step_kernel(
    # pointers
    temperature_ptr,  # [B] float (PER_REQ_T)
    pos_ptr,  # [B, N+1, POS_REC] int32 (_tree_positions_kernel)
    brk_ptr,  # [B*(N+1), RB_REC] fp32 in/out: the search's record per position
    sums_ptr,  # [B*(N+1), C, RHO_P] fp32: this round's chunk sums of min(rho q, p) per point
    # sizes
    B, N, num_chunks, rnd,
    # scalar parameters
    temperature,
    # constexprs
    PER_REQ_T: tl.constexpr, RHO_P: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """After round rnd of _tree_rho_kernel: merge its chunk sums and take one step of the search for
    every position that ran (no vocabulary). Grid (position tiles)."""
    pos, in_range, b, _rep = _position_tile(B, N, BLOCK_P)
    k, active = _rho_active(pos_ptr, temperature_ptr, brk_ptr, pos, in_range, b, rnd, temperature, PER_REQ_T)
    if tl.max(active.to(tl.int32), axis=0) > 0:
        kf = k.to(tl.float32)
        pts_i = tl.arange(0, RHO_P)[None, :]
        gs = tl.zeros([BLOCK_P, RHO_P], tl.float32)
        for c in range(0, num_chunks):
            gs += tl.load(sums_ptr + (pos[:, None] * num_chunks + c) * RHO_P + pts_i, mask=active[:, None], other=0.0)
        if rnd == 0:
            pts = _rho_first_points(kf, RHO_P)
            lo = _pick(pts, pts_i, tl.zeros_like(k))
            glo = _pick(gs, pts_i, tl.zeros_like(k))
        else:
            pts = tl.load(brk_ptr + pos[:, None] * RB_REC + RB_PTS + pts_i, mask=active[:, None], other=1.0)
            lo = tl.load(brk_ptr + pos * RB_REC + RB_LO, mask=active, other=1.0)
            glo = tl.load(brk_ptr + pos * RB_REC + RB_GLO, mask=active, other=0.0)
        lo, glo, hi, ghi, done, nxt = _rho_step(pts, gs, kf, lo, glo, RHO_P)
        rec = brk_ptr + pos * RB_REC
        tl.store(rec + RB_LO, lo, mask=active)
        tl.store(rec + RB_GLO, glo, mask=active)
        tl.store(rec + RB_HI, hi, mask=active)
        tl.store(rec + RB_GHI, ghi, mask=active)
        tl.store(rec + RB_DONE, done.to(tl.float32), mask=active)
        tl.store(rec[:, None] + RB_PTS + pts_i, nxt, mask=active[:, None])


@triton.jit(do_not_specialize=["B", "num_chunks", "rnd"])  # per-call scalars: triton/helpers.py
def _tree_rho_kernel(
    # pointers
    target_ptr,  # [B, K, G+1, V] raw target logits
    draft_ptr,  # [B, K, G, V] draft logits (mode 1) or probs (mode 2)
    temperature_ptr,  # [B] float (PER_REQ_T)
    pos_ptr,  # [B, N+1, POS_REC] int32 (_tree_positions_kernel)
    stats_ptr,  # [B*K*(G+1), 1, NUM_STATS] fp32 (row statistics)
    thr_ptr,  # [B*K*(G+1), NUM_THR] fp32 (HAS_FILTER; index cuts: BY_INDEX)
    brk_ptr,  # [B*(N+1), RB_REC] fp32: the search's record (_tree_rho_step_kernel; this round's points)
    sums_ptr,  # [B*(N+1), C, RHO_P] fp32 out: sum over the chunk of min(rho q, p) per point
    mask_ptr,  # [B, K, G+1, W] int32 (HAS_MASK): token_bitmask words of the target rows (_mask_rows)
    parents_ptr,  # [B, N] int (unless CHAINS): a tree's draft rows use their parent's mask row
    # strides: target, draft, mask (words), parents
    stride_tb, stride_tk, stride_tg, stride_db, stride_dk, stride_dg, stride_mb, stride_mk, stride_mg, stride_pb,
    # sizes
    B, K, G, V, N, chunk_size, num_chunks,
    rnd,  # this round (0 .. RHO_ROUNDS - 1): round 0 takes the first points, later ones the record's
    # scalar parameters
    temperature,
    # constexprs
    PER_REQ_T: tl.constexpr, DRAFT_MODE: tl.constexpr, HAS_FILTER: tl.constexpr,
    BY_INDEX: tl.constexpr,  # top_p_ties="by_index": thresholds carry an index cut (verify.CUT_T)
    HAS_MASK: tl.constexpr, CHAINS: tl.constexpr,  # token_bitmask; implicit parents (verify_multi)
    RHO_P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """K-SEQ's rho search, vocabulary-parallel: g = sum_x min(rho q, p) at this round's points for
    every position with siblings (k > 1) of every request that is not done, whatever path the walk
    takes. Programs of done positions read nothing. Grid (position tiles, chunks)."""
    pos, in_range, b, rep = _position_tile(B, N, BLOCK_P)
    chunk = tl.program_id(1)
    k, active = _rho_active(pos_ptr, temperature_ptr, brk_ptr, pos, in_range, b, rnd, temperature, PER_REQ_T)
    if tl.max(active.to(tl.int32), axis=0) > 0:
        first = tl.load(pos_ptr + pos * POS_REC + POS_FIRST, mask=in_range, other=0)
        t_req = per_request(temperature_ptr, temperature, b, in_range, PER_REQ_T).to(tl.float32)
        _greedy, inv_t = inverse_temperature(t_req)
        pts_i = tl.arange(0, RHO_P)[None, :]
        if rnd == 0:
            pts = _rho_first_points(k.to(tl.float32), RHO_P)
        else:
            pts = tl.load(brk_ptr + pos[:, None] * RB_REC + RB_PTS + pts_i, mask=active[:, None], other=1.0)
        m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q = _position_stats(
            stats_ptr, thr_ptr, _record(b, rep, K, G, 1), _record(b, first, K, G, 0), active, active, active,
            DRAFT_MODE, HAS_FILTER, BY_INDEX,
        )  # fmt: skip
        t_row = _row_ptr(target_ptr, b, rep, stride_tb, stride_tk, stride_tg, G, 1)[:, None]
        d_row = _row_ptr(draft_ptr, b, first, stride_db, stride_dk, stride_dg, G, 0)[:, None]
        tm_row, dm_row = _mask_rows(
            mask_ptr, parents_ptr, b, rep, first, active, stride_mb, stride_mk, stride_mg, stride_pb, G, CHAINS,
            HAS_MASK,
        )  # fmt: skip
        start_col = chunk * chunk_size
        end_col = tl.minimum(start_col + chunk_size, V)
        sums = _rho_chunk_sums(
            t_row, d_row, tm_row[:, None], dm_row[:, None], active, pts, inv_t, m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q,
            cut_q, start_col, end_col, DRAFT_MODE, BY_INDEX, HAS_MASK, RHO_P, BLOCK_P, BLOCK_V,
        )  # fmt: skip
        tl.store(sums_ptr + (pos[:, None] * num_chunks + chunk) * RHO_P + pts_i, sums, mask=active[:, None])


@triton.jit
def _rho_chunk_sums(
    t_row, d_row, tm_row, dm_row, active, pts, inv_t, m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q, start_col,
    end_col, DRAFT_MODE: tl.constexpr, BY_INDEX: tl.constexpr, HAS_MASK: tl.constexpr, RHO_P: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """sum over columns [start_col, end_col) of min(rho q, p) at each of the [BP, RHO_P] points pts,
    from the rows' statistics ([BP] each) and [BP, 1] row pointers."""
    c = (inv_t * LOG2E)[:, None]
    m_t = safe_max(m_t)[:, None]
    m_q = safe_max(m_q)[:, None]
    inv_zt = tl.where(z_t > 0.0, 1.0 / tl.where(z_t > 0.0, z_t, 1.0), 0.0)[:, None]
    inv_zq = tl.where(z_q > 0.0, 1.0 / tl.where(z_q > 0.0, z_q, 1.0), 0.0)[:, None]
    pts3 = pts[:, :, None]
    # per-lane running sums of min(rho q, p) = q min(rho, p / q): elementwise in the loop (two
    # instructions per point and entry), one reduction after it. Rows are loaded as [BP, 1, BV]
    # tiles, in the accumulator's layout: broadcasting over the points moves no data.
    t_row = t_row[:, :, None]
    d_row = d_row[:, :, None]
    c = c[:, :, None]
    m_t, m_q = m_t[:, :, None], m_q[:, :, None]
    inv_zt, inv_zq = inv_zt[:, :, None], inv_zq[:, :, None]
    thr_t, thr_q = thr_t[:, None, None], thr_q[:, None, None]
    cut_t, cut_q = cut_t[:, None, None], cut_q[:, None, None]
    mc_t, mc_q = m_t * c, m_q * c
    # exponent offsets m c + log2 z (+inf for an empty row: its probabilities are 0)
    off_t = mc_t + tl.where(inv_zt > 0.0, -tl.log2(tl.where(inv_zt > 0.0, inv_zt, 1.0)), float("inf"))
    off_q = mc_q + tl.where(inv_zq > 0.0, -tl.log2(tl.where(inv_zq > 0.0, inv_zq, 1.0)), float("inf"))
    acc = tl.zeros([BLOCK_P, RHO_P, BLOCK_V], tl.float32)
    vcols = tl.arange(0, BLOCK_V)[None, None, :]
    for start in range(start_col, end_col, BLOCK_V):
        cols = start + vcols
        lane = active[:, None, None] & (cols < end_col)
        x = tl.load(t_row + cols, mask=lane, other=float("-inf")).to(tl.float32)
        kept_t = kept_at(x, cols, thr_t, cut_t, BY_INDEX) & (x > float("-inf")) & (x < float("inf"))
        if DRAFT_MODE == DRAFT_LOGITS:
            # p = 2^a_t, q = 2^a_q with a = x c - (m c + log2 z); p / q = 2^(a_t - a_q): no division
            xq = tl.load(d_row + cols, mask=lane, other=float("-inf")).to(tl.float32)
            kept_q = kept_at(xq, cols, thr_q, cut_q, BY_INDEX) & (xq > float("-inf")) & (xq < float("inf"))
            if HAS_MASK:
                # a term is 0 where the target's or the draft's words disallow x: one bit per entry, from
                # the AND of both rows' words, in q's kept predicate (q = 0 there, so the ratio is 0 too;
                # no masked copies of the rows)
                kept_q = kept_q & allowed_tile(tm_row, start, end_col, active, BLOCK_V, HAS_MASK, dm_row)[:, None, :]
            a_t = x * c - off_t
            a_q = xq * c - off_q
            qv = tl.where(kept_q, tl.exp2(a_q), 0.0)
            ratio = tl.where(kept_t & (qv > 0.0), tl.exp2(a_t - a_q), 0.0)
        else:
            if HAS_MASK:
                kept_t = kept_t & allowed_tile(tm_row, start, end_col, active, BLOCK_V, HAS_MASK)[:, None, :]
            pv = tl.where(kept_t, tl.exp2(x * c - mc_t) * inv_zt, 0.0)
            qv, _bad_q = load_probs(d_row + cols, lane)
            ratio = tl.where(qv > 0.0, fast_div(pv, qv), 0.0)  # the term is 0 where q = 0
        acc += qv * tl.minimum(pts3, ratio)
    return tl.sum(acc, axis=2)
