"""Reference multi-draft / token-tree verification: the specification of ``sk.verify_tree``
and ``sk.verify_multi``. Loops over requests, tree positions and children, float64.

Tree walk (all methods). The walk state is the set S of nodes that spell the accepted prefix
(several when sibling drafts repeat a token: duplicates are kept "with multiplicity"). The
candidates at S are the children of every node in S, in node-index order; they are samples from
the draft distribution q at that prefix (taken from the first candidate's draft row). The target
distribution p is the row of the first node of S (row 0 for the root). A method picks a candidate
or rejects all; accepting token x moves S to the candidates spelling x. When every candidate is
rejected one token is drawn from the method's residual; at a leaf (no candidates) a bonus token is
drawn from p. Random numbers: Philox keyed by the request's seed with counter
(candidate rank, r, ACCEPT) for the accept tests and (vocab index, r, RECOVER | BONUS) for draws,
where r = 1 + the first node of S (0 at the root). For a single chain this is exactly ``verify``.

Methods:
  kseq     SpecTr K-SEQ with k candidates: accept candidate X_i (first in order) w.p.
           min(1, p(X_i) / (rho q(X_i))); residual ∝ max(p - c min(q, p/rho), 0) with
           c = (1 - (1 - beta)^k) / beta, beta = sum_x min(q, p/rho). rho comes from
           ``solve_rho``: the upper end of a bracketing search for the root rho* of
           1 - (1 - beta)^k = rho beta on [1, k], stopped once the acceptance it loses is at most
           RHO_TOL; any rho >= rho* keeps the output exact (c <= rho).
  rrs      recursive rejection sampling: test candidates in order with min(1, p_j/q), on rejection
           p_{j+1} = norm(max(p_j - q, 0)); all rejected: draw from p_{k+1}.
  rrs_wor  as rrs, and q_{j+1} = q_j without the rejected token, renormalised.
  one-hot  (no draft probabilities, any method) accept candidate x w.p. p_j(x) where p_j is p with
           the earlier rejected tokens removed and renormalised; all rejected: draw from p without them.
  greedy   (temperature 0) follow the first candidate equal to argmax(p); emit argmax at the end.
           A row with no finite logit (a grammar mask allowing nothing) has argmax 0 and flags the
           request, as in ``verify``.
"""

from __future__ import annotations

import torch

from .._params import MIN_TEMPERATURE
from .._tree_args import check_tree_args
from .._types import DRAFT_LOGITS, TreeMetadata, TreeVerifyOutput
from .sampling import (
    accept_uniforms,
    bonus_token,
    draft_distribution,
    grammar_masked,
    processed_probs,
    recover_token,
    sanitize_logits,
)

# Why two rounds at least: the stop test needs a bracket whose acceptance gap is <= RHO_TOL, i.e. a
# width of ~1e-4 in rho (dA/drho is 0.05-0.25 near rho*). Evenly spaced first-round points leave a gap
# of 1e-3 - 3e-3 even at 128 of them (bench_verify_tree's world, V = 151,936, T = 0.7, k = 2..4), so a
# second round is always needed; its points are placed from the first round's bounds on g (rho_step).
RHO_POINTS = 8  # values of rho evaluated per vocabulary pass (the first round's include 1 and k)
RHO_ROUNDS = 3  # passes at most; a position stops once its bracket is within RHO_TOL of acceptance
RHO_TOL = 5e-5  # bound on the acceptance lost by using the bracket's upper end instead of rho*
RHO_BISECT = 16  # bisection steps that place the next round's points (on [lo, hi]: no vocabulary)
RHO_MARGIN = 0.125  # the next points span the sandwich's roots widened by this share on each side
# ... and by at least RHO_EPS of f on each side, measured along f's chord on [lo, hi]: a rho margin of
# w RHO_EPS / clamp(f(lo) - f(hi), RHO_EPS, 1). Why in f: the kernels compute f in float32 (g's
# sum, exp and log: an error of ~1e-6 near rho*), and a margin in rho alone (it was w 2^-RHO_BISECT,
# ~3e-8, below float32's resolution at rho) let every next point land on one value whose computed
# f was > 0, so the bracket kept the old upper end (up to 4e-4 of acceptance lost; issue 28). In f
# the margin costs at most ~RHO_EPS / 3 of acceptance per round (|dA/drho| <= |df/drho|), and it
# still covers the bisection's resolution w 2^-RHO_BISECT (the clamp at 1).
RHO_EPS = 2.0**-16


def kseq_beta(p: torch.Tensor, q: torch.Tensor, rho: float) -> float:
    return float(torch.minimum(q, p / rho).sum())


def kseq_f(rho, g, k):
    """f = 1 - (1 - beta)^k - rho beta with beta = g / rho (g = rho beta = sum_x min(rho q, p));
    decreasing in rho, root rho*."""
    return 1.0 - torch.clamp(1.0 - g / rho, min=0.0) ** k - g


def kseq_acceptance(rho, g, k):
    """P(some draft accepted) = 1 - (1 - beta)^k at rho: decreasing in rho."""
    return 1.0 - torch.clamp(1.0 - g / rho, min=0.0) ** k


def rho_first_points(k: torch.Tensor) -> torch.Tensor:
    """The first round's points [M, RHO_POINTS]: 1 + (k - 1) m / (RHO_POINTS - 1), m = 0 .. RHO_POINTS - 1."""
    m = torch.arange(RHO_POINTS, dtype=torch.float64, device=k.device)
    return 1.0 + (k.to(torch.float64)[:, None] - 1.0) * (m / (RHO_POINTS - 1))


def rho_step(pts, gs, k, lo, glo):
    """One round of the rho search from its points pts [M, P] (ascending, the last one the old upper
    end) and g = sum_x min(rho q, p) at them; k, lo, glo [M]: candidates, the old lower end and g there
    (round 0: the first point). Returns (lo, glo, hi, ghi, done, next points [M, P]).

    The bracket: hi = the first point with f <= 0 (the last one if rounding says none), lo = the
    point before it (the old lo when it is the first). Any rho >= rho* keeps K-SEQ exact, so rho = hi
    and the acceptance lost is at most A(lo) - A(hi); done when that is <= RHO_TOL. The next points
    use that g is concave and piecewise linear in rho (g(0) = 0): on [lo, hi] it lies above the chord
    and below the extended chords of the neighbouring intervals. The roots of f with g replaced by
    either bound are found by bisection (no vocabulary), and RHO_POINTS - 1 points spread evenly
    over them (widened by RHO_MARGIN, and by at least RHO_EPS of f), plus hi.
    """
    P = pts.shape[1]
    kf = k.to(pts.dtype)
    idx = torch.arange(P, device=pts.device)
    nonpos = kseq_f(pts, gs, kf[:, None]) <= 0.0
    m = torch.where(nonpos.any(1), torch.where(nonpos, idx, P).min(1).values, P - 1)

    def at(i):
        i = i.clamp(0, P - 1)[:, None]
        return pts.gather(1, i).squeeze(1), gs.gather(1, i).squeeze(1)

    a, ga = at(m - 1)
    a, ga = torch.where(m > 0, a, lo), torch.where(m > 0, ga, glo)
    b, gb = at(m)
    done = kseq_acceptance(a, ga, kf) - kseq_acceptance(b, gb, kf) <= RHO_TOL
    # neighbours' chords (the origin when there is no left neighbour; slope 0 when no right one)
    an, gan = at(m - 2)
    left = (m >= 2) & (an < a)
    an, gan = torch.where(left, an, 0.0), torch.where(left, gan, 0.0)
    s_left = (ga - gan) / (a - an)
    bn, gbn = at(m + 1)
    right = (m + 1 < P) & (bn > b)
    s_right = torch.where(right, (gbn - gb) / torch.where(right, bn - b, 1.0), 0.0)
    w = b - a
    chord = (gb - ga) / torch.where(w > 0, w, 1.0)

    def lower(x):
        return ga + chord * (x - a)

    def upper(x):
        return torch.minimum(ga + s_left * (x - a), gb - s_right * (b - x))

    def root(bound):
        x_lo, x_hi = a, b
        for _ in range(RHO_BISECT):
            mid = 0.5 * (x_lo + x_hi)
            pos = kseq_f(mid, bound(mid), kf) > 0.0
            x_lo, x_hi = torch.where(pos, mid, x_lo), torch.where(pos, x_hi, mid)
        return x_hi

    r_lower, r_upper = root(lower), root(upper)
    x0, x1 = torch.minimum(r_lower, r_upper), torch.maximum(r_lower, r_upper)
    f_drop = torch.clamp(kseq_f(a, ga, kf) - kseq_f(b, gb, kf), min=RHO_EPS, max=1.0)
    margin = RHO_MARGIN * (x1 - x0) + w * (RHO_EPS / f_drop)
    x0, x1 = torch.maximum(a, x0 - margin), torch.minimum(b, x1 + margin)
    j = torch.arange(P, dtype=pts.dtype, device=pts.device) / (P - 2)
    nxt = x0[:, None] + (x1 - x0)[:, None] * j
    nxt[:, P - 1] = b
    return a, ga, b, gb, done, nxt


def kseq_g(p: torch.Tensor, q: torch.Tensor, rhos: torch.Tensor) -> torch.Tensor:
    """g(rho) = rho beta(rho) = sum_x min(rho q, p) at each of rhos [P]."""
    return torch.minimum(rhos[:, None] * q, p).sum(1)


def rho_search(g_of, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rho, beta(rho)) [M] of rows with k [M] > 1 candidates: at most RHO_ROUNDS rounds of
    ``rho_step``; a row stops (keeps its bracket) once it is done. g_of(points [M, P]) gives
    g = sum_x min(rho q, p) at the points (one pass over the vocabulary)."""
    pts = rho_first_points(k)
    live = torch.ones(k.shape, dtype=torch.bool, device=k.device)
    state = None
    for rnd in range(RHO_ROUNDS):
        gs = g_of(pts)
        lo, glo = (pts[:, 0], gs[:, 0]) if rnd == 0 else state[:2]
        *new, done, pts = rho_step(pts, gs, k, lo, glo)
        state = new if state is None else [torch.where(live, n, o) for n, o in zip(new, state, strict=True)]
        live = live & ~done
        if not bool(live.any()):
            break
    _lo, _glo, hi, ghi = state
    return hi, ghi / hi


def solve_rho(p: torch.Tensor, q: torch.Tensor, k: int) -> tuple[float, float]:
    """(rho, beta(rho)) for K-SEQ with k drafts: the upper end of a bracket around rho*, whose
    acceptance is within RHO_TOL of rho*'s (``rho_step``); at most RHO_ROUNDS passes over the
    vocabulary of RHO_POINTS values each. k = 1 gives rho = 1 exactly."""
    if k <= 1:
        return 1.0, kseq_beta(p, q, 1.0)
    rho, beta = rho_search(lambda pts: kseq_g(p, q, pts[0])[None], torch.tensor([k]))
    return float(rho), float(beta)


def kseq_scale(beta: float, k: int) -> float:
    """c = (1 - (1 - beta)^k) / beta (the limit k when beta = 0); exactly 1 for k = 1."""
    if k == 1:
        return 1.0
    if beta <= 0.0:
        return float(k)
    return (1.0 - (1.0 - beta) ** k) / beta


def verify_tree_reference(
    target_logits, tree_tokens, parents, draft_logits=None, *, draft_probs=None, temperature=1.0, top_k=0, top_p=1.0,
    seed=None, num_nodes=None, method="kseq", max_depth=None, validate=True, top_p_ties="keep",
):  # fmt: skip
    """Same contract as :func:`specdec_kernels.verify_tree`; see its docstring."""
    args = check_tree_args(
        target_logits, tree_tokens, parents, draft_logits, draft_probs, temperature, top_k, top_p, seed, num_nodes,
        method, max_depth, validate=validate, top_p_ties=top_p_ties,
    )  # fmt: skip
    return verify_tree_checked(args)


def verify_multi_reference(
    target_logits, draft_tokens, draft_logits=None, *, draft_probs=None, temperature=1.0, top_k=0, top_p=1.0,
    seed=None, method="kseq", validate=True, top_p_ties="keep",
):  # fmt: skip
    """Same contract as :func:`specdec_kernels.verify_multi`; see its docstring."""
    args = check_tree_args(
        target_logits, draft_tokens, None, draft_logits, draft_probs, temperature, top_k, top_p, seed, None, method,
        None, validate=validate, multi=True, top_p_ties=top_p_ties,
    )  # fmt: skip
    return verify_tree_checked(args)


def verify_tree_checked(args) -> TreeVerifyOutput:
    """The reference on checked arguments (``_tree_args.TreeArgs``); the torch backend."""
    B, D = args.B, args.max_depth
    params = args.per_request_cpu()
    target = args.target.cpu()
    draft = args.draft.cpu() if args.draft is not None else None
    mask = args.token_bitmask.cpu() if args.token_bitmask is not None else None
    tokens_all = args.tokens.cpu().reshape(B, args.N)
    parents_all = args.parents_cpu()
    out_tokens = torch.full((B, D + 1), -1, dtype=torch.int64)
    out_nodes = torch.full((B, D), -1, dtype=torch.int64)
    num_accepted = torch.zeros(B, dtype=torch.int32)
    nonfinite = torch.zeros(B, dtype=torch.bool)
    for b in range(B):
        path, token, flagged = _walk(
            tree=_Tree(
                target[b],
                draft[b] if draft is not None else None,
                tokens_all[b],
                parents_all[b],
                int(params["num_nodes"][b]),
                args.G,
                mask[b] if mask is not None else None,
                masks_drafts=args.draft_mode == DRAFT_LOGITS,
                chains=args.parents is None,
            ),
            mode=args.draft_mode,
            method=args.method,
            temperature=float(params["temperature"][b]),
            top_k=int(params["top_k"][b]),
            top_p=float(params["top_p"][b]),
            seed=int(params["seed"][b]),
            ties=args.sampling.top_p_ties,
        )
        n = len(path)
        out_nodes[b, :n] = torch.tensor(path, dtype=torch.int64)
        out_tokens[b, :n] = tokens_all[b][path] if n else out_tokens[b, :0]
        out_tokens[b, n] = token
        num_accepted[b] = n
        nonfinite[b] = flagged
    dev = args.target.device
    return TreeVerifyOutput(out_tokens.to(dev), num_accepted.to(dev), out_nodes.to(dev), nonfinite.to(dev))


class _Tree:
    """One request's tree: node i lives in chain i // G at depth i % G of the [K, G] layout.

    Grammar masks (``token_bitmask``, [K, G+1, W]): a target row uses its own mask row; the draft
    row of node i (as logits) uses the mask of the target row at which node i is a candidate:
    verify_tree (K = 1): row parents[i] + 1 (0 for the root's children); verify_multi (``chains``):
    the chain's own row [k, i % G]."""

    def __init__(self, target, draft, tokens, parents, num_nodes, G, mask=None, masks_drafts=False, chains=False):
        self.target, self.draft, self.tokens, self.parents = target, draft, tokens, parents
        self.n, self.G = num_nodes, G
        self.mask, self.masks_drafts, self.chains = mask, masks_drafts, chains

    def _words(self, k: int, r: int):
        return None if self.mask is None else self.mask[k, r]

    def target_row(self, node: int) -> torch.Tensor:
        if node < 0:
            return grammar_masked(self.target[0, 0], self._words(0, 0))
        k, r = node // self.G, node % self.G + 1
        return grammar_masked(self.target[k, r], self._words(k, r))

    def draft_row(self, node: int) -> torch.Tensor:
        k, s = node // self.G, node % self.G
        row = self.draft[k, s]
        if not self.masks_drafts:  # draft probabilities: used as given
            return row
        if self.chains:
            return grammar_masked(row, self._words(k, s))
        parent = min(max(int(self.parents[node]), -1), self.G - 1)  # unchecked ids (validate=False) in range
        return grammar_masked(row, self._words(0, parent + 1))

    def children_of(self, nodes: list[int] | None) -> list[int]:
        """Children of the node set (None = the root), in node-index order."""
        want = {-1} if nodes is None else set(nodes)
        return [i for i in range(self.n) if int(self.parents[i]) in want]


def _walk(tree: _Tree, mode, method, temperature, top_k, top_p, seed, ties="keep"):
    """(accepted path nodes, emitted token, nonfinite flag) for one request."""
    greedy = not temperature >= MIN_TEMPERATURE  # subnormal / NaN temperatures act as greedy, like the kernels
    current = None  # None = root; else the list of nodes spelling the accepted prefix
    accepted_node = None
    path_tokens = 0
    flagged = False
    while True:
        first = -1 if current is None else current[0]
        r = first + 1
        row = tree.target_row(first)
        x_row, bad = sanitize_logits(row)
        flagged |= bad
        # children with placeholder ids (outside [0, V)) are no candidates: the draft ends there
        cands = [c for c in tree.children_of(current) if 0 <= int(tree.tokens[c]) < x_row.numel()]
        toks = [int(tree.tokens[c]) for c in cands]
        if greedy:
            best = int(torch.argmax(x_row))  # NaN already -inf; first index on ties
            flagged |= not bool((x_row > float("-inf")).any())  # nothing to choose from: token 0, flagged
            match = [c for c, t in zip(cands, toks, strict=False) if t == best]
            if not match:
                return _path_to(tree, accepted_node), best, flagged
            current, accepted_node = match, match[0]
            path_tokens += 1
            continue
        p = processed_probs(row, temperature, top_k, top_p, ties)
        flagged |= not bool((p > 0).any())
        if not cands:  # leaf: bonus token
            return _path_to(tree, accepted_node), bonus_token(p, seed, r), flagged
        draft_row = tree.draft_row(cands[0]) if tree.draft is not None else None
        q, bad_q = draft_distribution(draft_row, mode, temperature, top_k, top_p, ties)
        flagged |= bad_q  # the position's draft row held NaN / inf (or, as probabilities, < 0)
        chosen, residual = _choose(p, q, toks, method, seed, r)
        if chosen is None:
            return _path_to(tree, accepted_node), recover_token(residual, p, seed, r), flagged
        accepted_node = cands[chosen]
        current = [c for c, t in zip(cands, toks, strict=False) if t == toks[chosen]]
        path_tokens += 1


def _path_to(tree: _Tree, node) -> list[int]:
    path = []
    while node is not None and node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return path[::-1]


def _choose(p, q, toks, method, seed, r):
    """(index of the accepted candidate or None, residual weights when all are rejected)."""
    k = len(toks)
    u = accept_uniforms(seed, r, k)
    if q is None:  # one-hot drafts
        removed, mass = set(), 0.0
        for j, x in enumerate(toks):
            if x not in removed:
                pj = float(p[x]) / (1.0 - mass) if mass < 1.0 else 0.0
                if pj > 0 and u[j] <= pj:
                    return j, None
                removed.add(x)
                mass += float(p[x])
        residual = p.clone()
        residual[list(removed)] = 0.0
        return None, residual
    if method == "kseq":
        rho, beta = solve_rho(p, q, k)
        for j, x in enumerate(toks):
            if p[x] > 0 and u[j] * rho * float(q[x]) <= float(p[x]):
                return j, None
        c = kseq_scale(beta, k)
        return None, torch.clamp(p - c * torch.minimum(q, p / rho), min=0.0)
    # rrs / rrs_wor
    pj, qj, removed = p.clone(), q.clone(), set()
    for j, x in enumerate(toks):
        repeated = method == "rrs_wor" and x in removed  # impossible without replacement: reject
        if not repeated and pj[x] > 0 and u[j] * float(qj[x]) <= float(pj[x]):
            return j, None
        r_next = torch.clamp(pj - qj, min=0.0)
        z = float(r_next.sum())
        pj = r_next / z if z > 0 else r_next
        if method == "rrs_wor" and not repeated:
            keep = 1.0 - float(qj[x])
            qj = qj.clone()
            qj[x] = 0.0
            qj = qj / keep if keep > 0 else qj
            removed.add(x)
    return None, pj


def tree_metadata_reference(parents: torch.Tensor, num_nodes: torch.Tensor | None = None):
    """Depths ([B, N] int32) and ancestor-or-self bitmasks ([B, N] int64) by walking up parents."""
    B, N = parents.shape
    par = parents.cpu().tolist()
    n = num_nodes.cpu().tolist() if num_nodes is not None else [N] * B
    depth = torch.zeros(B, N, dtype=torch.int32)
    mask = torch.zeros(B, N, dtype=torch.int64)
    for b in range(B):
        for i in range(n[b]):
            node, d, bits = i, 0, 0
            while node >= 0:
                bits |= 1 << node
                d += 1
                node = par[b][node]
            depth[b, i] = d
            mask[b, i] = bits - (1 << 64) if bits >= 1 << 63 else bits  # as a signed int64
    return TreeMetadata(depth.to(parents.device), mask.to(parents.device))
