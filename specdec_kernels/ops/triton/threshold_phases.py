"""The top-k / top-p threshold phases of the row pass: the launches of ``_verify_row_stats_kernel``
that run before its statistics pass when a call filters (``threshold_phases``), their launch plan
(``threshold_plan``, ``ThresholdPlan``) and ``launch_threshold_phases``. The selections themselves
(candidates, selection among them, bisection, tie cuts) are the device functions of ``thresholds``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..._interpreter import multiprocessors, plans_for_interpreter
from .helpers import DRAFT_LOGITS, cdiv, next_pow2
from .launch import num_warps
from .records import (
    CUT_OF_THR,
    PHASE_CANDIDATES,
    PHASE_SELECT,
    PHASE_WHOLE,
    THR_Q,
    THR_T,
    store_cut,
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


@triton.jit
def threshold_phases(
    t_rows,  # [R, 1] pointers to the target rows
    d_rows,  # [R, 1] pointers to the draft rows (DRAFT_LOGITS)
    tm_rows,  # [R, 1] pointers to the target rows' mask rows (HAS_MASK: token_bitmask words)
    dm_rows,  # [R, 1] pointers to the draft rows' mask rows (HAS_MASK)
    rows,  # [R] int64 the rows' records (flattened row index)
    t_ok,  # [R] target rows that sample (greedy rows never filter)
    d_ok,  # [R] draft rows that sample
    thr_rec,  # [R] pointers: the rows' threshold records (NUM_THR fp32 each)
    filter_buf_ptr,  # fp32 scratch (``ThresholdPlan.scratch``)
    filter_int_ptr,  # int32 scratch
    RS, TC, CW, V, inv_t, top_k, top_p,
    PHASE: tl.constexpr, DRAFT_MODE: tl.constexpr, FILTER_BLOCK: tl.constexpr, FILTER_CAP: tl.constexpr,
    FILTER_BINS: tl.constexpr, FILTER_CHUNKS: tl.constexpr, T_SHIFT: tl.constexpr, T_GROUP: tl.constexpr,
    D_SHIFT: tl.constexpr, D_GROUP: tl.constexpr, BY_INDEX: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """The threshold phases of the row-stats kernel (RS scratch slots, TC threshold chunks of CW
    entries): PHASE_WHOLE, the interpreter's plan, takes BLOCK_R whole rows per program, target then
    draft (``_whole_rows``); the GPU plan's PHASE_CANDIDATES / PHASE_SELECT take one row per program,
    axis 1 = (program of the row) x W + (0: target, 1: draft; W = 2 with draft logits)."""
    if PHASE == PHASE_WHOLE:
        _whole_rows(
            t_rows, tm_rows, rows * 2, t_ok, thr_rec + THR_T, filter_buf_ptr, V, inv_t, top_k, top_p, FILTER_BLOCK,
            FILTER_CAP, FILTER_BINS, BY_INDEX, HAS_MASK,
        )  # fmt: skip
        if DRAFT_MODE == DRAFT_LOGITS:
            _whole_rows(
                d_rows, dm_rows, rows * 2 + 1, d_ok, thr_rec + THR_Q, filter_buf_ptr, V, inv_t, top_k, top_p,
                FILTER_BLOCK, FILTER_CAP, FILTER_BINS, BY_INDEX, HAS_MASK,
            )  # fmt: skip
    else:
        chunk = tl.program_id(1)
        part = chunk
        parts = tl.num_programs(1)
        which = chunk * 0
        if DRAFT_MODE == DRAFT_LOGITS:
            which = chunk % 2
            part = chunk // 2
            parts = parts // 2
        if DRAFT_MODE != DRAFT_LOGITS:
            _threshold_phase(
                t_rows, tm_rows, rows * 2, t_ok, thr_rec + THR_T, filter_buf_ptr, filter_int_ptr, RS, TC, part, parts,
                CW, V, inv_t, top_k, top_p, PHASE, FILTER_BLOCK, FILTER_CAP, FILTER_BINS, FILTER_CHUNKS, T_SHIFT,
                T_GROUP, BY_INDEX, HAS_MASK,
            )  # fmt: skip
        elif D_SHIFT == T_SHIFT:  # same dtype: one copy of the code, the rows picked by `which`
            is_d = which == 1
            _threshold_phase(
                tl.where(is_d, d_rows, t_rows), tl.where(is_d, dm_rows, tm_rows), rows * 2 + which,
                tl.where(is_d, d_ok, t_ok), thr_rec + which, filter_buf_ptr, filter_int_ptr, RS, TC, part, parts, CW, V,
                inv_t, top_k, top_p, PHASE, FILTER_BLOCK, FILTER_CAP, FILTER_BINS, FILTER_CHUNKS, T_SHIFT, T_GROUP,
                BY_INDEX, HAS_MASK,
            )  # fmt: skip
        elif which == 0:
            _threshold_phase(
                t_rows, tm_rows, rows * 2, t_ok, thr_rec + THR_T, filter_buf_ptr, filter_int_ptr, RS, TC, part, parts,
                CW, V, inv_t, top_k, top_p, PHASE, FILTER_BLOCK, FILTER_CAP, FILTER_BINS, FILTER_CHUNKS, T_SHIFT,
                T_GROUP, BY_INDEX, HAS_MASK,
            )  # fmt: skip
        else:  # draft logits of another dtype than the target's
            _threshold_phase(
                d_rows, dm_rows, rows * 2 + 1, d_ok, thr_rec + THR_Q, filter_buf_ptr, filter_int_ptr, RS, TC, part,
                parts, CW, V, inv_t, top_k, top_p, PHASE, FILTER_BLOCK, FILTER_CAP, FILTER_BINS, FILTER_CHUNKS, D_SHIFT,
                D_GROUP, BY_INDEX, HAS_MASK,
            )  # fmt: skip


@triton.constexpr_function
def key_shift(ty):
    """Low bits of the float32 order key that are the same for every value of dtype ty (bf16: 16,
    fp16: 13, fp32: 0): the selections bisect only the others."""
    return 16 if ty == tl.bfloat16 else (13 if ty == tl.float16 else 0)


@triton.jit
def _candidate_chunks(
    row, mask_row, cand, rec, tau, active, part, parts, TC, CW, V, inv_t, BLOCK, CAP, NB, E: tl.constexpr,
    WITH_Z: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """Chunks part, part + parts, ... of one row: candidates, (max, sum-exp) and bound of each."""
    for c in range(part, TC, parts):
        start = c * CW
        m, z, bound = chunk_candidates(
            row,
            cand + c * CAP,
            active,
            start,
            tl.minimum(start + CW, V),
            inv_t,
            BLOCK,
            CAP,
            NB,
            E,
            WITH_Z,
            mask_row,
            HAS_MASK,
        )
        tl.store(rec + c * 2, m, mask=active)
        tl.store(rec + c * 2 + 1, z, mask=active)
        tl.store(tau + c, bound, mask=active)


@triton.constexpr_function
def candidate_group(ty):
    """Entries of one 16-byte vector of dtype ty: the candidate groups (bf16 / fp16: 8, fp32: 4)."""
    return 128 // ty.primitive_bitwidth


@triton.constexpr_function
def fallback_block(block):
    return min(block, 2048)


@triton.jit
def _whole_rows(
    row_ptrs,  # [R, 1] pointers to the rows (target or draft)
    mask_rows,  # [R, 1] pointers to their mask rows (HAS_MASK)
    slot,  # [R] scratch slot of each row: 2 * row (+ 1 for the draft)
    ok,  # [R] rows that sample (greedy rows never filter)
    thr_out,  # [R] pointers: where the thresholds go
    filter_buf_ptr,  # fp32 scratch: candidates [2R, CAP]
    V, inv_t, top_k, top_p, BLOCK: tl.constexpr, CAP: tl.constexpr, NB_BITS: tl.constexpr, BY_INDEX: tl.constexpr,
    HAS_MASK: tl.constexpr,
):  # fmt: skip
    """PHASE_WHOLE: the thresholds of R whole rows in one program (``filter_threshold``: key
    histogram -> pivot, copy of the candidates, selection among them; bisection when they overflow
    CAP). The interpreter's plan: it pays per operation, so many rows per program are cheap."""
    cand = filter_buf_ptr + slot.to(tl.int64) * CAP
    thr, _fast, need = filter_threshold_ties(
        row_ptrs, cand[:, None], ok, V, inv_t, top_k, top_p, BLOCK, CAP, NB_BITS, BY_INDEX, mask_rows, HAS_MASK
    )
    tl.store(thr_out, thr, mask=ok)
    if BY_INDEX:
        store_cut(thr_out + CUT_OF_THR, tie_index(row_ptrs, need, thr, V, BLOCK, mask_rows, HAS_MASK), ok)


@triton.jit
def _threshold_phase(
    row_ptrs,  # row_ptrs, mask_rows, slot, ok, thr_out: as for _whole_rows
    mask_rows,
    slot,
    ok,
    thr_out,
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
    HAS_MASK: tl.constexpr,
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
            mask_row = tl.reshape(mask_rows, [1])
            if tl.max((use_p & ~use_k).to(tl.int32), axis=0) > 0:  # top-p alone: the row's sum-exp too
                _candidate_chunks(
                    row, mask_row, cand, rec, tau, active, part, parts, TC, CW, V, inv_t, BLOCK, CAP, NB, E, True,
                    HAS_MASK,
                )  # fmt: skip
            else:
                _candidate_chunks(
                    row, mask_row, cand, rec, tau, active, part, parts, TC, CW, V, inv_t, BLOCK, CAP, NB, E, False,
                    HAS_MASK,
                )  # fmt: skip
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
                    row_ptrs, slow, V, inv_t, top_k, top_p, fallback_block(BLOCK), True, mask_rows, HAS_MASK
                )
                thr = tl.where(slow, exact, thr)
                need = tl.where(slow, exact_need, need)
        tl.store(thr_out, thr, mask=ok)
        cut = tie_index(row_ptrs, need, thr, V, fallback_block(BLOCK), mask_rows, HAS_MASK)
        store_cut(thr_out + CUT_OF_THR, cut, ok)
    else:  # PHASE_SELECT (the keep rule: no tie count carried through the branches)
        thr = tl.full(inv_t.shape, float("-inf"), tl.float32)
        if tl.max(active.to(tl.int32), axis=0) > 0:
            thr, fast = select_candidates(cand, rec, tau, TC, ok, V, inv_t, top_k, top_p, TCP2, CAP, NB, SHIFT)
            slow = active & ~fast
            if tl.max(slow.to(tl.int32), axis=0) > 0:
                exact = bisect_threshold(
                    row_ptrs, slow, V, inv_t, top_k, top_p, fallback_block(BLOCK), mask_rows, HAS_MASK
                )
                thr = tl.where(slow, exact, thr)
        tl.store(thr_out, thr, mask=ok)


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


# candidate slots of a row in the selection tile (chunks x slots per chunk) on a GPU: 4096 lets
# V = 151,936 split into 8,192-entry chunks (19 -> 32 x 128 slots); with 2048 only 16,384-entry chunks fit
SELECT_SLOTS = 4096
CANDIDATE_BINS = 256  # bins of the candidate histograms: key16 steps below the max
MIN_GROUPS = 16  # candidate groups per chunk (fewer: the union of the chunks rarely holds top-k 50)
# the widest candidates chunk: 32 entries per thread at 8 warps. 16,384 (64 per thread) compiled to 177
# registers under Triton 3.9 and 255 with 140 spilled bytes under 3.6; on an H200 (Triton 3.6) the
# top-k + top-p call took 6.2 ms at B = 64 against a 150 us estimate (2026-11-27, c23d175)
MAX_CANDIDATE_CHUNK = 8192


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
        for width in (1024, 2048, 4096, MAX_CANDIDATE_CHUNK):
            tc = cdiv(V, width)
            if next_pow2(tc) * 8 * MIN_GROUPS > capacity and width < MAX_CANDIDATE_CHUNK:
                continue
            cost = math.ceil(rows * slots * tc / sms) * (width + 1024)
            if best is None or cost < best[0]:
                best = (cost, width)
        width = best[1] if chunks is None else next_pow2(cdiv(V, chunks))
        warps = num_warps(width, 32)  # at most 32 entries of the chunk per thread
        capacity = min(capacity, next_pow2(cdiv(V, width)) * 8 * MIN_GROUPS)  # no bigger tile than needed
    tc = cdiv(V, width)
    tcp2 = next_pow2(tc)
    cap = max(8, capacity // tcp2)
    constexprs = dict(FILTER_BLOCK=width, FILTER_CAP=cap, FILTER_BINS=CANDIDATE_BINS, FILTER_CHUNKS=tcp2)
    select_warps = num_warps(tcp2 * cap, 32, fewest=2)  # at most 32 candidates per thread (2 warps: 2048)
    return ThresholdPlan(tc, width, tc, slots, warps, select_warps, constexprs)
