"""Dynamic draft trees from any draft model (``draft_tree="dynamic"``): the draft grows a token tree
each step, shaped by its own probabilities, and ``sk.verify_tree`` verifies it exactly.

Growth, depth by depth (one batched draft forward per depth over that depth's nodes):

* forward 0 feeds the uncached committed tokens (as the chain drafter: 1 or 2 per request) and gives
  the root's q row; forward d (d >= 1) feeds the depth-d nodes, which attend to the committed prefix
  (shared cache) and to their own ancestors only (tree attention masks), and gives their q rows;
* every fed node proposes k = ``tree_width`` children: its top-k tokens when greedy, or, when
  sampling, the first k draws of one sequential sample *without replacement* from its q row (the
  exponential race / Gumbel-top-k of ``medusa.candidate_tokens``, on the call's generator);
* a child of rank r (the r-th draw) scores its parent's score times the r-th largest probability of
  the parent's q row; the depth-d nodes of the tree are the best min(k, budget left) candidates at
  depth d by score (ties: earlier parent, then lower rank), so the tree has at most N nodes, at most
  k per depth and per parent, and ceil(N / k) depths. When greedy the r-th candidate *is* the
  r-th most likely token, so scores are the paths' draft probabilities.

Exactness when sampling (``method="rrs_wor"``, each node's draft row = its parent's q row):

1. Each node's children in the tree are a prefix, in draw order, of one sequential without-replacement
   sample from exactly the q row passed for them: ranks are kept in order (a lower rank never scores
   less, and wins ties) and the draws are fresh randomness, independent of everything drawn before.
2. Whether a depth-d node is in the tree depends only on the scores of the depth-d candidates and
   on the shallower tree: on q rows and on the draws at depths < d, never on the depth-d draws
   themselves (a child's score uses the probability of its *rank*, not of the token drawn there),
   and never on the verifier's random numbers (drawn after the tree is built). So when the walk of
   rejection sampling reaches a node, the number of its children is fixed by what the walk has
   already seen plus randomness independent of the children's tokens, which is what recursive
   rejection sampling without replacement needs at every node (the argument of our Medusa trees).

Scoring a child by the probability of the token actually drawn would break (2): a node would be kept
or dropped according to its own token, and the kept children would no longer be distributed as q.

Under a grammar (``grammar=``, ``hf/grammar.py``) every fed node's row is masked with the grammar
state of its own path before its children are drawn or ranked (one host read of the depth's nodes per
depth), so every node is valid and its draft row is the masked law it was drawn from; the verifier
masks the target's rows with the same words (``token_bitmask``). The tree's shape stays a function
of q rows (now the masked ones) and of earlier draws only, so points 1 and 2 hold as they stand.

Cache invariant between steps (as the chain drafter's): the draft cache holds every committed token
but the last u (1, or 2 when the accepted path reached the tree's last depth, whose nodes were never
fed). After the step the cache keeps the fed nodes of the accepted path, gathered into place.
"""

from __future__ import annotations

import math

import torch

from .. import drafting
from ..attention import TreeAttentionMetadata
from ..config import is_number
from ..draft_length import draft_cost_estimate
from ..forwards import forward, gen_for
from ..medusa import MIN_RANK_PROB, candidate_tokens
from ..tree_budget import MAX_CHAIN, TreeBudgetPolicy
from .base import TreeProposal, Verified
from .model import ModelDrafter


def tree_depths(num_nodes: int, width: int) -> list[int]:
    """The nodes each depth may hold: ``width`` per depth until the budget ``num_nodes`` is spent."""
    return [min(width, num_nodes - d * width) for d in range(math.ceil(num_nodes / width))]


class DynamicTreeDrafter(ModelDrafter):
    """``num_draft_tokens`` = N tree nodes besides the root, ``tree_width`` = k children per node."""

    def __init__(self, model, config):
        super().__init__(model, config)
        N, self.width = config.num_draft_tokens, config.tree_width
        self.per_depth = tree_depths(N, self.width)  # this step's nodes per depth
        chain = min(N, MAX_CHAIN) if config.adaptive_draft and self.width > 1 else 0  # the chain fallback
        self.max_tree_nodes, self.max_depth = N, max(len(self.per_depth), chain)
        self.node_slot = None  # [A, N] each node's draft-cache slot (from the step's first), -1: never fed
        self.policy: TreeBudgetPolicy | None = None

    def length_policy(self, session):
        """adaptive_draft: the step's tree (depth, or a chain) from past steps (``hf/tree_budget.py``);
        else every step grows the N-node tree of width k."""
        cfg = self.config
        if not cfg.adaptive_draft:
            return None
        measured = cfg.draft_cost == "measured" or (cfg.draft_cost is None and cfg.greedy)
        cost = cfg.draft_cost if is_number(cfg.draft_cost) else draft_cost_estimate(session.target, self.model)
        self.policy = TreeBudgetPolicy(cfg.num_draft_tokens, self.width, float(cost), measured)
        return self.policy

    @staticmethod
    def _children(logits: torch.Tensor, probs, gen, k: int):
        """Candidates [A, F, k] and the log-probabilities of their ranks [A, F, k] (-inf: no node)."""
        if probs is None:  # greedy: the top-k tokens, scored by their draft probabilities
            top = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
            return top.indices, top.values
        log_sorted = torch.topk(torch.log(probs), k, dim=-1).values
        # as for Medusa: ranks below MIN_RANK_PROB (q's sorted probabilities only) get no node
        log_sorted = log_sorted.masked_fill(log_sorted < math.log(MIN_RANK_PROB), float("-inf"))
        return candidate_tokens(probs, logits, (k,), greedy=False, generator=gen), log_sorted

    def propose(self, session, g: int) -> TreeProposal:
        grammar = session.grammar
        if session.processor is not grammar:  # SpecConfig refuses it; a drafter used directly must too
            raise ValueError("draft_tree='dynamic' does not support logits processors yet")
        k = self.policy.width if self.policy is not None else self.width
        self.per_depth = tree_depths(g, k)
        batch, device, V = session.batch, session.device, session.V
        greedy, sampling = self.config.greedy, self.config.sampling
        A, u, U = len(batch.rows), self.uncached, max(self.uncached_host)
        fed_slots = U + sum(self.per_depth[:-1])
        self.fed = (self.length, U)
        session.check_room("draft", self.length, fed_slots)
        logits, meta0 = self._first_forward(session)
        # grammar: per request, the draft tokens on each node's path (the rows' prefixes; None: no node)
        paths = None if grammar is None else [[] for _ in range(A)]
        if grammar is not None:  # the root's row follows the committed tokens
            logits = grammar(session, logits[:, None], [[[]]] * A)[:, 0]
        gen = gen_for(session.generator, device)
        probs = None if greedy else drafting.draft_distribution(logits, **sampling)
        # the candidates of the depth being built: tokens, scores, parent (node index), parent's q row
        cand, log_rank = self._children(logits[:, None], None if probs is None else probs[:, None], gen, k)
        cand_score, cand_parent = log_rank.reshape(A, k), torch.full((A, k), -1, device=device)
        cand_q = None if probs is None else probs[:, None]  # [A, F, V]: candidate c was drawn from row c // k
        cand, rows = cand.reshape(A, k), []
        tokens, parents, valid, slots, depths, bits = [], [], [], [], [], []
        root_bits = (torch.ones_like(u) << u) - 1
        next_slot, arange_a = U, torch.arange(A, device=device)[:, None]
        for d, width in enumerate(self.per_depth, start=1):
            # keep the best `width` candidates (stable: earlier parent, lower rank first on ties)
            order = torch.sort(-cand_score, dim=1, stable=True).indices[:, :width]
            score = cand_score.gather(1, order)
            ok = score > float("-inf")
            parent = cand_parent.gather(1, order)
            tokens.append(torch.where(ok, cand.gather(1, order), 0))
            parents.append(torch.where(ok, parent, -1))
            valid.append(ok)
            depths.append(torch.full_like(parent, d))
            if cand_q is not None:
                rows.append(cand_q[arange_a, order // k])
            if d == len(self.per_depth):
                slots.append(torch.full_like(parent, -1))
                break
            # feed the depth-d nodes: each attends to the committed prefix and its own ancestors
            slot = next_slot + torch.arange(width, device=device)
            next_slot += width
            slots.append(slot.expand(A, width))
            all_bits = torch.cat(bits, dim=1) if bits else root_bits[:, None]
            up = torch.where(parent >= 0, all_bits.gather(1, parent.clamp_min(0)), root_bits[:, None])
            own = torch.where(ok, up, root_bits[:, None]) | (torch.ones_like(parent) << slot)
            bits.append(own)
            positions = (self.cached + u - 1 + d)[:, None].expand(A, width)
            meta = TreeAttentionMetadata(
                meta0.key_start, meta0.prefix_end, meta0.tree_start, own, positions, fed_slots, meta0.backend
            )
            logits = forward(self.model, self.cache, tokens[-1], meta, V)  # [A, width, V]
            self.length += width
            if grammar is not None:  # each node's row follows its own path: its children obey the grammar
                logits = grammar(session, logits, _extend_paths(paths, tokens[-1], parents[-1], ok))
            probs = None if greedy else drafting.draft_distribution(logits, **sampling)
            cand, log_rank = self._children(logits, probs, gen, k)  # [A, width, k]
            cand_score = (score[:, :, None] + log_rank).reshape(A, width * k)
            first = sum(self.per_depth[: d - 1])  # node index of this depth's first node
            cand_parent = (first + torch.arange(width, device=device))[None, :, None].expand(A, width, k)
            cand_parent, cand = cand_parent.reshape(A, width * k), cand.reshape(A, width * k)
            cand_q = probs
        return self._compact(tokens, parents, valid, slots, depths, rows)

    def _compact(self, tokens, parents, valid, slots, depths, rows) -> TreeProposal:
        """The nodes of every depth, padding moved to the end (parents renumbered)."""
        ok = torch.cat(valid, dim=1)
        A, N = ok.shape
        order = torch.sort((~ok).long(), dim=1, stable=True).indices  # real nodes first, in order
        new_index = torch.empty_like(order).scatter_(1, order, torch.arange(N, device=ok.device).expand(A, N))
        pick = lambda t: torch.cat(t, dim=1).gather(1, order)  # noqa: E731
        parent = pick(parents)
        parent = torch.where(parent >= 0, new_index.gather(1, parent.clamp_min(0)), -1)
        kept = ok.gather(1, order)
        depth = torch.where(kept, pick(depths), 0)
        self.node_slot = torch.where(kept, pick(slots), -1)
        probs = None
        if rows:
            probs = torch.cat(rows, dim=1)[torch.arange(A, device=ok.device)[:, None], order]
        num = kept.long().sum(dim=1)
        D = len(self.per_depth)
        return TreeProposal(pick(tokens), parent, num, depth.max(dim=1).values, D, probs, D)

    def _commit_slots(self, verified: Verified):
        """Draft-cache slots to keep [A, U + D - 1] and their counts: the u committed tokens fed by
        forward 0, then the accepted path's fed nodes (every depth but the last)."""
        (S, U), D = self.fed, verified.proposal.depth
        path, accepted, u = verified.path, verified.accepted, self.uncached
        j = torch.arange(U + D - 1, device=accepted.device)[None, :]
        t = (j - u[:, None]).clamp(0, max(D - 1, 1) - 1)  # index into the path of the j-th kept slot
        node = (path.gather(1, t) - 1).clamp_min(0)  # forward slot 1 + node index
        src = torch.where(j < u[:, None], S + j, S + self.node_slot.gather(1, node).clamp_min(0))
        kept = u + torch.clamp(accepted, max=D - 1)
        return src, torch.where(verified.finished, 0, kept)


def _extend_paths(paths: list[list], tokens: torch.Tensor, parents: torch.Tensor, ok: torch.Tensor) -> list[list]:
    """Appends one depth's nodes (tokens, parents (-1: the root), ok [A, width]) to ``paths`` (per
    request, each node's draft tokens from the root, None for no node) and returns their paths as the
    grammar takes them: a slot without a node gets the root's ([]), read by no child (score -inf)."""
    rows = []
    for path, tok, par, real in zip(paths, tokens.tolist(), parents.tolist(), ok.tolist(), strict=True):
        new = [(path[p] if p >= 0 else []) + [t] if r else None for t, p, r in zip(tok, par, real, strict=True)]
        path.extend(new)
        rows.append([[] if n is None else n for n in new])
    return rows
