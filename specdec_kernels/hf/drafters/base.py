"""What every drafter offers the session (:class:`Drafter`) and what it proposes (a Proposal).

A step of the session is draft -> target forward -> verify -> commit, whatever the drafter:

* ``drafter.propose(session, g)`` returns a :class:`ChainProposal` (K chains of g drafts hanging off
  the root, verified by ``sk.verify`` / ``sk.verify_multi``) or a :class:`TreeProposal` (a token tree
  with parents, verified by ``sk.verify_tree``), with the probabilities each draft was sampled from;
* the target scores root + proposal in one forward and the proposal verifies the logits;
* the session commits the target cache and tokens; the drafter commits its own state
  (``host_values`` before the step's one host synchronisation, ``update`` after it).

A new drafter (a dynamic tree, a grammar-aware one) subclasses :class:`Drafter` and returns one of
the two proposals; the session loop does not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import api as ops
from ..._params import SEED_RANGE
from ..drafting import chains_tree_parents


def _seeds(A: int, generator: torch.Generator, device) -> torch.Tensor:
    """[A] the verifier's per-request seeds, drawn from the call's generator."""
    return torch.randint(0, SEED_RANGE, (A,), generator=generator).to(device)


def _chains_view(rows: torch.Tensor, K: int, G: int) -> torch.Tensor:
    """[A, K, G+1, X] of the forward's rows [A, 1 + K*G, X]: the root's row, then chain k's G rows."""
    A, X = rows.shape[0], rows.shape[-1]
    return torch.cat([rows[:, :1, None, :].expand(A, K, 1, X), rows[:, 1:].reshape(A, K, G, X)], dim=2)


@dataclass
class ChainProposal:
    """K chains of g drafts per request, each hanging off the root (the last committed token).

    drafts [A, K, g] int64; probs [A, K, g, V] fp32, the exact probabilities each draft was sampled
    from (handed to the verifier as ``draft_probs``; None when greedy or for one-hot drafts);
    n_drafts [A] int64 drafts offered per request (None: all g); draft_forwards: forwards spent.
    """

    drafts: torch.Tensor
    probs: torch.Tensor | None = None
    n_drafts: torch.Tensor | None = None
    draft_forwards: int = 0

    @property
    def depth(self) -> int:
        """The longest path the verifier can accept (its output has depth + 1 token columns)."""
        return self.drafts.shape[2]

    def offered(self) -> torch.Tensor:
        """[A] drafts offered per request."""
        if self.n_drafts is not None:
            return self.n_drafts
        A = self.drafts.shape[0]
        return torch.full((A,), self.depth, dtype=torch.long, device=self.drafts.device)

    def nodes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The target forward's tree below the root: tokens [A, N], parents [A, 1 + N] (root first,
        -1), node counts [A] with the root (None: all)."""
        A, K, g = self.drafts.shape
        parents = chains_tree_parents(K, g, self.drafts.device).expand(A, 1 + K * g)
        return self.drafts.reshape(A, K * g), parents, None if self.n_drafts is None else 1 + self.n_drafts

    def verify(
        self, logits: torch.Tensor, method: str, sampling: dict, generator, chain_rule: str = "token", bitmask=None
    ):
        """The fused verification of the target's logits [A, 1 + K*g, V]; returns (out, path), path
        [A, g] the accepted nodes' forward indices (1 + chain*g + slot), -1 padding. chain_rule: K = 1's
        rule (``sk.verify``'s method: "token" or "block"). bitmask: grammar words [A, 1 + K*g, W] of
        the target's rows (``token_bitmask``) or None."""
        A, N, V = logits.shape
        A, K, G = self.drafts.shape
        device = logits.device
        seeds = _seeds(A, generator, device)
        draft_kw = {} if self.probs is None else {"draft_probs": self.probs}
        # validate=False: every input here is built by the driver (ids < V, probabilities normalised),
        # and value checks would synchronise with the GPU once per step.
        if K == 1:
            draft_kw = {name: rows[:, 0] for name, rows in draft_kw.items()}
            out = ops.verify(
                logits,
                self.drafts[:, 0],
                **draft_kw,
                token_bitmask=bitmask,
                num_draft_tokens=self.n_drafts,
                seed=seeds,
                validate=False,
                method=chain_rule,
                **sampling,
            )
            slots = torch.arange(1, G + 1, device=device).expand(A, G)
            path = torch.where(slots <= out.num_accepted.long()[:, None], slots, -1)
            return out, path
        rows, words = _chains_view(logits, K, G), None if bitmask is None else _chains_view(bitmask, K, G)
        out = ops.verify_multi(
            rows, self.drafts, **draft_kw, token_bitmask=words, seed=seeds, method=method, validate=False, **sampling
        )
        path = torch.where(out.accepted_nodes >= 0, out.accepted_nodes + 1, -1)
        return out, path


@dataclass
class TreeProposal:
    """A token tree per request, as ``sk.verify_tree`` takes it (nodes past num_nodes pad).

    tokens [A, N] int64; parents [A, N] int64 (-1 = child of the root); num_nodes [A] int64;
    max_depth [A] int64, the depth each request offers; depth, the deepest path any step can have;
    probs [A, N, V] fp32, the law each node was drawn from (None when greedy).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    max_depth: torch.Tensor
    depth: int
    probs: torch.Tensor | None = None
    draft_forwards: int = 0

    def offered(self) -> torch.Tensor:
        return self.max_depth

    def nodes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        root = torch.full_like(self.parents[:, :1], -1)
        return self.tokens, torch.cat([root, self.parents.clamp_min(-1) + 1], dim=1), 1 + self.num_nodes

    def verify(
        self, logits: torch.Tensor, method: str, sampling: dict, generator, chain_rule: str = "token", bitmask=None
    ):
        """``sk.verify_tree`` of the target's logits [A, 1 + N, V]; (out, path) as for chains (a tree
        has no chain rule: ``SpecConfig`` refuses verification="block" for trees); bitmask: grammar
        words [A, 1 + N, W] of the target's rows or None."""
        seeds = _seeds(logits.shape[0], generator, logits.device)
        draft_kw = {} if self.probs is None else {"draft_probs": self.probs}
        out = ops.verify_tree(
            logits,
            self.tokens,
            self.parents,
            **draft_kw,
            token_bitmask=bitmask,
            num_nodes=self.num_nodes,
            seed=seeds,
            method=method,
            max_depth=self.depth,
            validate=False,
            **sampling,
        )
        return out, torch.where(out.accepted_nodes >= 0, out.accepted_nodes + 1, -1)  # forward slots


@dataclass
class Verified:
    """One step's verification, as the drafter's commit sees it (per active request, device)."""

    proposal: ChainProposal | TreeProposal
    out: object  # the verifier's output (tokens, num_accepted, ...)
    path: torch.Tensor  # [A, depth] forward indices of the accepted nodes, -1 padding
    accepted: torch.Tensor  # [A] int64
    finished: torch.Tensor  # [A] bool: the request leaves the batch after this step
    accepted_host: list[int] | None = None  # the same as ``accepted``, after the step's transfer


class Drafter:
    """The interface of a drafter (subclass it; the defaults suit a stateless drafter).

    Attributes: ``keeps_history`` (the session keeps host copies of every request's tokens for it),
    ``reads_target_hidden`` (the target's prefill keeps every position's output-layer input),
    ``max_tree_nodes`` / ``max_depth`` (bounds of any proposal: cache and token room).
    """

    keeps_history: bool = False
    reads_target_hidden: bool = False
    max_tree_nodes: int = 0
    max_depth: int = 0

    def enter(self, stack) -> None:
        """Enter the contexts the drafter needs for the whole call on ``stack`` (an ExitStack)."""

    def start(self, session) -> None:
        """Prefill the drafter's state for ``session.prompts`` (after the target's prefill)."""

    def propose(self, session, g: int) -> ChainProposal | TreeProposal:
        """Drafts for every active request (``g`` per chain: the step's draft length)."""
        raise NotImplementedError

    def host_values(self, session, verified: Verified) -> list[torch.Tensor]:
        """0-d device tensors the drafter needs on the host (sent with the step's one transfer)."""
        return []

    def update(self, session, verified: Verified, host: list[int]) -> None:
        """Commit the drafter's state to the accepted path (``host``: its ``host_values``)."""

    def select(self, index: torch.Tensor, positions: list[int]) -> None:
        """Keep the active requests at ``positions`` (the same as a device index [A']); finished
        ones leave."""

    def length_policy(self, session):
        """A draft-length policy (``choose`` / ``record``) or None: every step drafts G."""
        return None
