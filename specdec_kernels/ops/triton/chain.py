"""Fused chain verification for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

Three launches (five with top-k / top-p; four in the interpreter, see ``threshold_plan``; two when
every request is greedy), no host synchronisation, no Python loop over requests:

1. ``_verify_row_stats_kernel``  grid (row tiles, vocab chunks): one pass over each target row
   (and draft row) computes the online max / sum-exp of the processed logits and the greedy
   argmax. Each lane keeps its own running state (one exp per logit, no cross-lane reduction
   inside the loop); the lanes are combined once after it. Entries are not sanitised in this pass:
   a NaN-propagating running max notices NaN / +inf, and only such rows are redone with every
   entry checked (``_row_pass_exact``). With top-k / top-p the same kernel runs twice before,
   as the threshold phases (one read of each row): the candidates of every vocabulary chunk,
   picked while the chunk sits in registers (``chunk_candidates``; grid: rows, chunks x target /
   draft), then the exact selection among them per row (``select_candidates``; bisection over the
   row for the rare rows they do not decide); the statistics pass then reads the thresholds and
   splits as usual.
2. ``_verify_accept_kernel``     grid (request tiles, vocab chunks): combines the chunk statistics,
   tests every draft ``u * q(x) <= p(x)``, finds the first rejection j and, for sampled requests,
   runs one exponential race over row j: of the residual ``max(p - q, 0)`` when j < n_b (a
   rejection), of p itself when every draft was accepted (the bonus token) — without ever writing
   p, q or the residual to memory. The bonus race lives here rather than in kernel 1 so the row
   pass stays lean (no random numbers, half the registers) and only one row per request races.
3. ``_verify_finalize_kernel``   grid (request tiles): reduces the chunk races and writes tokens.
   An all-greedy call (scalar temperature 0, no logprobs) needs no race: kernel 2 runs once per
   request tile and writes the tokens itself, merging up to ``GREEDY_INLINE_CHUNKS`` chunk records
   per row on the way (no merge launch).

Block verification (``method="block"``, ``block.py``) launches kernel 2 twice: the residual masses
of the rows it needs, then tau and the race of row tau in place of j.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..._interpreter import multiprocessors, plans_for_interpreter
from ..._types import VerifyOutput
from ..._validation import VerifyArgs, _last_dim_contiguous
from .block import BLOCK_MASS, BLOCK_RACE, BLOCK_TOKEN, block_candidates, block_masses, block_tau, block_weights
from .chunk_merge import combine_chunk_records
from .helpers import (
    DRAFT_LOGITS,
    DRAFT_NONE,
    DRAFT_PROBS,
    PURPOSE_ACCEPT,
    PURPOSE_BONUS,
    PURPOSE_RECOVER,
    allowed_at,
    cdiv,
    inverse_temperature,
    kept_at,
    lanes_argmax,
    load_logits,
    load_probs,
    next_pow2,
    per_request,
    race_inv_exp,
    request_seed,
    row_j_probs,
    row_j_view,
    safe_max,
    select_row,
    uniform_open,
)
from .launch import TileSettings, chunks_to_fill, ties_by_index_at_unit_t, tile_settings, vocab_chunks
from .records import NUM_STATS, NUM_THR, STAT_GMAX, STAT_M_T, STAT_Z_T, load_thresholds
from .row_pass import (
    RowPassLayout,
    RowPassPlan,
    RowStats,
    drafted,
    launch_row_stats,
    prob_of,
    request_base,
    threshold_plan,
)

# An all-greedy call merges up to this many chunk records per row inside the accept kernel (one
# dependent load each, ~0.28 us on an H200) instead of launching the merge kernel (a launch costs
# 2.4-4.6 us there); more chunks (small batches) keep the merge kernel's tiles. See bench_static.py.
GREEDY_INLINE_CHUNKS = 8

# Race records of kernel 2, per (request, chunk): key and index of two races.
RACE_RESIDUAL = tl.constexpr(0)  # over the residual max(p - q, 0) of the rejected row
RACE_TARGET = tl.constexpr(1)  # over p itself (the fallback when the residual is empty)
NUM_RACES = tl.constexpr(2)


@triton.jit
def _race_row_j(
    target_ptr, draft_ptr, mask_ptr, t_base, d_base, m_base, stride_tg, stride_dg, stride_mg, i, j, need, recover, seed,
    tok, m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q, inv_t, start_col, end_col, w_j, DRAFT_MODE: tl.constexpr,
    BY_INDEX: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr, WEIGHTED: tl.constexpr = False,
):  # fmt: skip
    """The exponential races over [start_col, end_col) of row j of each request: argmax_x r(x) / E_x
    with E_x ~ Exp(1) (the same winner as argmax log r(x) - log E_x, without the logs) over the
    residual r = max(p - q, 0) (over p at the bonus position) and over p itself (the fallback when
    the residual is empty). Per-lane running winners, reduced once at the end. Row j's statistics
    and draft id are picked from the [BLOCK_B, ROWS] tiles (m_t ... cut_q, tok; columns i).
    WEIGHTED (block verification): the residual is max(w_j p - q, 0), w_j [BLOCK_B] fp32 (unused
    otherwise). Returns (residual key, index, p key, index) per request; -inf keys when nothing
    qualifies."""
    BLOCK_B: tl.constexpr = need.shape[0]
    purpose = tl.where(recover, PURPOSE_RECOVER, PURPOSE_BONUS)
    tok_j, tj_row, dj_row, mj_row, c, mj_t, inv_zt, thrj_t, cutj_t, mj_q, inv_zq, thrj_q, cutj_q = row_j_view(
        target_ptr, draft_ptr, mask_ptr, t_base, d_base, m_base, stride_tg, stride_dg, stride_mg, i, j, tok, m_t, z_t,
        thr_t, cut_t, m_q, z_q, thr_q, cut_q, inv_t,
    )  # fmt: skip
    best_r = tl.full([BLOCK_B, BLOCK_V], float("-inf"), tl.float32)
    idx_r = tl.zeros([BLOCK_B, BLOCK_V], tl.int32)
    best_p = tl.full([BLOCK_B, BLOCK_V], float("-inf"), tl.float32)
    idx_p = tl.zeros([BLOCK_B, BLOCK_V], tl.int32)
    for start in range(start_col, end_col, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)[None, :]
        lane_ok = need[:, None] & (cols < end_col)
        lane_q = lane_ok & recover[:, None]  # no draft row at the bonus position
        p, q = row_j_probs(
            tj_row, dj_row, mj_row, start, end_col, need, lane_ok, lane_q, c, mj_t, inv_zt, thrj_t, cutj_t, mj_q,
            inv_zq, thrj_q, cutj_q, DRAFT_MODE, BY_INDEX, HAS_MASK, BLOCK_V,
        )  # fmt: skip
        wp = p
        if WEIGHTED:
            wp = w_j[:, None] * p
        if DRAFT_MODE == DRAFT_NONE:
            residual = tl.where(cols == tok_j[:, None], 0.0, wp)  # one-hot q: max(w p(x) - 1, 0) = 0 at x
        else:
            residual = tl.maximum(wp - q, 0.0)
        inv_e = race_inv_exp(seed[:, None], start, j[:, None], purpose[:, None], BLOCK_V)
        key_p = tl.where(lane_ok & (p > 0.0), p * inv_e, float("-inf"))
        key_r = tl.where(recover[:, None], tl.where(lane_ok & (residual > 0.0), residual * inv_e, float("-inf")), key_p)
        take_r = key_r > best_r
        best_r = tl.where(take_r, key_r, best_r)
        idx_r = tl.where(take_r, cols, idx_r)
        take_p = key_p > best_p
        best_p = tl.where(take_p, key_p, best_p)
        idx_p = tl.where(take_p, cols, idx_p)
    key_r, at_r = lanes_argmax(best_r, idx_r)
    key_p, at_p = lanes_argmax(best_p, idx_p)
    return key_r, at_r, key_p, at_p


@triton.jit
def _first_rejection(
    t_rows, d_rows, m_rows, x_rows, i, n_b, b_ok, greedy, seed, m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q, g_idx,
    inv_t, V, DRAFT_MODE: tl.constexpr, BY_INDEX: tl.constexpr, HAS_MASK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """The accept test of every draft i < n_b (columns i of [BLOCK_B, ROWS] tiles; t_rows / d_rows
    point at the rows): (j = the first rejected draft, n_b when none is; the draft ids, 0 where
    out of range; p(x), q(x) of the drafts, read by block verification). Sampled: accept iff
    u * q(x) <= p(x) and p(x) > 0; greedy: iff x = argmax."""
    is_draft = b_ok[:, None] & (i < n_b[:, None])
    tok = tl.load(x_rows[:, None] + i, mask=is_draft, other=0).to(tl.int64)
    tok_ok = (tok >= 0) & (tok < V)  # out-of-range ids (validate=False) are rejected, never loaded
    tok_safe = tl.where(tok_ok, tok, 0)
    tok_allowed = allowed_at(m_rows, tok_safe, is_draft, HAS_MASK)  # row i's words: target and draft row i
    x_t, _bad_t = load_logits(t_rows + tok_safe, tok_allowed)
    p_tok = prob_of(x_t, m_t, z_t, thr_t, inv_t, tok_safe, cut_t, BY_INDEX)
    if DRAFT_MODE == DRAFT_LOGITS:
        x_q, _bad_q = load_logits(d_rows + tok_safe, tok_allowed)
        q_tok = prob_of(x_q, m_q, z_q, thr_q, inv_t, tok_safe, cut_q, BY_INDEX)
    elif DRAFT_MODE == DRAFT_PROBS:
        q_tok, _bad_qt = load_probs(d_rows + tok_safe, is_draft)
    else:
        q_tok = tl.full(is_draft.shape, 1.0, tl.float32)
    u = uniform_open(seed[:, None], i * 0, i, PURPOSE_ACCEPT)
    accept_sampled = (u * q_tok <= p_tok) & (p_tok > 0.0)  # u > 0: p = 0 is never accepted
    accept_greedy = tok == g_idx.to(tl.int64)
    accept = tl.where(greedy[:, None], accept_greedy, accept_sampled) & tok_ok
    j = tl.min(tl.where(is_draft & ~accept, i, ROWS), axis=1)
    return tl.minimum(j, n_b), tok_safe, p_tok, q_tok


@triton.jit(do_not_specialize=["B", "num_chunks", "stat_chunks", "seed"])  # per-call scalars: triton/helpers.py
def _verify_accept_kernel(
    # pointers
    target_ptr,  # [B, G+1, V] raw target logits
    draft_ptr,  # [B, G, V] draft logits (mode 1) or draft probs (mode 2)
    draft_tokens_ptr,  # [B, G] int32/int64
    cu_ptr,  # [B+1] int (FLAT)
    num_draft_ptr,  # [B] int (PER_REQ_N)
    temperature_ptr,  # [B] float (PER_REQ_T)
    seed_ptr,  # [B] int (PER_REQ_SEED)
    stats_ptr,  # [B*(G+1), C, NUM_STATS] fp32 (kernel 1)
    idx_ptr,  # [B*(G+1), C, 2] int32 (kernel 1)
    thr_ptr,  # [B*(G+1), NUM_THR] fp32 (kernel 1, HAS_FILTER)
    first_reject_ptr,  # [B] int32 out: j = number of accepted drafts
    token_ptr,  # [B] int32 out: greedy or bonus token (when no recovery race is needed)
    nonfinite_ptr,  # [B] bool out
    race_key_ptr,  # [B, C, 2] fp32 out: best residual key, best fallback (p) key per chunk
    race_idx_ptr,  # [B, C, 2] int32 out
    mask_ptr,  # [B, G+1, W] int32 (HAS_MASK; flattened: [N+B, W]): grammar words, draft row i uses row i
    mass_ptr,  # [B, G, C] fp64 (BLOCK): residual masses, written by BLOCK_MASS, read by BLOCK_RACE
    out_tokens_ptr,  # [B, G+1] int64 out (WRITE_TOKENS)
    out_accepted_ptr,  # [B] int32 out (WRITE_TOKENS)
    # strides
    stride_tb,
    stride_tg,
    stride_db,
    stride_dg,
    stride_xb,
    stride_mb,  # in words, as the target's (flattened: row strides)
    stride_mg,
    stride_ob,  # out_tokens row stride (WRITE_TOKENS)
    # sizes
    B,
    G,
    V,
    chunk_size,
    num_chunks,
    stat_chunks,  # chunks per record of stats_ptr (1 once merged by _combine_row_stats_kernel)
    # scalar parameters (used when the per-request tensor is absent)
    temperature,
    seed: tl.int64,  # one signature for every seed (see triton/helpers.py)
    # constexprs
    PER_REQ_N: tl.constexpr,
    PER_REQ_T: tl.constexpr,
    PER_REQ_SEED: tl.constexpr,
    DRAFT_MODE: tl.constexpr,
    HAS_FILTER: tl.constexpr,
    BY_INDEX: tl.constexpr,  # top_p_ties="by_index": thresholds carry an index cut (CUT_T, CUT_Q)
    FLAT: tl.constexpr,
    HAS_MASK: tl.constexpr,  # token_bitmask: disallowed logits are -inf in target and draft rows
    BLOCK_B: tl.constexpr,
    ROWS: tl.constexpr,  # next power of two >= G + 1
    BLOCK_V: tl.constexpr,
    BLOCK: tl.constexpr = BLOCK_TOKEN,  # method="block": BLOCK_MASS, then BLOCK_RACE (``block.py``)
    WRITE_TOKENS: tl.constexpr = False,  # every request greedy: write the outputs here (no race, no kernel 3)
):
    """Combine each row's records, test every draft, and race over row j of each sampled request
    (this program's vocabulary chunk): ``combine_chunk_records``, ``_first_rejection``, ``_race_row_j``.
    Block verification: row tau instead of row j (``block.py``). WRITE_TOKENS (an all-greedy call,
    one program per request tile): the tokens and counts are written here, as kernel 3 would."""
    pid_b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    b_ok = b < B
    t_base = request_base(cu_ptr, b, b_ok, stride_tb, 1, FLAT)
    d_base = request_base(cu_ptr, b, b_ok, stride_db, 0, FLAT)
    m_base = request_base(cu_ptr, b, b_ok, stride_mb, 1, FLAT)
    x_rows = draft_tokens_ptr + request_base(cu_ptr, b, b_ok, stride_xb, 0, FLAT)
    n_b = per_request(num_draft_ptr, G, b, b_ok, PER_REQ_N).to(tl.int32)
    n_b = drafted(x_rows, b_ok, n_b, V, ROWS)
    temperature = per_request(temperature_ptr, temperature, b, b_ok, PER_REQ_T).to(tl.float32)
    greedy, inv_t = inverse_temperature(temperature)
    seed = request_seed(seed_ptr, seed, b, b_ok, PER_REQ_SEED)

    # ---- the records of every row i <= n_b: [BLOCK_B, ROWS] tiles
    i = tl.arange(0, ROWS)[None, :]
    row_ok = b_ok[:, None] & (i <= n_b[:, None])
    rows = b[:, None] * (G + 1) + i
    inv_t2 = inv_t[:, None] + tl.zeros([BLOCK_B, ROWS], tl.float32)
    m_t, z_t, m_q, z_q, g_max, g_idx, bad_t, bad_q = combine_chunk_records(
        stats_ptr, idx_ptr, rows, row_ok, stat_chunks, inv_t2
    )
    bad = bad_t + bad_q
    sampled = row_ok & ~greedy[:, None]
    thr_t, cut_t, thr_q, cut_q = load_thresholds(
        thr_ptr + rows * NUM_THR, sampled, sampled & (i < n_b[:, None]), HAS_FILTER, DRAFT_MODE, BY_INDEX
    )

    # ---- accept test of every draft, first rejection j
    t_rows = target_ptr + t_base[:, None] + i.to(tl.int64) * stride_tg
    d_rows = draft_ptr + d_base[:, None] + i.to(tl.int64) * stride_dg
    m_rows = mask_ptr + m_base[:, None] + i.to(tl.int64) * stride_mg
    j, tok, p_tok, q_tok = _first_rejection(
        t_rows, d_rows, m_rows, x_rows, i, n_b, b_ok, greedy, seed, m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q,
        g_idx, inv_t2, V, DRAFT_MODE, BY_INDEX, HAS_MASK, ROWS,
    )  # fmt: skip
    end_col = tl.minimum(chunk * chunk_size + chunk_size, V)
    last = j  # the last row the request reads (block verification: all of them)
    w_j = inv_t  # block verification's w_tau (unused by the token rule)
    if BLOCK != BLOCK_TOKEN:  # block verification (``block.py``): tau replaces j for sampled requests
        w = block_weights(p_tok, q_tok, i, ROWS)
        cand, eta = block_candidates(w, seed, i, n_b, b_ok & ~greedy)
        if BLOCK == BLOCK_MASS:
            block_masses(
                mass_ptr, target_ptr, draft_ptr, mask_ptr, t_base, d_base, m_base, stride_tg, stride_dg, stride_mg, i,
                cand, w, tok, m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q, inv_t, b, b_ok, G, chunk, num_chunks,
                chunk * chunk_size, end_col, DRAFT_MODE, BY_INDEX, HAS_MASK, BLOCK_V,
            )  # fmt: skip
            return
        j = tl.where(greedy, j, block_tau(mass_ptr, b, i, cand, w, eta, n_b, G, num_chunks))
        w_j = select_row(w, i, j).to(tl.float32)
        last = tl.where(greedy, j, n_b)

    # ---- outputs that need no second pass: the greedy token; the nonfinite flag
    used = row_ok & (i <= last[:, None])
    # A used row with nothing to sample (no finite logit; greedy or not) flags the request.
    empty = used & tl.where(greedy[:, None], g_max == float("-inf"), z_t == 0.0)
    flagged = tl.sum(tl.where(used & (bad > 0.0), 1, 0) + empty.to(tl.int32), axis=1) > 0
    direct = select_row(g_idx, i, j)  # sampled requests: replaced by the race below
    if chunk == 0:
        tl.store(nonfinite_ptr + b, flagged, mask=b_ok)
    if WRITE_TOKENS:
        _store_tokens(x_rows, out_tokens_ptr, out_accepted_ptr, b, b_ok, j, direct, stride_ob, G, V, ROWS)
        return
    if chunk == 0:  # kernel 3's inputs
        tl.store(first_reject_ptr + b, j, mask=b_ok)
        tl.store(token_ptr + b, direct, mask=b_ok)

    # ---- the emitted token of a sampled request: an exponential race over row j, this program's
    # chunk - over the residual max(p - q, 0) after a rejection (j < n_b), over p for the bonus token
    need = b_ok & ~greedy
    res_key = tl.full([BLOCK_B], float("-inf"), tl.float32)
    res_idx = tl.zeros([BLOCK_B], tl.int32)
    p_key = tl.full([BLOCK_B], float("-inf"), tl.float32)
    p_idx = tl.zeros([BLOCK_B], tl.int32)
    if tl.max(need.to(tl.int32), axis=0) > 0:
        res_key, res_idx, p_key, p_idx = _race_row_j(
            target_ptr, draft_ptr, mask_ptr, t_base, d_base, m_base, stride_tg, stride_dg, stride_mg, i, j, need,
            j < n_b, seed, tok, m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q, inv_t, chunk * chunk_size, end_col,
            w_j, DRAFT_MODE, BY_INDEX, HAS_MASK, BLOCK_V, BLOCK != BLOCK_TOKEN,
        )  # fmt: skip
    rec = (b * num_chunks + chunk) * NUM_RACES
    tl.store(race_key_ptr + rec + RACE_RESIDUAL, res_key, mask=b_ok)
    tl.store(race_key_ptr + rec + RACE_TARGET, p_key, mask=b_ok)
    tl.store(race_idx_ptr + rec + RACE_RESIDUAL, res_idx, mask=b_ok)
    tl.store(race_idx_ptr + rec + RACE_TARGET, p_idx, mask=b_ok)


@triton.jit(do_not_specialize=["B", "num_chunks"])  # per-call scalars: triton/helpers.py
def _verify_finalize_kernel(
    # pointers
    draft_tokens_ptr,  # [B, G] int32/int64
    cu_ptr,  # [B+1] int (FLAT)
    temperature_ptr,  # [B] float (PER_REQ_T)
    first_reject_ptr,  # [B] int32 (kernel 2)
    token_ptr,  # [B] int32 (kernel 2)
    race_key_ptr,  # [B, C, 2] fp32 (kernel 2)
    race_idx_ptr,  # [B, C, 2] int32 (kernel 2)
    out_tokens_ptr,  # [B, G+1] int64 out
    out_accepted_ptr,  # [B] int32 out
    target_ptr,  # [B, G+1, V] raw target logits (flattened: [N+B, V]) (LOGPROBS)
    mask_ptr,  # [B, G+1, W] int32 grammar words (flattened: [N+B, W]) (LOGPROBS and HAS_MASK)
    stats_ptr,  # [B*(G+1), 1, NUM_STATS] fp32 whole-row records of the row pass (LOGPROBS)
    thr_ptr,  # [B*(G+1), NUM_THR] fp32 thresholds of the row pass (LOGPROBS and HAS_FILTER)
    out_logprobs_ptr,  # [B, G+1] fp32 out (LOGPROBS)
    # strides
    stride_xb,
    stride_ob,
    stride_tb,  # target strides as the accept kernel's (flattened: row strides) (LOGPROBS)
    stride_tg,
    stride_mb,  # in words (LOGPROBS and HAS_MASK)
    stride_mg,
    stride_lb,  # out_logprobs row stride (LOGPROBS)
    # sizes
    B,
    G,
    V,
    num_chunks,
    # scalar parameters (used when the per-request tensor is absent)
    temperature,
    # constexprs
    PER_REQ_T: tl.constexpr,
    FLAT: tl.constexpr,
    BLOCK_B: tl.constexpr,
    ROWS: tl.constexpr,  # next power of two >= G + 1
    LOGPROBS: tl.constexpr,  # return_logprobs: out_logprobs from the row records (``_emitted_logprobs``)
    HAS_FILTER: tl.constexpr,  # (LOGPROBS) top-k / top-p thresholds in thr_ptr
    BY_INDEX: tl.constexpr,  # (LOGPROBS) the thresholds carry index cuts
    HAS_MASK: tl.constexpr,  # (LOGPROBS) token_bitmask words in mask_ptr
):
    pid_b = tl.program_id(0).to(tl.int64)
    b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    b_ok = b < B
    x_rows = draft_tokens_ptr + request_base(cu_ptr, b, b_ok, stride_xb, 0, FLAT)
    temperature = per_request(temperature_ptr, temperature, b, b_ok, PER_REQ_T).to(tl.float32)
    greedy, _inv_t = inverse_temperature(temperature)
    j = tl.load(first_reject_ptr + b, mask=b_ok, other=0)
    token = tl.load(token_ptr + b, mask=b_ok, other=0)
    need = b_ok & ~greedy  # every sampled request ran a race (recovered or bonus token)
    res_key = tl.full([BLOCK_B], float("-inf"), tl.float32)
    res_idx = tl.zeros([BLOCK_B], tl.int32)
    p_key = tl.full([BLOCK_B], float("-inf"), tl.float32)
    p_idx = tl.zeros([BLOCK_B], tl.int32)
    for c in range(0, num_chunks):
        rec = (b * num_chunks + c) * NUM_RACES
        k_r = tl.load(race_key_ptr + rec + RACE_RESIDUAL, mask=need, other=float("-inf"))
        k_p = tl.load(race_key_ptr + rec + RACE_TARGET, mask=need, other=float("-inf"))
        take_r = k_r > res_key
        take_p = k_p > p_key
        res_idx = tl.where(take_r, tl.load(race_idx_ptr + rec + RACE_RESIDUAL, mask=need, other=0), res_idx)
        p_idx = tl.where(take_p, tl.load(race_idx_ptr + rec + RACE_TARGET, mask=need, other=0), p_idx)
        res_key = tl.where(take_r, k_r, res_key)
        p_key = tl.where(take_p, k_p, p_key)
    # An empty residual (p == q to fp32 precision) cannot really be hit; fall back to p.
    recovered = tl.where(res_key > float("-inf"), res_idx, p_idx)
    token = tl.where(need, recovered, token)
    out = _store_tokens(x_rows, out_tokens_ptr, out_accepted_ptr, b, b_ok, j, token, stride_ob, G, V, ROWS)
    if LOGPROBS:
        t = tl.arange(0, ROWS)[None, :]
        t_rows = target_ptr + request_base(cu_ptr, b, b_ok, stride_tb, 1, FLAT)[:, None] + t.to(tl.int64) * stride_tg
        m_rows = mask_ptr + request_base(cu_ptr, b, b_ok, stride_mb, 1, FLAT)[:, None] + t.to(tl.int64) * stride_mg
        emitted = b_ok[:, None] & (t <= j[:, None]) & (t <= G)
        unit_t = tl.where(greedy, 1.0, temperature)[:, None]  # greedy requests: scored at T = 1
        lp = _emitted_logprobs(
            t_rows, m_rows, stats_ptr, thr_ptr, b[:, None] * (G + 1) + t, emitted, out, unit_t, HAS_FILTER, BY_INDEX,
            HAS_MASK,
        )  # fmt: skip
        tl.store(out_logprobs_ptr + b[:, None] * stride_lb + t, lp, mask=b_ok[:, None] & (t <= G))


@triton.jit
def _store_tokens(x_rows, out_tokens_ptr, out_accepted_ptr, b, b_ok, j, token, stride_ob, G, V, ROWS: tl.constexpr):
    """Write each request's output row (its j accepted drafts, the emitted token (clamped into
    [0, V)), -1 after) and j; returns the [BLOCK_B, ROWS] row."""
    token = tl.minimum(tl.maximum(token, 0), V - 1).to(tl.int64)
    t = tl.arange(0, ROWS)[None, :]
    drafts = tl.load(x_rows[:, None] + t, mask=b_ok[:, None] & (t < j[:, None]), other=-1)
    out = tl.where(t < j[:, None], drafts.to(tl.int64), tl.where(t == j[:, None], token[:, None], -1))
    tl.store(out_tokens_ptr + b[:, None] * stride_ob + t, out, mask=b_ok[:, None] & (t <= G))
    tl.store(out_accepted_ptr + b, j, mask=b_ok)
    return out


@triton.jit
def _emitted_logprobs(
    t_rows, m_rows, stats_ptr, thr_ptr, rows, emitted, tok, unit_t, HAS_FILTER: tl.constexpr, BY_INDEX: tl.constexpr,
    HAS_MASK: tl.constexpr,
):  # fmt: skip
    """log p(tok) under each emitted row's processed target distribution, from the row pass's
    records (no pass over the logits: one logit load per position): (x - m) / T - log z for a kept
    token, -inf for one outside the kept set, NaN where nothing was emitted or the row has no
    finite logit (``reference/logprobs.py``). [BLOCK_B, ROWS] tiles: t_rows / m_rows point at the
    target / mask rows, rows index the records, unit_t is T (1 for greedy requests, whose records
    the row pass computed at T = 1 and, with LOGPROBS, with their thresholds)."""
    rec = stats_ptr + rows * NUM_STATS
    m = tl.load(rec + STAT_M_T, mask=emitted, other=float("-inf"))
    z = tl.load(rec + STAT_Z_T, mask=emitted, other=0.0)
    g_max = tl.load(rec + STAT_GMAX, mask=emitted, other=float("-inf"))  # the sanitised row max
    thr, cut, _thr_q, _cut_q = load_thresholds(thr_ptr + rows * NUM_THR, emitted, emitted, HAS_FILTER, 0, BY_INDEX)
    tok_safe = tl.where(emitted, tok, 0)
    x, _bad = load_logits(t_rows + tok_safe, emitted, allowed_at(m_rows, tok_safe, emitted, HAS_MASK))
    kept = kept_at(x, tok_safe, thr, cut, BY_INDEX) & (x > float("-inf")) & (z > 0.0)
    lp = (x - safe_max(m)) / unit_t - tl.log(tl.where(z > 0.0, z, 1.0))
    lp = tl.where(kept, lp, float("-inf"))
    return tl.where(emitted & (g_max > float("-inf")), lp, float("nan"))


# --------------------------------------------------------------------------------------------
# launcher: a plan (``ChainPlan``), the row pass (``row_pass.launch_row_stats``), then kernels 2 and 3


@dataclass(frozen=True)
class ChainPlan:
    """The launch plan of a chain verification: the row pass's tiles (BLOCK_V and warps also serve
    the accept kernel), requests per accept program, and the vocabulary chunks (the row pass's and
    the accept kernel's races: one program per (request tile, chunk))."""

    tiles: TileSettings
    block_b: int  # requests per program in kernels 2 and 3
    num_chunks: int
    chunk_size: int

    block_v = property(lambda self: self.tiles.block_v)
    block_r = property(lambda self: self.tiles.block_r)  # rows per program in kernel 1
    num_warps = property(lambda self: self.tiles.num_warps)


def _plan(args: VerifyArgs, num_chunks: int | None, block_v: int | None) -> ChainPlan:
    interpreted = plans_for_interpreter(args.target_logits.device)
    if interpreted or num_chunks is not None or block_v is not None:
        return _plan_for(args, num_chunks, block_v, interpreted, sms=0)
    return gpu_plan(args, multiprocessors(args.target_logits.device))


def gpu_plan(args: VerifyArgs, sms: int) -> ChainPlan:
    """The launch plan of a call on a GPU with `sms` SMs (a pure function of shapes; with top-k /
    top-p the threshold phases before it have their own grids, ``threshold_plan``).

    Split the vocabulary so that a small batch still fills the GPU (~4 programs per SM in the row
    pass). The accept kernel has one program per (request tile, chunk), so at B = 1 the chunk count
    alone must cover half the SMs: chunks go down to one block, and blocks shrink (to 256 entries)
    while there are too few of them (V = 32,000 at 2,048 per block has only 16)."""
    plan = _plan_for(args, None, None, False, sms)
    while plan.block_v > 256 and cdiv(args.B, plan.block_b) * plan.num_chunks < (sms + 1) // 2:
        plan = _plan_for(args, None, plan.block_v // 2, False, sms)
    return plan


def _plan_for(args, num_chunks, block_v, interpreted: bool, sms: int) -> ChainPlan:
    B, G, V = args.B, args.G, args.V
    rows = B * (G + 1)
    # On a GPU at most 2 rows per program: more programs, not wider ones, when blocks shrink.
    tiles = tile_settings(V, rows, interpreted, block_v, None if interpreted else 2)
    block_b = max(1, min(next_pow2(B), tiles.tile // tiles.block_v, 4096 if interpreted else 2))
    if num_chunks is None:
        num_chunks = 1 if interpreted else chunks_to_fill(sms, cdiv(rows, tiles.block_r), 256)
    return ChainPlan(tiles, block_b, *vocab_chunks(V, tiles.block_v, num_chunks))


def _row_layout(args: VerifyArgs) -> RowPassLayout:
    """The rows of a chain call for the row pass (one chain per request: K = 1)."""
    target, draft, flat = args.target_logits, args.draft, args.cu is not None
    draft_tokens = args.draft_tokens
    if draft_tokens.numel() == 0:  # G = 0 (or no drafts at all): a valid pointer, never read
        draft_tokens = torch.zeros(1, dtype=torch.int64, device=target.device)

    def strides(t):  # flattened layout: every "request stride" is a row stride; the kernels add cu[b] (+ b) rows
        if t is None:
            return (0, 0, 0)
        return (t.stride(0), 0, t.stride(0) if flat else t.stride(1))

    mask = args.token_bitmask  # the kernels step through a mask row's words with stride 1
    mask = _last_dim_contiguous(mask) if mask is not None else None
    return RowPassLayout(
        target, draft, args.draft_mode, args.B, 1, args.G, args.V, strides(target), strides(draft),
        counts=args.num_draft_tokens, draft_tokens=draft_tokens, cu=args.cu, mask=mask, mask_strides=strides(mask),
    )  # fmt: skip


def launch_verify(
    args: VerifyArgs,
    num_chunks: int | None = None,
    block_v: int | None = None,
    threshold_chunks: int | None = None,
    threshold_capacity: int | None = None,
    logprobs: bool = False,
    method: str = "token",
) -> VerifyOutput:
    """Run the kernels on checked arguments (``_validation.check_verify_args``).

    num_chunks / block_v / threshold_chunks / threshold_capacity override the launch plan (tests
    use them to split small vocabularies and to force the bisection fallback). logprobs
    (return_logprobs without top-n): the finalize kernel also writes ``out.logprobs`` from the row
    records (``_emitted_logprobs``), so the post-pass (``ops/logprobs.py``) returns at once. method:
    "token" or "block" (block verification, ``block.py``: one more launch of the accept kernel)."""
    B, G, V = args.B, args.G, args.V
    dev = args.target_logits.device
    out = VerifyOutput(
        torch.empty((B, G + 1), dtype=torch.int64, device=dev),
        torch.empty((B,), dtype=torch.int32, device=dev),
        torch.empty((B,), dtype=torch.bool, device=dev),
        logprobs=torch.empty((B, G + 1), dtype=torch.float32, device=dev) if logprobs else None,
    )
    if B == 0:
        return out
    plan = _plan(args, num_chunks, block_v)
    layout = _row_layout(args)
    logits = args.draft_mode == DRAFT_LOGITS
    tplan = threshold_plan(args.target_logits, layout.rows, V, threshold_chunks, logits, threshold_capacity)
    row_plan = RowPassPlan(plan.tiles, plan.num_chunks, plan.chunk_size, tplan)
    t = args.sampling.temperature  # scalar 0: every request greedy; the accept kernel reads max / argmax only
    # (not with logprobs: greedy rows then score their logprobs from the record's T = 1 normaliser)
    argmax_only = isinstance(t, float) and t == 0.0 and not logprobs
    # all greedy: the accept kernel merges a few chunks itself and writes the outputs (2 launches)
    merge = not argmax_only or plan.num_chunks > GREEDY_INLINE_CHUNKS
    records = launch_row_stats(layout, args.sampling, row_plan, logprobs, argmax_only, merge)
    if argmax_only:
        _launch_accept(args, layout, plan, records, out.nonfinite, out=out)
        return out
    # Without drafts, and when every request is greedy, both rules are the token rule's kernels.
    block = method == "block" and G > 0
    races = _launch_accept(args, layout, plan, records, out.nonfinite, block)
    _launch_finalize(args, layout, races, out, records)
    return out


class _Races(NamedTuple):
    """Kernel 2's outputs that kernel 3 reads."""

    first_reject: torch.Tensor  # [B] int32: j
    direct_token: torch.Tensor  # [B] int32: the greedy token
    key: torch.Tensor  # [B, C, NUM_RACES] fp32: best key per chunk
    idx: torch.Tensor  # [B, C, NUM_RACES] int32


def _launch_accept(
    args: VerifyArgs, layout: RowPassLayout, plan: ChainPlan, records: RowStats, nonfinite, block=False, out=None
) -> _Races:
    """Kernel 2 (block verification: twice, BLOCK_MASS then BLOCK_RACE, with their mass records;
    ``out`` given (an all-greedy call): once per request tile, writing the outputs, no races)."""
    B, C, dev = args.B, plan.num_chunks, layout.target.device
    if out is not None:  # WRITE_TOKENS never touches kernel 3's buffers: placeholders of their dtypes
        races = _Races(out.num_accepted, out.num_accepted, records.stats, out.num_accepted)
        _accept_launch(args, layout, plan, records, nonfinite, races, None, BLOCK_TOKEN.value, out)
        return races
    races = _Races(
        torch.empty((B,), dtype=torch.int32, device=dev),
        torch.empty((B,), dtype=torch.int32, device=dev),
        torch.empty((B, C, NUM_RACES.value), dtype=torch.float32, device=dev),
        torch.empty((B, C, NUM_RACES.value), dtype=torch.int32, device=dev),
    )
    mass = torch.empty((B, args.G, C), dtype=torch.float64, device=dev) if block else None
    for phase in (BLOCK_MASS, BLOCK_RACE) if block else (BLOCK_TOKEN,):
        _accept_launch(args, layout, plan, records, nonfinite, races, mass, phase.value)
    return races


def _accept_launch(args, layout, plan, records, nonfinite, races: _Races, mass, phase: int, out=None) -> None:
    B, C = args.B, 1 if out is not None else plan.num_chunks  # WRITE_TOKENS: no race, one program per tile
    params = args.sampling.kernel_args(layout.target)
    t_ptr, t_val, per_req_t = params["temperature"]
    s_ptr, s_val, per_req_s = params["seed"]
    has_filter = args.has_filter
    _verify_accept_kernel[(cdiv(B, plan.block_b), C)](
        # pointers
        target_ptr=layout.target,  # [B, G+1, V] (flattened: [N+B, V])
        draft_ptr=layout.draft if layout.draft is not None else layout.target,  # [B, G, V]; unused in mode 0
        draft_tokens_ptr=layout.draft_tokens,  # [B, G] (flattened: [N])
        cu_ptr=layout.cu if layout.cu is not None else layout.draft_tokens,  # [B+1] (FLAT)
        num_draft_ptr=layout.counts if layout.counts is not None else layout.target,  # [B] (PER_REQ_N)
        temperature_ptr=t_ptr,  # [B] (PER_REQ_T)
        seed_ptr=s_ptr,  # [B] (PER_REQ_SEED)
        stats_ptr=records.stats,  # [B*(G+1), 1, NUM_STATS]
        idx_ptr=records.idx,  # [B*(G+1), 1, NUM_IDX]
        thr_ptr=records.thr,  # [B*(G+1), NUM_THR]
        first_reject_ptr=races.first_reject,  # [B] out
        token_ptr=races.direct_token,  # [B] out
        nonfinite_ptr=nonfinite,  # [B] out
        race_key_ptr=races.key,  # [B, C, NUM_RACES] out
        race_idx_ptr=races.idx,  # [B, C, NUM_RACES] out
        mask_ptr=layout.mask if layout.mask is not None else layout.target,  # [B, G+1, W] (HAS_MASK)
        mass_ptr=mass if mass is not None else layout.target,  # [B, G, C] (BLOCK)
        out_tokens_ptr=out.tokens if out is not None else races.idx,  # [B, G+1] out (WRITE_TOKENS)
        out_accepted_ptr=out.num_accepted if out is not None else races.idx,  # [B] out (WRITE_TOKENS)
        # strides
        stride_tb=layout.target_strides[0],
        stride_tg=layout.target_strides[2],
        stride_db=layout.draft_strides[0],
        stride_dg=layout.draft_strides[2],
        stride_xb=layout.draft_tokens.stride(0),
        stride_mb=layout.mask_strides[0],
        stride_mg=layout.mask_strides[2],
        stride_ob=out.tokens.stride(0) if out is not None else 0,
        # sizes
        B=B,
        G=args.G,
        V=args.V,
        chunk_size=plan.chunk_size,
        num_chunks=C,
        stat_chunks=records.stats.shape[1],
        # scalars
        temperature=float(t_val),
        seed=s_val,
        # constexprs
        PER_REQ_N=layout.counts is not None,
        PER_REQ_T=per_req_t,
        PER_REQ_SEED=per_req_s,
        DRAFT_MODE=args.draft_mode,
        HAS_FILTER=has_filter,
        BY_INDEX=has_filter and args.sampling.ties_by_index(),
        FLAT=layout.cu is not None,
        HAS_MASK=layout.mask is not None,
        BLOCK_B=plan.block_b,
        ROWS=next_pow2(args.G + 1),
        BLOCK_V=plan.block_v,
        **({"BLOCK": phase} if phase else {}),  # the token rule: the kernel's default, its launch as before
        **({"WRITE_TOKENS": True} if out is not None else {}),
        num_warps=plan.num_warps,
    )


def _launch_finalize(
    args: VerifyArgs, layout: RowPassLayout, races: _Races, out: VerifyOutput, records: RowStats
) -> None:
    B = args.B
    t_ptr, t_val, per_req_t = args.sampling.kernel_args(layout.target)["temperature"]
    block_b = min(next_pow2(B), 128)
    lp = out.logprobs is not None  # without logprobs: the kernel and its arguments as before (unused: 0 / False)
    has_filter = lp and args.has_filter  # the row pass wrote thresholds
    mask = layout.mask if lp and layout.mask is not None else None
    _verify_finalize_kernel[(cdiv(B, block_b),)](
        # pointers
        draft_tokens_ptr=layout.draft_tokens,  # [B, G] (flattened: [N])
        cu_ptr=layout.cu if layout.cu is not None else layout.draft_tokens,  # [B+1] (FLAT)
        temperature_ptr=t_ptr,  # [B] (PER_REQ_T)
        first_reject_ptr=races.first_reject,  # [B]
        token_ptr=races.direct_token,  # [B]
        race_key_ptr=races.key,  # [B, C, NUM_RACES]
        race_idx_ptr=races.idx,  # [B, C, NUM_RACES]
        out_tokens_ptr=out.tokens,  # [B, G+1] out
        out_accepted_ptr=out.num_accepted,  # [B] out
        target_ptr=layout.target,  # [B, G+1, V] (flattened: [N+B, V]) (LOGPROBS)
        mask_ptr=mask if mask is not None else layout.target,  # [B, G+1, W] (HAS_MASK)
        stats_ptr=records.stats,  # [B*(G+1), 1, NUM_STATS] (LOGPROBS)
        thr_ptr=records.thr,  # [B*(G+1), NUM_THR] (HAS_FILTER)
        out_logprobs_ptr=out.logprobs if lp else out.tokens,  # [B, G+1] out (LOGPROBS)
        # strides
        stride_xb=layout.draft_tokens.stride(0),
        stride_ob=out.tokens.stride(0),
        stride_tb=layout.target_strides[0] if lp else 0,
        stride_tg=layout.target_strides[2] if lp else 0,
        stride_mb=layout.mask_strides[0] if mask is not None else 0,
        stride_mg=layout.mask_strides[2] if mask is not None else 0,
        stride_lb=out.logprobs.stride(0) if lp else 0,
        # sizes
        B=B,
        G=args.G,
        V=args.V,
        num_chunks=races.key.shape[1],
        # scalars
        temperature=float(t_val),
        # constexprs
        PER_REQ_T=per_req_t,
        FLAT=layout.cu is not None,
        BLOCK_B=block_b,
        ROWS=next_pow2(args.G + 1),
        LOGPROBS=lp,
        HAS_FILTER=has_filter,
        BY_INDEX=has_filter and ties_by_index_at_unit_t(args.sampling),
        HAS_MASK=mask is not None,
    )
