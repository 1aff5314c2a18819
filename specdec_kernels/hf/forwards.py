"""The model forwards of the driver: prefill, tree-attention forwards, the compiled target forward."""

from __future__ import annotations

import functools
import inspect

import torch

from .attention import TreeAttentionMetadata, tree_attention_context
from .cache import cache_kwargs
from .lean_forward import lean_forward, lean_forward_applies


def prefill(model, prompts: list[list[int]], device, static_len: int | None = None, every_position: bool = False):
    """Cache every prompt token but the last, left-aligned (right padding), through plain SDPA, in a
    ``DynamicCache`` or (``static_len`` slots) a ``StaticCache``. Its logits are not used: the output
    layer runs on the last position only (a prompt's worth of vocabulary rows otherwise: 15-30% of a
    1.5B / 0.5B Qwen prefill) unless ``every_position``."""
    # Full-attention cache layers for every model: a sliding-window layer would drop its oldest keys
    # and break "slot key_start + t holds position t"; the tree backend applies the window itself.
    from transformers import DynamicCache
    from transformers.cache_utils import Cache, StaticLayer

    if static_len is None:
        cache = DynamicCache()
    else:
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        cache = Cache(layers=[StaticLayer(max_cache_len=static_len) for _ in range(layers)])
        if not all(hasattr(layer, "cumulative_length") for layer in cache.layers):
            raise RuntimeError("cache_implementation='static' needs transformers >= 5.4 (StaticLayer write counters)")
    width = max(len(p) for p in prompts) - 1
    if width <= 0:
        return cache
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p) - 1] = torch.tensor(p[:-1])
        mask[b, : len(p) - 1] = 1
    positions = torch.arange(width).expand(len(prompts), width)
    model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        use_cache=True,
        **cache_kwargs(model, cache),
        **({} if every_position else last_logits_only(model)),
    )
    return cache


def forward(
    model, cache, ids: torch.Tensor, meta: TreeAttentionMetadata, V: int, compiled=None, keep_last: bool | int = False
) -> torch.Tensor:
    """The model's logits [A, N, V] for the N input tokens, or [A, n, V] (the last n; True: 1) with
    ``keep_last`` when the model can restrict its output layer (else [A, N, V] all the same: callers
    index from the end)."""
    with tree_attention_context(meta):
        if compiled is None and lean_forward_applies(model, cache, ids.device):  # bit-identical, less Python
            keep = int(keep_last) if keep_last and _takes_logits_to_keep(type(model)) else 0
            return lean_forward(model, cache, ids, meta.position_ids, keep)[..., :V]
        if compiled is None:
            kw = last_logits_only(model, int(keep_last)) if keep_last else {}
            kw.update(cache_kwargs(model, cache))
            out = model(input_ids=ids, position_ids=meta.position_ids, use_cache=True, **kw)
        else:  # the metadata as an argument: its tensors become graph inputs (the context is not traceable)
            kw = cache_kwargs(model, cache)
            out = compiled(input_ids=ids, position_ids=meta.position_ids, use_cache=True, specdec_tree=meta, **kw)
    return out.logits[..., :V]


def last_logits_only(model, n: int = 1) -> dict:
    """``{"logits_to_keep": n}`` where the model's forward takes it (``transformers`` causal LMs):
    the output layer, V rows of the hidden size, then runs on the last n positions only."""
    return {"logits_to_keep": n} if _takes_logits_to_keep(type(model)) else {}


@functools.cache
def _takes_logits_to_keep(model_type: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_type.forward).parameters


def compiled_forward(model, compile_target: bool | dict, device):
    """``torch.compile(model.forward)`` with the driver's defaults, or None when not asked for."""
    if not compile_target:
        return None
    options = dict(fullgraph=True, dynamic=False)
    if torch.device(device).type == "cuda":
        options["mode"] = "reduce-overhead"  # CUDA graphs: one replay per verification step
    if isinstance(compile_target, dict):
        options.update(compile_target)
    return torch.compile(model.forward, **options)


def gen_for(generator: torch.Generator, device) -> torch.Generator | None:
    """torch.multinomial needs a generator on the tensor's device; CPU runs use the seeded one."""
    return generator if torch.device(device).type == "cpu" else None
