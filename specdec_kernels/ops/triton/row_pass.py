"""The row pass both chain and tree verification run: per-(row, vocabulary chunk) statistics of the
processed target and draft rows (online max / sum-exp, greedy argmax, NaN/+inf counts), the top-k / top-p
threshold phases before it, the chunk-merging kernel, and the device functions that turn the statistics
into probabilities (``prob_of``). Launch plans: ``threshold_plan`` and ``merge_chunk_stats``; the chain
(``chain.py``) and the tree (``tree.py``) launch the row pass with their own grids."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..._interpreter import multiprocessors, plans_for_interpreter
from .helpers import (
    DRAFT_LOGITS,
    DRAFT_PROBS,
    LOG2E,
    NO_MAX,
    cdiv,
    inverse_temperature,
    kept_at,
    lane_argmax_update,
    lane_exp_update,
    lane_softmax_update,
    lanes_argmax,
    lanes_exp_sum,
    lanes_softmax,
    load_logits,
    load_probs,
    next_pow2,
    per_request,
    safe_max,
)
from .thresholds import (
    bisect_threshold,
    bisect_threshold_ties,
    chunk_candidates,
    filter_threshold_ties,
    select_candidates,
    select_candidates_ties,
    tie_index,
)

# Row statistics written by kernel 1: one fp32 record of NUM_STATS values per (row, chunk) ...
STAT_M_T = tl.constexpr(0)  # running max of the target's processed logits
STAT_Z_T = tl.constexpr(1)  # sum-exp of the target relative to STAT_M_T
STAT_M_Q = tl.constexpr(2)  # the same two for the draft (DRAFT_LOGITS)
STAT_Z_Q = tl.constexpr(3)
STAT_GMAX = tl.constexpr(4)  # greedy max (raw logit)
STAT_BAD_T = tl.constexpr(5)  # count of NaN/+inf target logits
STAT_BAD_Q = tl.constexpr(6)  # count of NaN/+inf draft logits (NaN/+inf/negative draft probs)
NUM_STATS_HOST = 7
NUM_STATS = tl.constexpr(NUM_STATS_HOST)
# ... and one int32 record of NUM_IDX indices.
IDX_GREEDY = tl.constexpr(0)  # greedy argmax (lowest index on ties)
NUM_IDX_HOST = 1
NUM_IDX = tl.constexpr(NUM_IDX_HOST)
# Launches of the row-stats kernel: the statistics pass, and the top-k/top-p threshold phases.
PHASE_STATS = tl.constexpr(0)  # grid (row tiles, chunks): statistics, thresholds read from thr_ptr
PHASE_CANDIDATES = tl.constexpr(1)  # grid (rows, W x programs per row): candidates of each chunk
PHASE_SELECT = tl.constexpr(2)  # grid (rows, W): thresholds among the candidates (W = 2: target, draft)
PHASE_WHOLE = tl.constexpr(3)  # grid (row tiles, 1): thresholds of whole rows, BLOCK_R per program (interpreter)
# Top-k/top-p thresholds per row (raw-logit units), written by kernel 1 when filtering.
THR_T = tl.constexpr(0)  # target
THR_Q = tl.constexpr(1)  # draft (DRAFT_LOGITS)
# top_p_ties="by_index" (BY_INDEX): the index cut of each threshold, int32 bits in the fp32 record;
# entries equal to the threshold stay from that index on (``kept_at``; 0 keeps the whole tie group)
CUT_T = tl.constexpr(2)  # target
CUT_Q = tl.constexpr(3)  # draft
CUT_OF_THR = tl.constexpr(2)  # CUT_T - THR_T == CUT_Q - THR_Q
NUM_THR_HOST = 4
NUM_THR = tl.constexpr(NUM_THR_HOST)


@triton.jit
def _row_pass_fast(
    t_rows, d_rows, row_ok, draft_ok, thr_t, thr_q, cut_t, cut_q, inv_t, start_col, end_col, DRAFT_MODE, HAS_FILTER,
    BY_INDEX, BLOCK_V
):  # fmt: skip
    """One pass over [start_col, end_col) of each row: (max, sum-exp) of the processed target and
    draft logits, greedy argmax, count of unusable draft probabilities. About 12 instructions per
    entry: the running max is NaN-propagating (a row with NaN / +inf entries ends with a max that
    is not < inf; the caller redoes it exactly), every lane keeps its own running state and the
    lanes are reduced once at the end."""
    BLOCK_R: tl.constexpr = t_rows.shape[0]
    c = (inv_t * LOG2E)[:, None]
    m_t = tl.full([BLOCK_R, BLOCK_V], NO_MAX, tl.float32)
    z_t = tl.zeros([BLOCK_R, BLOCK_V], tl.float32)
    top_t = tl.full([BLOCK_R, BLOCK_V], float("-inf"), tl.float32)
    top_idx = tl.zeros([BLOCK_R, BLOCK_V], tl.int32)
    m_q = tl.full([BLOCK_R, BLOCK_V], NO_MAX, tl.float32)
    z_q = tl.zeros([BLOCK_R, BLOCK_V], tl.float32)
    top_q = tl.full([BLOCK_R, BLOCK_V], float("-inf"), tl.float32)
    bad_q = tl.zeros([BLOCK_R, BLOCK_V], tl.int32)
    for start in range(start_col, end_col, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)[None, :]
        in_chunk = cols < end_col
        x = tl.load(t_rows + cols, mask=row_ok[:, None] & in_chunk, other=float("-inf")).to(tl.float32)
        top_idx = tl.where(x > top_t, cols, top_idx)
        top_t = tl.maximum(top_t, x, propagate_nan=tl.PropagateNan.ALL)
        if HAS_FILTER:
            x = tl.where(kept_at(x, cols, thr_t[:, None], cut_t[:, None], BY_INDEX), x, float("-inf"))
        m_t, z_t = lane_exp_update(m_t, z_t, x, c)
        if DRAFT_MODE == DRAFT_LOGITS:
            xd = tl.load(d_rows + cols, mask=draft_ok[:, None] & in_chunk, other=float("-inf")).to(tl.float32)
            top_q = tl.maximum(top_q, xd, propagate_nan=tl.PropagateNan.ALL)
            if HAS_FILTER:
                xd = tl.where(kept_at(xd, cols, thr_q[:, None], cut_q[:, None], BY_INDEX), xd, float("-inf"))
            m_q, z_q = lane_exp_update(m_q, z_q, xd, c)
        elif DRAFT_MODE == DRAFT_PROBS:  # only counted: unusable entries flag the request
            _qd, qd_bad = load_probs(d_rows + cols, draft_ok[:, None] & in_chunk)
            bad_q += qd_bad.to(tl.int32)
    row_top, row_idx = lanes_argmax(top_t, top_idx)
    row_top = tl.where(tl.max((top_t != top_t).to(tl.int32), axis=1) > 0, float("nan"), row_top)
    row_z_t = lanes_exp_sum(m_t, z_t, row_top, c)
    row_top_q = tl.max(top_q, axis=1)
    row_top_q = tl.where(tl.max((top_q != top_q).to(tl.int32), axis=1) > 0, float("nan"), row_top_q)
    row_z_q = lanes_exp_sum(m_q, z_q, row_top_q, c)
    return row_top, row_z_t, row_idx, row_top_q, row_z_q, tl.sum(bad_q, axis=1)


@triton.jit
def _row_pass_exact(
    t_rows, d_rows, row_ok, draft_ok, thr_t, thr_q, cut_t, cut_q, inv_t, start_col, end_col, DRAFT_MODE, BY_INDEX,
    BLOCK_V,
):  # fmt: skip
    """The row pass with every entry sanitised (NaN / +inf count as -inf and are counted): for
    the rare rows whose fast pass met such entries."""
    BLOCK_R: tl.constexpr = t_rows.shape[0]
    m_t = tl.full([BLOCK_R, BLOCK_V], float("-inf"), tl.float32)
    z_t = tl.zeros([BLOCK_R, BLOCK_V], tl.float32)
    m_q = tl.full([BLOCK_R, BLOCK_V], float("-inf"), tl.float32)
    z_q = tl.zeros([BLOCK_R, BLOCK_V], tl.float32)
    g_max = tl.full([BLOCK_R, BLOCK_V], float("-inf"), tl.float32)
    g_idx = tl.zeros([BLOCK_R, BLOCK_V], tl.int32)
    bad = tl.zeros([BLOCK_R, BLOCK_V], tl.int32)
    bad_q = tl.zeros([BLOCK_R, BLOCK_V], tl.int32)
    inv_t2 = inv_t[:, None]
    for start in range(start_col, end_col, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)[None, :]
        in_chunk = cols < end_col
        x, x_bad = load_logits(t_rows + cols, row_ok[:, None] & in_chunk)
        bad += x_bad.to(tl.int32)
        g_max, g_idx = lane_argmax_update(g_max, g_idx, x, cols)
        m_t, z_t = lane_softmax_update(m_t, z_t, x, kept_at(x, cols, thr_t[:, None], cut_t[:, None], BY_INDEX), inv_t2)
        if DRAFT_MODE == DRAFT_LOGITS:
            xd, xd_bad = load_logits(d_rows + cols, draft_ok[:, None] & in_chunk)
            bad_q += xd_bad.to(tl.int32)
            kept_q = kept_at(xd, cols, thr_q[:, None], cut_q[:, None], BY_INDEX)
            m_q, z_q = lane_softmax_update(m_q, z_q, xd, kept_q, inv_t2)
    row_m_t, row_z_t = lanes_softmax(m_t, z_t, inv_t)
    row_g_max, row_g_idx = lanes_argmax(g_max, g_idx)
    row_m_q, row_z_q = lanes_softmax(m_q, z_q, inv_t)
    return row_m_t, row_z_t, row_g_max, row_g_idx, tl.sum(bad, axis=1), row_m_q, row_z_q, tl.sum(bad_q, axis=1)


@triton.jit(do_not_specialize=["B", "num_chunks", "top_k"])  # per-call scalars: triton/helpers.py
def _verify_row_stats_kernel(
    # pointers
    target_ptr,  # [B, (K,) G+1, V] fp32/fp16/bf16 raw target logits
    draft_ptr,  # [B, (K,) G, V] raw draft logits (DRAFT_MODE == DRAFT_LOGITS), otherwise unused
    draft_tokens_ptr,  # [B, G] int (PLACEHOLDERS_END), otherwise unused
    cu_ptr,  # [B+1] int: flattened layout (FLAT): request b owns draft rows cu[b] .. cu[b+1]-1
    num_draft_ptr,  # [B] int: n_b (PER_REQ_N), else every request uses G
    temperature_ptr,  # [B] float: 0 = greedy (PER_REQ_T), else the scalar `temperature`
    top_k_ptr,  # [B] int: 0 = off (PER_REQ_K), else the scalar `top_k`
    top_p_ptr,  # [B] float: 1 = off (PER_REQ_P), else the scalar `top_p`
    stats_ptr,  # [B*K*(G+1), C, NUM_STATS] fp32 out
    idx_ptr,  # [B*K*(G+1), C, NUM_IDX] int32 out
    thr_ptr,  # [B*K*(G+1), NUM_THR] fp32 out: thresholds of target and draft (+ index cuts: BY_INDEX)
    filter_buf_ptr,  # fp32 scratch of the threshold phases: candidates [2R, TC, FILTER_CAP], chunk (m, z)
    filter_int_ptr,  # int32 scratch of the threshold phases: each chunk's candidate bound [2R, TC] (not PHASE_WHOLE)
    use_ptr,  # [B*K*(G+1), 2] int8 (ROW_USE): nonzero where the record's target / draft row is used
    # strides
    stride_tb,
    stride_tk,
    stride_tg,
    stride_db,
    stride_dk,
    stride_dg,
    stride_xb,
    # sizes
    B,
    K,  # chains per request (1 for verify; tree ops view a tree as K chains of G slots)
    G,
    V,
    chunk_size,  # vocab entries per chunk, a multiple of BLOCK_V
    num_chunks,
    # scalar parameters (used when the per-request tensor is absent)
    temperature,
    top_k,
    top_p,
    # constexprs
    PER_REQ_N: tl.constexpr,
    PER_REQ_T: tl.constexpr,
    PER_REQ_K: tl.constexpr,
    PER_REQ_P: tl.constexpr,
    DRAFT_MODE: tl.constexpr,
    HAS_FILTER: tl.constexpr,
    BY_INDEX: tl.constexpr,  # top_p_ties="by_index": thresholds carry an index cut (CUT_T, CUT_Q)
    PHASE: tl.constexpr,  # PHASE_STATS, or one of the top-k/top-p threshold phases (see launch_verify)
    FILTER_BLOCK: tl.constexpr,  # threshold chunk width (in registers; chunk_size of the threshold phases)
    FILTER_CAP: tl.constexpr,  # candidate slots per chunk
    FILTER_BINS: tl.constexpr,  # bins of the candidate histograms (key16 steps below the max); PHASE_WHOLE: log2
    FILTER_CHUNKS: tl.constexpr,  # next power of two >= the threshold chunks (selection tile: x FILTER_CAP)
    PLACEHOLDERS_END: tl.constexpr,  # a draft id outside [0, V) ends the draft (chains)
    GP2: tl.constexpr,  # next power of two >= G (PLACEHOLDERS_END)
    FLAT: tl.constexpr,  # flattened ragged layout (chains): bases from cu_ptr, strides are row strides
    ROW_USE: tl.constexpr,  # trees: rows no walk can use (use_ptr) are never read
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One pass over each row's chunk: (max, sum-exp) of the processed target and draft logits, the
    greedy argmax and the count of non-finite logits. The hot loop keeps per-lane running values
    (elementwise work only, one exp per logit); lanes are reduced once, after the loop."""
    pid_r = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # flattened (b * K + k) * (G+1) + i
    bk = rows // (G + 1)
    b = bk // K
    k = bk % K
    i = (rows % (G + 1)).to(tl.int32)
    in_batch = rows < B * K * (G + 1)
    n_b = per_request(num_draft_ptr, G, b, in_batch, PER_REQ_N).to(tl.int32)
    if PLACEHOLDERS_END:
        x_base = request_base(cu_ptr, b, in_batch, stride_xb, 0, FLAT)
        n_b = drafted(draft_tokens_ptr + x_base, in_batch, n_b, V, GP2)
    row_ok = in_batch & (i <= n_b)  # rows past the bonus row are never read
    temperature = per_request(temperature_ptr, temperature, b, row_ok, PER_REQ_T).to(tl.float32)
    greedy, inv_t = inverse_temperature(temperature)
    draft_ok = row_ok & (i < n_b) & ~greedy  # draft rows: never read for greedy, nor in DRAFT_NONE
    target_ok = row_ok  # target rows read (the record is written whenever row_ok)
    if ROW_USE:  # a tree's duplicate and non-first sibling rows: no position takes p or q from them
        target_ok = row_ok & (tl.load(use_ptr + rows * 2, mask=row_ok, other=0) != 0)
        draft_ok = draft_ok & (tl.load(use_ptr + rows * 2 + 1, mask=draft_ok, other=0) != 0)

    t_base = request_base(cu_ptr, b, in_batch, stride_tb, 1, FLAT)  # + b: each request's bonus row
    d_base = request_base(cu_ptr, b, in_batch, stride_db, 0, FLAT)
    t_rows = target_ptr + t_base[:, None] + k[:, None] * stride_tk + i[:, None].to(tl.int64) * stride_tg
    d_rows = draft_ptr + d_base[:, None] + k[:, None] * stride_dk + i[:, None].to(tl.int64) * stride_dg
    thr_t = tl.full([BLOCK_R], float("-inf"), tl.float32)
    thr_q = tl.full([BLOCK_R], float("-inf"), tl.float32)
    cut_t = tl.zeros([BLOCK_R], tl.int32)
    cut_q = tl.zeros([BLOCK_R], tl.int32)
    if HAS_FILTER:
        if PHASE == PHASE_STATS:  # thresholds from the threshold phases
            thr_t = tl.load(thr_ptr + rows * NUM_THR + THR_T, mask=target_ok & ~greedy, other=float("-inf"))
            cut_t = load_cut(thr_ptr + rows * NUM_THR + CUT_T, target_ok & ~greedy, BY_INDEX)
            if DRAFT_MODE == DRAFT_LOGITS:
                thr_q = tl.load(thr_ptr + rows * NUM_THR + THR_Q, mask=draft_ok, other=float("-inf"))
                cut_q = load_cut(thr_ptr + rows * NUM_THR + CUT_Q, draft_ok, BY_INDEX)
        else:
            top_k = per_request(top_k_ptr, top_k, b, row_ok, PER_REQ_K).to(tl.int64)
            top_k = tl.where(top_k >= V, 0, top_k).to(tl.int32)  # k >= V (int64 too) keeps the whole row
            top_p = per_request(top_p_ptr, top_p, b, row_ok, PER_REQ_P).to(tl.float32)
            RS = B * K * (G + 1) * 2
            if PHASE == PHASE_WHOLE:  # the interpreter's plan: BLOCK_R whole rows per program, target then draft
                _whole_rows(
                    t_rows, rows * 2, target_ok & ~greedy, thr_ptr + rows * NUM_THR + THR_T, filter_buf_ptr,
                    V, inv_t, top_k, top_p, FILTER_BLOCK, FILTER_CAP, FILTER_BINS, BY_INDEX,
                )  # fmt: skip
                if DRAFT_MODE == DRAFT_LOGITS:
                    _whole_rows(
                        d_rows, rows * 2 + 1, draft_ok, thr_ptr + rows * NUM_THR + THR_Q, filter_buf_ptr,
                        V, inv_t, top_k, top_p, FILTER_BLOCK, FILTER_CAP, FILTER_BINS, BY_INDEX,
                    )  # fmt: skip
            else:  # the GPU plan: candidates per chunk, then the selection per row
                # axis 1: (program of the row) x W + (0: target, 1: draft; W = 2 with draft logits)
                part = chunk
                parts = tl.num_programs(1)
                which = chunk * 0
                if DRAFT_MODE == DRAFT_LOGITS:
                    which = chunk % 2
                    part = chunk // 2
                    parts = parts // 2
                t_shift: tl.constexpr = _key_shift(target_ptr.dtype.element_ty)
                t_group: tl.constexpr = _group(target_ptr.dtype.element_ty)
                d_shift: tl.constexpr = _key_shift(draft_ptr.dtype.element_ty)
                if DRAFT_MODE != DRAFT_LOGITS:
                    _threshold_phase(
                        t_rows, rows * 2, target_ok & ~greedy, thr_ptr + rows * NUM_THR + THR_T, filter_buf_ptr,
                        filter_int_ptr, RS, num_chunks, part, parts, chunk_size, V, inv_t, top_k, top_p,
                        PHASE, FILTER_BLOCK, FILTER_CAP, FILTER_BINS, FILTER_CHUNKS, t_shift, t_group, BY_INDEX,
                    )  # fmt: skip
                elif d_shift == t_shift:  # same dtype: one copy of the code, the rows picked by `which`
                    is_d = which == 1
                    _threshold_phase(
                        tl.where(is_d, d_rows, t_rows), rows * 2 + which, tl.where(is_d, draft_ok, target_ok & ~greedy),
                        thr_ptr + rows * NUM_THR + which, filter_buf_ptr, filter_int_ptr, RS, num_chunks, part, parts,
                        chunk_size, V, inv_t, top_k, top_p,
                        PHASE, FILTER_BLOCK, FILTER_CAP, FILTER_BINS, FILTER_CHUNKS, t_shift, t_group, BY_INDEX,
                    )  # fmt: skip
                elif which == 0:
                    _threshold_phase(
                        t_rows, rows * 2, target_ok & ~greedy, thr_ptr + rows * NUM_THR + THR_T, filter_buf_ptr,
                        filter_int_ptr, RS, num_chunks, part, parts, chunk_size, V, inv_t, top_k, top_p,
                        PHASE, FILTER_BLOCK, FILTER_CAP, FILTER_BINS, FILTER_CHUNKS, t_shift, t_group, BY_INDEX,
                    )  # fmt: skip
                else:  # draft logits of another dtype than the target's
                    d_group: tl.constexpr = _group(draft_ptr.dtype.element_ty)
                    _threshold_phase(
                        d_rows, rows * 2 + 1, draft_ok, thr_ptr + rows * NUM_THR + THR_Q, filter_buf_ptr,
                        filter_int_ptr, RS, num_chunks, part, parts, chunk_size, V, inv_t, top_k, top_p,
                        PHASE, FILTER_BLOCK, FILTER_CAP, FILTER_BINS, FILTER_CHUNKS, d_shift, d_group, BY_INDEX,
                    )  # fmt: skip
    if PHASE == PHASE_STATS:
        _row_stats_pass(
            t_rows,
            d_rows,
            stats_ptr + (rows * num_chunks + chunk) * NUM_STATS,
            idx_ptr + (rows * num_chunks + chunk) * NUM_IDX,
            row_ok,
            target_ok,
            draft_ok,
            thr_t,
            thr_q,
            cut_t,
            cut_q,
            inv_t,
            chunk * chunk_size,
            tl.minimum(chunk * chunk_size + chunk_size, V),
            DRAFT_MODE,
            HAS_FILTER,
            BY_INDEX,
            BLOCK_V,
        )


@triton.jit
def _row_stats_pass(
    t_rows,
    d_rows,
    rec_ptr,
    idx_rec_ptr,
    row_ok,
    target_ok,
    draft_ok,
    thr_t,
    thr_q,
    cut_t,
    cut_q,
    inv_t,
    start_col,
    end_col,
    DRAFT_MODE: tl.constexpr,
    HAS_FILTER: tl.constexpr,
    BY_INDEX: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Statistics of each row's chunk [start_col, end_col), written to its records rec_ptr /
    idx_rec_ptr ([R] pointers) where row_ok; target rows are read where target_ok, draft rows where
    draft_ok."""
    BLOCK_R: tl.constexpr = t_rows.shape[0]
    # Fast pass: no per-entry sanitising. NaN / +inf entries poison the NaN-propagating running max
    # (which is also the row max and the greedy max); such rows are redone exactly below.
    row_m_t, row_z_t, row_g_idx, row_m_q, row_z_q, bad_q = _row_pass_fast(
        t_rows, d_rows, target_ok, draft_ok, thr_t, thr_q, cut_t, cut_q, inv_t, start_col, end_col, DRAFT_MODE,
        HAS_FILTER, BY_INDEX, BLOCK_V,
    )  # fmt: skip
    redo = target_ok & ~(row_m_t < float("inf"))
    if DRAFT_MODE == DRAFT_LOGITS:
        redo = redo | (draft_ok & ~(row_m_q < float("inf")))
    bad_t = tl.zeros([BLOCK_R], tl.int32)
    if tl.max(redo.to(tl.int32), axis=0) > 0:
        e_m_t, e_z_t, e_g_max, e_g_idx, e_bad_t, e_m_q, e_z_q, e_bad_q = _row_pass_exact(
            t_rows,
            d_rows,
            redo & target_ok,
            redo & draft_ok,
            thr_t,
            thr_q,
            cut_t,
            cut_q,
            inv_t,
            start_col,
            end_col,
            DRAFT_MODE,
            BY_INDEX,
            BLOCK_V,
        )
        row_m_t = tl.where(redo, e_m_t, row_m_t)
        row_z_t = tl.where(redo, e_z_t, row_z_t)
        row_g_idx = tl.where(redo, e_g_idx, row_g_idx)
        bad_t = tl.where(redo, e_bad_t, bad_t)
        row_g_max = tl.where(redo, e_g_max, row_m_t)
        if DRAFT_MODE == DRAFT_LOGITS:
            row_m_q = tl.where(redo, e_m_q, row_m_q)
            row_z_q = tl.where(redo, e_z_q, row_z_q)
            bad_q = tl.where(redo, e_bad_q, bad_q)
    else:
        row_g_max = row_m_t  # the max over kept entries is the row max: a threshold never drops it
    tl.store(rec_ptr + STAT_M_T, row_m_t, mask=row_ok)
    tl.store(rec_ptr + STAT_Z_T, row_z_t, mask=row_ok)
    tl.store(rec_ptr + STAT_GMAX, row_g_max, mask=row_ok)
    tl.store(rec_ptr + STAT_BAD_T, bad_t.to(tl.float32), mask=row_ok)
    tl.store(rec_ptr + STAT_M_Q, row_m_q, mask=row_ok)
    tl.store(rec_ptr + STAT_Z_Q, row_z_q, mask=row_ok)
    tl.store(rec_ptr + STAT_BAD_Q, bad_q.to(tl.float32), mask=row_ok)
    tl.store(idx_rec_ptr + IDX_GREEDY, row_g_idx, mask=row_ok)


@triton.constexpr_function
def _key_shift(ty):
    """Low bits of the float32 order key that are the same for every value of dtype ty (bf16: 16,
    fp16: 13, fp32: 0): the selections bisect only the others."""
    return 16 if ty == tl.bfloat16 else (13 if ty == tl.float16 else 0)


@triton.jit
def _candidate_chunks(
    row, cand, rec, tau, active, part, parts, TC, CW, V, inv_t, BLOCK, CAP, NB, E: tl.constexpr, WITH_Z: tl.constexpr
):
    """Chunks part, part + parts, ... of one row: candidates, (max, sum-exp) and bound of each."""
    for c in range(part, TC, parts):
        start = c * CW
        m, z, bound = chunk_candidates(
            row, cand + c * CAP, active, start, tl.minimum(start + CW, V), inv_t, BLOCK, CAP, NB, E, WITH_Z
        )
        tl.store(rec + c * 2, m, mask=active)
        tl.store(rec + c * 2 + 1, z, mask=active)
        tl.store(tau + c, bound, mask=active)


@triton.constexpr_function
def _group(ty):
    """Entries of one 16-byte vector of dtype ty: the candidate groups (bf16 / fp16: 8, fp32: 4)."""
    return 128 // ty.primitive_bitwidth


@triton.constexpr_function
def _fallback_block(block):
    return min(block, 2048)


@triton.jit
def _whole_rows(
    row_ptrs,  # [R, 1] pointers to the rows (target or draft)
    slot,  # [R] scratch slot of each row: 2 * row (+ 1 for the draft)
    ok,  # [R] rows that sample (greedy rows never filter)
    thr_out,  # [R] pointers: where the thresholds go
    filter_buf_ptr,  # fp32 scratch: candidates [2R, CAP]
    V,
    inv_t,
    top_k,
    top_p,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    NB_BITS: tl.constexpr,
    BY_INDEX: tl.constexpr,
):
    """PHASE_WHOLE: the thresholds of R whole rows in one program (``filter_threshold``: key
    histogram -> pivot, copy of the candidates, selection among them; bisection when they overflow
    CAP). The interpreter's plan: it pays per operation, so many rows per program are cheap."""
    cand = filter_buf_ptr + slot.to(tl.int64) * CAP
    thr, _fast, need = filter_threshold_ties(
        row_ptrs, cand[:, None], ok, V, inv_t, top_k, top_p, BLOCK, CAP, NB_BITS, BY_INDEX
    )
    tl.store(thr_out, thr, mask=ok)
    if BY_INDEX:
        store_cut(thr_out + CUT_OF_THR, tie_index(row_ptrs, need, thr, V, BLOCK), ok)


@triton.jit
def _threshold_phase(
    row_ptrs,  # [R, 1] pointers to the rows (target or draft)
    slot,  # [R] scratch slot of each row: 2 * row (+ 1 for the draft)
    ok,  # [R] rows that sample (greedy rows never filter)
    thr_out,  # [R] pointers: where the thresholds go
    filter_buf_ptr,
    filter_int_ptr,
    RS,  # scratch slots in all: 2 * rows
    TC,  # threshold chunks
    part,  # this program's share of the row (PHASE_CANDIDATES)
    parts,  # programs per row (PHASE_CANDIDATES)
    CW,  # chunk width (== FILTER_BLOCK)
    V,
    inv_t,
    top_k,
    top_p,
    PHASE: tl.constexpr,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    NB: tl.constexpr,
    TCP2: tl.constexpr,
    SHIFT: tl.constexpr,
    E: tl.constexpr,
    BY_INDEX: tl.constexpr,
):
    """The top-k/top-p thresholds in two launches: the candidates of each vocabulary chunk, read
    once and kept in registers (PHASE_CANDIDATES, ``chunk_candidates``: a program takes chunks
    part, part + parts, ... of one row), then the exact selection among them per row
    (PHASE_SELECT, ``select_candidates``), with the bisection over the row for rows the candidates
    do not decide (``bisect_threshold``). Scratch (``ThresholdPlan.scratch``): fp32 candidates
    [RS, TC, CAP] and (max, sum-exp) [RS, TC, 2]; int32 candidate bounds [RS, TC]."""
    use_k = ok & (top_k > 0) & (top_k < V)
    use_p = ok & (top_p < 1.0)
    active = use_k | use_p
    s64 = slot.to(tl.int64)
    cand = filter_buf_ptr + s64 * TC * CAP
    rec = filter_buf_ptr + RS * TC * CAP + s64 * TC * 2
    tau = filter_int_ptr + s64 * TC
    if PHASE == PHASE_CANDIDATES:
        if tl.max(active.to(tl.int32), axis=0) > 0:
            row = tl.reshape(row_ptrs, [1])
            if tl.max((use_p & ~use_k).to(tl.int32), axis=0) > 0:  # top-p alone: the row's sum-exp too
                _candidate_chunks(row, cand, rec, tau, active, part, parts, TC, CW, V, inv_t, BLOCK, CAP, NB, E, True)
            else:
                _candidate_chunks(row, cand, rec, tau, active, part, parts, TC, CW, V, inv_t, BLOCK, CAP, NB, E, False)
    elif BY_INDEX:  # PHASE_SELECT with the index cuts
        thr = tl.full(inv_t.shape, float("-inf"), tl.float32)
        need = tl.zeros(inv_t.shape, tl.int32)
        if tl.max(active.to(tl.int32), axis=0) > 0:
            thr, fast, need = select_candidates_ties(
                cand, rec, tau, TC, ok, V, inv_t, top_k, top_p, TCP2, CAP, NB, SHIFT, True
            )
            slow = active & ~fast
            if tl.max(slow.to(tl.int32), axis=0) > 0:
                exact, exact_need = bisect_threshold_ties(
                    row_ptrs, slow, V, inv_t, top_k, top_p, _fallback_block(BLOCK), True
                )
                thr = tl.where(slow, exact, thr)
                need = tl.where(slow, exact_need, need)
        tl.store(thr_out, thr, mask=ok)
        store_cut(thr_out + CUT_OF_THR, tie_index(row_ptrs, need, thr, V, _fallback_block(BLOCK)), ok)
    else:  # PHASE_SELECT (the keep rule: no tie count carried through the branches)
        thr = tl.full(inv_t.shape, float("-inf"), tl.float32)
        if tl.max(active.to(tl.int32), axis=0) > 0:
            thr, fast = select_candidates(cand, rec, tau, TC, ok, V, inv_t, top_k, top_p, TCP2, CAP, NB, SHIFT)
            slow = active & ~fast
            if tl.max(slow.to(tl.int32), axis=0) > 0:
                exact = bisect_threshold(row_ptrs, slow, V, inv_t, top_k, top_p, _fallback_block(BLOCK))
                thr = tl.where(slow, exact, thr)
        tl.store(thr_out, thr, mask=ok)


@triton.jit(do_not_specialize=["R", "num_chunks"])  # per-call scalars: triton/helpers.py
def _combine_row_stats_kernel(
    # pointers
    stats_ptr,  # [R, C, NUM_STATS] fp32: per-chunk statistics of kernel 1
    idx_ptr,  # [R, C, NUM_IDX] int32
    out_stats_ptr,  # [R, 1, NUM_STATS] fp32 out: whole-row statistics
    out_idx_ptr,  # [R, 1, NUM_IDX] int32 out
    temperature_ptr,  # [B] float (PER_REQ_T)
    # sizes
    R,
    ROWS_PER_REQUEST,  # K * (G + 1): rows of one request (for its temperature)
    num_chunks,
    # scalar parameters
    temperature,
    # constexprs
    PER_REQ_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Merge the vocabulary chunks of kernel 1 into whole-row records, for consumers that read one
    record per row (the tree walk)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    ok = rows < R
    temperature = per_request(temperature_ptr, temperature, rows // ROWS_PER_REQUEST, ok, PER_REQ_T)
    _greedy, inv_t = inverse_temperature(temperature.to(tl.float32))
    m_t = tl.full([BLOCK_R], float("-inf"), tl.float32)
    z_t = tl.zeros([BLOCK_R], tl.float32)
    m_q = tl.full([BLOCK_R], float("-inf"), tl.float32)
    z_q = tl.zeros([BLOCK_R], tl.float32)
    g_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
    g_idx = tl.zeros([BLOCK_R], tl.int32)
    bad_t = tl.zeros([BLOCK_R], tl.float32)
    bad_q = tl.zeros([BLOCK_R], tl.float32)
    for c in range(0, num_chunks):
        rec = (rows * num_chunks + c) * NUM_STATS
        c_gmax = tl.load(stats_ptr + rec + STAT_GMAX, mask=ok, other=float("-inf"))
        c_gidx = tl.load(idx_ptr + (rows * num_chunks + c) * NUM_IDX + IDX_GREEDY, mask=ok, other=0)
        take = c_gmax > g_max  # strict: the earlier chunk keeps ties (lowest index)
        g_max = tl.where(take, c_gmax, g_max)
        g_idx = tl.where(take, c_gidx, g_idx)
        m_t, z_t = combine_softmax(
            m_t,
            z_t,
            tl.load(stats_ptr + rec + STAT_M_T, mask=ok, other=float("-inf")),
            tl.load(stats_ptr + rec + STAT_Z_T, mask=ok, other=0.0),
            inv_t,
        )
        m_q, z_q = combine_softmax(
            m_q,
            z_q,
            tl.load(stats_ptr + rec + STAT_M_Q, mask=ok, other=float("-inf")),
            tl.load(stats_ptr + rec + STAT_Z_Q, mask=ok, other=0.0),
            inv_t,
        )
        bad_t += tl.load(stats_ptr + rec + STAT_BAD_T, mask=ok, other=0.0)
        bad_q += tl.load(stats_ptr + rec + STAT_BAD_Q, mask=ok, other=0.0)
    out = rows * NUM_STATS
    tl.store(out_stats_ptr + out + STAT_M_T, m_t, mask=ok)
    tl.store(out_stats_ptr + out + STAT_Z_T, z_t, mask=ok)
    tl.store(out_stats_ptr + out + STAT_M_Q, m_q, mask=ok)
    tl.store(out_stats_ptr + out + STAT_Z_Q, z_q, mask=ok)
    tl.store(out_stats_ptr + out + STAT_GMAX, g_max, mask=ok)
    tl.store(out_stats_ptr + out + STAT_BAD_T, bad_t, mask=ok)
    tl.store(out_stats_ptr + out + STAT_BAD_Q, bad_q, mask=ok)
    tl.store(out_idx_ptr + rows * NUM_IDX + IDX_GREEDY, g_idx, mask=ok)


@triton.jit
def request_base(cu_ptr, b, mask, stride_b, BONUS_ROW: tl.constexpr, FLAT: tl.constexpr):
    """Element offset of request b's first row: ``b * stride_b`` in the padded layout; in the
    flattened layout row ``cu[b] + BONUS_ROW * b`` times the row stride (passed as stride_b), where
    BONUS_ROW = 1 for target rows (each request owns n_b + 1 of them) and 0 for draft rows / ids."""
    if FLAT:
        return (tl.load(cu_ptr + b, mask=mask, other=0).to(tl.int64) + BONUS_ROW * b) * stride_b
    else:
        return b * stride_b


@triton.jit
def drafted(x_rows, mask, n_b, V, GP2: tl.constexpr):
    """n_b cut at the first placeholder id (outside [0, V), e.g. vLLM's -1 padding) of the draft ids
    at ``x_rows`` (one pointer per request): the draft ends there, so that position draws the bonus
    token from p, masking nothing (as a tree walk does when a node has no valid child)."""
    t = tl.arange(0, GP2)[None, :]
    in_draft = mask[:, None] & (t < n_b[:, None])
    tok = tl.load(x_rows[:, None] + t, mask=in_draft, other=0)
    placeholder = in_draft & ((tok < 0) | (tok >= V))
    return tl.minimum(n_b, tl.min(tl.where(placeholder, t, GP2), axis=1))


@triton.jit
def combine_softmax(m, z, m_c, z_c, inv_t):
    """Merge a chunk's (max, sum-exp) into the running pair."""
    m_new = tl.maximum(m, m_c)
    ref = safe_max(m_new)
    z = z * tl.exp((m - ref) * inv_t) + z_c * tl.exp((m_c - ref) * inv_t)
    return m_new, z


@triton.jit
def load_cut(ptrs, mask, BY_INDEX: tl.constexpr):
    """The by_index cuts of threshold records (int32 bits in the fp32 record); 0 without BY_INDEX."""
    if BY_INDEX:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.int32, bitcast=True)
    else:
        return tl.zeros(ptrs.shape, tl.int32)


@triton.jit
def store_cut(ptrs, cut, mask):
    tl.store(ptrs, cut.to(tl.float32, bitcast=True), mask=mask)


@triton.jit
def prob_of(x, m, z, thr, inv_t, col, cut, BY_INDEX: tl.constexpr):
    """p(x) of the processed distribution given its statistics (0 for filtered or -inf logits); x
    is the entry at column col (``kept_at``)."""
    kept = kept_at(x, col, thr, cut, BY_INDEX) & (x > float("-inf")) & (z > 0.0)
    p = tl.exp((x - safe_max(m)) * inv_t) / tl.where(z > 0.0, z, 1.0)
    return tl.where(kept, p, 0.0)


def launch_threshold_phases(row_pass, tplan: ThresholdPlan) -> None:
    """The threshold launches of the row-stats kernel; row_pass(phase, block_r, grid_chunks,
    num_chunks, chunk_size, num_warps) launches it with the call's other arguments (one row per
    program; axis 1 interleaves target and draft when draft logits are filtered too), or the
    interpreter's one whole-row launch (PHASE_WHOLE, ``tplan.block_r`` rows per program)."""
    if tplan.block_r:
        row_pass(PHASE_WHOLE.value, tplan.block_r, 1, 1, tplan.chunk_size, tplan.warps)
        return
    w = tplan.slots
    row_pass(PHASE_CANDIDATES.value, 1, w * tplan.programs, tplan.chunks, tplan.chunk_size, tplan.warps)
    row_pass(PHASE_SELECT.value, 1, w, tplan.chunks, tplan.chunk_size, tplan.select_warps)


@dataclass(frozen=True)
class ThresholdPlan:
    """The top-k/top-p threshold launches: vocabulary chunks of chunk_size entries (each one tile in
    registers), programs per row (each takes every programs-th chunk), target/draft slots per row,
    warps, and the kernel's FILTER_* constexprs. block_r > 0: the interpreter's whole-row plan
    instead (one PHASE_WHOLE launch, block_r rows per program, one chunk of chunk_size >= V)."""

    chunks: int
    chunk_size: int
    programs: int
    slots: int
    warps: int
    select_warps: int
    constexprs: dict
    block_r: int = 0

    def scratch(self, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32, int32) scratch of the phases (layout in ``_threshold_phase``)."""
        slots, tc = 2 * rows, self.chunks
        floats = slots * tc * (self.constexprs["FILTER_CAP"] + 2)
        return (
            torch.empty(floats, dtype=torch.float32, device=device),
            torch.empty(slots * tc, dtype=torch.int32, device=device),
        )


SELECT_SLOTS = 2048  # candidate slots of a row in the selection tile (chunks x slots per chunk) on a GPU
CANDIDATE_BINS = 256  # bins of the candidate histograms: key16 steps below the max
MIN_GROUPS = 16  # candidate groups per chunk (fewer: the union of the chunks rarely holds top-k 50)


def threshold_plan(
    target: torch.Tensor,
    rows: int,
    V: int,
    chunks: int | None = None,
    draft_logits: bool = True,
    capacity: int | None = None,
) -> ThresholdPlan:
    """Threshold launches for `rows` rows (target, and draft when `draft_logits`): every row is split
    into chunks that are read once, each kept in registers (at most 32 entries per thread) while its
    candidates are picked; the chunk width balances the programs over the SMs (the busiest SM's
    entries, plus a per-program overhead) while the selection tile (chunks x slots per chunk =
    `capacity`) keeps at least MIN_GROUPS groups of 8 per chunk. `chunks` forces a split (tests),
    `capacity` the selection tile.

    The Triton interpreter gets another plan unless a test forces `chunks` or `capacity`: one
    PHASE_WHOLE launch over up to 64 whole rows per program (``filter_threshold``). It pays per
    operation, not per byte, and the two launches' one row per program with serial in-register
    bisections run ~40x slower there (hours for the slow suite's 40,000-sample statistical tests).
    The plan only changes how the work is split: both compute the thresholds of
    ``reference.sampling.filter_threshold``, a deterministic function of the row (no random
    numbers), and the fast tests check both against the reference, thresholds and tokens: the
    default interpreter plan everywhere, the two launches with interpreter-sized constexprs under
    ``launch_overrides(threshold_chunks=..., threshold_capacity=...)``."""
    slots = 2 if draft_logits else 1
    interpreted = plans_for_interpreter(target.device)
    if interpreted and chunks is None and capacity is None:
        # the interpreter pays per operation: many rows and whole rows of candidates are cheap
        block_r = max(1, min(next_pow2(rows), 64))
        # ... but every operation costs its tile's width: no tile or candidate buffer wider than a row
        row = max(16, next_pow2(V))
        block = max(16, min(4096, (1 << 16) // block_r, row))
        constexprs = dict(FILTER_BLOCK=block, FILTER_CAP=min(4096, row), FILTER_BINS=10, FILTER_CHUNKS=1)
        warps = 8 if block_r > 1 else 4
        return ThresholdPlan(1, cdiv(V, block) * block, 1, slots, warps, warps, constexprs, block_r)
    if interpreted:  # a forced split or capacity (tests): the GPU's two launches, interpreter-sized
        # whole rows (up to 64k entries) per chunk unless split, big tiles
        capacity = capacity or 4096
        width = max(16, min(next_pow2(cdiv(V, chunks or 1)), 1 << 16))
        warps = 4
    else:
        capacity = capacity or SELECT_SLOTS
        sms = multiprocessors(target.device)
        best = None
        for width in (1024, 2048, 4096, 8192, 16384):
            tc = cdiv(V, width)
            if next_pow2(tc) * 8 * MIN_GROUPS > capacity and width < 16384:
                continue
            cost = math.ceil(rows * slots * tc / sms) * (width + 1024)
            if best is None or cost < best[0]:
                best = (cost, width)
        width = best[1] if chunks is None else next_pow2(cdiv(V, chunks))
        warps = max(4, min(8, width // 1024))
        capacity = min(capacity, next_pow2(cdiv(V, width)) * 8 * MIN_GROUPS)  # no bigger tile than needed
    tc = cdiv(V, width)
    tcp2 = next_pow2(tc)
    cap = max(8, capacity // tcp2)
    constexprs = dict(FILTER_BLOCK=width, FILTER_CAP=cap, FILTER_BINS=CANDIDATE_BINS, FILTER_CHUNKS=tcp2)
    return ThresholdPlan(tc, width, tc, slots, warps, 2, constexprs)


def merge_chunk_stats(stats, idx, rows: int, rows_per_request: int, t_ptr, t_val, per_req_t: bool):
    """Whole-row records [rows, 1, ...] from the row pass's per-chunk ones (one small launch)."""
    whole = torch.empty((rows, 1, NUM_STATS_HOST), dtype=torch.float32, device=stats.device)
    whole_idx = torch.empty((rows, 1, NUM_IDX_HOST), dtype=torch.int32, device=stats.device)
    block = min(next_pow2(rows), 128)
    _combine_row_stats_kernel[(cdiv(rows, block),)](
        stats,
        idx,
        whole,
        whole_idx,
        t_ptr,
        rows,
        rows_per_request,
        stats.shape[1],
        float(t_val),
        PER_REQ_T=per_req_t,
        BLOCK_R=block,
    )
    return whole, whole_idx
