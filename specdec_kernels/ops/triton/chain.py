"""Fused chain verification for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

Three launches (five with top-k / top-p; four in the interpreter, see ``threshold_plan``), no host
synchronisation, no Python loop over requests:

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..._interpreter import multiprocessors, plans_for_interpreter
from ..._types import VerifyOutput
from ..._validation import VerifyArgs
from .helpers import (
    DRAFT_LOGITS,
    DRAFT_PROBS,
    LOG2E,
    PURPOSE_ACCEPT,
    PURPOSE_BONUS,
    PURPOSE_RECOVER,
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
    safe_max,
    uniform_open,
)
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
    STAT_GMAX,
    STAT_M_Q,
    STAT_M_T,
    STAT_Z_Q,
    STAT_Z_T,
    THR_Q,
    THR_T,
    _verify_row_stats_kernel,
    combine_softmax,
    drafted,
    launch_threshold_phases,
    load_cut,
    merge_chunk_stats,
    prob_of,
    request_base,
    threshold_plan,
)

# Race records of kernel 2, per (request, chunk): key and index of two races.
RACE_RESIDUAL = tl.constexpr(0)  # over the residual max(p - q, 0) of the rejected row
RACE_TARGET = tl.constexpr(1)  # over p itself (the fallback when the residual is empty)
NUM_RACES = tl.constexpr(2)


@triton.jit
def _select_row(vals, rows_i, j):
    """vals[b, j[b]] for a [BLOCK_B, ROWS] tile (a gather along the small row axis)."""
    return tl.sum(tl.where(rows_i == j[:, None], vals, 0), axis=1)


@triton.jit
def _kept_prob(x, m, c, inv_z, thr, cols, cut, BY_INDEX: tl.constexpr):
    """p(x) from the row statistics: 2^((x - m) c) / z for kept finite x, else 0 (NaN, +inf, -inf
    and filtered entries). m: safe row max, c = log2(e) / T, inv_z = 1 / z (0 for an empty row);
    x at columns cols (``kept_at``)."""
    kept = kept_at(x, cols, thr, cut, BY_INDEX) & (x > float("-inf")) & (x < float("inf"))
    return tl.where(kept, tl.exp2((x - m) * c) * inv_z, 0.0)


@triton.jit
def _race_row_j(
    tj_row,
    dj_row,
    need,
    recover,
    seed,
    j,
    purpose,
    tok_j,
    mj_t,
    zj_t,
    thrj_t,
    mj_q,
    zj_q,
    thrj_q,
    cutj_t,
    cutj_q,
    inv_t,
    start_col,
    end_col,
    DRAFT_MODE: tl.constexpr,
    BY_INDEX: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The exponential races over [start_col, end_col) of row j of each request: argmax_x r(x) / E_x
    with E_x ~ Exp(1) (the same winner as argmax log r(x) - log E_x, without the logs) over the
    residual r = max(p - q, 0) (over p at the bonus position) and over p itself (the fallback when
    the residual is empty). Per-lane running winners, reduced once at the end.
    Returns (residual key, index, p key, index) per request; -inf keys when nothing qualifies."""
    BLOCK_B: tl.constexpr = need.shape[0]
    c = (inv_t * LOG2E)[:, None]
    inv_zt = tl.where(zj_t > 0.0, 1.0 / tl.where(zj_t > 0.0, zj_t, 1.0), 0.0)[:, None]
    inv_zq = tl.where(zj_q > 0.0, 1.0 / tl.where(zj_q > 0.0, zj_q, 1.0), 0.0)[:, None]
    best_r = tl.full([BLOCK_B, BLOCK_V], float("-inf"), tl.float32)
    idx_r = tl.zeros([BLOCK_B, BLOCK_V], tl.int32)
    best_p = tl.full([BLOCK_B, BLOCK_V], float("-inf"), tl.float32)
    idx_p = tl.zeros([BLOCK_B, BLOCK_V], tl.int32)
    for start in range(start_col, end_col, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)[None, :]
        lane_ok = need[:, None] & (cols < end_col)
        lane_q = lane_ok & recover[:, None]  # no draft row at the bonus position
        x = tl.load(tj_row + cols, mask=lane_ok, other=float("-inf")).to(tl.float32)
        p = _kept_prob(x, mj_t[:, None], c, inv_zt, thrj_t[:, None], cols, cutj_t[:, None], BY_INDEX)
        if DRAFT_MODE == DRAFT_LOGITS:
            xd = tl.load(dj_row + cols, mask=lane_q, other=float("-inf")).to(tl.float32)
            q = _kept_prob(xd, mj_q[:, None], c, inv_zq, thrj_q[:, None], cols, cutj_q[:, None], BY_INDEX)
            residual = tl.maximum(p - q, 0.0)
        elif DRAFT_MODE == DRAFT_PROBS:
            q, _bad_q = load_probs(dj_row + cols, lane_q)
            residual = tl.maximum(p - q, 0.0)
        else:
            residual = tl.where(cols == tok_j[:, None], 0.0, p)
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
    # strides
    stride_tb,
    stride_tg,
    stride_db,
    stride_dg,
    stride_xb,
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
    BLOCK_B: tl.constexpr,
    ROWS: tl.constexpr,  # next power of two >= G + 1
    BLOCK_V: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    b_ok = b < B
    t_base = request_base(cu_ptr, b, b_ok, stride_tb, 1, FLAT)
    d_base = request_base(cu_ptr, b, b_ok, stride_db, 0, FLAT)
    x_rows = draft_tokens_ptr + request_base(cu_ptr, b, b_ok, stride_xb, 0, FLAT)
    n_b = per_request(num_draft_ptr, G, b, b_ok, PER_REQ_N).to(tl.int32)
    n_b = drafted(x_rows, b_ok, n_b, V, ROWS)
    temperature = per_request(temperature_ptr, temperature, b, b_ok, PER_REQ_T).to(tl.float32)
    greedy, inv_t = inverse_temperature(temperature)
    seed = request_seed(seed_ptr, seed, b, b_ok, PER_REQ_SEED)

    # ---- combine the chunk statistics of every row i <= n_b: [BLOCK_B, ROWS] tiles
    i = tl.arange(0, ROWS)[None, :]
    row_ok = b_ok[:, None] & (i <= n_b[:, None])
    rows = b[:, None] * (G + 1) + i
    inv_t2 = inv_t[:, None] + tl.zeros([BLOCK_B, ROWS], tl.float32)
    m_t = tl.full([BLOCK_B, ROWS], float("-inf"), tl.float32)
    z_t = tl.zeros([BLOCK_B, ROWS], tl.float32)
    m_q = tl.full([BLOCK_B, ROWS], float("-inf"), tl.float32)
    z_q = tl.zeros([BLOCK_B, ROWS], tl.float32)
    g_max = tl.full([BLOCK_B, ROWS], float("-inf"), tl.float32)
    g_idx = tl.zeros([BLOCK_B, ROWS], tl.int32)
    bad = tl.zeros([BLOCK_B, ROWS], tl.float32)
    for c in range(0, stat_chunks):
        rec = (rows * stat_chunks + c) * NUM_STATS
        irec = (rows * stat_chunks + c) * NUM_IDX
        cm_t = tl.load(stats_ptr + rec + STAT_M_T, mask=row_ok, other=float("-inf"))
        cz_t = tl.load(stats_ptr + rec + STAT_Z_T, mask=row_ok, other=0.0)
        cm_q = tl.load(stats_ptr + rec + STAT_M_Q, mask=row_ok, other=float("-inf"))
        cz_q = tl.load(stats_ptr + rec + STAT_Z_Q, mask=row_ok, other=0.0)
        c_gmax = tl.load(stats_ptr + rec + STAT_GMAX, mask=row_ok, other=float("-inf"))
        bad += tl.load(stats_ptr + rec + STAT_BAD_T, mask=row_ok, other=0.0) + tl.load(
            stats_ptr + rec + STAT_BAD_Q, mask=row_ok, other=0.0
        )
        c_gidx = tl.load(idx_ptr + irec + IDX_GREEDY, mask=row_ok, other=0)
        take = c_gmax > g_max  # strict: the earlier chunk keeps ties (lowest index)
        g_max = tl.where(take, c_gmax, g_max)
        g_idx = tl.where(take, c_gidx, g_idx)
        m_t, z_t = combine_softmax(m_t, z_t, cm_t, cz_t, inv_t2)
        m_q, z_q = combine_softmax(m_q, z_q, cm_q, cz_q, inv_t2)
    thr_t = tl.full([BLOCK_B, ROWS], float("-inf"), tl.float32)
    thr_q = tl.full([BLOCK_B, ROWS], float("-inf"), tl.float32)
    cut_t = tl.zeros([BLOCK_B, ROWS], tl.int32)
    cut_q = tl.zeros([BLOCK_B, ROWS], tl.int32)
    if HAS_FILTER:
        thr_t = tl.load(thr_ptr + rows * NUM_THR + THR_T, mask=row_ok & ~greedy[:, None], other=float("-inf"))
        cut_t = load_cut(thr_ptr + rows * NUM_THR + CUT_T, row_ok & ~greedy[:, None], BY_INDEX)
        if DRAFT_MODE == DRAFT_LOGITS:
            q_ok = row_ok & (i < n_b[:, None]) & ~greedy[:, None]
            thr_q = tl.load(thr_ptr + rows * NUM_THR + THR_Q, mask=q_ok, other=float("-inf"))
            cut_q = load_cut(thr_ptr + rows * NUM_THR + CUT_Q, q_ok, BY_INDEX)

    # ---- accept test of every draft, first rejection j
    is_draft = b_ok[:, None] & (i < n_b[:, None])
    tok = tl.load(x_rows[:, None] + i, mask=is_draft, other=0).to(tl.int64)
    tok_ok = (tok >= 0) & (tok < V)  # out-of-range ids (validate=False) are rejected, never loaded
    tok_safe = tl.where(tok_ok, tok, 0)
    t_rows = target_ptr + t_base[:, None] + i.to(tl.int64) * stride_tg
    d_rows = draft_ptr + d_base[:, None] + i.to(tl.int64) * stride_dg
    x_t, _bad_t = load_logits(t_rows + tok_safe, is_draft)
    p_tok = prob_of(x_t, m_t, z_t, thr_t, inv_t2, tok_safe, cut_t, BY_INDEX)
    if DRAFT_MODE == DRAFT_LOGITS:
        x_q, _bad_q = load_logits(d_rows + tok_safe, is_draft)
        q_tok = prob_of(x_q, m_q, z_q, thr_q, inv_t2, tok_safe, cut_q, BY_INDEX)
    elif DRAFT_MODE == DRAFT_PROBS:
        q_tok, _bad_qt = load_probs(d_rows + tok_safe, is_draft)
    else:
        q_tok = tl.full([BLOCK_B, ROWS], 1.0, tl.float32)
    u = uniform_open(seed[:, None], i * 0, i, PURPOSE_ACCEPT)
    accept_sampled = (u * q_tok <= p_tok) & (p_tok > 0.0)  # u > 0: p = 0 is never accepted
    accept_greedy = tok == g_idx.to(tl.int64)
    accept = tl.where(greedy[:, None], accept_greedy, accept_sampled) & tok_ok
    j = tl.min(tl.where(is_draft & ~accept, i, ROWS), axis=1)
    j = tl.minimum(j, n_b)

    # ---- outputs that need no second pass: the greedy token; the nonfinite flag
    used = row_ok & (i <= j[:, None])
    # A used row with nothing to sample (no finite logit; greedy or not) flags the request.
    empty = used & tl.where(greedy[:, None], g_max == float("-inf"), z_t == 0.0)
    flagged = tl.sum(tl.where(used & (bad > 0.0), 1, 0) + empty.to(tl.int32), axis=1) > 0
    direct = _select_row(g_idx, i, j)  # sampled requests: replaced by the race below
    if chunk == 0:
        tl.store(first_reject_ptr + b, j, mask=b_ok)
        tl.store(token_ptr + b, direct, mask=b_ok)
        tl.store(nonfinite_ptr + b, flagged, mask=b_ok)

    # ---- the emitted token of a sampled request: an exponential race over row j, this program's
    # chunk - over the residual max(p - q, 0) after a rejection (j < n_b), over p for the bonus token
    need = b_ok & ~greedy
    recover = j < n_b
    purpose = tl.where(recover, PURPOSE_RECOVER, PURPOSE_BONUS)
    res_key = tl.full([BLOCK_B], float("-inf"), tl.float32)
    res_idx = tl.zeros([BLOCK_B], tl.int32)
    p_key = tl.full([BLOCK_B], float("-inf"), tl.float32)
    p_idx = tl.zeros([BLOCK_B], tl.int32)
    if tl.max(need.to(tl.int32), axis=0) > 0:
        mj_t = safe_max(_select_row(m_t, i, j))
        zj_t = _select_row(z_t, i, j)
        thrj_t = _select_row(thr_t, i, j)
        mj_q = safe_max(_select_row(m_q, i, j))
        zj_q = _select_row(z_q, i, j)
        thrj_q = _select_row(thr_q, i, j)
        cutj_t = _select_row(cut_t, i, j)
        cutj_q = _select_row(cut_q, i, j)
        tok_j = _select_row(tok_safe, i, j)
        tj_row = target_ptr + t_base[:, None] + j[:, None].to(tl.int64) * stride_tg
        dj_row = draft_ptr + d_base[:, None] + j[:, None].to(tl.int64) * stride_dg
        res_key, res_idx, p_key, p_idx = _race_row_j(
            tj_row,
            dj_row,
            need,
            recover,
            seed,
            j,
            purpose,
            tok_j,
            mj_t,
            zj_t,
            thrj_t,
            mj_q,
            zj_q,
            thrj_q,
            cutj_t,
            cutj_q,
            inv_t,
            chunk * chunk_size,
            tl.minimum(chunk * chunk_size + chunk_size, V),
            DRAFT_MODE,
            BY_INDEX,
            BLOCK_V,
        )
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
    # strides
    stride_xb,
    stride_ob,
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
    token = tl.minimum(tl.maximum(token, 0), V - 1).to(tl.int64)

    t = tl.arange(0, ROWS)[None, :]
    drafts = tl.load(x_rows[:, None] + t, mask=b_ok[:, None] & (t < j[:, None]), other=-1)
    out = tl.where(t < j[:, None], drafts.to(tl.int64), tl.where(t == j[:, None], token[:, None], -1))
    tl.store(out_tokens_ptr + b[:, None] * stride_ob + t, out, mask=b_ok[:, None] & (t <= G))
    tl.store(out_accepted_ptr + b, j, mask=b_ok)


# --------------------------------------------------------------------------------------------
# launcher


@dataclass(frozen=True)
class _LaunchPlan:
    block_v: int
    block_r: int  # rows per program in kernel 1
    block_b: int  # requests per program in kernels 2 and 3
    num_chunks: int
    chunk_size: int
    num_warps: int


def _plan(args: VerifyArgs, num_chunks: int | None, block_v: int | None) -> _LaunchPlan:
    interpreted = plans_for_interpreter(args.target_logits.device)
    if interpreted or num_chunks is not None or block_v is not None:
        return _plan_for(args, num_chunks, block_v, interpreted, sms=0)
    return gpu_plan(args, multiprocessors(args.target_logits.device))


def gpu_plan(args: VerifyArgs, sms: int) -> _LaunchPlan:
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


def _plan_for(args, num_chunks, block_v, interpreted: bool, sms: int) -> _LaunchPlan:
    B, G, V = args.B, args.G, args.V
    # The interpreter pays per operation, not per element: give it big tiles.
    max_block_v, tile, max_block_b = (8192, 1 << 16, 4096) if interpreted else (1024, 2048, 2)
    block_v = max(4, min(next_pow2(V), block_v or max_block_v))  # races take 4 entries per Philox call
    rows = B * (G + 1)
    # On a GPU at most 2 rows per program: more programs, not wider ones, when blocks shrink.
    block_r = max(1, min(next_pow2(rows), tile // block_v, 1 << 30 if interpreted else 2))
    block_b = max(1, min(next_pow2(B), tile // block_v, max_block_b))
    blocks = cdiv(V, block_v)
    if num_chunks is None:
        num_chunks = 1 if interpreted else min(blocks, max(1, math.ceil(4 * sms / cdiv(rows, block_r))), 256)
    num_chunks = max(1, min(int(num_chunks), blocks))
    chunk_size = cdiv(blocks, num_chunks) * block_v
    num_chunks = cdiv(V, chunk_size)
    num_warps = 8 if block_r * block_v >= 2048 else 4
    return _LaunchPlan(block_v, block_r, block_b, num_chunks, chunk_size, num_warps)


def launch_verify(
    args: VerifyArgs,
    num_chunks: int | None = None,
    block_v: int | None = None,
    threshold_chunks: int | None = None,
    threshold_capacity: int | None = None,
) -> VerifyOutput:
    """Run the kernels on checked arguments (``_validation.check_verify_args``).

    num_chunks / block_v / threshold_chunks / threshold_capacity override the launch plan (tests
    use them to split small vocabularies and to force the bisection fallback)."""
    B, G, V = args.B, args.G, args.V
    dev = args.target_logits.device
    tokens = torch.empty((B, G + 1), dtype=torch.int64, device=dev)
    num_accepted = torch.empty((B,), dtype=torch.int32, device=dev)
    nonfinite = torch.empty((B,), dtype=torch.bool, device=dev)
    if B == 0:
        return VerifyOutput(tokens, num_accepted, nonfinite)

    has_filter = args.has_filter
    by_index = has_filter and args.sampling.ties_by_index()
    plan = _plan(args, num_chunks, block_v)
    C = plan.num_chunks
    rows = B * (G + 1)
    # Workspaces: torch.empty launches nothing.
    stats = torch.empty((rows, C, NUM_STATS_HOST), dtype=torch.float32, device=dev)
    idx = torch.empty((rows, C, NUM_IDX_HOST), dtype=torch.int32, device=dev)
    thr = torch.empty((rows if has_filter else 1, NUM_THR_HOST), dtype=torch.float32, device=dev)
    tplan = threshold_plan(
        args.target_logits, rows, V, threshold_chunks, args.draft_mode == DRAFT_LOGITS, threshold_capacity
    )
    filter_buf, filter_int = tplan.scratch(rows, dev) if has_filter else (thr, thr)
    first_reject = torch.empty((B,), dtype=torch.int32, device=dev)
    direct_token = torch.empty((B,), dtype=torch.int32, device=dev)
    race_key = torch.empty((B, C, 2), dtype=torch.float32, device=dev)
    race_idx = torch.empty((B, C, 2), dtype=torch.int32, device=dev)

    target = args.target_logits
    draft = args.draft if args.draft is not None else target  # never read in mode 0
    flat = args.cu is not None
    draft_tokens = args.draft_tokens if args.draft_tokens.numel() > 0 else torch.zeros(1, dtype=torch.int64, device=dev)
    cu = args.cu if flat else draft_tokens  # never read unless FLAT
    # Flattened layout: every "request stride" is a row stride; the kernels add cu[b] (+ b) rows.
    stride_tb, stride_tg = (target.stride(0), target.stride(0)) if flat else (target.stride(0), target.stride(1))
    if args.draft is None:
        stride_db = stride_dg = 0
    else:
        stride_db, stride_dg = (draft.stride(0), draft.stride(0)) if flat else (draft.stride(0), draft.stride(1))
    stride_xb = draft_tokens.stride(0)
    rows_p2 = next_pow2(G + 1)
    per_req_n = args.num_draft_tokens is not None
    n_ptr = args.num_draft_tokens if per_req_n else target
    params = args.sampling.kernel_args(target)
    t_ptr, t_val, per_req_t = params["temperature"]
    k_ptr, k_val, per_req_k = params["top_k"]
    p_ptr, p_val, per_req_p = params["top_p"]
    s_ptr, s_val, per_req_s = params["seed"]

    def row_pass(phase: int, block_r: int, grid_chunks: int, chunks: int, chunk_size: int, num_warps: int) -> None:
        _verify_row_stats_kernel[(cdiv(rows, block_r), grid_chunks)](
            target,
            draft,
            draft_tokens,
            cu,
            n_ptr,
            t_ptr,
            k_ptr,
            p_ptr,
            stats,
            idx,
            thr,
            filter_buf,
            filter_int,
            filter_int,  # row use: unused (chains read every row they have)
            stride_tb,
            0,
            stride_tg,
            stride_db,
            0,
            stride_dg,
            stride_xb,
            B,
            1,
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
            PLACEHOLDERS_END=True,
            GP2=next_pow2(max(G, 1)),
            FLAT=flat,
            ROW_USE=False,
            BLOCK_R=block_r,
            BLOCK_V=plan.block_v,
            num_warps=num_warps,
        )

    if has_filter:  # thresholds first (candidates per chunk, selection per row), then the statistics pass
        launch_threshold_phases(row_pass, tplan)
    row_pass(PHASE_STATS.value, plan.block_r, C, C, plan.chunk_size, plan.num_warps)
    stat_chunks = C
    if C > 1:  # merge the chunks once, not once per accept program (each would loop over all C)
        stats, idx = merge_chunk_stats(stats, idx, rows, G + 1, t_ptr, t_val, per_req_t)
        stat_chunks = 1
    _verify_accept_kernel[(cdiv(B, plan.block_b), C)](
        target,
        draft,
        draft_tokens,
        cu,
        n_ptr,
        t_ptr,
        s_ptr,
        stats,
        idx,
        thr,
        first_reject,
        direct_token,
        nonfinite,
        race_key,
        race_idx,
        stride_tb,
        stride_tg,
        stride_db,
        stride_dg,
        stride_xb,
        B,
        G,
        V,
        plan.chunk_size,
        C,
        stat_chunks,
        float(t_val),
        s_val,
        PER_REQ_N=per_req_n,
        PER_REQ_T=per_req_t,
        PER_REQ_SEED=per_req_s,
        DRAFT_MODE=args.draft_mode,
        HAS_FILTER=has_filter,
        BY_INDEX=by_index,
        FLAT=flat,
        BLOCK_B=plan.block_b,
        ROWS=rows_p2,
        BLOCK_V=plan.block_v,
        num_warps=plan.num_warps,
    )
    block_b3 = min(next_pow2(B), 128)
    _verify_finalize_kernel[(cdiv(B, block_b3),)](
        draft_tokens,
        cu,
        t_ptr,
        first_reject,
        direct_token,
        race_key,
        race_idx,
        tokens,
        num_accepted,
        stride_xb,
        tokens.stride(0),
        B,
        G,
        V,
        C,
        float(t_val),
        PER_REQ_T=per_req_t,
        FLAT=flat,
        BLOCK_B=block_b3,
        ROWS=rows_p2,
    )
    return VerifyOutput(tokens, num_accepted, nonfinite)
