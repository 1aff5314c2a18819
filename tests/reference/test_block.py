"""Block verification's rule (reference/block.py): its law computed exactly, and sampled."""

import itertools
import random

import pytest
import torch

from specdec_kernels.reference.block import block_tau, block_weights, stop_probability, verify_request_block


def _exact_law(b, s, G, V, weights=block_weights):
    """(law of the first G + 1 emitted tokens, completed from the target; expected accepted drafts)
    of block verification, with the drafts drawn from s and the eta's integrated out exactly.
    b(prefix), s(prefix): float64 distributions [V] of the next token."""
    law, accepted = {}, 0.0

    def complete(seq, weight):
        if len(seq) == G + 1:
            law[tuple(seq)] = law.get(tuple(seq), 0.0) + weight
            return
        for z, pz in enumerate(b(tuple(seq)).tolist()):
            complete([*seq, z], weight * pz)

    for drafts in itertools.product(range(V), repeat=G):
        q_seq = 1.0
        for i in range(G):
            q_seq *= float(s(drafts[:i])[drafts[i]])
        if q_seq == 0:
            continue
        p_tok = [float(b(drafts[:i])[drafts[i]]) for i in range(G)]
        q_tok = [float(s(drafts[:i])[drafts[i]]) for i in range(G)]
        w = weights(p_tok, q_tok)
        stops = [stop_probability(w[i], b(drafts[:i]), s(drafts[:i])) for i in range(1, G)] + [w[G]]
        for tau in range(G + 1):  # P(tau) = h_tau * prod_{j > tau} (1 - h_j)
            prob = stops[tau - 1] if tau else 1.0
            for j in range(tau + 1, G + 1):
                prob *= 1 - stops[j - 1]
            if prob == 0:
                continue
            accepted += q_seq * prob * tau
            prefix = drafts[:tau]
            if tau == G:
                nxt = b(prefix)
            else:
                r = torch.clamp(w[tau] * b(prefix) - s(prefix), min=0)
                nxt = r / r.sum()
            for y, py in enumerate(nxt.tolist()):
                complete([*prefix, y], q_seq * prob * py)
    return law, accepted


def _target_law(b, G, V):
    law = {}
    for seq in itertools.product(range(V), repeat=G + 1):
        prob = 1.0
        for i in range(G + 1):
            prob *= float(b(seq[:i])[seq[i]])
        law[seq] = prob
    return law


def test_the_papers_example_accepts_eleven_ninths():
    """V = {a, b}, context-free target (1/3, 2/3) and draft (2/3, 1/3), G = 2: block verification
    accepts 11/9 drafts per step in expectation (token-wise: 10/9), and emits the target's law."""
    b = lambda prefix: torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)  # noqa: E731
    s = lambda prefix: torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)  # noqa: E731
    law, accepted = _exact_law(b, s, 2, 2)
    assert accepted == pytest.approx(11 / 9, abs=1e-12)
    want = _target_law(b, 2, 2)
    assert max(abs(law[k] - want[k]) for k in want) < 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_context_dependent_rows_keep_the_target_law_and_beat_token_wise(seed):
    """Random prefix-dependent target and draft (V = 3, G = 3, some zero entries): the emitted
    tokens' joint law equals the target's, and the expected accepted length is >= token-wise's."""
    rng = random.Random(seed)
    cache = {}

    def dist(kind, prefix):
        if (kind, prefix) not in cache:
            w = torch.tensor([rng.random() ** 3 if rng.random() > 0.2 else 0.0 for _ in range(3)], dtype=torch.float64)
            w[rng.randrange(3)] += 0.1
            cache[kind, prefix] = w / w.sum()
        return cache[kind, prefix]

    b, s = (lambda prefix: dist("b", prefix)), (lambda prefix: dist("s", prefix))
    G, V = 3, 3
    law, accepted = _exact_law(b, s, G, V)
    want = _target_law(b, G, V)
    assert max(abs(law.get(k, 0.0) - want[k]) for k in want) < 1e-12
    token_wise = 0.0
    for drafts in itertools.product(range(V), repeat=G):
        q_seq, alive = 1.0, 1.0
        for i in range(G):
            q_seq *= float(s(drafts[:i])[drafts[i]])
        for i in range(G):
            p, q = float(b(drafts[:i])[drafts[i]]), float(s(drafts[:i])[drafts[i]])
            alive *= min(1.0, p / q) if q > 0 else 0.0
            token_wise += q_seq * alive
    assert accepted >= token_wise - 1e-12


def test_a_variant_without_the_weights_fails_the_law():
    """Power of the exactness check: stopping with h_i = r_i computed from w = 1 (the weights
    dropped) emits another law on the same rows."""
    rows = {0: [0.6, 0.1, 0.3], 1: [0.2, 0.5, 0.3]}

    def b(prefix):
        return torch.tensor(rows[len(prefix) % 2], dtype=torch.float64)

    def s(prefix):
        return torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)

    law, _ = _exact_law(b, s, 2, 3, weights=lambda p, q: [1.0] * (len(p) + 1))
    want = _target_law(b, 2, 3)
    assert max(abs(law.get(k, 0.0) - want[k]) for k in want) > 1e-3


def test_tau_is_the_last_stop():
    w = [1.0, 0.5, 0.25]
    assert block_tau(w, [0.4], [0.3, 0.9]) == 1  # eta_1 <= h_1, eta_2 > w_2
    assert block_tau(w, [0.4], [0.3, 0.2]) == 2
    assert block_tau(w, [0.4], [0.5, 0.9]) == 0
    assert block_tau([1.0], [], []) == 0


def test_sampled_requests_accept_eleven_ninths_on_average():
    """The sampled rule (Philox uniforms, races) on the paper's rows: mean accepted within 4
    standard errors of 11/9 over 3,000 seeds, and 10/9 (the token rule) well outside."""
    target = torch.log(torch.tensor([[1 / 3, 2 / 3]] * 3, dtype=torch.float64)).float()
    draft = torch.log(torch.tensor([[2 / 3, 1 / 3]] * 2, dtype=torch.float64)).float()
    gen = torch.Generator().manual_seed(0)
    accepted = []
    for seed in range(3000):
        drafts = torch.multinomial(torch.tensor([2 / 3, 1 / 3]), 2, replacement=True, generator=gen).tolist()
        a, token, flagged = verify_request_block(target, drafts, draft, 1, 1.0, 0, 1.0, 2, seed, 2)
        assert 0 <= token < 2 and not flagged
        accepted.append(a)
    mean = sum(accepted) / len(accepted)
    se = (sum((a - mean) ** 2 for a in accepted) / len(accepted) / len(accepted)) ** 0.5
    assert abs(mean - 11 / 9) < 4 * se and abs(mean - 10 / 9) > 4 * se, (mean, se)
