"""Device functions shared by the verification kernels.

Conventions (shared with ``specdec_kernels.reference``):

* Random numbers: ``tl.philox`` keyed by the request's 64-bit seed with counter
  ``(c0, c1, c2, 0)`` = (vocab index or 0, draft row, purpose). A number is therefore a pure
  function of (seed, row, purpose, index): batch size, batch order and other requests never
  change it, and the reference replays it bit for bit.
* Uniforms lie strictly inside (0, 1) (23 bits, exact in fp32): a uniform of 0 would accept a
  token with target probability 0, a uniform of 1 would give an exponential of 0.
* Logits are loaded as fp32 and *sanitised*: NaN and +inf become -inf (never sampled, never
  accepted) and are counted so the request can be flagged.
* Draft probabilities are loaded as fp32 with unusable entries (NaN, +inf, negative) replaced by 0,
  counted the same way (``load_probs``).
* Per-call scalars are not specialised: kernel arguments whose value changes from call to call
  in a serving process (batch size B and the row and chunk counts derived from it, seeds, a scalar
  top-k, round indices, the KV length S, split counts) are listed in the decorators'
  ``do_not_specialize``. Triton would otherwise compile another variant for a value of 1 (made a
  constant) or a multiple of 16 (an alignment hint), and a serving process would stall mid-stream
  on a fresh compile. Seeds are also annotated ``tl.int64``: a small seed would otherwise be passed
  as i32 and a large one as i64 (two variants). Values fixed by the model and the configuration
  (V, G, N, D, strides, chunk widths that are multiples of the block) stay specialised, and tile
  sizes are constexpr (``tests/ops/test_specialisation.py``).
"""

import inspect

import triton
import triton.language as tl

from ... import _bitmask, _params, _types
from ...reference import sampling as _reference

# Draft modes as kernel constants (values from specdec_kernels._types).
DRAFT_NONE = tl.constexpr(_types.DRAFT_NONE)
DRAFT_LOGITS = tl.constexpr(_types.DRAFT_LOGITS)
DRAFT_PROBS = tl.constexpr(_types.DRAFT_PROBS)

# Purposes: third Philox counter word (values from the reference). Different purposes never share
# a random number.
PURPOSE_ACCEPT = tl.constexpr(_reference.PURPOSE_ACCEPT)
PURPOSE_RECOVER = tl.constexpr(_reference.PURPOSE_RECOVER)
PURPOSE_BONUS = tl.constexpr(_reference.PURPOSE_BONUS)

# Temperatures below this (or NaN) are greedy (value and reason: specdec_kernels._params).
MIN_TEMPERATURE = tl.constexpr(_params.MIN_TEMPERATURE)

NEG_INF = tl.constexpr(float("-inf"))

# Approximate fp32 division: Triton >= 3.7 spells it tl.fdiv(..., approx=True); older releases have
# no `approx` and their non-IEEE fdiv (ieee_rounding=False) is the fast one. See fast_div.
FDIV_HAS_APPROX = tl.constexpr("approx" in inspect.signature(tl.fdiv).parameters)

# The floor under a positive residual weight before its log, as csrc's 1e-38f (verify_core.h): only
# subnormal weights move. Subnormal in fp32, so Triton reads the bare Python float as an fp64 constant
# (promoting the whole expression, which breaks loop-carried fp32 values): log_floored builds it as fp32.
LOG_FLOOR = tl.constexpr(1e-38)


@triton.jit
def fast_div(x, y):
    """x / y in fp32 without correct rounding (a few ulp), on every supported Triton release."""
    if FDIV_HAS_APPROX:
        q = tl.fdiv(x, y, approx=True)
    else:
        q = tl.fdiv(x, y, ieee_rounding=False)
    return q


@triton.jit
def log_floored(w):
    """log(max(w, 1e-38)) in fp32 (csrc's logf(w > 1e-38f ? w : 1e-38f))."""
    return tl.log(tl.maximum(w, tl.full(w.shape, LOG_FLOOR, tl.float32)))


@triton.jit
def uniform_open(seed, c0, c1, c2):
    """Uniform in (0, 1) from Philox(seed; c0, c1, c2, 0); arguments broadcast."""
    zero = tl.zeros_like(c0).to(tl.int32)
    c0 = (zero + c0).to(tl.uint32)
    c1 = (zero + c1).to(tl.uint32)
    c2 = (zero + c2).to(tl.uint32)
    bits, _, _, _ = tl.philox(seed, c0, c1, c2, c0 * 0)
    k = (bits >> 9).to(tl.float32)
    return (k + 0.5) * 1.1920928955078125e-07  # 2**-23


@triton.jit
def race_uniforms(seed, start, c1, c2, BLOCK_V: tl.constexpr):
    """Uniforms in (0, 1) of the vocabulary entries x in [start, start + BLOCK_V): one Philox call
    serves four entries, entry x uses word x % 4 of Philox(seed; x // 4, c1, c2, 0) (start a
    multiple of 4). seed, c1: [R, 1]; result [R, BLOCK_V]."""
    quad = start // 4 + tl.arange(0, BLOCK_V // 4)[None, :]
    zero = tl.zeros_like(c1 + quad).to(tl.int32)
    c0 = (zero + quad).to(tl.uint32)
    w0, w1, w2, w3 = tl.philox(seed, c0, (zero + c1).to(tl.uint32), (zero + c2).to(tl.uint32), c0 * 0)
    bits = tl.interleave(tl.interleave(w0, w2), tl.interleave(w1, w3))  # word x % 4 at column x
    u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    return u


@triton.jit
def race_noise(seed, start, c1, c2, BLOCK_V: tl.constexpr):
    """-log(E_x), E_x ~ Exp(1), for the vocabulary entries x in [start, start + BLOCK_V).

    Adding it to log r(x) and taking the argmax samples norm(r) (exponential race / Gumbel-max)
    with no normalisation and no inverse CDF. One Philox call serves four entries: entry x uses
    word x % 4 of Philox(seed; x // 4, c1, c2, 0) (start must be a multiple of 4). Philox is the
    arithmetic-heavy part of a race, so this quarters the work. seed, c1: [R, 1]; result [R, BLOCK_V].
    """
    u = race_uniforms(seed, start, c1, c2, BLOCK_V)
    return -tl.log(-tl.log(u))


@triton.jit
def race_inv_exp(seed, start, c1, c2, BLOCK_V: tl.constexpr):
    """1 / E_x, E_x = -log(u_x) ~ Exp(1), with the uniforms of ``race_noise``: argmax r(x) / E_x
    is the winner of argmax log r(x) + race_noise, without two logs per entry."""
    u = race_uniforms(seed, start, c1, c2, BLOCK_V)
    return fast_div(tl.full(u.shape, -1.0, tl.float32), tl.log(u))  # 1/E itself needs no correct rounding


@triton.jit
def load_logits(ptrs, mask, allowed=None):
    """fp32 logits with NaN / +inf replaced by -inf; also returns the mask of replaced entries.
    allowed (token_bitmask bits, ``allowed_tile``): -inf where False before the check (a NaN at a
    disallowed entry is not counted, as in the masked copy)."""
    x = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
    bad = (x != x) | (x == float("inf"))
    if allowed is not None:  # one select: the bit joins the finiteness test's predicate
        bad = bad & allowed
        return tl.where(bad | ~allowed, float("-inf"), x), bad
    return tl.where(bad, float("-inf"), x), bad


BITS_PER_WORD = tl.constexpr(_bitmask.BITS_PER_WORD)  # token_bitmask: token bits per int32 word
WORD_SHIFT = tl.constexpr(_bitmask.BITS_PER_WORD.bit_length() - 1)  # log2(BITS_PER_WORD): column >> it = word


@triton.jit
def allowed_at(mask_rows, cols, ok, HAS_MASK: tl.constexpr):
    """``ok``, and with HAS_MASK only where the grammar words allow the columns: bit cols % 32 of
    word cols // 32 of the mask row at ``mask_rows`` (int32 words, ``_bitmask``; any broadcastable
    shapes). Loading a row under this mask with other=-inf gives the masked copy's -inf (a NaN at a
    disallowed column is never seen, as there)."""
    if HAS_MASK:
        words = tl.load(mask_rows + cols // BITS_PER_WORD, mask=ok, other=0)
        ok = ok & (((words >> (cols % BITS_PER_WORD)) & 1) != 0)  # bit 31: sign-extended, & 1 still reads it
    return ok


@triton.jit
def allowed_tile(mask_rows, start, end, row_ok, BLOCK_V: tl.constexpr, HAS_MASK: tl.constexpr, also_rows=None):
    """[R, BLOCK_V] bits of the grammar words at the columns start + arange(BLOCK_V) of R mask rows
    (``mask_rows``: [R, 1] pointers; rows where ``row_ok``, columns < end), True everywhere without
    HAS_MASK; with ``also_rows`` (pointers as mask_rows) the AND of both rows' bits (one expansion).
    The hot loops' form of ``allowed_at``: one word load per 32 columns, the bits expanded in
    registers (a word per lane group instead of a load and a 64-bit address per entry); start is a
    non-negative multiple of BLOCK_V (chunks are whole tiles), so of 32 when BLOCK_V >= 32 (a shift,
    not a signed division). Apply the bits after a load (``where``, ``load_logits(..., allowed)``, or
    folded into a predicate the loop has anyway), not in its mask: the row loads stay vectorised."""
    R: tl.constexpr = mask_rows.shape[0]
    cols = start + tl.arange(0, BLOCK_V)[None, :]
    bits = tl.full([R, BLOCK_V], 1, tl.int1)
    if HAS_MASK:
        if BLOCK_V >= BITS_PER_WORD:
            WORDS: tl.constexpr = BLOCK_V // BITS_PER_WORD
            w = (start >> WORD_SHIFT.value) + tl.arange(0, WORDS)[None, :]
            ok = row_ok[:, None] & (w < ((end + BITS_PER_WORD - 1) >> WORD_SHIFT.value))
            words = tl.load(mask_rows + w, mask=ok, other=0)
            if also_rows is not None:
                words = words & tl.load(also_rows + w, mask=ok, other=0)
            lane_bit = 1 << tl.arange(0, BITS_PER_WORD)[None, None, :]  # loop-invariant: one AND per entry
            bits = tl.reshape((words[:, :, None] & lane_bit) != 0, [R, BLOCK_V])
        else:
            bits = allowed_at(mask_rows, cols, row_ok[:, None] & (cols < end), HAS_MASK)
            if also_rows is not None:
                bits = bits & allowed_at(also_rows, cols, row_ok[:, None] & (cols < end), HAS_MASK)
    return bits


@triton.jit
def load_probs(ptrs, mask):
    """fp32 draft probabilities with NaN / +inf / negative entries replaced by 0 (no probability:
    the accept ratio and the residual treat them as 0); also returns the mask of replaced entries."""
    q = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    bad = ~((q >= 0.0) & (q < float("inf")))  # NaN fails both comparisons
    return tl.where(bad, 0.0, q), bad


@triton.jit
def select_row(vals, rows_i, j):
    """vals[b, j[b]] for a [BLOCK_B, ROWS] tile (a gather along the small row axis)."""
    return tl.sum(tl.where(rows_i == j[:, None], vals, 0), axis=1)


@triton.jit
def kept_prob(x, m, c, inv_z, thr, cols, cut, BY_INDEX: tl.constexpr):
    """p(x) from the row statistics: 2^((x - m) c) / z for kept finite x, else 0 (NaN, +inf, -inf
    and filtered entries). m: safe row max, c = log2(e) / T, inv_z = 1 / z (0 for an empty row);
    x at columns cols (``kept_at``)."""
    kept = kept_at(x, cols, thr, cut, BY_INDEX) & (x > float("-inf")) & (x < float("inf"))
    return tl.where(kept, tl.exp2((x - m) * c) * inv_z, 0.0)


@triton.jit
def row_j_view(
    target_ptr, draft_ptr, mask_ptr, t_base, d_base, m_base, stride_tg, stride_dg, stride_mg, i, j, tok, m_t, z_t,
    thr_t, cut_t, m_q, z_q, thr_q, cut_q, inv_t,
):  # fmt: skip
    """Row j of each request, for a pass over its entries (``row_j_probs``): the draft id there, the
    [BLOCK_B, 1] pointers to the target, draft and mask rows, and the row's statistics picked from
    the [BLOCK_B, ROWS] tiles (columns i) as [BLOCK_B, 1] columns: c = log2(e) / T, then the safe
    max, 1 / z (0 for an empty row), threshold and cut of the target and of the draft."""
    tok_j = select_row(tok, i, j)
    thrj_t = select_row(thr_t, i, j)[:, None]
    thrj_q = select_row(thr_q, i, j)[:, None]
    cutj_t = select_row(cut_t, i, j)[:, None]
    cutj_q = select_row(cut_q, i, j)[:, None]
    mj_t = safe_max(select_row(m_t, i, j))[:, None]
    mj_q = safe_max(select_row(m_q, i, j))[:, None]
    zj_t = select_row(z_t, i, j)
    zj_q = select_row(z_q, i, j)
    tj_row = target_ptr + t_base[:, None] + j[:, None].to(tl.int64) * stride_tg
    dj_row = draft_ptr + d_base[:, None] + j[:, None].to(tl.int64) * stride_dg
    mj_row = mask_ptr + m_base[:, None] + j[:, None].to(tl.int64) * stride_mg  # target and draft row j's words
    c = (inv_t * LOG2E)[:, None]
    inv_zt = tl.where(zj_t > 0.0, 1.0 / tl.where(zj_t > 0.0, zj_t, 1.0), 0.0)[:, None]
    inv_zq = tl.where(zj_q > 0.0, 1.0 / tl.where(zj_q > 0.0, zj_q, 1.0), 0.0)[:, None]
    return tok_j, tj_row, dj_row, mj_row, c, mj_t, inv_zt, thrj_t, cutj_t, mj_q, inv_zq, thrj_q, cutj_q


@triton.jit
def row_j_probs(
    tj_row, dj_row, mj_row, start, end_col, need, lane_ok, lane_q, c, mj_t, inv_zt, thrj_t, cutj_t, mj_q, inv_zq,
    thrj_q, cutj_q, DRAFT_MODE: tl.constexpr, BY_INDEX: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """(p, q) at the columns start + arange(BLOCK_V) of rows ``row_j_view`` points at: the processed
    target and draft probabilities (q: 0 for one-hot drafts, whose q the caller knows; 0 outside
    lane_q). Lanes outside lane_ok read nothing (p = 0)."""
    cols = start + tl.arange(0, BLOCK_V)[None, :]
    bits = allowed_tile(mj_row, start, end_col, need, BLOCK_V, HAS_MASK)  # target and draft row j
    x = tl.load(tj_row + cols, mask=lane_ok, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        x = tl.where(bits, x, float("-inf"))
    p = kept_prob(x, mj_t, c, inv_zt, thrj_t, cols, cutj_t, BY_INDEX)
    q = tl.zeros_like(p)
    if DRAFT_MODE == DRAFT_LOGITS:
        xd = tl.load(dj_row + cols, mask=lane_q, other=float("-inf")).to(tl.float32)
        if HAS_MASK:
            xd = tl.where(bits, xd, float("-inf"))
        q = kept_prob(xd, mj_q, c, inv_zq, thrj_q, cols, cutj_q, BY_INDEX)
    elif DRAFT_MODE == DRAFT_PROBS:
        q, _bad_q = load_probs(dj_row + cols, lane_q)
    return p, q


@triton.jit
def order_key(x):
    """int32 key with the same order as the float32 values (for selecting thresholds)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def key_to_float(key):
    k = key.to(tl.int32)
    bits = tl.where(k < 0, k ^ 0x7FFFFFFF, k)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def safe_max(m):
    """The max to subtract before exp: -inf rows (no token kept yet) subtract 0, not -inf."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def online_softmax_update(m, z, x, keep, inv_t):
    """Fold a [R, BLOCK] tile into the running (max, sum of exp((x - max) / T)) of each row."""
    xk = tl.where(keep, x, float("-inf"))
    m_new = tl.maximum(m, tl.max(xk, axis=1))
    m_ref = safe_max(m_new)
    z = z * tl.exp((m - m_ref) * inv_t) + tl.sum(tl.exp((xk - m_ref[:, None]) * inv_t[:, None]), axis=1)
    return m_new, z


@triton.jit
def first_argmax_update(best, best_idx, vals, idx):
    """Running (max, lowest index of the max) per row; earlier tiles win ties."""
    tile_best = tl.max(vals, axis=1)
    tile_idx = tl.min(tl.where(vals == tile_best[:, None], idx, 2147483647), axis=1)
    take = tile_best > best
    return tl.where(take, tile_best, best), tl.where(take, tile_idx, best_idx)


@triton.jit
def lane_softmax_update(m, z, x, keep, inv_t):
    """Per-lane running (max, sum of exp((x - max) / T)) over [R, BLOCK] tiles: no reduction across
    lanes inside the hot loop (``lanes_softmax`` reduces once at the end). One exp per entry:
    whichever of the old max and x is smaller is the one rescaled."""
    xk = tl.where(keep, x, float("-inf"))
    # d = (x - m) / T; +inf while the lane holds nothing yet (m = -inf), -inf for dropped entries.
    d = tl.where(xk > float("-inf"), tl.where(m > float("-inf"), (xk - m) * inv_t, float("inf")), float("-inf"))
    e = tl.exp(-tl.abs(d))
    grow = d > 0.0
    z = tl.where(grow, z * e + 1.0, z + e)
    return tl.where(grow, xk, m), z


LOG2E = tl.constexpr(1.4426950408889634)
NO_MAX = tl.constexpr(-3.4028234663852886e38)  # running max of a lane that has seen no entry yet


@triton.jit
def lane_exp_update(m, y, x, c):
    """Per-lane running (max, sum of 2^((x - max) c) minus 1) with c = log2(e) / T: the fast-pass
    form of ``lane_softmax_update``, carrying y = z - 1 (start -1: z = 0) as ``lane_max_exp_update``
    does (one select and one fma per entry). m starts at NO_MAX (finite), so -inf entries (masked or
    filtered) add exactly 0 and no NaN arises from finite or -inf x; NaN / +inf x make y NaN (the
    caller redoes such rows). One exp2 per entry: whichever of the old max and x is smaller is
    rescaled."""
    d = (x - m) * c
    e = tl.exp2(-tl.abs(d))
    grow = d > 0.0
    return tl.where(grow, x, m), y * tl.where(grow, e, 1.0) + e


@triton.jit
def lane_max_exp_update(m, y, idx, x, cols, c):
    """``lane_exp_update`` that is also the lane's running argmax (no filter, or one that keeps every
    entry equal to the row max): the one compare x > m picks the new max, its first column and which
    side is rescaled. It carries y = z - 1 (start -1: z = 0), so that each entry costs one select and
    one fma: z' = z e + 1 (x grows m) or z + e are both y' = y a + e with a = e or 1 (a + b = 1 + e
    for the pair (a, b) = (e, 1) or (1, e) that z' = z a + b takes).
    m starts at NO_MAX, below every finite bf16 / fp16 value; fp32's -FLT_MAX never grows it (adds
    2^0 to z instead: ``lanes_max_exp`` sends such rows to the exact pass). NaN x leaves m and makes y
    NaN, +inf x makes m +inf: the caller redoes such rows."""
    d = (x - m) * c
    e = tl.exp2(-tl.abs(d))
    grow = x > m
    return tl.where(grow, x, m), y * tl.where(grow, e, 1.0) + e, tl.where(grow, cols, idx)


@triton.jit
def lanes_max_exp(m, y, idx, c):
    """(row max, first column of it, sum-exp relative to it) of per-lane ``lane_max_exp_update``
    state [R, BLOCK] (y = z - 1); c: [R, 1]. The max is NaN where z is (NaN entries: the caller
    redoes the row), -inf for a row without entries (every lane at NO_MAX with z = 0), and NaN too
    where a lane at NO_MAX counted entries (fp32 -FLT_MAX: the exact pass takes the row)."""
    row_m, row_idx = lanes_argmax(m, idx)
    row_z = lanes_exp_sum(m, y + 1.0, row_m, c)
    empty = row_m == NO_MAX
    row_m = tl.where(empty, float("-inf"), row_m)
    row_m = tl.where((row_z != row_z) | (empty & (row_z > 0.0)), float("nan"), row_m)
    return row_m, row_idx, row_z


@triton.jit
def lanes_exp_sum(m, z, row_max, c):
    """Row sum-exp relative to row_max of per-lane pairs from ``lane_exp_update``; c: [R, 1].
    Rows with no entry (row_max -inf) have every lane at NO_MAX with z = 0: their sum is 0."""
    ref = tl.where(row_max == float("-inf"), NO_MAX, row_max)
    return tl.sum(z * tl.exp2((m - ref[:, None]) * c), axis=1)


@triton.jit
def lanes_softmax(m, z, inv_t):
    """(row max, row sum-exp) of per-lane running pairs [R, BLOCK]; inv_t: [R]."""
    row_m = tl.max(m, axis=1)
    scale = tl.exp((m - safe_max(row_m)[:, None]) * inv_t[:, None])  # lanes at -inf hold z = 0
    return row_m, tl.sum(tl.where(m > float("-inf"), z * scale, 0.0), axis=1)


@triton.jit
def lane_argmax_update(best, best_idx, x, idx):
    """Per-lane running (max, index of its first occurrence); lanes see increasing indices."""
    take = x > best
    return tl.where(take, x, best), tl.where(take, idx, best_idx)


@triton.jit
def lanes_argmax(best, best_idx):
    """(row max, lowest index of the row max) of per-lane running pairs [R, BLOCK]."""
    row_best = tl.max(best, axis=1)
    return row_best, tl.min(tl.where(best == row_best[:, None], best_idx, 2147483647), axis=1)


@triton.jit
def argmax_pass(t_rows, tm_rows, row_ok, start_col, end_col, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """The row pass's fast results (``row_pass._row_pass_fast``) when every request is greedy
    (ARGMAX_ONLY) over [start_col, end_col) of rows ``t_rows`` ([R, 1] pointers): the NaN-propagating
    max and its first index per lane (a lane keeps the tile start: a scalar select, its offset added
    at the end), no sum-exp (z = 0) nor draft row; about 3 instructions an entry."""
    BLOCK_R: tl.constexpr = t_rows.shape[0]
    top_t = tl.full([BLOCK_R, BLOCK_V], float("-inf"), tl.float32)
    top_start = tl.zeros([BLOCK_R, BLOCK_V], tl.int32)
    lane = tl.arange(0, BLOCK_V)[None, :]
    for start in range(start_col, end_col, BLOCK_V):
        in_tile = row_ok[:, None] & (start + lane < end_col)
        x = tl.load(t_rows + start + lane, mask=in_tile, other=float("-inf")).to(tl.float32)
        if HAS_MASK:
            x = tl.where(allowed_tile(tm_rows, start, end_col, row_ok, BLOCK_V, HAS_MASK), x, float("-inf"))
        top_start = tl.where(x > top_t, start, top_start)
        top_t = tl.maximum(top_t, x, propagate_nan=tl.PropagateNan.ALL)
    row_top, row_idx = lanes_argmax(top_t, top_start + lane)
    row_top = tl.where(tl.max((top_t != top_t).to(tl.int32), axis=1) > 0, float("nan"), row_top)
    zero = tl.zeros([BLOCK_R], tl.float32)
    return row_top, zero, row_idx, zero + float("-inf"), zero, zero.to(tl.int32)


@triton.jit
def kept_at(x, cols, thr, cut, BY_INDEX: tl.constexpr):
    """Whether the entries x at columns cols pass the top-k/top-p threshold: x >= thr, or with
    the by_index tie rule x > thr, or x == thr at a column >= cut (``tie_index``; cut 0 = x >= thr).
    By index as one compare against a per-column threshold: thr from the cut on, before it the
    smallest float above thr (above both zeros when thr is one: -0.0 == 0.0 are one tie group)."""
    if BY_INDEX:
        up = key_to_float(order_key(tl.where(thr == 0.0, 0.0, thr)) + 1)
        return x >= tl.where(cols >= cut, thr, up)
    else:
        return x >= thr


@triton.jit
def per_request(ptr, value, b, mask, PER_REQUEST: tl.constexpr):
    """A per-request parameter: loaded from a [B] tensor, or the scalar `value` for every request.

    Scalars travel as kernel arguments so that a call with plain Python parameters launches no
    fill kernels; the caller casts the result to the dtype it needs.
    """
    if PER_REQUEST:
        return tl.load(ptr + b, mask=mask, other=0)
    else:
        return value + tl.zeros(b.shape, tl.int32)


@triton.jit
def request_seed(ptr, value, b, mask, PER_REQUEST: tl.constexpr):
    """int64 Philox key of each request: the given [B] seeds, or mixed from (scalar seed, b).

    The mixing (multiply by an odd constant, xor-shift; int64 arithmetic wraps) is repeated on the
    host by ``_validation.per_request_seeds`` so the reference sees the same keys.
    """
    if PER_REQUEST:
        return tl.load(ptr + b, mask=mask, other=0).to(tl.int64)
    else:
        x = (b.to(tl.int64) + value) * 0x5851F42D4C957F2D + 0x14057B7EF767814F
        return x ^ (x >> 29)


@triton.jit
def inverse_temperature(temperature):
    """(greedy, 1 / T) per request; greedy rows (T = 0) get 1 so no division by zero happens."""
    # T below the smallest normal float32 (1/T would overflow; validation rejects it) and NaN act as
    # greedy, the limit T -> 0: never inf or NaN in the softmax.
    greedy = ~(temperature >= MIN_TEMPERATURE)
    return greedy, tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temperature))


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers. (triton.cdiv is a constexpr function in newer Triton releases:
    ~15 us a host call there, and a verify_tree call made 30 of them.)"""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1): Triton block shapes must be powers of two."""
    return 1 << max(0, int(n) - 1).bit_length()
