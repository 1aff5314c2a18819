"""Tree metadata for tree attention and KV-cache bookkeeping: node depths and ancestor masks.

One launch; each program walks the nodes of a tile of requests in index order (parents come
first, so one sweep suffices) keeping the masks in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._interpreter import planned_as_gpu, plans_for_interpreter, require_triton_device
from .._params import INT_DTYPES
from .._types import MAX_NODES, TreeMetadata
from .._validation import _capturing, _check_tensor, _require
from .triton.helpers import cdiv, next_pow2


@triton.jit(do_not_specialize=["B"])  # per-call scalars: triton/helpers.py
def _tree_metadata_kernel(
    parents_ptr,  # [B, N] int
    num_nodes_ptr,  # [B] int (PER_REQ_N)
    depth_ptr,  # [B, N] int32 out
    mask_ptr,  # [B, N] int64 out
    stride_pb,
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
        n = tl.load(num_nodes_ptr + b, mask=b_ok, other=0).to(tl.int32)
    else:
        n = N + tl.zeros([BLOCK_B], tl.int32)
    nodes = tl.arange(0, NP2)[None, :]
    valid = b_ok[:, None] & (nodes < n[:, None])
    par = tl.load(parents_ptr + b[:, None] * stride_pb + nodes, mask=valid, other=-1).to(tl.int32)
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
    parents: torch.Tensor,
    num_nodes: torch.Tensor | None = None,
    *,
    validate: bool = True,
    backend: str = "auto",
) -> TreeMetadata:
    """Depths and ancestor bitmasks of token trees (same parents convention as :func:`verify_tree`).

    Args:
        parents:   [B, N] int32 | int64, -1 for children of the root, else parents[b, i] < i; N <= 64.
        num_nodes: [B] int, ragged trees (nodes >= num_nodes[b] are padding: depth 0, mask 0).
        validate:  check the values (parents in [-1, i), 0 <= num_nodes <= N; one host sync; skipped
                   during CUDA-graph capture and torch.compile tracing). With validate=False the caller
                   is trusted: an out-of-range parent is read as -1.
        backend:   "auto" (the Triton kernel on CUDA tensors, vectorised PyTorch on CPU tensors and
                   under torch.compile), "triton" (the kernel; on CPU through Triton's interpreter)
                   or "torch". Works inside ``torch.compile(fullgraph=True)`` with validate=False.

    Example:
        >>> meta = sk.tree_metadata(parents)
        >>> position_ids = prefix_lens[:, None] + meta.depth - 1
        >>> allowed = (meta.ancestor_mask[:, :, None] >> torch.arange(N)) & 1  # [B, N, N]
    """
    _require(isinstance(parents, torch.Tensor), "parents must be a torch.Tensor", TypeError)
    _check_tensor("parents", parents, 2, INT_DTYPES, parents.device)
    B, N = parents.shape
    _require(N <= MAX_NODES, f"at most {MAX_NODES} tree nodes are supported, got {N}")
    _require(backend in ("auto", "triton", "torch"), f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if num_nodes is not None:
        _check_tensor("num_nodes", num_nodes, 1, INT_DTYPES, parents.device)
        _require(num_nodes.shape[0] == B, f"num_nodes must have shape [B={B}], got {tuple(num_nodes.shape)}")
        num_nodes = num_nodes.contiguous()  # the kernel reads num_nodes[b] at ptr + b
    parents = parents if parents.stride(-1) == 1 else parents.contiguous()
    if validate and B > 0 and N > 0 and not _capturing(parents.device) and not torch.compiler.is_compiling():
        check_parents(parents, num_nodes)
    # Under torch.compile the PyTorch path is traced into the graph (a Triton launch is not traceable).
    # plan_as_gpu (the static model): the launch a CUDA call makes (not read while compiling: a
    # ContextVar is not traceable, and the compiled path is the PyTorch one anyway).
    pytorch = torch.compiler.is_compiling() or not (parents.device.type == "cuda" or planned_as_gpu())
    if backend == "torch" or (backend == "auto" and pytorch):
        return _tree_metadata_torch(parents, num_nodes)
    return _tree_metadata_triton(parents, num_nodes)


def _tree_metadata_triton(parents: torch.Tensor, num_nodes: torch.Tensor | None) -> TreeMetadata:
    """The kernel's launch on checked arguments (parents' last dim contiguous, num_nodes contiguous)."""
    B, N = parents.shape
    depth = torch.empty((B, N), dtype=torch.int32, device=parents.device)
    mask = torch.empty((B, N), dtype=torch.int64, device=parents.device)
    if B == 0 or N == 0:
        return TreeMetadata(depth, mask)
    require_triton_device(parents.device, "sk.tree_metadata(backend='triton')")
    np2 = max(2, next_pow2(N))
    cap = 1024 if plans_for_interpreter(parents.device) else 16  # the interpreter pays per operation
    block_b = max(1, min(next_pow2(B), cap))
    _tree_metadata_kernel[(cdiv(B, block_b),)](
        parents,
        num_nodes if num_nodes is not None else parents,
        depth,
        mask,
        parents.stride(0),
        depth.stride(0),
        B,
        N,
        PER_REQ_N=num_nodes is not None,
        BLOCK_B=block_b,
        NP2=np2,
    )
    return TreeMetadata(depth, mask)


def check_parents(parents: torch.Tensor, num_nodes: torch.Tensor | None) -> None:
    """ValueError unless every real node's parent is -1 or an earlier node, and 0 <= num_nodes <= N."""
    B, N = parents.shape
    par = parents.cpu().long()
    n = num_nodes.cpu().long() if num_nodes is not None else torch.full((B,), N)
    bad_n = (n < 0) | (n > N)
    _require(not bool(bad_n.any()), f"num_nodes must be in [0, N={N}]; got {n[bad_n][:4].tolist()}")
    idx = torch.arange(N)[None, :]
    bad = (idx < n[:, None]) & ((par < -1) | (par >= idx))
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            "parents must be -1 (a child of the root) or an earlier node (parents[b, i] < i, so no cycles): "
            f"parents[{b}, {i}] = {int(par[b, i])}"
        )


def _tree_metadata_torch(parents: torch.Tensor, num_nodes: torch.Tensor | None) -> TreeMetadata:
    """The kernel's result by pointer jumping: after round r every node knows its ancestors up to
    2^r - 1 steps up and its 2^r-th ancestor; at most log2(64) = 6 rounds, vectorised over requests."""
    B, N = parents.shape
    device = parents.device
    nodes = torch.arange(N, device=device)[None, :]
    real = (nodes < (num_nodes.long()[:, None] if num_nodes is not None else N)).expand(B, N)
    up = parents.long()
    up = torch.where(real & (up >= 0) & (up < nodes), up, -1)  # as the kernel reads untrusted parents
    anc = torch.where(real, torch.ones_like(up) << nodes, 0)
    depth = real.long()
    for _ in range(max(1, N).bit_length()):
        has_up = up >= 0
        at = up.clamp_min(0)
        anc = torch.where(has_up, anc | anc.gather(1, at), anc)
        depth = torch.where(has_up, depth + depth.gather(1, at), depth)
        up = torch.where(has_up, up.gather(1, at), up)
    return TreeMetadata(depth.to(torch.int32), anc)
