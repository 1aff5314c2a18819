"""Block verification (``method="block"``) inside the fused chain kernels (``chain.py``).

The rule of ``reference/block.py`` (Sun et al. 2024) on the row pass's records, as the CPU build
runs it (``csrc/verify_cpu.cpp``: block_decide): the weights

    w_0 = 1,  w_i = min(w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i), 1)

come from the drafts' p and q, which the accept kernel reads for the token rule anyway
(``_first_rejection``): a scan over the G positions in registers, in fp64 as the CPU build. The
stop probability of a position 1 <= i < n is h_i = r_i / (r_i + 1 - w_i) with the residual mass
r_i = sum_x max(w_i p_i(x) - q_i(x), 0): one more pass over row i. Since r_i <= w_i, h_i <= w_i,
and a position whose uniform eta_i (the token rule's accept uniform of position i - 1) exceeds w_i
cannot stop: only the others (``block_candidates``) are read. h_n = w_n needs no pass. tau = the
last position that stops (0 if none); the race of row tau is the token rule's race of row j with
the residual max(w_tau p - q, 0) (``_race_row_j``, WEIGHTED), over p_n when tau = n.

Two launches of the accept kernel instead of one (``launch_verify(..., method="block")``):

* BLOCK_MASS, grid (request tiles, vocabulary chunks): each program sums its chunk of
  max(w_i p_i - q_i, 0) for the candidate rows of its requests into ``mass[b, i, chunk]`` (fp64);
* BLOCK_RACE, the same grid: the chunk sums give r_i and tau, then the race of row tau as usual.

Greedy requests are the argmax chain under both rules (the token rule's j). A sampled request is
flagged by any of its rows 0 .. n (block verification reads them all). BLOCK_TOKEN compiles the
token rule's kernel unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .helpers import DRAFT_NONE, PURPOSE_ACCEPT, row_j_probs, row_j_view, select_row, uniform_open

BLOCK_TOKEN = tl.constexpr(0)  # the token rule (no block code compiled)
BLOCK_MASS = tl.constexpr(1)  # block verification, launch 1: residual masses of the candidate rows
BLOCK_RACE = tl.constexpr(2)  # block verification, launch 2: tau and the race of row tau
# Slack on h_i <= w_i (the CPU build's kBlockBoundSlack): the fp32 probabilities of a row sum to 1
# within ~1e-6, so r_i can exceed w_i by rounding; a position is skipped only when eta_i > w_i + this.
BLOCK_BOUND_SLACK = tl.constexpr(1e-5)


@triton.jit
def block_weights(p_tok, q_tok, i, ROWS: tl.constexpr):
    """w [BLOCK_B, ROWS] fp64 (column i = w_i) from the drafts' p(x_i) and q(x_i) (columns i - 1,
    fp32): ratio p / q (+inf for q = 0 < p, 0 for p = 0), w stays 0 once 0."""
    p = p_tok.to(tl.float64)
    q = q_tok.to(tl.float64)
    ratio = tl.where(p > 0.0, tl.where(q > 0.0, p / tl.where(q > 0.0, q, 1.0), float("inf")), 0.0)
    w_prev = tl.full([p_tok.shape[0]], 1.0, tl.float64)
    w = tl.where(i == 0, 1.0, 0.0).to(tl.float64) + tl.zeros(p.shape, tl.float64)
    for k in tl.static_range(ROWS - 1):
        r_k = tl.sum(tl.where(i == k, ratio, 0.0), axis=1)
        w_prev = tl.where(w_prev > 0.0, tl.minimum(w_prev * r_k, 1.0), 0.0)
        w = tl.where(i == k + 1, w_prev[:, None], w)
    return w


@triton.jit
def block_candidates(w, seed, i, n_b, need):
    """(candidates, eta) [BLOCK_B, ROWS]: eta_i = the accept uniform of position i - 1 (fp64);
    candidates = the positions 1 <= i < n_b of the requests `need` whose stop probability must be
    computed (eta_i <= w_i + slack, w_i > 0: h_i <= w_i)."""
    eta = uniform_open(seed[:, None], i * 0, i - 1, PURPOSE_ACCEPT).to(tl.float64)
    inner = need[:, None] & (i >= 1) & (i < n_b[:, None])
    return inner & (w > 0.0) & (eta <= w + BLOCK_BOUND_SLACK), eta


@triton.jit
def _row_mass(
    target_ptr, draft_ptr, mask_ptr, t_base, d_base, m_base, stride_tg, stride_dg, stride_mg, i, k, need, w, tok, m_t,
    z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q, inv_t, start_col, end_col, DRAFT_MODE: tl.constexpr,
    BY_INDEX: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """sum over [start_col, end_col) of max(w_k p_k(x) - q_k(x), 0), row k (a [BLOCK_B] vector) of
    the requests `need` (0 elsewhere), fp64 (one-hot drafts: q_k = 1 at the draft id)."""
    BLOCK_B: tl.constexpr = need.shape[0]
    w_k = select_row(w, i, k)[:, None]
    tok_k, tk_row, dk_row, mk_row, c, mk_t, inv_zt, thrk_t, cutk_t, mk_q, inv_zq, thrk_q, cutk_q = row_j_view(
        target_ptr, draft_ptr, mask_ptr, t_base, d_base, m_base, stride_tg, stride_dg, stride_mg, i, k, tok, m_t, z_t,
        thr_t, cut_t, m_q, z_q, thr_q, cut_q, inv_t,
    )  # fmt: skip
    acc = tl.zeros([BLOCK_B, BLOCK_V], tl.float64)
    for start in range(start_col, end_col, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)[None, :]
        lane_ok = need[:, None] & (cols < end_col)
        p, q = row_j_probs(
            tk_row, dk_row, mk_row, start, end_col, need, lane_ok, lane_ok, c, mk_t, inv_zt, thrk_t, cutk_t, mk_q,
            inv_zq, thrk_q, cutk_q, DRAFT_MODE, BY_INDEX, HAS_MASK, BLOCK_V,
        )  # fmt: skip
        q64 = q.to(tl.float64)
        if DRAFT_MODE == DRAFT_NONE:
            q64 = tl.where(cols == tok_k[:, None], 1.0, 0.0).to(tl.float64)
        acc += tl.maximum(w_k * p.to(tl.float64) - q64, 0.0)  # lanes outside lane_ok: p = 0
    return tl.sum(acc, axis=1)


@triton.jit
def block_masses(
    mass_ptr, target_ptr, draft_ptr, mask_ptr, t_base, d_base, m_base, stride_tg, stride_dg, stride_mg, i, cand, w,
    tok, m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q, inv_t, b, b_ok, G, chunk, num_chunks, start_col, end_col,
    DRAFT_MODE: tl.constexpr, BY_INDEX: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Launch BLOCK_MASS: mass[b, k, chunk] = this chunk's part of r_k for every row 1 <= k < G
    (0 where k is no candidate: no pass over that row)."""
    cand_i = cand.to(tl.int32)
    for k in range(1, G):
        at = tl.zeros(b.shape, tl.int32) + k
        need = select_row(cand_i, i, at) > 0
        r = tl.zeros(b.shape, tl.float64)
        if tl.max(need.to(tl.int32), axis=0) > 0:
            r = _row_mass(
                target_ptr, draft_ptr, mask_ptr, t_base, d_base, m_base, stride_tg, stride_dg, stride_mg, i, at, need,
                w, tok, m_t, z_t, thr_t, cut_t, m_q, z_q, thr_q, cut_q, inv_t, start_col, end_col, DRAFT_MODE,
                BY_INDEX, HAS_MASK, BLOCK_V,
            )  # fmt: skip
        tl.store(mass_ptr + (b * G + k) * num_chunks + chunk, r, mask=b_ok)


@triton.jit
def block_tau(mass_ptr, b, i, cand, w, eta, n_b, G, num_chunks):
    """Launch BLOCK_RACE: tau [BLOCK_B] = the last position 1 <= i <= n_b that stops (eta_i <= h_i,
    h_i = r_i / (r_i + 1 - w_i) with r_i the chunk sums of ``block_masses``; h_n = w_n), 0 if none."""
    r = tl.zeros(w.shape, tl.float64)
    for c in range(0, num_chunks):
        r += tl.load(mass_ptr + (b[:, None] * G + i) * num_chunks + c, mask=cand, other=0.0)
    h = tl.where(r > 0.0, r / tl.where(r > 0.0, r + 1.0 - w, 1.0), 0.0)
    last = i == n_b[:, None]
    stop = tl.where(last, eta <= w, cand & (eta <= h) & (r > 0.0)) & (i >= 1) & (i <= n_b[:, None])
    return tl.max(tl.where(stop, i, 0), axis=1)
