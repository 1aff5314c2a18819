"""Tree attention: the target scores every node of a token tree in one forward pass.

Each tree token attends to the committed prefix of its request and to its own ancestors in the
tree (itself included), nothing else. The kernel is flash-attention style: fp32 online softmax over
key tiles, scores never written to memory, and the tree part of the mask is one int64 bitmask per
query node (bit j: "may attend tree node j"), built once per step by :func:`tree_metadata`.

The kernels (and how they lay out the work): ``ops/triton/attention.py``; this module has the contract,
the launcher and a plain-PyTorch fallback for CPU runs.

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
import triton.language as tl

from .._interpreter import interpreter_requested, multiprocessors, plans_for_interpreter, require_triton_device
from .._params import FLOAT_DTYPES, INT_DTYPES
from .._types import MAX_NODES
from .._validation import _capturing, _require
from .tree_metadata import check_parents, tree_metadata
from .triton import attention as kernels
from .triton.helpers import cdiv, next_pow2

_LOG2E = 1.4426950408889634
_SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)


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


def tree_attention_sdpa(q, k, v, allowed, scale=None):
    """The dense-mask attention (``allowed`` [B, Nq, S] of :func:`tree_attention_allowed`) through
    PyTorch's fused ``scaled_dot_product_attention`` - the Hugging Face backend's CPU path, 3-9x
    faster than :func:`tree_attention_torch` on decode shapes (its CPU flash kernel, in the model's
    dtype, as ``transformers``' "sdpa" attention runs). Unlike :func:`tree_attention_torch` it has
    no guard for NaN/inf at keys nobody attends (the fused kernel multiplies such a value by its
    zero weight): like "sdpa", it expects the model's own finite caches. A query attending nothing
    (padding) outputs zeros. No host synchronisation; traceable by torch.compile."""
    real = allowed.any(-1)  # [B, Nq]
    mask = allowed | ~real[:, :, None]  # a padding query attends every key; zeroed below
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.masked_fill(~real[:, None, :, None], 0.0)


def tree_attention_grouped(q, k, v, allowed, scale=None):
    """:func:`tree_attention_sdpa`'s attention for a few queries: per KV head, one float32 matmul of
    its group of query heads (GQA without expanding the keys), the masked softmax, one matmul with
    the values. PyTorch's fused CPU kernel is slow for one query (measured on the 2-core AMD EPYC, 1
    thread, 400 keys: a bf16 layer of 14 x 64 query heads 606 us against 89 here, an fp32 12 x 128 one
    118 against 96), and as accurate: the products are summed in float32 (error against a float64
    reference equal or lower). For ``GROUPED_MAX_QUERIES`` queries or fewer (the Hugging Face
    backend's choice on the CPU); same contract as :func:`tree_attention_sdpa` (finite caches;
    a padding query outputs zeros). q [B, Hq, Nq, D], k/v [B, Hkv, S, D], allowed [B, Nq, S] ->
    [B, Hq, Nq, D] in q's dtype."""
    B, Hq, Nq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    group = Hq // Hkv  # query head h reads KV head h // group (transformers' repeat_kv, SDPA's GQA)
    real = allowed.any(-1)  # [B, Nq]; a padding query's row is all -inf: NaN, zeroed below
    scores = torch.matmul(q.reshape(B, Hkv, group * Nq, D).float(), k.float().transpose(-1, -2))
    scores = scores.view(B, Hkv, group, Nq, S).masked_fill_(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores.mul_(1.0 / math.sqrt(D) if scale is None else scale), dim=-1)
    out = torch.matmul(probs.view(B, Hkv, group * Nq, S), v.float()).view(B, Hq, Nq, D)
    return out.masked_fill_(~real[:, None, :, None], 0.0).to(q.dtype)


def tree_attention_from_masks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    key_start: torch.Tensor, prefix_end: torch.Tensor, tree_start: torch.Tensor, query_masks: torch.Tensor,
    scale: float | None = None,
    *, tree_slots: int = MAX_NODES, window_lo: torch.Tensor | None = None, _num_splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
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
    kernels._tree_attention_kernel[(B * Hkv * m_tiles, 1, splits)](
        q_ptr=q, k_ptr=k, v_ptr=v,
        key_start_ptr=key_start, prefix_end_ptr=prefix_end, tree_start_ptr=tree_start, anc_ptr=query_masks,
        window_lo_ptr=query_masks if window_lo is None else window_lo,
        out_ptr=out, part_acc_ptr=part_acc, part_ml_ptr=part_ml,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_qn=q.stride(2),
        stride_kb=k.stride(0), stride_kh=k.stride(1), stride_ks=k.stride(2),
        stride_vb=v.stride(0), stride_vh=v.stride(1), stride_vs=v.stride(2),
        stride_ob=out.stride(0), stride_oh=out.stride(1), stride_on=out.stride(2),
        Hkv=Hkv, Nq=Nq, S=S, split_len=split_len, tree_slots=tree_slots, qk_scale=scale * _LOG2E,
        GROUP=group, D=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        TREE_SPAN=max(16, next_pow2(tree_slots)), NUM_SPLITS=splits, HAS_WINDOW=window_lo is not None,
        DOT_DTYPE=_dot_dtype(q.dtype),
        **launch,
    )  # fmt: skip
    if splits > 1:
        kernels._tree_attention_combine_kernel[(B * Hq * Nq,)](
            part_acc_ptr=part_acc, part_ml_ptr=part_ml, out_ptr=out,
            stride_ob=out.stride(0), stride_oh=out.stride(1), stride_on=out.stride(2),
            Hq=Hq, Nq=Nq, NUM_SPLITS=splits,
            D=D, BLOCK_D=block_d, SPLITS_P2=next_pow2(splits),
        )  # fmt: skip
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
