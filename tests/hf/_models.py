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
