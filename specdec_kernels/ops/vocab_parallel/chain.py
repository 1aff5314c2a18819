"""Chain verification on vocabulary shards: ``reference.verify.verify_checked``, the rows of a
request's drafts processed together (target and draft rows share each collective); method="block"
decides the sampled requests' accepted prefix by block verification (``block.py``)."""

from __future__ import annotations

import torch

from ..._types import DRAFT_LOGITS, DRAFT_NONE, VerifyOutput
from ...reference.sampling import PURPOSE_BONUS, PURPOSE_RECOVER, safe_log
from .block import sharded_block_tau
from .protocol import Shard
from .rows import accept_uniforms, draft_rows, process_rows, race, request_params, row_min


def verify_chain_sharded(shard: Shard, args, method: str = "token") -> VerifyOutput:
    """``reference.verify.verify_checked`` on vocabulary shards (padded VerifyArgs, global ids);
    method "token" or "block" (``reference/block.py`` for the sampled requests)."""
    B, G, V = args.B, args.G, shard.V
    dev = args.target_logits.device
    G1 = G + 1
    if B == 0:  # B is replicated (the layout exchange checks it): every rank returns here, no collective
        empty = torch.empty((0,), device=dev)
        return VerifyOutput(empty.new_empty((0, G1), dtype=torch.int64), empty.int(), empty.bool())
    temp, top_k, top_p, seeds, greedy = request_params(args.sampling, B, dev)
    n = args.per_request_cpu()["num_draft_tokens"].to(dev)
    drafts = args.draft_tokens.to(torch.int64)
    pos = torch.arange(G, device=dev)
    invalid = (pos[None] < n[:, None]) & ((drafts < 0) | (drafts >= V))
    n = torch.where(invalid.any(1), row_min(torch.where(invalid, pos[None], G), G), n)  # placeholder ends it
    ids = torch.cat([torch.where((drafts >= 0) & (drafts < V), drafts, -1), torch.full((B, 1), -1, device=dev)], 1)

    def per_row(v):
        return v[:, None].expand(B, G1).reshape(-1)

    rows_sampled = per_row(~greedy)
    params = (per_row(temp), per_row(top_k), per_row(top_p))
    logits = args.target_logits.reshape(B * G1, -1)
    has_draft = args.draft_mode != DRAFT_NONE and G > 0 and not bool(greedy.all())  # greedy never reads q
    if has_draft:
        d_rows = (slice(None), slice(0, G))
        d_params = tuple(v.reshape(B, G1)[d_rows].reshape(-1) for v in params)
        d_sampled = rows_sampled.reshape(B, G1)[d_rows].reshape(-1)
        d_ids = ids[:, :G].reshape(-1, 1)
    if has_draft and args.draft_mode == DRAFT_LOGITS:  # target and draft rows share the collectives
        rows, _ = process_rows(
            shard,
            torch.cat([logits.float(), args.draft.reshape(B * G, -1).float()]),
            tuple(torch.cat([t, d]) for t, d in zip(params, d_params, strict=True)),
            torch.cat([rows_sampled, d_sampled]),
            torch.cat([ids.reshape(-1, 1), d_ids]),
        )
        target, draft = rows.take(slice(0, B * G1)), rows.take(slice(B * G1, None))
    elif has_draft:
        probs = args.draft.reshape(B * G, -1)
        target, draft = process_rows(shard, logits, params, rows_sampled, ids.reshape(-1, 1), probs, d_ids)
    else:
        (target, _), draft = process_rows(shard, logits, params, rows_sampled, ids.reshape(-1, 1)), None
    p_tok = target.at_ids.reshape(B, G1)
    t_bad, t_empty = target.bad.reshape(B, G1), target.empty.reshape(B, G1)
    argmax = target.argmax.reshape(B, G1)
    if draft is None:
        q_tok = torch.ones((B, G1), dtype=torch.float64, device=dev)
        d_bad = torch.zeros((B, G1), dtype=torch.bool, device=dev)
    else:
        pad = torch.zeros((B, 1), dtype=torch.float64, device=dev)
        q_tok = torch.cat([draft.at_ids.reshape(B, G), pad], 1)
        d_bad = torch.cat([draft.bad.reshape(B, G), pad.bool()], 1)
    row = torch.arange(G1, device=dev)
    u = accept_uniforms(seeds[:, None], 0, row[None, :])
    acc_sampled = (p_tok > 0) & (u * q_tok <= p_tok)
    acc_greedy = ids == argmax
    acc = torch.where(greedy[:, None], acc_greedy, acc_sampled) & (row[None] < n[:, None])
    j = torch.where(~acc, row[None], G1).min(1).values.clamp(max=n)  # first rejection, else n
    upto = row[None] <= j[:, None]
    b_idx = torch.arange(B, device=dev)
    w_j = None  # block: the weight w_j of the residual max(w_j p_j - q_j, 0)
    if method == "block" and G and shard.V and not bool(greedy.all()):  # replicated branch
        tau, w = sharded_block_tau(shard, target, draft, ids, p_tok, q_tok, u, n, ~greedy)
        j = torch.where(greedy, j, tau)
        upto = torch.where(greedy[:, None], upto, row[None] <= n[:, None])  # block reads rows 0 .. n
        w_j = w[b_idx, j]
    t_flag = t_bad | t_empty  # greedy: no finite logit; sampled: p == 0 everywhere (the same rows)
    flag = (upto & t_flag).any(1) | (~greedy & (upto & (row[None] < n[:, None]) & d_bad).any(1))
    # the emitted token: greedy argmax, else a race at row j (bonus from p_n, or the residual)
    flat = b_idx * G1 + j
    p_row = target.p_rows(flat)
    bonus = j >= n
    q_row = draft_rows(shard, draft, ids, b_idx, j, G)
    token = argmax[b_idx, j]
    if not bool(greedy.all()):  # replicated: every rank takes the same branch
        residual = torch.clamp((p_row if w_j is None else w_j[:, None] * p_row) - q_row, min=0)
        purposes = torch.where(bonus, PURPOSE_BONUS, PURPOSE_RECOVER)
        res_tok, p_tok_won = race(shard, [safe_log(residual), safe_log(p_row)], seeds, j, purposes)
        sampled_tok = torch.where(bonus | (res_tok < 0), p_tok_won, res_tok).clamp(min=0)
        token = torch.where(greedy, token, sampled_tok)
    tokens = torch.full((B, G1), -1, dtype=torch.int64, device=dev)
    if G:
        tokens[:, :G] = torch.where(row[None, :G] < j[:, None], drafts, -1)
    tokens[b_idx, j] = token
    return VerifyOutput(tokens, j.to(torch.int32), flag)
