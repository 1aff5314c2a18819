"""Plain-PyTorch definitions of logit processing and of the kernels' random numbers.

These functions are the specification: the Triton kernels must agree with them token for token
when both use the same seeds.
"""

from __future__ import annotations

import numpy as np
import torch

from .._types import DRAFT_LOGITS, DRAFT_PROBS
from .philox import philox4x32, uniform_open

# Third Philox counter word: what a random number is for (the Triton kernels take these values;
# csrc/verify_core.h spells them again, in C++).
PURPOSE_ACCEPT = 0
PURPOSE_RECOVER = 1
PURPOSE_BONUS = 2


def sanitize_logits(row: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """fp32 view of a logit row with NaN/+inf -> -inf; also whether anything was replaced."""
    x = row.to(torch.float32)
    bad = torch.isnan(x) | (x == float("inf"))
    return torch.where(bad, torch.full_like(x, float("-inf")), x), bool(bad.any())


def allowed_tokens(words: torch.Tensor, V: int) -> torch.Tensor:
    """bool [V]: token t is allowed iff bit t % 32 of word t // 32 of a ``token_bitmask`` row is set."""
    t = torch.arange(V)
    return ((words.to(torch.int64)[t // 32] >> (t % 32)) & 1) == 1


def grammar_masked(row: torch.Tensor, words: torch.Tensor | None) -> torch.Tensor:
    """A logit row with -inf at the tokens its ``token_bitmask`` words disallow (None: unchanged).

    Applied before everything else (sanitising, temperature, top-k, top-p): a disallowed entry is
    -inf whatever it held (NaN there is not flagged), so it is never sampled nor accepted."""
    if words is None:
        return row
    return torch.where(allowed_tokens(words, row.numel()), row, torch.full_like(row, float("-inf")))


def sanitize_probs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 view of draft_probs rows [..., V] with unusable entries -> 0; also, per row, whether
    any was replaced (bool [...]; a 0-d tensor for one row).

    Unusable: NaN, +inf and negative values (-inf included). Such a q(x) is no probability, so it
    counts as 0 in the accept ratio and in the residual, and the request is flagged (``nonfinite``).
    """
    q = rows.double()
    bad = ~((q >= 0) & (q < float("inf")))  # NaN fails both comparisons
    return torch.where(bad, torch.zeros_like(q), q), bad.any(-1)


def filter_threshold(x: torch.Tensor, temperature: float, top_k: int, top_p: float) -> float:
    """Raw-logit threshold for top-k then top-p on a sanitised fp32 row (keep x >= threshold).

    top-k keeps every token whose logit is >= the k-th largest (ties kept);
    top-p then keeps the smallest set of highest-probability tokens whose mass is >= top_p
    (again with ties at the boundary kept). -inf means nothing is filtered.
    """
    V = x.numel()
    thr = float("-inf")
    finite = x[x > float("-inf")]
    if 0 < top_k < V and finite.numel() >= top_k:
        thr = float(torch.sort(finite, descending=True).values[top_k - 1])
    if top_p < 1.0:
        kept = torch.sort(x[(x >= thr) & (x > float("-inf"))], descending=True).values
        if kept.numel() > 0:
            weights = torch.exp((kept.double() - kept[0].double()) / temperature)
            mass = torch.cumsum(weights, 0)
            first = int(torch.searchsorted(mass, top_p * mass[-1]))  # first index with mass >= goal
            thr = float(kept[min(first, kept.numel() - 1)])
    return thr


def kept_entries(x: torch.Tensor, temperature: float, top_k: int, top_p: float, top_p_ties: str = "keep"):
    """[V] bool: the entries of a sanitised fp32 row that top-k then top-p keep.

    top_p_ties="keep": x >= ``filter_threshold`` (the whole tie group at the top-p boundary stays).
    top_p_ties="by_index": order the entries top-k keeps by descending logit and, among equal
    logits, descending index; keep each entry whose float64 mass ordered before it is < top_p of
    the total. transformers' TopPLogitsWarper keeps the same set when its ascending sort is stable
    (ties then ascend by index, and it drops cumulative mass <= 1 - top_p). The cumulative mass
    is the same sum as ``filter_threshold``'s, so both rules cut in the same tie group.
    """
    finite = x > float("-inf")
    if top_p_ties == "keep" or top_p >= 1.0:
        return (x >= filter_threshold(x, temperature, top_k, top_p)) & finite
    if top_p_ties != "by_index":
        raise ValueError(f"top_p_ties must be 'keep' or 'by_index', got {top_p_ties!r}")
    index = torch.nonzero((x >= filter_threshold(x, temperature, top_k, 1.0)) & finite).squeeze(1).flip(0)
    kept = torch.zeros(x.shape, dtype=torch.bool)
    if index.numel() == 0:
        return kept
    index = index[torch.sort(x[index], descending=True, stable=True).indices]  # ties: higher index first
    values = x[index].double()
    mass = torch.cumsum(torch.exp((values - values[0]) / temperature), 0)
    first = int(torch.searchsorted(mass, top_p * mass[-1]))  # the last entry whose mass before is < goal
    kept[index[: min(first, index.numel() - 1) + 1]] = True
    return kept


def processed_probs(
    row: torch.Tensor, temperature: float, top_k: int, top_p: float, top_p_ties: str = "keep"
) -> torch.Tensor:
    """float64 probabilities after temperature, top-k and top-p (all zeros if nothing is finite)."""
    x, _ = sanitize_logits(row)
    kept = kept_entries(x, temperature, top_k, top_p, top_p_ties)
    if not bool(kept.any()):
        return torch.zeros(x.shape, dtype=torch.float64)
    xd = x.double()
    m = xd[kept].max()
    w = torch.where(kept, torch.exp((xd - m) / temperature), torch.zeros_like(xd))
    return w / w.sum()


def draft_distribution(row, mode: int, temperature: float, top_k: int, top_p: float, top_p_ties: str = "keep"):
    """(q as float64, whether the row held unusable values) for a draft row given as logits
    (DRAFT_LOGITS: processed like the target) or probabilities (DRAFT_PROBS: used as given,
    unusable entries as 0); (None, False) for one-hot drafts (DRAFT_NONE: no row)."""
    if mode == DRAFT_LOGITS:
        return processed_probs(row, temperature, top_k, top_p, top_p_ties), sanitize_logits(row)[1]
    if mode == DRAFT_PROBS:
        q, bad = sanitize_probs(row)
        return q, bool(bad)
    return None, False


def uniforms(seed: int, c0, row: int, purpose: int) -> np.ndarray:
    """float32 uniforms in (0, 1) for counters (c0, row, purpose, 0) under `seed`."""
    bits, _, _, _ = philox4x32(np.int64(seed), np.asarray(c0), row, purpose, 0)
    return uniform_open(bits)


def race_uniforms(seed: int, V: int, row: int, purpose: int) -> np.ndarray:
    """The race's uniform for every vocabulary entry x: word x % 4 of Philox(seed; x // 4, row, purpose, 0)."""
    x = np.arange(V)
    words = philox4x32(np.int64(seed), x // 4, row, purpose, 0)
    return uniform_open(np.choose(x % 4, words))


def exponential_race(log_weights: torch.Tensor, seed: int, row: int, purpose: int) -> int:
    """argmax_x log w(x) - log E_x with E_x = -log u_x: a sample from norm(w); -1 if w == 0."""
    V = log_weights.numel()
    u = torch.from_numpy(race_uniforms(seed, V, row, purpose)).double()
    keys = log_weights.double() - torch.log(-torch.log(u))
    keys = torch.where(torch.isnan(keys), torch.full_like(keys, float("-inf")), keys)
    if not bool((keys > float("-inf")).any()):
        return -1
    return int(torch.argmax(keys))  # first index among exact ties


def safe_log(w: torch.Tensor) -> torch.Tensor:
    """log w elementwise, -inf where w <= 0 (no warning, no NaN): the race's log-weights."""
    return torch.where(w > 0, torch.log(torch.where(w > 0, w, torch.ones_like(w))), torch.full_like(w, float("-inf")))


def accept_uniforms(seed: int, row: int, k: int) -> list[float]:
    """The accept tests' uniforms of candidates 0 .. k - 1 at `row`: counters (j, row, ACCEPT)."""
    return [float(uniforms(seed, j, row, PURPOSE_ACCEPT)) for j in range(k)]


def bonus_token(p: torch.Tensor, seed: int, row: int) -> int:
    """The bonus token at `row`: a race over p (token 0 when p is empty: a flagged row)."""
    return max(exponential_race(safe_log(p), seed, row, PURPOSE_BONUS), 0)


def recover_token(residual: torch.Tensor, p: torch.Tensor, seed: int, row: int) -> int:
    """The token drawn at `row` after every draft there was rejected: a race over the residual
    weights; an empty residual (p == q to rounding) falls back to p, as the kernels do (token 0 when
    p is empty too: a flagged row)."""
    token = exponential_race(safe_log(residual), seed, row, PURPOSE_RECOVER)
    return token if token >= 0 else max(exponential_race(safe_log(p), seed, row, PURPOSE_RECOVER), 0)
