"""KV-cache bookkeeping for speculative decoding on Hugging Face caches.

Layout kept by the driver: request b's committed tokens occupy cache slots [0, C_b) of every layer
(left-aligned; slots past C_b are stale). A verification forward appends its tree at the shared end
S of the cache; afterwards ``commit_paths`` gathers each request's accepted root-to-node path into
[C_b, C_b + len) and crops the cache to the longest request. Nothing committed is ever recomputed.

Works on any cache whose layers expose ``keys``/``values`` tensors [B, H, S, D] (transformers >= 4.56
``DynamicCache``), on the legacy ``key_cache``/``value_cache`` lists, and on ``StaticCache``: there
the buffers keep their fixed [B, H, max_cache_len, D] shape and address (what torch.compile and CUDA
graphs need), the path is moved in place, and "cropping" only moves each layer's write counter
(``cumulative_length``, where the next forward writes) back to ``new_len``.
"""

from __future__ import annotations

import functools
import inspect

import torch


def cache_kwargs(model, cache) -> dict:
    """The KV cache as the keyword the model's forward takes: ``cache`` where transformers renamed
    it (``past_key_values`` is deprecated there, with a FutureWarning per call), else
    ``past_key_values``."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_type: type) -> str:
    parameters = inspect.signature(model_type.forward).parameters  # follows the deprecation wrapper
    return "cache" if "cache" in parameters and "past_key_values" not in parameters else "past_key_values"


def _layers(cache):
    """(get, set) pairs over the layers' key and value tensors."""
    if hasattr(cache, "layers"):
        for layer in cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            yield layer, "keys", "values"
    else:  # transformers < 4.56
        for i in range(len(cache.key_cache)):
            yield _LegacyLayer(cache, i), "keys", "values"


class _LegacyLayer:
    def __init__(self, cache, i):
        self.cache, self.i = cache, i

    @property
    def keys(self):
        return self.cache.key_cache[self.i]

    @keys.setter
    def keys(self, t):
        self.cache.key_cache[self.i] = t

    @property
    def values(self):
        return self.cache.value_cache[self.i]

    @values.setter
    def values(self, t):
        self.cache.value_cache[self.i] = t


def _is_static(layer) -> bool:
    return hasattr(layer, "max_cache_len") and hasattr(layer, "cumulative_length")


def cache_length(cache) -> int:
    """Slots in use (the shared end S where the next forward appends)."""
    for layer, k, _ in _layers(cache):
        if _is_static(layer):
            return int(layer.cumulative_length)
        return getattr(layer, k).shape[-2]
    return 0


def commit_paths(cache, src: torch.Tensor, dst_start: torch.Tensor, lengths: torch.Tensor, new_len: int) -> None:
    """Move each request's accepted slots into place and crop the cache to ``new_len`` slots.

    Args:
        src:       [B, M] int64 cache slots to keep, in order (entries >= lengths[b] are ignored).
        dst_start: [B] int64: request b's first destination slot (its committed length C_b).
        lengths:   [B] int64: how many of src[b] are real.
        new_len:   slots to keep afterwards (>= max(dst_start + lengths)).
    """
    B, M = src.shape
    if M == 0:
        _crop(cache, new_len)
        return
    i = torch.arange(M, device=src.device)[None, :]
    real = i < lengths[:, None]
    dst = dst_start[:, None] + i
    # Padding entries copy a slot onto itself (read before any write), so scatter indices stay unique.
    src = torch.where(real, src, dst)
    for layer, kname, vname in _layers(cache):
        for name in (kname, vname):
            t = getattr(layer, name)
            H, D = t.shape[1], t.shape[3]
            gathered = torch.gather(t, 2, src[:, None, :, None].expand(B, H, M, D))
            t.scatter_(2, dst[:, None, :, None].expand(B, H, M, D), gathered)
    _crop(cache, new_len)


def _crop(cache, new_len: int) -> None:
    for layer, kname, vname in _layers(cache):
        if _is_static(layer):  # fixed buffers: stale slots stay, masked by the tree metadata
            layer.cumulative_length.fill_(new_len)
            continue
        for name in (kname, vname):
            t = getattr(layer, name)
            if t.shape[2] > new_len:
                setattr(layer, name, t[:, :, :new_len])


def select_requests(cache, index: torch.Tensor) -> None:
    """Keep only the requests in ``index`` (finished requests stop costing memory and compute)."""
    for layer, kname, vname in _layers(cache):
        for name in (kname, vname):
            setattr(layer, name, getattr(layer, name).index_select(0, index))
        if _is_static(layer):
            layer.batch_size = int(index.numel())
            # As StaticCache does at allocation: a compiled forward (CUDA graphs) then writes these
            # buffers in place instead of copying them in as inputs or skipping the graph.
            torch._dynamo.mark_static_address(getattr(layer, kname))
            torch._dynamo.mark_static_address(getattr(layer, vname))
