"""Medusa heads: a token tree from heads on the target's last hidden state (``hf/medusa.py``).

The heads read the hidden state at the last accepted node, captured from the previous verification
forward (or the prefill) by a hook on the target's output layer: no forward of their own. The tree
keeps the N best nodes of the heads' Cartesian product and is verified by ``sk.verify_tree``.
"""

from __future__ import annotations

import contextlib

import torch

from .. import medusa as _medusa
from ..forwards import gen_for
from .base import Drafter, TreeProposal, Verified


class LMHeadInput:
    """Keeps the input of the model's output layer (the last hidden states, [B, T, H]) of its
    latest forward: a forward pre-hook, so the heads need no forward of their own."""

    def __init__(self, model):
        layer = model.get_output_embeddings()
        if layer is None:
            raise ValueError("drafter='medusa' needs a target with an output layer (get_output_embeddings())")
        self.value = None
        self.handle = layer.register_forward_pre_hook(self._keep)

    def _keep(self, module, args):
        self.value = args[0]


@contextlib.contextmanager
def lm_head_input(model):
    capture = LMHeadInput(model)
    try:
        yield capture
    finally:
        capture.handle.remove()


class MedusaDrafter(Drafter):
    """``num_draft_tokens`` = N tree nodes, ``num_drafts`` = s candidates per head."""

    reads_target_hidden = True

    def __init__(self, target, heads, config):
        self.target, self.heads, self.config = target, heads, config
        self.max_tree_nodes = config.num_draft_tokens
        self.max_depth = heads.num_heads
        self.capture: LMHeadInput | None = None
        self.hidden: torch.Tensor | None = None  # [A, H] the heads' input: hidden state at each last accepted node
        self.cartesian = None  # medusa.CartesianTree over (num_drafts,) * heads

    def enter(self, stack) -> None:
        self.capture = stack.enter_context(lm_head_input(self.target))

    def start(self, session) -> None:
        """The heads' first input: the last hidden state of each prompt's prefill (position len - 2,
        the token before the root); zeros for one-token prompts (no prefill: the first tree then
        comes from a zero state, which costs acceptance, not exactness)."""
        device, heads = session.device, self.heads
        self.cartesian = _medusa.cartesian_tree((self.config.num_drafts,) * heads.num_heads, device)
        lens = torch.tensor([len(p) for p in session.prompts], device=device)
        B = lens.shape[0]
        if max(len(p) for p in session.prompts) <= 1 or self.capture.value is None:
            self.hidden = torch.zeros(B, heads.hidden_size, device=device)
            return
        h = self.capture.value[torch.arange(B, device=device), (lens - 2).clamp_min(0)]
        self.hidden = torch.where((lens >= 2)[:, None], h, torch.zeros_like(h))

    def propose(self, session, g: int) -> TreeProposal:
        head_logits = self.heads(self.hidden)[..., : session.V]  # [A, D, V]
        tree = _medusa.medusa_tree(
            head_logits,
            self.cartesian,
            self.config.num_draft_tokens,
            self.config.sampling,
            generator=gen_for(session.generator, session.device),
            sampler=_medusa.candidate_tokens,  # looked up per call (tests swap in wrong variants)
        )
        return TreeProposal(tree.tokens, tree.parents, tree.num_nodes, tree.max_depth, self.heads.num_heads, tree.probs)

    def update(self, session, verified: Verified, host: list[int]) -> None:
        """The next heads' input: the target's hidden state at the last accepted node (or the root)."""
        path, n = verified.path, verified.accepted
        last = torch.where(n > 0, path.gather(1, (n - 1).clamp_min(0)[:, None])[:, 0], 0)
        self.hidden = self.capture.value[torch.arange(path.shape[0], device=path.device), last]

    def select(self, index: torch.Tensor, positions: list[int]) -> None:
        self.hidden = self.hidden[index]
