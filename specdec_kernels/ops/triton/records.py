"""The records of the row pass, which the chain and tree kernels read: per-(row, chunk) statistics
(``STAT_*``), indices (``IDX_*``), top-k/top-p thresholds (``THR_*``, ``CUT_*``), and the phases of the
row-stats kernel (``PHASE_*``). Each record is NUM_* values long; the host allocates ``NUM_*_HOST``."""

import triton
import triton.language as tl

from .helpers import DRAFT_LOGITS

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
def load_thresholds(
    thr_rec, t_mask, q_mask, HAS_FILTER: tl.constexpr, DRAFT_MODE: tl.constexpr, BY_INDEX: tl.constexpr
):
    """(thr_t, cut_t, thr_q, cut_q) from threshold records thr_rec (pointers to NUM_THR values, any
    shape): the target's where t_mask, the draft's where q_mask (DRAFT_LOGITS); elsewhere, and
    without HAS_FILTER, threshold -inf and cut 0 (every entry kept)."""
    thr_t = tl.full(t_mask.shape, float("-inf"), tl.float32)
    thr_q = tl.full(t_mask.shape, float("-inf"), tl.float32)
    cut_t = tl.zeros(t_mask.shape, tl.int32)
    cut_q = tl.zeros(t_mask.shape, tl.int32)
    if HAS_FILTER:
        thr_t = tl.load(thr_rec + THR_T, mask=t_mask, other=float("-inf"))
        cut_t = load_cut(thr_rec + CUT_T, t_mask, BY_INDEX)
        if DRAFT_MODE == DRAFT_LOGITS:
            thr_q = tl.load(thr_rec + THR_Q, mask=q_mask, other=float("-inf"))
            cut_q = load_cut(thr_rec + CUT_Q, q_mask, BY_INDEX)
    return thr_t, cut_t, thr_q, cut_q
