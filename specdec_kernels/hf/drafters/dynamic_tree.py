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

Prompt lookup (``prompt_lookup=True``): the n-gram continuation of each request's committed tokens
(``drafting.prompt_lookup``, the rule of ``drafter="prompt_lookup"``, cut where a grammar refuses it)
is one branch from the root, one node per depth (at most the step's depth). Its node at depth d is the
child of its node at depth d - 1 and is always among the depth's kept nodes (it takes one of the
depth's slots: the budget of N nodes, k per depth, is unchanged); the draft model's candidates of the
lookup node's parent exclude the lookup token, so a lookup token the model would also propose is one
node (the model's path continues under it) and never two. The lookup node is fed like any node and
scored by its draft probability, so its model children compete for the next depth's slots.

A step where some request has a lookup match is a *deterministic* tree (the model's children are
its top-k, as when greedy) verified **one-hot** (``sk.verify_tree`` without draft probabilities):
at a node whose candidates are x_1, x_2, ... (fixed before the verifier draws), x_j is accepted with
probability p_j(x_j), p_j being p with x_1..x_(j-1) removed and renormalised, and when all are
rejected the token is drawn from p without them. Then P(emit y) = p(y) for *any* candidates (the
sequential elimination samples p exactly), and so, node by node along the walk, the output follows
the target exactly when sampling too. A lookup token is not a draw from q, so it cannot join a
sibling set verified with ``rrs_wor`` (the kernel reads one q row per sibling set and would treat it
as one): when sampling, the steps with a match trade rrs_wor's acceptance for one-hot's, the steps
without one are the sampled trees above. Greedy verification accepts any tree (output identical to
``generate``).

Cache invariant between steps (as the chain drafter's): the draft cache holds every committed token
but the last u (1, or 2 when the accepted path reached the tree's last depth, whose nodes were never
fed). After the step the cache keeps the fed nodes of the accepted path, gathered into place.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from .. import drafting
from ..attention import TreeAttentionMetadata
from ..config import is_number
from ..draft_length import draft_cost_estimate, draft_row_cost_estimate, pair_step_times, row_cost_estimate
from ..forwards import forward, gen_for
from ..medusa import MIN_RANK_PROB, candidate_tokens
from ..tree_budget import MAX_CHAIN, TreeBudgetPolicy, learned_threshold_on, pair_row_costs, pair_tree_times
from .base import TreeProposal, Verified
from .model import ModelDrafter

MAX_SHAPED_DEPTH = MAX_CHAIN  # a shaped tree's depths (draft forwards per step): the chains' bound


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
        self.threshold = config.tree_threshold  # > 0: shaped trees (up to shaped_depth deep)
        self.shaped_depth = min(N, MAX_SHAPED_DEPTH) if self.threshold > 0.0 and self.width > 1 else 0
        self.max_tree_nodes, self.max_depth = N, max(len(self.per_depth), chain, self.shaped_depth)
        self.node_slot = None  # [A, N] each node's draft-cache slot (from the step's first), -1: never fed
        self.first_child = None  # (first [A, N], parent [A, N]) of this step's tree for chain_equivalent, or None
        self.policy: TreeBudgetPolicy | None = None
        self.prompt_lookup = config.prompt_lookup
        self.keeps_history = config.prompt_lookup  # the lookup reads the host copies of the tokens
        self.lookup_nodes: list[int] = []  # the last step's lookup-branch nodes per request (tests, benches)

    def length_policy(self, session):
        """adaptive_draft: the step's tree (depth, or a chain) from past steps (``hf/tree_budget.py``);
        else every step grows the N-node tree of width k."""
        cfg = self.config
        if not cfg.adaptive_draft:
            return None
        measured = cfg.draft_cost == "measured" or (cfg.draft_cost is None and cfg.greedy)
        cost = cfg.draft_cost if is_number(cfg.draft_cost) else draft_cost_estimate(session.target, self.model)
        # (a learned threshold changes what the arms' steps cost: its times are kept apart)
        settings = (cfg.num_draft_tokens, self.width, self.threshold, self.prompt_lookup, learned_threshold_on())
        self.policy = TreeBudgetPolicy(
            cfg.num_draft_tokens,
            self.width,
            float(cost),
            measured,
            max_depth=self.shaped_depth or None,
            times=pair_tree_times(session.target, self.cost_key, settings) if measured else None,
            # a chain arm's steps are the chain drafter's, but for the lookup branch
            chain_times=None if self.prompt_lookup else partial(pair_step_times, session.target, self.cost_key),
            row_costs=pair_row_costs(session.target, self.cost_key, settings) if measured else None,
            row_cost=row_cost_estimate(session.target),
            draft_row_cost=draft_row_cost_estimate(self.model),
        )
        return self.policy

    @staticmethod
    def _children(logits: torch.Tensor, probs, gen, k: int, exclude: torch.Tensor | None = None):
        """Candidates [A, F, k], the log-probabilities of their ranks [A, F, k] (-inf: no node), and
        for exclude [A, F] (greedy only: a token per row, -1 none, that gets no candidate: the lookup
        branch's node there) its log-probability [A, F] (-inf where none), else None."""
        if probs is None:  # greedy: the top-k tokens, scored by their draft probabilities
            logp = torch.log_softmax(logits.float(), dim=-1)
            excluded = None
            if exclude is not None:
                index = exclude.clamp_min(0)[..., None]
                has = (exclude >= 0)[..., None]
                excluded = logp.gather(-1, index).masked_fill(~has, float("-inf"))[..., 0]
                logp = logp.masked_fill(
                    torch.zeros_like(logp, dtype=torch.bool).scatter_(-1, index, has), float("-inf")
                )
            top = torch.topk(logp, k, dim=-1)
            return top.indices, top.values, excluded
        log_sorted = torch.topk(torch.log(probs), k, dim=-1).values
        # as for Medusa: ranks below MIN_RANK_PROB (q's sorted probabilities only) get no node
        log_sorted = log_sorted.masked_fill(log_sorted < math.log(MIN_RANK_PROB), float("-inf"))
        return candidate_tokens(probs, logits, (k,), greedy=False, generator=gen), log_sorted, None

    def propose(self, session, g: int) -> TreeProposal:
        grammar = session.grammar
        if session.processor is not grammar:  # SpecConfig refuses it; a drafter used directly must too
            raise ValueError("draft_tree='dynamic' does not support logits processors yet")
        k = self.policy.width if self.policy is not None else self.width
        shaped = self.shaped_depth > 0 and k > 1
        if shaped:  # up to k nodes per depth, g in all: the threshold decides how many
            self.per_depth = [k] * (self.policy.arm[1] if self.policy is not None else self.shaped_depth)
        else:
            self.per_depth = tree_depths(g, k)
        batch, device, V = session.batch, session.device, session.V
        A, u, U = len(batch.rows), self.uncached, max(self.uncached_host)
        look = self._lookup_branch(session) if self.prompt_lookup else _NO_LOOKUP
        greedy = self.config.greedy or look is not _NO_LOOKUP  # a lookup step: a deterministic tree, one-hot
        # a tree of the draft model's own draws also tells the policy what a chain would have accepted
        shadow = self.policy is not None and k > 1 and look is _NO_LOOKUP
        sampling = self.config.sampling
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
        kids = self._children(logits[:, None], None if probs is None else probs[:, None], gen, k, look.exclude(0))
        cand, cand_score = kids[0].reshape(A, k), kids[1].reshape(A, k)
        cand_parent = torch.full((A, k), -1, device=device)
        cand_q = None if probs is None else probs[:, None]  # [A, F, V]: candidate c was drawn from row c // k
        rows = []
        tokens, parents, valid, slots, depths, bits, firsts = [], [], [], [], [], [], []
        root_bits = (torch.ones_like(u) << u) - 1
        next_slot, arange_a = U, torch.arange(A, device=device)[:, None]
        shape = _Shape(self._step_threshold(), g, A, device) if shaped else None
        for d, width in enumerate(self.per_depth, start=1):
            # keep the best `width` candidates (stable: earlier parent, lower rank first on ties); the
            # lookup branch's candidate (last column) first
            cand, cand_score, cand_parent, key = look.add(d, cand, cand_score, cand_parent, kids)
            order = torch.sort(-key, dim=1, stable=True).indices[:, :width]
            score, key = cand_score.gather(1, order), key.gather(1, order)
            ok = key > float("-inf")
            if shape is not None:  # the shaped tree's threshold and budget (a prefix of the order)
                ok = shape.keep(ok, score, key, d)
                score = torch.where(ok, score, float("-inf"))  # a dropped node has no children
                end = shape.end(ok, d) if _stops_early(device) else None
                if end == "empty":  # no node clears the threshold at depth d: the tree is d - 1 deep
                    self.per_depth = self.per_depth[: d - 1]
                    break
                if end == "spent":  # every request's budget is spent: depth d is the last
                    self.per_depth = self.per_depth[:d]
            parent = cand_parent.gather(1, order)
            look.placed(order, sum(self.per_depth[: d - 1]))
            tokens.append(torch.where(ok, cand.gather(1, order), 0))
            parents.append(torch.where(ok, parent, -1))
            valid.append(ok)
            if shadow:  # its parent's first candidate (top-1 / first draw)
                firsts.append(ok & (order % k == 0))
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
            kids = self._children(logits, probs, gen, k, look.exclude(d, width))  # [A, width, k]
            cand_score = (score[:, :, None] + kids[1]).reshape(A, width * k)
            first = sum(self.per_depth[: d - 1])  # node index of this depth's first node
            cand_parent = (first + torch.arange(width, device=device))[None, :, None].expand(A, width, k)
            cand_parent, cand = cand_parent.reshape(A, width * k), kids[0].reshape(A, width * k)
            cand_q = probs
        trim = shape is not None and _stops_early(device)  # the target scores no padding column
        return self._compact(tokens, parents, valid, slots, depths, rows, g, trim, firsts if shadow else None)

    def _step_threshold(self) -> float:
        """A shaped tree's threshold this step: ``tree_threshold``, raised to the path score below
        which a node costs more than it brings (``TreeBudgetPolicy.node_threshold``: measured costs
        and past steps only, so the shape stays a function of q rows and shallower draws)."""
        learned = self.policy.node_threshold() if self.policy is not None else 0.0
        return max(self.threshold, learned)

    def _lookup_branch(self, session):
        """This step's lookup branch (``_LookupBranch``), or a no-op one when no request has a match."""
        rows, depth = session.batch.rows, len(self.per_depth)
        found = drafting.prompt_lookup([session.tokens.history[b] for b in rows], depth)
        if session.grammar is not None:  # what the grammar refuses could never be accepted
            found = [p[: session.grammar.valid_prefix(b, p)] for b, p in zip(rows, found, strict=True)]
        self.lookup_nodes = [len(p) for p in found]
        return _LookupBranch(found, session.device) if any(found) else _NO_LOOKUP

    def _compact(self, tokens, parents, valid, slots, depths, rows, budget: int, trim: bool, firsts) -> TreeProposal:
        """The nodes of every depth, padding moved to the end (parents renumbered), at most ``budget``
        columns (a shaped tree's depths offer more slots than its budget of real nodes); ``trim`` (a
        host read): only as many columns as the largest tree has nodes. firsts (None: not counted):
        per depth, which nodes are their parent's first candidate (``chain_equivalent``)."""
        ok = torch.cat(valid, dim=1)
        A, N = ok.shape
        order = torch.sort((~ok).long(), dim=1, stable=True).indices  # real nodes first, in order
        new_index = torch.empty_like(order).scatter_(1, order, torch.arange(N, device=ok.device).expand(A, N))
        columns = max(int(ok.sum(dim=1).max()), 1) if trim else min(N, budget)
        order = order[:, :columns]  # (real nodes <= budget: padding only is cut)
        pick = lambda t: torch.cat(t, dim=1).gather(1, order)  # noqa: E731
        parent = pick(parents)
        parent = torch.where(parent >= 0, new_index.gather(1, parent.clamp_min(0)), -1)
        kept = ok.gather(1, order)
        depth = torch.where(kept, pick(depths), 0)
        self.node_slot = torch.where(kept, pick(slots), -1)
        self.first_child = None if firsts is None else (pick(firsts) & kept, parent)
        probs = None
        if rows:
            probs = torch.cat(rows, dim=1)[torch.arange(A, device=ok.device)[:, None], order]
        num = kept.long().sum(dim=1)
        D = len(self.per_depth)
        return TreeProposal(pick(tokens), parent, num, depth.max(dim=1).values, D, probs, D)

    def host_values(self, session, verified: Verified) -> list[torch.Tensor]:
        """The chain drafter's, then (a tree of the model's draws) what a chain of the first
        candidates would have accepted this step: accepted drafts and rejections, summed over requests."""
        values = super().host_values(session, verified)
        if values and self.first_child is not None:
            accepted, rejections = chain_equivalent(verified.path, verified.accepted, *self.first_child)
            values += [accepted.sum(), rejections.sum()]
        return values

    def update(self, session, verified: Verified, host: list[int]) -> None:
        super().update(session, verified, host)
        if len(host) == 3:  # host_values' chain-equivalent counts
            self.policy.observe_chain(host[1], host[2])

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


def chain_equivalent(path, accepted, first, parent) -> tuple[torch.Tensor, torch.Tensor]:
    """What a chain would have accepted in a tree step (per request): (accepted drafts [A],
    rejections [A] (0 or 1)), for the tree policy's chain acceptance (``TreeBudgetPolicy.observe_chain``).

    A chain drafts each node's first candidate: the top-1 token when greedy, the first draw from q
    when sampling (a chain's draft is one draw from q). Both verifiers test a node's first child as
    the chain's verifier tests its draft (greedy: the target's argmax; rrs_wor: accepted with
    probability min(1, p / q)), and a path goes on from the node it accepted. So the leading run of
    first children on the accepted path is what the chain accepts, and it was rejected where the run
    ends on a later sibling, or where the path stops at a node whose first child is in the tree (all
    its children were rejected). Where the path stops at a node without one (a leaf, a pruned branch)
    the chain's next test is unknown and counts as neither (censored).

    path [A, D]: the accepted nodes' forward indices (node + 1; -1 padding); accepted [A];
    first [A, C]: the node is its parent's first candidate (False for padding); parent [A, C] (-1: root)."""
    A, D = path.shape
    if D == 0:
        zero = accepted.new_zeros(A)
        return zero, zero
    on_path = first.gather(1, (path - 1).clamp_min(0)) & (path > 0)
    run = torch.minimum(on_path.long().cumprod(dim=1).sum(dim=1), accepted)
    has_first = torch.zeros((A, first.shape[1] + 1), dtype=torch.long, device=first.device)
    has_first.scatter_add_(1, parent + 1, first.long())  # index 0: the root
    last = torch.where(accepted > 0, path.gather(1, (accepted - 1).clamp(0, D - 1)[:, None])[:, 0], 0)
    stopped = has_first.gather(1, last.clamp_min(0)[:, None])[:, 0] > 0
    rejected = (run < accepted) | stopped
    return run, rejected.long()


def _stops_early(device: torch.device) -> bool:
    """Whether a shaped tree stops growing once a depth has no node or the budget is spent: a
    host read per depth, free on the CPU; on a GPU it would be a synchronisation per depth, so there
    the depths run to the end and the empty ones are padding (tests emulate the GPU with it)."""
    return device.type == "cpu"


class _Shape:
    """A shaped tree's selection (``tree_threshold`` > 0): at depth d, of the candidates sorted by
    score, the ones whose score (log path score) is >= log(threshold), at most the request's budget
    left (g nodes in all); the best one at depth 1 always (a step drafts at least one token) and the
    lookup branch's node always (sort key +inf). A function of the scores (ranks' probabilities), never
    of the tokens drawn at depth d: the exactness argument of the module docstring holds as it stands."""

    def __init__(self, threshold: float, budget: int, A: int, device):
        self.log_threshold = math.log(threshold)
        self.left = torch.full((A,), budget, dtype=torch.long, device=device)

    def keep(self, ok: torch.Tensor, score: torch.Tensor, key: torch.Tensor, d: int) -> torch.Tensor:
        """ok [A, width] of the depth's sorted candidates -> the kept ones (a prefix of each row)."""
        col = torch.arange(ok.shape[1], device=ok.device)[None, :]
        keep = (score >= self.log_threshold) | (key == float("inf")) | ((col == 0) & (d == 1))
        ok = ok & keep & (col < self.left[:, None])
        self.left = self.left - ok.sum(dim=1)
        return ok

    def end(self, ok: torch.Tensor, d: int) -> str | None:
        """One host read: "empty" (no request has a depth-d node), "spent" (no budget left), None."""
        any_node, any_left = torch.stack([ok.any(), (self.left > 0).any()]).tolist()
        if not any_node and d > 1:
            return "empty"
        return None if any_left else "spent"


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


class _LookupBranch:
    """The lookup continuations (one per request, up to the step's depth) as a branch from the root:
    its depth-d node is the depth's last candidate column, always kept first (sort key +inf)."""

    def __init__(self, found: list[list[int]], device):
        width = max(len(p) for p in found)
        self.tokens = torch.tensor([p + [-1] * (width - len(p)) for p in found], dtype=torch.long).to(device)
        self.node = torch.full((len(found),), -1, dtype=torch.long, device=device)  # its last node (-1: root)
        self.column = torch.zeros_like(self.node)  # that node's column among its depth's kept nodes
        self.score = torch.zeros(len(found), device=device)  # the draft log-probability of the branch so far
        self.last_column = -1  # the lookup candidate's column in the depth's candidates (``add``)

    def _token(self, d: int) -> torch.Tensor:
        """[A] the branch's depth-d token (1-based), -1 where it has none."""
        if d > self.tokens.shape[1]:
            return torch.full_like(self.node, -1)
        return self.tokens[:, d - 1]

    def exclude(self, d: int, width: int = 1) -> torch.Tensor:
        """_children's ``exclude`` [A, width]: the branch's depth-(d + 1) token in its depth-d node's
        row (the root's when d = 0), so the model proposes no second node with it."""
        out = torch.full((self.node.shape[0], width), -1, dtype=torch.long, device=self.node.device)
        return out.scatter_(1, self.column[:, None], self._token(d + 1)[:, None])

    def add(self, d: int, cand, score, parent, kids):
        """Appends the depth-d lookup candidate to the candidates; returns them and the sort key."""
        token = self._token(d)
        on = token >= 0
        self.score = torch.where(on, self.score + kids[2].gather(1, self.column[:, None])[:, 0], float("-inf"))
        key = torch.cat([score, torch.where(on, float("inf"), float("-inf"))[:, None]], dim=1)
        cand = torch.cat([cand, token.clamp_min(0)[:, None]], dim=1)
        parent = torch.cat([parent, self.node[:, None]], dim=1)
        self.last_column = cand.shape[1] - 1
        return cand, torch.cat([score, self.score[:, None]], dim=1), parent, key

    def placed(self, order: torch.Tensor, first: int) -> None:
        """Notes where the depth's lookup node went (order [A, width]: kept candidate columns)."""
        self.column = (order == self.last_column).long().argmax(dim=1)  # (no node there: unread)
        self.node = first + self.column


class _NoLookup:
    """The branch-free step: the candidates unchanged, sorted by score."""

    @staticmethod
    def exclude(d: int, width: int = 1) -> None:
        return None

    @staticmethod
    def add(d, cand, score, parent, kids):
        return cand, score, parent, score

    @staticmethod
    def placed(order, first) -> None:
        return None


_NO_LOOKUP = _NoLookup()
