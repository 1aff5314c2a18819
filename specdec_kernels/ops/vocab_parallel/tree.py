"""Tree / multi-draft verification on vocabulary shards: the walk of ``reference.verify_tree``,
one depth per step, with the K-SEQ rho search and RRS tests on globally reduced sums."""

from __future__ import annotations

import torch

from ..._types import DRAFT_LOGITS, DRAFT_NONE, DRAFT_PROBS, TreeVerifyOutput
from ...reference.sampling import PURPOSE_BONUS, PURPOSE_RECOVER, safe_log
from ...reference.verify_tree import RHO_POINTS, kseq_scale, rho_search
from .protocol import Shard
from .rows import Rows, accept_uniforms, process_rows, race, request_params, row_min


def verify_tree_sharded(shard: Shard, args) -> TreeVerifyOutput:
    """``reference.verify_tree.verify_tree_checked`` on vocabulary shards (TreeArgs, global ids)."""
    B, G, N, V, D = args.B, args.G, args.N, shard.V, args.max_depth
    dev = args.target.device
    temp, top_k, top_p, seeds, greedy = request_params(args.sampling, B, dev)
    params = (temp, top_k, top_p)
    num_nodes = args.per_request_cpu()["num_nodes"].to(dev)
    toks = args.tokens.reshape(B, N).to(torch.int64)
    parents = args.parents_cpu().to(dev)
    node = torch.arange(N, device=dev)
    usable = (node[None] < num_nodes[:, None]) & (toks >= 0) & (toks < V)
    b_idx = torch.arange(B, device=dev)
    all_greedy = bool(greedy.all())
    slots = max(G, 1)  # G as a divisor: with G = 0 (no nodes) only the root row is ever read
    draft_mode = args.draft_mode if N > 0 else DRAFT_NONE  # no nodes: no candidate, no draft row to read

    cur = torch.zeros((B, N), dtype=torch.bool, device=dev)  # the node set S (empty: the root)
    at_root = torch.ones(B, dtype=torch.bool, device=dev)
    first = torch.full((B,), -1, dtype=torch.int64, device=dev)
    last_node = torch.full((B,), -1, dtype=torch.int64, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    token = torch.zeros(B, dtype=torch.int64, device=dev)
    flag = torch.zeros(B, dtype=torch.bool, device=dev)
    for _ in range(D + 2):
        if bool(done.all()):
            break
        live = ~done
        r = first + 1
        t_rows = torch.where(first < 0, 0, first // slots), torch.where(first < 0, 0, first % slots + 1)
        x_raw = args.target[b_idx, t_rows[0], t_rows[1]]  # [B, V_r]
        parent_in = torch.where(parents >= 0, cur.gather(1, parents.clamp(min=0)), at_root[:, None])
        cand = parent_in & usable
        ncand = cand.sum(1)
        # candidates in node order, compacted: [B, N] node ids (-1 padding)
        order = torch.where(cand, node[None], N).sort(1).values
        cnode = torch.where(order < N, order, -1)
        ctok = torch.where(cnode >= 0, toks.gather(1, cnode.clamp(min=0)), -1)
        c0 = row_min(cnode.clamp(min=0)[:, :1], 0)  # the position's draft row: the first candidate's
        d_raw = None if draft_mode == DRAFT_NONE else args.draft[b_idx, c0 // slots, c0 % slots]
        if all_greedy:  # greedy never reads q
            (target, _), draft = process_rows(shard, x_raw, params, ~greedy, ctok), None
        elif draft_mode == DRAFT_LOGITS:  # target and draft rows share the collectives
            both, _ = process_rows(
                shard,
                torch.cat([x_raw.float(), d_raw.float()]),
                tuple(torch.cat([v, v]) for v in params),
                torch.cat([~greedy, ~greedy]),
                torch.cat([ctok, ctok]),
            )
            target, draft = both.take(slice(0, B)), both.take(slice(B, None))
        elif draft_mode == DRAFT_PROBS:
            target, draft = process_rows(shard, x_raw, params, ~greedy, ctok, d_raw, ctok)
        else:
            (target, _), draft = process_rows(shard, x_raw, params, ~greedy, ctok), None
        flag |= live & (target.bad | (~greedy & target.empty))
        # greedy requests: follow the first candidate equal to the argmax
        best = target.argmax
        g_match = cand & (toks == best[:, None])
        g_end = live & greedy & ~g_match.any(1)
        token = torch.where(g_end, best, token)
        # sampled requests
        s_live = live & ~greedy
        leaf = s_live & (ncand == 0)
        q_at = None if draft is None else draft.at_ids
        if draft is not None:
            flag |= s_live & (ncand > 0) & draft.bad
        q_rows = None if draft is None else draft.p
        testing = s_live & ~leaf
        if bool(testing.any()):  # replicated / reduced values: every rank takes the same branch
            chosen, residual = _choose(shard, target, q_rows, q_at, ctok, ncand, args.method, seeds, r, testing)
        else:
            chosen, residual = torch.full((B,), -1, dtype=torch.int64, device=dev), None
        rejected = testing & (chosen < 0)
        if bool((leaf | rejected).any()):
            purposes = torch.where(leaf, PURPOSE_BONUS, PURPOSE_RECOVER)
            p = target.p
            residual = p if residual is None else residual
            res_tok, p_tok = race(shard, [safe_log(residual), safe_log(p)], seeds, r, purposes)
            drawn = torch.where(leaf | (res_tok < 0), p_tok, res_tok).clamp(min=0)
            token = torch.where(leaf | rejected, drawn, token)
        s_acc = s_live & ~leaf & (chosen >= 0)
        # move S: to the candidates spelling the accepted token
        acc_tok = torch.where(greedy, best, _at_rank(ctok, chosen))
        acc_node = torch.where(
            greedy,
            row_min(torch.where(g_match, node[None], N), N),
            _at_rank(cnode, chosen),
        )
        moving = (live & greedy & ~g_end) | s_acc
        new_cur = cand & (toks == acc_tok[:, None])
        cur = torch.where(moving[:, None], new_cur, cur)
        first = torch.where(moving, row_min(torch.where(new_cur, node[None], N), N), first)
        last_node = torch.where(moving, acc_node, last_node)
        at_root = at_root & ~moving
        done = done | g_end | leaf | rejected
    return _tree_output(args, toks, parents, last_node, token, flag)


def _at_rank(x: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """x[b, rank[b]] of candidates x [B, N] (rank -1 reads rank 0); -1 when there are no nodes."""
    if x.shape[1] == 0:
        return torch.full_like(rank, -1)
    return x.gather(1, rank.clamp(min=0)[:, None])[:, 0]


def _tree_output(args, toks, parents, last_node, token, flag) -> TreeVerifyOutput:
    B, D = args.B, args.max_depth
    dev = toks.device
    paths = torch.full((B, D), -1, dtype=torch.int64)
    out_tokens = torch.full((B, D + 1), -1, dtype=torch.int64)
    num = torch.zeros(B, dtype=torch.int32)
    par, last, tk, tok_all = parents.cpu().tolist(), last_node.cpu().tolist(), token.cpu().tolist(), toks.cpu()
    for b in range(B):
        path, nd = [], last[b]
        while nd >= 0:
            path.append(nd)
            nd = par[b][nd]
        path.reverse()
        n = len(path)
        paths[b, :n] = torch.tensor(path, dtype=torch.int64)
        out_tokens[b, :n] = tok_all[b][path] if n else out_tokens[b, :0]
        out_tokens[b, n] = tk[b]
        num[b] = n
    return TreeVerifyOutput(out_tokens.to(dev), num.to(dev), paths.to(dev), flag.to(dev))


def _choose(shard, target: Rows, q_rows, q_at, ctok, ncand, method, seeds, r, active):
    """(chosen candidate rank [B] or -1, residual weights [B, V_r]) for the rows that test
    candidates (``active``), as ``reference.verify_tree._choose``."""
    B, N = ctok.shape
    dev = ctok.device
    p, p_at = target.p, target.at_ids
    ranks = torch.arange(N, device=dev)
    valid = ranks[None] < ncand[:, None]
    u = accept_uniforms(seeds[:, None], ranks[None], r[:, None])
    # duplicates: an earlier candidate with the same token
    same = (ctok[:, :, None] == ctok[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    earlier = torch.tril(torch.ones((N, N), dtype=torch.bool, device=dev), diagonal=-1)
    repeated = (same & earlier[None]).any(2)
    chosen = torch.full((B,), -1, dtype=torch.int64, device=dev)
    if q_rows is None:  # one-hot drafts (host arithmetic, as the reference's scalar loop)
        p_at_h, u_h, rep_h, val_h = p_at.cpu().tolist(), u.cpu().tolist(), repeated.cpu().tolist(), valid.cpu()
        act = active.cpu().tolist()
        ch = [-1] * B
        for b in range(B):
            if not act[b]:
                continue
            mass = 0.0
            for jj in range(int(val_h[b].sum())):
                if rep_h[b][jj]:
                    continue
                pj = p_at_h[b][jj] / (1.0 - mass) if mass < 1.0 else 0.0
                if pj > 0 and u_h[b][jj] <= pj:
                    ch[b] = jj
                    break
                mass += p_at_h[b][jj]
        chosen = torch.tensor(ch, dtype=torch.int64, device=dev)
        own, loc = shard.local(ctok.clamp(min=0))
        removed = torch.zeros_like(p)
        if shard.size:
            removed.scatter_add_(1, loc, (own & valid).double())
        return chosen, torch.where(removed > 0, torch.zeros_like(p), p)
    if method == "kseq":
        return _kseq(shard, p, q_rows, p_at, q_at, u, ncand, active)
    return _rrs(shard, p, q_rows, ctok, u, ncand, repeated, active, method == "rrs_wor")


def _kseq(shard, p, q, p_at, q_at, u, ncand, active):
    B = p.shape[0]
    dev = p.device
    k_h = ncand.cpu().tolist()
    act = active.cpu().tolist()
    hi, beta_hi = [1.0] * B, [0.0] * B
    multi = [act[b] and k_h[b] > 1 for b in range(B)]
    # k <= 1: rho = 1 and beta(1) (one sum); k > 1: the reference's rho search on global sums (every
    # shard takes the same rounds: they see the same sums)
    one = torch.minimum(q, p / 1.0).sum(1, keepdim=True)
    beta1 = shard.sum(one.to(shard.device)).cpu()[:, 0].tolist()
    if any(multi):

        def g_of(pts):
            rho = pts.to(dev)
            local = torch.stack([torch.minimum(rho[:, m : m + 1] * q, p).sum(1) for m in range(RHO_POINTS)], 1)
            return shard.sum(local.to(shard.device)).cpu()

        rho_t, beta_t = rho_search(g_of, torch.tensor([max(k, 2) for k in k_h]))
        hi, beta_hi = rho_t.tolist(), beta_t.tolist()
    rho_h = [hi[b] if multi[b] else 1.0 for b in range(B)]
    beta_h = [beta_hi[b] if multi[b] else beta1[b] for b in range(B)]
    p_h, q_h, u_h = p_at.cpu().tolist(), q_at.cpu().tolist(), u.cpu().tolist()
    ch = [-1] * B
    for b in range(B):
        if not act[b]:
            continue
        for jj in range(k_h[b]):
            if p_h[b][jj] > 0 and u_h[b][jj] * rho_h[b] * q_h[b][jj] <= p_h[b][jj]:
                ch[b] = jj
                break
    c = torch.tensor([kseq_scale(beta_h[b], max(k_h[b], 1)) for b in range(B)], dtype=torch.float64, device=dev)
    rho = torch.tensor(rho_h, dtype=torch.float64, device=dev)
    residual = torch.clamp(p - c[:, None] * torch.minimum(q, p / rho[:, None]), min=0.0)
    return torch.tensor(ch, dtype=torch.int64, device=dev), residual


def _rrs(shard, p, q, ctok, u, ncand, repeated, active, wor: bool):
    B, N = ctok.shape
    dev = p.device
    pj, qj = p.clone(), q.clone()
    chosen = torch.full((B,), -1, dtype=torch.int64, device=dev)
    testing = active.clone()
    for jj in range(int(ncand.max()) if B else 0):
        testing = testing & (jj < ncand) & (chosen < 0)
        if not bool(testing.any()):
            break
        x = ctok[:, jj : jj + 1].clamp(min=0)
        at = shard.sum(torch.cat([shard.lookup(pj, x), shard.lookup(qj, x)], 1).to(shard.device)).to(dev)
        pjx, qjx = at[:, 0], at[:, 1]
        rep = repeated[:, jj] & wor
        ok = testing & ~rep & (pjx > 0) & (u[:, jj] * qjx <= pjx)
        chosen = torch.where(ok, jj, chosen)
        step = testing & ~ok
        r_next = torch.clamp(pj - qj, min=0.0)
        z = shard.sum(r_next.sum(1).to(shard.device)).to(dev)
        new_p = torch.where(z[:, None] > 0, r_next / torch.where(z > 0, z, 1.0)[:, None], r_next)
        pj = torch.where(step[:, None], new_p, pj)
        if wor:
            drop = step & ~rep
            keep = 1.0 - qjx
            own, loc = shard.local(x[:, 0])
            zeroed = qj.clone()
            if shard.size:
                hit = drop & own
                zeroed[hit, loc[hit]] = 0.0
            zeroed = torch.where(keep[:, None] > 0, zeroed / torch.where(keep > 0, keep, 1.0)[:, None], zeroed)
            qj = torch.where(drop[:, None], zeroed, qj)
    return chosen, pj
