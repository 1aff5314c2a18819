"""Phase 3 of tree verification, RRS: the residual masses Z_1 .. Z_{RRS_MAX-1} of every position,
before the walk and split over the vocabulary."""

from __future__ import annotations

import triton
import triton.language as tl

from ..helpers import DRAFT_LOGITS, allowed_at, inverse_temperature, load_logits, load_probs, per_request
from ..row_pass import prob_of
from .common import (
    POS_FIRST,
    POS_K,
    POS_REC,
    POS_TOK,
    RRS_MAX,
    _mask_rows,
    _position_stats,
    _position_tile,
    _position_tiles,
    _record,
    _row_ptr,
    _rrs_residual,
    _rrs_start,
)


@triton.jit(do_not_specialize=["B", "num_chunks", "rnd"])  # per-call scalars: triton/helpers.py
def _tree_rrs_kernel(
    # pointers
    target_ptr,  # [B, K, G+1, V] raw target logits
    draft_ptr,  # [B, K, G, V] draft logits (mode 1) or probs (mode 2)
    temperature_ptr,  # [B] float (PER_REQ_T)
    pos_ptr,  # [B, N+1, POS_REC] int32 (_tree_positions_kernel)
    stats_ptr,  # [B*K*(G+1), 1, NUM_STATS] fp32 (row statistics)
    thr_ptr,  # [B*K*(G+1), NUM_THR] fp32 (HAS_FILTER; index cuts: BY_INDEX)
    sums_ptr,  # [RRS_MAX - 1, B*(N+1), C] fp32: chunk sums of Z_j (round j at j - 1)
    mask_ptr,  # [B, K, G+1, W] int32 (HAS_MASK): token_bitmask words of the target rows (_mask_rows)
    parents_ptr,  # [B, N] int (unless CHAINS): a tree's draft rows use their parent's mask row
    # strides: target, draft, mask (words), parents
    stride_tb, stride_tk, stride_tg, stride_db, stride_dk, stride_dg, stride_mb, stride_mk, stride_mg, stride_pb,
    # sizes
    B, K, G, V, N, chunk_size, num_chunks,
    rnd,  # j in 1 .. RRS_MAX - 1: the mass Z_j of the residual after j rejections
    # scalar parameters
    temperature,
    # constexprs
    PER_REQ_T: tl.constexpr, DRAFT_MODE: tl.constexpr, HAS_FILTER: tl.constexpr, BY_INDEX: tl.constexpr,
    WOR: tl.constexpr, FIRST_ROUND: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_MASK: tl.constexpr, CHAINS: tl.constexpr,  # token_bitmask; implicit parents (verify_multi)
):  # fmt: skip
    """RRS's residual masses before the walk, split over the vocabulary: round j sums the residual
    left after the first j candidates of a position are rejected (the candidates and their order
    are fixed by the tree), for every position with more than j candidates. Grid (position tiles, chunks).

    FIRST_ROUND (rnd == 1, set by the launcher) compiles round 1 with rnd a constant: no earlier
    round's sums, one rejected token, and the residual's rank tiles fold to constants (48 instead of
    71 registers for rrs_wor on sm_90; rnd itself is per-call, see triton/helpers.py)."""
    if FIRST_ROUND:
        rnd = 1
    pos, in_range, b, rep = _position_tile(B, N, BLOCK_P)
    chunk = tl.program_id(1)
    k = tl.load(pos_ptr + pos * POS_REC + POS_K, mask=in_range, other=0)
    temperature = per_request(temperature_ptr, temperature, b, in_range, PER_REQ_T).to(tl.float32)
    greedy, inv_t = inverse_temperature(temperature)
    active = in_range & ~greedy & (k > rnd)
    if tl.max(active.to(tl.int32), axis=0) > 0:
        first = tl.load(pos_ptr + pos * POS_REC + POS_FIRST, mask=active, other=0)
        m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q = _position_stats(
            stats_ptr, thr_ptr, _record(b, rep, K, G, 1), _record(b, first, K, G, 0), active, active, active,
            DRAFT_MODE, HAS_FILTER, BY_INDEX,
        )  # fmt: skip
        t_row = _row_ptr(target_ptr, b, rep, stride_tb, stride_tk, stride_tg, G, 1)
        d_row = _row_ptr(draft_ptr, b, first, stride_db, stride_dk, stride_dg, G, 0)
        tm_row, dm_row = _mask_rows(
            mask_ptr, parents_ptr, b, rep, first, active, stride_mb, stride_mk, stride_mg, stride_pb, G, CHAINS,
            HAS_MASK,
        )  # fmt: skip
        ranks = tl.arange(0, RRS_MAX)[None, :]
        zs, ds, xs = _rrs_prefix(
            pos_ptr, sums_ptr, d_row, dm_row, pos, active, B * (N + 1), num_chunks, rnd, m_q, z_q, thr_q, cut_q, inv_t,
            ranks, DRAFT_MODE, BY_INDEX, WOR, HAS_MASK, BLOCK_P,
        )  # fmt: skip
        steps = tl.zeros([BLOCK_P], tl.int32) + rnd
        xs32 = xs.to(tl.int32)  # -1 or token ids from the int32 position records: exact in int32
        acc = tl.zeros([BLOCK_P, BLOCK_V], tl.float32)
        start_col = chunk * chunk_size
        end_col = tl.minimum(start_col + chunk_size, V)
        vcols = tl.arange(0, BLOCK_V)[None, :]
        for start in range(start_col, end_col, BLOCK_V):
            cols = start + vcols
            lane = active[:, None] & (cols < end_col)
            _x, pv, qv = _position_tiles(
                t_row, d_row, tm_row, dm_row, start, end_col, active, active, m_t, z_t, thr_t, m_q, z_q, thr_q, inv_t,
                cut_t, cut_q, DRAFT_MODE, BY_INDEX, HAS_MASK, BLOCK_V,
            )  # fmt: skip
            r = _rrs_residual(pv, qv, steps, zs, xs32, ds, cols, ranks, WOR)
            acc += tl.where(lane, r, 0.0)
        tl.store(sums_ptr + ((rnd - 1) * B * (N + 1) + pos) * num_chunks + chunk, tl.sum(acc, axis=1), mask=active)


@triton.jit
def _rrs_prefix(
    pos_ptr, sums_ptr, d_row, dm_row, pos, active, P, num_chunks, rnd, m_q, z_q, thr_q, cut_q, inv_t, ranks,
    DRAFT_MODE: tl.constexpr, BY_INDEX: tl.constexpr, WOR: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_P: tl.constexpr,
):  # fmt: skip
    """The walk's RRS state after the first rnd rejections, by rank (as in _tree_walk_kernel): the
    normalisers Z_1 .. Z_{rnd-1} of earlier rounds, WOR's q masses and rejected tokens."""
    zs, ds, xs = _rrs_start(ranks, BLOCK_P, RRS_MAX)
    for j in range(0, rnd):
        x_j = tl.load(pos_ptr + pos * POS_REC + POS_TOK + j, mask=active, other=0).to(tl.int64)
        if j > 0:
            z_j = tl.zeros([BLOCK_P], tl.float32)
            for c in range(0, num_chunks):
                z_j += tl.load(sums_ptr + ((j - 1) * P + pos) * num_chunks + c, mask=active, other=0.0)
            zs = tl.where(ranks == j, z_j[:, None], zs)
        if WOR:
            if DRAFT_MODE == DRAFT_LOGITS:
                xq, _bad = load_logits(d_row + x_j, allowed_at(dm_row, x_j, active, HAS_MASK))
                q_x = prob_of(xq, m_q, z_q, thr_q, inv_t, x_j, cut_q, BY_INDEX)
            else:
                q_x, _bad = load_probs(d_row + x_j, active)
            d_now = tl.sum(tl.where(ranks == j, ds, 0.0), axis=1)
            repeated = tl.sum((xs == x_j[:, None]).to(tl.int32), axis=1) > 0
            ds = tl.where(ranks == j + 1, tl.where(repeated, d_now, d_now - q_x)[:, None], ds)
            xs = tl.where((ranks == j) & ~repeated[:, None], x_j[:, None], xs)
    return zs, ds, xs
