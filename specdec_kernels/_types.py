"""Names every layer shares: output types, draft modes, tree methods, size limits, backends.

The bottom layer of the package (see CONTRIBUTING.md): it imports nothing from specdec_kernels, so
kernels, references, the dispatch layer and the public functions can all use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# How the draft distribution q is given (a kernel constexpr).
DRAFT_NONE = 0  # one-hot q on the draft token (n-gram / prompt-lookup / greedy drafters)
DRAFT_LOGITS = 1  # raw draft logits, processed like the target (temperature, top-k, top-p)
DRAFT_PROBS = 2  # the exact probabilities the draft sampled from, used as given

# Tree / multi-draft verification methods, with the id the kernels take.
METHODS = {"kseq": 0, "rrs": 1, "rrs_wor": 2}
VERIFY_METHODS = ("token", "block")  # chain verification rules: sk.verify's method=, the driver's verification=
MAX_NODES = 64  # the tree walk keeps node sets as 64-bit masks
MAX_DEPTH = 64

# Verification backends; "auto" picks one of the others per call (see specdec_kernels._dispatch).
BACKENDS = ("auto", "triton", "cuda", "cpu", "vectorized", "torch")


@dataclass(kw_only=True)
class LogprobFields:
    """The output fields of ``return_logprobs=True`` / ``num_logprobs=n`` (None unless asked for).

    logprobs:        [*, D+1] float32: log p(token) under its position's processed target
                     distribution (NaN where tokens == -1); for trees the accepted path's positions.
    top_logprob_ids: [*, D+1, n] int64 and top_logprobs [*, D+1, n] float32: the top-n of it.
    """

    logprobs: torch.Tensor | None = None
    top_logprob_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


@dataclass
class VerifyOutput(LogprobFields):
    """Result of :func:`specdec_kernels.verify`.

    tokens:       [B, G+1] int64: accepted drafts, then one recovered-or-bonus token, then -1.
    num_accepted: [B] int32: number of accepted drafts (the emitted token sits at this index).
    nonfinite:    [B] bool: the request met a NaN/+inf logit (treated as -inf), an unusable
                  draft_probs entry (NaN, +inf or negative; treated as 0) or a row with no finite
                  logit in a row it used; its tokens are valid ids but you may want to abort it.
    logprobs, top_logprob_ids, top_logprobs: :class:`LogprobFields` (D = G).
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    nonfinite: torch.Tensor


@dataclass
class TreeVerifyOutput(LogprobFields):
    """Result of :func:`specdec_kernels.verify_tree` / :func:`specdec_kernels.verify_multi`.

    tokens:         [B, D+1] int64: accepted path tokens, one recovered-or-bonus token, then -1.
    num_accepted:   [B] int32: length of the accepted path.
    accepted_nodes: [B, D] int64: node index of each accepted token (a root-to-node path), -1 padding;
                    for verify_multi node = chain * G + slot. Use it to compact the KV cache.
    nonfinite:      [B] bool: the request met NaN/+inf logits (treated as -inf), unusable draft_probs
                    entries (NaN, +inf, negative; treated as 0) or an empty row.
    logprobs, top_logprob_ids, top_logprobs: :class:`LogprobFields`.
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    accepted_nodes: torch.Tensor
    nonfinite: torch.Tensor


@dataclass
class TreeMetadata:
    """Result of :func:`specdec_kernels.tree_metadata`.

    depth:          [B, N] int32: 1 for children of the root, d for nodes d deep; 0 for padding.
                    position_ids of tree tokens = prefix_len + depth - 1.
    ancestor_mask:  [B, N] int64: bit j set iff node j is node i or one of its ancestors
                    (the tree-attention mask row of node i); 0 for padding.
    """

    depth: torch.Tensor
    ancestor_mask: torch.Tensor
