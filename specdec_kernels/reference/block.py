"""Reference block verification of one chain: the specification of ``verify(..., method="block")``.

Block verification (Sun, Mendlovic, Leviathan, Aharoni, Ro, Beirami, Suresh, "Block Verification
Accelerates Speculative Decoding", 2024) decides the accepted prefix of the G drafts jointly instead
of draft by draft. With b_i / s_i the processed target / draft distributions of position i (given
the drafts before it) and x_1..x_n the drafts, it keeps one weight per position,

    w_0 = 1,  w_i = min(w_{i-1} b_{i-1}(x_i) / s_{i-1}(x_i), 1),

the residual mass r_i = sum_x max(w_i b_i(x) - s_i(x), 0) of position i, and the stop probability

    h_i = r_i / (r_i + 1 - w_i)  (i < n; 0 where r_i = 0),   h_n = w_n.

With one uniform eta_i per position, tau = the last i in 1..n with eta_i <= h_i (0 if none): the
request emits x_1..x_tau, then one token drawn from max(w_tau b_tau - s_tau, 0) normalised (the
bonus row b_n itself when tau = n). Each emitted sequence is exactly target-distributed, and the
expected accepted length is the largest any valid verifier reaches from the same drafts; never
below token-wise verification's (tau = 0 draws from max(b_0 - s_0, 0), the token rule's residual).

Randomness is the chain's (``reference.verify``): eta_i is the token rule's uniform of position i
(Philox(seed; 0, i - 1, ACCEPT)), the residual race of row tau uses RECOVER (BONUS at tau = n); an
empty residual (b == s to rounding) falls back to b, as the token rule's does. Greedy requests are
the argmax chain, as with the token rule (block verification changes nothing there).
"""

from __future__ import annotations

import torch

from .._params import MIN_TEMPERATURE
from . import sampling as spec  # the chain rule's processing and random numbers


def block_weights(p_tok: list[float], q_tok: list[float]) -> list[float]:
    """w_0 .. w_n from the drafts' target and draft probabilities (q(x) = 0 < p(x): ratio +inf)."""
    w = [1.0]
    for p, q in zip(p_tok, q_tok, strict=True):
        ratio = 0.0 if p <= 0 else (p / q if q > 0 else float("inf"))
        w.append(min(w[-1] * ratio, 1.0))
    return w


def stop_probability(w: float, p: torch.Tensor, q: torch.Tensor) -> float:
    """h = r / (r + 1 - w), r = sum_x max(w p(x) - q(x), 0): 0 where r = 0 (nothing to draw)."""
    r = float(torch.clamp(w * p - q, min=0).sum())
    return r / (r + 1.0 - w) if r > 0 else 0.0


def block_tau(w: list[float], h: list[float], eta: list[float]) -> int:
    """The last position i in 1..n with eta_i <= h_i (h_n = w_n), 0 if none."""
    n = len(eta)
    stops = [*h, w[n]] if n else []
    return max((i + 1 for i in range(n) if eta[i] <= stops[i]), default=0)


def verify_request_block(target, drafts, draft, mode, temperature, top_k, top_p, n, seed, V, ties="keep"):
    """(number accepted, emitted token, nonfinite flag) for one sampled request under block
    verification; the arguments of ``reference.verify._verify_request`` (greedy requests: the argmax
    chain, the same for both rules, is the caller's - ``verify_checked``)."""
    if not temperature >= MIN_TEMPERATURE:  # (NaN included)
        raise ValueError("block verification of a greedy request: the argmax chain is the token rule's")
    n = next((i for i in range(n) if not 0 <= drafts[i] < V), n)
    flagged = False
    ps, qs = [], []
    for i in range(n + 1):
        flagged |= spec.sanitize_logits(target[i])[1]
        p = spec.processed_probs(target[i], temperature, top_k, top_p, ties)
        flagged |= not bool((p > 0).any())
        ps.append(p)
        if i < n:
            q, bad_q = spec.draft_distribution(
                draft[i] if draft is not None else None, mode, temperature, top_k, top_p, ties
            )
            flagged |= bad_q
            if q is None:  # one-hot q (n-gram drafts)
                q = torch.zeros(V, dtype=torch.float64)
                q[drafts[i]] = 1.0
            qs.append(q)
    w = block_weights([float(ps[i][drafts[i]]) for i in range(n)], [float(qs[i][drafts[i]]) for i in range(n)])
    h = [stop_probability(w[i], ps[i], qs[i]) for i in range(1, n)]
    eta = [float(spec.uniforms(seed, 0, i, spec.PURPOSE_ACCEPT)) for i in range(n)]
    tau = block_tau(w, h, eta)
    if tau == n:
        return n, spec.bonus_token(ps[n], seed, n), flagged
    residual = torch.clamp(w[tau] * ps[tau] - qs[tau], min=0)
    return tau, spec.recover_token(residual, ps[tau], seed, tau), flagged  # empty residual: p, as the token rule
