"""Phase 1 of tree verification: the positions a walk can reach, from the tree alone."""

from __future__ import annotations

import triton
import triton.language as tl

from ..helpers import per_request
from .common import POS_FIRST, POS_K, POS_REC, POS_TOK, RRS_MAX, _record, _tree_nodes


@triton.jit(do_not_specialize=["B"])  # per-call scalars: triton/helpers.py
def _tree_positions_kernel(
    # pointers
    tokens_ptr,  # [B, K, G] int: node tokens (node = chain * G + slot)
    parents_ptr,  # [B, N] int (unless CHAINS)
    num_nodes_ptr,  # [B] int (PER_REQ_N)
    pos_ptr,  # [B, N+1, POS_REC] int32 out: per position (slot 0 = root, 1 + n = node n)
    use_ptr,  # [B*K*(G+1), 2] int8 out: the row pass's record use (target row, draft row)
    # strides
    stride_xb, stride_xk, stride_pb,
    # sizes
    B, K, G, V, N, D,
    # constexprs
    PER_REQ_N: tl.constexpr, CHAINS: tl.constexpr, NP2: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """The positions a walk can reach, from the tree alone (no randomness): nodes spelling the same
    token path form one position (the walk's node set), named by its first node. For each position:
    its candidate count k (0 when the node is not the first of its set) and its first candidate (whose
    draft row is the position's q). And the rows the row pass reads: the positions' target rows and
    their first candidates' draft rows; no walk uses the others (later siblings' draft rows, rows of
    nodes repeating a sibling's token). BLOCK_B requests per program (1 on a GPU; a tile of them in
    the interpreter, where a program per request costs more than its work); D rounds of
    [BLOCK_B, NP2, NP2] bit tiles."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    b_ok = b < B
    n_nodes = per_request(num_nodes_ptr, N, b, b_ok, PER_REQ_N).to(tl.int32)
    n_nodes = tl.where(b_ok, n_nodes, 0)[:, None, None]  # requests past B have no nodes
    b3 = b[:, None, None]
    ni = tl.arange(0, NP2)[None, :, None]
    nj = tl.arange(0, NP2)[None, None, :]
    tok_i, ok_i, par_i = _tree_nodes(
        tokens_ptr, parents_ptr, b3, ni, n_nodes, stride_xb, stride_xk, stride_pb, G, V, CHAINS
    )
    tok_j, ok_j, par_j = _tree_nodes(
        tokens_ptr, parents_ptr, b3, nj, n_nodes, stride_xb, stride_xk, stride_pb, G, V, CHAINS
    )
    tok_eq = (tok_i == tok_j) & ok_i & ok_j
    both_root = (par_i == -1) & (par_j == -1)
    one = tl.full([BLOCK_B, NP2, NP2], 1, tl.int64)
    rel = tok_eq & both_root
    bits = tl.sum(tl.where(rel, one << nj.to(tl.int64), 0), axis=2)  # [BB, NP2]: same-path set of node i
    for _depth in range(0, D):  # nodes at depth d + 1 are settled after d rounds
        par_bits = tl.sum(tl.where(nj == par_i, bits[:, None, :], 0), axis=2)  # bits[parent(i)]
        same_parent = ((par_bits[:, :, None] >> tl.maximum(par_j, 0).to(tl.int64)) & 1) != 0
        rel = tok_eq & (both_root | ((par_i >= 0) & (par_j >= 0) & same_parent))
        bits = tl.sum(tl.where(rel, one << nj.to(tl.int64), 0), axis=2)
    n = tl.arange(0, NP2)[None, :]
    rep = tl.min(tl.where(rel, nj, NP2), axis=2)  # [BB, NP2]: first node of each node's set
    is_first = rep == n
    rep_of_parent = tl.sum(tl.where(ni == par_j, rep[:, :, None], 0), axis=1)  # [BB, NP2] over j
    member = ok_j & (par_j >= 0) & (rep_of_parent[:, None, :] == ni) & is_first[:, :, None]
    k = tl.sum(member.to(tl.int32), axis=2)
    first = tl.min(tl.where(member, nj, NP2), axis=2)
    root_member = ok_j & (par_j == -1)  # [BB, 1, NP2]
    k_root = tl.sum(root_member.to(tl.int32), axis=2)  # [BB, 1]
    first_root = tl.min(tl.where(root_member, nj, NP2), axis=2)
    base = (pos_ptr + b * (N + 1) * POS_REC)[:, None]
    r0 = tl.arange(0, 1)[None, :]
    ok_root = b_ok[:, None]
    ok_node = b_ok[:, None] & (n < N)
    tl.store(base + r0 * POS_REC + POS_K, k_root, mask=ok_root)
    tl.store(base + r0 * POS_REC + POS_FIRST, first_root, mask=ok_root)
    tl.store(base + (1 + n) * POS_REC + POS_K, k, mask=ok_node)
    tl.store(base + (1 + n) * POS_REC + POS_FIRST, first, mask=ok_node)
    # candidate tokens by rank (RRS's residual masses before the walk)
    rank = tl.cumsum(member.to(tl.int32), axis=2) - 1
    root_rank = tl.cumsum(root_member.to(tl.int32), axis=2) - 1
    for r in range(0, RRS_MAX):  # a loop, not unrolled: the program is near the register limit
        x_r = tl.sum(tl.where(member & (rank == r), tok_j, 0), axis=2).to(tl.int32)
        tl.store(base + (1 + n) * POS_REC + POS_TOK + r, x_r, mask=ok_node)
        x_root = tl.sum(tl.where(root_member & (root_rank == r), tok_j, 0), axis=2).to(tl.int32)
        tl.store(base + r0 * POS_REC + POS_TOK + r, x_root, mask=ok_root)
    _store_row_use(use_ptr, b[:, None], n, ok_root, ok_node, is_first, k, first, k_root, first_root, K, G)


@triton.jit
def _store_row_use(use_ptr, b, n, ok_root, ok_node, is_first, k, first, k_root, first_root, K, G):
    """Marks the rows the row pass reads in use_ptr (zeroed by the launcher; [BB, 1] requests, [1, NP2]
    nodes): the root's target row and each position's (its first node's), and the draft row of each
    position's first candidate - scattered ones (distinct positions have distinct first candidates).
    Left unmarked: copies of the root row (chains k > 0), later siblings' draft rows, rows of nodes
    repeating a sibling's token."""
    one_root = tl.full(ok_root.shape, 1, tl.int8)
    one = tl.full(ok_node.shape, 1, tl.int8)
    tl.store(use_ptr + b * K * (G + 1) * 2, one_root, mask=ok_root)
    tl.store(use_ptr + _record(b, first_root, K, G, 0) * 2 + 1, one_root, mask=ok_root & (k_root > 0))
    tl.store(use_ptr + _record(b, n, K, G, 1) * 2, one, mask=ok_node & is_first)
    tl.store(use_ptr + _record(b, first, K, G, 0) * 2 + 1, one, mask=ok_node & (k > 0))
