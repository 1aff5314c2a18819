"""Tree attention's Triton kernels (launched by ``ops/tree_attention.py``, which has the contract).

Work layout. One program owns one (request, KV head) pair, a tile of BLOCK_M query rows and one
split of the keys; the query tiles of a pair are adjacent in the grid. The query rows stack the GQA
group: row r is query head ``hkv * GROUP + r // Nq`` at node ``r % Nq``, so each K/V tile is loaded
once for all heads that share it (GROUP * Nq <= 256 rows: one tile). Long prefixes with
few programs (decoding, small trees, batch 1) are split across programs (flash-decoding): just enough
prefix splits to give every SM a program, plus a last split for the tree keys; each writes its rows'
normalised partial outputs (q's dtype) and fp32 (max, sum), and a second small kernel merges them.
Tiles past a request's own prefix are never visited, so ragged batches cost what their real keys cost.

The hot loop runs over prefix tiles every row attends: no mask, the softmax scale folded into the
exponent's FMA. Masks apply only on the (at most two) tiles that straddle the prefix bounds, the
tree tiles (ancestor bits) and, with a sliding window, every tile.

The kernel by phase: the prologue (rows, q, the split's key range), ``_prefix_keys`` (the committed
prefix), ``_tree_keys`` (the ancestors, last split only) and ``_store_rows`` (the output, or the
split's partial softmax for ``_tree_attention_combine_kernel``).
"""

import triton
import triton.language as tl

INT32_MAX = tl.constexpr(2**31 - 1)  # the window bound of padding rows: above every key


@triton.jit
def _scores(q, k, DOT_DTYPE: tl.constexpr):
    """q k^T of one tile (IEEE fp32 products for fp32 inputs: TF32 would lose the reference's digits)."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


@triton.jit
def _fold_values(p, v, alpha, l_i, acc, DOT_DTYPE: tl.constexpr):
    """The running (sum, acc) after a tile's weights p: rescale by alpha, add p's row sums and p v."""
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_DTYPE == tl.float32:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(DOT_DTYPE), v)
    return l_i, acc * alpha[:, None] + pv


@triton.jit
def _online_tile(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_DTYPE: tl.constexpr):
    """Fold one key tile into the running (max, sum, acc) of each query row (log2 domain)."""
    s = tl.where(allowed, _scores(q, k, DOT_DTYPE) * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows that have seen no allowed key yet keep m = -inf; subtract 0 instead to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i, acc = _fold_values(p, v, alpha, l_i, acc, DOT_DTYPE)
    return m_new, l_i, acc


@triton.jit
def _online_tile_full(q, k, v, m_i, l_i, acc, qk_scale, DOT_DTYPE: tl.constexpr):
    """_online_tile for a tile every row attends (a full prefix tile, no window): no mask, and the scale
    folded into the exponent's FMA. Needs qk_scale >= 0 (the kernel flips q's sign otherwise), so that
    max(s) * scale is the max of s * scale. Padding rows (q = 0) get finite garbage, discarded at the end."""
    s = _scores(q, k, DOT_DTYPE)
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # keys of -inf scores only (k = -inf)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s * qk_scale - m_safe[:, None])  # one FFMA and one MUFU per score
    l_i, acc = _fold_values(p, v, alpha, l_i, acc, DOT_DTYPE)
    return m_new, l_i, acc


@triton.jit
def _prefix_tile(
    q, k_base, v_base, tile, lo, hi, stride_ks, stride_vs, d, d_ok, real, window_lo,
    m_i, l_i, acc, row_bad, qk_scale, DOT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    """Fold prefix keys [tile, tile + BLOCK_N) ∩ [lo, hi) (and each row's window) into the running softmax."""
    keys = tile + tl.arange(0, BLOCK_N)
    key_ok = (keys >= lo) & (keys < hi)
    kv_off = keys.to(tl.int64)[:, None]
    kv_mask = key_ok[:, None] & d_ok[None, :]
    k = tl.load(k_base + kv_off * stride_ks + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
    v = tl.load(v_base + kv_off * stride_vs + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
    allowed = real[:, None] & key_ok[None, :]
    if HAS_WINDOW:
        # keys below some rows' windows but inside others': those rows weigh them 0
        allowed = allowed & (keys[None, :] >= window_lo[:, None])
        v, row_bad = _clean_values(v, kv_mask, allowed, row_bad)
    m_i, l_i, acc = _online_tile(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_DTYPE)
    return m_i, l_i, acc, row_bad


@triton.jit
def _finite_values(v, kv_mask):
    """(v with non-finite values zeroed, keys holding one): a weight of 0 must never multiply them (0 * NaN =
    NaN would leak into rows that do not attend the key); rows that do attend such a key output NaN instead."""
    good = tl.abs(v.to(tl.float32)) < float("inf")  # False for NaN and +-inf
    bad_key = tl.max((kv_mask & ~good).to(tl.int32), axis=1) > 0  # [BLOCK_N]
    return tl.where(good, v, 0.0), bad_key


@triton.jit
def _clean_values(v, kv_mask, allowed, row_bad):
    """_finite_values, marking the rows (`allowed`) that attend a key holding a non-finite value."""
    v, bad_key = _finite_values(v, kv_mask)
    row_bad = row_bad | (tl.max((allowed & bad_key[None, :]).to(tl.int32), axis=1) > 0)
    return v, row_bad


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _tree_tile(
    q, k_base, v_base, anc, real, union, tree_start, t0, S, tree_slots, stride_ks, stride_vs, d, d_ok,
    m_i, l_i, acc, bad_slots, qk_scale, DOT_DTYPE: tl.constexpr, TREE_BLOCK: tl.constexpr,
):  # fmt: skip
    """Fold tree key slots [t0, t0 + TREE_BLOCK) into the running softmax: slot j is attended by the
    rows whose ancestor mask has bit j; slots no row of the tile attends are not even read. `bad_slots`
    gains bit j when slot j's value is not finite (the rows attending it: ``_tree_keys``)."""
    j = t0 + tl.arange(0, TREE_BLOCK)
    keys = tree_start + j
    key_ok = (keys >= 0) & (keys < S) & (j < tree_slots)
    # the tile lies in one 32-bit half of the mask (TREE_BLOCK <= 32, t0 a multiple of it): int32 shifts
    word = (anc >> (t0 // 32 * 32)).to(tl.int32)
    is_ancestor = ((word[:, None] >> (j - t0 // 32 * 32)[None, :]) & 1) != 0
    allowed = real[:, None] & key_ok[None, :] & is_ancestor
    # slots some real row attends, from the OR of the rows' masks (`union`): a reduction of `allowed` over
    # the rows wanted a layout with 16 rows a thread, whose masks stayed live across the prefix loop
    used = key_ok & (((union >> j.to(tl.int64)) & 1) != 0)
    kv_off = keys.to(tl.int64)[:, None]
    kv_mask = used[:, None] & d_ok[None, :]
    k = tl.load(k_base + kv_off * stride_ks + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
    v = tl.load(v_base + kv_off * stride_vs + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
    v, bad_key = _finite_values(v, kv_mask)  # a sibling's slot: some rows only
    bad_slots = bad_slots | tl.reduce(bad_key.to(tl.int64) << j.to(tl.int64), 0, _bit_or)
    m_i, l_i, acc = _online_tile(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_DTYPE)
    return m_i, l_i, acc, bad_slots


@triton.jit
def _row_masks(anc_b, node0, Nq, rows_left, BLOCK_M: tl.constexpr):
    """The ancestor masks of the tile's rows (0: padding), loaded again after the prefix loop. The prologue's
    (or `real` from them), kept live across the loop for the tree keys and the store, spilled at 256 rows
    (N = 64: the loop needs all 128 registers); the index is written unlike the prologue's, which the
    compiler would otherwise share and keep live (as pointers) instead."""
    r = tl.arange(0, BLOCK_M)
    return tl.load(anc_b + (node0 + r) % Nq, mask=r < rows_left, other=0)


@triton.jit
def _prefix_keys(
    q, k_base, v_base, lo, hi, stride_ks, stride_vs, d, d_ok, anc, real, window_lo, anc_b, node0, Nq, rows_left,
    m_i, l_i, acc, row_bad, qk_scale, DOT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Fold the prefix keys [lo, hi) into the running softmax; fully masked tiles are skipped. Returns the
    rows' (anc, real) too: without a window, loaded again after the loop (``_row_masks``)."""
    if HAS_WINDOW:
        for tile in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
            m_i, l_i, acc, row_bad = _prefix_tile(
                q, k_base, v_base, tile, lo, hi, stride_ks, stride_vs, d, d_ok, real, window_lo,
                m_i, l_i, acc, row_bad, qk_scale, DOT_DTYPE, BLOCK_N, HAS_WINDOW,
            )  # fmt: skip
    else:
        # Masks only on the (at most two) tiles that straddle lo or hi; the tiles between are
        # attended by every row: the hot loop has no mask.
        edge = lo // BLOCK_N * BLOCK_N  # the tile holding lo
        full_lo = tl.cdiv(lo, BLOCK_N) * BLOCK_N
        full_hi = hi // BLOCK_N * BLOCK_N
        if (edge < full_lo) & (edge < hi):
            m_i, l_i, acc, row_bad = _prefix_tile(
                q, k_base, v_base, edge, lo, hi, stride_ks, stride_vs, d, d_ok, real, lo,
                m_i, l_i, acc, row_bad, qk_scale, DOT_DTYPE, BLOCK_N, HAS_WINDOW,
            )  # fmt: skip
        for tile in range(full_lo, full_hi, BLOCK_N):
            kv_off = (tile + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]
            k = tl.load(k_base + kv_off * stride_ks + d[None, :], mask=d_ok[None, :], other=0.0).to(DOT_DTYPE)
            v = tl.load(v_base + kv_off * stride_vs + d[None, :], mask=d_ok[None, :], other=0.0).to(DOT_DTYPE)
            m_i, l_i, acc = _online_tile_full(q, k, v, m_i, l_i, acc, qk_scale, DOT_DTYPE)
        anc = _row_masks(anc_b, node0, Nq, rows_left, BLOCK_M)
        real = anc != 0
        if (full_hi < hi) & (full_hi >= full_lo):
            m_i, l_i, acc, row_bad = _prefix_tile(
                q, k_base, v_base, full_hi, lo, hi, stride_ks, stride_vs, d, d_ok, real, lo,
                m_i, l_i, acc, row_bad, qk_scale, DOT_DTYPE, BLOCK_N, HAS_WINDOW,
            )  # fmt: skip
    return m_i, l_i, acc, row_bad, anc, real


@triton.jit
def _tree_keys(
    q, k_base, v_base, anc, real, tree_start, S, tree_slots, stride_ks, stride_vs, d, d_ok,
    m_i, l_i, acc, row_bad, qk_scale, DOT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, TREE_SPAN: tl.constexpr,
):  # fmt: skip
    """Fold the tree nodes (at most 64 keys) into the running softmax, in tiles of at most 32 keys (one
    32-bit half of the masks; a [BLOCK_M, 64] score tile next to the accumulator spilled)."""
    TREE_BLOCK: tl.constexpr = min(TREE_SPAN, BLOCK_N, 32)
    union = tl.reduce(tl.where(real, anc, 0), 0, _bit_or)  # slots some row attends
    bad_slots = tl.zeros([], tl.int64)  # bit j: slot j's value holds a NaN / inf
    # A loop, not unrolled (and not pipelined): the unrolled tiles' updates were interleaved by the compiler
    # (the first tile's sums kept live into the second's loads) and spilled at 256 rows (N = 64).
    for t0 in tl.range(0, TREE_SPAN, TREE_BLOCK, num_stages=1):
        m_i, l_i, acc, bad_slots = _tree_tile(
            q, k_base, v_base, anc, real, union, tree_start, t0, S, tree_slots, stride_ks, stride_vs, d, d_ok,
            m_i, l_i, acc, bad_slots, qk_scale, DOT_DTYPE, TREE_BLOCK,
        )  # fmt: skip
    # The rows attending a bad slot, from their masks once (padding rows' masks are 0): marking them per tile
    # from `allowed` ([BLOCK_M, TREE_BLOCK]) spilled at 256 rows (N = 64).
    return m_i, l_i, acc, row_bad | ((anc & bad_slots) != 0)


@triton.jit
def _store_rows(
    out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, real, row_bad, first_row, rows_left, split,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Write the tile's rows: the output (one split), or the split's partial softmax for the merge.

    Addresses: a scalar base (``first_row`` of [B * Hq * Nq]) + constexpr multiples of the row in the
    tile (out and the partials are ours, contiguous): per-row offsets or pointers shared with the
    prologue stayed live across the key loop and spilled at 256 rows."""
    r = tl.arange(0, BLOCK_M)
    r_ok = r < rows_left
    d = tl.arange(0, BLOCK_D)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out = tl.where(real[:, None], out, 0.0)  # padding rows: zeros (their acc may hold 0 * NaN)
        out = tl.where(row_bad[:, None], float("nan"), out)
        o_ptrs = out_ptr + first_row * D + r[:, None] * D + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & (d < D)[None, :])
    else:
        # The split's own softmax output (normalised: |o| <= max |v|, safe in q's dtype, half the bytes of
        # fp32) and its (max, sum) in fp32. Padding rows: o = 0, m = -inf, l = 0 (weight 0 in the merge).
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o = tl.where(real[:, None], o, 0.0)
        first = first_row * NUM_SPLITS + split  # slot of [B * Hq * Nq, NUM_SPLITS]
        o_ptrs = part_acc_ptr + first * BLOCK_D + r[:, None] * (NUM_SPLITS * BLOCK_D) + d[None, :]
        tl.store(o_ptrs, o.to(part_acc_ptr.dtype.element_ty), mask=r_ok[:, None])
        ml_ptrs = part_ml_ptr + first * 2 + r * (NUM_SPLITS * 2)
        tl.store(ml_ptrs, tl.where(real, m_i, float("-inf")), mask=r_ok)
        l_out = tl.where(row_bad, float("nan"), tl.where(real, l_i, 0.0))  # NaN: poisoned
        tl.store(ml_ptrs + 1, l_out, mask=r_ok)


@triton.jit(do_not_specialize=["S"])  # per-call scalars: triton/helpers.py
def _tree_attention_kernel(
    # pointers
    q_ptr,  # [B, Hq, Nq, D] fp32 | fp16 | bf16, last dim contiguous
    k_ptr,  # [B, Hkv, S, D] same dtype as q, last dim contiguous
    v_ptr,  # [B, Hkv, S, D] same dtype as q, last dim contiguous
    key_start_ptr,  # [B] int32: first committed key of the request (left padding before it)
    prefix_end_ptr,  # [B] int32: committed keys are [key_start, prefix_end)
    tree_start_ptr,  # [B] int32: tree node j's key sits at tree_start + j
    anc_ptr,  # [B, Nq] int64: bit j set iff the query may attend tree node j; 0 = padding query
    window_lo_ptr,  # [B, Nq] int32: first prefix key the query may attend (read when HAS_WINDOW)
    out_ptr,  # [B, Hq, Nq, D] q's dtype, contiguous: row * D addressing (written when NUM_SPLITS == 1)
    part_acc_ptr,  # [B * Hq * Nq, NUM_SPLITS, BLOCK_D] q's dtype: normalised split outputs (NUM_SPLITS > 1)
    part_ml_ptr,  # [B * Hq * Nq, NUM_SPLITS, 2] fp32 running max (log2 units) and sum (NUM_SPLITS > 1)
    # strides (elements)
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ob,
    stride_oh,
    stride_on,
    # sizes and scalars
    Hkv,
    Nq,
    S,
    split_len,  # prefix keys per split, a multiple of BLOCK_N (the last split: the rest, usually none)
    tree_slots,  # tree key slots the masks may reference (<= TREE_SPAN)
    qk_scale,  # softmax scale * log2(e)
    # constexprs
    GROUP: tl.constexpr,  # Hq // Hkv
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TREE_SPAN: tl.constexpr,  # power of two >= number of tree key slots (<= 64)
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,  # sliding window: per-query lower bounds on the prefix keys
    DOT_DTYPE: tl.constexpr,  # fp32 in the interpreter (its bf16 arithmetic is wrong), else q's dtype
):
    # The query tiles of one (request, KV head) are adjacent program ids: when GROUP * Nq > BLOCK_M they
    # run side by side and their K/V tiles come from L2 after the first one's read.
    m_tiles = tl.cdiv(GROUP * Nq, BLOCK_M)
    pid = tl.program_id(0).to(tl.int64)
    pid_bh = pid // m_tiles
    pid_m = (pid % m_tiles).to(tl.int32)
    split = tl.program_id(2)
    b = pid_bh // Hkv
    hkv = pid_bh % Hkv

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * Nq
    head = hkv * GROUP + rows // Nq
    node = rows % Nq
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    # q's per-row offsets in int32 from the request's base pointer (a request's q spans < 2^31 elements):
    # fewer registers in the prologue than 64-bit row pointers.
    anc = tl.load(anc_ptr + b * Nq + node, mask=row_ok, other=0)
    real = row_ok & (anc != 0)
    q_rows = head * stride_qh + node * stride_qn
    q_b = q_ptr + b * stride_qb
    # Padding rows' q is loaded too (whatever it holds): rows never mix, and their outputs are zeroed at the
    # end. Masking the load by `real` kept the masks of its layout's rows in registers (spills at 256 rows).
    q = tl.load(q_b + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)

    k_base = k_ptr + b * stride_kb + hkv * stride_kh
    v_base = v_ptr + b * stride_vb + hkv * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row_bad = tl.zeros([BLOCK_M], tl.int1)  # row attended a key whose value is NaN/inf

    # Committed prefix: this split's share of [key_start, prefix_end).
    key_start = tl.load(key_start_ptr + b).to(tl.int32)
    prefix_end = tl.minimum(tl.load(prefix_end_ptr + b).to(tl.int32), S)
    lo = tl.maximum(key_start, split * split_len)
    # the prefix splits take split_len keys each; the last one (the tree's) whatever prefix is left
    hi = tl.minimum(prefix_end, tl.where(split == NUM_SPLITS - 1, prefix_end, (split + 1) * split_len))
    if HAS_WINDOW:
        window_lo = tl.load(window_lo_ptr + b * Nq + node, mask=row_ok, other=0).to(tl.int32)
        # tiles below every row's window are skipped like tiles outside the prefix
        lo = tl.maximum(lo, tl.min(tl.where(real, window_lo, INT32_MAX), axis=0))
    else:
        window_lo = lo  # no per-row bound (not read)
    any_real = tl.max(real.to(tl.int32), axis=0) > 0
    if any_real:
        m_i, l_i, acc, row_bad, anc, real = _prefix_keys(
            q, k_base, v_base, lo, hi, stride_ks, stride_vs, d, d_ok, anc, real, window_lo,
            anc_ptr + b * Nq, (pid_m * BLOCK_M) % Nq, Nq, GROUP * Nq - pid_m * BLOCK_M,
            m_i, l_i, acc, row_bad, qk_scale, DOT_DTYPE, BLOCK_N, HAS_WINDOW, BLOCK_M,
        )  # fmt: skip
        if split == NUM_SPLITS - 1:  # the tree keys: the last split's
            tree_start = tl.load(tree_start_ptr + b).to(tl.int32)
            m_i, l_i, acc, row_bad = _tree_keys(
                q, k_base, v_base, anc, real, tree_start, S, tree_slots, stride_ks, stride_vs, d, d_ok,
                m_i, l_i, acc, row_bad, qk_scale, DOT_DTYPE, BLOCK_N, TREE_SPAN,
            )  # fmt: skip

    first_row = b * (Hkv * GROUP * Nq) + hkv * (GROUP * Nq) + pid_m * BLOCK_M  # of [B * Hq * Nq]
    _store_rows(
        out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, real, row_bad, first_row, GROUP * Nq - pid_m * BLOCK_M,
        split, D, BLOCK_D, BLOCK_M, NUM_SPLITS,
    )  # fmt: skip


@triton.jit(do_not_specialize=["NUM_SPLITS"])  # per-call scalars: triton/helpers.py
def _tree_attention_combine_kernel(
    part_acc_ptr,  # [B * Hq * Nq, NUM_SPLITS, BLOCK_D] q's dtype: each split's normalised output
    part_ml_ptr,  # [B * Hq * Nq, NUM_SPLITS, 2] fp32: each split's running max (log2 units) and sum
    out_ptr,  # [B, Hq, Nq, D] q's dtype
    stride_ob,
    stride_oh,
    stride_on,
    Hq,
    Nq,
    NUM_SPLITS,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_P2: tl.constexpr,  # power of two >= NUM_SPLITS
):
    """Merge the splits' partial softmaxes of one query row: sum_s w_s o_s / sum_s w_s, w_s = 2^(m_s - M) l_s."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLITS_P2)
    s_ok = splits < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    slot = row * NUM_SPLITS + splits
    m = tl.load(part_ml_ptr + slot * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + slot * 2 + 1, mask=s_ok, other=0.0)
    o = tl.load(part_acc_ptr + slot[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0).to(tl.float32)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe) * l  # splits that saw no key: weight 0; NaN when a split marked the row poisoned
    total = tl.sum(w, axis=0)
    out = tl.sum(tl.where(w[:, None] > 0, w[:, None] * o, 0.0), axis=0) / tl.where(total > 0, total, 1.0)
    out = tl.where(total == total, out, float("nan"))
    b = row // (Hq * Nq)
    h = (row // Nq) % Hq
    n = row % Nq
    tl.store(out_ptr + b * stride_ob + h * stride_oh + n * stride_on + d, out.to(out_ptr.dtype.element_ty), mask=d < D)
