"""Multi-draft and token-tree verification: SpecTr K-SEQ and recursive rejection sampling.

No host synchronisation, no Python loop over requests or nodes. Everything that does not depend on
the random path runs before the walk, split over the vocabulary; the walk itself reads no logits row
(except RRS positions with more than RRS_MAX candidates):

1. ``_tree_positions_kernel`` grid (requests): the positions a walk can reach (node sets spelling the
   same token path, named by their first node), their candidate counts, first candidates and the
   first candidates' tokens by rank - from the tree alone - and the rows they use (sampled requests
   with draft distributions; greedy and one-hot calls skip it).
2. ``_verify_row_stats_kernel`` (shared with ``verify``): online max / sum-exp, greedy argmax and
   top-k/top-p thresholds of every used target row and draft row of the tree (chunks merged once):
   later siblings' draft rows are never read (their prefix is the first sibling's).
3. K-SEQ: ``_tree_rho_kernel`` grid (positions, vocabulary chunks), RHO_ROUNDS launches: g(rho) at
   one round's RHO_POINTS points of the rho* search (``reference.verify_tree.rho_search``) for every
   position with siblings whose search is not done, each followed by ``_tree_rho_step_kernel`` grid
   (positions): the bracket, the stop test and the next round's points. RRS: ``_tree_rrs_kernel``,
   one launch per rejection count j: the mass Z_j of the residual left after the first j candidates
   of every position are rejected.
4. ``_tree_walk_kernel`` grid (request tiles): walks each request's tree from the root with the
   gathered p(x), q(x) of the candidates and the precomputed rho / Z_j, writes the accepted path and
   records the race it ends with (position, rho and scale, RRS state).
5. ``_tree_race_kernel`` grid (request tiles, vocabulary chunks): the recovered / bonus token's
   exponential race over the residual, which - like p and q - is never written to memory;
   ``_tree_finalize_kernel`` merges the chunks' winners.

The semantics (the walk over node *sets*, so repeated sibling tokens act with multiplicity) are
specified by ``specdec_kernels.reference.verify_tree``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._interpreter import multiprocessors, plans_for_interpreter
from ..._params import MIN_TEMPERATURE
from ..._tree_args import TreeArgs
from ..._types import METHODS, TreeVerifyOutput
from ...reference import verify_tree as _ref_tree
from .helpers import (
    DRAFT_LOGITS,
    DRAFT_NONE,
    DRAFT_PROBS,
    LOG2E,
    PURPOSE_ACCEPT,
    PURPOSE_BONUS,
    PURPOSE_RECOVER,
    cdiv,
    fast_div,
    first_argmax_update,
    inverse_temperature,
    kept_at,
    load_logits,
    load_probs,
    log_floored,
    next_pow2,
    per_request,
    race_noise,
    request_seed,
    safe_max,
    uniform_open,
)
from .launch import tile_settings
from .row_pass import (
    CUT_Q,
    CUT_T,
    IDX_GREEDY,
    NUM_IDX,
    NUM_IDX_HOST,
    NUM_STATS,
    NUM_STATS_HOST,
    NUM_THR,
    NUM_THR_HOST,
    PHASE_STATS,
    STAT_BAD_Q,
    STAT_BAD_T,
    STAT_M_Q,
    STAT_M_T,
    STAT_Z_Q,
    STAT_Z_T,
    THR_Q,
    THR_T,
    _verify_row_stats_kernel,
    launch_threshold_phases,
    load_cut,
    merge_chunk_stats,
    prob_of,
    threshold_plan,
)

# K-SEQ's rho search: the reference's rule (reference.verify_tree.rho_step)
RHO_POINTS = _ref_tree.RHO_POINTS
RHO_ROUNDS = _ref_tree.RHO_ROUNDS
RHO_TOL = tl.constexpr(_ref_tree.RHO_TOL)
RHO_BISECT = tl.constexpr(_ref_tree.RHO_BISECT)
RHO_MARGIN = tl.constexpr(_ref_tree.RHO_MARGIN)
RHO_EPS = tl.constexpr(2.0**-_ref_tree.RHO_BISECT)  # the bisection's resolution on [lo, hi]
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
def _pick(vals, cols, j):
    """vals[b, j[b]] of a [BLOCK_B, N] tile."""
    return tl.sum(tl.where(cols == j[:, None], vals, 0), axis=1)


@triton.jit
def _position_tiles(
    t_row, d_row, cols, lane, lane_q, m_t, z_t, thr_t, m_q, z_q, thr_q, inv_t, cut_t, cut_q, DRAFT_MODE: tl.constexpr,
    BY_INDEX: tl.constexpr,
):  # fmt: skip
    """(target logits, p, q) on a [BB, BLOCK_V] tile of the position's target and draft rows
    (the draft row is read where lane_q holds)."""
    xt, _bad_t = load_logits(t_row[:, None] + cols, lane)
    pv = prob_of(xt, m_t[:, None], z_t[:, None], thr_t[:, None], inv_t[:, None], cols, cut_t[:, None], BY_INDEX)
    if DRAFT_MODE == DRAFT_LOGITS:
        xq, _bad_q = load_logits(d_row[:, None] + cols, lane_q)
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


@triton.jit(do_not_specialize=["B"])  # per-call scalars: triton/helpers.py
def _tree_positions_kernel(
    # pointers
    tokens_ptr,  # [B, K, G] int: node tokens (node = chain * G + slot)
    parents_ptr,  # [B, N] int (unless CHAINS)
    num_nodes_ptr,  # [B] int (PER_REQ_N)
    pos_ptr,  # [B, N+1, POS_REC] int32 out: per position (slot 0 = root, 1 + n = node n)
    use_ptr,  # [B*K*(G+1), 2] int8 out: the row pass's record use (target row, draft row)
    # strides
    stride_xb,
    stride_xk,
    stride_pb,
    # sizes
    B,
    K,
    G,
    V,
    N,
    D,
    # constexprs
    PER_REQ_N: tl.constexpr,
    CHAINS: tl.constexpr,
    NP2: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """The positions a walk can reach, from the tree alone (no randomness): nodes spelling the same
    token path form one position (the walk's node set), named by its first node. For each position:
    its candidate count k (0 when the node is not the first of its set) and its first candidate (whose
    draft row is the position's q). And the rows the row pass reads: the positions' target rows and
    their first candidates' draft rows; no walk uses the others (later siblings' draft rows, rows of
    nodes repeating a sibling's token). BLOCK_B requests per program (1 on a GPU; a tile of them in
    the interpreter, where a program per request costs more than its work); D rounds of
    [BLOCK_B, NP2, NP2] bit tiles."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    b_ok = b < B
    n_nodes = per_request(num_nodes_ptr, N, b, b_ok, PER_REQ_N).to(tl.int32)
    n_nodes = tl.where(b_ok, n_nodes, 0)[:, None, None]  # requests past B have no nodes
    b3 = b[:, None, None]
    ni = tl.arange(0, NP2)[None, :, None]
    nj = tl.arange(0, NP2)[None, None, :]
    tok_i, ok_i, par_i = _tree_nodes(
        tokens_ptr, parents_ptr, b3, ni, n_nodes, stride_xb, stride_xk, stride_pb, G, V, CHAINS
    )
    tok_j, ok_j, par_j = _tree_nodes(
        tokens_ptr, parents_ptr, b3, nj, n_nodes, stride_xb, stride_xk, stride_pb, G, V, CHAINS
    )
    tok_eq = (tok_i == tok_j) & ok_i & ok_j
    both_root = (par_i == -1) & (par_j == -1)
    one = tl.full([BLOCK_B, NP2, NP2], 1, tl.int64)
    rel = tok_eq & both_root
    bits = tl.sum(tl.where(rel, one << nj.to(tl.int64), 0), axis=2)  # [BB, NP2]: same-path set of node i
    for _depth in range(0, D):  # nodes at depth d + 1 are settled after d rounds
        par_bits = tl.sum(tl.where(nj == par_i, bits[:, None, :], 0), axis=2)  # bits[parent(i)]
        same_parent = ((par_bits[:, :, None] >> tl.maximum(par_j, 0).to(tl.int64)) & 1) != 0
        rel = tok_eq & (both_root | ((par_i >= 0) & (par_j >= 0) & same_parent))
        bits = tl.sum(tl.where(rel, one << nj.to(tl.int64), 0), axis=2)
    n = tl.arange(0, NP2)[None, :]
    rep = tl.min(tl.where(rel, nj, NP2), axis=2)  # [BB, NP2]: first node of each node's set
    is_first = rep == n
    rep_of_parent = tl.sum(tl.where(ni == par_j, rep[:, :, None], 0), axis=1)  # [BB, NP2] over j
    member = ok_j & (par_j >= 0) & (rep_of_parent[:, None, :] == ni) & is_first[:, :, None]
    k = tl.sum(member.to(tl.int32), axis=2)
    first = tl.min(tl.where(member, nj, NP2), axis=2)
    root_member = ok_j & (par_j == -1)  # [BB, 1, NP2]
    k_root = tl.sum(root_member.to(tl.int32), axis=2)  # [BB, 1]
    first_root = tl.min(tl.where(root_member, nj, NP2), axis=2)
    base = (pos_ptr + b * (N + 1) * POS_REC)[:, None]
    r0 = tl.arange(0, 1)[None, :]
    ok_root = b_ok[:, None]
    ok_node = b_ok[:, None] & (n < N)
    tl.store(base + r0 * POS_REC + POS_K, k_root, mask=ok_root)
    tl.store(base + r0 * POS_REC + POS_FIRST, first_root, mask=ok_root)
    tl.store(base + (1 + n) * POS_REC + POS_K, k, mask=ok_node)
    tl.store(base + (1 + n) * POS_REC + POS_FIRST, first, mask=ok_node)
    # candidate tokens by rank (RRS's residual masses before the walk)
    rank = tl.cumsum(member.to(tl.int32), axis=2) - 1
    root_rank = tl.cumsum(root_member.to(tl.int32), axis=2) - 1
    for r in range(0, RRS_MAX):  # a loop, not unrolled: the program is near the register limit
        x_r = tl.sum(tl.where(member & (rank == r), tok_j, 0), axis=2).to(tl.int32)
        tl.store(base + (1 + n) * POS_REC + POS_TOK + r, x_r, mask=ok_node)
        x_root = tl.sum(tl.where(root_member & (root_rank == r), tok_j, 0), axis=2).to(tl.int32)
        tl.store(base + r0 * POS_REC + POS_TOK + r, x_root, mask=ok_root)
    _store_row_use(use_ptr, b[:, None], n, ok_root, ok_node, is_first, k, first, k_root, first_root, K, G)


@triton.jit
def _store_row_use(use_ptr, b, n, ok_root, ok_node, is_first, k, first, k_root, first_root, K, G):
    """Marks the rows the row pass reads in use_ptr (zeroed by the launcher; [BB, 1] requests, [1, NP2]
    nodes): the root's target row and each position's (its first node's), and the draft row of each
    position's first candidate - scattered ones (distinct positions have distinct first candidates).
    Left unmarked: copies of the root row (chains k > 0), later siblings' draft rows, rows of nodes
    repeating a sibling's token."""
    one_root = tl.full(ok_root.shape, 1, tl.int8)
    one = tl.full(ok_node.shape, 1, tl.int8)
    tl.store(use_ptr + b * K * (G + 1) * 2, one_root, mask=ok_root)
    tl.store(use_ptr + _record(b, first_root, K, G, 0) * 2 + 1, one_root, mask=ok_root & (k_root > 0))
    tl.store(use_ptr + _record(b, n, K, G, 1) * 2, one, mask=ok_node & is_first)
    tl.store(use_ptr + _record(b, first, K, G, 0) * 2 + 1, one, mask=ok_node & (k > 0))


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
    margin = RHO_MARGIN * (x1 - x0) + w * RHO_EPS
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
    B,
    N,
    num_chunks,
    rnd,
    # scalar parameters
    temperature,
    # constexprs
    PER_REQ_T: tl.constexpr,
    RHO_P: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """After round rnd of _tree_rho_kernel: merge its chunk sums and take one step of the search for
    every position that ran (no vocabulary). Grid (position tiles)."""
    P = B * (N + 1)
    pos = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P).to(tl.int64)
    in_range = pos < P
    b = pos // (N + 1)
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
    # strides
    stride_tb,
    stride_tk,
    stride_tg,
    stride_db,
    stride_dk,
    stride_dg,
    # sizes
    B,
    K,
    G,
    V,
    N,
    chunk_size,
    num_chunks,
    rnd,  # this round (0 .. RHO_ROUNDS - 1): round 0 takes the first points, later ones the record's
    # scalar parameters
    temperature,
    # constexprs
    PER_REQ_T: tl.constexpr,
    DRAFT_MODE: tl.constexpr,
    HAS_FILTER: tl.constexpr,
    BY_INDEX: tl.constexpr,  # top_p_ties="by_index": thresholds carry an index cut (verify.CUT_T)
    RHO_P: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """K-SEQ's rho search, vocabulary-parallel: g = sum_x min(rho q, p) at this round's points for
    every position with siblings (k > 1) of every request that is not done, whatever path the walk
    takes. Programs of done positions read nothing. Grid (position tiles, chunks)."""
    P = B * (N + 1)
    pos = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P).to(tl.int64)
    chunk = tl.program_id(1)
    in_range = pos < P
    b = pos // (N + 1)
    rep = (pos % (N + 1) - 1).to(tl.int32)  # -1: the root
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

        rec_t = _record(b, rep, K, G, 1)
        rec_q = _record(b, first, K, G, 0)
        m_t = tl.load(stats_ptr + rec_t * NUM_STATS + STAT_M_T, mask=active, other=0.0)
        z_t = tl.load(stats_ptr + rec_t * NUM_STATS + STAT_Z_T, mask=active, other=0.0)
        m_q = tl.load(stats_ptr + rec_q * NUM_STATS + STAT_M_Q, mask=active, other=0.0)
        z_q = tl.load(stats_ptr + rec_q * NUM_STATS + STAT_Z_Q, mask=active, other=0.0)
        thr_t = tl.full([BLOCK_P], float("-inf"), tl.float32)
        thr_q = tl.full([BLOCK_P], float("-inf"), tl.float32)
        cut_t = tl.zeros([BLOCK_P], tl.int32)
        cut_q = tl.zeros([BLOCK_P], tl.int32)
        if HAS_FILTER:
            thr_t = tl.load(thr_ptr + rec_t * NUM_THR + THR_T, mask=active, other=float("-inf"))
            cut_t = load_cut(thr_ptr + rec_t * NUM_THR + CUT_T, active, BY_INDEX)
            if DRAFT_MODE == DRAFT_LOGITS:
                thr_q = tl.load(thr_ptr + rec_q * NUM_THR + THR_Q, mask=active, other=float("-inf"))
                cut_q = load_cut(thr_ptr + rec_q * NUM_THR + CUT_Q, active, BY_INDEX)
        t_row = _row_ptr(target_ptr, b, rep, stride_tb, stride_tk, stride_tg, G, 1)[:, None]
        d_row = _row_ptr(draft_ptr, b, first, stride_db, stride_dk, stride_dg, G, 0)[:, None]
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
        start_col = chunk * chunk_size
        end_col = tl.minimum(start_col + chunk_size, V)
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
                a_t = x * c - off_t
                a_q = xq * c - off_q
                qv = tl.where(kept_q, tl.exp2(a_q), 0.0)
                ratio = tl.where(kept_t & (qv > 0.0), tl.exp2(a_t - a_q), 0.0)
            else:
                pv = tl.where(kept_t, tl.exp2(x * c - mc_t) * inv_zt, 0.0)
                qv, _bad_q = load_probs(d_row + cols, lane)
                ratio = tl.where(qv > 0.0, fast_div(pv, qv), 0.0)  # the term is 0 where q = 0
            acc += qv * tl.minimum(pts3, ratio)
        sums = tl.sum(acc, axis=2)
        tl.store(sums_ptr + (pos[:, None] * num_chunks + chunk) * RHO_P + pts_i, sums, mask=active[:, None])


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
    # strides
    stride_tb,
    stride_tk,
    stride_tg,
    stride_db,
    stride_dk,
    stride_dg,
    # sizes
    B,
    K,
    G,
    V,
    N,
    chunk_size,
    num_chunks,
    rnd,  # j in 1 .. RRS_MAX - 1: the mass Z_j of the residual after j rejections
    # scalar parameters
    temperature,
    # constexprs
    PER_REQ_T: tl.constexpr,
    DRAFT_MODE: tl.constexpr,
    HAS_FILTER: tl.constexpr,
    BY_INDEX: tl.constexpr,
    WOR: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """RRS's residual masses before the walk, split over the vocabulary: round j sums the residual
    left after the first j candidates of a position are rejected (the candidates and their order
    are fixed by the tree), for every position with more than j candidates. Grid (position tiles, chunks)."""
    P = B * (N + 1)
    pos = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P).to(tl.int64)
    chunk = tl.program_id(1)
    in_range = pos < P
    b = pos // (N + 1)
    rep = (pos % (N + 1) - 1).to(tl.int32)
    k = tl.load(pos_ptr + pos * POS_REC + POS_K, mask=in_range, other=0)
    temperature = per_request(temperature_ptr, temperature, b, in_range, PER_REQ_T).to(tl.float32)
    greedy, inv_t = inverse_temperature(temperature)
    active = in_range & ~greedy & (k > rnd)
    if tl.max(active.to(tl.int32), axis=0) > 0:
        first = tl.load(pos_ptr + pos * POS_REC + POS_FIRST, mask=active, other=0)
        rec_t = _record(b, rep, K, G, 1)
        rec_q = _record(b, first, K, G, 0)
        m_t = tl.load(stats_ptr + rec_t * NUM_STATS + STAT_M_T, mask=active, other=0.0)
        z_t = tl.load(stats_ptr + rec_t * NUM_STATS + STAT_Z_T, mask=active, other=0.0)
        m_q = tl.load(stats_ptr + rec_q * NUM_STATS + STAT_M_Q, mask=active, other=0.0)
        z_q = tl.load(stats_ptr + rec_q * NUM_STATS + STAT_Z_Q, mask=active, other=0.0)
        thr_t = tl.full([BLOCK_P], float("-inf"), tl.float32)
        thr_q = tl.full([BLOCK_P], float("-inf"), tl.float32)
        cut_t = tl.zeros([BLOCK_P], tl.int32)
        cut_q = tl.zeros([BLOCK_P], tl.int32)
        if HAS_FILTER:
            thr_t = tl.load(thr_ptr + rec_t * NUM_THR + THR_T, mask=active, other=float("-inf"))
            cut_t = load_cut(thr_ptr + rec_t * NUM_THR + CUT_T, active, BY_INDEX)
            if DRAFT_MODE == DRAFT_LOGITS:
                thr_q = tl.load(thr_ptr + rec_q * NUM_THR + THR_Q, mask=active, other=float("-inf"))
                cut_q = load_cut(thr_ptr + rec_q * NUM_THR + CUT_Q, active, BY_INDEX)
        t_row = _row_ptr(target_ptr, b, rep, stride_tb, stride_tk, stride_tg, G, 1)
        d_row = _row_ptr(draft_ptr, b, first, stride_db, stride_dk, stride_dg, G, 0)
        # the walk's RRS state after the first rnd rejections, by rank (as in _tree_walk_kernel)
        ranks = tl.arange(0, RRS_MAX)[None, :]
        zs = tl.zeros([BLOCK_P, RRS_MAX], tl.float32) + tl.where(ranks == 0, 1.0, 0.0)
        ds = tl.zeros([BLOCK_P, RRS_MAX], tl.float32) + tl.where(ranks == 0, 1.0, 0.0)
        xs = tl.full([BLOCK_P, RRS_MAX], -1, tl.int64)
        for j in range(0, rnd):
            x_j = tl.load(pos_ptr + pos * POS_REC + POS_TOK + j, mask=active, other=0).to(tl.int64)
            if j > 0:
                z_j = tl.zeros([BLOCK_P], tl.float32)
                for c in range(0, num_chunks):
                    z_j += tl.load(sums_ptr + ((j - 1) * P + pos) * num_chunks + c, mask=active, other=0.0)
                zs = tl.where(ranks == j, z_j[:, None], zs)
            if WOR:
                if DRAFT_MODE == DRAFT_LOGITS:
                    xq, _bad = load_logits(d_row + x_j, active)
                    q_x = prob_of(xq, m_q, z_q, thr_q, inv_t, x_j, cut_q, BY_INDEX)
                else:
                    q_x, _bad = load_probs(d_row + x_j, active)
                d_now = tl.sum(tl.where(ranks == j, ds, 0.0), axis=1)
                repeated = tl.sum((xs == x_j[:, None]).to(tl.int32), axis=1) > 0
                ds = tl.where(ranks == j + 1, tl.where(repeated, d_now, d_now - q_x)[:, None], ds)
                xs = tl.where((ranks == j) & ~repeated[:, None], x_j[:, None], xs)
        steps = tl.zeros([BLOCK_P], tl.int32) + rnd
        acc = tl.zeros([BLOCK_P, BLOCK_V], tl.float32)
        start_col = chunk * chunk_size
        end_col = tl.minimum(start_col + chunk_size, V)
        vcols = tl.arange(0, BLOCK_V)[None, :]
        for start in range(start_col, end_col, BLOCK_V):
            cols = start + vcols
            lane = active[:, None] & (cols < end_col)
            _x, pv, qv = _position_tiles(
                t_row, d_row, cols, lane, lane, m_t, z_t, thr_t, m_q, z_q, thr_q, inv_t, cut_t, cut_q, DRAFT_MODE,
                BY_INDEX,
            )  # fmt: skip
            r = _rrs_residual(pv, qv, steps, zs, xs, ds, cols.to(tl.int64), ranks, WOR)
            acc += tl.where(lane, r, 0.0)
        tl.store(sums_ptr + ((rnd - 1) * P + pos) * num_chunks + chunk, tl.sum(acc, axis=1), mask=active)


@triton.jit(do_not_specialize=["B", "rrs_chunks", "seed"])  # per-call scalars: triton/helpers.py
def _tree_walk_kernel(
    # pointers
    target_ptr,  # [B, K, G+1, V] raw target logits
    draft_ptr,  # [B, K, G, V] draft logits (mode 1) or probs (mode 2)
    tokens_ptr,  # [B, K, G] int: node tokens (node = chain * G + slot)
    parents_ptr,  # [B, N] int (unless CHAINS)
    num_nodes_ptr,  # [B] int (PER_REQ_N)
    temperature_ptr,  # [B] float (PER_REQ_T)
    seed_ptr,  # [B] int (PER_REQ_SEED)
    stats_ptr,  # [B*K*(G+1), 1, NUM_STATS] fp32 (row statistics)
    idx_ptr,  # [B*K*(G+1), 1, 2] int32 (row statistics)
    thr_ptr,  # [B*K*(G+1), NUM_THR] fp32 (HAS_FILTER; index cuts: BY_INDEX)
    out_tokens_ptr,  # [B, D+1] int64 out
    out_nodes_ptr,  # [B, D] int64 out
    out_accepted_ptr,  # [B] int32 out
    nonfinite_ptr,  # [B] bool out
    brk_ptr,  # [B*(N+1), RB_REC] fp32 (_tree_rho_step_kernel, K-SEQ): rho = RB_HI, beta = RB_GHI / rho
    race_i_ptr,  # [B, RACE_I] int32 out: the race's record
    race_f_ptr,  # [B, RACE_F] fp32 out
    race_zs_ptr,  # [B, NP2] fp32 out: RRS normalisers by rank
    race_ds_ptr,  # [B, NP2] fp32 out: RRS-WOR q masses by rank
    race_xs_ptr,  # [B, NP2] int64 out: RRS-WOR rejected tokens by rank (one-hot: the candidates' tokens)
    rrs_ptr,  # [RRS_MAX - 1, B*(N+1), rrs_chunks] fp32 (_tree_rrs_kernel, RRS)
    # strides
    stride_tb,
    stride_tk,
    stride_tg,
    stride_db,
    stride_dk,
    stride_dg,
    stride_xb,
    stride_xk,
    stride_pb,
    stride_ob,
    stride_nb,
    # sizes
    B,
    K,
    G,
    V,
    N,
    D,
    rrs_chunks,
    # scalar parameters
    temperature,
    seed: tl.int64,  # one signature for every seed (see triton/helpers.py)
    # constexprs
    PER_REQ_N: tl.constexpr,
    PER_REQ_T: tl.constexpr,
    PER_REQ_SEED: tl.constexpr,
    CHAINS: tl.constexpr,  # parents implicit: K chains of G slots (verify_multi)
    DRAFT_MODE: tl.constexpr,
    HAS_FILTER: tl.constexpr,
    BY_INDEX: tl.constexpr,
    METHOD: tl.constexpr,  # 0 kseq, 1 rrs, 2 rrs_wor
    BLOCK_B: tl.constexpr,
    NP2: tl.constexpr,  # next power of two >= N
    DP2: tl.constexpr,  # next power of two >= D + 1
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    b_ok = b < B
    n_nodes = per_request(num_nodes_ptr, N, b, b_ok, PER_REQ_N).to(tl.int32)
    temperature = per_request(temperature_ptr, temperature, b, b_ok, PER_REQ_T).to(tl.float32)
    greedy, inv_t = inverse_temperature(temperature)
    seed = request_seed(seed_ptr, seed, b, b_ok, PER_REQ_SEED)

    # ---- the tree: tokens and parents of every node, [BLOCK_B, NP2]
    nodes = tl.arange(0, NP2)[None, :]
    node_ok = b_ok[:, None] & (nodes < n_nodes[:, None])
    tok_ptrs = tokens_ptr + b[:, None] * stride_xb + (nodes // _slots(G)).to(tl.int64) * stride_xk + nodes % _slots(G)
    tok = tl.load(tok_ptrs, mask=node_ok, other=-1).to(tl.int64)
    tok_ok = (tok >= 0) & (tok < V)  # out-of-range ids (validate=False) never become candidates
    tok = tl.where(tok_ok, tok, -1)
    if CHAINS:
        par = tl.where(nodes % _slots(G) == 0, -1, nodes - 1) + tl.zeros([BLOCK_B, NP2], tl.int32)
    else:
        par = tl.load(parents_ptr + b[:, None] * stride_pb + nodes, mask=node_ok, other=-1).to(tl.int32)
    par = tl.where(node_ok, par, -2)  # padding nodes are nobody's children
    flagged = tl.zeros([BLOCK_B], tl.int1)  # placeholder ids (outside [0, V)) are no error

    # ---- walk state
    at_root = b_ok
    in_set = tl.zeros([BLOCK_B], tl.int64)  # bitmask of the nodes spelling the accepted prefix
    rep = tl.full([BLOCK_B], -1, tl.int32)  # first node of that set (-1 = root)
    last = tl.full([BLOCK_B], -1, tl.int32)  # last accepted node
    depth = tl.zeros([BLOCK_B], tl.int32)
    done = ~b_ok
    out_cols = tl.arange(0, DP2)[None, :]
    out_tok = tl.full([BLOCK_B, DP2], -1, tl.int64)
    vcols = tl.arange(0, BLOCK_V)[None, :]
    r_flag = tl.zeros([BLOCK_B], tl.int1)  # the race's record (see the end)
    r_rep = tl.full([BLOCK_B], -1, tl.int32)
    r_first = tl.zeros([BLOCK_B], tl.int32)
    r_has = tl.zeros([BLOCK_B], tl.int1)
    r_rho = tl.full([BLOCK_B], 1.0, tl.float32)
    r_scale = tl.full([BLOCK_B], 1.0, tl.float32)
    r_steps = tl.zeros([BLOCK_B], tl.int32)
    r_zs = tl.zeros([BLOCK_B, NP2], tl.float32)
    r_ds = tl.zeros([BLOCK_B, NP2], tl.float32)
    r_xs = tl.full([BLOCK_B, NP2], -1, tl.int64)

    for d in range(0, D + 1):
        active = ~done
        stochastic = active & ~greedy
        # candidates: children of the current node set, in node order
        parent_in_set = ((in_set[:, None] >> tl.maximum(par, 0).to(tl.int64)) & 1) != 0
        in_pos = tl.where(par >= 0, parent_in_set, (par == -1) & at_root[:, None])
        cand = in_pos & tok_ok & active[:, None]
        rank = tl.cumsum(cand.to(tl.int32), axis=1) - 1
        # k from the ranks, not tl.sum(cand): LLVM turns that sum of booleans into a bitcast of <8 x i1>
        # to <2 x i4> + popcount, which the NVPTX backend lowers through an (unused) 8-byte stack frame
        k = tl.max(rank, axis=1) + 1
        first = tl.min(tl.where(cand, nodes, NP2), axis=1)
        has_cand = k > 0
        counter = rep + 1  # Philox row counter of this position

        # target row of the position: statistics from the row pass
        rec_t = _record(b, rep, K, G, 1)
        m_t = tl.load(stats_ptr + rec_t * NUM_STATS + STAT_M_T, mask=active, other=0.0)
        z_t = tl.load(stats_ptr + rec_t * NUM_STATS + STAT_Z_T, mask=active, other=0.0)
        bad_t = tl.load(stats_ptr + rec_t * NUM_STATS + STAT_BAD_T, mask=active, other=0.0)
        g_idx = tl.load(idx_ptr + rec_t * NUM_IDX + IDX_GREEDY, mask=active, other=0).to(tl.int64)
        thr_t = tl.full([BLOCK_B], float("-inf"), tl.float32)
        cut_t = tl.zeros([BLOCK_B], tl.int32)
        if HAS_FILTER:
            thr_t = tl.load(thr_ptr + rec_t * NUM_THR + THR_T, mask=stochastic, other=float("-inf"))
            cut_t = load_cut(thr_ptr + rec_t * NUM_THR + CUT_T, stochastic, BY_INDEX)
        flagged = flagged | (active & (bad_t > 0.0)) | (stochastic & (z_t == 0.0))
        t_row = _row_ptr(target_ptr, b, rep, stride_tb, stride_tk, stride_tg, G, 1)
        x_c, _bad_c = load_logits(t_row[:, None] + tl.maximum(tok, 0), cand)
        p_c = prob_of(x_c, m_t[:, None], z_t[:, None], thr_t[:, None], inv_t[:, None], tok, cut_t[:, None], BY_INDEX)

        # draft distribution of the position: the first candidate's draft row
        first_safe = tl.where(has_cand, first, 0)
        rec_q = _record(b, first_safe, K, G, 0)
        d_row = _row_ptr(draft_ptr, b, first_safe, stride_db, stride_dk, stride_dg, G, 0)
        m_q = tl.load(stats_ptr + rec_q * NUM_STATS + STAT_M_Q, mask=stochastic & has_cand, other=0.0)
        z_q = tl.load(stats_ptr + rec_q * NUM_STATS + STAT_Z_Q, mask=stochastic & has_cand, other=0.0)
        thr_q = tl.full([BLOCK_B], float("-inf"), tl.float32)
        cut_q = tl.zeros([BLOCK_B], tl.int32)
        if DRAFT_MODE != DRAFT_NONE:  # unusable draft logits / probabilities in the row of this position
            bad_q = tl.load(stats_ptr + rec_q * NUM_STATS + STAT_BAD_Q, mask=stochastic & has_cand, other=0.0)
            flagged = flagged | (stochastic & has_cand & (bad_q > 0.0))
        if DRAFT_MODE == DRAFT_LOGITS:
            if HAS_FILTER:
                thr_q = tl.load(thr_ptr + rec_q * NUM_THR + THR_Q, mask=stochastic & has_cand, other=float("-inf"))
                cut_q = load_cut(thr_ptr + rec_q * NUM_THR + CUT_Q, stochastic & has_cand, BY_INDEX)
            xq_c, _bad_qc = load_logits(d_row[:, None] + tl.maximum(tok, 0), cand)
            q_c = prob_of(
                xq_c, m_q[:, None], z_q[:, None], thr_q[:, None], inv_t[:, None], tok, cut_q[:, None], BY_INDEX
            )
        elif DRAFT_MODE == DRAFT_PROBS:
            q_c, _bad_qc = load_probs(d_row[:, None] + tl.maximum(tok, 0), cand)
        else:
            q_c = tl.where(cand, 1.0, 0.0)
        u = uniform_open(seed[:, None], rank, counter[:, None], PURPOSE_ACCEPT)

        # ---- decide: index of the accepted candidate (NP2 = none)
        rho = tl.full([BLOCK_B], 1.0, tl.float32)
        scale = tl.full([BLOCK_B], 1.0, tl.float32)
        zs = tl.zeros([BLOCK_B, NP2], tl.float32) + tl.where(nodes == 0, 1.0, 0.0)  # RRS normalisers
        ds = tl.zeros([BLOCK_B, NP2], tl.float32) + tl.where(nodes == 0, 1.0, 0.0)  # RRS-WOR q mass
        xs = tl.full([BLOCK_B, NP2], -1, tl.int64)  # RRS candidate token by rank
        steps = tl.zeros([BLOCK_B], tl.int32)  # RRS rejections so far
        if DRAFT_MODE == DRAFT_NONE:
            # one-hot drafts: p_j = p without the earlier (distinct) rejected tokens, renormalised
            earlier = nodes[:, :, None] > nodes[:, None, :]
            same = (tok[:, :, None] == tok[:, None, :]) & cand[:, None, :] & earlier
            repeated = tl.sum(same.to(tl.int32), axis=2) > 0
            fresh_p = tl.where(cand & ~repeated, p_c, 0.0)
            removed_before = tl.cumsum(fresh_p, axis=1) - fresh_p
            left = 1.0 - removed_before
            p_j = tl.where(repeated | (left <= 0.0), 0.0, p_c / tl.where(left > 0.0, left, 1.0))
            accept = cand & (p_j > 0.0) & (u <= p_j)
        elif METHOD == 0:
            # K-SEQ: rho and beta(rho) = g / rho from the rho search's record (lanes with k > 1)
            search = stochastic & (k > 1)
            kf = k.to(tl.float32)
            beta_hi = tl.zeros([BLOCK_B], tl.float32)
            hi = tl.full([BLOCK_B], 1.0, tl.float32)
            if tl.max(search.to(tl.int32), axis=0) > 0:
                rec = brk_ptr + (b * (N + 1) + rep + 1) * RB_REC
                hi = tl.load(rec + RB_HI, mask=search, other=1.0)
                beta_hi = tl.load(rec + RB_GHI, mask=search, other=0.0) / hi
            rho = tl.where(search, hi, 1.0)
            pow_k = tl.exp(kf * tl.log(tl.maximum(1.0 - beta_hi, 0.0)))
            scale = tl.where(
                search, tl.where(beta_hi > 0.0, (1.0 - pow_k) / tl.where(beta_hi > 0.0, beta_hi, 1.0), kf), 1.0
            )
            accept = cand & (p_c > 0.0) & (u * rho[:, None] * q_c <= p_c)
        else:
            # RRS: test candidates in rank order; each rejection renormalises the residual (one pass)
            accept = cand & (nodes < 0)
            decided = ~stochastic
            for j in range(0, tl.max(k, axis=0)):
                at_j = cand & (rank == j)
                live = ~decided & (j < k)
                x_j = tl.sum(tl.where(at_j, tok, 0), axis=1)
                if j > 0:  # Z_j from _tree_rrs_kernel
                    z_j = tl.zeros([BLOCK_B], tl.float32)
                    slot = (tl.minimum(j, RRS_MAX - 1) - 1) * B * (N + 1) + b * (N + 1) + rep + 1
                    for c in range(0, rrs_chunks):
                        z_j += tl.load(rrs_ptr + slot * rrs_chunks + c, mask=live & (j < RRS_MAX), other=0.0)
                    zs = tl.where(live[:, None] & (nodes == j), z_j[:, None], zs)
                if j >= RRS_MAX:  # Z_j: one pass over the vocabulary (positions with more candidates)
                    z_j = tl.zeros([BLOCK_B], tl.float32)
                    for start in range(0, V, BLOCK_V):
                        cols = start + vcols
                        lane = live[:, None] & (cols < V)
                        _x, pv, qv = _position_tiles(
                            t_row, d_row, cols, lane, lane, m_t, z_t, thr_t, m_q, z_q, thr_q, inv_t, cut_t, cut_q,
                            DRAFT_MODE, BY_INDEX,
                        )  # fmt: skip
                        r = _rrs_residual(pv, qv, steps, zs, xs, ds, cols.to(tl.int64), nodes, METHOD == 2)
                        z_j += tl.sum(tl.where(lane, r, 0.0), axis=1)
                    zs = tl.where(live[:, None] & (nodes == j), z_j[:, None], zs)
                p_x = tl.sum(tl.where(at_j, p_c, 0.0), axis=1)
                q_x = tl.sum(tl.where(at_j, q_c, 0.0), axis=1)
                r_x = _rrs_residual(p_x[:, None], q_x[:, None], steps, zs, xs, ds, x_j[:, None], nodes, METHOD == 2)
                z_now = tl.sum(tl.where(nodes == j, zs, 0.0), axis=1)
                p_j = tl.where(z_now > 0.0, tl.sum(r_x, axis=1) / tl.where(z_now > 0.0, z_now, 1.0), 0.0)
                repeated = x_j < 0
                if METHOD == 2:
                    d_now = tl.sum(tl.where(nodes == j, ds, 0.0), axis=1)
                    repeated = tl.sum((xs == x_j[:, None]).to(tl.int32), axis=1) > 0
                    q_j = tl.where(repeated | (d_now <= 0.0), 0.0, q_x / tl.where(d_now > 0.0, d_now, 1.0))
                    ds = tl.where(live[:, None] & (nodes == j + 1), tl.where(repeated, d_now, d_now - q_x)[:, None], ds)
                    xs = tl.where(live[:, None] & (nodes == j) & ~repeated[:, None], x_j[:, None], xs)
                else:
                    q_j = q_x
                u_j = tl.sum(tl.where(at_j, u, 0.0), axis=1)
                ok = live & ~repeated & (p_j > 0.0) & (u_j * q_j <= p_j)
                accept = accept | (at_j & ok[:, None])
                decided = decided | ok
                steps = tl.where(live & ~ok, steps + 1, steps)
        chosen = tl.min(tl.where(accept, nodes, NP2), axis=1)
        matched = tl.min(tl.where(cand & (tok == g_idx[:, None]), nodes, NP2), axis=1)
        chosen = tl.where(greedy, matched, chosen)
        accepted = active & (chosen < NP2)
        emit = active & ~accepted

        # ---- recovered / bonus token: recorded here, raced by _tree_race_kernel over vocabulary chunks
        race = emit & ~greedy
        r_flag = r_flag | race
        r_rep = tl.where(race, rep, r_rep)
        r_first = tl.where(race, first_safe, r_first)
        r_has = tl.where(race, has_cand, r_has)
        r_rho = tl.where(race, rho, r_rho)
        r_scale = tl.where(race, scale, r_scale)
        r_steps = tl.where(race, steps, r_steps)
        r_zs = tl.where(race[:, None], zs, r_zs)
        r_ds = tl.where(race[:, None], ds, r_ds)
        if DRAFT_MODE == DRAFT_NONE:  # the candidates' tokens leave the residual
            r_xs = tl.where(race[:, None], tl.where(cand, tok, -1), r_xs)
        else:
            r_xs = tl.where(race[:, None], xs, r_xs)
        final = tl.where(greedy, g_idx, -1)

        # ---- advance
        chosen_tok = _pick(tok, nodes, chosen)
        same_pos = cand & (tok == chosen_tok[:, None])
        new_set = tl.sum(tl.where(same_pos, tl.full([BLOCK_B, NP2], 1, tl.int64) << nodes.to(tl.int64), 0), axis=1)
        new_rep = tl.min(tl.where(same_pos, nodes, NP2), axis=1)
        emitted = tl.where(accepted, chosen_tok, final)
        out_tok = tl.where(active[:, None] & (out_cols == d), emitted[:, None], out_tok)
        in_set = tl.where(accepted, new_set, in_set)
        rep = tl.where(accepted, new_rep, rep)
        last = tl.where(accepted, chosen, last)
        at_root = at_root & ~accepted
        depth = tl.where(accepted, depth + 1, depth)
        done = done | emit

    # ---- the accepted path: ancestors of the last accepted node
    path = tl.full([BLOCK_B, DP2], -1, tl.int64)
    node = last
    for step in range(0, D):
        pos = depth - 1 - step
        path = tl.where((out_cols == pos[:, None]) & (node >= 0)[:, None], node.to(tl.int64)[:, None], path)
        node = tl.where(node >= 0, _pick(par, nodes, node), -1)
    # the race's record: (flag, position, first candidate, has candidates, steps) int32, (rho, scale) fp32,
    # and per rank the RRS normalisers / WOR masses (fp32) and rejected (one-hot: candidate) tokens
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
    tl.store(out_tokens_ptr + b[:, None] * stride_ob + out_cols, out_tok, mask=b_ok[:, None] & (out_cols <= D))
    tl.store(out_nodes_ptr + b[:, None] * stride_nb + out_cols, path, mask=b_ok[:, None] & (out_cols < D))
    tl.store(out_accepted_ptr + b, depth, mask=b_ok)
    tl.store(nonfinite_ptr + b, flagged, mask=b_ok)


@triton.jit(do_not_specialize=["B", "num_chunks", "seed"])  # per-call scalars: triton/helpers.py
def _tree_race_kernel(
    # pointers
    target_ptr,  # [B, K, G+1, V] raw target logits
    draft_ptr,  # [B, K, G, V] draft logits (mode 1) or probs (mode 2)
    temperature_ptr,  # [B] float (PER_REQ_T)
    seed_ptr,  # [B] int (PER_REQ_SEED)
    stats_ptr,  # [B*K*(G+1), 1, NUM_STATS] fp32 (row statistics)
    thr_ptr,  # [B*K*(G+1), NUM_THR] fp32 (HAS_FILTER; index cuts: BY_INDEX)
    race_i_ptr,  # [B, RACE_I] int32 (walk)
    race_f_ptr,  # [B, RACE_F] fp32 (walk)
    race_zs_ptr,  # [B, NP2] fp32 (walk)
    race_ds_ptr,  # [B, NP2] fp32 (walk)
    race_xs_ptr,  # [B, NP2] int64 (walk)
    key_ptr,  # [B, C, 2] fp32 out: best residual key, best key of p (the fallback) per chunk
    idx_ptr,  # [B, C, 2] int32 out
    # strides
    stride_tb,
    stride_tk,
    stride_tg,
    stride_db,
    stride_dk,
    stride_dg,
    # sizes
    B,
    K,
    G,
    V,
    chunk_size,
    num_chunks,
    # scalar parameters
    temperature,
    seed: tl.int64,  # one signature for every seed (see triton/helpers.py)
    # constexprs
    PER_REQ_T: tl.constexpr,
    PER_REQ_SEED: tl.constexpr,
    DRAFT_MODE: tl.constexpr,
    HAS_FILTER: tl.constexpr,
    BY_INDEX: tl.constexpr,
    METHOD: tl.constexpr,
    NP2: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The recovered / bonus token's exponential race over one vocabulary chunk of the position where
    each request's walk ended: over the method's residual (over p at a leaf) and over p itself (the
    fallback when the residual is empty). Grid (request tiles, chunks); _tree_finalize_kernel merges."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    chunk = tl.program_id(1)
    b_ok = b < B
    race = b_ok & (tl.load(race_i_ptr + b * RACE_I + RI_FLAG, mask=b_ok, other=0) != 0)
    best_key = tl.full([BLOCK_B], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_B], tl.int32)
    p_key = tl.full([BLOCK_B], float("-inf"), tl.float32)
    p_idx = tl.zeros([BLOCK_B], tl.int32)
    if tl.max(race.to(tl.int32), axis=0) > 0:
        rep = tl.load(race_i_ptr + b * RACE_I + RI_REP, mask=race, other=-1)
        first = tl.load(race_i_ptr + b * RACE_I + RI_FIRST, mask=race, other=0)
        has_cand = tl.load(race_i_ptr + b * RACE_I + RI_HAS, mask=race, other=0) != 0
        steps = tl.load(race_i_ptr + b * RACE_I + RI_STEPS, mask=race, other=0)
        rho = tl.load(race_f_ptr + b * RACE_F + RF_RHO, mask=race, other=1.0)
        scale = tl.load(race_f_ptr + b * RACE_F + RF_SCALE, mask=race, other=1.0)
        nodes = tl.arange(0, NP2)[None, :]
        ranks = b[:, None] * NP2 + nodes
        zs = tl.load(race_zs_ptr + ranks, mask=race[:, None], other=0.0)
        ds = tl.load(race_ds_ptr + ranks, mask=race[:, None], other=0.0)
        xs = tl.load(race_xs_ptr + ranks, mask=race[:, None], other=-1)
        _greedy, inv_t = inverse_temperature(
            per_request(temperature_ptr, temperature, b, b_ok, PER_REQ_T).to(tl.float32)
        )
        key = request_seed(seed_ptr, seed, b, b_ok, PER_REQ_SEED)
        rec_t = _record(b, rep, K, G, 1)
        rec_q = _record(b, first, K, G, 0)
        m_t = tl.load(stats_ptr + rec_t * NUM_STATS + STAT_M_T, mask=race, other=0.0)
        z_t = tl.load(stats_ptr + rec_t * NUM_STATS + STAT_Z_T, mask=race, other=0.0)
        with_q = race & has_cand
        m_q = tl.load(stats_ptr + rec_q * NUM_STATS + STAT_M_Q, mask=with_q, other=0.0)
        z_q = tl.load(stats_ptr + rec_q * NUM_STATS + STAT_Z_Q, mask=with_q, other=0.0)
        thr_t = tl.full([BLOCK_B], float("-inf"), tl.float32)
        thr_q = tl.full([BLOCK_B], float("-inf"), tl.float32)
        cut_t = tl.zeros([BLOCK_B], tl.int32)
        cut_q = tl.zeros([BLOCK_B], tl.int32)
        if HAS_FILTER:
            thr_t = tl.load(thr_ptr + rec_t * NUM_THR + THR_T, mask=race, other=float("-inf"))
            cut_t = load_cut(thr_ptr + rec_t * NUM_THR + CUT_T, race, BY_INDEX)
            if DRAFT_MODE == DRAFT_LOGITS:
                thr_q = tl.load(thr_ptr + rec_q * NUM_THR + THR_Q, mask=with_q, other=float("-inf"))
                cut_q = load_cut(thr_ptr + rec_q * NUM_THR + CUT_Q, with_q, BY_INDEX)
        t_row = _row_ptr(target_ptr, b, rep, stride_tb, stride_tk, stride_tg, G, 1)
        d_row = _row_ptr(draft_ptr, b, first, stride_db, stride_dk, stride_dg, G, 0)
        counter = rep + 1
        purpose = tl.where(has_cand, PURPOSE_RECOVER, PURPOSE_BONUS)
        log_z = tl.log(tl.where(z_t > 0.0, z_t, 1.0))
        vcols = tl.arange(0, BLOCK_V)[None, :]
        start_col = chunk * chunk_size
        end_col = tl.minimum(start_col + chunk_size, V)
        for start in range(start_col, end_col, BLOCK_V):
            cols = start + vcols
            lane = race[:, None] & (cols < end_col)
            xt, pv, qv = _position_tiles(
                t_row, d_row, cols, lane, lane & has_cand[:, None], m_t, z_t, thr_t, m_q, z_q, thr_q, inv_t, cut_t,
                cut_q, DRAFT_MODE, BY_INDEX,
            )  # fmt: skip
            if DRAFT_MODE == DRAFT_NONE:
                gone = (cols < 0) & lane
                for j in range(0, NP2):
                    x_j = tl.sum(tl.where(nodes == j, xs, 0), axis=1)
                    gone = gone | ((cols == x_j[:, None]) & (x_j >= 0)[:, None])
                w = tl.where(gone, 0.0, pv)
            else:
                if METHOD == 0:
                    w = tl.maximum(pv - scale[:, None] * tl.minimum(qv, pv / rho[:, None]), 0.0)
                else:
                    w = _rrs_residual(pv, qv, steps, zs, xs, ds, cols.to(tl.int64), nodes, METHOD == 2)
            w = tl.where(has_cand[:, None], w, pv)
            noise = race_noise(key[:, None], start, counter[:, None], purpose[:, None], BLOCK_V)
            log_p = (xt - safe_max(m_t)[:, None]) * inv_t[:, None] - log_z[:, None]
            keys = tl.where(lane & (w > 0.0), log_floored(w) + noise, float("-inf"))
            keys_p = tl.where(lane & (pv > 0.0), log_p + noise, float("-inf"))
            best_key, best_idx = first_argmax_update(best_key, best_idx, keys, cols)
            p_key, p_idx = first_argmax_update(p_key, p_idx, keys_p, cols)
    rec = (b * num_chunks + chunk) * 2
    tl.store(key_ptr + rec, best_key, mask=b_ok)
    tl.store(key_ptr + rec + 1, p_key, mask=b_ok)
    tl.store(idx_ptr + rec, best_idx, mask=b_ok)
    tl.store(idx_ptr + rec + 1, p_idx, mask=b_ok)


@triton.jit(do_not_specialize=["B", "num_chunks"])  # per-call scalars: triton/helpers.py
def _tree_finalize_kernel(
    race_i_ptr,  # [B, RACE_I] int32 (walk)
    key_ptr,  # [B, C, 2] fp32 (_tree_race_kernel)
    idx_ptr,  # [B, C, 2] int32
    out_tokens_ptr,  # [B, D+1] int64 out: the raced token at slot RI_DEPTH
    stride_ob,
    B,
    V,
    num_chunks,
    BLOCK_B: tl.constexpr,
):
    """Merge the chunks' race winners (earlier chunks keep ties) and write the raced tokens."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    b_ok = b < B
    race = b_ok & (tl.load(race_i_ptr + b * RACE_I + RI_FLAG, mask=b_ok, other=0) != 0)
    res_key = tl.full([BLOCK_B], float("-inf"), tl.float32)
    res_idx = tl.zeros([BLOCK_B], tl.int32)
    p_key = tl.full([BLOCK_B], float("-inf"), tl.float32)
    p_idx = tl.zeros([BLOCK_B], tl.int32)
    for c in range(0, num_chunks):
        rec = (b * num_chunks + c) * 2
        k_r = tl.load(key_ptr + rec, mask=race, other=float("-inf"))
        k_p = tl.load(key_ptr + rec + 1, mask=race, other=float("-inf"))
        take_r = k_r > res_key
        take_p = k_p > p_key
        res_idx = tl.where(take_r, tl.load(idx_ptr + rec, mask=race, other=0), res_idx)
        p_idx = tl.where(take_p, tl.load(idx_ptr + rec + 1, mask=race, other=0), p_idx)
        res_key = tl.where(take_r, k_r, res_key)
        p_key = tl.where(take_p, k_p, p_key)
    token = tl.where(res_key > float("-inf"), res_idx, p_idx).to(tl.int64)
    token = tl.minimum(tl.maximum(token, 0), V - 1)
    depth = tl.load(race_i_ptr + b * RACE_I + RI_DEPTH, mask=race, other=0)
    tl.store(out_tokens_ptr + b * stride_ob + depth, token, mask=race)


# --------------------------------------------------------------------------------------------
# launcher


def _row_pass_chunks(args: TreeArgs, row_tiles: int, blocks: int, interpreted: bool, num_chunks: int | None) -> int:
    """Vocabulary chunks of the row pass: split rows so that a small batch still fills the GPU
    (~4 programs per SM). Filtered rows are split too: their thresholds come from the threshold phases."""
    if num_chunks is None:
        if interpreted:
            return 1
        sms = multiprocessors(args.target.device)
        num_chunks = min(64, max(1, -(-4 * sms // row_tiles)))
    return max(1, min(int(num_chunks), blocks))


def launch_tree(
    args: TreeArgs,
    block_v: int | None = None,
    num_chunks: int | None = None,
    threshold_chunks: int | None = None,
    threshold_capacity: int | None = None,
) -> TreeVerifyOutput:
    """Run the launches of the module docstring on checked arguments (``_tree_args.check_tree_args``).

    num_chunks / block_v override the launch plan (tests use them to split small vocabularies: the row
    pass, the rho / RRS rounds and the race all take them); threshold_chunks / threshold_capacity make
    the interpreter run the GPU's two-launch top-k/top-p thresholds (``ops/verify.threshold_plan``)."""
    B, K, G, V, N, D = args.B, args.K, args.G, args.V, args.N, args.max_depth
    dev = args.target.device
    tokens = torch.empty((B, D + 1), dtype=torch.int64, device=dev)
    nodes = torch.empty((B, D), dtype=torch.int64, device=dev)
    num_accepted = torch.empty((B,), dtype=torch.int32, device=dev)
    nonfinite = torch.empty((B,), dtype=torch.bool, device=dev)
    if B == 0:
        return TreeVerifyOutput(tokens, num_accepted, nodes, nonfinite)

    interpreted = plans_for_interpreter(dev)
    rows = B * K * (G + 1)
    tiles = tile_settings(V, rows, interpreted, block_v)  # the row pass's tiles (launch.py)
    block_v, block_r, tile = tiles.block_v, tiles.block_r, tiles.tile
    has_filter = args.has_filter
    by_index = has_filter and args.sampling.ties_by_index()
    np2 = max(2, next_pow2(N))
    # The walk holds [BLOCK_B, NP2, NP2] tiles (and [BLOCK_B, NP2, BLOCK_V] ones in its rare RRS passes).
    block_b = max(1, min(next_pow2(B), tile // max(block_v * RHO_POINTS, np2 * np2, 1))) if interpreted else 1

    blocks = cdiv(V, block_v)
    C = _row_pass_chunks(args, cdiv(rows, block_r), blocks, interpreted, num_chunks)
    chunk_size = cdiv(blocks, C) * block_v
    C = cdiv(V, chunk_size)
    stats = torch.empty((rows, C, NUM_STATS_HOST), dtype=torch.float32, device=dev)
    idx = torch.empty((rows, C, NUM_IDX_HOST), dtype=torch.int32, device=dev)
    thr = torch.empty((rows if has_filter else 1, NUM_THR_HOST), dtype=torch.float32, device=dev)
    tplan = threshold_plan(args.target, rows, V, threshold_chunks, args.draft_mode == DRAFT_LOGITS, threshold_capacity)
    filter_buf, filter_int = tplan.scratch(rows, dev) if has_filter else (thr, thr)
    target = args.target
    draft = args.draft if args.draft is not None else target
    d_strides = (draft.stride(0), draft.stride(1), draft.stride(2)) if args.draft is not None else (0, 0, 0)
    per_req_n = args.num_nodes is not None
    n_ptr = args.num_nodes if per_req_n else target
    params = args.sampling.kernel_args(target)
    t_ptr, t_val, per_req_t = params["temperature"]
    k_ptr, k_val, per_req_k = params["top_k"]
    p_ptr, p_val, per_req_p = params["top_p"]
    s_ptr, s_val, per_req_s = params["seed"]

    parents = args.parents if args.parents is not None else target
    P = B * (N + 1)
    kseq = METHODS[args.method] == 0 and args.draft_mode != DRAFT_NONE
    sampled = per_req_t or float(t_val) >= MIN_TEMPERATURE
    use, row_use = stats, False  # the row pass reads every row unless the positions say which are used
    if args.draft_mode != DRAFT_NONE and sampled:
        # the positions a walk can reach and their candidates, from the tree alone
        pos = torch.empty((B, N + 1, POS_REC_HOST), dtype=torch.int32, device=dev)
        use, row_use = torch.zeros((rows, 2), dtype=torch.int8, device=dev), True
        pos_block_b = max(1, min(next_pow2(B), (1 << 16) // (np2 * np2))) if interpreted else 1
        _tree_positions_kernel[(cdiv(B, pos_block_b),)](
            args.tokens,
            parents,
            n_ptr,
            pos,
            use,
            args.tokens.stride(0),
            args.tokens.stride(1),
            parents.stride(0) if args.parents is not None else 0,
            B,
            K,
            G,
            V,
            N,
            D,
            PER_REQ_N=per_req_n,
            CHAINS=args.parents is None,
            NP2=np2,
            BLOCK_B=pos_block_b,
        )

    # Rows past a ragged tree's last node are skipped: "n_b" of the row pass is the node count
    # (row i of a single chain belongs to node i - 1); chains of verify_multi are never ragged.
    def row_pass(phase: int, rows_per_program: int, grid_chunks: int, chunks: int, chunk_size: int, warps: int) -> None:
        _verify_row_stats_kernel[(cdiv(rows, rows_per_program), grid_chunks)](
            target,
            draft,
            target,  # draft tokens: unused (placeholders are handled by the walk)
            target,  # cu: unused (no flattened layout for trees)
            n_ptr,
            t_ptr,
            k_ptr,
            p_ptr,
            stats,
            idx,
            thr,
            filter_buf,
            filter_int,
            use,
            target.stride(0),
            target.stride(1),
            target.stride(2),
            *d_strides,
            0,
            B,
            K,
            G,
            V,
            chunk_size,
            chunks,
            float(t_val),
            int(k_val),
            float(p_val),
            PER_REQ_N=per_req_n,
            PER_REQ_T=per_req_t,
            PER_REQ_K=per_req_k,
            PER_REQ_P=per_req_p,
            DRAFT_MODE=args.draft_mode,
            HAS_FILTER=has_filter,
            BY_INDEX=by_index,
            PHASE=phase,
            **tplan.constexprs,
            PLACEHOLDERS_END=False,
            GP2=1,
            FLAT=False,
            ROW_USE=row_use,
            BLOCK_R=rows_per_program,
            BLOCK_V=block_v,
            num_warps=warps,
        )

    if has_filter:  # thresholds first (candidates per chunk, selection per row), then the statistics pass
        launch_threshold_phases(row_pass, tplan)
    row_pass(PHASE_STATS.value, block_r, C, C, chunk_size, 8 if block_r * block_v >= 2048 else 4)
    if C > 1:  # the walk reads one record per row
        stats, idx = merge_chunk_stats(stats, idx, rows, K * (G + 1), t_ptr, t_val, per_req_t)
    rrs_c = 1
    brk = rrs = stats  # unused unless K-SEQ / RRS sample with draft distributions
    if kseq and sampled:
        # K-SEQ's rho for every position with siblings, before the walk and split over the vocabulary
        rho_block_v = block_v if interpreted else 512
        rho_blocks = cdiv(V, rho_block_v)
        rho_c = 1
        if num_chunks is not None:
            rho_c = max(1, min(int(num_chunks), rho_blocks))
        elif not interpreted:  # a few positions per request have siblings: fill the GPU with chunks
            rho_c = max(1, min(64, rho_blocks, cdiv(4 * multiprocessors(dev), B)))
        rho_chunk = cdiv(rho_blocks, rho_c) * rho_block_v
        rho_c = cdiv(V, rho_chunk)
        brk = torch.empty((P, RB_REC_HOST), dtype=torch.float32, device=dev)
        sums = torch.empty((P, rho_c, RHO_POINTS), dtype=torch.float32, device=dev)
        block_p = 1 if not interpreted else max(1, min(next_pow2(P), (1 << 16) // (rho_block_v * RHO_POINTS)))
        step_block_p = 64 if not interpreted else min(next_pow2(P), (1 << 16) // RHO_POINTS)
        for rnd in range(RHO_ROUNDS):  # a round's sums, then one step of every search that ran
            _tree_rho_kernel[(cdiv(P, block_p), rho_c)](
                target,
                draft,
                t_ptr,
                pos,
                stats,
                thr,
                brk,
                sums,
                target.stride(0),
                target.stride(1),
                target.stride(2),
                *d_strides,
                B,
                K,
                G,
                V,
                N,
                rho_chunk,
                rho_c,
                rnd,
                float(t_val),
                PER_REQ_T=per_req_t,
                DRAFT_MODE=args.draft_mode,
                HAS_FILTER=has_filter,
                BY_INDEX=by_index,
                RHO_P=RHO_POINTS,
                BLOCK_P=block_p,
                BLOCK_V=rho_block_v,
                num_warps=4,
            )
            _tree_rho_step_kernel[(cdiv(P, step_block_p),)](
                t_ptr,
                pos,
                brk,
                sums,
                B,
                N,
                rho_c,
                rnd,
                float(t_val),
                PER_REQ_T=per_req_t,
                RHO_P=RHO_POINTS,
                BLOCK_P=step_block_p,
                num_warps=4,
            )
    rrs_rounds = min((K if args.parents is None else N) - 1, RRS_MAX_HOST - 1)
    if not kseq and args.draft_mode != DRAFT_NONE and sampled and rrs_rounds > 0:
        # RRS's residual masses Z_1 .. Z_7 of every position, before the walk and split over the vocabulary
        rrs_c = 1
        if num_chunks is not None:
            rrs_c = max(1, min(int(num_chunks), blocks))
        elif not interpreted:
            rrs_c = max(1, min(64, blocks, cdiv(4 * multiprocessors(dev), B)))
        rrs_chunk = cdiv(blocks, rrs_c) * block_v
        rrs_c = cdiv(V, rrs_chunk)
        rrs = torch.empty((RRS_MAX_HOST - 1, P, rrs_c), dtype=torch.float32, device=dev)
        block_p = 1 if not interpreted else max(1, min(next_pow2(P), (1 << 16) // block_v))
        for rnd in range(1, rrs_rounds + 1):
            _tree_rrs_kernel[(cdiv(P, block_p), rrs_c)](
                target,
                draft,
                t_ptr,
                pos,
                stats,
                thr,
                rrs,
                target.stride(0),
                target.stride(1),
                target.stride(2),
                *d_strides,
                B,
                K,
                G,
                V,
                N,
                rrs_chunk,
                rrs_c,
                rnd,
                float(t_val),
                PER_REQ_T=per_req_t,
                DRAFT_MODE=args.draft_mode,
                HAS_FILTER=has_filter,
                BY_INDEX=by_index,
                WOR=args.method == "rrs_wor",
                BLOCK_P=block_p,
                BLOCK_V=block_v,
                num_warps=4,
            )
    race_i = torch.empty((B, RACE_I_HOST), dtype=torch.int32, device=dev)
    race_f = torch.empty((B, RACE_F_HOST), dtype=torch.float32, device=dev)
    race_zs = torch.empty((B, np2), dtype=torch.float32, device=dev)
    race_ds = torch.empty((B, np2), dtype=torch.float32, device=dev)
    race_xs = torch.empty((B, np2), dtype=torch.int64, device=dev)
    _tree_walk_kernel[(cdiv(B, block_b),)](
        target,
        draft,
        args.tokens,
        parents,
        n_ptr,
        t_ptr,
        s_ptr,
        stats,
        idx,
        thr,
        tokens,
        nodes,
        num_accepted,
        nonfinite,
        brk,
        race_i,
        race_f,
        race_zs,
        race_ds,
        race_xs,
        rrs,
        target.stride(0),
        target.stride(1),
        target.stride(2),
        *d_strides,
        args.tokens.stride(0),
        args.tokens.stride(1),
        parents.stride(0) if args.parents is not None else 0,
        tokens.stride(0),
        nodes.stride(0) if D > 0 else 0,
        B,
        K,
        G,
        V,
        N,
        D,
        rrs_c,
        float(t_val),
        s_val,
        PER_REQ_N=per_req_n,
        PER_REQ_T=per_req_t,
        PER_REQ_SEED=per_req_s,
        CHAINS=args.parents is None,
        DRAFT_MODE=args.draft_mode,
        HAS_FILTER=has_filter,
        BY_INDEX=by_index,
        METHOD=METHODS[args.method],
        BLOCK_B=block_b,
        NP2=np2,
        DP2=next_pow2(D + 1),
        BLOCK_V=block_v,
        num_warps=4,
    )
    if sampled:  # the recovered / bonus tokens: races split over the vocabulary like chain verification
        race_block_b = block_b if interpreted else 1
        race_c = 1
        if num_chunks is not None:
            race_c = max(1, min(int(num_chunks), blocks))
        elif not interpreted:  # at least ~2 programs per SM
            race_c = max(1, min(blocks, cdiv(2 * multiprocessors(dev), B)))
        race_chunk = cdiv(blocks, race_c) * block_v
        race_c = cdiv(V, race_chunk)
        race_key = torch.empty((B, race_c, 2), dtype=torch.float32, device=dev)
        race_idx = torch.empty((B, race_c, 2), dtype=torch.int32, device=dev)
        _tree_race_kernel[(cdiv(B, race_block_b), race_c)](
            target,
            draft,
            t_ptr,
            s_ptr,
            stats,
            thr,
            race_i,
            race_f,
            race_zs,
            race_ds,
            race_xs,
            race_key,
            race_idx,
            target.stride(0),
            target.stride(1),
            target.stride(2),
            *d_strides,
            B,
            K,
            G,
            V,
            race_chunk,
            race_c,
            float(t_val),
            s_val,
            PER_REQ_T=per_req_t,
            PER_REQ_SEED=per_req_s,
            DRAFT_MODE=args.draft_mode,
            HAS_FILTER=has_filter,
            BY_INDEX=by_index,
            METHOD=METHODS[args.method],
            NP2=np2,
            BLOCK_B=race_block_b,
            BLOCK_V=block_v,
            num_warps=4,
        )
        fin_block = min(next_pow2(B), 128)
        _tree_finalize_kernel[(cdiv(B, fin_block),)](
            race_i, race_key, race_idx, tokens, tokens.stride(0), B, V, race_c, BLOCK_B=fin_block
        )
    return TreeVerifyOutput(tokens, num_accepted, nodes, nonfinite)
