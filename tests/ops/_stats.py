"""Statistical exactness machinery: goodness-of-fit tests and a simulator of (wrong) variants.

Thresholds: every test statistic is compared at ALPHA = 1e-6. A verification test file runs
fewer than 30 statistics, so a correct kernel fails a run with probability < 3e-5 (< 1 in
10,000 runs as required). Power is shown, not assumed: each test also runs the same statistic
on a deliberately wrong variant and asserts that it is rejected.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy import stats

ALPHA = 1e-6


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of integer samples to `probs`; cells with expected count < 5 are pooled.

    A sample on a zero-probability token gives p-value 0 (an impossible outcome).
    """
    samples = samples.cpu().long()
    probs = probs.cpu().double()
    n = samples.numel()
    assert n > 0
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep].numpy(), exp[keep].numpy()
    if obs.size < 2:
        return 1.0
    exp = exp * (obs.sum() / exp.sum())  # remove float dust so scipy accepts the sums
    return float(stats.chisquare(obs, exp).pvalue)


def binomial_pvalue(successes: int, trials: int, prob: float) -> float:
    return float(stats.binomtest(int(successes), int(trials), prob).pvalue)


def min_detectable_tv(n: int, probs: torch.Tensor, power: float = 0.99) -> float:
    """A rough statement of power: the smallest TV bias the chi-square test detects with `power`.

    Uses the noncentral chi-square approximation with a bias spread over the two largest cells.
    """
    df = int((probs * n >= 5).sum())
    crit = stats.chi2.ppf(1 - ALPHA, df)
    for tv in np.linspace(0.001, 0.5, 500):
        p_sorted = probs.sort(descending=True).values.double()
        lam = n * (tv**2 / float(p_sorted[0]) + tv**2 / float(p_sorted[1]))
        if stats.ncx2.sf(crit, df, lam) >= power:
            return float(tv)
    return math.inf


def sample_rows(probs: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """n samples from each of the distributions in probs [R, V] -> [n, R]."""
    return torch.multinomial(probs.double(), n, replacement=True, generator=gen).T.contiguous()


def simulate_chain(
    p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, gen: torch.Generator, *, variant: str
):
    """Vectorised chain verification with a pluggable (possibly wrong) rule, for power checks.

    p: [G+1, V], q: [G, V] or None for one-hot drafts, drafts [N, G]
    -> tokens [N, G+1] (-1 padded), num_accepted [N].
    Variants: "correct", "resample_from_p" (rejection resamples p instead of the residual; for
    one-hot drafts: without removing the rejected token), "residual_abs" (|p - q| instead of
    max(p - q, 0)), "inverted_ratio" (accept w.p. min(1, q/p)).
    """
    N, G = drafts.shape
    p = p.double()
    rows = torch.arange(G)
    p_tok = p[rows, drafts]  # [N, G]
    q_tok = q.double()[rows, drafts] if q is not None else torch.ones_like(p_tok)
    u = torch.rand(N, G, generator=gen, dtype=torch.float64)
    if variant == "inverted_ratio":
        accept = u * p_tok <= q_tok
    else:
        accept = u * q_tok <= p_tok
    rejected = ~accept
    first = torch.where(rejected.any(1), rejected.int().argmax(1), torch.full((N,), G))
    cols = torch.arange(G + 1)[None, :]
    padded = torch.cat([drafts, torch.zeros(N, 1, dtype=drafts.dtype)], 1)
    tokens = torch.where(cols < first[:, None], padded, torch.full_like(padded, -1))
    final = torch.empty(N, dtype=torch.int64)
    for j in range(G + 1):
        sel = first == j
        if not bool(sel.any()):
            continue
        if j == G or variant == "resample_from_p":
            w = p[j].expand(int(sel.sum()), -1)
        elif q is None:  # one-hot: p without the rejected draft
            w = p[j].expand(int(sel.sum()), -1).scatter(1, drafts[sel, j : j + 1], 0.0)
        elif variant == "residual_abs":
            w = (p[j] - q[j]).abs().expand(int(sel.sum()), -1)
        else:
            w = (p[j] - q[j]).clamp(min=0).expand(int(sel.sum()), -1)
        final[sel] = torch.multinomial(w, 1, generator=gen)[:, 0]
    tokens[torch.arange(N), first] = final
    return tokens, first.int()


def exact_rho(p: torch.Tensor, q: torch.Tensor, k: int) -> tuple[float, float]:
    """K-SEQ's rho* (the root of 1 - (1 - beta)^k = rho beta, beta(rho) = sum_x min(q, p / rho)) and
    beta(rho*), solved in float64 to 1e-14 (scipy's brentq): what the rho searches are tested against."""
    from scipy.optimize import brentq

    p, q = p.double(), q.double()
    beta = lambda rho: float(torch.minimum(q, p / rho).sum())  # noqa: E731
    f = lambda rho: 1 - (1 - beta(rho)) ** k - rho * beta(rho)  # noqa: E731
    if f(1.0) <= 0:
        return 1.0, beta(1.0)
    rho = brentq(f, 1.0, float(k), xtol=1e-14)
    return rho, beta(rho)


def rho_cases():
    """(name, target logits [V] float32, draft probabilities [V] float32, k): the reference test's
    world (target 3 N(0, 1) / T, draft = target + sigma N(0, 1)) and adversarial rows."""
    gen = torch.Generator().manual_seed(11)
    cases = []
    for trial in range(12):
        V = [100, 1000, 3000][trial % 3]
        scale, T = [(3.0, 0.7), (3.0, 1.0), (6.0, 0.5), (1.5, 1.0), (6.0, 1.0)][trial % 5]
        sigma = [0.3, 1.0, 2.0][trial % 3]
        s = torch.randn(V, generator=gen) * scale / T
        q = torch.softmax(s.double() + torch.randn(V, generator=gen, dtype=torch.float64) * sigma / T, 0).float()
        cases += [(f"random {trial}", s, q, k) for k in (2, 3, 4, 8, 13)]
    s = torch.randn(64, generator=gen)
    p = torch.softmax(s, 0)
    least, top, low_half = (torch.zeros(64) for _ in range(3))
    least[p.argmin()], top[p.argmax()], low_half[p.argsort()[:32]] = 1.0, 1.0, 1 / 32
    flat = torch.zeros(200)
    peaky_q = torch.softmax(torch.randn(200, generator=gen) * 5, 0)
    peaky_p = torch.randn(200, generator=gen) * 8
    for k in (2, 5, 32):
        cases += [("q = p", s, p, k), ("q one-hot on p's least", s, least, k), ("q one-hot on p's top", s, top, k)]
        cases += [("q on p's lower half", s, low_half, k)]
    for k in (2, 9, 64):
        cases += [("p flat, q peaky", flat, peaky_q, k), ("p peaky, q flat", peaky_p, torch.full((200,), 1 / 200), k)]
    cases += [
        ("V = 1", torch.zeros(1), torch.ones(1), 3),
        ("V = 3", torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0.7, 0.2, 0.1]), 2),
    ]
    return cases


# The kernels evaluate f = 1 - (1 - beta)^k - rho beta in float32 (g = rho beta summed in double by
# the CPU core, in float32 per GPU thread / Triton lane): near rho* f is off by ~1e-6, so a search's
# "rho >= rho*" is checked as the mass K-SEQ would misplace at its rho, at most this much.
RHO_EXCESS_TOL = 1e-5


def rho_outcomes(cases: list[tuple], rhos: list[float]) -> list[tuple]:
    """(name, k, rho, misplaced mass at rho, acceptance at rho, acceptance at rho*) for each of
    ``rho_cases``'s cases given a search's rho for it (float64; the mass 1 - (1 - beta)^k - rho beta
    is > 0 only below rho*)."""
    out = []
    for (name, s, q, k), rho in zip(cases, rhos, strict=True):
        p, qd = torch.softmax(s.double(), 0), q.double()
        _rho_star, beta_star = exact_rho(p, qd, k)
        beta = float(torch.minimum(qd, p / rho).sum())
        accept = 1 - (1 - beta) ** k
        out.append((name, k, rho, accept - rho * beta, accept, 1 - (1 - beta_star) ** k))
    return out


def chi_square_power(expected: torch.Tensor, alternative: torch.Tensor, n: int) -> float:
    """Probability that ``chi_square_pvalue`` (pooling as it does) rejects at ALPHA when n samples
    come from ``alternative`` instead of ``expected`` (noncentral chi-square approximation)."""
    expected = expected.cpu().double()
    alternative = alternative.cpu().double()
    if bool((alternative[expected == 0] > 0).any()):
        return 1.0
    big = expected * n >= 5
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    alt = torch.cat([alternative[big], alternative[~big].sum().reshape(1)])
    keep = exp > 0
    exp, alt = exp[keep], alt[keep]
    df = exp.numel() - 1
    noncentrality = float(n * ((alt - exp) ** 2 / exp).sum())
    crit = stats.chi2.ppf(1 - ALPHA, df)
    return float(stats.ncx2.sf(crit, df, noncentrality))


# Every backend that samples: the statistical tests run each one (``backend="auto"`` on CPU tensors
# is "cpu", the C++ core; tests/ops/conftest.py points auto at Triton, so auto alone would skip it).
SAMPLED_BACKENDS = ["triton", "cpu", "vectorized", "cuda"]


# Filtered statistical cases (top-k / top-p) that the Triton *interpreter* needs 3-15 minutes for at
# the full sample size (its threshold launches run one program per row: 40,000 requests x 10 rows), about
# half of CI's slow stage. Without a GPU they are replaced by a token-for-token equality of Triton and the
# C++ core on the same distributions and filters (``assert_triton_equals_core``), the core's law being
# tested at the full size in the same file; on a GPU (compiled Triton) they run like every other case.
INTERPRETER_EQUALITY_SAMPLES = 512  # requests of the stand-in equality check (seconds in the interpreter)


def triton_interpreted(backend: str) -> bool:
    """True for backend="triton" without a CUDA GPU (the kernels run in Triton's interpreter)."""
    return backend == "triton" and not torch.cuda.is_available()


def interpreted_stand_in(backend: str, top_k: int, top_p: float, call) -> bool:
    """For an interpreted filtered Triton case (see INTERPRETER_EQUALITY_SAMPLES): assert that
    ``call(n, backend, device=...)`` (the statistical test's own verification call on its first n
    requests) returns the same tokens and accepted counts for backend="triton" and for the C++ core
    (skips where the core is unavailable), and return True; False (nothing run) for any other case."""
    if not (triton_interpreted(backend) and (top_k > 0 or top_p < 1.0)):
        return False
    from .conftest import cpu_core_or_skip

    cpu_core_or_skip()
    n = INTERPRETER_EQUALITY_SAMPLES
    core, triton = call(n, "cpu", device="cpu"), call(n, "triton", device="cpu")
    assert torch.equal(triton.tokens.cpu(), core.tokens.cpu())
    assert torch.equal(triton.num_accepted.cpu(), core.num_accepted.cpu())
    return True


def backend_device(backend: str, device: str) -> str:
    """The device a backend's statistical test runs on (skips a backend this machine lacks):
    triton on the test device (its interpreter without a GPU), cpu and vectorized on CPU tensors,
    cuda on the GPU with the csrc extension."""
    import pytest

    if backend == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        from specdec_kernels.ops import csrc

        try:
            csrc.load_cuda_extension()
        except RuntimeError as exc:
            pytest.skip(f"CUDA extension unavailable: {str(exc)[:300]}")
        return "cuda"
    if backend == "cpu":
        from .conftest import cpu_core_or_skip

        cpu_core_or_skip()
        return "cpu"
    return device if backend == "triton" else "cpu"
