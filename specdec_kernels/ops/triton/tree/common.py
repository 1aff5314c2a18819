"""What the phases of tree verification share: the records they pass each other (their field
offsets) and the device functions that read a position's rows (inlined into every kernel)."""

from __future__ import annotations

import triton
import triton.language as tl

from ....reference import verify_tree as _ref_tree
from ..helpers import DRAFT_LOGITS, DRAFT_PROBS, allowed_tile, load_logits, load_probs
from ..records import CUT_Q, CUT_T, NUM_STATS, NUM_THR, STAT_M_Q, STAT_M_T, STAT_Z_Q, STAT_Z_T, THR_Q, THR_T, load_cut
from ..row_pass import prob_of

# K-SEQ's rho search: the reference's rule (reference.verify_tree.rho_step)
RHO_POINTS = _ref_tree.RHO_POINTS
RHO_ROUNDS = _ref_tree.RHO_ROUNDS
RHO_TOL = tl.constexpr(_ref_tree.RHO_TOL)
RHO_BISECT = tl.constexpr(_ref_tree.RHO_BISECT)
RHO_MARGIN = tl.constexpr(_ref_tree.RHO_MARGIN)
RHO_EPS = tl.constexpr(_ref_tree.RHO_EPS)  # the next points' least margin, in f (reference: why)
# The rho search's record per position (fp32), rewritten by _tree_rho_step_kernel after each round:
RB_LO = tl.constexpr(0)  # bracket's lower end and g = sum_x min(rho q, p) there
RB_GLO = tl.constexpr(1)
RB_HI = tl.constexpr(2)  # upper end (rho) and g there (beta = g / rho)
RB_GHI = tl.constexpr(3)
RB_DONE = tl.constexpr(4)  # 1: converged, no more rounds
RB_PTS = tl.constexpr(8)  # the next round's RHO_POINTS points
RB_REC_HOST = 8 + RHO_POINTS
RB_REC = tl.constexpr(RB_REC_HOST)
# Position records of _tree_positions_kernel (int32): candidate count, first candidate.
POS_K = tl.constexpr(0)
POS_FIRST = tl.constexpr(1)
POS_TOK = tl.constexpr(2)  # tokens of the first RRS_MAX candidates, by rank (RRS's residual masses)
RRS_MAX_HOST = 8  # RRS residual masses Z_1 .. Z_7 come from _tree_rrs_kernel, later ones from the walk
RRS_MAX = tl.constexpr(RRS_MAX_HOST)
POS_REC_HOST = 2 + RRS_MAX_HOST
POS_REC = tl.constexpr(POS_REC_HOST)
# The race's record, written by the walk for _tree_race_kernel: int32 fields ...
RI_FLAG = tl.constexpr(0)  # 1: the request races (a sampled request that did not end by acceptance)
RI_REP = tl.constexpr(1)  # first node of the position (-1 = root): its target row and Philox counter
RI_FIRST = tl.constexpr(2)  # first candidate: its draft row is the position's q
RI_HAS = tl.constexpr(3)  # 1: the position has candidates (recovered token), 0: a leaf (bonus token)
RI_STEPS = tl.constexpr(4)  # RRS rejections
RI_DEPTH = tl.constexpr(5)  # accepted tokens: the output slot of the raced token
RACE_I_HOST = 6
RACE_I = tl.constexpr(RACE_I_HOST)
# ... and fp32 fields
RF_RHO = tl.constexpr(0)  # K-SEQ rho
RF_SCALE = tl.constexpr(1)  # K-SEQ c = (1 - (1 - beta)^k) / beta
RACE_F_HOST = 2
RACE_F = tl.constexpr(RACE_F_HOST)


@triton.jit
def _slots(G):
    """G as a divisor: chains without slots (G = 0) hold no nodes, so whatever a node index divided
    by it gives is never used (every node of such a tree is padding); 1 keeps the division defined."""
    return tl.maximum(G, 1)


@triton.jit
def _record(b, node, K, G, TARGET: tl.constexpr):
    """Row-statistics record of a node's target row (node -1 = root) or of its draft row."""
    chain = tl.where(node < 0, 0, node // _slots(G))
    slot = tl.where(node < 0, 0, node % _slots(G) + TARGET)
    return (b * K + chain) * (G + 1) + slot


@triton.jit
def _row_ptr(base, b, node, stride_b, stride_k, stride_g, G, TARGET: tl.constexpr):
    chain = tl.where(node < 0, 0, node // _slots(G)).to(tl.int64)
    slot = tl.where(node < 0, 0, node % _slots(G) + TARGET).to(tl.int64)
    return base + b * stride_b + chain * stride_k + slot * stride_g


@triton.jit
def _mask_rows(
    mask_ptr, parents_ptr, b, rep, first, ok, stride_mb, stride_mk, stride_mg, stride_pb, G, CHAINS: tl.constexpr,
    HAS_MASK: tl.constexpr,
):  # fmt: skip
    """The token_bitmask rows (HAS_MASK; else any pointer, never read) of a position's target row
    (node rep's, as ``_row_ptr``) and of its first candidate's draft row: verify_multi's draft row
    [k, i] uses mask row [k, i]; verify_tree's node uses the row of its parent, parents[first] + 1
    (clamped as ``_bitmask.tree_draft_mask``; row 0 for the root's children)."""
    t_mask = _row_ptr(mask_ptr, b, rep, stride_mb, stride_mk, stride_mg, G, 1)
    d_mask = t_mask
    if HAS_MASK:
        if CHAINS:
            d_mask = _row_ptr(mask_ptr, b, first, stride_mb, stride_mk, stride_mg, G, 0)
        else:
            par = tl.load(parents_ptr + b * stride_pb + first, mask=ok, other=-1)
            par = tl.minimum(tl.maximum(par, -1), G - 1)
            d_mask = _row_ptr(mask_ptr, b, par, stride_mb, stride_mk, stride_mg, G, 1)
    return t_mask, d_mask


@triton.jit
def _pick(vals, cols, j):
    """vals[b, j[b]] of a [BLOCK_B, N] tile."""
    return tl.sum(tl.where(cols == j[:, None], vals, 0), axis=1)


@triton.jit
def _position_tiles(
    t_row, d_row, tm_row, dm_row, start, end, rows, rows_q, m_t, z_t, thr_t, m_q, z_q, thr_q, inv_t, cut_t, cut_q,
    DRAFT_MODE: tl.constexpr, BY_INDEX: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """(target logits, p, q) on the [BB, BLOCK_V] tile at columns start + arange(BLOCK_V) (< end) of
    the position's target rows (where `rows`) and draft rows (where `rows_q`), under their
    token_bitmask rows tm_row / dm_row (HAS_MASK)."""
    cols = start + tl.arange(0, BLOCK_V)[None, :]
    lane = rows[:, None] & (cols < end)
    lane_q = rows_q[:, None] & (cols < end)
    t_bits = None
    d_bits = None
    if HAS_MASK:
        t_bits = allowed_tile(tm_row[:, None], start, end, rows, BLOCK_V, HAS_MASK)
        d_bits = allowed_tile(dm_row[:, None], start, end, rows_q, BLOCK_V, HAS_MASK)
    xt, _bad_t = load_logits(t_row[:, None] + cols, lane, t_bits)
    pv = prob_of(xt, m_t[:, None], z_t[:, None], thr_t[:, None], inv_t[:, None], cols, cut_t[:, None], BY_INDEX)
    if DRAFT_MODE == DRAFT_LOGITS:
        xq, _bad_q = load_logits(d_row[:, None] + cols, lane_q, d_bits)
        qv = prob_of(xq, m_q[:, None], z_q[:, None], thr_q[:, None], inv_t[:, None], cols, cut_q[:, None], BY_INDEX)
    elif DRAFT_MODE == DRAFT_PROBS:
        qv, _bad_qv = load_probs(d_row[:, None] + cols, lane_q)
    else:
        qv = tl.zeros_like(pv)
    return xt, pv, qv


@triton.jit
def _rrs_residual(p, q, steps, zs, xs, ds, x_ids, cols, WOR: tl.constexpr):
    """Unnormalised RRS residual after `steps` rejections (per lane), elementwise on [BB, X] tiles.

    r_0 = p; r_{l+1} = max(r_l / Z_l - q_l, 0) where q_l = q (with replacement) or q without the
    tokens rejected before l, over D_l (without replacement). zs, xs, ds: [BB, NP2] by rank.
    """
    r = p
    removed = (x_ids < 0) & (p != p)  # all False, with the shape of p
    for step in range(0, tl.max(steps, axis=0)):
        live = (step < steps)[:, None]
        z = _pick(zs, cols, step + tl.zeros_like(steps))[:, None]
        q_l = q
        if WOR:
            d = _pick(ds, cols, step + tl.zeros_like(steps))[:, None]
            q_l = tl.where(removed | (d <= 0.0), 0.0, q / tl.where(d > 0.0, d, 1.0))
            x_l = _pick(xs, cols, step + tl.zeros_like(steps))[:, None]
            removed = removed | (live & (x_ids == x_l))
        nxt = tl.maximum(tl.where(z > 0.0, r / tl.where(z > 0.0, z, 1.0), 0.0) - q_l, 0.0)
        r = tl.where(live, nxt, r)
    return r


@triton.jit
def _tree_nodes(
    tokens_ptr, parents_ptr, b, nodes, n_nodes, stride_xb, stride_xk, stride_pb, G, V, CHAINS: tl.constexpr
):
    """(token, usable token, parent) of each node in `nodes` (parent -2 for padding nodes)."""
    node_ok = nodes < n_nodes
    tok = tl.load(
        tokens_ptr + b * stride_xb + (nodes // _slots(G)).to(tl.int64) * stride_xk + nodes % _slots(G),
        mask=node_ok,
        other=-1,
    )
    tok = tok.to(tl.int64)
    tok_ok = node_ok & (tok >= 0) & (tok < V)
    if CHAINS:
        par = tl.where(nodes % _slots(G) == 0, -1, nodes - 1)
    else:
        par = tl.load(parents_ptr + b * stride_pb + nodes, mask=node_ok, other=-2).to(tl.int32)
    return tl.where(tok_ok, tok, -1), tok_ok, tl.where(node_ok, par, -2)


@triton.jit
def _position_tile(B, N, BLOCK_P: tl.constexpr):
    """(positions, in range, request, first node (-1 = the root)) of this program's BLOCK_P positions
    (position b * (N + 1) + 1 + n is node n's set, b * (N + 1) the root)."""
    pos = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P).to(tl.int64)
    in_range = pos < B * (N + 1)
    b = pos // (N + 1)
    rep = (pos % (N + 1) - 1).to(tl.int32)
    return pos, in_range, b, rep


@triton.jit
def _position_stats(
    stats_ptr, thr_ptr, rec_t, rec_q, mask_t, mask_thr_t, mask_q, DRAFT_MODE: tl.constexpr, HAS_FILTER: tl.constexpr,
    BY_INDEX: tl.constexpr,
):  # fmt: skip
    """Row statistics of a position's target row (record rec_t) and draft row (rec_q): (m_t, z_t,
    thr_t, cut_t, m_q, z_q, thr_q, cut_q); thresholds -inf and cuts 0 where nothing is filtered."""
    m_t = tl.load(stats_ptr + rec_t * NUM_STATS + STAT_M_T, mask=mask_t, other=0.0)
    z_t = tl.load(stats_ptr + rec_t * NUM_STATS + STAT_Z_T, mask=mask_t, other=0.0)
    m_q = tl.load(stats_ptr + rec_q * NUM_STATS + STAT_M_Q, mask=mask_q, other=0.0)
    z_q = tl.load(stats_ptr + rec_q * NUM_STATS + STAT_Z_Q, mask=mask_q, other=0.0)
    thr_t = tl.full(m_t.shape, float("-inf"), tl.float32)
    thr_q = tl.full(m_t.shape, float("-inf"), tl.float32)
    cut_t = tl.zeros(m_t.shape, tl.int32)
    cut_q = tl.zeros(m_t.shape, tl.int32)
    if HAS_FILTER:
        thr_t = tl.load(thr_ptr + rec_t * NUM_THR + THR_T, mask=mask_thr_t, other=float("-inf"))
        cut_t = load_cut(thr_ptr + rec_t * NUM_THR + CUT_T, mask_thr_t, BY_INDEX)
        if DRAFT_MODE == DRAFT_LOGITS:
            thr_q = tl.load(thr_ptr + rec_q * NUM_THR + THR_Q, mask=mask_q, other=float("-inf"))
            cut_q = load_cut(thr_ptr + rec_q * NUM_THR + CUT_Q, mask_q, BY_INDEX)
    return m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q


@triton.jit
def _rrs_start(ranks, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    """RRS state before any rejection, by rank on [BLOCK, WIDTH] tiles: normalisers Z (Z_0 = 1),
    WOR q masses D (D_0 = 1) and rejected tokens (none: -1)."""
    zs = tl.zeros([BLOCK, WIDTH], tl.float32) + tl.where(ranks == 0, 1.0, 0.0)
    ds = tl.zeros([BLOCK, WIDTH], tl.float32) + tl.where(ranks == 0, 1.0, 0.0)
    xs = tl.full([BLOCK, WIDTH], -1, tl.int64)
    return zs, ds, xs


@triton.jit
def _store_race(
    race_i_ptr, race_f_ptr, race_zs_ptr, race_ds_ptr, race_xs_ptr, b, b_ok, r_flag, r_rep, r_first, r_has, r_steps,
    depth, r_rho, r_scale, r_zs, r_ds, r_xs, nodes, NP2: tl.constexpr,
):  # fmt: skip
    """The race's record: (flag, position, first candidate, has candidates, steps, depth) int32, (rho,
    scale) fp32, and per rank the RRS normalisers / WOR masses (fp32) and rejected (one-hot:
    candidate) tokens."""
    rec_i = race_i_ptr + b * RACE_I
    tl.store(rec_i + RI_FLAG, r_flag.to(tl.int32), mask=b_ok)
    tl.store(rec_i + RI_REP, r_rep, mask=b_ok)
    tl.store(rec_i + RI_FIRST, r_first, mask=b_ok)
    tl.store(rec_i + RI_HAS, r_has.to(tl.int32), mask=b_ok)
    tl.store(rec_i + RI_STEPS, r_steps, mask=b_ok)
    tl.store(rec_i + RI_DEPTH, depth, mask=b_ok)
    tl.store(race_f_ptr + b * RACE_F + RF_RHO, r_rho, mask=b_ok)
    tl.store(race_f_ptr + b * RACE_F + RF_SCALE, r_scale, mask=b_ok)
    ranks = b[:, None] * NP2 + nodes
    tl.store(race_zs_ptr + ranks, r_zs, mask=b_ok[:, None])
    tl.store(race_ds_ptr + ranks, r_ds, mask=b_ok[:, None])
    tl.store(race_xs_ptr + ranks, r_xs, mask=b_ok[:, None])


@triton.jit
def _load_race(race_i_ptr, race_f_ptr, race_zs_ptr, race_ds_ptr, race_xs_ptr, b, race, nodes, NP2: tl.constexpr):
    """The race's record the walk wrote (_store_race): (position, first candidate, has candidates,
    RRS steps, K-SEQ rho and scale, RRS normalisers / WOR masses / rejected tokens by rank)."""
    rep = tl.load(race_i_ptr + b * RACE_I + RI_REP, mask=race, other=-1)
    first = tl.load(race_i_ptr + b * RACE_I + RI_FIRST, mask=race, other=0)
    has_cand = tl.load(race_i_ptr + b * RACE_I + RI_HAS, mask=race, other=0) != 0
    steps = tl.load(race_i_ptr + b * RACE_I + RI_STEPS, mask=race, other=0)
    rho = tl.load(race_f_ptr + b * RACE_F + RF_RHO, mask=race, other=1.0)
    scale = tl.load(race_f_ptr + b * RACE_F + RF_SCALE, mask=race, other=1.0)
    ranks = b[:, None] * NP2 + nodes
    zs = tl.load(race_zs_ptr + ranks, mask=race[:, None], other=0.0)
    ds = tl.load(race_ds_ptr + ranks, mask=race[:, None], other=0.0)
    xs = tl.load(race_xs_ptr + ranks, mask=race[:, None], other=-1)
    return rep, first, has_cand, steps, rho, scale, zs, ds, xs
