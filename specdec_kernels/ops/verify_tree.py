"""Multi-draft and token-tree verification: SpecTr K-SEQ and recursive rejection sampling.

Two launches, no host synchronisation, no Python loop over requests or nodes:

1. ``_verify_row_stats_kernel`` (shared with ``verify``): online max / sum-exp, greedy argmax and
   top-k/top-p thresholds of every target row and draft row of the tree.
2. ``_tree_walk_kernel`` grid (request tiles): walks each request's tree from the root. At every
   position it gathers the candidates' p(x) and q(x), runs the method (K-SEQ solves rho* by a
   bracketing search over vocabulary sums inside the kernel; RRS renormalises its residual with
   one vocabulary pass per rejected candidate), and either moves to the accepted child or draws
   the recovered / bonus token with an exponential race over the residual - which, like p and q,
   is never written to memory. It finally writes the accepted path and its node indices.

The semantics (the walk over node *sets*, so repeated sibling tokens act with multiplicity) are
specified by ``specdec_kernels.reference.verify_tree``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._interpreter import multiprocessors, plans_for_interpreter
from .._tree_args import TreeArgs
from .._types import METHODS, TreeVerifyOutput
from ._triton_helpers import (
    DRAFT_LOGITS,
    DRAFT_NONE,
    DRAFT_PROBS,
    PURPOSE_ACCEPT,
    PURPOSE_BONUS,
    PURPOSE_RECOVER,
    first_argmax_update,
    inverse_temperature,
    load_logits,
    load_probs,
    next_pow2,
    per_request,
    race_noise,
    request_seed,
    safe_max,
    uniform_open,
)
from .verify import (
    IDX_GREEDY,
    NUM_IDX,
    NUM_IDX_HOST,
    NUM_STATS,
    NUM_STATS_HOST,
    NUM_THR,
    PHASE_STATS,
    STAT_BAD_Q,
    STAT_BAD_T,
    STAT_M_Q,
    STAT_M_T,
    STAT_Z_Q,
    STAT_Z_T,
    THR_Q,
    THR_T,
    _prob_of,
    _verify_row_stats_kernel,
    launch_threshold_phases,
    merge_chunk_stats,
    threshold_plan,
)

RHO_POINTS = 16  # must match reference.verify_tree
RHO_ROUNDS = 4


@triton.jit
def _record(b, node, K, G, TARGET: tl.constexpr):
    """Row-statistics record of a node's target row (node -1 = root) or of its draft row."""
    chain = tl.where(node < 0, 0, node // G)
    slot = tl.where(node < 0, 0, node % G + TARGET)
    return (b * K + chain) * (G + 1) + slot


@triton.jit
def _row_ptr(base, b, node, stride_b, stride_k, stride_g, G, TARGET: tl.constexpr):
    chain = tl.where(node < 0, 0, node // G).to(tl.int64)
    slot = tl.where(node < 0, 0, node % G + TARGET).to(tl.int64)
    return base + b * stride_b + chain * stride_k + slot * stride_g


@triton.jit
def _pick(vals, cols, j):
    """vals[b, j[b]] of a [BLOCK_B, N] tile."""
    return tl.sum(tl.where(cols == j[:, None], vals, 0), axis=1)


@triton.jit
def _position_tiles(
    t_row, d_row, cols, lane, lane_q, m_t, z_t, thr_t, m_q, z_q, thr_q, inv_t, DRAFT_MODE: tl.constexpr
):
    """(target logits, p, q) on a [BB, BLOCK_V] tile of the position's target and draft rows
    (the draft row is read where lane_q holds)."""
    xt, _bad_t = load_logits(t_row[:, None] + cols, lane)
    pv = _prob_of(xt, m_t[:, None], z_t[:, None], thr_t[:, None], inv_t[:, None])
    if DRAFT_MODE == DRAFT_LOGITS:
        xq, _bad_q = load_logits(d_row[:, None] + cols, lane_q)
        qv = _prob_of(xq, m_q[:, None], z_q[:, None], thr_q[:, None], inv_t[:, None])
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
    thr_ptr,  # [B*K*(G+1), 2] fp32 (HAS_FILTER)
    out_tokens_ptr,  # [B, D+1] int64 out
    out_nodes_ptr,  # [B, D] int64 out
    out_accepted_ptr,  # [B] int32 out
    nonfinite_ptr,  # [B] bool out
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
    # scalar parameters
    temperature,
    seed,
    # constexprs
    PER_REQ_N: tl.constexpr,
    PER_REQ_T: tl.constexpr,
    PER_REQ_SEED: tl.constexpr,
    CHAINS: tl.constexpr,  # parents implicit: K chains of G slots (verify_multi)
    DRAFT_MODE: tl.constexpr,
    HAS_FILTER: tl.constexpr,
    METHOD: tl.constexpr,  # 0 kseq, 1 rrs, 2 rrs_wor
    BLOCK_B: tl.constexpr,
    NP2: tl.constexpr,  # next power of two >= N
    DP2: tl.constexpr,  # next power of two >= D + 1
    BLOCK_V: tl.constexpr,
    RHO_P: tl.constexpr,
    RHO_R: tl.constexpr,
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
    tok_ptrs = tokens_ptr + b[:, None] * stride_xb + (nodes // G).to(tl.int64) * stride_xk + nodes % G
    tok = tl.load(tok_ptrs, mask=node_ok, other=-1).to(tl.int64)
    tok_ok = (tok >= 0) & (tok < V)  # out-of-range ids (validate=False) never become candidates
    tok = tl.where(tok_ok, tok, -1)
    if CHAINS:
        par = tl.where(nodes % G == 0, -1, nodes - 1) + tl.zeros([BLOCK_B, NP2], tl.int32)
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

    for d in range(0, D + 1):
        active = ~done
        stochastic = active & ~greedy
        # candidates: children of the current node set, in node order
        parent_in_set = ((in_set[:, None] >> tl.maximum(par, 0).to(tl.int64)) & 1) != 0
        in_pos = tl.where(par >= 0, parent_in_set, (par == -1) & at_root[:, None])
        cand = in_pos & tok_ok & active[:, None]
        k = tl.sum(cand.to(tl.int32), axis=1)
        rank = tl.cumsum(cand.to(tl.int32), axis=1) - 1
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
        if HAS_FILTER:
            thr_t = tl.load(thr_ptr + rec_t * NUM_THR + THR_T, mask=stochastic, other=float("-inf"))
        flagged = flagged | (active & (bad_t > 0.0)) | (stochastic & (z_t == 0.0))
        t_row = _row_ptr(target_ptr, b, rep, stride_tb, stride_tk, stride_tg, G, 1)
        x_c, _bad_c = load_logits(t_row[:, None] + tl.maximum(tok, 0), cand)
        p_c = _prob_of(x_c, m_t[:, None], z_t[:, None], thr_t[:, None], inv_t[:, None])

        # draft distribution of the position: the first candidate's draft row
        first_safe = tl.where(has_cand, first, 0)
        rec_q = _record(b, first_safe, K, G, 0)
        d_row = _row_ptr(draft_ptr, b, first_safe, stride_db, stride_dk, stride_dg, G, 0)
        m_q = tl.load(stats_ptr + rec_q * NUM_STATS + STAT_M_Q, mask=stochastic & has_cand, other=0.0)
        z_q = tl.load(stats_ptr + rec_q * NUM_STATS + STAT_Z_Q, mask=stochastic & has_cand, other=0.0)
        thr_q = tl.full([BLOCK_B], float("-inf"), tl.float32)
        if DRAFT_MODE != DRAFT_NONE:  # unusable draft logits / probabilities in the row of this position
            bad_q = tl.load(stats_ptr + rec_q * NUM_STATS + STAT_BAD_Q, mask=stochastic & has_cand, other=0.0)
            flagged = flagged | (stochastic & has_cand & (bad_q > 0.0))
        if DRAFT_MODE == DRAFT_LOGITS:
            if HAS_FILTER:
                thr_q = tl.load(thr_ptr + rec_q * NUM_THR + THR_Q, mask=stochastic & has_cand, other=float("-inf"))
            xq_c, _bad_qc = load_logits(d_row[:, None] + tl.maximum(tok, 0), cand)
            q_c = _prob_of(xq_c, m_q[:, None], z_q[:, None], thr_q[:, None], inv_t[:, None])
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
            # K-SEQ: bracket rho* in [1, k] with RHO_P points per pass (lanes with k > 1)
            search = stochastic & (k > 1)
            kf = k.to(tl.float32)
            lo = tl.full([BLOCK_B], 1.0, tl.float32)
            hi = tl.maximum(kf, 1.0)
            beta_hi = tl.zeros([BLOCK_B], tl.float32)
            pts_i = tl.arange(0, RHO_P)[None, :]
            if tl.max(search.to(tl.int32), axis=0) > 0:
                for _round in range(RHO_R):
                    pts = lo[:, None] + (hi - lo)[:, None] * ((pts_i + 1).to(tl.float32) / RHO_P)
                    pts = tl.where(pts_i == RHO_P - 1, hi[:, None], pts)
                    beta = tl.zeros([BLOCK_B, RHO_P], tl.float32)
                    for start in range(0, V, BLOCK_V):
                        cols = start + vcols
                        lane = search[:, None] & (cols < V)
                        _x, pv, qv = _position_tiles(
                            t_row, d_row, cols, lane, lane, m_t, z_t, thr_t, m_q, z_q, thr_q, inv_t, DRAFT_MODE
                        )
                        terms = tl.minimum(qv[:, None, :], pv[:, None, :] / pts[:, :, None])
                        beta += tl.sum(terms, axis=2)
                    f = 1.0 - tl.exp(kf[:, None] * tl.log(tl.maximum(1.0 - beta, 0.0))) - pts * beta
                    m_star = tl.min(tl.where(f <= 0.0, pts_i, RHO_P - 1), axis=1)
                    new_lo = tl.where(m_star > 0, _pick(pts, pts_i, m_star - 1), lo)
                    new_hi = _pick(pts, pts_i, m_star)
                    new_beta = _pick(beta, pts_i, m_star)
                    lo = tl.where(search, new_lo, lo)
                    hi = tl.where(search, new_hi, hi)
                    beta_hi = tl.where(search, new_beta, beta_hi)
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
                if j > 0:  # Z_j: one pass over the vocabulary
                    z_j = tl.zeros([BLOCK_B], tl.float32)
                    for start in range(0, V, BLOCK_V):
                        cols = start + vcols
                        lane = live[:, None] & (cols < V)
                        _x, pv, qv = _position_tiles(
                            t_row, d_row, cols, lane, lane, m_t, z_t, thr_t, m_q, z_q, thr_q, inv_t, DRAFT_MODE
                        )
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

        # ---- recovered / bonus token: exponential race over the residual of this position
        race = emit & ~greedy
        best_key = tl.full([BLOCK_B], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK_B], tl.int32)
        p_key = tl.full([BLOCK_B], float("-inf"), tl.float32)
        p_idx = tl.zeros([BLOCK_B], tl.int32)
        if tl.max(race.to(tl.int32), axis=0) > 0:
            purpose = tl.where(has_cand, PURPOSE_RECOVER, PURPOSE_BONUS)
            log_z = tl.log(tl.where(z_t > 0.0, z_t, 1.0))
            for start in range(0, V, BLOCK_V):
                cols = start + vcols
                lane = race[:, None] & (cols < V)
                xt, pv, qv = _position_tiles(
                    t_row,
                    d_row,
                    cols,
                    lane,
                    lane & has_cand[:, None],
                    m_t,
                    z_t,
                    thr_t,
                    m_q,
                    z_q,
                    thr_q,
                    inv_t,
                    DRAFT_MODE,
                )
                if DRAFT_MODE == DRAFT_NONE:
                    gone = (cols < 0) & lane
                    for j in range(0, tl.max(k, axis=0)):
                        x_j = tl.sum(tl.where(cand & (rank == j), tok, 0), axis=1)
                        gone = gone | ((cols == x_j[:, None]) & (j < k)[:, None])
                    w = tl.where(gone, 0.0, pv)
                else:
                    if METHOD == 0:
                        w = tl.maximum(pv - scale[:, None] * tl.minimum(qv, pv / rho[:, None]), 0.0)
                    else:
                        w = _rrs_residual(pv, qv, steps, zs, xs, ds, cols.to(tl.int64), nodes, METHOD == 2)
                w = tl.where(has_cand[:, None], w, pv)
                noise = race_noise(seed[:, None], start, counter[:, None], purpose[:, None], BLOCK_V)
                log_p = (xt - safe_max(m_t)[:, None]) * inv_t[:, None] - log_z[:, None]
                keys = tl.where(lane & (w > 0.0), tl.log(tl.maximum(w, 1e-38)) + noise, float("-inf"))
                keys_p = tl.where(lane & (pv > 0.0), log_p + noise, float("-inf"))
                best_key, best_idx = first_argmax_update(best_key, best_idx, keys, cols)
                p_key, p_idx = first_argmax_update(p_key, p_idx, keys_p, cols)
        sampled = tl.where(best_key > float("-inf"), best_idx, p_idx).to(tl.int64)
        final = tl.where(greedy, g_idx, sampled)
        final = tl.minimum(tl.maximum(final, 0), V - 1)

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
    tl.store(out_tokens_ptr + b[:, None] * stride_ob + out_cols, out_tok, mask=b_ok[:, None] & (out_cols <= D))
    tl.store(out_nodes_ptr + b[:, None] * stride_nb + out_cols, path, mask=b_ok[:, None] & (out_cols < D))
    tl.store(out_accepted_ptr + b, depth, mask=b_ok)
    tl.store(nonfinite_ptr + b, flagged, mask=b_ok)


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


def launch_tree(args: TreeArgs, block_v: int | None = None, num_chunks: int | None = None) -> TreeVerifyOutput:
    """Run the row-statistics pass and the walk on checked arguments (``_tree_args.check_tree_args``).

    num_chunks / block_v override the launch plan (tests use them to split small vocabularies)."""
    B, K, G, V, N, D = args.B, args.K, args.G, args.V, args.N, args.max_depth
    dev = args.target.device
    tokens = torch.empty((B, D + 1), dtype=torch.int64, device=dev)
    nodes = torch.empty((B, D), dtype=torch.int64, device=dev)
    num_accepted = torch.empty((B,), dtype=torch.int32, device=dev)
    nonfinite = torch.empty((B,), dtype=torch.bool, device=dev)
    if B == 0:
        return TreeVerifyOutput(tokens, num_accepted, nodes, nonfinite)

    interpreted = plans_for_interpreter(dev)
    # On a GPU 2 rows x 1024 entries per program (8 warps): the row pass keeps per-lane running state
    # (about 60 registers of it at 8 entries per thread; 4 rows x 4 warps spilled).
    max_block_v, tile = (8192, 1 << 16) if interpreted else (1024, 2048)
    block_v = max(4, min(next_pow2(V), block_v or max_block_v))  # races take 4 entries per Philox call
    rows = B * K * (G + 1)
    block_r = max(1, min(next_pow2(rows), tile // block_v))
    has_filter = args.has_filter
    np2 = max(2, next_pow2(N))
    # The walk holds [BLOCK_B, NP2, NP2] and [BLOCK_B, RHO_POINTS, BLOCK_V] tiles.
    block_b = max(1, min(next_pow2(B), tile // max(block_v * RHO_POINTS, np2 * np2, 1))) if interpreted else 1

    blocks = triton.cdiv(V, block_v)
    C = _row_pass_chunks(args, triton.cdiv(rows, block_r), blocks, interpreted, num_chunks)
    chunk_size = triton.cdiv(blocks, C) * block_v
    C = triton.cdiv(V, chunk_size)
    stats = torch.empty((rows, C, NUM_STATS_HOST), dtype=torch.float32, device=dev)
    idx = torch.empty((rows, C, NUM_IDX_HOST), dtype=torch.int32, device=dev)
    thr = torch.empty((rows, 2) if has_filter else (1, 2), dtype=torch.float32, device=dev)
    tplan = threshold_plan(args.target, rows, V)
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

    # Rows past a ragged tree's last node are skipped: "n_b" of the row pass is the node count
    # (row i of a single chain belongs to node i - 1); chains of verify_multi are never ragged.
    def row_pass(phase: int, rows_per_program: int, grid_chunks: int, chunks: int, chunk_size: int, warps: int) -> None:
        _verify_row_stats_kernel[(triton.cdiv(rows, rows_per_program), grid_chunks)](
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
            PHASE=phase,
            **tplan.constexprs,
            PLACEHOLDERS_END=False,
            GP2=1,
            FLAT=False,
            BLOCK_R=rows_per_program,
            BLOCK_V=block_v,
            num_warps=warps,
        )

    if has_filter:  # thresholds first (candidates per chunk, selection per row), then the statistics pass
        launch_threshold_phases(row_pass, tplan)
    row_pass(PHASE_STATS.value, block_r, C, C, chunk_size, 8 if block_r * block_v >= 2048 else 4)
    if C > 1:  # the walk reads one record per row
        stats, idx = merge_chunk_stats(stats, idx, rows, K * (G + 1), t_ptr, t_val, per_req_t)
    parents = args.parents if args.parents is not None else target
    _tree_walk_kernel[(triton.cdiv(B, block_b),)](
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
        float(t_val),
        s_val,
        PER_REQ_N=per_req_n,
        PER_REQ_T=per_req_t,
        PER_REQ_SEED=per_req_s,
        CHAINS=args.parents is None,
        DRAFT_MODE=args.draft_mode,
        HAS_FILTER=has_filter,
        METHOD=METHODS[args.method],
        BLOCK_B=block_b,
        NP2=np2,
        DP2=next_pow2(D + 1),
        BLOCK_V=block_v,
        RHO_P=RHO_POINTS,
        RHO_R=RHO_ROUNDS,
        num_warps=4,
    )
    return TreeVerifyOutput(tokens, num_accepted, nodes, nonfinite)
