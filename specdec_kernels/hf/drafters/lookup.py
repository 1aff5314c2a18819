"""Prompt lookup: one chain of n-gram drafts from each request's own tokens, no draft model."""

from __future__ import annotations

import torch

from ..drafting import prompt_lookup
from .base import ChainProposal, Drafter


class PromptLookupDrafter(Drafter):
    """Drafts up to g tokens per request by n-gram lookup (host work on the tokens the step transfer
    keeps); the drafts are one-hot, so the verifier needs no draft probabilities. Under a grammar a
    lookup chain is cut at its first token the grammar refuses (it could never be accepted)."""

    keeps_history = True

    def __init__(self, config):
        self.max_tree_nodes = self.max_depth = config.num_draft_tokens

    def propose(self, session, g: int) -> ChainProposal:
        history, rows = session.tokens.history, session.batch.rows
        proposals = prompt_lookup([history[b] for b in rows], g)
        if session.grammar is not None:  # offer only what the grammar allows (rejected anyway: p = 0)
            proposals = [p[: session.grammar.valid_prefix(b, p)] for b, p in zip(rows, proposals, strict=True)]
        drafts = torch.zeros(len(proposals), 1, g, dtype=torch.long)
        for a, p in enumerate(proposals):
            drafts[a, 0, : len(p)] = torch.tensor(p, dtype=torch.long)
        n = torch.tensor([len(p) for p in proposals], dtype=torch.long)
        return ChainProposal(drafts.to(session.device), None, n.to(session.device))
