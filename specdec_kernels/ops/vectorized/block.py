"""Block verification of chains as batched PyTorch tensor ops (``method="block"``).

The rule of ``reference/block.py`` on all requests at once: the processed target rows p_0 .. p_G
and draft rows q_0 .. q_{G-1} of the sampled requests as float64 [M, rows, V]; the weights
w_i = min(w_{i-1} p(x_i) / q(x_i), 1) by a scan over the G positions; the stop probabilities
h_i = r_i / (r_i + 1 - w_i) with r_i = sum_x max(w_i p_i - q_i, 0) (one pass over each row, which
the token rule does not need: block verification reads every row's distribution, not only row j);
tau = the last position whose uniform eta_i <= h_i (h_n = w_n); then the race of row tau over
max(w_tau p_tau - q_tau, 0) (RECOVER), or over p_n (BONUS) when tau = n. The same uniforms and
races as the token rule, so the same tokens as the reference for the same seeds. Greedy requests
are the argmax chain, shared with the token rule (``chain.verify_vectorized``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..._types import DRAFT_LOGITS, DRAFT_PROBS, VerifyOutput
from ..._validation import VerifyArgs
from ...reference.philox import uniform_open_torch
from ...reference.sampling import PURPOSE_ACCEPT, PURPOSE_BONUS, PURPOSE_RECOVER
from .chain import (
    philox,
    processed_probs,
    race,
    sanitize,
    unusable_prob_rows,
    usable_probs,
    verify_vectorized,
)


def verify_block_vectorized(args: VerifyArgs) -> VerifyOutput:
    """Block verification on checked arguments in the padded layout (``VerifyArgs.padded()``): the
    token rule's pass (``chain.verify_vectorized``) with the block rule for the sampled requests.
    Without drafts (G = 0) or vocabulary both rules draw the same bonus token."""
    return verify_vectorized(args, sampled_rule=_block if args.G > 0 and args.V > 0 else None)


def _distributions(args: VerifyArgs, params: dict, x: Tensor, index: Tensor):
    """(p [M, G+1, V], q [M, G, V] float64 or None for one-hot drafts, draft-row flags [M, G]) of
    the requests ``index``; x: the sanitised target rows [B, G+1, V]."""
    G, V = args.G, args.V
    M = index.numel()
    t = params["temperature"][index].double()
    top_k, top_p = params["top_k"][index], params["top_p"][index].double()
    filtered = args.has_filter
    by_index = args.sampling.ties_by_index()

    def probs(rows_x: Tensor, rows: int):
        flat = rows_x.reshape(M * rows, V)
        per_row = [v.repeat_interleave(rows) for v in (t, top_k, top_p)]
        return processed_probs(flat, flat.amax(-1), *per_row, filtered, by_index).view(M, rows, V)

    p = probs(x[index], G + 1)
    bad_q = torch.zeros((M, G), dtype=torch.bool, device=p.device)
    q = None
    if args.draft_mode == DRAFT_LOGITS:
        xd, bad, _, _ = sanitize(args.draft[index].reshape(M * G, V))
        q, bad_q = probs(xd, G), bad.view(M, G)
    elif args.draft_mode == DRAFT_PROBS:
        q = usable_probs(args.draft[index])
        bad_q = unusable_prob_rows(args.draft[index])
    return p, q, bad_q


def stop_weights(p_tok: Tensor, q_tok: Tensor) -> Tensor:
    """w_0 .. w_G [M, G+1] float64 from p / q at the drafts [M, G] (q = 0 < p: ratio +inf), by the
    reference's scan (``reference.block.block_weights``) on all requests at once; also the vocabulary
    shards' (``ops/vocab_parallel/block.py``)."""
    M, G = p_tok.shape
    ratio = torch.where(q_tok > 0, p_tok / q_tok.clamp(min=1e-300), torch.full_like(p_tok, float("inf")))
    ratio = torch.where(p_tok > 0, ratio, torch.zeros_like(ratio))
    w = torch.ones((M, G + 1), dtype=torch.float64, device=p_tok.device)
    for i in range(G):
        w[:, i + 1] = torch.clamp(w[:, i] * ratio[:, i], max=1.0)
    return w


def _block(args: VerifyArgs, params: dict, x: Tensor, flag_rows: Tensor, tok: Tensor, n: Tensor, index: Tensor):
    """(accepted tau [M], token [M], flagged [M]) of the sampled requests ``index`` under block
    verification; x, flag_rows, tok, n: the token rule's sanitised rows, row flags, clamped draft ids
    and draft counts of every request (``chain.verify_vectorized``)."""
    G, V = args.G, args.V
    dev = args.target_logits.device
    M = index.numel()
    pos = torch.arange(G + 1, device=dev)
    tok, n = tok[index], n[index]
    p, q, bad_q = _distributions(args, params, x, index)
    if q is None:  # one-hot drafts
        q = torch.zeros((M, G, V), dtype=torch.float64, device=dev).scatter_(2, tok[:, :, None], 1.0)
    p_tok = p[:, :G].gather(2, tok[:, :, None]).squeeze(2)
    q_tok = q.gather(2, tok[:, :, None]).squeeze(2)
    w = stop_weights(p_tok, q_tok)
    r = torch.clamp(w[:, :G, None] * p[:, :G] - q, min=0).sum(-1)  # r_i for rows 0 .. G-1
    h = torch.where(r > 0, r / (r + 1.0 - w[:, :G]), torch.zeros_like(r))
    stops = torch.cat([h[:, 1:], torch.zeros_like(h[:, :1])], 1)  # stop at position i = 1 .. G
    last = torch.arange(1, G + 1, device=dev)[None, :] == n[:, None]
    stops = torch.where(last, w[:, 1:], stops)  # h_n = w_n
    seed = params["seed"][index]
    rows = torch.arange(G, device=dev, dtype=torch.int64)
    bits = philox(seed[:, None], torch.zeros_like(rows), rows, torch.full_like(rows, PURPOSE_ACCEPT))[0]
    eta = uniform_open_torch(bits).to(torch.float64)  # eta of position i + 1 = the token rule's u_i
    stop = (eta <= stops) & (pos[None, 1:] <= n[:, None])
    tau = torch.where(stop, pos[None, 1:], torch.zeros_like(stop, dtype=torch.int64)).amax(-1)
    token = _race_row(p, q, w, tau, n, seed)
    flagged = (flag_rows[index] & (pos[None, :] <= n[:, None])).any(-1) | (bad_q & (pos[None, :G] < n[:, None])).any(-1)
    return tau, token, flagged


def _race_row(p: Tensor, q: Tensor, w: Tensor, tau: Tensor, n: Tensor, seed: Tensor) -> Tensor:
    """Row tau's token: the race over max(w_tau p_tau - q_tau, 0) (RECOVER), p_n (BONUS) at tau = n;
    an empty residual falls back to p_tau with the same uniforms."""
    M = tau.numel()
    at = torch.arange(M, device=tau.device)
    p_tau = p[at, tau]
    recover = tau < n
    qrow = q[at, tau.clamp(max=max(q.shape[1] - 1, 0))]
    weight = torch.where(recover[:, None], torch.clamp(w[at, tau][:, None] * p_tau - qrow, min=0), p_tau)
    purpose = torch.where(recover, PURPOSE_RECOVER, PURPOSE_BONUS).to(torch.int64)
    best = race(weight.clone(), seed, tau, purpose)
    redo = (best < 0) & recover
    if bool(redo.any()):
        rows = redo.nonzero().squeeze(1)
        best[rows] = race(p_tau[rows].clone(), seed[rows], tau[rows], purpose[rows])
    return best.clamp(min=0)
