"""The draft's law in the driver: the drafts are sampled from exactly the q the verifier is told.

Issue 24 item 3: at temperatures below 1e-6 the driver sampled drafts from softmax(x / 1e-6) but
handed the verifier the raw draft logits, which it processed at the true T. A perfect draft (the
target itself) then had every draft accepted and the output followed the floored law.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from specdec_kernels._params import MIN_TEMPERATURE  # noqa: E402
from specdec_kernels.hf.drafting import draft_distribution  # noqa: E402
from specdec_kernels.reference.sampling import processed_probs  # noqa: E402

from ..ops._stats import ALPHA, chi_square_power, chi_square_pvalue  # noqa: E402
from ._models import perfect_draft_run  # noqa: E402

# Near ties at the temperature's scale: logits 1, 1 - s, 1 - 2s (exact in float32) and a far one.
NEAR_TIES = {1e-7: 2.0**-23, 1e-3: 2.0**-10}
SAMPLES = 20_000


def _near_tie_row(T: float) -> list[float]:
    s = NEAR_TIES[T]
    return [1.0, 1.0 - s, 1.0 - 2 * s, -3.0]


def _law(row: list[float], T: float) -> torch.Tensor:
    """softmax(x / T) in float64 (shifted by the maximum, which does not change it)."""
    x = torch.tensor(row, dtype=torch.float32).double()
    return torch.softmax((x - x.max()) / T, dim=0)


def _first_tokens(row: list[float], T: float, *, seed: int, num_drafts: int = 1):
    """SAMPLES one-token generations from the prompt [3] with a perfect draft (a copy of the target)."""
    return perfect_draft_run(row, SAMPLES, max_new_tokens=1, num_drafts=num_drafts, temperature=T, seed=seed)


@pytest.mark.parametrize("T", sorted(NEAR_TIES))
@pytest.mark.parametrize("K", [1, 2])
def test_first_token_follows_the_target_at_tiny_temperatures(T, K):
    """Chi-square (alpha 1e-6) of the first emitted token of 20,000 requests against the exact
    target law softmax(x / T) in float64, with a perfect draft (every draft accepted, so the output
    is the drafter's own law). Failed before the fix at T = 1e-7: emitted ~ [0.378, 0.327, 0.295]
    vs the law [0.716, 0.218, 0.066].

    Power, asserted below: the test rejects with probability > 0.99 the floored law softmax(x / 1e-6)
    (the pre-fix output, at T = 1e-7) and the law at 1.1 T (at T = 1e-3, where the floor does not
    bite); a sample of that biased law is rejected.
    """
    row = _near_tie_row(T)
    expected = _law(row, T)
    biased = _law(row, max(T, 1e-6)) if T < 1e-6 else _law(row, 1.1 * T)
    assert chi_square_power(expected, biased, SAMPLES) > 0.99
    gen = torch.Generator().manual_seed(7)
    assert chi_square_pvalue(torch.multinomial(biased, SAMPLES, replacement=True, generator=gen), expected) < ALPHA
    out = _first_tokens(row, T, seed=11, num_drafts=K)
    assert out.stats.acceptance_rate > 0.99  # q = p: the first token is the drafter's sample
    assert chi_square_pvalue(out.sequences[:, 1], expected) > ALPHA


@pytest.mark.parametrize("T", [1e-7, 1e-3, 0.7, MIN_TEMPERATURE])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (2, 1.0), (0, 0.8)])
def test_draft_distribution_is_the_verifiers_processing(T, top_k, top_p):
    """The drafter's law equals the reference processing (what the verifier applies to the target):
    the logits are shifted by their maximum before scaling, so near ties keep their spacing."""
    rows = torch.tensor([_near_tie_row(1e-7), _near_tie_row(1e-3), [0.3, -1.2, 2.0, 0.1]])
    for x in rows:
        want = processed_probs(x, T, top_k, top_p)
        torch.testing.assert_close(draft_distribution(x, T, top_k, top_p).double(), want, atol=1e-6, rtol=1e-5)


def test_draft_distribution_below_the_smallest_normal_temperature_is_greedy():
    """As in the kernels: T below 2**-126 (0 included) is the limit T -> 0, one-hot at the first argmax."""
    x = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 0.0, 0.0]])
    for T in (0.0, MIN_TEMPERATURE / 2):
        assert draft_distribution(x, T, 0, 1.0).tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_output_is_exact_whatever_law_the_drafter_samples(monkeypatch):
    """The verifier is told the q the drafts were drawn from, so a drafter whose processing differs
    from the target's (here the pre-fix floored temperature, softmax(x / 1e-6)) costs acceptance,
    never exactness: chi-square (alpha 1e-6) of the first token at T = 1e-7, as above."""
    from specdec_kernels.hf import drafting

    def floored(logits, temperature, top_k, top_p):
        return torch.softmax(logits.float() / max(temperature, 1e-6), dim=-1)

    monkeypatch.setattr(drafting, "draft_distribution", floored)
    T = 1e-7
    row = _near_tie_row(T)
    out = _first_tokens(row, T, seed=12)
    assert 0.5 < out.stats.acceptance_rate < 0.9  # drafts from the floored law: rejections ran
    assert chi_square_pvalue(out.sequences[:, 1], _law(row, T)) > ALPHA
