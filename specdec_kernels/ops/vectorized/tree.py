"""Tree / multi-draft verification as batched PyTorch ops: ``backend="vectorized"`` for
``verify_tree`` and ``verify_multi``.

The reference's walk (``reference/verify_tree.py``) with every request advanced at once: a loop
over tree depth (one accepted token per step), and inside a step a loop over candidate ranks for
the methods that test candidates one after another (rrs, rrs_wor, one-hot drafts) and over the
rounds of K-SEQ's rho search; never a loop over requests. Same random numbers (Philox counters
(rank, r, ACCEPT) for the tests and (x // 4, r, RECOVER | BONUS) for the draws, r = 1 + the first
node of the accepted set), same float64 arithmetic in the same order, so the same tokens.

State per request: the set S of nodes spelling the accepted prefix (a [B, N] mask; the root at the
start), the last accepted node (the path is rebuilt from parents at the end), the nonfinite flag.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..._params import MIN_TEMPERATURE
from ..._tree_args import TreeArgs
from ..._types import DRAFT_LOGITS, DRAFT_PROBS, TreeVerifyOutput
from ...reference.philox import uniform_open_torch
from ...reference.sampling import PURPOSE_ACCEPT, PURPOSE_BONUS, PURPOSE_RECOVER
from ...reference.verify_tree import RHO_POINTS, rho_search
from .chain import philox, processed_probs, race, sanitize

_NEG_INF = float("-inf")


def verify_tree_vectorized(args: TreeArgs) -> TreeVerifyOutput:
    """Tree / multi-draft verification on checked arguments (``_tree_args.TreeArgs``)."""
    B, V, N, D = args.B, args.V, args.N, args.max_depth
    dev = args.target.device
    params = {k: v.to(dev) for k, v in args.per_request_cpu().items()}
    tokens = args.tokens.reshape(B, N).to(torch.int64)
    node = torch.arange(N, device=dev)
    real = node[None, :] < params["num_nodes"][:, None]
    # padding past num_nodes may hold any parent: read as a root child (never a candidate: not usable)
    parents = torch.where(real, args.parents_cpu().to(dev), -1)
    # placeholder ids (outside [0, V)) are no candidates
    usable = real & (tokens >= 0) & (tokens < V)
    tokens = torch.where(usable, tokens, 0)  # unusable ids are never read as ids (gathers stay in range)
    walk = _Walk(args, params, tokens, parents, usable)
    for _ in range(N + 1):  # every step accepts a node or ends the walk
        if not walk.step():
            break
    return walk.output(D)


class _Walk:
    def __init__(self, args: TreeArgs, params: dict, tokens: Tensor, parents: Tensor, usable: Tensor):
        B, N, dev = args.B, args.N, args.target.device
        self.args, self.tokens, self.parents, self.usable = args, tokens, parents, usable
        self.G, self.V, self.N = args.G, args.V, N
        self.slots = max(args.G, 1)  # G as a divisor: with G = 0 there are no nodes to locate
        self.seed = params["seed"]
        self.t = params["temperature"].to(torch.float64)
        self.top_k, self.top_p = params["top_k"], params["top_p"].to(torch.float64)
        self.greedy = ~(params["temperature"] >= MIN_TEMPERATURE)
        self.filtered = args.has_filter
        self.by_index = args.sampling.ties_by_index()  # top_p_ties="by_index" with top-p active
        self.active = torch.ones(B, dtype=torch.bool, device=dev)
        self.at_root = torch.ones(B, dtype=torch.bool, device=dev)
        self.S = torch.zeros((B, N), dtype=torch.bool, device=dev)
        self.last = torch.full((B,), -1, dtype=torch.int64, device=dev)  # last accepted node
        self.token = torch.zeros(B, dtype=torch.int64, device=dev)
        self.flagged = torch.zeros(B, dtype=torch.bool, device=dev)

    # ---- one step of the walk for every active request

    def step(self) -> bool:
        b = self.active.nonzero().squeeze(1)
        if b.numel() == 0:
            return False
        S = self.S[b]
        first = torch.where(self.at_root[b], -1, _first_true(S))
        r = first + 1
        k_row = torch.where(first < 0, 0, first // self.slots)
        s_row = torch.where(first < 0, 0, first % self.slots + 1)
        x, bad, m, idx = sanitize(self.args.target[b, k_row, s_row], with_index=True)
        self.flagged[b] |= bad
        # children of S (the root: parent -1), in node-index order
        in_s = torch.cat([self.at_root[b, None], S], 1).gather(1, self.parents[b] + 1)
        cand = in_s & self.usable[b]
        toks = self.tokens[b]
        greedy = self.greedy[b]
        if bool(greedy.any()):
            g = greedy.nonzero().squeeze(1)
            self.flagged[b[g]] |= m[g] == _NEG_INF  # nothing to choose from: token 0, flagged
            self._greedy_step(b[g], cand[g], toks[g], idx[g])
        if not bool(greedy.all()):
            s = (~greedy).nonzero().squeeze(1)
            self._sampled_step(b[s], x[s], m[s], cand[s], toks[s], r[s])
        return True

    def _greedy_step(self, b, cand, toks, best):
        match = cand & (toks == best[:, None])
        found = match.any(1)
        self._finish(b[~found], best[~found])
        self._accept(b[found], match[found])

    def _sampled_step(self, b, x, m, cand, toks, r):
        p = processed_probs(x, m, self.t[b], self.top_k[b], self.top_p[b], self.filtered, self.by_index)
        self.flagged[b] |= ~(p > 0).any(1)
        k = cand.sum(1)
        leaf = k == 0
        if bool(leaf.any()):
            lf = leaf.nonzero().squeeze(1)
            purpose = torch.full_like(lf, PURPOSE_BONUS)
            self._finish(b[lf], race(p[lf].clone(), self.seed[b[lf]], r[lf], purpose).clamp(min=0))
        inner = (~leaf).nonzero().squeeze(1)
        if inner.numel() == 0:
            return
        b, p, cand, toks, r, k = b[inner], p[inner], cand[inner], toks[inner], r[inner], k[inner]
        # candidates by rank: their node ids (padding N) and tokens
        order = torch.where(cand, torch.arange(self.N, device=b.device), self.N)
        nodes = order.sort(1).values[:, : int(k.max())]  # [M, kmax]
        valid = nodes < self.N
        ctok = toks.gather(1, nodes.clamp(max=self.N - 1))
        ranks = torch.arange(nodes.shape[1], device=b.device)
        purpose = torch.full_like(ranks, PURPOSE_ACCEPT)[None, :]
        u = uniform_open_torch(philox(self.seed[b][:, None], ranks[None, :], r[:, None], purpose)[0]).to(torch.float64)
        # an earlier candidate with the same token (siblings spelling one token)
        dup = (ctok[:, :, None] == ctok[:, None, :]).tril(-1).any(2)
        q = self._draft_q(b, nodes[:, 0])
        method = self.args.method
        if q is None:
            chosen, residual = _choose_one_hot(p, ctok, valid, dup, u)
        elif method == "kseq":
            chosen, residual = _choose_kseq(p, q, ctok, valid, u, k)
        else:
            chosen, residual = _choose_rrs(p, q, ctok, valid, dup, u, method == "rrs_wor")
        rejected = chosen < 0
        if bool(rejected.any()):
            rj = rejected.nonzero().squeeze(1)
            purpose = torch.full_like(rj, PURPOSE_RECOVER)
            token = race(residual[rj], self.seed[b[rj]], r[rj], purpose)
            empty = token < 0  # p == q to rounding: draw from p with the same uniforms
            if bool(empty.any()):
                e = empty.nonzero().squeeze(1)
                token[e] = race(p[rj[e]].clone(), self.seed[b[rj[e]]], r[rj[e]], purpose[e]).clamp(min=0)
            self._finish(b[rj], token)
        ok = (~rejected).nonzero().squeeze(1)
        if ok.numel() > 0:
            pick = chosen[ok]
            tok = ctok[ok].gather(1, pick[:, None])
            match = cand[ok] & (toks[ok] == tok)
            last = nodes[ok].gather(1, pick[:, None]).squeeze(1)
            self._accept(b[ok], match, last)

    def _draft_q(self, b, c0):
        """The draft distribution at the position (the first candidate's draft row), float64, or
        None for one-hot drafts; flags unusable values of that row."""
        mode = self.args.draft_mode
        if mode not in (DRAFT_LOGITS, DRAFT_PROBS):
            return None
        row = self.args.draft[b, c0 // self.slots, c0 % self.slots]
        if mode == DRAFT_LOGITS:
            xd, bad, md, _ = sanitize(row)
            self.flagged[b] |= bad
            return processed_probs(xd, md, self.t[b], self.top_k[b], self.top_p[b], self.filtered, self.by_index)
        q = row.to(torch.float64, copy=True)
        bad = ~((q >= 0) & (q < float("inf")))
        self.flagged[b] |= bad.any(1)
        return q.masked_fill_(bad, 0.0)

    # ---- bookkeeping

    def _accept(self, b, match, last=None):
        if b.numel() == 0:
            return
        self.S[b] = match
        self.at_root[b] = False
        self.last[b] = _first_true(match) if last is None else last

    def _finish(self, b, token):
        if b.numel() == 0:
            return
        self.token[b] = token
        self.active[b] = False

    def output(self, D: int) -> TreeVerifyOutput:
        """Paths rebuilt from the last accepted node up the parents (the reference's _path_to)."""
        B, dev = self.last.shape[0], self.last.device
        chain = torch.full((B, self.N + 1), -1, dtype=torch.int64, device=dev)  # leaf first
        cur = self.last.clone()
        for depth in range(self.N + 1):
            live = cur >= 0
            if not bool(live.any()):
                break
            chain[:, depth] = cur
            cur = torch.where(live, self.parents.gather(1, cur.clamp(min=0)[:, None]).squeeze(1), cur)
        n = (chain >= 0).sum(1)
        pos = torch.arange(D, device=dev)
        src = (n[:, None] - 1 - pos[None, :]).clamp(min=0)
        nodes = torch.where(pos[None, :] < n[:, None], chain.gather(1, src.clamp(max=self.N)), -1)
        path_tokens = self.tokens.gather(1, nodes.clamp(min=0))
        out = torch.full((B, D + 1), -1, dtype=torch.int64, device=dev)
        out[:, :D] = torch.where(nodes >= 0, path_tokens, -1)
        out.scatter_(1, n[:, None].clamp(max=D), self.token[:, None])
        return TreeVerifyOutput(out, n.to(torch.int32), nodes, self.flagged.clone())


def _first_true(mask: Tensor) -> Tensor:
    """Index of the first True of each row (rows with none, and rows of no columns: 0)."""
    if mask.shape[1] == 0:  # a tree without nodes: argmax has nothing to reduce
        return torch.zeros(mask.shape[0], dtype=torch.int64, device=mask.device)
    return mask.to(torch.int8).argmax(1)


def _p_at(p: Tensor, tok: Tensor) -> Tensor:
    return p.gather(1, tok[:, None]).squeeze(1)


def _choose_one_hot(p, ctok, valid, dup, u):
    """One-hot drafts: candidate x is accepted w.p. p(x) / (1 - removed mass); a rejected token
    leaves p. (chosen rank or -1, residual = p without the rejected tokens)."""
    M, kmax = ctok.shape
    chosen = torch.full((M,), -1, dtype=torch.int64, device=p.device)
    mass = torch.zeros(M, dtype=torch.float64, device=p.device)
    testing = valid[:, 0].clone()
    for j in range(kmax):
        live = testing & valid[:, j] & (chosen < 0)
        if not bool(live.any()):
            break
        fresh = live & ~dup[:, j]
        px = _p_at(p, ctok[:, j])
        pj = torch.where(mass < 1.0, px / (1.0 - mass), torch.zeros_like(px))
        take = fresh & (pj > 0) & (u[:, j] <= pj)
        chosen = torch.where(take, j, chosen)
        mass = torch.where(fresh & ~take, mass + px, mass)
    residual = p.clone()
    rejected = valid & (chosen[:, None] < 0)  # all rejected: every candidate token is removed
    rows, cols = rejected.nonzero(as_tuple=True)
    residual[rows, ctok[rows, cols]] = 0.0
    return chosen, residual


def _beta(p, q, rho):
    """sum_x min(q, p / rho) for rho [M] (float64 [M])."""
    return torch.minimum(q, p / rho[:, None]).sum(1)


def _solve_rho(p, q, k):
    """The reference's solve_rho for every row: (rho, beta(rho)) [M] each; k [M] candidates."""
    M = p.shape[0]
    hi = torch.ones(M, dtype=torch.float64, device=p.device)
    beta_hi = torch.zeros(M, dtype=torch.float64, device=p.device)
    multi = k > 1
    rows = multi.nonzero().squeeze(1)
    if rows.numel() > 0:
        pr, qr = p[rows], q[rows]

        def g_of(pts):
            return torch.stack([torch.minimum(pts[:, m : m + 1] * qr, pr).sum(1) for m in range(RHO_POINTS)], 1)

        hi[rows], beta_hi[rows] = rho_search(g_of, k[rows])
    single = (~multi).nonzero().squeeze(1)
    if single.numel() > 0:
        beta_hi[single] = _beta(p[single], q[single], hi[single])
    return hi, beta_hi


def _choose_kseq(p, q, ctok, valid, u, k):
    """SpecTr K-SEQ: accept candidate X_i (first in order) w.p. min(1, p / (rho q)); residual
    max(p - c min(q, p / rho), 0) with c = (1 - (1 - beta)^k) / beta."""
    M, kmax = ctok.shape
    rho, beta = _solve_rho(p, q, k)
    chosen = torch.full((M,), -1, dtype=torch.int64, device=p.device)
    for j in range(kmax):
        px, qx = _p_at(p, ctok[:, j]), _p_at(q, ctok[:, j])
        take = valid[:, j] & (chosen < 0) & (px > 0) & (u[:, j] * rho * qx <= px)
        chosen = torch.where(take, j, chosen)
    kf = k.to(torch.float64)
    c = torch.where(beta <= 0.0, kf, (1.0 - (1.0 - beta) ** kf) / beta)
    c = torch.where(k == 1, torch.ones_like(c), c)
    residual = torch.clamp(p - c[:, None] * torch.minimum(q, p / rho[:, None]), min=0.0)
    return chosen, residual


def _choose_rrs(p, q, ctok, valid, dup, u, without_replacement: bool):
    """Recursive rejection sampling: test candidates in order with min(1, p_j / q_j); after a
    rejection p_{j+1} = norm(max(p_j - q_j, 0)) (and, without replacement, q_{j+1} = q_j without
    the rejected token, renormalised). (chosen rank or -1, p after the last rejection)."""
    M, kmax = ctok.shape
    chosen = torch.full((M,), -1, dtype=torch.int64, device=p.device)
    pj, qj = p.clone(), q.clone()
    for j in range(kmax):
        live = valid[:, j] & (chosen < 0)
        if not bool(live.any()):
            break
        rows = live.nonzero().squeeze(1)
        x = ctok[rows, j]
        p_r, q_r = pj[rows], qj[rows]
        repeated = dup[rows, j] if without_replacement else torch.zeros_like(x, dtype=torch.bool)
        px, qx = _p_at(p_r, x), _p_at(q_r, x)
        take = ~repeated & (px > 0) & (u[rows, j] * qx <= px)
        chosen[rows[take]] = j
        nxt = ~take
        if not bool(nxt.any()):
            continue
        rr, xr, q_n = rows[nxt], x[nxt], q_r[nxt]
        r_next = torch.clamp(p_r[nxt] - q_n, min=0.0)
        z = r_next.sum(1)
        pj[rr] = torch.where(z[:, None] > 0, r_next / z[:, None], r_next)
        if without_replacement:
            fresh = ~repeated[nxt]
            keep = 1.0 - _p_at(q_n, xr)
            q_new = q_n.clone()
            q_new[torch.arange(xr.numel(), device=p.device), xr] = 0.0
            q_new = torch.where((keep > 0)[:, None], q_new / keep[:, None], q_new)
            qj[rr] = torch.where(fresh[:, None], q_new, q_n)
    return chosen, pj
