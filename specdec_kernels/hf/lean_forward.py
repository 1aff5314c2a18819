"""A leaner forward for Llama-family models on the CPU: transformers' ops, in transformers' order.

Why this exists. A decoding draft forward of the 0.5B Qwen2.5-Coder draft takes ~36 ms on the 2-core
AMD EPYC (1 thread, int8 linears), and ~3 ms of it are transformers' Python around the ops: module
calls and their hook machinery, keyword plumbing through every layer, the cache and mask
abstractions, output dataclasses. This forward walks the same modules and runs the same tensor ops
in the same order on the same inputs, so its logits and cache are *bit-identical* to the model's own
forward (tested), and skips the rest. Measured on that draft (one query, 300 cached tokens, CPU time,
median of 25 interleaved): see docs/performance.md.

Where it runs (:func:`lean_forward_applies`; otherwise the model's own forward does): Llama, Qwen2 and
Mistral causal LMs (their decoder layers are the same code: pre-norm attention with rotary position
embeddings, SwiGLU MLP) on the CPU, switched to the "specdec_tree" attention, inference (no grad, no
module hooks), no sliding window, a ``DynamicCache`` whose every layer already holds the prompt (the
driver's caches after prefill). Anything else takes the model's forward: never a different result.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from .attention import ATTN_NAME, _tree_attention_forward

# Model classes whose decoder layer is the one replayed below (same ops, same order: transformers 5)
_MODELS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer")


def lean_forward_applies(model, cache, device) -> bool:
    """Whether :func:`lean_forward` gives this call the model's own result (module docstring);
    ``SPECDEC_LEAN_FORWARD=0`` in the environment: never (the model's forward, for comparisons)."""
    if os.environ.get("SPECDEC_LEAN_FORWARD") == "0":
        return False
    if torch.device(device).type != "cpu" or torch.is_grad_enabled() or model.training:
        return False
    if model.config._attn_implementation != ATTN_NAME or not _model_fits(model):
        return False
    layers = getattr(cache, "layers", None)
    if layers is None or getattr(cache, "offloading", False) or len(layers) != len(model.model.layers):
        return False
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)


def _model_fits(model) -> bool:
    """The model's structure is the replayed one and nothing hooks into it (hooks would be skipped)."""
    if type(model).__name__ not in _MODELS:
        return False
    cached = getattr(model, "_specdec_lean_fits", None)
    if cached is None:
        cached = _structure_fits(model)
        model._specdec_lean_fits = cached
    return cached and not _any_hooks(model)


def _structure_fits(model) -> bool:
    body = model.model
    if len(body.layers) != model.config.num_hidden_layers or getattr(model.config, "pretraining_tp", 1) != 1:
        return False
    for layer in body.layers:
        att, mlp = layer.self_attn, layer.mlp
        if type(layer).__name__ not in _LAYERS or getattr(att, "sliding_window", None) is not None:
            return False
        if hasattr(att, "q_norm") or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return False
    return getattr(model.config, "sliding_window", None) is None or type(model).__name__ == "Qwen2ForCausalLM"


def _any_hooks(model) -> bool:
    """Whether a forward (pre-)hook is registered anywhere in the model (a plain walk over the module
    tree: ~0.1 ms for a 24-layer model, against ~1 ms for ``model.modules()``'s named walk)."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    stack = [model]
    while stack:
        m = stack.pop()
        if m._forward_hooks or m._forward_pre_hooks:
            return True
        stack.extend(c for c in m._modules.values() if c is not None)
    return False


def lean_forward(model, cache, ids: torch.Tensor, position_ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
    """The model's logits for ``ids`` [B, N] at ``position_ids`` [B, N], appending their keys and
    values to ``cache`` (within an active tree-attention context, as the model's forward would be
    called); ``keep`` > 0: the last ``keep`` positions only (``logits_to_keep``). Call only where
    :func:`lean_forward_applies`."""
    body = model.model
    apply_rotary = _modeling_module(type(model)).apply_rotary_pos_emb  # the model's own function
    hidden = body.embed_tokens.forward(ids)
    cos, sin = body.rotary_emb.forward(hidden, position_ids)
    B, N = ids.shape
    for layer, kv in zip(body.layers, cache.layers, strict=True):
        att, mlp = layer.self_attn, layer.mlp
        residual = hidden
        x = layer.input_layernorm.forward(hidden)
        shape = (B, N, -1, att.head_dim)
        q = att.q_proj.forward(x).view(shape).transpose(1, 2)
        k = att.k_proj.forward(x).view(shape).transpose(1, 2)
        v = att.v_proj.forward(x).view(shape).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        keys, values = kv.update(k, v)  # the cache layer's own append
        out, _ = _tree_attention_forward(att, q, keys, values, None, dropout=0.0, scaling=att.scaling)
        hidden = residual + att.o_proj.forward(out.reshape(B, N, -1).contiguous())
        residual = hidden
        x = layer.post_attention_layernorm.forward(hidden)
        hidden = residual + mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x))
    hidden = body.norm.forward(hidden)
    return model.lm_head.forward(hidden[:, -keep:, :] if keep else hidden)


@functools.lru_cache(maxsize=8)
def _modeling_module(model_type: type):
    """The ``transformers`` module that defines the model class (its ``apply_rotary_pos_emb``)."""
    return sys.modules[model_type.__module__]
