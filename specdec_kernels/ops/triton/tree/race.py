"""Phase 5 of tree verification: the recovered / bonus token's exponential race over the residual
of the position where each walk ended, split over the vocabulary, and the merge of the chunks."""

from __future__ import annotations

import triton
import triton.language as tl

from ..chain import _emitted_logprobs
from ..helpers import (
    DRAFT_NONE,
    PURPOSE_BONUS,
    PURPOSE_RECOVER,
    first_argmax_update,
    inverse_temperature,
    log_floored,
    per_request,
    race_noise,
    request_seed,
    safe_max,
)
from .common import (
    RACE_I,
    RI_DEPTH,
    RI_FLAG,
    RI_REP,
    _load_race,
    _mask_rows,
    _position_stats,
    _position_tiles,
    _record,
    _row_ptr,
    _rrs_residual,
)


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
    mask_ptr,  # [B, K, G+1, W] int32 (HAS_MASK): token_bitmask words of the target rows (_mask_rows)
    parents_ptr,  # [B, N] int (unless CHAINS): a tree's draft rows use their parent's mask row
    # strides: target, draft, mask (words), parents
    stride_tb, stride_tk, stride_tg, stride_db, stride_dk, stride_dg, stride_mb, stride_mk, stride_mg, stride_pb,
    # sizes
    B, K, G, V, chunk_size, num_chunks,
    # scalar parameters
    temperature,
    seed: tl.int64,  # one signature for every seed (see triton/helpers.py)
    # constexprs
    PER_REQ_T: tl.constexpr, PER_REQ_SEED: tl.constexpr, DRAFT_MODE: tl.constexpr, HAS_FILTER: tl.constexpr,
    BY_INDEX: tl.constexpr, METHOD: tl.constexpr, NP2: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_MASK: tl.constexpr, CHAINS: tl.constexpr,  # token_bitmask; implicit parents (verify_multi)
):  # fmt: skip
    """The recovered / bonus token's exponential race over one vocabulary chunk of the position where
    each request's walk ended: over the method's residual (over p at a leaf) and over p itself (the
    fallback when the residual is empty). Grid (request tiles, chunks); _tree_finalize_kernel merges."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    chunk = tl.program_id(1)
    b_ok = b < B
    race = b_ok & (tl.load(race_i_ptr + b * RACE_I + RI_FLAG, mask=b_ok, other=0) != 0)
    best_key, best_idx, p_key, p_idx = _no_winners(BLOCK_B)
    if tl.max(race.to(tl.int32), axis=0) > 0:
        nodes = tl.arange(0, NP2)[None, :]
        rep, first, has_cand, steps, rho, scale, zs, ds, xs = _load_race(
            race_i_ptr, race_f_ptr, race_zs_ptr, race_ds_ptr, race_xs_ptr, b, race, nodes, NP2
        )
        _greedy, inv_t = inverse_temperature(
            per_request(temperature_ptr, temperature, b, b_ok, PER_REQ_T).to(tl.float32)
        )
        key = request_seed(seed_ptr, seed, b, b_ok, PER_REQ_SEED)
        m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q = _position_stats(
            stats_ptr, thr_ptr, _record(b, rep, K, G, 1), _record(b, first, K, G, 0), race, race, race & has_cand,
            DRAFT_MODE, HAS_FILTER, BY_INDEX,
        )  # fmt: skip
        t_row = _row_ptr(target_ptr, b, rep, stride_tb, stride_tk, stride_tg, G, 1)
        d_row = _row_ptr(draft_ptr, b, first, stride_db, stride_dk, stride_dg, G, 0)
        tm_row, dm_row = _mask_rows(
            mask_ptr, parents_ptr, b, rep, first, race & has_cand, stride_mb, stride_mk, stride_mg, stride_pb, G,
            CHAINS, HAS_MASK,
        )  # fmt: skip
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
                t_row, d_row, tm_row, dm_row, start, end_col, race, race & has_cand, m_t, z_t, thr_t, m_q, z_q, thr_q,
                inv_t, cut_t, cut_q, DRAFT_MODE, BY_INDEX, HAS_MASK, BLOCK_V,
            )  # fmt: skip
            w = _race_weights(
                pv, qv, cols, lane, has_cand, steps, rho, scale, zs, ds, xs, nodes, DRAFT_MODE, METHOD, NP2
            )
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


@triton.jit
def _no_winners(BLOCK_B: tl.constexpr):
    """(key, index) of the residual's race and of p's (the fallback) before any entry: -inf, 0."""
    res_key = tl.full([BLOCK_B], float("-inf"), tl.float32)
    res_idx = tl.zeros([BLOCK_B], tl.int32)
    p_key = tl.full([BLOCK_B], float("-inf"), tl.float32)
    p_idx = tl.zeros([BLOCK_B], tl.int32)
    return res_key, res_idx, p_key, p_idx


@triton.jit
def _race_weights(
    pv, qv, cols, lane, has_cand, steps, rho, scale, zs, ds, xs, nodes, DRAFT_MODE: tl.constexpr,
    METHOD: tl.constexpr, NP2: tl.constexpr,
):  # fmt: skip
    """The race's unnormalised weights on a [BB, BLOCK_V] tile: the method's residual where the
    position has candidates (one-hot drafts: p without the candidates' tokens), p at a leaf."""
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
    return tl.where(has_cand[:, None], w, pv)


@triton.jit(do_not_specialize=["B", "num_chunks"])  # per-call scalars: triton/helpers.py
def _tree_finalize_kernel(
    # pointers
    race_i_ptr,  # [B, RACE_I] int32 (walk)
    key_ptr,  # [B, C, 2] fp32 (_tree_race_kernel)
    idx_ptr,  # [B, C, 2] int32 (_tree_race_kernel)
    out_tokens_ptr,  # [B, D+1] int64 out: the raced token at slot RI_DEPTH
    target_ptr,  # [B, K, G+1, V] raw target logits (LOGPROBS)
    mask_ptr,  # [B, K, G+1, W] int32 token_bitmask words (LOGPROBS and HAS_MASK)
    stats_ptr,  # [B*K*(G+1), 1, NUM_STATS] fp32 row statistics (LOGPROBS)
    thr_ptr,  # [B*K*(G+1), NUM_THR] fp32 thresholds (LOGPROBS and HAS_FILTER)
    temperature_ptr,  # [B] float (LOGPROBS and PER_REQ_T)
    out_logprobs_ptr,  # [B, D+1] fp32 out (LOGPROBS): the raced token's logprob at slot RI_DEPTH
    # strides: out tokens; target, mask (words), out logprobs (LOGPROBS)
    stride_ob, stride_tb, stride_tk, stride_tg, stride_mb, stride_mk, stride_mg, stride_lb,
    # sizes
    B, K, G, V, num_chunks,
    temperature,  # scalar parameter (LOGPROBS)
    # constexprs
    BLOCK_B: tl.constexpr,
    LOGPROBS: tl.constexpr,  # return_logprobs: score the raced tokens (``walk._walk_logprobs``)
    PER_REQ_T: tl.constexpr, HAS_FILTER: tl.constexpr, BY_INDEX: tl.constexpr, HAS_MASK: tl.constexpr,  # (LOGPROBS)
):  # fmt: skip
    """Merge the chunks' race winners (earlier chunks keep ties) and write the raced tokens (LOGPROBS:
    and their logprobs under the target row of the position they were raced at)."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    b_ok = b < B
    race = b_ok & (tl.load(race_i_ptr + b * RACE_I + RI_FLAG, mask=b_ok, other=0) != 0)
    res_key, res_idx, p_key, p_idx = _no_winners(BLOCK_B)
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
    if LOGPROBS:  # the position's target row: its first node's (-1 = the root), as the walk scored it
        rep = tl.load(race_i_ptr + b * RACE_I + RI_REP, mask=race, other=-1)
        t = per_request(temperature_ptr, temperature, b, race, PER_REQ_T).to(tl.float32)  # > 0: it raced
        lp = _emitted_logprobs(
            _row_ptr(target_ptr, b, rep, stride_tb, stride_tk, stride_tg, G, 1),
            _row_ptr(mask_ptr, b, rep, stride_mb, stride_mk, stride_mg, G, 1), stats_ptr, thr_ptr,
            _record(b, rep, K, G, 1), race, token, t, HAS_FILTER, BY_INDEX, HAS_MASK,
        )  # fmt: skip
        tl.store(out_logprobs_ptr + b * stride_lb + depth, lp, mask=race)
