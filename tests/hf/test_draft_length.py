"""Adaptive draft length (hf/draft_length.py): the cost models and the policy's choices."""

from __future__ import annotations

import pytest
import torch

from specdec_kernels.hf import speculative_generate
from specdec_kernels.hf.draft_length import (
    CPU_LAYER_BYTES,
    NO_TARGET_ONLY_ENV,
    PROBE_EVERY,
    DraftLengthPolicy,
    acceptance_estimate,
    best_by_shapes,
    draft_cost_estimate,
    expected_tokens,
    forced_lengths,
    pair_step_times,
)

from ._models import tiny_model


class _Model(torch.nn.Module):
    """A stand-in model: the policy keys its timings on the (target, draft) objects."""


def _run(policy, step_seconds, accept_rate: float, steps: int, active: int = 1, totals=None) -> list[int]:
    """Drive the policy like speculative_generate: choose, 'run' a step of step_seconds(g), record.
    totals: the call's [accepted, rejections] to continue from (updated)."""
    chosen = []
    accepted, rejections = totals or (0, 0)
    for _ in range(steps):
        g = policy.choose(accepted, rejections, active)
        chosen.append(g)
        # the geometric model's expectations: drafts accepted, and whether the step ended in a rejection
        accepted += sum(accept_rate**i for i in range(1, g + 1))
        rejections += 1 - accept_rate**g
        policy.record(g, active, step_seconds(g))
    if totals is not None:
        totals[:] = [accepted, rejections]
    return chosen


def test_expected_tokens_and_acceptance_estimate():
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert acceptance_estimate(0, 0) == pytest.approx(0.7)  # the prior
    assert acceptance_estimate(900, 100) == pytest.approx(0.9, abs=0.01)
    assert acceptance_estimate(0, 10_000) == 0.01  # clamped


def test_cpu_cost_estimate_counts_streamed_bytes_and_layers():
    """On the CPU a draft costs its weight bytes plus a fixed cost per layer, relative to the target's:
    a bf16 draft counts half its bytes, and swapping in oneDNN linears changes nothing."""
    import copy

    from specdec_kernels.hf.cpu_linear import onednn_linear_available, use_onednn_linears
    from specdec_kernels.hf.draft_length import _streamed_bytes

    target = tiny_model("qwen2", layers=4, hidden=128, vocab=997)
    draft = tiny_model("qwen2", layers=1, hidden=64, vocab=997)
    expected = (_streamed_bytes(draft) + CPU_LAYER_BYTES) / (_streamed_bytes(target) + 4 * CPU_LAYER_BYTES)
    assert draft_cost_estimate(target, draft) == pytest.approx(expected)
    embedding = target.get_input_embeddings().weight
    params = sum(p.numel() * 4 for p in target.parameters())
    assert _streamed_bytes(target) == params - embedding.numel() * 4  # one embedding row is read, not all
    half = copy.deepcopy(draft).to(torch.bfloat16)
    assert _streamed_bytes(half) * 2 == _streamed_bytes(draft)
    if onednn_linear_available():
        swapped_t, swapped_d = copy.deepcopy(target), copy.deepcopy(draft)
        use_onednn_linears(swapped_t), use_onednn_linears(swapped_d)
        assert _streamed_bytes(swapped_t) == _streamed_bytes(target)
        assert draft_cost_estimate(swapped_t, swapped_d) == pytest.approx(expected)
    from specdec_kernels.hf.cpu_f32 import native_linear_available, use_native_linears

    if native_linear_available():  # its panels: output rows padded to 16
        pad = sum(4 * (-m.out_features % 16) * m.in_features for m in target.modules() if type(m) is torch.nn.Linear)
        swapped_t = copy.deepcopy(target)
        assert use_native_linears(swapped_t) > 0
        assert _streamed_bytes(swapped_t) == _streamed_bytes(target) + pad > _streamed_bytes(target)


def test_shapes_model_drafts_more_when_drafts_are_cheap_or_accepted():
    assert best_by_shapes(0.9, 8, 0.05) > best_by_shapes(0.9, 8, 0.5)
    assert best_by_shapes(0.9, 8, 0.2) > best_by_shapes(0.3, 8, 0.2)
    assert best_by_shapes(0.99, 4, 0.0) == 4  # capped at G_max
    assert best_by_shapes(0.01, 4, 1.0) == 1


def test_shape_model_prices_rows_past_the_free_ones():
    """The target's rows past FREE_ROWS cost row_cost each: a well-accepted chain stops where its
    rows start to cost; with free rows (a GPU) it drafts to G_max."""
    from specdec_kernels.hf.draft_length import FREE_ROWS, shape_cost

    assert shape_cost(3, FREE_ROWS, 0.2, 0.5) == pytest.approx(1.6)
    assert shape_cost(3, FREE_ROWS + 2, 0.2, 0.5) == pytest.approx(2.6)
    assert best_by_shapes(0.9, 8, 0.05, row_cost=0.0) == 8
    assert best_by_shapes(0.9, 8, 0.05, row_cost=0.5) == FREE_ROWS - 1


def test_row_cost_estimate_from_the_targets_shape():
    """On the CPU: 2 FLOPs per streamed weight at CPU_FLOPS_PER_BYTE over the one-row forward's
    bytes and layer costs; a bf16 target's row costs more of its (cheaper) one-row forward."""
    import copy

    from specdec_kernels.hf.draft_length import CPU_FLOPS_PER_BYTE, _streamed, row_cost_estimate

    target = tiny_model("qwen2", layers=4, hidden=128, vocab=997)
    nbytes, weights = _streamed(target)
    assert nbytes == 4 * weights
    expected = 2 * weights / CPU_FLOPS_PER_BYTE / (nbytes + 4 * CPU_LAYER_BYTES)
    assert row_cost_estimate(target) == pytest.approx(expected)
    assert row_cost_estimate(copy.deepcopy(target).to(torch.bfloat16)) > row_cost_estimate(target)


def test_draft_row_cost_estimate_from_the_drafts_shape():
    """On the CPU: CPU_LAYER_ROW_BYTES per layer over the one-row forward's bytes and layer costs; a
    deeper draft of the same width pays more per row of its forward, a GPU draft nothing."""
    from specdec_kernels.hf.draft_length import CPU_LAYER_ROW_BYTES, _streamed, draft_row_cost_estimate

    draft = tiny_model("qwen2", layers=4, hidden=128, vocab=997)
    nbytes, _ = _streamed(draft)
    expected = 4 * CPU_LAYER_ROW_BYTES / (nbytes + 4 * CPU_LAYER_BYTES)
    assert draft_row_cost_estimate(draft) == pytest.approx(expected)
    assert draft_row_cost_estimate(tiny_model("qwen2", layers=8, hidden=128, vocab=997)) > expected
    on_meta = tiny_model("qwen2", layers=4, hidden=128, vocab=997).to("meta")  # no CPU: priced as a GPU
    assert draft_row_cost_estimate(on_meta) == 0.0


def test_measured_model_finds_the_verification_forwards_cliff():
    """The CPU measurement that motivated it: target forwards of 1-3 tokens cost the same, 4+ tokens
    1.8x (another BLAS kernel); a draft forward 0.37 of a target's. The shape model (cost 0.59 from
    the Qwen pair's shapes) drafts 1 at acceptance 0.8; the measured one settles on 2."""

    def seconds(g):
        return (1.0 if g + 1 <= 3 else 1.8) + 0.37 * g

    target, draft = _Model(), _Model()
    policy = DraftLengthPolicy(target, draft, 6, 0.59, measured=True)
    chosen = _run(policy, seconds, 0.8, 60)
    assert set(chosen[2:12]) >= {2, 3}  # explored both sides of the cliff
    tail = chosen[30:]
    assert tail.count(2) >= 0.8 * len(tail)  # then mostly the best (every 16th step refreshes a neighbour)
    assert best_by_shapes(0.8, 6, 0.59) == 1
    # remembered for the pair: a new call starts informed
    again = DraftLengthPolicy(target, draft, 6, 0.59, measured=True)
    assert _run(again, seconds, 0.8, 3)[1:] == [2, 2]


def test_measured_model_drafts_long_when_forwards_are_flat():
    policy = DraftLengthPolicy(_Model(), _Model(), 6, 0.59, measured=True)
    chosen = _run(policy, lambda g: 1.0 + 0.02 * g, 0.95, 40)
    assert chosen[-1] == 6


def test_first_step_of_a_call_is_not_timed_and_timings_are_per_batch_size():
    target, draft = _Model(), _Model()
    policy = DraftLengthPolicy(target, draft, 4, 0.3, measured=True)
    policy.record(2, 1, 100.0)  # a cold first step (one-off costs): ignored
    assert not pair_step_times(target, draft, 1).seconds
    policy.record(2, 1, 1.0)
    policy.record(2, 3, 2.0)
    assert pair_step_times(target, draft, 1).seconds == {2: 1.0}
    assert pair_step_times(target, draft, 3).seconds == {2: 2.0}


def test_shapes_policy_never_reads_timings():
    target, draft = _Model(), _Model()
    slow_long = _run(DraftLengthPolicy(target, draft, 6, 0.2, measured=False), lambda g: 1.0 + 9 * g, 0.9, 10)
    flat = _run(DraftLengthPolicy(target, draft, 6, 0.2, measured=False), lambda g: 1.0, 0.9, 10)
    assert slow_long == flat and max(flat) > 1
    assert not pair_step_times(target, draft, 1).seconds


def test_sampled_calls_are_reproducible_and_draft_cost_is_checked():
    """Sampling uses the timing-free model by default: one seed, the same tokens, twice."""
    target = tiny_model("llama", seed=1)
    draft = tiny_model("llama", seed=2)
    ids = torch.randint(3, 90, (1, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=8, num_draft_tokens=4, temperature=0.8, seed=11, eos_token_id=[])
    first = speculative_generate(target, draft, ids, **kw)
    second = speculative_generate(target, draft, ids, **kw)
    assert torch.equal(first.sequences, second.sequences)
    assert first.stats.draft_length_histogram == second.stats.draft_length_histogram
    for bad in ("fast", -1.0, True):
        with pytest.raises(ValueError, match="draft_cost"):
            speculative_generate(target, draft, ids, draft_cost=bad, **kw)


def _longest_run_of(value, chosen: list[int]) -> int:
    longest = run = 0
    for g in chosen:
        run = run + 1 if g == value else 0
        longest = max(longest, run)
    return longest


@pytest.mark.parametrize("measured", [True, False])
def test_policy_takes_target_only_steps_when_drafting_loses_and_drafts_again_when_it_wins(measured):
    """A draft forward costs 0.4 of a target step. At acceptance 0.1 no chain pays for itself
    (g = 1: 1.1 tokens for 1.4 steps): the policy settles on target-only steps (G = 0), drafting
    once every PROBE_EVERY + 1 steps to re-test the draft. When acceptance rises to 0.9 (the text
    became predictable) the probes see it and it drafts again within a few probes."""
    policy = DraftLengthPolicy(_Model(), _Model(), 4, 0.4, measured=measured)
    seconds, totals = (lambda g: 1.0 + 0.4 * g), [0, 0]
    low = _run(policy, seconds, 0.1, 90, totals=totals)
    tail = low[45:]
    assert tail.count(0) >= 0.8 * len(tail)
    assert _longest_run_of(0, low) <= PROBE_EVERY and min(tail) == 0 < max(tail)  # probes
    high = _run(policy, seconds, 0.9, 60, totals=totals)
    first = next(i for i in range(len(high) - 3) if min(high[i : i + 3]) > 0)  # drafting again
    assert first <= 5 * (PROBE_EVERY + 1)  # (after 4 probes here)
    assert 0 not in high[first:] and max(high[-5:]) >= 2  # and longer chains as the estimate climbs


def test_shapes_model_takes_target_only_steps_when_drafts_are_rarely_accepted():
    assert best_by_shapes(0.1, 4, 0.3, target_only=True) == 0  # 1.1 tokens for 1.3 forwards < 1
    assert best_by_shapes(0.1, 4, 0.3) == 1  # (the arm is off by default)
    assert best_by_shapes(0.5, 4, 0.3, target_only=True) >= 1  # 1.5 for 1.3 > 1
    assert best_by_shapes(0.3, 4, 0.3, target_only=True) == 1  # a near-tie goes to drafting


def test_target_only_arm_can_be_turned_off(monkeypatch):
    """target_only=False or SPECDEC_NO_TARGET_ONLY_STEPS=1: every step drafts (benchmarks of before / after)."""
    off = DraftLengthPolicy(_Model(), _Model(), 4, 0.4, measured=True, target_only=False)
    assert 0 not in _run(off, lambda g: 1.0 + 0.4 * g, 0.1, 40)
    monkeypatch.setenv(NO_TARGET_ONLY_ENV, "1")
    env_off = DraftLengthPolicy(_Model(), _Model(), 4, 0.4, measured=False)
    assert 0 not in _run(env_off, lambda g: 1.0, 0.1, 40)


def test_a_step_catching_up_is_not_timed():
    """The drafting step after a target-only one also feeds the draft the tokens it missed: its
    time is not the arm's and is not recorded."""
    target, draft = _Model(), _Model()
    policy = DraftLengthPolicy(target, draft, 4, 0.3, measured=True)
    policy.record(1, 1, 100.0)  # the call's first step: not timed
    policy.record(0, 1, 0.5)
    policy.record(2, 1, 9.0)  # catching up
    policy.record(2, 1, 1.5)
    assert pair_step_times(target, draft, 1).seconds == {0: 0.5, 2: 1.5}


def test_forced_lengths_schedule():
    policy = DraftLengthPolicy(_Model(), _Model(), 3, 0.3, measured=False)
    with forced_lengths([0, 5, 2]):
        assert [policy.choose(0, 0, 1) for _ in range(5)] == [0, 3, 2, 0, 3]  # capped at G_max
    assert policy.choose(0, 0, 1) >= 1  # the prior (0.7) drafts
    for bad in ([], [-1], [1.5]):
        with pytest.raises(ValueError, match="forced_lengths"), forced_lengths(bad):
            pass
