"""The row pass both chain and tree verification run: per-(row, vocabulary chunk) statistics of the
processed target and draft rows (online max / sum-exp, greedy argmax, NaN/+inf counts), with the
top-k / top-p threshold phases before it (``threshold_phases``), the merge of its chunks
(``chunk_merge``), and the device functions that turn the statistics into probabilities (``prob_of``).

Launch: ``launch_row_stats(layout, sampling, plan)`` with a ``RowPassLayout`` (where the rows are)
and a ``RowPassPlan`` (``row_pass_plan``: tiles from ``launch.tile_settings``, vocabulary chunks,
the threshold phases' plan); it returns whole-row records (``RowStats``) that the chain's accept
kernel and the tree walk read. The record layouts are in ``records``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..._params import SamplingParams
from .chunk_merge import merge_chunk_stats
from .helpers import (
    DRAFT_LOGITS,
    DRAFT_NONE,
    DRAFT_PROBS,
    LOG2E,
    NO_MAX,
    allowed_tile,
    argmax_pass,
    cdiv,
    inverse_temperature,
    kept_at,
    lane_argmax_update,
    lane_exp_update,
    lane_max_exp_update,
    lane_softmax_update,
    lanes_argmax,
    lanes_exp_sum,
    lanes_max_exp,
    lanes_softmax,
    load_logits,
    load_probs,
    next_pow2,
    per_request,
    safe_max,
)
from .launch import TileSettings, greedy_logprobs_filter, ties_by_index_at_unit_t, vocab_chunks
from .records import (
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
    load_thresholds,
)
from .threshold_phases import (
    ThresholdPlan,
    candidate_group,
    key_shift,
    launch_threshold_phases,
    threshold_phases,
    threshold_plan,
)


@triton.jit
def _row_pass_fast(
    t_rows, d_rows, tm_rows, dm_rows, row_ok, draft_ok, thr_t, thr_q, cut_t, cut_q, inv_t, start_col, end_col,
    DRAFT_MODE, HAS_FILTER, BY_INDEX, HAS_MASK, MASK_PARENTS, BLOCK_V
):  # fmt: skip
    """One pass over [start_col, end_col) of each row: (max, sum-exp) of the processed target and
    draft logits, greedy argmax, count of unusable draft probabilities; about 10 instructions per
    entry. A row with NaN / +inf entries ends with a max that is not < inf (the caller redoes it
    exactly); every lane keeps its own running state and the lanes are reduced once at the end.

    The running max of the sum-exp is also the row max and the argmax (``lane_max_exp_update``):
    a threshold keeps the row max and every entry equal to it, and a NaN passes the filter (dropped
    only where x < thr) to poison z. The by_index tie rule can drop entries equal to the max before
    its cut: with it (TIES) a separate NaN-propagating max and its index track the unfiltered
    entries. The mask's bit and the filter's test make one predicate: -inf where either fails."""
    BLOCK_R: tl.constexpr = t_rows.shape[0]
    TIES: tl.constexpr = HAS_FILTER and BY_INDEX
    c = (inv_t * LOG2E)[:, None]
    m_t = tl.full([BLOCK_R, BLOCK_V], NO_MAX, tl.float32)
    y_t = tl.full([BLOCK_R, BLOCK_V], -1.0, tl.float32)  # z - 1 (``lane_exp_update``)
    top_t = tl.full([BLOCK_R, BLOCK_V], float("-inf"), tl.float32)  # TIES
    top_idx = tl.zeros([BLOCK_R, BLOCK_V], tl.int32)
    m_q = tl.full([BLOCK_R, BLOCK_V], NO_MAX, tl.float32)
    y_q = tl.full([BLOCK_R, BLOCK_V], -1.0, tl.float32)
    top_q = tl.full([BLOCK_R, BLOCK_V], float("-inf"), tl.float32)  # TIES
    bad_q = tl.zeros([BLOCK_R, BLOCK_V], tl.int32)
    for start in range(start_col, end_col, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)[None, :]
        in_chunk = cols < end_col
        t_bits = allowed_tile(tm_rows, start, end_col, row_ok | draft_ok, BLOCK_V, HAS_MASK)
        x = tl.load(t_rows + cols, mask=row_ok[:, None] & in_chunk, other=float("-inf")).to(tl.float32)
        m_t, y_t, top_t, top_idx = _fold_entries(
            x, t_bits, m_t, y_t, top_t, top_idx, cols, thr_t, cut_t, c, TIES, HAS_FILTER, HAS_MASK
        )
        if DRAFT_MODE == DRAFT_LOGITS:
            d_bits = t_bits  # a chain's / verify_multi's draft row i uses its target row's words
            if MASK_PARENTS:
                d_bits = allowed_tile(dm_rows, start, end_col, draft_ok, BLOCK_V, HAS_MASK)
            xd = tl.load(d_rows + cols, mask=draft_ok[:, None] & in_chunk, other=float("-inf")).to(tl.float32)
            m_q, y_q, top_q, _idx = _fold_entries(
                xd, d_bits, m_q, y_q, top_q, top_idx, cols, thr_q, cut_q, c, TIES, HAS_FILTER, HAS_MASK
            )
        elif DRAFT_MODE == DRAFT_PROBS:  # only counted: unusable entries flag the request
            _qd, qd_bad = load_probs(d_rows + cols, draft_ok[:, None] & in_chunk)
            bad_q += qd_bad.to(tl.int32)
    if TIES:
        row_top, row_idx = lanes_argmax(top_t, top_idx)
        row_top = tl.where(tl.max((top_t != top_t).to(tl.int32), axis=1) > 0, float("nan"), row_top)
        row_z_t = lanes_exp_sum(m_t, y_t + 1.0, row_top, c)
        row_top_q = tl.max(top_q, axis=1)
        row_top_q = tl.where(tl.max((top_q != top_q).to(tl.int32), axis=1) > 0, float("nan"), row_top_q)
        row_z_q = lanes_exp_sum(m_q, y_q + 1.0, row_top_q, c)
    else:
        row_top, row_idx, row_z_t = lanes_max_exp(m_t, y_t, top_idx, c)
        row_top_q, _row_idx_q, row_z_q = lanes_max_exp(m_q, y_q, top_idx, c)
    return row_top, row_z_t, row_idx, row_top_q, row_z_q, tl.sum(bad_q, axis=1)


@triton.jit
def _kept_entries(x, bits, thr, HAS_FILTER: tl.constexpr, HAS_MASK: tl.constexpr):
    """x where the mask allows it and, with a filter, where not x < thr (a NaN passes), else -inf."""
    keep = bits
    if HAS_FILTER:
        keep = keep & ~(x < thr[:, None])  # a NaN passes: it poisons z
    if HAS_MASK or HAS_FILTER:
        x = tl.where(keep, x, float("-inf"))
    return x


@triton.jit
def _ties_entries(x, bits, top, top_idx, cols, thr, cut, HAS_MASK: tl.constexpr):
    """The by_index filter's form (TIES of ``_row_pass_fast``): the masked entries update the
    NaN-propagating max and its first index, then the filtered entries (x >= the cut's threshold)."""
    if HAS_MASK:
        x = tl.where(bits, x, float("-inf"))
    top_idx = tl.where(x > top, cols, top_idx)
    top = tl.maximum(top, x, propagate_nan=tl.PropagateNan.ALL)
    return tl.where(kept_at(x, cols, thr[:, None], cut[:, None], True), x, float("-inf")), top, top_idx


@triton.jit
def _fold_entries(
    x, bits, m, y, top, top_idx, cols, thr, cut, c, TIES: tl.constexpr, HAS_FILTER: tl.constexpr,
    HAS_MASK: tl.constexpr,
):  # fmt: skip
    """One tile of a target or draft row into its lanes' running (max, z - 1) and, with TIES, its
    NaN-propagating max; returns (m, y, top, top_idx) (the draft's caller drops the index)."""
    if TIES:
        x, top, top_idx = _ties_entries(x, bits, top, top_idx, cols, thr, cut, HAS_MASK)
        m, y = lane_exp_update(m, y, x, c)
    else:
        x = _kept_entries(x, bits, thr, HAS_FILTER, HAS_MASK)
        m, y, top_idx = lane_max_exp_update(m, y, top_idx, x, cols, c)
    return m, y, top, top_idx


@triton.jit
def _row_pass_exact(
    t_rows, d_rows, tm_rows, dm_rows, row_ok, draft_ok, thr_t, thr_q, cut_t, cut_q, inv_t, start_col, end_col,
    DRAFT_MODE, BY_INDEX, HAS_MASK, MASK_PARENTS, BLOCK_V,
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
        t_bits = allowed_tile(tm_rows, start, end_col, row_ok | draft_ok, BLOCK_V, HAS_MASK)
        x, x_bad = load_logits(t_rows + cols, row_ok[:, None] & in_chunk, t_bits)
        bad += x_bad.to(tl.int32)
        g_max, g_idx = lane_argmax_update(g_max, g_idx, x, cols)
        m_t, z_t = lane_softmax_update(m_t, z_t, x, kept_at(x, cols, thr_t[:, None], cut_t[:, None], BY_INDEX), inv_t2)
        if DRAFT_MODE == DRAFT_LOGITS:
            d_bits = t_bits
            if MASK_PARENTS:
                d_bits = allowed_tile(dm_rows, start, end_col, draft_ok, BLOCK_V, HAS_MASK)
            xd, xd_bad = load_logits(d_rows + cols, draft_ok[:, None] & in_chunk, d_bits)
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
    mask_ptr,  # [B, (K,) G+1, W] int32 (HAS_MASK): grammar words of the target rows (flattened: [N+B, W])
    parents_ptr,  # [B, N] int (MASK_PARENTS): a tree's draft row i uses mask row parents[i] + 1
    # strides
    stride_tb,
    stride_tk,
    stride_tg,
    stride_db,
    stride_dk,
    stride_dg,
    stride_xb,
    stride_mb,  # mask strides in words, as the target's (flattened: row strides)
    stride_mk,
    stride_mg,
    stride_pb,
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
    PHASE: tl.constexpr,  # PHASE_STATS, or one of the top-k/top-p threshold phases (``threshold_phases``)
    FILTER_BLOCK: tl.constexpr,  # threshold chunk width (in registers; chunk_size of the threshold phases)
    FILTER_CAP: tl.constexpr,  # candidate slots per chunk
    FILTER_BINS: tl.constexpr,  # bins of the candidate histograms (key16 steps below the max); PHASE_WHOLE: log2
    FILTER_CHUNKS: tl.constexpr,  # next power of two >= the threshold chunks (selection tile: x FILTER_CAP)
    PLACEHOLDERS_END: tl.constexpr,  # a draft id outside [0, V) ends the draft (chains)
    GP2: tl.constexpr,  # next power of two >= G (PLACEHOLDERS_END)
    FLAT: tl.constexpr,  # flattened ragged layout (chains): bases from cu_ptr, strides are row strides
    ROW_USE: tl.constexpr,  # trees: rows no walk can use (use_ptr) are never read
    HAS_MASK: tl.constexpr,  # token_bitmask: disallowed logits are -inf in target and draft rows
    MASK_PARENTS: tl.constexpr,  # draft row i's mask row is parents[i] + 1 (verify_tree), else row i
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LOGPROBS: tl.constexpr,  # return_logprobs: greedy rows get top-k/top-p thresholds too (at T = 1)
    ARGMAX_ONLY: tl.constexpr,  # every request greedy, DRAFT_NONE: records hold max and argmax only (z = 0)
):
    """One pass over each row's chunk: (max, sum-exp) of the processed target and draft logits, the
    greedy argmax and the count of non-finite logits (PHASE_STATS, ``_row_stats_pass``); or one of
    the top-k/top-p threshold phases before it (``threshold_phases``)."""
    rows, b, k, i, row_ok, target_ok, draft_ok, greedy, inv_t = _row_tile(
        cu_ptr, num_draft_ptr, draft_tokens_ptr, temperature_ptr, use_ptr, stride_xb, B, K, G, V, temperature,
        PER_REQ_N, PER_REQ_T, PLACEHOLDERS_END, GP2, FLAT, ROW_USE, BLOCK_R,
    )  # fmt: skip
    t_base = request_base(cu_ptr, b, rows < B * K * (G + 1), stride_tb, 1, FLAT)  # + b: each request's bonus row
    d_base = request_base(cu_ptr, b, rows < B * K * (G + 1), stride_db, 0, FLAT)
    t_rows = target_ptr + t_base[:, None] + k[:, None] * stride_tk + i[:, None].to(tl.int64) * stride_tg
    d_rows = draft_ptr + d_base[:, None] + k[:, None] * stride_dk + i[:, None].to(tl.int64) * stride_dg
    tm_rows, dm_rows = mask_rows(
        mask_ptr, parents_ptr, cu_ptr, b, k, i, rows < B * K * (G + 1), draft_ok, stride_mb, stride_mk, stride_mg,
        stride_pb, G, FLAT, MASK_PARENTS,
    )  # fmt: skip
    chunk = tl.program_id(1)
    filtered = target_ok & ~greedy  # greedy rows need no thresholds to pick the argmax ...
    if LOGPROBS:  # ... but their logprobs are scored at T = 1 with their top-k / top-p (the greedy max stays)
        filtered = target_ok
    if PHASE == PHASE_STATS:  # thresholds (when filtering) from the threshold phases
        thr_t, cut_t, thr_q, cut_q = load_thresholds(
            thr_ptr + rows * NUM_THR, filtered, draft_ok, HAS_FILTER, DRAFT_MODE, BY_INDEX
        )
        _row_stats_pass(
            t_rows, d_rows, tm_rows, dm_rows, stats_ptr + (rows * num_chunks + chunk) * NUM_STATS,
            idx_ptr + (rows * num_chunks + chunk) * NUM_IDX, row_ok, target_ok, draft_ok, thr_t, thr_q, cut_t, cut_q,
            inv_t, chunk * chunk_size, tl.minimum(chunk * chunk_size + chunk_size, V), DRAFT_MODE, HAS_FILTER,
            BY_INDEX, HAS_MASK, MASK_PARENTS, ARGMAX_ONLY, BLOCK_V,
        )  # fmt: skip
    elif HAS_FILTER:
        top_k = per_request(top_k_ptr, top_k, b, row_ok, PER_REQ_K).to(tl.int64)
        top_k = tl.where(top_k >= V, 0, top_k).to(tl.int32)  # k >= V (int64 too) keeps the whole row
        top_p = per_request(top_p_ptr, top_p, b, row_ok, PER_REQ_P).to(tl.float32)
        t_shift: tl.constexpr = key_shift(target_ptr.dtype.element_ty)
        t_group: tl.constexpr = candidate_group(target_ptr.dtype.element_ty)
        d_shift: tl.constexpr = key_shift(draft_ptr.dtype.element_ty)
        d_group: tl.constexpr = candidate_group(draft_ptr.dtype.element_ty)
        threshold_phases(
            t_rows, d_rows, tm_rows, dm_rows, rows, filtered, draft_ok, thr_ptr + rows * NUM_THR,
            filter_buf_ptr, filter_int_ptr, B * K * (G + 1) * 2, num_chunks, chunk_size, V, inv_t, top_k, top_p, PHASE,
            DRAFT_MODE, FILTER_BLOCK, FILTER_CAP, FILTER_BINS, FILTER_CHUNKS, t_shift, t_group, d_shift, d_group,
            BY_INDEX, HAS_MASK,
        )  # fmt: skip


@triton.jit
def _row_tile(
    cu_ptr, num_draft_ptr, draft_tokens_ptr, temperature_ptr, use_ptr, stride_xb, B, K, G, V, temperature,
    PER_REQ_N: tl.constexpr, PER_REQ_T: tl.constexpr, PLACEHOLDERS_END: tl.constexpr, GP2: tl.constexpr,
    FLAT: tl.constexpr, ROW_USE: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """The BLOCK_R rows of this program (flattened (b * K + k) * (G+1) + i) and which of them are
    read: (rows, b, k, i, row_ok: the record is written, target_ok / draft_ok: the target / draft row
    is read, greedy, 1 / T)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
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
    return rows, b, k, i, row_ok, target_ok, draft_ok, greedy, inv_t


@triton.jit
def _row_stats_pass(
    t_rows,
    d_rows,
    tm_rows,
    dm_rows,
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
    HAS_MASK: tl.constexpr,
    MASK_PARENTS: tl.constexpr,
    ARGMAX_ONLY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Statistics of each row's chunk [start_col, end_col), written to its records rec_ptr /
    idx_rec_ptr ([R] pointers) where row_ok; target rows are read where target_ok, draft rows where
    draft_ok; with ARGMAX_ONLY max and argmax only."""
    BLOCK_R: tl.constexpr = t_rows.shape[0]
    # Fast pass: no per-entry sanitising. NaN / +inf entries poison the NaN-propagating running max
    # (which is also the row max and the greedy max); such rows are redone exactly below.
    if ARGMAX_ONLY:
        row_m_t, row_z_t, row_g_idx, row_m_q, row_z_q, bad_q = argmax_pass(
            t_rows, tm_rows, target_ok, start_col, end_col, HAS_MASK, BLOCK_V
        )
    else:
        row_m_t, row_z_t, row_g_idx, row_m_q, row_z_q, bad_q = _row_pass_fast(
            t_rows, d_rows, tm_rows, dm_rows, target_ok, draft_ok, thr_t, thr_q, cut_t, cut_q, inv_t, start_col,
            end_col, DRAFT_MODE, HAS_FILTER, BY_INDEX, HAS_MASK, MASK_PARENTS, BLOCK_V,
        )  # fmt: skip
    redo = target_ok & ~(row_m_t < float("inf"))
    if DRAFT_MODE == DRAFT_LOGITS:
        redo = redo | (draft_ok & ~(row_m_q < float("inf")))
    bad_t = tl.zeros([BLOCK_R], tl.int32)
    if tl.max(redo.to(tl.int32), axis=0) > 0:
        e_m_t, e_z_t, e_g_max, e_g_idx, e_bad_t, e_m_q, e_z_q, e_bad_q = _row_pass_exact(
            t_rows, d_rows, tm_rows, dm_rows, redo & target_ok, redo & draft_ok, thr_t, thr_q, cut_t, cut_q, inv_t,
            start_col, end_col, DRAFT_MODE, BY_INDEX, HAS_MASK, MASK_PARENTS, BLOCK_V,
        )  # fmt: skip
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
def mask_rows(
    mask_ptr, parents_ptr, cu_ptr, b, k, i, ok, draft_ok, stride_mb, stride_mk, stride_mg, stride_pb, G,
    FLAT: tl.constexpr, MASK_PARENTS: tl.constexpr,
):  # fmt: skip
    """[R, 1] pointers to the mask rows (token_bitmask words) of the target and draft rows of records
    (b, k, i): target row i uses mask row i (flattened: the target's row cu[b] + b + i); draft row i
    the same row, or with MASK_PARENTS (verify_tree) row parents[b, i] + 1, clamped to [0, G] as
    ``_bitmask.tree_draft_mask`` clamps it (unchecked ids stay in range)."""
    base = mask_ptr + request_base(cu_ptr, b, ok, stride_mb, 1, FLAT) + k * stride_mk
    t_rows = base + i.to(tl.int64) * stride_mg
    d_rows = t_rows
    if MASK_PARENTS:
        par = tl.load(parents_ptr + b * stride_pb + i, mask=draft_ok & (i < G), other=-1)
        d_rows = base + (tl.minimum(tl.maximum(par, -1), G - 1) + 1).to(tl.int64) * stride_mg
    return t_rows[:, None], d_rows[:, None]


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
def prob_of(x, m, z, thr, inv_t, col, cut, BY_INDEX: tl.constexpr):
    """p(x) of the processed distribution given its statistics (0 for filtered or -inf logits); x
    is the entry at column col (``kept_at``)."""
    kept = kept_at(x, col, thr, cut, BY_INDEX) & (x > float("-inf")) & (z > 0.0)
    p = tl.exp((x - safe_max(m)) * inv_t) / tl.where(z > 0.0, z, 1.0)
    return tl.where(kept, p, 0.0)


@dataclass(frozen=True)
class RowPassLayout:
    """Where the row pass finds a call's rows: request b, chain k, row i of the target is at
    ``target + b * strides[0] + k * strides[1] + i * strides[2]`` (the draft's likewise, rows 0 .. G-1).
    Flattened layout (``cu``): the strides are row strides and request b starts at row cu[b] (+ b
    for the target: each request's bonus row)."""

    target: torch.Tensor  # [B, K, G+1, V] / [B, G+1, V] / flattened [N + B, V] fp32/fp16/bf16 raw logits
    draft: torch.Tensor | None  # draft logits / probs, the target's rows but the bonus row; None: DRAFT_NONE
    draft_mode: int  # DRAFT_NONE, DRAFT_LOGITS, DRAFT_PROBS
    B: int
    K: int  # chains per request (1 for verify; trees are K chains of G slots)
    G: int
    V: int
    target_strides: tuple[int, int, int]  # (request, chain, row), in elements
    draft_strides: tuple[int, int, int]  # (0, 0, 0) without a draft tensor
    counts: torch.Tensor | None = None  # [B] int: rows 0 .. n_b of request b hold data (drafts, nodes); None: G
    draft_tokens: torch.Tensor | None = None  # [B, G] (flattened: [N]) ids; a placeholder ends the chain (K = 1)
    cu: torch.Tensor | None = None  # [B+1] int64 offsets of the flattened layout (K = 1)
    use: torch.Tensor | None = None  # [rows, 2] int8: records whose target / draft row is read (trees)
    mask: torch.Tensor | None = None  # token_bitmask [B, (K,) G+1, W] int32 (flattened: [N + B, W]); None: no mask
    mask_strides: tuple[int, int, int] = (0, 0, 0)  # (request, chain, row) in words, as target_strides
    parents: torch.Tensor | None = None  # [B, N] (verify_tree with a mask): draft row i uses mask row parents[i] + 1

    @property
    def rows(self) -> int:
        return self.B * self.K * (self.G + 1)


@dataclass(frozen=True)
class RowPassPlan:
    """Tiles, vocabulary chunks of the statistics pass, and the threshold phases' plan."""

    tiles: TileSettings
    num_chunks: int
    chunk_size: int  # a multiple of tiles.block_v
    thresholds: ThresholdPlan


def row_pass_plan(
    layout: RowPassLayout,
    tiles: TileSettings,
    num_chunks: int,
    threshold_chunks: int | None = None,
    threshold_capacity: int | None = None,
) -> RowPassPlan:
    """The row pass over about `num_chunks` vocabulary chunks per row (``vocab_chunks``);
    threshold_chunks / threshold_capacity force the threshold phases' split (tests, ``threshold_plan``)."""
    chunks, chunk_size = vocab_chunks(layout.V, tiles.block_v, num_chunks)
    logits = layout.draft_mode == DRAFT_LOGITS
    tplan = threshold_plan(layout.target, layout.rows, layout.V, threshold_chunks, logits, threshold_capacity)
    return RowPassPlan(tiles, chunks, chunk_size, tplan)


class RowStats(NamedTuple):
    """The row pass's output: one whole-row record per (request, chain, row)."""

    stats: torch.Tensor  # [rows, 1, NUM_STATS] fp32
    idx: torch.Tensor  # [rows, 1, NUM_IDX] int32
    thr: torch.Tensor  # [rows, NUM_THR] fp32 thresholds (a [1, NUM_THR] placeholder without top-k / top-p)


def launch_row_stats(
    layout: RowPassLayout, sampling: SamplingParams, plan: RowPassPlan, logprobs=False, argmax_only=False, merge=True
) -> RowStats:
    """The row pass of a call: with top-k / top-p the threshold phases first (candidates per chunk,
    selection per row; ``launch_threshold_phases``), then the statistics pass over ``plan.num_chunks``
    chunks per row, merged into whole-row records when there are several. logprobs (return_logprobs,
    ``chain.launch_verify``): greedy rows get thresholds too, so their records score the logprobs
    at T = 1 with their top-k / top-p (``greedy_logprobs_filter``). argmax_only (all greedy, no
    logprobs: the consumer reads max / argmax and counts only): no sum-exp, draft row or thresholds.
    merge=False: the chunk records are returned as they are ([rows, C, ...]; the consumer merges)."""
    if argmax_only and logprobs:
        raise ValueError("internal error: argmax_only rows have no normaliser for logprobs")
    rows, V, dev = layout.rows, layout.V, layout.target.device
    has_filter = sampling.has_filter(V) and not argmax_only
    greedy_filter = logprobs and greedy_logprobs_filter(sampling, V)
    C, tplan = plan.num_chunks, plan.thresholds
    stats = torch.empty((rows, C, NUM_STATS_HOST), dtype=torch.float32, device=dev)
    idx = torch.empty((rows, C, NUM_IDX_HOST), dtype=torch.int32, device=dev)
    thr = torch.empty((rows if has_filter else 1, NUM_THR_HOST), dtype=torch.float32, device=dev)
    filter_buf, filter_int = tplan.scratch(rows, dev) if has_filter else (thr, thr)
    params = sampling.kernel_args(layout.target)
    t_ptr, t_val, per_req_t = params["temperature"]
    k_ptr, k_val, per_req_k = params["top_k"]
    p_ptr, p_val, per_req_p = params["top_p"]
    unused = layout.target  # pointer arguments whose constexpr switch is off are never read
    constexprs = dict(
        PER_REQ_N=layout.counts is not None,
        PER_REQ_T=per_req_t,
        PER_REQ_K=per_req_k,
        PER_REQ_P=per_req_p,
        DRAFT_MODE=DRAFT_NONE.value if argmax_only else layout.draft_mode,
        HAS_FILTER=has_filter,
        BY_INDEX=has_filter and (sampling.ties_by_index() or greedy_filter and ties_by_index_at_unit_t(sampling)),
        **tplan.constexprs,
        PLACEHOLDERS_END=layout.draft_tokens is not None,
        GP2=next_pow2(max(layout.G, 1)) if layout.draft_tokens is not None else 1,
        FLAT=layout.cu is not None,
        ROW_USE=layout.use is not None,
        HAS_MASK=layout.mask is not None,
        MASK_PARENTS=layout.mask is not None and layout.parents is not None,
        BLOCK_V=plan.tiles.block_v,
        LOGPROBS=greedy_filter,
        ARGMAX_ONLY=argmax_only,
    )

    def row_pass(phase: int, block_r: int, grid_chunks: int, chunks: int, chunk_size: int, num_warps: int) -> None:
        _verify_row_stats_kernel[(cdiv(rows, block_r), grid_chunks)](
            # pointers
            target_ptr=layout.target,  # [B, (K,) G+1, V]
            draft_ptr=layout.draft if layout.draft is not None else unused,  # [B, (K,) G, V]
            draft_tokens_ptr=layout.draft_tokens if layout.draft_tokens is not None else unused,  # [B, G]
            cu_ptr=layout.cu if layout.cu is not None else unused,  # [B+1]
            num_draft_ptr=layout.counts if layout.counts is not None else unused,  # [B]
            temperature_ptr=t_ptr,  # [B]
            top_k_ptr=k_ptr,  # [B]
            top_p_ptr=p_ptr,  # [B]
            stats_ptr=stats,  # [rows, C, NUM_STATS] out
            idx_ptr=idx,  # [rows, C, NUM_IDX] out
            thr_ptr=thr,  # [rows, NUM_THR] out
            filter_buf_ptr=filter_buf,  # fp32 scratch of the threshold phases
            filter_int_ptr=filter_int,  # int32 scratch of the threshold phases
            use_ptr=layout.use if layout.use is not None else filter_int,  # [rows, 2]
            mask_ptr=layout.mask if layout.mask is not None else unused,  # [B, (K,) G+1, W] int32
            parents_ptr=layout.parents if layout.parents is not None else unused,  # [B, N]
            # strides
            stride_tb=layout.target_strides[0],
            stride_tk=layout.target_strides[1],
            stride_tg=layout.target_strides[2],
            stride_db=layout.draft_strides[0],
            stride_dk=layout.draft_strides[1],
            stride_dg=layout.draft_strides[2],
            stride_xb=layout.draft_tokens.stride(0) if layout.draft_tokens is not None else 0,
            stride_mb=layout.mask_strides[0],
            stride_mk=layout.mask_strides[1],
            stride_mg=layout.mask_strides[2],
            stride_pb=layout.parents.stride(0) if layout.parents is not None else 0,
            # sizes
            B=layout.B,
            K=layout.K,
            G=layout.G,
            V=V,
            chunk_size=chunk_size,
            num_chunks=chunks,
            # scalars
            temperature=float(t_val),
            top_k=int(k_val),
            top_p=float(p_val),
            # constexprs
            PHASE=phase,
            BLOCK_R=block_r,
            **constexprs,
            num_warps=num_warps,
        )

    if has_filter:  # thresholds first (candidates per chunk, selection per row), then the statistics pass
        launch_threshold_phases(row_pass, tplan)
    tiles = plan.tiles
    row_pass(PHASE_STATS.value, tiles.block_r, C, C, plan.chunk_size, tiles.num_warps)
    if C > 1 and merge:  # merge the chunks once, not once per consumer program (each would loop over all C)
        rows_per_request = layout.K * (layout.G + 1)
        stats, idx = merge_chunk_stats(stats, idx, rows, rows_per_request, t_ptr, t_val, per_req_t)
    return RowStats(stats, idx, thr)
