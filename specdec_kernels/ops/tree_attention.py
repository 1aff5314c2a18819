"""Tree attention: the target scores every node of a token tree in one forward pass.

Each tree token attends to the committed prefix of its request and to its own ancestors in the
tree (itself included), nothing else. The kernel is flash-attention style: fp32 online softmax over
key tiles, scores never written to memory, and the tree part of the mask is one int64 bitmask per
query node (bit j: "may attend tree node j"), built once per step by :func:`tree_metadata`.

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

Key layout (per request b, positions in the key dimension of ``k``/``v``):

    [key_start[b], prefix_end[b])          committed prefix, attended by every real query
    tree_start[b] + j, j < 64              tree node j, attended by query n iff bit j of anc[b, n]

With a sliding window, query n of request b sees only prefix keys >= window_lo[b, n] (its own
first slot inside the window); tree keys are always inside it (the window must cover the tree).

``tree_attention`` (the public function) uses key_start = 0, prefix_end = tree_start = prefix_lens;
the Hugging Face backend passes the general form (left padding, tree appended after a shared cache
length).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._interpreter import interpreter_requested, multiprocessors, plans_for_interpreter, require_triton_device
from .._params import FLOAT_DTYPES, INT_DTYPES
from .._types import MAX_NODES
from .._validation import _capturing, _require
from .tree_metadata import check_parents, tree_metadata
from .triton.helpers import cdiv, next_pow2

_LOG2E = 1.4426950408889634
_SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)


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
def _clean_values(v, kv_mask, allowed, row_bad):
    """Zero non-finite values so that a weight of 0 never multiplies them (0 * NaN = NaN would leak into
    rows that do not attend the key); rows that do attend such a key are marked and output NaN instead."""
    good = tl.abs(v.to(tl.float32)) < float("inf")  # False for NaN and +-inf
    bad_key = tl.max((kv_mask & ~good).to(tl.int32), axis=1) > 0  # [BLOCK_N]
    row_bad = row_bad | (tl.max((allowed & bad_key[None, :]).to(tl.int32), axis=1) > 0)
    return tl.where(good, v, 0.0), row_bad


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _tree_tile(
    q, k_base, v_base, anc, real, union, tree_start, t0, S, tree_slots, stride_ks, stride_vs, d, d_ok,
    m_i, l_i, acc, row_bad, qk_scale, DOT_DTYPE: tl.constexpr, TREE_BLOCK: tl.constexpr,
):  # fmt: skip
    """Fold tree key slots [t0, t0 + TREE_BLOCK) into the running softmax: slot j is attended by the
    rows whose ancestor mask has bit j; slots no row of the tile attends are not even read."""
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
    v, row_bad = _clean_values(v, kv_mask, allowed, row_bad)  # a sibling's slot: some rows only
    m_i, l_i, acc = _online_tile(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_DTYPE)
    return m_i, l_i, acc, row_bad


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

    # Committed prefix: this split's share of [key_start, prefix_end); fully masked tiles are skipped.
    key_start = tl.load(key_start_ptr + b).to(tl.int32)
    prefix_end = tl.minimum(tl.load(prefix_end_ptr + b).to(tl.int32), S)
    lo = tl.maximum(key_start, split * split_len)
    # the prefix splits take split_len keys each; the last one (the tree's) whatever prefix is left
    hi = tl.minimum(prefix_end, tl.where(split == NUM_SPLITS - 1, prefix_end, (split + 1) * split_len))
    if HAS_WINDOW:
        window_lo = tl.load(window_lo_ptr + b * Nq + node, mask=row_ok, other=0).to(tl.int32)
        # tiles below every row's window are skipped like tiles outside the prefix
        lo = tl.maximum(lo, tl.min(tl.where(real, window_lo, 2147483647), axis=0))
    any_real = tl.max(real.to(tl.int32), axis=0) > 0
    if any_real:
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
            if (full_hi < hi) & (full_hi >= full_lo):
                m_i, l_i, acc, row_bad = _prefix_tile(
                    q, k_base, v_base, full_hi, lo, hi, stride_ks, stride_vs, d, d_ok, real, lo,
                    m_i, l_i, acc, row_bad, qk_scale, DOT_DTYPE, BLOCK_N, HAS_WINDOW,
                )  # fmt: skip

        # The tree nodes (at most 64 keys), handled by the last split in tiles of at most 32 keys (one
        # 32-bit half of the masks; a [BLOCK_M, 64] score tile next to the accumulator spilled).
        if split == NUM_SPLITS - 1:
            tree_start = tl.load(tree_start_ptr + b).to(tl.int32)
            TREE_BLOCK: tl.constexpr = min(TREE_SPAN, BLOCK_N, 32)
            union = tl.reduce(tl.where(real, anc, 0), 0, _bit_or)  # slots some row attends
            for t0 in tl.static_range(0, TREE_SPAN, TREE_BLOCK):
                m_i, l_i, acc, row_bad = _tree_tile(
                    q, k_base, v_base, anc, real, union, tree_start, t0, S, tree_slots, stride_ks, stride_vs, d, d_ok,
                    m_i, l_i, acc, row_bad, qk_scale, DOT_DTYPE, TREE_BLOCK,
                )  # fmt: skip

    # Epilogue addresses: a scalar base + constexpr multiples of the row in the tile (out and the partials
    # are ours, contiguous): per-row offsets or pointers shared with the prologue stayed live across the
    # key loop and spilled at 256 rows.
    r = tl.arange(0, BLOCK_M)
    r_ok = r < GROUP * Nq - pid_m * BLOCK_M
    first_row = b * (Hkv * GROUP * Nq) + hkv * (GROUP * Nq) + pid_m * BLOCK_M  # of [B * Hq * Nq]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out = tl.where(real[:, None], out, 0.0)  # padding rows: zeros (their acc may hold 0 * NaN)
        out = tl.where(row_bad[:, None], float("nan"), out)
        o_ptrs = out_ptr + first_row * D + r[:, None] * D + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
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


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _num_sms(device: torch.device) -> int:
    return 1 if plans_for_interpreter(device) else multiprocessors(device)


def _choose_splits(programs: int, prefix_keys: int, device: torch.device) -> int:
    """Flash-decoding split count (the last split takes the tree keys only): just enough prefix splits to
    give every SM one program, each >= 128 prefix keys; 1 when the programs alone fill the GPU.

    No more splits than that: every split writes a partial output row (D values in q's dtype + max and
    sum) per query row, and the merge reads it back. Batch 1, 8 KV heads, a 4k prefix: 16 prefix splits
    of 256 keys + the tree split = 136 programs on a 132-SM H100.
    """
    if plans_for_interpreter(device):
        return 1
    prefix_splits = min(_num_sms(device) // max(programs, 1), prefix_keys // 128)
    return prefix_splits + 1 if prefix_splits > 1 else 1


def _tile_config(block_d: int, dtype: torch.dtype) -> tuple[int, dict]:
    """(BLOCK_N, launch options) per head dim, chosen from the sm_90 compile's metadata (no GPU timings).

    D <= 128 in fp16/bf16 (BLOCK_M = 64): 8 warps, 32-key tiles, 2 stages, registers capped at 128 gives
    2 CTAs (16 warps, 25%) per SM: 128 registers, 48 KB shared memory. The former 4 warps / 64 keys /
    3 stages used 255 registers, spilled, and 112 KB shared: 8 warps per SM (12.5%).
    """
    if block_d > 128:
        return 32, {"num_warps": 8}
    if dtype == torch.float32:
        return 64, {"num_warps": 4}
    if interpreter_requested():  # same tiles; the register cap is a CUDA compile option
        return 32, {"num_warps": 8}
    return 32, {"num_warps": 8, "num_stages": 2, "maxnreg": 128}


def _dot_dtype(dtype: torch.dtype):
    if interpreter_requested():
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def window_start(key_start: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """[B, Nq] int32: the first prefix key slot each query of a sliding-window layer may attend.

    A query at position p sees positions > p - window, and slot key_start[b] + t holds position t,
    so the bound is key_start + max(p - window + 1, 0). Tree keys lie within the tree's depth of
    their query and need no bound while the window covers the tree.
    """
    return (key_start[:, None] + (positions - window + 1).clamp_min(0)).to(torch.int32)


def tree_attention_allowed(
    key_start, prefix_end, tree_start, query_masks, S: int, *, tree_slots=MAX_NODES, window_lo=None
):
    """[B, Nq, S] bool: query n of request b may attend key slot s (the dense form of the metadata).

    Every layer of one forward has the same mask: the Hugging Face backend builds it once per
    forward and passes it to :func:`tree_attention_torch` (``allowed=``).
    """
    s = torch.arange(S, device=query_masks.device)
    prefix = (s[None, :] >= key_start[:, None]) & (s[None, :] < prefix_end[:, None])  # [B, S]
    prefix = prefix[:, None, :]  # [B, 1 or Nq, S]
    if window_lo is not None:
        prefix = prefix & (s[None, None, :] >= window_lo[:, :, None])
    j = s[None, :] - tree_start[:, None]  # [B, S]
    in_tree = (j >= 0) & (j < tree_slots)
    bits = (query_masks[:, :, None] >> j.clamp(0, MAX_NODES - 1)[:, None, :]) & 1  # [B, Nq, S]
    real = (query_masks != 0)[:, :, None]
    return real & (prefix | (in_tree[:, None, :] & (bits != 0)))


def tree_attention_torch(
    q,
    k,
    v,
    key_start,
    prefix_end,
    tree_start,
    query_masks,
    scale=None,
    *,
    tree_slots=MAX_NODES,
    window_lo=None,
    allowed=None,
):
    """Same contract as :func:`tree_attention_from_masks` in plain PyTorch (a dense mask).

    For CPU runs, where Triton only has its (slow) interpreter: the Hugging Face backend uses it for
    CPU tensors unless told otherwise. Not a reference: the reference is reference/tree_attention.py.
    ``allowed``: the mask of :func:`tree_attention_allowed` when the caller already has it.

    GQA without copying K/V: the query heads of one KV head become extra query rows of that head
    (a view), so each layer reads K and V once, as the kernel does.
    """
    B, Hq, Nq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if allowed is None:
        allowed = tree_attention_allowed(
            key_start, prefix_end, tree_start, query_masks, S, tree_slots=tree_slots, window_lo=window_lo
        )
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    qg = q.float().reshape(B, Hkv, group * Nq, D)  # head h = kv * group + g, as repeat_interleave pairs them
    scores = torch.matmul(qg, k.float().transpose(-1, -2)).view(B, Hkv, group, Nq, S) * scale
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padding queries: no key -> zeros
    # Unattended NaN/inf values must not reach real rows through 0 * NaN: zero those keys' values,
    # and give NaN to the rows that do attend one (what attending it means).
    vv = v.float()
    bad = ~vv.isfinite().all(-1)  # [B, Hkv, S]
    poisoned = (allowed[:, None] & bad[:, :, None, :]).any(-1)  # [B, Hkv, Nq]
    out = torch.matmul(weights.view(B, Hkv, group * Nq, S), vv.masked_fill(bad[..., None], 0.0))
    out = out.view(B, Hkv, group, Nq, D).masked_fill(poisoned[:, :, None, :, None], float("nan"))
    return out.view(B, Hq, Nq, D).to(q.dtype)


def tree_attention_from_masks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_start: torch.Tensor,
    prefix_end: torch.Tensor,
    tree_start: torch.Tensor,
    query_masks: torch.Tensor,
    scale: float | None = None,
    *,
    tree_slots: int = MAX_NODES,
    window_lo: torch.Tensor | None = None,
    _num_splits: int | None = None,
) -> torch.Tensor:
    """The general form the Hugging Face backend uses: masks given per query, tree anywhere in the keys.

    Args:
        q: [B, Hq, Nq, D]; k, v: [B, Hkv, S, D] (any strides with a contiguous last dim).
        key_start, prefix_end: [B] int32: request b attends keys [key_start[b], prefix_end[b]).
        tree_start: [B] int32: tree node j's key is at tree_start[b] + j (0 <= j < 64).
        query_masks: [B, Nq] int64: bit j set iff query n may attend tree node j; 0 marks a padding
            query (its output is zeros). The tree slots must not overlap the prefix range.
        tree_slots: how many tree key slots the masks may reference (<= 64; fewer scans fewer keys).
        window_lo: [B, Nq] int32 or None: sliding window; query n attends only prefix keys
            >= window_lo[b, n] (tree keys are not windowed: the window must cover the tree).

    Shapes and dtypes are checked; values are not (no host synchronisation): it is the layer the
    Hugging Face backend calls once per layer with metadata built once per step.
    """
    if torch.compiler.is_compiling():  # one opaque node in the graph: dynamo cannot trace the launcher
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        return tree_attention_op(q, k, v, key_start, prefix_end, tree_start, query_masks, scale, tree_slots, window_lo)
    if window_lo is not None:
        _require(tuple(window_lo.shape) == tuple(query_masks.shape), "window_lo must have query_masks' shape [B, Nq]")
    return _launch(q, k, v, key_start, prefix_end, tree_start, query_masks, scale, tree_slots, window_lo, _num_splits)


@torch.library.custom_op("specdec::tree_attention", mutates_args=())
def tree_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_start: torch.Tensor,
    prefix_end: torch.Tensor,
    tree_start: torch.Tensor,
    query_masks: torch.Tensor,
    scale: float,
    tree_slots: int,
    window_lo: torch.Tensor | None = None,
) -> torch.Tensor:
    """``tree_attention_from_masks`` as a torch.library op (torch.compile graphs, CUDA graphs)."""
    return _launch(q, k, v, key_start, prefix_end, tree_start, query_masks, scale, tree_slots, window_lo, None)


@tree_attention_op.register_fake
def _tree_attention_fake(q, k, v, key_start, prefix_end, tree_start, query_masks, scale, tree_slots, window_lo=None):
    return q.new_empty(q.shape)  # contiguous [B, Hq, Nq, D], as _launch allocates


def _launch(q, k, v, key_start, prefix_end, tree_start, query_masks, scale, tree_slots, window_lo, _num_splits):
    B, Hq, Nq, D = q.shape
    _, Hkv, S, _ = k.shape
    out = torch.empty((B, Hq, Nq, D), dtype=q.dtype, device=q.device)
    if B == 0 or Nq == 0 or Hq == 0:
        return out
    require_triton_device(q.device, "sk.tree_attention")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    # [B] / [B, Nq] index tensors: the kernel indexes them densely; copies of strided views cost B * Nq elements
    key_start, prefix_end, tree_start, query_masks = (
        t.contiguous() for t in (key_start, prefix_end, tree_start, query_masks)
    )
    if window_lo is not None:
        window_lo = window_lo.to(torch.int32).contiguous()
    group = Hq // Hkv
    block_d = max(16, next_pow2(D))
    block_n, launch = _tile_config(block_d, q.dtype)
    block_m = max(16, min(64, next_pow2(group * Nq)))
    rows = next_pow2(group * Nq)
    if rows > block_m and rows * block_d <= 256 * 128:
        # The whole GQA group in one program (N = 64, GQA 4: 256 rows): K/V read once per (request, KV
        # head). 16 warps (4 warpgroups of 64 rows) keep the fp32 accumulator at <= 64 registers a thread.
        block_m = rows
        if not interpreter_requested():
            launch = dict(launch, num_warps=16)
        if block_d <= 64:  # a 32-register accumulator leaves room for 64-key tiles: half the per-key
            block_n = max(block_n, 64)  # softmax bookkeeping (D = 64, N = 64, B = 64: 261 -> 181 us est.)
    m_tiles = cdiv(group * Nq, block_m)
    # Keys [0, S - tree_slots) hold the prefix (in tree_attention; an upper bound elsewhere: any prefix key
    # past the prefix splits falls to the last split, which runs to prefix_end).
    prefix_keys = max(S - tree_slots, 1)
    splits = _num_splits or _choose_splits(B * Hkv * m_tiles, prefix_keys, q.device)
    split_len = cdiv(cdiv(prefix_keys, max(splits - 1, 1)), block_n) * block_n
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if scale < 0:  # the kernel's unmasked tiles need scale >= 0: (-q) k |scale| = q k scale, exactly
        q, scale = -q, -scale
    if splits > 1:
        part_acc = torch.empty((B * Hq * Nq, splits, block_d), dtype=q.dtype, device=q.device)
        part_ml = torch.empty((B * Hq * Nq, splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _tree_attention_kernel[(B * Hkv * m_tiles, 1, splits)](
        q,
        k,
        v,
        key_start,
        prefix_end,
        tree_start,
        query_masks,
        query_masks if window_lo is None else window_lo,
        out,
        part_acc,
        part_ml,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        Hkv,
        Nq,
        S,
        split_len,
        tree_slots,
        scale * _LOG2E,
        GROUP=group,
        D=D,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        TREE_SPAN=max(16, next_pow2(tree_slots)),
        NUM_SPLITS=splits,
        HAS_WINDOW=window_lo is not None,
        DOT_DTYPE=_dot_dtype(q.dtype),
        **launch,
    )
    if splits > 1:
        _tree_attention_combine_kernel[(B * Hq * Nq,)](
            part_acc,
            part_ml,
            out,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            Hq,
            Nq,
            splits,
            D=D,
            BLOCK_D=block_d,
            SPLITS_P2=next_pow2(splits),
        )
    return out


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_lens: torch.Tensor,
    parents: torch.Tensor,
    *,
    num_nodes: torch.Tensor | None = None,
    scale: float | None = None,
    sliding_window: int | None = None,
    validate: bool = True,
    _num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of the N nodes of a token tree over the committed prefix and their own ancestors.

    Args:
        q:           [B, Hq, N, D] fp32 | fp16 | bf16: queries of the tree tokens.
        k, v:        [B, Hkv, S, D], q's dtype: request b's committed prefix is keys [0, prefix_lens[b]),
                     its tree tokens sit at [prefix_lens[b], prefix_lens[b] + N). Hq % Hkv == 0
                     (GQA/MQA); D in {64, 80, 96, 128, 256} (others work, untuned).
        prefix_lens: [B] int32 | int64: ragged committed lengths.
        parents:     [B, N] int, -1 for children of the root, else parents[b, i] < i (as in
                     :func:`verify_tree`); N <= 64.
        num_nodes:   [B] int: ragged trees; nodes >= num_nodes[b] are padding (zero output, never attended).
        scale:       softmax scale, default 1/sqrt(D).
        sliding_window: W, or None: a query at position p (prefix key s is at position s, node n at
                     prefix_lens[b] + depth(n) - 1) attends only keys at positions > p - W, as
                     Mistral-style sliding-window layers do. W >= N (the window covers the tree).
        validate:    check values on the host (0 <= num_nodes <= N, -1 <= parents[b, i] < i for real nodes,
                     prefix_lens >= 0, prefix_lens + num_nodes <= S): a ValueError, never a wrong answer.
                     Synchronises with the GPU; skipped during CUDA-graph capture and torch.compile
                     tracing. ``validate=False`` is the fast path and trusts the caller.
        Every tensor argument may be a strided view (transposed q/k/v, int32 slices, expanded parents).

    Returns:
        [B, Hq, N, D] in q's dtype: softmax(q k^T * scale + mask) v with mask[n, s] allowed iff
        s < prefix_lens[b], or s = prefix_lens[b] + j with j an ancestor of n or n itself.

    The math: fp32 online softmax (flash attention), keys in tiles, scores and masks never in
    memory; the ancestor relation is one int64 bitmask per node from :func:`tree_metadata`. A chain
    (parents[i] = i - 1) is causal attention; N = 1 is ordinary decoding.

    Example:
        >>> parents = torch.tensor([[-1, 0, 0, 1]])           # root child 0, its children 1 and 2, 1's child 3
        >>> o = sk.tree_attention(q, k, v, prefix_lens=torch.tensor([100]), parents=parents)
    """
    _check_attention_args(q, k, v, prefix_lens, parents, num_nodes)
    B, _, N, _ = q.shape
    if validate and B and not _capturing(q.device) and not torch.compiler.is_compiling():
        _check_attention_values(k.shape[2], N, prefix_lens, parents, num_nodes)
    _require(
        sliding_window is None or int(sliding_window) >= N,
        f"sliding_window must be >= N={N} (the window must cover the tree), got {sliding_window}",
    )
    meta = tree_metadata(parents, num_nodes, validate=False)  # checked above when validate
    prefix_end = prefix_lens.to(torch.int32)
    key_start = torch.zeros_like(prefix_end)
    window_lo = None
    if sliding_window is not None:  # node positions: prefix + depth - 1
        positions = prefix_end[:, None] + meta.depth - 1
        window_lo = window_start(key_start, positions, int(sliding_window))
    return tree_attention_from_masks(
        q,
        k,
        v,
        key_start,
        prefix_end,
        prefix_end,
        meta.ancestor_mask,
        scale,
        tree_slots=N,
        window_lo=window_lo,
        _num_splits=_num_splits,
    )


def _check_attention_args(q, k, v, prefix_lens, parents, num_nodes) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("prefix_lens", prefix_lens), ("parents", parents)):
        _require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    _require(q.dim() == 4, f"q must be [B, Hq, N, D], got shape {tuple(q.shape)}")
    _require(k.dim() == 4, f"k must be [B, Hkv, S, D], got shape {tuple(k.shape)}")
    _require(v.shape == k.shape, f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    B, Hq, N, D = q.shape
    _require(k.shape[0] == B, f"k has batch {k.shape[0]} but q has batch {B}")
    _require(k.shape[3] == D, f"k has head dim {k.shape[3]} but q has head dim {D}")
    Hkv = k.shape[1]
    _require(Hkv > 0 and Hq % Hkv == 0, f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    _require(q.dtype in FLOAT_DTYPES, f"q has dtype {q.dtype}; supported: fp32, fp16, bf16", TypeError)
    _require(
        k.dtype == q.dtype and v.dtype == q.dtype,
        f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}",
        TypeError,
    )
    _require(N <= MAX_NODES, f"at most {MAX_NODES} tree nodes are supported, got N={N}")
    _require(
        parents.dim() == 2 and tuple(parents.shape) == (B, N),
        f"parents must have shape [B={B}, N={N}], got {tuple(parents.shape)}",
    )
    _require(
        prefix_lens.dim() == 1 and prefix_lens.shape[0] == B,
        f"prefix_lens must have shape [B={B}], got {tuple(prefix_lens.shape)}",
    )
    ints = [("prefix_lens", prefix_lens), ("parents", parents)] + (
        [("num_nodes", num_nodes)] if num_nodes is not None else []
    )
    for name, t in ints:
        _require(
            isinstance(t, torch.Tensor) and t.dtype in INT_DTYPES, f"{name} must be an int32/int64 tensor", TypeError
        )
    if num_nodes is not None:
        _require(
            num_nodes.dim() == 1 and num_nodes.shape[0] == B,
            f"num_nodes must have shape [B={B}], got {tuple(num_nodes.shape)}",
        )
    for name, t in [("k", k), ("v", v)] + ints:
        _require(t.device == q.device, f"{name} is on {t.device} but q is on {q.device}")


def _check_attention_values(S: int, N: int, prefix_lens, parents, num_nodes) -> None:
    check_parents(parents, num_nodes)
    prefix = prefix_lens.cpu().long()
    n = num_nodes.cpu().long() if num_nodes is not None else torch.full_like(prefix, N)
    _require(bool((prefix >= 0).all()), f"prefix_lens must be >= 0, got {prefix.tolist()}")
    too_long = prefix + n > S
    _require(
        not bool(too_long.any()),
        f"prefix_lens + num_nodes exceeds the key length S={S} for requests {too_long.nonzero().flatten().tolist()}",
    )
