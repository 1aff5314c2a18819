"""Argument checking for multi-draft / tree verification (shared by kernels and references).

Layout: every tree is viewed as K chains of G slots ([B, K, G] tokens, [B, K, G+1, V] target
rows): node i is chain i // G, slot i % G; its target row is [k, i % G + 1], its draft row
[k, i % G]; the root's target row is [0, 0]. ``verify_tree`` is the case K = 1, G = N with explicit
parents; ``verify_multi`` is K independent chains (implicit parents) - a forest whose shared
prefixes are merged by the walk itself (siblings spelling the same token are one position, their
children pooled with multiplicity).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._bitmask import check_token_bitmask
from ._params import INT_DTYPES, SamplingParams
from ._types import DRAFT_NONE, MAX_DEPTH, MAX_NODES, METHODS
from ._validation import (
    _capturing,
    _check_draft,
    _check_ids,
    _check_tensor,
    _last_dim_contiguous,
    _require,
    check_counts,
    check_target,
    counts_cpu,
)


@dataclass
class TreeArgs:
    target: torch.Tensor  # [B, K, G+1, V]
    tokens: torch.Tensor  # [B, K, G] int
    parents: torch.Tensor | None  # [B, N] int (verify_tree) or None (chains of verify_multi)
    draft: torch.Tensor | None  # [B, K, G, V]
    draft_mode: int
    sampling: SamplingParams
    num_nodes: torch.Tensor | None  # [B] int (contiguous), None = N
    method: str
    max_depth: int  # D: accepted tokens per request at most (output width D + 1)
    token_bitmask: torch.Tensor | None = None  # [B, K, G+1, ceil(V/32)] int32 grammar words (_bitmask)

    B = property(lambda self: self.target.shape[0])
    K = property(lambda self: self.target.shape[1])
    G = property(lambda self: self.target.shape[2] - 1)
    V = property(lambda self: self.target.shape[3])
    N = property(lambda self: self.target.shape[1] * (self.target.shape[2] - 1))

    @property
    def has_filter(self) -> bool:
        return self.sampling.has_filter(self.V)

    def per_request_cpu(self) -> dict[str, torch.Tensor]:
        params = self.sampling.per_request_cpu(self.B)
        params["num_nodes"] = counts_cpu(self.num_nodes, self.B, self.N)
        return params

    def parents_cpu(self) -> torch.Tensor:
        """[B, N] parents; chains get i - 1 within a chain and -1 at each chain's first slot."""
        if self.parents is not None:
            return self.parents.cpu().to(torch.int64)
        i = torch.arange(self.N)
        slots = max(self.G, 1)  # G = 0: no nodes (N = 0), nothing is divided
        chain_parent = torch.where(i % slots == 0, torch.full_like(i, -1), i - 1)
        return chain_parent.expand(self.B, -1)


def node_depths(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """[B, N] depth of every node (1 for children of the root, 0 for padding); parents on CPU."""
    B, N = parents.shape
    depth = torch.zeros(B, N, dtype=torch.int64)
    for i in range(N):  # parents[b, i] < i: one sweep in index order
        par = parents[:, i]
        from_parent = torch.where(par >= 0, depth.gather(1, par.clamp(0, N - 1)[:, None])[:, 0], torch.zeros_like(par))
        depth[:, i] = torch.where(i < num_nodes, from_parent + 1, torch.zeros_like(par))
    return depth


def check_tree_args(
    target_logits, tokens, parents, draft_logits, draft_probs, temperature, top_k, top_p, seed, num_nodes, method,
    max_depth, *, validate: bool = True, multi: bool = False, top_p_ties: str = "keep", token_bitmask=None,
) -> TreeArgs:  # fmt: skip
    """Checked arguments of ``sk.verify_tree`` (parents) and ``sk.verify_multi`` (``multi``: K chains);
    ``token_bitmask`` has the target's leading shape (``_bitmask``), kept in the K-chains view."""
    device = check_target(target_logits, 4 if multi else 3)
    tok_name = "draft_tokens" if multi else "tree_tokens"
    if multi:
        B, K, G1, V = target_logits.shape
        G = G1 - 1
        # G = 0 (no drafts) is one bonus token per request from the root row [0, 0]; K = 0 has no
        # root row to draw it from, so it is an error rather than a guess.
        _require(
            K >= 1,
            "verify_multi needs K >= 1 chains: target_logits row [:, 0, 0] scores the root (the bonus token "
            f"when nothing is accepted); for no drafts pass K >= 1 chains of G = 0 drafts "
            f"([B, K, 1, V] logits, [B, K, 0] draft_tokens), got target_logits {tuple(target_logits.shape)}",
        )
        _require(G >= 0, f"target_logits must be [B, K, G+1, V] with G+1 >= 1 rows, got {tuple(target_logits.shape)}")
        _check_tensor(tok_name, tokens, 3, INT_DTYPES, device)
        _require(
            tuple(tokens.shape) == (B, K, G),
            f"draft_tokens must have shape [B, K, G] = [{B}, {K}, {G}], got {tuple(tokens.shape)}",
        )
        draft, mode = _check_draft(draft_logits, draft_probs, (B, K, G), V, device)
        target = target_logits
    else:
        B, N1, V = target_logits.shape
        N = N1 - 1
        _require(N >= 0, "target_logits must have N+1 >= 1 rows")
        _check_tensor(tok_name, tokens, 2, INT_DTYPES, device)
        _require(
            tuple(tokens.shape) == (B, N), f"tree_tokens must have shape [B, N] = [{B}, {N}], got {tuple(tokens.shape)}"
        )
        _check_tensor("parents", parents, 2, INT_DTYPES, device)
        _require(
            tuple(parents.shape) == (B, N), f"parents must have shape [B, N] = [{B}, {N}], got {tuple(parents.shape)}"
        )
        draft, mode = _check_draft(draft_logits, draft_probs, (B, N), V, device)
        target, tokens = target_logits[:, None], tokens[:, None]
        draft = draft[:, None] if draft is not None else None
        K, G = 1, N
    _require(V >= 1, "target_logits has an empty vocabulary dimension")
    _require(K * G <= MAX_NODES, f"at most {MAX_NODES} tree nodes are supported, got {K * G}")
    _require(method in METHODS, f"method must be one of {sorted(METHODS)}, got {method!r}")
    sampling = SamplingParams.check(B, device, temperature, top_k, top_p, seed, top_p_ties)
    num_nodes = check_counts("num_nodes", num_nodes, B, device)
    if max_depth is not None:
        _require(
            isinstance(max_depth, int) and 0 <= max_depth <= MAX_DEPTH,
            f"max_depth must be an int in [0, {MAX_DEPTH}], got {max_depth!r}",
        )
    layout = "[B, K, G+1, W]" if multi else "[B, N+1, W]"
    mask = check_token_bitmask(token_bitmask, target_logits.shape[:-1], V, device, layout)
    mask = mask if mask is None or multi else mask[:, None]
    tokens = _last_dim_contiguous(tokens)  # the walk indexes slots with stride 1
    parents = _last_dim_contiguous(parents) if parents is not None else None
    args = TreeArgs(
        _last_dim_contiguous(target),
        tokens,
        parents,
        draft,
        mode,
        sampling,
        num_nodes,
        method,
        max_depth if max_depth is not None else (G if multi else K * G),
        token_bitmask=mask,
    )
    if validate and not _capturing(device) and B > 0:
        depth = _validate_tree_values(args, tok_name)
        if max_depth is None and not multi:
            args.max_depth = depth  # the tightest output width (costs the sync validation does anyway)
    return args


def _validate_tree_values(args: TreeArgs, tok_name: str, V: int | None = None) -> int:
    """Value checks (one host synchronisation); returns the deepest tree's depth. V: the vocabulary
    the ids index (default the logits' last dimension; the full vocabulary for shards)."""
    params = args.per_request_cpu()
    SamplingParams.check_values(params)
    B, N, V = args.B, args.N, args.V if V is None else V
    n = params["num_nodes"]
    bad_n = (n < 0) | (n > N)
    _require(not bool(bad_n.any()), f"num_nodes must be in [0, N={N}]; got {n[bad_n][:4].tolist()}")
    used = torch.arange(N)[None, :] < n[:, None]
    tokens = args.tokens.cpu().reshape(B, N)
    _check_ids(tok_name, tokens, used, V)
    parents = args.parents_cpu()
    if args.parents is not None:
        idx = torch.arange(N)[None, :]
        bad = used & ((parents < -1) | (parents >= idx))
        if bool(bad.any()):
            b, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"parents must be topological (-1 for the root's children, else parents[b, i] < i, so no cycles): "
                f"parents[{b}, {i}] = {int(parents[b, i])}"
            )
    depth = node_depths(parents, n)
    deepest = int(depth.max()) if depth.numel() else 0
    _require(deepest <= args.max_depth, f"a tree is {deepest} deep but max_depth={args.max_depth}")
    if args.method == "rrs_wor" and args.draft_mode != DRAFT_NONE:
        same_parent = parents[:, :, None] == parents[:, None, :]
        same_token = tokens[:, :, None] == tokens[:, None, :]
        both = used[:, :, None] & used[:, None, :] & ~torch.eye(N, dtype=torch.bool)[None]
        _require(
            not bool((same_parent & same_token & both).any()),
            "method='rrs_wor' needs siblings with distinct tokens (drafts sampled without replacement)",
        )
    return deepest


def validate_sharded_tree_values(args: TreeArgs, V: int, multi: bool) -> int | None:
    """Value checks of a vocabulary-parallel call (``process_group=``): ids against the full
    vocabulary V (the sum of the shards). Returns the deepest tree's depth (None if B = 0)."""
    if args.B == 0:
        return None
    return _validate_tree_values(args, "draft_tokens" if multi else "tree_tokens", V)
