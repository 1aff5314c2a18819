"""Tree metadata for tree attention and KV-cache bookkeeping: node depths and ancestor masks.

One launch; each program walks the nodes of a tile of requests in index order (parents come
first, so one sweep suffices) keeping the masks in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._interpreter import interpreter_requested
from .._tree_args import MAX_NODES
from .._validation import INT_DTYPES, _capturing, _check_tensor, _require
from .verify import _next_pow2


@dataclass
class TreeMetadata:
    """depth:          [B, N] int32: 1 for children of the root, d for nodes d deep; 0 for padding.
                       position_ids of tree tokens = prefix_len + depth - 1.
    ancestor_mask:  [B, N] int64: bit j set iff node j is node i or one of its ancestors
                       (the tree-attention mask row of node i); 0 for padding.
    """

    depth: torch.Tensor
    ancestor_mask: torch.Tensor


@triton.jit
def _tree_metadata_kernel(
    parents_ptr,  # [B, N] int
    num_nodes_ptr,  # [B] int (PER_REQ_N)
    depth_ptr,  # [B, N] int32 out
    mask_ptr,  # [B, N] int64 out
    stride_pb,
    stride_pn,
    stride_nb,
    stride_ob,
    B,
    N,
    PER_REQ_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    NP2: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    b_ok = b < B
    if PER_REQ_N:
        n = tl.load(num_nodes_ptr + b * stride_nb, mask=b_ok, other=0).to(tl.int32)
    else:
        n = N + tl.zeros([BLOCK_B], tl.int32)
    nodes = tl.arange(0, NP2)[None, :]
    valid = b_ok[:, None] & (nodes < n[:, None])
    par = tl.load(parents_ptr + b[:, None] * stride_pb + nodes * stride_pn, mask=valid, other=-1).to(tl.int32)
    par = tl.where((par >= 0) & (par < nodes), par, -1)  # validated inputs never need this clamp
    depth = tl.zeros([BLOCK_B, NP2], tl.int32)
    anc = tl.zeros([BLOCK_B, NP2], tl.int64)
    for i in range(0, N):
        p_i = tl.sum(tl.where(nodes == i, par, 0), axis=1)
        p_depth = tl.sum(tl.where(nodes == p_i[:, None], depth, 0), axis=1)
        p_anc = tl.sum(tl.where(nodes == p_i[:, None], anc, 0), axis=1)
        own = tl.full([BLOCK_B], 1, tl.int64) << i
        here = (nodes == i) & valid
        depth = tl.where(here, (p_depth + 1)[:, None], depth)
        anc = tl.where(here, (p_anc | own)[:, None], anc)
    out = b[:, None] * stride_ob + nodes
    tl.store(depth_ptr + out, depth, mask=b_ok[:, None] & (nodes < N))
    tl.store(mask_ptr + out, anc, mask=b_ok[:, None] & (nodes < N))


def tree_metadata(
    parents: torch.Tensor, num_nodes: torch.Tensor | None = None, *, validate: bool = True
) -> TreeMetadata:
    """Depths and ancestor bitmasks of token trees (same parents convention as :func:`verify_tree`).

    Args:
        parents:   [B, N] int32 | int64, -1 for children of the root, else parents[b, i] < i; N <= 64.
                   Any strides (an expanded [1, N] -> [B, N] view included).
        num_nodes: [B] int, ragged trees (nodes >= num_nodes[b] are padding: depth 0, mask 0); any stride.
        validate:  check values on the host (0 <= num_nodes <= N; -1 <= parents[b, i] < i for real nodes):
                   a ValueError instead of wrong masks. One host synchronisation on a GPU; skipped while a
                   CUDA graph is captured or torch.compile traces. ``validate=False`` is the fast path: it
                   trusts the caller (out-of-range parents are then read as -1, a child of the root).

    Returns:
        TreeMetadata(depth [B, N] int32, ancestor_mask [B, N] int64), contiguous.

    Example:
        >>> meta = sk.tree_metadata(parents)
        >>> position_ids = prefix_lens[:, None] + meta.depth - 1
        >>> allowed = (meta.ancestor_mask[:, :, None] >> torch.arange(N)) & 1  # [B, N, N]
    """
    _require(isinstance(parents, torch.Tensor), "parents must be a torch.Tensor", TypeError)
    _check_tensor("parents", parents, 2, INT_DTYPES, parents.device)
    B, N = parents.shape
    _require(N <= MAX_NODES, f"at most {MAX_NODES} tree nodes are supported, got {N}")
    if num_nodes is not None:
        _require(isinstance(num_nodes, torch.Tensor), "num_nodes must be a torch.Tensor or None", TypeError)
        _check_tensor("num_nodes", num_nodes, 1, INT_DTYPES, parents.device)
        _require(num_nodes.shape[0] == B, f"num_nodes must have shape [B={B}], got {tuple(num_nodes.shape)}")
    if torch.compiler.is_compiling():  # one opaque node: dynamo cannot trace the launcher (nor validate)
        depth, mask = tree_metadata_op(parents, num_nodes)
        return TreeMetadata(depth, mask)
    if validate and B and not _capturing(parents.device):
        check_tree_values(parents, num_nodes)
    return TreeMetadata(*_launch(parents, num_nodes))


def check_tree_values(parents: torch.Tensor, num_nodes: torch.Tensor | None) -> None:
    """ValueError unless 0 <= num_nodes[b] <= N and -1 <= parents[b, i] < i for every real node (host)."""
    B, N = parents.shape
    n = num_nodes.cpu().long() if num_nodes is not None else torch.full((B,), N, dtype=torch.long)
    _require(bool((n >= 0).all() and (n <= N).all()), f"num_nodes must lie in [0, N={N}], got {n.tolist()}")
    par = parents.cpu().long()
    idx = torch.arange(N)
    bad = (idx[None, :] < n[:, None]) & ((par < -1) | (par >= idx[None, :]))
    _require(
        not bool(bad.any()),
        f"parents must satisfy -1 <= parents[b, i] < i for real nodes (topological order); "
        f"offending (b, i): {bad.nonzero().tolist()[:8]}",
    )


def _launch(parents: torch.Tensor, num_nodes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    B, N = parents.shape
    depth = torch.empty((B, N), dtype=torch.int32, device=parents.device)
    mask = torch.empty((B, N), dtype=torch.int64, device=parents.device)
    if B == 0 or N == 0:
        return depth, mask
    np2 = max(2, _next_pow2(N))
    cap = 1024 if (interpreter_requested() or parents.device.type != "cuda") else 16
    block_b = max(1, min(_next_pow2(B), cap))
    _tree_metadata_kernel[(triton.cdiv(B, block_b),)](
        parents,
        num_nodes if num_nodes is not None else parents,
        depth,
        mask,
        parents.stride(0),
        parents.stride(1),
        num_nodes.stride(0) if num_nodes is not None else 0,
        depth.stride(0),
        B,
        N,
        PER_REQ_N=num_nodes is not None,
        BLOCK_B=block_b,
        NP2=np2,
    )
    return depth, mask


@torch.library.custom_op("specdec::tree_metadata", mutates_args=())
def tree_metadata_op(parents: torch.Tensor, num_nodes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tree_metadata` (unvalidated) as a torch.library op: torch.compile(fullgraph=True), CUDA graphs."""
    return _launch(parents, num_nodes)


@tree_metadata_op.register_fake
def _tree_metadata_fake(parents, num_nodes=None):
    B, N = parents.shape
    return parents.new_empty((B, N), dtype=torch.int32), parents.new_empty((B, N), dtype=torch.int64)
