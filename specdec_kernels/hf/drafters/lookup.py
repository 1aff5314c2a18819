"""Prompt lookup: one chain of n-gram drafts from each request's own tokens, no draft model."""

from __future__ import annotations

import torch

from ..drafting import prompt_lookup
from .base import ChainProposal, Drafter


class PromptLookupDrafter(Drafter):
    """Drafts up to g tokens per request by n-gram lookup (host work on the tokens the step transfer
    keeps); the drafts are one-hot, so the verifier needs no draft probabilities."""

    keeps_history = True

    def __init__(self, config):
        self.max_tree_nodes = self.max_depth = config.num_draft_tokens

    def propose(self, session, g: int) -> ChainProposal:
        history, rows = session.tokens.history, session.batch.rows
        proposals = prompt_lookup([history[b] for b in rows], g)
        drafts = torch.zeros(len(proposals), 1, g, dtype=torch.long)
        for a, p in enumerate(proposals):
            drafts[a, 0, : len(p)] = torch.tensor(p, dtype=torch.long)
        n = torch.tensor([len(p) for p in proposals], dtype=torch.long)
        return ChainProposal(drafts.to(session.device), None, n.to(session.device))
