"""Grammar token bitmasks (``token_bitmask=`` of ``sk.verify``, ``sk.verify_tree``, ``sk.verify_multi``).

Layout (the one xgrammar's ``fill_next_token_bitmask`` and llguidance produce): int32 words, bit j
of word w set = token 32 w + j allowed; one row of W = ceil(V / 32) words per target row, so the
mask has the target rows' leading shape: ``[B, G+1, W]`` (padded chain), ``[N + B, W]`` (flattened,
``cu_num_draft_tokens``), ``[B, N+1, W]`` (``verify_tree``), ``[B, K, G+1, W]`` (``verify_multi``).
Bits past V in the last word are ignored. Any strides are accepted.

Semantics: a disallowed token's logit is -inf before temperature, top-k and top-p, in the target
row and in the draft-logits row verified at that position (the draft sampled under the same grammar
state): chain draft row i uses mask row i (flattened: draft n of request b uses target row n + b);
tree node i uses the mask of the target row at which it is a candidate, row parents[i] + 1 (row 0
for the root's children); verify_multi draft row [k, i] uses mask [k, i]. draft_probs are used as
given. Under vocabulary shards each rank passes the words of its own slice [lo, hi): W_r =
ceil((hi - lo) / 32) words, bit j of word w = global token lo + 32 w + j - the same local layout.

This module checks masks and applies them as one masked copy of the rows (the backends without a
native mask path run on that copy; the csrc programs - the CPU build's row pass and the CUDA
kernels - test the bits as they read each row and the Triton kernels test each entry's bit as they
read it, ``ops/triton/helpers.allowed_tile``; see ``_dispatch.NATIVE_MASK_BACKENDS``);
``reference/sampling.py`` states the rule independently.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ._types import DRAFT_LOGITS

BITS_PER_WORD = 32  # xgrammar / llguidance pack 32 token bits into each int32 word
# Rows unpacked at once: bounds the temporary [rows, W, 32] int32 bit table to ~64 MiB.
UNPACK_ELEMENTS = 1 << 24


def num_words(V: int) -> int:
    """W = ceil(V / 32): words per mask row for a vocabulary (or shard) of V entries."""
    return (V + BITS_PER_WORD - 1) // BITS_PER_WORD


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """The int32 words [..., W] of a bool allow-mask [..., V] (for callers holding booleans, and the
    benchmarks): bit j of word w = allowed[..., 32 w + j]."""
    V = allowed.shape[-1]
    padded = torch.zeros(*allowed.shape[:-1], num_words(V) * BITS_PER_WORD, dtype=torch.int32, device=allowed.device)
    padded[..., :V] = allowed
    bits = padded.unflatten(-1, (num_words(V), BITS_PER_WORD))
    words = torch.zeros(bits.shape[:-1], dtype=torch.int32, device=allowed.device)
    for j in range(BITS_PER_WORD):
        words |= bits[..., j] << j  # j = 31 sets the sign bit
    return words


def check_token_bitmask(mask, rows: tuple, V: int, device, layout: str) -> torch.Tensor | None:
    """The mask (None stays None) after checking it: an int32 tensor of shape ``rows + (W,)`` on
    ``device``. ``layout`` names the expected shape in the error message. ValueError otherwise."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"token_bitmask must be a torch.Tensor of int32 words, got {type(mask).__name__}")
    if mask.dtype != torch.int32:
        raise ValueError(
            f"token_bitmask must hold int32 words (bit j of word w = token 32w + j allowed), got {mask.dtype}"
        )
    if mask.device != device:
        raise ValueError(f"token_bitmask is on {mask.device} but target_logits is on {device}")
    want = tuple(rows) + (num_words(V),)
    if tuple(mask.shape) != want:
        raise ValueError(
            f"token_bitmask must have shape {layout} = {list(want)} (W = ceil(V / 32) = {num_words(V)} words for "
            f"V = {V}), got {list(mask.shape)}"
        )
    return mask


def allowed(mask: torch.Tensor, V: int) -> torch.Tensor:
    """bool [..., V]: the allowed tokens of mask rows [..., W]."""
    bit = torch.ones((), dtype=torch.int32, device=mask.device) << torch.arange(
        BITS_PER_WORD, dtype=torch.int32, device=mask.device
    )  # 1 << 31 wraps to INT32_MIN: still the sign bit
    return ((mask.unsqueeze(-1) & bit) != 0).flatten(-2)[..., :V]


# The masked copy selects bits on the logits' integer view: (x & keep) | (-inf & ~keep) with keep
# all ones or zeros per entry, a few vectorised passes (masked_fill with a bool mask was ~2x slower on CPU).
_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def masked_rows(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of logits [..., V] with -inf at the tokens mask [..., W] disallows."""
    V, W = logits.shape[-1], mask.shape[-1]
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if out.numel() == 0:  # no rows, or an empty vocabulary shard: nothing to mask
        return out
    itype = _SAME_WIDTH_INT[logits.dtype]
    neg_inf = torch.full((), float("-inf"), dtype=logits.dtype).view(itype).item()
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=mask.device)
    src, dst, words = logits.reshape(-1, V).view(itype), out.view(-1, V).view(itype), mask.reshape(-1, W)
    step = max(1, UNPACK_ELEMENTS // max(1, W * BITS_PER_WORD))
    for start in range(0, dst.shape[0], step):
        rows = slice(start, start + step)
        keep = ((words[rows, :, None] >> shifts) & 1).to(itype).neg_().flatten(1)[:, :V]  # -1: allowed
        torch.bitwise_or(src[rows] & keep, (~keep) & neg_inf, out=dst[rows])
    return out


def chain_draft_mask(mask: torch.Tensor, cu: torch.Tensor | None, num_drafts: int) -> torch.Tensor:
    """The mask rows of the draft rows of a chain: [B, G, W] (padded: rows 0 .. G-1 of each
    request) or [N, W] (flattened: draft n of request b is scored at target row n + b)."""
    if cu is None:
        return mask[:, : mask.shape[1] - 1]
    n = torch.arange(num_drafts, device=mask.device)
    request = torch.bucketize(n, cu[1:], right=True)  # b with cu[b] <= n < cu[b + 1]; no host sync
    return mask[(n + request).clamp(max=mask.shape[0] - 1)]


def tree_draft_mask(mask: torch.Tensor, parents: torch.Tensor | None) -> torch.Tensor:
    """The mask rows [B, K, G, W] of the draft rows of a tree in the K-chains view (mask
    [B, K, G+1, W]): verify_multi row [k, i] uses [k, i]; verify_tree node i (K = 1) the row of
    its parent, parents[i] + 1 (0 for the root's children; clamped so unchecked ids stay in range)."""
    if parents is None:
        return mask[:, :, : mask.shape[2] - 1]
    N = parents.shape[1]
    rows = (parents.to(torch.int64).clamp(-1, N - 1) + 1)[:, :, None].expand(-1, -1, mask.shape[-1])
    return torch.gather(mask[:, 0], 1, rows)[:, None]


def apply_chain_mask(args):
    """VerifyArgs with the mask applied: masked copies of the target and of draft logits (draft
    probabilities are used as given), ``token_bitmask`` None. Unchanged without a mask."""
    mask = args.token_bitmask
    if mask is None:
        return args
    draft = args.draft
    if args.draft_mode == DRAFT_LOGITS:
        draft = masked_rows(draft, chain_draft_mask(mask, args.cu, draft.shape[0]))
    return replace(args, target_logits=masked_rows(args.target_logits, mask), draft=draft, token_bitmask=None)


def apply_tree_mask(args):
    """TreeArgs with the mask applied (see :func:`apply_chain_mask`)."""
    mask = args.token_bitmask
    if mask is None:
        return args
    draft = args.draft
    if args.draft_mode == DRAFT_LOGITS:
        draft = masked_rows(draft, tree_draft_mask(mask, args.parents))
    return replace(args, target=masked_rows(args.target, mask), draft=draft, token_bitmask=None)


def padded_mask(mask: torch.Tensor | None, target_rows: torch.Tensor) -> torch.Tensor | None:
    """The flattened layout's mask [N + B, W] gathered into the padded one [B, G+1, W]."""
    return None if mask is None else mask[target_rows]
