"""Tiny random Hugging Face models built from configs (no download)."""

from __future__ import annotations

import torch


def tiny_model(
    kind: str = "llama",
    *,
    vocab: int = 97,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    init_std: float = 0.2,
    attn: str = "sdpa",
    **config,
):
    """A tiny random causal LM; a large init std gives peaked next-token distributions (few argmax ties)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),  # sliding_window=4096 by default
    }[kind]
    config = config_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        initializer_range=init_std,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        **config,
    )
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return model_cls(config).eval()


def fixed_logits_model(row: list[float]):
    """A tiny causal LM whose logits are ``row`` at every position: a zero output layer with the row as bias."""
    model = tiny_model("llama", vocab=len(row), layers=1, hidden=16, heads=2, kv_heads=1)
    head = torch.nn.Linear(16, len(row), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(torch.tensor(row, dtype=torch.float32))
    model.lm_head = head
    return model


def perfect_draft_run(row: list[float], samples: int, *, max_new_tokens: int, **kw):
    """``samples`` generations from the prompt [3] of a fixed-logits target with a perfect draft (a
    copy of it: every token after the first follows an accepted draft); ``kw`` go to
    speculative_generate (temperature, seed, num_drafts, ...). One draft every step (adaptive
    drafting off: it would take target-only steps, a draft as large as the target never paying)."""
    import copy

    from specdec_kernels.hf import speculative_generate

    target = fixed_logits_model(row)
    prompts = torch.full((samples, 1), 3)
    kw = dict(num_draft_tokens=1, eos_token_id=[], adaptive_draft=False) | kw
    return speculative_generate(target, copy.deepcopy(target), prompts, max_new_tokens=max_new_tokens, **kw)
