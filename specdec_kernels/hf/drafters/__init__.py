"""Drafters: what proposes the tokens the target verifies (see ``base`` for the interface)."""

from __future__ import annotations

from .base import ChainProposal, Drafter, TreeProposal, Verified
from .dynamic_tree import DynamicTreeDrafter
from .lookup import PromptLookupDrafter
from .medusa import MedusaDrafter
from .model import ModelDrafter


def build_drafter(config, target, draft) -> Drafter:
    """The drafter ``config.drafter`` names ("model", "prompt_lookup", "medusa")."""
    if config.drafter == "model":
        return DynamicTreeDrafter(draft, config) if config.draft_tree == "dynamic" else ModelDrafter(draft, config)
    if config.drafter == "prompt_lookup":
        return PromptLookupDrafter(config)
    return MedusaDrafter(target, config.medusa_heads, config)


__all__ = [
    "ChainProposal",
    "Drafter",
    "DynamicTreeDrafter",
    "MedusaDrafter",
    "ModelDrafter",
    "PromptLookupDrafter",
    "TreeProposal",
    "Verified",
    "build_drafter",
]
