"""Draft-model chains: K chains of g tokens (K = 1: speculative sampling; K > 1: SpecTr / RRS).

One batched draft forward per depth (forward 0 feeds the uncached committed tokens, 1 or 2 per
request; forward t feeds the K depth-t tokens), all through the tree-attention backend so the chains
share the prompt's KV cache. Invariant between steps: the draft cache holds every committed token
but the last u_b (u_b = 2 when all g drafts were accepted, since the draft never fed its own last
draft, else 1), plus one per target-only step (g = 0: no draft forward, ``hf/draft_length.py``) since
the last drafting step. The next drafting step feeds those tokens in its forward 0 (a catch-up: one
forward whatever their number, up to the tree's 64 slots; more first go through ``_catch_up``).
"""

from __future__ import annotations

import torch

from ..._types import MAX_NODES
from .. import drafting
from ..attention import TreeAttentionMetadata, tree_attention_metadata, using_tree_attention
from ..cache import commit_paths, select_requests
from ..config import is_number
from ..draft_length import DraftLengthPolicy, draft_cost_estimate, row_cost_estimate
from ..forwards import forward, gen_for, prefill
from .base import ChainProposal, Drafter, Verified


class ModelDrafter(Drafter):
    """Chains drawn from a draft model sharing the target's vocabulary."""

    def __init__(self, model, config):
        self.model, self.config = model, config
        K, G = config.num_drafts, config.num_draft_tokens
        self.max_tree_nodes, self.max_depth = K * G, G
        self.cache = None
        self.length = 0  # slots in use in the draft cache (tracked on the host)
        self.cached = self.uncached = None  # [A] int64: committed tokens cached / not fed yet (>= 1)
        self.uncached_host: list[int] = []  # the same on the host (known from the last step's transfer)
        self.fed = (0, 1)  # this step's (first slot, forward-0 width): what the commit gathers from
        # what the measured step times are kept under: the model, or its restricted output layer
        # (hf/draft_vocab.py: another draft cost, so times of the two never mix)
        self.cost_key = model

    def enter(self, stack) -> None:
        stack.enter_context(using_tree_attention(self.model))
        if self.config.draft_vocab is not None:  # the call's restricted output layer, put back on exit
            self.cost_key = stack.enter_context(self.config.draft_vocab.installed(self.model))

    def start(self, session) -> None:
        prompts = session.prompts
        self.cache = prefill(self.model, prompts, session.device, session.static_len)
        self.length = max(0, max(len(p) for p in prompts) - 1)
        self.cached = session.batch.target_cached.clone()
        self.uncached = torch.ones_like(self.cached)
        self.uncached_host = [1] * len(prompts)

    def length_policy(self, session):
        cfg = self.config
        if not cfg.adaptive_draft:
            return None
        measured = cfg.draft_cost == "measured" or (cfg.draft_cost is None and cfg.greedy)
        cost = cfg.draft_cost if is_number(cfg.draft_cost) else draft_cost_estimate(session.target, self.model)
        rows = row_cost_estimate(session.target)
        return DraftLengthPolicy(
            session.target, self.cost_key, cfg.num_draft_tokens, float(cost), measured, row_cost=rows
        )

    def _first_forward(self, session):
        """Forward 0: the uncached committed tokens (1 or 2 per request, more after target-only
        steps), left-aligned; the last is the root. Returns the root's logits [A, V] and the forward's metadata."""
        batch, device = session.batch, session.device
        A, u, U = len(batch.rows), self.uncached, max(self.uncached_host)  # known on the host: no sync
        ids0 = session.tokens.last(batch.index, U)  # right-aligned; left-align the u real ones (the rest is padding)
        ids0 = ids0.gather(1, (torch.arange(U, device=device) + U - u[:, None]) % U)
        parents0 = torch.arange(U, device=device).expand(A, U) - 1
        meta0 = tree_attention_metadata(
            parents0, self.cached, self.length, num_nodes=u, backend=batch.attention_backend, validate=False
        )
        # Only the roots' logits are needed: request b's is position u_b - 1, so the output layer
        # runs on the last U - min(u) + 1 positions only (1 when every request feeds U tokens, as at
        # batch 1; 2 otherwise: the requests' u differ by one at most).
        keep = U - min(self.uncached_host) + 1
        logits0 = forward(self.model, self.cache, ids0, meta0, session.V, keep_last=keep)
        self.length += U
        if keep == 1:
            return logits0[:, -1], meta0
        return logits0[torch.arange(A, device=device), u - 1 - (U - logits0.shape[1])], meta0

    def propose(self, session, g: int) -> ChainProposal:
        """K chains of g draft tokens per request with the probabilities [A, K, g, V] each draft was
        sampled from (what the verifier is told q is; None when greedy) and, with a confidence cut,
        ragged draft counts. g = 0: a target-only step (no drafts, no draft forward)."""
        if g == 0:
            return self._target_only(session)
        catch_up = self._catch_up(session, g)
        batch, cfg, device = session.batch, self.config, session.device
        K, sampling, greedy = cfg.num_drafts, cfg.sampling, cfg.greedy
        A, u, U = len(batch.rows), self.uncached, max(self.uncached_host)
        self.fed = (self.length, U)
        session.check_room("draft", self.length, U + (g - 1) * K)
        root_logits, meta0 = self._first_forward(session)
        if session.processor is not None:  # the root row follows the committed tokens
            root_logits = session.processor(session, root_logits[:, None], [[[]]] * A)[:, 0]
        gen = gen_for(session.generator, device)
        probs = None if greedy else drafting.draft_distribution(root_logits, **sampling)
        distinct = cfg.method == "rrs_wor" and K > 1
        first = drafting.sample_first_tokens(probs, root_logits, K, greedy=greedy, distinct=distinct, generator=gen)
        tokens, rows = [first], [None if greedy else probs[:, None].expand(A, K, session.V)]
        confident = [self._confident(root_logits, probs)]
        # A chain keeps its drafts up to its first unsure one. On the CPU a flag costs nothing
        # to read (no device to wait for), so drafting stops once every request has met one: the
        # forwards after it would only make drafts that verification cuts. (On a GPU that read
        # would be a synchronisation per draft token; there the drafts are cut, not skipped.)
        stop_early = cfg.draft_confidence > 0.0 and K == 1 and device.type == "cpu"
        met_unsure = ~confident[0]
        # Forwards 1..g-1: the K depth-t tokens, each seeing the root chain and its own chain.
        root_bits = (torch.ones_like(u) << u) - 1  # [A]
        chain_bits = torch.zeros(K, dtype=torch.int64, device=device)
        for t in range(1, g):
            if stop_early and bool(met_unsure.all()):
                break
            slots = U + (t - 1) * K + torch.arange(K, device=device)
            chain_bits = chain_bits | (torch.ones(K, dtype=torch.int64, device=device) << slots)
            masks = root_bits[:, None] | chain_bits[None, :]
            positions = (self.cached + u - 1 + t)[:, None].expand(A, K)
            meta = TreeAttentionMetadata(
                meta0.key_start, meta0.prefix_end, meta0.tree_start, masks, positions, U + (g - 1) * K, meta0.backend
            )
            logits = forward(self.model, self.cache, tokens[-1], meta, session.V)  # [A, K, V]
            self.length += K
            if session.processor is not None:  # chain k's row follows its own drafts
                logits = session.processor(session, logits, torch.stack(tokens, dim=2).tolist())
            probs = None if greedy else drafting.draft_distribution(logits, **sampling)
            tokens.append(drafting.sample_next_tokens(probs, logits, greedy=greedy, generator=gen))
            rows.append(probs)
            confident.append(self._confident(logits[:, 0], None if probs is None else probs[:, 0]))
            met_unsure |= ~confident[-1]
        drafts = torch.stack(tokens, dim=2)  # [A, K, g]
        n_drafts = None
        if cfg.draft_confidence > 0.0:  # chains only: drafts up to and including the first unsure one
            # (that one is already drawn, and one more row costs the target's forward next to nothing)
            sure_run = torch.stack(confident, dim=1).long().cumprod(dim=1).sum(dim=1)
            n_drafts = (sure_run + 1).clamp_max(drafts.shape[2])
        draft_rows = None if greedy else torch.stack(rows, dim=2)
        return ChainProposal(drafts, draft_rows, n_drafts, draft_forwards=catch_up + drafts.shape[2])

    def _target_only(self, session) -> ChainProposal:
        """No drafts: the verifier draws the next token from the target's root row (its bonus
        token); the draft cache falls one more token behind (``update``)."""
        A = len(session.batch.rows)
        return ChainProposal(torch.zeros(A, 1, 0, dtype=torch.long, device=session.device))

    def _catch_up(self, session, g: int) -> int:
        """Feeds the draft the committed tokens it missed (target-only steps) that forward 0 cannot
        take with this step's chains (its tree of ``MAX_NODES`` slots: the uncached tokens plus
        (g - 1) * K draft slots): the oldest ones, the same number for every request (the requests
        lag by one token at most: all fall behind together), as a chain in their own forward, then
        commits them. Returns the forwards run (usually 0)."""
        K, forwards = self.config.num_drafts, 0
        while max(self.uncached_host) + (g - 1) * K > MAX_NODES:
            C = min(min(self.uncached_host) - 1, MAX_NODES)  # keep >= 1 each: forward 0 needs a root
            if C < 1:
                raise RuntimeError(
                    f"internal error: the draft lags by {self.uncached_host} tokens, which no forward can take; "
                    "please report this with the call's arguments"
                )
            batch, device, A = session.batch, session.device, len(session.batch.rows)
            session.check_room("draft", self.length, C)
            # the draft cache holds tokens [0, cached) of each request: feed tokens [cached, cached + C)
            ids = session.tokens.seq[batch.index].gather(1, self.cached[:, None] + torch.arange(C, device=device))
            parents = (torch.arange(C, device=device) - 1).expand(A, C)
            meta = tree_attention_metadata(
                parents, self.cached, self.length, backend=batch.attention_backend, validate=False
            )
            forward(self.model, self.cache, ids, meta, session.V, keep_last=True)  # (its logits are not needed)
            slots = (self.length + torch.arange(C, device=device)).expand(A, C)
            commit_paths(self.cache, slots, self.cached, torch.full_like(self.cached, C), self.length + C)
            self.length += C  # (stale slots stay up to the next commit's crop)
            self.cached, self.uncached = self.cached + C, self.uncached - C
            self.uncached_host = [u - C for u in self.uncached_host]
            forwards += 1
        return forwards

    def _confident(self, logits: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
        """[A] bool: the draft's distribution at this position has a token of probability >= the
        threshold (decided before looking at the sampled token, which keeps sampling exact)."""
        if self.config.draft_confidence <= 0.0:
            return torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        p = probs if probs is not None else torch.softmax(logits.float(), dim=-1)
        return p.max(dim=-1).values >= self.config.draft_confidence

    # ---- commit

    def _commit_slots(self, verified: Verified):
        """Draft-cache slots to keep, [A, U + g - 1] (left-aligned), and their counts [A]: the committed
        tokens fed in forward 0 (u per request) and the accepted drafts the draft fed itself (depths
        1..min(a, g-1) of the accepted chain; any chain through that prefix holds the same KV)."""
        (S, U), K, G = self.fed, self.config.num_drafts, verified.proposal.depth
        path, accepted, u = verified.path, verified.accepted, self.uncached
        j = torch.arange(U + G - 1, device=accepted.device)[None, :]
        t = (j - u[:, None] + 1).clamp(1, max(G - 1, 1))  # depth of the j-th kept draft slot
        chain = (path.gather(1, (t - 1).clamp_max(G - 1)) - 1).clamp_min(0) // G
        src = torch.where(j < u[:, None], S + j, S + U + (t - 1) * K + chain)
        kept = u + torch.clamp(accepted, max=G - 1)
        return src, torch.where(verified.finished, 0, kept)  # a finishing request keeps nothing

    def host_values(self, session, verified: Verified) -> list[torch.Tensor]:
        if verified.proposal.depth == 0:  # a target-only step: the draft cache is untouched
            return []
        self._src, self._kept = self._commit_slots(verified)
        return [(self.cached + self._kept).max()]

    def update(self, session, verified: Verified, host: list[int]) -> None:
        if verified.proposal.depth == 0:  # one more committed token the draft has not fed
            self.uncached = self.uncached + 1
            self.uncached_host = [u + 1 for u in self.uncached_host]
            return
        commit_paths(self.cache, self._src, self.cached, self._kept, host[0])
        self.length = host[0]
        self.cached = self.cached + self._kept
        g = verified.proposal.depth
        self.uncached = torch.where(verified.accepted == g, 2, 1)
        self.uncached_host = [2 if a == g else 1 for a in verified.accepted_host]

    def select(self, index: torch.Tensor, positions: list[int]) -> None:
        self.cached, self.uncached = self.cached[index], self.uncached[index]
        self.uncached_host = [self.uncached_host[p] for p in positions]
        select_requests(self.cache, index)
