"""Tree attention as a ``transformers`` attention implementation ("specdec_tree").

Registering adds one name to ``AttentionInterface`` and ``AttentionMaskInterface``. A model switched
to it behaves exactly as with "sdpa" (same function, same masks) *unless* a tree forward is active:
inside ``with tree_attention_context(meta):`` (or with ``specdec_tree=meta`` passed to the model
call) every attention layer runs :func:`specdec_kernels.ops.tree_attention.tree_attention_from_masks`
on the layer's cached keys and values, and the dense mask is never built.

Cache layout the metadata describes, per request b (keys of one layer, after the cache update):

    [key_start[b], prefix_end[b])     committed tokens (left padding before, stale slots after)
    tree_start[b] + j                  tree node j, appended by this forward (j < 64)

Example (verify a token tree on top of a DynamicCache holding ragged prefixes):

    >>> register_tree_attention(); model.set_attn_implementation("specdec_tree")
    >>> meta = tree_attention_metadata(parents, prefix_lens, cache_len=cache.get_seq_length())
    >>> with tree_attention_context(meta):
    ...     logits = model(input_ids=tree_tokens, position_ids=meta.position_ids, cache=cache).logits

(``past_key_values=cache`` on transformers releases before the keyword's rename; ``cache.cache_kwargs``
picks the one a model takes.)
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch

from .._types import MAX_NODES
from ..ops.tree_attention import (
    tree_attention_allowed,
    tree_attention_from_masks,
    tree_attention_grouped,
    tree_attention_sdpa,
    tree_attention_torch,
    window_start,
)
from ..ops.tree_metadata import tree_metadata

ATTN_NAME = "specdec_tree"
# CPU "auto": forwards of at most this many queries (draft forwards, a chain's verification forward
# of up to 8 drafts + the root, a target-only step) run tree_attention_grouped, the rest PyTorch's
# fused SDPA. Measured per layer (2-core AMD EPYC, 1 thread, grouped / SDPA, us; 2026-11-27, torch
# 2.13): fp32 12 x 128 heads, 300 keys: 1 query 95 / 113, 5 queries 202 / 278, 9 queries 307 / 370;
# 1,200 keys: 5 queries 625 / 1,014; bf16 14 x 64 heads, 300 keys, 1 query 92 / 480. Over B 1-8,
# 100-1,200 keys, fp32 and bf16, 14 x 64 / 12 x 128 / 32 x 8 x 128 heads, grouped won or tied at
# <= 9 queries (1.0-2.4x); from 12 on it was mixed (0.5-1.2x).
GROUPED_MAX_QUERIES = 9

_ACTIVE: contextvars.ContextVar[TreeAttentionMetadata | None] = contextvars.ContextVar("specdec_tree", default=None)
# Dynamo cannot trace ContextVar.get: while torch.compile traces, the mask builder and the attention
# layers read this plain mirror instead (set and restored together with _ACTIVE).
_TRACE_MIRROR: list[TreeAttentionMetadata | None] = [None]


@dataclass
class TreeAttentionMetadata:
    """What every attention layer of one tree forward needs; built once per step.

    key_start, prefix_end, tree_start: [B] int32 (see the module docstring).
    query_masks:  [B, Nq] int64: bit j set iff query n may attend tree slot j; 0 = padding query.
    position_ids: [B, Nq] int64: rotary positions of the query tokens (pass them to the model).
    tree_slots:   number of tree slots the masks reference (<= 64).
    backend:      "auto" (the Triton kernel on CUDA; elsewhere, where Triton only has its slow
                  interpreter, PyTorch's fused SDPA over the dense mask), "triton", or "torch"
                  (``tree_attention_torch``: the matmul path guarded against NaN in unattended keys).
    """

    key_start: torch.Tensor
    prefix_end: torch.Tensor
    tree_start: torch.Tensor
    query_masks: torch.Tensor
    position_ids: torch.Tensor
    tree_slots: int = MAX_NODES
    backend: str = "auto"
    # The PyTorch path's dense [B, Nq, S] masks per (cache length, sliding window): the same for
    # every layer of a forward, so built by its first layer only.
    dense_masks: dict = field(default_factory=dict, repr=False, compare=False)


def tree_attention_metadata(
    parents: torch.Tensor,
    prefix_lens: torch.Tensor,
    cache_len: int | torch.Tensor,
    *,
    num_nodes: torch.Tensor | None = None,
    key_start: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> TreeAttentionMetadata:
    """Metadata for a forward whose N input tokens are the nodes of a tree (parents as in ``sk.verify_tree``).

    Args:
        parents:     [B, N] int: -1 for children of the root, else an earlier node.
        prefix_lens: [B] int: committed tokens of request b are cache slots [key_start[b], prefix_lens[b]).
        cache_len:   the cache length before this forward: the tree is appended at that slot.
        num_nodes:   [B] int, ragged trees (trailing nodes are padding).
        key_start:   [B] int, first real cache slot (left padding), default 0.
        backend:     see :class:`TreeAttentionMetadata`.
        validate:    check parents / num_nodes values (a host sync); the driver, which builds them, skips it.

    position_ids = prefix_lens - key_start + depth - 1: node positions continue each request's own
    sequence, whatever the cache's padding.
    """
    B, N = parents.shape
    device = parents.device
    meta = tree_metadata(parents, num_nodes, validate=validate)
    prefix_end = prefix_lens.to(device=device, dtype=torch.int32)
    start = torch.zeros_like(prefix_end) if key_start is None else key_start.to(device=device, dtype=torch.int32)
    tree_start = torch.as_tensor(cache_len, device=device, dtype=torch.int32).expand(B).contiguous()
    position_ids = (prefix_end - start).long()[:, None] + meta.depth.long() - 1
    position_ids = position_ids.clamp_min(0)  # padding nodes (depth 0) get a harmless position
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    return TreeAttentionMetadata(start, prefix_end, tree_start, meta.ancestor_mask, position_ids, N, backend)


@contextlib.contextmanager
def tree_attention_context(meta: TreeAttentionMetadata):
    """Within the block, "specdec_tree" layers attend with ``meta`` (and skip dense-mask construction)."""
    token = _ACTIVE.set(meta)
    previous, _TRACE_MIRROR[0] = _TRACE_MIRROR[0], meta
    try:
        yield meta
    finally:
        _ACTIVE.reset(token)
        _TRACE_MIRROR[0] = previous


def active_tree_metadata() -> TreeAttentionMetadata | None:
    if torch.compiler.is_compiling():
        return _TRACE_MIRROR[0]
    return _ACTIVE.get()


# Attention-function arguments that change the math and that the tree kernel does not implement.
_UNSUPPORTED_FEATURES = ("softcap", "s_aux", "sinks", "position_bias")


def _tree_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface entry: query [B, Hq, Nq, D], key/value [B, Hkv, S, D] -> ([B, Nq, Hq, D], None)."""
    meta = kwargs.pop("specdec_tree", None) or active_tree_metadata()
    if meta is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    unsupported = [name for name in _UNSUPPORTED_FEATURES if kwargs.get(name) is not None]
    if unsupported:  # silently ignoring them would give wrong attention (Gemma 2 softcaps, gpt-oss sinks)
        raise NotImplementedError(f"specdec_tree attention does not support {', '.join(unsupported)} yet")
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    window_lo = _window_lower_bounds(meta, int(window)) if window else None
    _require_shape(meta, query)
    use_kernel = meta.backend == "triton" or (meta.backend == "auto" and query.device.type == "cuda")
    args = (query, key, value, meta.key_start, meta.prefix_end, meta.tree_start, meta.query_masks, scaling)
    if use_kernel:
        out = tree_attention_from_masks(*args, tree_slots=meta.tree_slots, window_lo=window_lo)
    else:
        mask = _dense_mask(meta, key.shape[2], window, window_lo)
        if meta.backend == "torch":
            out = tree_attention_torch(*args, tree_slots=meta.tree_slots, window_lo=window_lo, allowed=mask)
        elif query.shape[2] <= GROUPED_MAX_QUERIES:  # CPU "auto", a few queries (module constant)
            out = tree_attention_grouped(query, key, value, mask, scaling)
        else:  # CPU "auto": SDPA's fused kernel over the dense mask, as transformers' "sdpa" runs
            out = tree_attention_sdpa(query, key, value, mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def _dense_mask(meta: TreeAttentionMetadata, S: int, window, window_lo) -> torch.Tensor:
    """The forward's dense mask over S keys for the PyTorch path: every layer of a forward has the
    same one, so the first builds it and the others reuse it (while torch.compile traces, the graph
    builds it instead: the memo must not become part of it)."""
    key = (S, int(window) if window else None)
    mask = None if torch.compiler.is_compiling() else meta.dense_masks.get(key)
    if mask is None:
        mask = tree_attention_allowed(
            meta.key_start,
            meta.prefix_end,
            meta.tree_start,
            meta.query_masks,
            S,
            tree_slots=meta.tree_slots,
            window_lo=window_lo,
        )
        if not torch.compiler.is_compiling():
            meta.dense_masks[key] = mask
    return mask


def _window_lower_bounds(meta: TreeAttentionMetadata, window: int) -> torch.Tensor:
    """[B, Nq] int32 bounds for a sliding-window layer (see :func:`window_start`)."""
    if window < meta.tree_slots:
        raise NotImplementedError(
            f"specdec_tree attention: sliding window {window} is narrower than the tree ({meta.tree_slots} slots)"
        )
    return window_start(meta.key_start, meta.position_ids, window)


def _require_shape(meta: TreeAttentionMetadata, query: torch.Tensor) -> None:
    B, _, Nq, _ = query.shape
    if tuple(meta.query_masks.shape) != (B, Nq):
        raise ValueError(
            f"tree metadata is for {tuple(meta.query_masks.shape)} (batch, tokens) but the forward has ({B}, {Nq})"
        )


def _tree_mask(*args, **kwargs):
    """Mask builder: none during a tree forward (the kernel has the bitmasks), SDPA's otherwise."""
    if active_tree_metadata() is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


_REGISTERED = False


def register_tree_attention() -> str:
    """Register "specdec_tree" with transformers (idempotent); returns the name to pass as attn_implementation."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(ATTN_NAME, _tree_attention_forward)
        AttentionMaskInterface.register(ATTN_NAME, _tree_mask)
        _REGISTERED = True
    return ATTN_NAME


@contextlib.contextmanager
def using_tree_attention(model):
    """Temporarily switch ``model`` to "specdec_tree" (restores its previous implementation)."""
    register_tree_attention()
    if getattr(model.config, "attn_logit_softcapping", None):
        raise NotImplementedError(
            f"{type(model).__name__} softcaps its attention logits; specdec_tree attention does not support that yet"
        )
    previous = model.config._attn_implementation
    if previous == ATTN_NAME:
        yield model
        return
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
