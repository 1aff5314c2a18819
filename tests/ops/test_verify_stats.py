"""Statistical exactness of every sampling path of sk.verify (kernel samples, not the reference).

For each path we draw N = 40,000 independent requests (their own seeds) on fixed target/draft
distributions over a small vocabulary and test, at ALPHA = 1e-6 each:
  1. the first emitted token follows p_0 (chi-square);
  2. given the first draft was accepted, the next emitted token follows p_1 (chi-square);
  3. P(first draft accepted) = sum_x min(p_0(x), q_0(x)) (exact binomial test); for one-hot drafts
     E[p_0(x_0)].
Every sampling backend is tested (triton, the C++ core "cpu", vectorized; cuda on a GPU), each at the
full N: the C++ core and the vectorized path take about a second here. Exception: without a GPU the
filtered cases of Triton (its interpreter: minutes each) check Triton's tokens equal to the core's on
the same inputs instead (``_stats.INTERPRETER_EQUALITY_SAMPLES``).
Power: the same statistics are run on a wrong variant (tests/ops/_stats.py) and must reject it;
`min_detectable_tv` states the TV bias the first-token test detects with 99% power.
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels.reference.sampling import processed_probs

from ._stats import (
    ALPHA,
    SAMPLED_BACKENDS,
    backend_device,
    binomial_pvalue,
    chi_square_pvalue,
    interpreted_stand_in,
    min_detectable_tv,
    sample_rows,
    simulate_chain,
)

N = 40_000
V = 12
G = 2


def _distributions(seed: int):
    """Target logits [G+1, V] and draft logits [G, V] that disagree substantially."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(G + 1, V, generator=gen) * 1.5
    draft = torch.randn(G, V, generator=gen) * 1.5
    return target, draft


def _processed(logits, temperature, top_k, top_p):
    return torch.stack([processed_probs(row, temperature, top_k, top_p) for row in logits])


def _check_exact(tokens, accepted, p, accept_prob):
    n = tokens.shape[0]
    assert ((tokens[:, 0] >= 0) & (tokens[:, 0] < V)).all()
    pvals = {"first token ~ p0": chi_square_pvalue(tokens[:, 0], p[0])}
    given = accepted >= 1
    pvals["next token | accepted ~ p1"] = chi_square_pvalue(tokens[given, 1], p[1])
    pvals["P(accept x0)"] = binomial_pvalue(int(given.sum()), n, accept_prob)
    return pvals


def _assert_all_pass(pvals):
    failed = {k: v for k, v in pvals.items() if v < ALPHA}
    assert not failed, f"statistical exactness rejected at alpha={ALPHA}: {failed}"


def _assert_some_fail(pvals, variant):
    assert min(pvals.values()) < ALPHA, f"no power: wrong variant {variant!r} passed: {pvals}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", SAMPLED_BACKENDS)
@pytest.mark.parametrize(
    "mode, temperature, top_k, top_p, wrong, problem",
    [
        ("logits", 1.0, 0, 1.0, "resample_from_p", 1),
        ("probs", 1.0, 0, 1.0, "residual_abs", 2),
        ("ngram", 1.0, 0, 1.0, "resample_from_p", 3),
        ("ngram", 0.8, 4, 0.9, "resample_from_p", 4),
        ("logits", 0.7, 6, 0.85, "inverted_ratio", 5),
        ("probs", 1.6, 0, 0.9, "residual_abs", 6),
    ],
)
def test_verify_is_target_distributed(mode, temperature, top_k, top_p, wrong, problem, backend, device):
    device = backend_device(backend, device)
    target_logits, draft_logits = _distributions(seed=problem)
    p = _processed(target_logits, temperature, top_k, top_p)
    q = _processed(draft_logits, temperature, top_k, top_p)
    gen = torch.Generator().manual_seed(1234)
    if mode == "ngram":
        # One-hot drafts may come from anywhere: here mostly the 3rd most likely target token,
        # so that rejections of one token are frequent and a wrong residual shows.
        proposal = torch.full((G, V), 0.2 / (V - 1), dtype=torch.float64)
        proposal[torch.arange(G), p[:G].argsort(dim=1, descending=True)[:, 2]] = 0.8
        drafts = sample_rows(proposal, N, gen)
        accept_prob = float((proposal[0] * p[0]).sum())
    else:
        drafts = sample_rows(q, N, gen)
        accept_prob = float(torch.minimum(p[0], q[0]).sum())

    def call(n, backend, device=device):  # the verification of the first n requests
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=torch.arange(n, device=device) * 7 + 1)
        if mode == "logits":
            kw["draft_logits"] = draft_logits.expand(n, G, V).contiguous().to(device)
        elif mode == "probs":
            kw["draft_probs"] = q.float().expand(n, G, V).contiguous().to(device)
        target = target_logits.expand(n, G + 1, V).contiguous().to(device)
        return sk.verify(target, drafts[:n].to(device), **kw, backend=backend)

    if interpreted_stand_in(backend, top_k, top_p, call):  # _stats.INTERPRETER_EQUALITY_SAMPLES
        return
    out = call(N, backend)
    tokens, accepted = out.tokens.cpu(), out.num_accepted.cpu()
    assert not out.nonfinite.any()
    _assert_all_pass(_check_exact(tokens, accepted, p, accept_prob))

    # Power: the same statistics reject a wrong rule on the same distributions and sample size.
    q_rows = None if mode == "ngram" else q
    bad_tokens, bad_accepted = simulate_chain(p, q_rows, drafts, gen, variant=wrong)
    _assert_some_fail(_check_exact(bad_tokens, bad_accepted, p, accept_prob), wrong)
    good_tokens, good_accepted = simulate_chain(p, q_rows, drafts, gen, variant="correct")
    _assert_all_pass(_check_exact(good_tokens, good_accepted, p, accept_prob))


def test_stated_power():
    """With N = 40,000 and these distributions the first-token test detects a TV bias of ~0.02."""
    target_logits, _ = _distributions(seed=1)
    p = _processed(target_logits, 1.0, 0, 1.0)
    tv = min_detectable_tv(N, p[0])
    assert tv < 0.03, tv
