"""Phase 4 of tree verification: the walk from the root over the gathered p(x), q(x) of each
position's candidates, with the rho / Z_j of phase 3; it records the race it ends with."""

from __future__ import annotations

import triton
import triton.language as tl

from ..chain import _emitted_logprobs
from ..helpers import (
    DRAFT_LOGITS,
    DRAFT_NONE,
    DRAFT_PROBS,
    PURPOSE_ACCEPT,
    allowed_at,
    inverse_temperature,
    load_logits,
    load_probs,
    per_request,
    request_seed,
    uniform_open,
)
from ..records import IDX_GREEDY, NUM_IDX, NUM_STATS, STAT_BAD_Q, STAT_BAD_T, STAT_GMAX
from ..row_pass import prob_of
from .common import (
    RB_GHI,
    RB_HI,
    RB_REC,
    RRS_MAX,
    _mask_rows,
    _pick,
    _position_stats,
    _position_tiles,
    _record,
    _row_ptr,
    _rrs_residual,
    _rrs_start,
    _store_race,
    _tree_nodes,
)


@triton.jit(do_not_specialize=["B", "rrs_chunks", "seed"])  # per-call scalars: triton/helpers.py
def _tree_walk_kernel(
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
    mask_ptr,  # [B, K, G+1, W] int32 (HAS_MASK): token_bitmask words of the target rows (_mask_rows)
    # strides: target, draft, mask (words), tokens, parents, out tokens, out nodes
    stride_tb, stride_tk, stride_tg, stride_db, stride_dk, stride_dg, stride_mb, stride_mk, stride_mg,
    stride_xb, stride_xk, stride_pb, stride_ob, stride_nb,
    B, K, G, V, N, D, rrs_chunks,  # sizes
    temperature,  # scalar parameters
    seed: tl.int64,  # one signature for every seed (see triton/helpers.py)
    # last, so that the other arguments keep their places (a call without logprobs compiles as before)
    out_logprobs_ptr,  # [B, D+1] fp32 out (LOGPROBS): but the raced tokens' (_tree_finalize_kernel)
    stride_lb,  # out logprobs row stride (LOGPROBS)
    # constexprs
    PER_REQ_N: tl.constexpr, PER_REQ_T: tl.constexpr, PER_REQ_SEED: tl.constexpr,
    CHAINS: tl.constexpr,  # parents implicit: K chains of G slots (verify_multi)
    DRAFT_MODE: tl.constexpr, HAS_FILTER: tl.constexpr, BY_INDEX: tl.constexpr,
    METHOD: tl.constexpr,  # 0 kseq, 1 rrs, 2 rrs_wor
    BLOCK_B: tl.constexpr,
    NP2: tl.constexpr,  # next power of two >= N
    DP2: tl.constexpr,  # next power of two >= D + 1
    BLOCK_V: tl.constexpr,
    HAS_MASK: tl.constexpr,  # token_bitmask: disallowed logits are -inf in target and draft rows
    LOGPROBS: tl.constexpr,  # return_logprobs: each token's logprob under the row scored with (_walk_logprobs)
    LP_BY_INDEX: tl.constexpr,  # (LOGPROBS) index cuts in the thresholds, greedy rows' at T = 1 counted
):  # fmt: skip
    """Walks each request's tree from the root (BLOCK_B requests per program): at each position the
    method's test over its candidates, then the accepted child's node set or the end of the walk,
    whose recovered / bonus token is left to _tree_race_kernel (greedy requests: the argmax)."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    b_ok = b < B
    n_nodes = per_request(num_nodes_ptr, N, b, b_ok, PER_REQ_N).to(tl.int32)
    temperature = per_request(temperature_ptr, temperature, b, b_ok, PER_REQ_T).to(tl.float32)
    greedy, inv_t = inverse_temperature(temperature)
    seed = request_seed(seed_ptr, seed, b, b_ok, PER_REQ_SEED)
    # the tree: tokens and parents of every node, [BLOCK_B, NP2]; out-of-range ids (validate=False)
    # never become candidates, padding nodes are nobody's children (parent -2)
    nodes = tl.arange(0, NP2)[None, :]
    n_nodes = tl.where(b_ok, n_nodes, 0)[:, None]
    tok, tok_ok, par = _tree_nodes(
        tokens_ptr, parents_ptr, b[:, None], nodes, n_nodes, stride_xb, stride_xk, stride_pb, G, V, CHAINS
    )
    flagged = tl.zeros([BLOCK_B], tl.int1)  # placeholder ids (outside [0, V)) are no error
    at_root, in_set, rep, last, depth, done, out_tok = _walk_start(b_ok, BLOCK_B, DP2)
    out_cols = tl.arange(0, DP2)[None, :]
    r_flag, r_rep, r_first, r_has, r_rho, r_scale, r_steps, r_zs, r_ds, r_xs = _race_start(BLOCK_B, NP2)
    out_lp = tl.full([BLOCK_B, DP2], float("nan"), tl.float32)  # LOGPROBS: NaN where nothing is emitted
    for d in range(0, D + 1):
        active = ~done
        stochastic = active & ~greedy
        cand, rank, k, first, has_cand = _walk_candidates(par, tok_ok, in_set, at_root, active, nodes, NP2)
        first_safe = tl.where(has_cand, first, 0)
        t_row = _row_ptr(target_ptr, b, rep, stride_tb, stride_tk, stride_tg, G, 1)
        d_row = _row_ptr(draft_ptr, b, first_safe, stride_db, stride_dk, stride_dg, G, 0)
        tm_row, dm_row = _mask_rows(
            mask_ptr, parents_ptr, b, rep, first_safe, active, stride_mb, stride_mk, stride_mg, stride_pb, G, CHAINS,
            HAS_MASK,
        )  # fmt: skip
        rec_t = _record(b, rep, K, G, 1)
        rec_q = _record(b, first_safe, K, G, 0)
        m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q = _position_stats(
            stats_ptr, thr_ptr, rec_t, rec_q, active, stochastic, stochastic & has_cand, DRAFT_MODE, HAS_FILTER,
            BY_INDEX,
        )  # fmt: skip
        g_idx, flagged = _walk_row_checks(
            stats_ptr, idx_ptr, rec_t, rec_q, active, stochastic, has_cand, z_t, flagged, DRAFT_MODE
        )
        p_c, q_c = _candidate_probs(
            t_row, d_row, tm_row, dm_row, tok, cand, m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q, inv_t, DRAFT_MODE,
            BY_INDEX, HAS_MASK,
        )  # fmt: skip
        u = uniform_open(seed[:, None], rank, (rep + 1)[:, None], PURPOSE_ACCEPT)  # counter: the position
        # ---- decide: index of the accepted candidate (NP2 = none)
        rho, scale, steps = _decide_start(BLOCK_B)
        zs, ds, xs = _rrs_start(nodes, BLOCK_B, NP2)  # RRS normalisers, WOR q masses, tokens by rank
        if DRAFT_MODE == DRAFT_NONE:
            accept = _accept_one_hot(tok, cand, p_c, u, nodes)
        elif METHOD == 0:
            accept, rho, scale = _accept_kseq(brk_ptr, b, rep, k, cand, p_c, q_c, u, stochastic, N, BLOCK_B)
        else:
            accept, zs, ds, xs, steps = _accept_rrs(
                rrs_ptr, b, rep, k, tok, cand, rank, p_c, q_c, u, stochastic, zs, ds, xs, steps, nodes, t_row, d_row,
                tm_row, dm_row, m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q, inv_t, B, N, V, rrs_chunks, DRAFT_MODE,
                BY_INDEX, METHOD, HAS_MASK, BLOCK_V,
            )  # fmt: skip
        chosen, accepted, emit = _choose(accept, cand, tok, g_idx, greedy, active, nodes, NP2)
        # ---- recovered / bonus token: recorded here, raced by _tree_race_kernel over vocabulary chunks
        r_flag, r_rep, r_first, r_has, r_rho, r_scale, r_steps, r_zs, r_ds, r_xs = _race_update(
            emit & ~greedy, rep, first_safe, has_cand, rho, scale, steps, zs, ds, xs, cand, tok, r_flag, r_rep,
            r_first, r_has, r_rho, r_scale, r_steps, r_zs, r_ds, r_xs, DRAFT_MODE,
        )  # fmt: skip
        # ---- advance: the accepted child's node set, or the end of the walk
        in_set, rep, last, at_root, depth, out_tok = _walk_advance(
            tok, cand, nodes, chosen, accepted, tl.where(greedy, g_idx, -1), active, d, out_cols, in_set, rep, last,
            at_root, depth, out_tok, NP2,
        )  # fmt: skip
        if LOGPROBS:  # the tokens known here: accepted ones and greedy requests' last (raced ones: later)
            out_lp = _walk_logprobs(
                out_lp, out_tok, out_cols, d, active, accepted | (active & greedy), t_row, tm_row, rec_t, stats_ptr,
                thr_ptr, tl.where(greedy, 1.0, temperature), HAS_FILTER, LP_BY_INDEX, HAS_MASK,
            )  # fmt: skip
        done = done | emit
    path = _accepted_path(last, depth, par, nodes, out_cols, D, BLOCK_B, DP2)
    _store_race(
        race_i_ptr, race_f_ptr, race_zs_ptr, race_ds_ptr, race_xs_ptr, b, b_ok, r_flag, r_rep, r_first, r_has, r_steps,
        depth, r_rho, r_scale, r_zs, r_ds, r_xs, nodes, NP2,
    )  # fmt: skip
    tl.store(out_tokens_ptr + b[:, None] * stride_ob + out_cols, out_tok, mask=b_ok[:, None] & (out_cols <= D))
    tl.store(out_nodes_ptr + b[:, None] * stride_nb + out_cols, path, mask=b_ok[:, None] & (out_cols < D))
    tl.store(out_accepted_ptr + b, depth, mask=b_ok)
    if LOGPROBS:
        tl.store(out_logprobs_ptr + b[:, None] * stride_lb + out_cols, out_lp, mask=b_ok[:, None] & (out_cols <= D))
    tl.store(nonfinite_ptr + b, flagged, mask=b_ok)


@triton.jit
def _walk_start(b_ok, BLOCK_B: tl.constexpr, DP2: tl.constexpr):
    """The walk's state at the root: (at the root, bitmask of the nodes spelling the accepted prefix,
    first node of that set (-1 = root), last accepted node, accepted tokens, done, output tokens)."""
    at_root = b_ok
    in_set = tl.zeros([BLOCK_B], tl.int64)
    rep = tl.full([BLOCK_B], -1, tl.int32)
    last = tl.full([BLOCK_B], -1, tl.int32)
    depth = tl.zeros([BLOCK_B], tl.int32)
    done = ~b_ok
    out_tok = tl.full([BLOCK_B, DP2], -1, tl.int64)
    return at_root, in_set, rep, last, depth, done, out_tok


@triton.jit
def _walk_logprobs(
    out_lp, out_tok, out_cols, d, active, known, t_row, tm_row, rec_t, stats_ptr, thr_ptr, unit_t,
    HAS_FILTER: tl.constexpr, BY_INDEX: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """out_lp with column d set on the active lanes: log p of the token written there under the row
    the walk scored depth d with (t_row, mask row tm_row, record rec_t: the root's, then the first
    node's of the set spelling the accepted prefix; ``ops/logprobs.py``) where `known`, NaN for now
    where the token is raced (_tree_finalize_kernel scores it). unit_t: T, 1 for greedy requests
    (their records hold T = 1 statistics and, with logprobs, their thresholds)."""
    tok_d = tl.sum(tl.where(out_cols == d, out_tok, 0), axis=1)
    lp = _emitted_logprobs(
        t_row, tm_row, stats_ptr, thr_ptr, rec_t, known, tok_d, unit_t, HAS_FILTER, BY_INDEX, HAS_MASK
    )
    return tl.where(active[:, None] & (out_cols == d), lp[:, None], out_lp)


@triton.jit
def _race_start(BLOCK_B: tl.constexpr, NP2: tl.constexpr):
    """The race's record before the walk ends (fields as in _store_race): nobody races."""
    r_flag = tl.zeros([BLOCK_B], tl.int1)
    r_rep = tl.full([BLOCK_B], -1, tl.int32)
    r_first = tl.zeros([BLOCK_B], tl.int32)
    r_has = tl.zeros([BLOCK_B], tl.int1)
    r_rho = tl.full([BLOCK_B], 1.0, tl.float32)
    r_scale = tl.full([BLOCK_B], 1.0, tl.float32)
    r_steps = tl.zeros([BLOCK_B], tl.int32)
    r_zs = tl.zeros([BLOCK_B, NP2], tl.float32)
    r_ds = tl.zeros([BLOCK_B, NP2], tl.float32)
    r_xs = tl.full([BLOCK_B, NP2], -1, tl.int64)
    return r_flag, r_rep, r_first, r_has, r_rho, r_scale, r_steps, r_zs, r_ds, r_xs


@triton.jit
def _walk_candidates(par, tok_ok, in_set, at_root, active, nodes, NP2: tl.constexpr):
    """Candidates of the current position (children of its node set, in node order): (candidate
    mask, rank, count k, first candidate (NP2: none), has candidates)."""
    parent_in_set = ((in_set[:, None] >> tl.maximum(par, 0).to(tl.int64)) & 1) != 0
    in_pos = tl.where(par >= 0, parent_in_set, (par == -1) & at_root[:, None])
    cand = in_pos & tok_ok & active[:, None]
    rank = tl.cumsum(cand.to(tl.int32), axis=1) - 1
    # k from the ranks, not tl.sum(cand): LLVM turns that sum of booleans into a bitcast of <8 x i1>
    # to <2 x i4> + popcount, which the NVPTX backend lowers through an (unused) 8-byte stack frame
    k = tl.max(rank, axis=1) + 1
    first = tl.min(tl.where(cand, nodes, NP2), axis=1)
    return cand, rank, k, first, k > 0


@triton.jit
def _walk_row_checks(
    stats_ptr, idx_ptr, rec_t, rec_q, active, stochastic, has_cand, z_t, flagged, DRAFT_MODE: tl.constexpr
):
    """(greedy argmax of the position's target row, flagged updated): unusable target logits, an
    empty filtered target row (sampled requests), a row without a finite logit (greedy requests),
    unusable draft logits / probabilities in the position's draft row."""
    bad_t = tl.load(stats_ptr + rec_t * NUM_STATS + STAT_BAD_T, mask=active, other=0.0)
    g_idx = tl.load(idx_ptr + rec_t * NUM_IDX + IDX_GREEDY, mask=active, other=0).to(tl.int64)
    flagged = flagged | (active & (bad_t > 0.0)) | (stochastic & (z_t == 0.0))
    # a greedy row without a finite logit (all -inf, or a mask allowing nothing): flagged, as the chain
    g_max = tl.load(stats_ptr + rec_t * NUM_STATS + STAT_GMAX, mask=active & ~stochastic, other=0.0)
    flagged = flagged | (active & ~stochastic & ~(g_max > float("-inf")))
    if DRAFT_MODE != DRAFT_NONE:
        bad_q = tl.load(stats_ptr + rec_q * NUM_STATS + STAT_BAD_Q, mask=stochastic & has_cand, other=0.0)
        flagged = flagged | (stochastic & has_cand & (bad_q > 0.0))
    return g_idx, flagged


@triton.jit
def _candidate_probs(
    t_row, d_row, tm_row, dm_row, tok, cand, m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q, inv_t,
    DRAFT_MODE: tl.constexpr, BY_INDEX: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """p(x) and q(x) of the candidates' tokens ([BLOCK_B, NP2]; one-hot drafts: q = 1), under the
    rows' token_bitmask rows tm_row / dm_row (HAS_MASK)."""
    tok_safe = tl.maximum(tok, 0)
    x_c, _bad_c = load_logits(t_row[:, None] + tok_safe, allowed_at(tm_row[:, None], tok_safe, cand, HAS_MASK))
    p_c = prob_of(x_c, m_t[:, None], z_t[:, None], thr_t[:, None], inv_t[:, None], tok, cut_t[:, None], BY_INDEX)
    if DRAFT_MODE == DRAFT_LOGITS:
        xq_c, _bad_qc = load_logits(d_row[:, None] + tok_safe, allowed_at(dm_row[:, None], tok_safe, cand, HAS_MASK))
        q_c = prob_of(xq_c, m_q[:, None], z_q[:, None], thr_q[:, None], inv_t[:, None], tok, cut_q[:, None], BY_INDEX)
    elif DRAFT_MODE == DRAFT_PROBS:
        q_c, _bad_qc = load_probs(d_row[:, None] + tok_safe, cand)
    else:
        q_c = tl.where(cand, 1.0, 0.0)
    return p_c, q_c


@triton.jit
def _decide_start(BLOCK_B: tl.constexpr):
    """(K-SEQ's rho, its scale c, RRS rejections) before a position's test: 1, 1, 0."""
    rho = tl.full([BLOCK_B], 1.0, tl.float32)
    scale = tl.full([BLOCK_B], 1.0, tl.float32)
    steps = tl.zeros([BLOCK_B], tl.int32)
    return rho, scale, steps


@triton.jit
def _accept_one_hot(tok, cand, p_c, u, nodes):
    """One-hot drafts: p_j = p without the earlier (distinct) rejected tokens, renormalised."""
    earlier = nodes[:, :, None] > nodes[:, None, :]
    same = (tok[:, :, None] == tok[:, None, :]) & cand[:, None, :] & earlier
    repeated = tl.sum(same.to(tl.int32), axis=2) > 0
    fresh_p = tl.where(cand & ~repeated, p_c, 0.0)
    removed_before = tl.cumsum(fresh_p, axis=1) - fresh_p
    left = 1.0 - removed_before
    p_j = tl.where(repeated | (left <= 0.0), 0.0, p_c / tl.where(left > 0.0, left, 1.0))
    return cand & (p_j > 0.0) & (u <= p_j)


@triton.jit
def _accept_kseq(brk_ptr, b, rep, k, cand, p_c, q_c, u, stochastic, N, BLOCK_B: tl.constexpr):
    """K-SEQ: rho and beta(rho) = g / rho from the rho search's record (lanes with k > 1);
    (accepted candidates, rho, scale c = (1 - (1 - beta)^k) / beta)."""
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
    scale = tl.where(search, tl.where(beta_hi > 0.0, (1.0 - pow_k) / tl.where(beta_hi > 0.0, beta_hi, 1.0), kf), 1.0)
    accept = cand & (p_c > 0.0) & (u * rho[:, None] * q_c <= p_c)
    return accept, rho, scale


@triton.jit
def _accept_rrs(
    rrs_ptr, b, rep, k, tok, cand, rank, p_c, q_c, u, stochastic, zs, ds, xs, steps, nodes, t_row, d_row, tm_row,
    dm_row, m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q, inv_t, B, N, V, rrs_chunks, DRAFT_MODE: tl.constexpr,
    BY_INDEX: tl.constexpr, METHOD: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """RRS: test candidates in rank order; each rejection renormalises the residual (one pass).
    (accepted candidates, and the RRS state zs, ds, xs, steps the position ends with)."""
    accept = cand & (nodes < 0)
    decided = ~stochastic
    for j in range(0, tl.max(k, axis=0)):
        at_j = cand & (rank == j)
        live = ~decided & (j < k)
        x_j = tl.sum(tl.where(at_j, tok, 0), axis=1)
        zs = _rrs_z_j(
            rrs_ptr, b, rep, j, live, steps, zs, xs, ds, nodes, t_row, d_row, tm_row, dm_row, m_t, z_t, thr_t, cut_t,
            m_q, z_q, thr_q, cut_q, inv_t, B, N, V, rrs_chunks, DRAFT_MODE, BY_INDEX, METHOD, HAS_MASK, BLOCK_V,
        )  # fmt: skip
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
    return accept, zs, ds, xs, steps


@triton.jit
def _rrs_z_j(
    rrs_ptr, b, rep, j, live, steps, zs, xs, ds, nodes, t_row, d_row, tm_row, dm_row, m_t, z_t, thr_t, cut_t, m_q, z_q,
    thr_q, cut_q, inv_t, B, N, V, rrs_chunks, DRAFT_MODE: tl.constexpr, BY_INDEX: tl.constexpr, METHOD: tl.constexpr,
    HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """zs with the normaliser Z_j of the residual after j rejections set on live lanes (j > 0): from
    _tree_rrs_kernel below RRS_MAX, from one pass over the vocabulary at and beyond it."""
    if j > 0:  # Z_j from _tree_rrs_kernel
        z_j = tl.zeros(live.shape, tl.float32)
        slot = (tl.minimum(j, RRS_MAX - 1) - 1) * B * (N + 1) + b * (N + 1) + rep + 1
        for c in range(0, rrs_chunks):
            z_j += tl.load(rrs_ptr + slot * rrs_chunks + c, mask=live & (j < RRS_MAX), other=0.0)
        zs = tl.where(live[:, None] & (nodes == j), z_j[:, None], zs)
    if j >= RRS_MAX:  # Z_j: one pass over the vocabulary (positions with more candidates)
        z_j = tl.zeros(live.shape, tl.float32)
        vcols = tl.arange(0, BLOCK_V)[None, :]
        for start in range(0, V, BLOCK_V):
            cols = start + vcols
            lane = live[:, None] & (cols < V)
            _x, pv, qv = _position_tiles(
                t_row, d_row, tm_row, dm_row, start, V, live, live, m_t, z_t, thr_t, m_q, z_q, thr_q, inv_t, cut_t,
                cut_q, DRAFT_MODE, BY_INDEX, HAS_MASK, BLOCK_V,
            )  # fmt: skip
            r = _rrs_residual(pv, qv, steps, zs, xs, ds, cols.to(tl.int64), nodes, METHOD == 2)
            z_j += tl.sum(tl.where(lane, r, 0.0), axis=1)
        zs = tl.where(live[:, None] & (nodes == j), z_j[:, None], zs)
    return zs


@triton.jit
def _choose(accept, cand, tok, g_idx, greedy, active, nodes, NP2: tl.constexpr):
    """(chosen candidate (NP2 = none; greedy requests: the one spelling the argmax), accepted, the
    walk ends here)."""
    chosen = tl.min(tl.where(accept, nodes, NP2), axis=1)
    matched = tl.min(tl.where(cand & (tok == g_idx[:, None]), nodes, NP2), axis=1)
    chosen = tl.where(greedy, matched, chosen)
    accepted = active & (chosen < NP2)
    return chosen, accepted, active & ~accepted


@triton.jit
def _race_update(
    race, rep, first, has_cand, rho, scale, steps, zs, ds, xs, cand, tok, r_flag, r_rep, r_first, r_has, r_rho,
    r_scale, r_steps, r_zs, r_ds, r_xs, DRAFT_MODE: tl.constexpr,
):  # fmt: skip
    """The race's record with the requests that race here (their walk ends at this position)."""
    r_flag = r_flag | race
    r_rep = tl.where(race, rep, r_rep)
    r_first = tl.where(race, first, r_first)
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
    return r_flag, r_rep, r_first, r_has, r_rho, r_scale, r_steps, r_zs, r_ds, r_xs


@triton.jit
def _walk_advance(
    tok, cand, nodes, chosen, accepted, final, active, d, out_cols, in_set, rep, last, at_root, depth, out_tok,
    NP2: tl.constexpr,
):  # fmt: skip
    """Writes this depth's token (the accepted child's, or `final` where the walk ends) and moves the
    accepting requests to the node set spelling the chosen child's token."""
    chosen_tok = _pick(tok, nodes, chosen)
    same_pos = cand & (tok == chosen_tok[:, None])
    new_set = tl.sum(tl.where(same_pos, tl.full(cand.shape, 1, tl.int64) << nodes.to(tl.int64), 0), axis=1)
    new_rep = tl.min(tl.where(same_pos, nodes, NP2), axis=1)
    emitted = tl.where(accepted, chosen_tok, final)
    out_tok = tl.where(active[:, None] & (out_cols == d), emitted[:, None], out_tok)
    in_set = tl.where(accepted, new_set, in_set)
    rep = tl.where(accepted, new_rep, rep)
    last = tl.where(accepted, chosen, last)
    at_root = at_root & ~accepted
    depth = tl.where(accepted, depth + 1, depth)
    return in_set, rep, last, at_root, depth, out_tok


@triton.jit
def _accepted_path(last, depth, par, nodes, out_cols, D, BLOCK_B: tl.constexpr, DP2: tl.constexpr):
    """The accepted path [BLOCK_B, DP2]: the ancestors of the last accepted node, root first."""
    path = tl.full([BLOCK_B, DP2], -1, tl.int64)
    node = last
    for step in range(0, D):
        pos = depth - 1 - step
        path = tl.where((out_cols == pos[:, None]) & (node >= 0)[:, None], node.to(tl.int64)[:, None], path)
        node = tl.where(node >= 0, _pick(par, nodes, node), -1)
    return path
