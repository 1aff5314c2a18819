"""Merging the row pass's per-(row, vocabulary chunk) records into whole-row records: the pairwise
(max, sum-exp) merge, the chain accept kernel's launch-free read of one record per row, and the
merge kernel ``launch_row_stats`` runs when a row was split into several chunks.

The merge kernel reads every chunk of a tile of rows at once ([BLOCK_R, BLOCK_C] tiles: one memory
round trip per BLOCK_C chunks). A loop over the chunks, one record after the other, waits for a load
per chunk: on an H200 (2026-11-27, c23d175) that loop took 42 us for the 5 rows of B = 1, G = 4 at
V = 151,936 (about 90 chunks per row), 79% of the whole greedy call."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .helpers import cdiv, inverse_temperature, next_pow2, per_request, safe_max
from .records import (
    IDX_GREEDY,
    NUM_IDX,
    NUM_IDX_HOST,
    NUM_STATS,
    NUM_STATS_HOST,
    STAT_BAD_Q,
    STAT_BAD_T,
    STAT_GMAX,
    STAT_M_Q,
    STAT_M_T,
    STAT_Z_Q,
    STAT_Z_T,
)

MERGE_TILE = 4096  # records in one merge tile (BLOCK_R x BLOCK_C): 7 fp32 loads of 16 per thread at 8 warps
MERGE_MAX_CHUNKS = 512  # the widest chunk tile; more chunks per row loop over tiles of this width


@triton.jit
def combine_softmax(m, z, m_c, z_c, inv_t):
    """Merge a chunk's (max, sum-exp) into the running pair."""
    m_new = tl.maximum(m, m_c)
    ref = safe_max(m_new)
    z = z * tl.exp((m - ref) * inv_t) + z_c * tl.exp((m_c - ref) * inv_t)
    return m_new, z


@triton.jit
def combine_chunk_records(stats_ptr, idx_ptr, rows, ok, num_chunks, inv_t):
    """(m_t, z_t, m_q, z_q, greedy max, greedy index, non-finite counts of target and draft) of each
    row (rows, ok, inv_t: tiles of one shape) from its num_chunks chunk records, one after the other:
    the chain accept kernel's read of records the merge kernel has already merged (num_chunks = 1)."""
    m_t = tl.full(rows.shape, float("-inf"), tl.float32)
    z_t = tl.zeros(rows.shape, tl.float32)
    m_q = tl.full(rows.shape, float("-inf"), tl.float32)
    z_q = tl.zeros(rows.shape, tl.float32)
    g_max = tl.full(rows.shape, float("-inf"), tl.float32)
    g_idx = tl.zeros(rows.shape, tl.int32)
    bad_t = tl.zeros(rows.shape, tl.float32)
    bad_q = tl.zeros(rows.shape, tl.float32)
    for c in range(0, num_chunks):
        rec = (rows * num_chunks + c) * NUM_STATS
        cm_t = tl.load(stats_ptr + rec + STAT_M_T, mask=ok, other=float("-inf"))
        cz_t = tl.load(stats_ptr + rec + STAT_Z_T, mask=ok, other=0.0)
        cm_q = tl.load(stats_ptr + rec + STAT_M_Q, mask=ok, other=float("-inf"))
        cz_q = tl.load(stats_ptr + rec + STAT_Z_Q, mask=ok, other=0.0)
        c_gmax = tl.load(stats_ptr + rec + STAT_GMAX, mask=ok, other=float("-inf"))
        c_gidx = tl.load(idx_ptr + (rows * num_chunks + c) * NUM_IDX + IDX_GREEDY, mask=ok, other=0)
        bad_t += tl.load(stats_ptr + rec + STAT_BAD_T, mask=ok, other=0.0)
        bad_q += tl.load(stats_ptr + rec + STAT_BAD_Q, mask=ok, other=0.0)
        take = c_gmax > g_max  # strict: the earlier chunk keeps ties (lowest index)
        g_max = tl.where(take, c_gmax, g_max)
        g_idx = tl.where(take, c_gidx, g_idx)
        m_t, z_t = combine_softmax(m_t, z_t, cm_t, cz_t, inv_t)
        m_q, z_q = combine_softmax(m_q, z_q, cm_q, cz_q, inv_t)
    return m_t, z_t, m_q, z_q, g_max, g_idx, bad_t, bad_q


@triton.jit
def _tile_softmax(m, z, cm, cz, inv_t):
    """Fold a [BLOCK_R, BLOCK_C] tile of chunk (max, sum-exp) pairs into the running [BLOCK_R] pair."""
    m_c = tl.max(cm, 1)
    ref = safe_max(m_c)
    z_c = tl.sum(cz * tl.exp((cm - ref[:, None]) * inv_t[:, None]), 1)
    return combine_softmax(m, z, m_c, z_c, inv_t)


@triton.jit(do_not_specialize=["R", "num_chunks"])  # per-call scalars: triton/helpers.py
def _combine_row_stats_kernel(
    # pointers
    stats_ptr,  # [R, C, NUM_STATS] fp32: per-chunk statistics of the row pass
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
    BLOCK_C: tl.constexpr,  # chunks per tile (a power of two)
):
    """Merge the vocabulary chunks of the row pass into whole-row records, BLOCK_C chunks of BLOCK_R
    rows per step. The greedy index is the first chunk's among those holding the max (each chunk's
    own index is its lowest), as a left-to-right merge keeps it; NaN maxima never win."""
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
    for c0 in range(0, num_chunks, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)[None, :]
        tile_ok = ok[:, None] & (c < num_chunks)
        rec = rows[:, None] * num_chunks + c
        at = stats_ptr + rec * NUM_STATS
        cm_t = tl.load(at + STAT_M_T, mask=tile_ok, other=float("-inf"))
        cz_t = tl.load(at + STAT_Z_T, mask=tile_ok, other=0.0)
        cm_q = tl.load(at + STAT_M_Q, mask=tile_ok, other=float("-inf"))
        cz_q = tl.load(at + STAT_Z_Q, mask=tile_ok, other=0.0)
        c_gmax = tl.load(at + STAT_GMAX, mask=tile_ok, other=float("-inf"))
        c_gidx = tl.load(idx_ptr + rec * NUM_IDX + IDX_GREEDY, mask=tile_ok, other=0)
        bad_t += tl.sum(tl.load(at + STAT_BAD_T, mask=tile_ok, other=0.0), 1)
        bad_q += tl.sum(tl.load(at + STAT_BAD_Q, mask=tile_ok, other=0.0), 1)
        c_gmax = tl.where(c_gmax == c_gmax, c_gmax, float("-inf"))  # NaN never wins (nor in a loop)
        tile_max = tl.max(c_gmax, 1)
        hit = (c_gmax == tile_max[:, None]) & (tile_max[:, None] > float("-inf"))
        first = tl.min(tl.where(hit, c, num_chunks), 1)
        tile_idx = tl.sum(tl.where(c == first[:, None], c_gidx, 0), 1)
        take = tile_max > g_max  # strict: an earlier tile keeps ties (lowest index)
        g_max = tl.where(take, tile_max, g_max)
        g_idx = tl.where(take, tile_idx, g_idx)
        m_t, z_t = _tile_softmax(m_t, z_t, cm_t, cz_t, inv_t)
        m_q, z_q = _tile_softmax(m_q, z_q, cm_q, cz_q, inv_t)
    out = rows * NUM_STATS
    tl.store(out_stats_ptr + out + STAT_M_T, m_t, mask=ok)
    tl.store(out_stats_ptr + out + STAT_Z_T, z_t, mask=ok)
    tl.store(out_stats_ptr + out + STAT_M_Q, m_q, mask=ok)
    tl.store(out_stats_ptr + out + STAT_Z_Q, z_q, mask=ok)
    tl.store(out_stats_ptr + out + STAT_GMAX, g_max, mask=ok)
    tl.store(out_stats_ptr + out + STAT_BAD_T, bad_t, mask=ok)
    tl.store(out_stats_ptr + out + STAT_BAD_Q, bad_q, mask=ok)
    tl.store(out_idx_ptr + rows * NUM_IDX + IDX_GREEDY, g_idx, mask=ok)


def merge_tiles(rows: int, chunks: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of the merge kernel: every chunk of a row in one tile up to MERGE_MAX_CHUNKS,
    as many rows as fill MERGE_TILE records (at most 128: more programs for big batches)."""
    block_c = min(next_pow2(max(chunks, 1)), MERGE_MAX_CHUNKS)
    block_r = max(1, min(next_pow2(rows), MERGE_TILE // block_c, 128))
    return block_r, block_c


def merge_chunk_stats(stats, idx, rows: int, rows_per_request: int, t_ptr, t_val, per_req_t: bool):
    """Whole-row records [rows, 1, ...] from the row pass's per-chunk ones (one small launch)."""
    whole = torch.empty((rows, 1, NUM_STATS_HOST), dtype=torch.float32, device=stats.device)
    whole_idx = torch.empty((rows, 1, NUM_IDX_HOST), dtype=torch.int32, device=stats.device)
    block_r, block_c = merge_tiles(rows, stats.shape[1])
    _combine_row_stats_kernel[(cdiv(rows, block_r),)](
        # pointers
        stats_ptr=stats,  # [rows, C, NUM_STATS]
        idx_ptr=idx,  # [rows, C, NUM_IDX]
        out_stats_ptr=whole,  # [rows, 1, NUM_STATS]
        out_idx_ptr=whole_idx,  # [rows, 1, NUM_IDX]
        temperature_ptr=t_ptr,  # [B] (per_req_t)
        # sizes
        R=rows,
        ROWS_PER_REQUEST=rows_per_request,
        num_chunks=stats.shape[1],
        # scalars
        temperature=float(t_val),
        # constexprs
        PER_REQ_T=per_req_t,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=8 if block_r * block_c >= 2048 else 4,
    )
    return whole, whole_idx
