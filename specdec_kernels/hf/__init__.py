"""Hugging Face integration: the tree-attention backend and the speculative decoding driver.

Importing this module needs ``transformers``; the core package does not.
"""

from .attention import (
    ATTN_NAME,
    TreeAttentionMetadata,
    register_tree_attention,
    tree_attention_context,
    tree_attention_metadata,
    using_tree_attention,
)
from .generate import SpeculativeOutput, SpeculativeStats, speculative_generate
from .integration import CUSTOM_GENERATE
from .medusa import MedusaHeads

__all__ = [
    "ATTN_NAME",
    "CUSTOM_GENERATE",
    "MedusaHeads",
    "SpeculativeOutput",
    "SpeculativeStats",
    "TreeAttentionMetadata",
    "register_tree_attention",
    "speculative_generate",
    "tree_attention_context",
    "tree_attention_metadata",
    "using_tree_attention",
]
