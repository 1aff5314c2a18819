"""Target-only steps (G = 0) of adaptive chain drafting (issue 28): the policy may skip the draft
forward when drafting loses. Forced schedules of draft lengths (``forced_lengths``) mix target-only
and drafting steps: greedy output equals ``target.generate``, sampled output follows the target's law,
and both caches equal a fresh prefill of the committed tokens after any mix (the draft catches up on
the tokens it missed in its next forward)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GenerationConfig  # noqa: E402

from specdec_kernels.hf import speculative_generate  # noqa: E402
from specdec_kernels.hf.draft_length import forced_lengths  # noqa: E402
from specdec_kernels.hf.generate import open_session  # noqa: E402
from specdec_kernels.reference.sampling import processed_probs  # noqa: E402

from ..ops._stats import ALPHA, chi_square_power, chi_square_pvalue  # noqa: E402
from ._models import tiny_model  # noqa: E402
from .test_generate import (  # noqa: E402
    PAD,
    _greedy_reference,
    _near_copy,
    _ragged_prompts,
    assert_caches_hold_the_committed_tokens,
)

# Draft lengths per step, cycled: all target-only, alternating, runs of target-only steps before
# chains of each length (the draft catches up on 2-4 tokens), a chain first.
SCHEDULES = [[0], [0, 3], [0, 0, 0, 2, 1], [3, 0]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=1)
    return target, _near_copy(target, 0.3, seed=5)


def _greedy(pair, schedule, new=14, prompt_seed=0, **kw):
    target, draft = pair
    ids, mask = _ragged_prompts(seed=prompt_seed)
    settings = dict(max_new_tokens=new, num_draft_tokens=3, eos_token_id=[], pad_token_id=PAD) | kw
    with forced_lengths(schedule):
        return ids, mask, speculative_generate(target, draft, ids, mask, **settings)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_greedy_with_target_only_steps_equals_generate(pair, schedule, cache):
    """Batch 3, ragged prompts: the tokens are target.generate's whatever the mix of steps."""
    ids, mask, out = _greedy(pair, schedule, cache_implementation=cache)
    assert torch.equal(out.sequences, _greedy_reference(pair[0], ids, mask, 14))
    hist = out.stats.draft_length_histogram
    assert hist.get(0, 0) > 0 and sum(hist.values()) == out.stats.steps
    drafting_steps = out.stats.steps - hist[0]
    assert out.stats.draft_forwards == sum(g * n for g, n in hist.items())  # none in target-only steps
    assert out.stats.target_forwards == out.stats.steps and (drafting_steps > 0) == (schedule != [0])


def test_greedy_with_target_only_steps_and_a_processor_and_eos(pair):
    """The root row of a target-only step is processed with the committed prefix (repetition
    penalty), and a request that meets EOS in one leaves the batch."""
    target = pair[0]
    ids, mask = _ragged_prompts(seed=4)
    free = _greedy_reference(target, ids, mask, 10)
    eos = int(free[1, ids.shape[1] + 2])  # request 1's third token becomes EOS
    config = GenerationConfig(repetition_penalty=3.0)
    settings = dict(max_new_tokens=10, pad_token_id=PAD, eos_token_id=eos)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, **settings, **config.to_diff_dict())
    assert int((expected[:, -1] == PAD).sum()) == 2 and not torch.equal(expected[0, :10], free[0, :10])  # (power)
    _, _, out = _greedy(pair, [0, 0, 2], prompt_seed=4, generation_config=config, **settings)
    assert torch.equal(out.sequences, expected)


def test_a_long_lag_catches_up_in_its_own_forward(pair):
    """After 40 target-only steps a 40-draft chain cannot take the 41 missed tokens in its first
    forward (a tree of 64 slots): one catch-up forward feeds the oldest, then the chain runs."""
    ids, mask, out = _greedy(pair, [0] * 40 + [40], new=60, num_draft_tokens=40, cache_implementation="static")
    assert torch.equal(out.sequences, _greedy_reference(pair[0], ids, mask, 60))
    assert out.stats.draft_length_histogram[40] == 1
    assert out.stats.draft_forwards == 40 + 1  # the chain's forwards and the catch-up


@pytest.mark.parametrize(
    "K, G, schedule",
    [(1, 3, [0, 3, 0, 0, 1, 0, 2]), (2, 3, [0, 0, 3, 0, 2]), (1, 40, [0] * 30 + [40])],
    ids=["chain", "two_chains", "long_lag"],
)
def test_caches_equal_a_fresh_prefill_after_target_only_steps(pair, K, G, schedule):
    """After every step of a mix of target-only and drafting steps both caches hold exactly the
    committed tokens (the draft's lagging during target-only steps; long_lag: caught up through a
    separate forward). K = 2: a target-only step is one the session can run for any drafter of chains."""
    target, draft = pair
    ids, mask = _ragged_prompts(seed=5)
    settings = dict(num_draft_tokens=G, num_drafts=K, seed=0, max_new_tokens=100, eos_token_id=[])
    with open_session(target, draft, ids, mask, **settings) as session:
        for g in schedule:
            lag = list(session.drafter.uncached_host)
            result = session.step(g)
            assert result.drafted == g
            if g == 0:  # one token each, none of them fed to the draft
                assert set(result.emitted) == {1} and result.draft_forwards == 0
                assert session.drafter.uncached_host == [u + 1 for u in lag]
            else:
                assert max(session.drafter.uncached_host) <= 2
            assert_caches_hold_the_committed_tokens(session, target, draft)
            session.drop_finished_rows(result.finished)


def test_pinned_draft_length_never_takes_target_only_steps(pair):
    """adaptive_draft=False (G pinned) has no policy: even a forced schedule of zeros drafts G."""
    _, _, out = _greedy(pair, [0], adaptive_draft=False)
    assert set(out.stats.draft_length_histogram) == {3}


def _three_token_distribution(model, prompt, temperature, top_k=0, top_p=1.0):
    """Exact p(x1, x2, x3 | prompt) [V, V, V] of the model after temperature / top-k / top-p."""
    V = model.config.vocab_size

    def probs(ids):  # the processed next-token law after each sequence, float64 [R, V]
        with torch.no_grad():
            rows = model(input_ids=torch.tensor(ids)).logits[:, -1].float()
        return torch.stack([processed_probs(row, temperature, top_k, top_p) for row in rows])

    first = probs([prompt])[0]
    second = probs([prompt + [x] for x in range(V)])
    third = probs([prompt + [x, y] for x in range(V) for y in range(V)]).reshape(V, V, V)
    return first[:, None, None] * second[:, :, None] * third


@pytest.mark.parametrize(
    "schedule, sampling",
    [
        ([0], {}),
        ([0, 2], {}),
        ([2, 0], {}),
        ([0, 0, 2], {}),
        ([0, 1], dict(temperature=0.8, top_k=4, top_p=0.9)),
    ],
    ids=str,
)
def test_sampled_output_with_target_only_steps_follows_the_target(schedule, sampling):
    """Chi-square (alpha 1e-6) on (x1, x2) and on (x2, x3) (V = 6: 36 cells each) of 3000 requests
    whose steps follow ``schedule``, against the target's own law after the same processing.

    Power, asserted below: at this sample size both tests reject with probability > 0.99 a driver
    whose tokens follow the draft's law, and the first one a target-only step that forgets the
    processing (samples the target at temperature 1, no top-k / top-p) where there is one.
    """
    V, n = 6, 3000
    sampling = {"temperature": 1.0, **sampling}
    target = tiny_model("llama", vocab=V, seed=13, init_std=0.1)  # flat: p_max ~ 0.3, overlap ~ 0.7
    draft = tiny_model("llama", vocab=V, seed=14, init_std=0.1, layers=1)
    prompt = [3, 4, 5, 0]
    expected = _three_token_distribution(target, prompt, **sampling)
    draft_law = _three_token_distribution(draft, prompt, **sampling)
    first_two, last_two = expected.sum(2).flatten(), expected.sum(0).flatten()
    assert chi_square_power(first_two, draft_law.sum(2).flatten(), n) > 0.99
    assert chi_square_power(last_two, draft_law.sum(0).flatten(), n) > 0.99
    if sampling != {"temperature": 1.0}:
        raw = _three_token_distribution(target, prompt, temperature=1.0)
        assert chi_square_power(first_two, raw.sum(2).flatten(), n) > 0.99
    ids = torch.tensor([prompt] * n)
    with forced_lengths(schedule):
        out = speculative_generate(
            target, draft, ids, max_new_tokens=3, num_draft_tokens=2, seed=1, eos_token_id=[], **sampling
        )
    assert out.stats.draft_length_histogram.get(0, 0) > 0
    if schedule != [0]:
        assert 0 < out.stats.acceptance_rate < 0.95  # both accept and reject paths ran
    x = out.sequences[:, len(prompt) :]
    assert chi_square_pvalue(x[:, 0] * V + x[:, 1], first_two) > ALPHA
    assert chi_square_pvalue(x[:, 1] * V + x[:, 2], last_two) > ALPHA


def test_a_target_only_step_that_forgets_the_processing_fails(monkeypatch):
    """The biased variant the power statement above is about: target-only steps that sample the
    target's raw row (temperature 1, no top-k / top-p) fail the first chi-square test."""
    from specdec_kernels.hf.drafters.base import ChainProposal

    verify = ChainProposal.verify

    def forgetful(self, logits, method, sampling, generator, *rest, **kw):
        if self.depth == 0:
            sampling = dict(sampling, temperature=1.0, top_k=0, top_p=1.0)
        return verify(self, logits, method, sampling, generator, *rest, **kw)

    monkeypatch.setattr(ChainProposal, "verify", forgetful)
    V, n, sampling = 6, 3000, dict(temperature=0.8, top_k=4, top_p=0.9)
    target = tiny_model("llama", vocab=V, seed=13, init_std=0.1)
    draft = tiny_model("llama", vocab=V, seed=14, init_std=0.1, layers=1)
    prompt = [3, 4, 5, 0]
    expected = _three_token_distribution(target, prompt, **sampling).sum(2).flatten()
    with forced_lengths([0, 1]):
        out = speculative_generate(
            target,
            draft,
            torch.tensor([prompt] * n),
            max_new_tokens=3,
            num_draft_tokens=2,
            seed=1,
            eos_token_id=[],
            **sampling,
        )
    x = out.sequences[:, len(prompt) :]
    assert chi_square_pvalue(x[:, 0] * V + x[:, 1], expected) < ALPHA
