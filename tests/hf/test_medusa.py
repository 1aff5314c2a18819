"""drafter="medusa": greedy identity with generate, tree construction, shipped heads, exact sampling."""

from __future__ import annotations

import heapq

import pytest
import torch

pytest.importorskip("transformers")

from specdec_kernels.hf import medusa, speculative_generate  # noqa: E402
from specdec_kernels.hf.medusa import MedusaHeads, build_tree, cartesian_tree, medusa_tree  # noqa: E402
from specdec_kernels.reference.sampling import processed_probs  # noqa: E402

from ..ops._stats import ALPHA, chi_square_power, chi_square_pvalue  # noqa: E402
from ._models import tiny_model  # noqa: E402
from .test_generate import PAD, _greedy_reference, _ragged_prompts, _two_token_distribution  # noqa: E402


def _random_heads(target, num_heads=3, std=0.5, seed=0):
    """Heads with random output layers (a poor but non-trivial drafter: some nodes accepted)."""
    config = target.config
    torch.manual_seed(seed)
    heads = MedusaHeads(config.hidden_size, config.vocab_size, num_heads=num_heads)
    heads.init_from_lm_head(target.lm_head)
    with torch.no_grad():
        for k, head in enumerate(heads.heads):
            head[-1].weight.add_(torch.randn_like(head[-1].weight) * std * (k + 1) / num_heads)
            head[0].linear.weight.normal_(0, 0.05)
    return heads.eval()


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=1)


@pytest.fixture(scope="module")
def fitted_heads(target):
    """Heads fitted (memorised) on the target's own greedy continuations of the test prompts, so
    that greedy trees get deep paths accepted and the commit of long accepted paths is exercised."""
    heads = MedusaHeads(target.config.hidden_size, target.config.vocab_size, num_heads=3)
    heads.init_from_lm_head(target.lm_head)
    hidden, labels, valid = [], [], []
    with torch.no_grad():
        for seed, lens in ((0, (5, 8, 1)), (4, (5, 8, 3))):
            ids, mask = _ragged_prompts(seed=seed, lens=lens)
            seq = _greedy_reference(target, ids, mask, 16)
            full = torch.cat([mask, torch.ones(3, 16, dtype=mask.dtype)], dim=1)
            position = (full.cumsum(1) - 1).clamp_min(0)
            h = target.model(input_ids=seq, attention_mask=full, position_ids=position).last_hidden_state
            hidden.append(h)
            labels.append(seq)
            valid.append(full.bool())
    hidden, labels, valid = torch.cat(hidden), torch.cat(labels), torch.cat(valid)
    T = hidden.shape[1]
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(150):
        logits = heads(hidden)
        loss = 0.0
        for k in range(1, 4):
            ok = valid[:, : T - 1 - k]
            loss = loss + torch.nn.functional.cross_entropy(logits[:, : T - 1 - k, k - 1][ok], labels[:, 1 + k :][ok])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval()


@pytest.mark.parametrize("N, s, cache", [(10, 3, "dynamic"), (63, 4, "static"), (3, 1, "dynamic")])
def test_greedy_equals_target_generate(target, fitted_heads, N, s, cache):
    """Batch 3, ragged prompts (one of a single token: the first tree comes from a zero state)."""
    heads = fitted_heads
    ids, mask = _ragged_prompts(lens=(5, 8, 1))
    expected = _greedy_reference(target, ids, mask, 12)
    out = speculative_generate(
        target,
        None,
        ids,
        mask,
        max_new_tokens=12,
        drafter="medusa",
        medusa_heads=heads,
        num_draft_tokens=N,
        num_drafts=s,
        eos_token_id=[],
        pad_token_id=PAD,
        cache_implementation=cache,
    )
    assert torch.equal(out.sequences, expected)
    assert out.stats.accepted >= 10 and out.stats.target_forwards <= 9  # deep paths get accepted
    assert out.stats.draft_forwards == 0
    assert out.stats.accepted_length_histogram.shape == (3, heads.num_heads + 1)


def test_greedy_eos_mid_batch(target, fitted_heads):
    """A request stopping at EOS leaves the batch (its hidden state row too); the others continue."""
    heads = fitted_heads
    ids, mask = _ragged_prompts(seed=4)
    free = _greedy_reference(target, ids, mask, 10)
    eos = int(free[1, ids.shape[1] + 2])
    expected = _greedy_reference(target, ids, mask, 10, eos=eos)
    out = speculative_generate(
        target,
        None,
        ids,
        mask,
        max_new_tokens=10,
        drafter="medusa",
        medusa_heads=heads,
        num_draft_tokens=12,
        num_drafts=3,
        eos_token_id=eos,
        pad_token_id=PAD,
    )
    assert torch.equal(out.sequences, expected)
    assert out.stats.accepted > 0


def test_greedy_random_heads(target):
    """Heads that are mostly wrong (few nodes accepted): still generate's tokens."""
    ids, mask = _ragged_prompts(seed=2)
    expected = _greedy_reference(target, ids, mask, 8)
    out = speculative_generate(
        target,
        None,
        ids,
        mask,
        max_new_tokens=8,
        drafter="medusa",
        medusa_heads=_random_heads(target, std=0.5),
        num_draft_tokens=20,
        num_drafts=4,
        eos_token_id=[],
        pad_token_id=PAD,
    )
    assert torch.equal(out.sequences, expected)


@pytest.mark.parametrize("temperature", [0.0, 0.3])
def test_heads_read_the_hidden_state_before_the_root(target, fitted_heads, temperature):
    """Before every step the heads' input is the hidden state the target computes at the token before
    the root (the last committed token), taken from the previous verification forward (or the
    prefill): equal to a fresh forward over the committed tokens."""
    from specdec_kernels.hf.generate import open_session

    ids, mask = _ragged_prompts(seed=4)
    settings = dict(drafter="medusa", medusa_heads=fitted_heads, num_draft_tokens=12, num_drafts=3)
    with open_session(target, None, ids, mask, temperature=temperature, seed=0, **settings) as session:
        accepted = 0
        for _ in range(3):
            tokens = session.tokens
            for b in range(3):
                n = int(tokens.length[b])
                fresh = target.model(input_ids=tokens.seq[b : b + 1, : n - 1]).last_hidden_state[0, -1]
                torch.testing.assert_close(session.drafter.hidden[b], fresh, atol=1e-4, rtol=1e-4)
            accepted += sum(session.step().accepted)
    assert accepted > 0


# ---- tree construction


def _brute_force_tree(log_sorted: torch.Tensor, topk, N):
    """Best-first growth with a heap (a different algorithm): pop the best node, push its next
    sibling and its first child. Returns the kept rank paths in pop order."""
    K = len(topk)
    heap = [(-float(log_sorted[0, 0]), 0, (0,))]
    counter, kept = 1, []
    while heap and len(kept) < N:
        neg, _, path = heapq.heappop(heap)
        if neg == float("inf"):
            break
        kept.append(path)
        d, r = len(path), path[-1]
        score = -neg
        if r + 1 < topk[d - 1]:
            sibling = score - float(log_sorted[d - 1, r]) + float(log_sorted[d - 1, r + 1])
            heapq.heappush(heap, (-sibling, counter, path[:-1] + (r + 1,)))
            counter += 1
        if d < K:
            heapq.heappush(heap, (-(score + float(log_sorted[d, 0])), counter, path + (0,)))
            counter += 1
    return kept


@pytest.mark.parametrize("topk, N", [((4, 4, 4), 20), ((3, 2, 2, 2), 63), ((5,), 3), ((2, 2), 64), ((6, 5, 4), 64)])
def test_tree_is_the_best_closed_subtree(topk, N):
    """N <= 64 nodes, parents before children (valid, -1 = root), depth = parent depth + 1,
    siblings in rank order, tokens = the candidates at (depth, rank), scores non-increasing, and
    the node set equals a best-first (heap) growth's."""
    gen = torch.Generator().manual_seed(sum(topk) * 7 + N)
    A, K, S = 4, len(topk), max(topk)
    logits = torch.randn(A, K, 50, generator=gen) * 2
    log_sorted = torch.log_softmax(logits, -1).sort(-1, descending=True).values[..., :S]
    allowed = torch.arange(S)[None, :] < torch.tensor(topk)[:, None]
    log_sorted = log_sorted.masked_fill(~allowed[None], float("-inf"))
    candidates = torch.randint(0, 50, (A, K, S), generator=gen)
    cart = cartesian_tree(topk)
    tokens, parents, n, depth = build_tree(cart, log_sorted, candidates, N)
    assert tokens.shape[1] <= min(N, 64)
    for a in range(A):
        kept = _brute_force_tree(log_sorted[a], topk, N)
        assert int(n[a]) == len(kept) == min(N, cart.size)
        paths, scores = [], []
        for i in range(int(n[a])):
            p = int(parents[a, i])
            assert -1 <= p < i
            path = (paths[p] if p >= 0 else ()) + (None,)
            assert int(depth[a, i]) == len(path)
            # the node's rank: its position among its siblings so far
            rank = sum(1 for j in range(i) if int(parents[a, j]) == p)
            path = path[:-1] + (rank,)
            paths.append(path)
            assert int(tokens[a, i]) == int(candidates[a, len(path) - 1, rank])
            scores.append(sum(float(log_sorted[a, d, r]) for d, r in enumerate(path)))
        assert all(x >= y - 1e-6 for x, y in zip(scores, scores[1:]))
        assert sorted(paths) == sorted(kept)


def test_tree_drops_ranks_outside_the_support():
    """A head whose distribution has fewer nonzero tokens than candidates (top-k filtering): the
    ranks past its support never become nodes (their score is -inf), so sampled trees only hold
    genuine draws."""
    q = torch.zeros(1, 2, 10)
    q[0, 0, :2] = torch.tensor([0.7, 0.3])  # head 1: two tokens
    q[0, 1] = torch.softmax(torch.arange(10.0), -1)
    tree = medusa_tree(torch.log(q), cartesian_tree((4, 4)), 64, dict(temperature=1.0, top_k=0, top_p=1.0))
    n = int(tree.num_nodes[0])
    assert n == 2 + 2 * 4
    assert set(tree.tokens[0, :n][tree.depth[0, :n] == 1].tolist()) == {0, 1}
    assert (tree.parents[0, n:] == -1).all() and (tree.depth[0, n:] == 0).all()
    torch.testing.assert_close(tree.probs[0, 0], q[0, 0])  # q of a depth-1 node is head 1's
    torch.testing.assert_close(tree.probs[0, n - 1], q[0, 1])


def test_sampled_candidates_are_without_replacement_in_draw_order():
    """Gumbel-top-s: the first draw is distributed as q, the second as q without the first."""
    q = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 40000
    gen = torch.Generator().manual_seed(3)
    cand = medusa.candidate_tokens(q.expand(n, 1, 4).contiguous(), None, (2,), greedy=False, generator=gen)[:, 0]
    assert (cand[:, 0] != cand[:, 1]).all()
    assert chi_square_pvalue(cand[:, 0], q) > ALPHA
    second = (q[:, None] * q[None, :] / (1 - q[:, None])).fill_diagonal_(0).sum(0)  # P(second = y)
    assert chi_square_pvalue(cand[:, 1], second) > ALPHA
    assert chi_square_pvalue(cand[:, 1], q) < ALPHA  # power: the second draw is not q


# ---- shipped heads


def test_demo_heads_load_from_package_data():
    from specdec_kernels.demo import WEIGHTS_DIR, load_demo_pair, load_medusa_heads

    heads = load_medusa_heads()
    target, _, tok = load_demo_pair()
    assert isinstance(heads, MedusaHeads) and not heads.training
    assert heads.hidden_size == target.config.hidden_size and heads.vocab_size == target.config.vocab_size
    assert next(heads.parameters()).dtype == torch.float32
    weights = WEIGHTS_DIR / "medusa" / "model.safetensors"
    assert weights.stat().st_size < 4e6  # fp16, a few MB at most
    batch = tok(["def add(a, b):\n    return "], return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    expected = target.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id
    )
    out = speculative_generate(
        target,
        None,
        ids,
        mask,
        max_new_tokens=24,
        drafter="medusa",
        medusa_heads=heads,
        num_draft_tokens=16,
        num_drafts=3,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    assert torch.equal(out.sequences, expected)
    assert out.stats.mean_accepted_length > 1.3  # the trained heads are accepted


# ---- exactness of sampling


def _rrs_wor_first_token(p: torch.Tensor, q: torch.Tensor, toks: list[int], renormalise: bool = True) -> torch.Tensor:
    """Exact distribution of the token ``rrs_wor`` emits at the root for fixed candidates ``toks``
    (what a deterministic top-s tree gives): float64. ``renormalise=False``: ``rrs``'s rule (q
    unchanged after a candidate)."""
    p, q = p.double(), q.double()
    out, reach = torch.zeros_like(p), 1.0
    pj, qj = p.clone(), q.clone()
    for x in toks:
        a = min(1.0, float(pj[x] / qj[x])) if qj[x] > 0 else float(pj[x] > 0)
        out[x] += reach * a
        reach *= 1 - a
        r = torch.clamp(pj - qj, min=0)
        pj = r / r.sum() if r.sum() > 0 else r
        if renormalise:
            keep = 1 - float(qj[x])
            qj[x] = 0
            qj = qj / keep if keep > 0 else qj
    return out + reach * pj


def _deterministic_top_s(q, logits, topk, *, greedy, generator=None):
    """The wrong variant for sampling: top-s candidates instead of draws."""
    return torch.topk((q if q is not None else logits).float(), max(topk), dim=-1).indices


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=4, top_p=0.9)])
def test_sampled_output_follows_the_target(monkeypatch, sampling):
    """Chi-square (alpha 1e-6) on the first two generated tokens (V = 6: 36 cells) of 3000
    requests (2 heads, 2 candidates each, up to 6 nodes) against the target's own distribution
    after the same processing; and on the first token alone.

    Power, asserted: the wrong variant of deterministic top-s candidates verified with the heads'
    q (as if sampled) gives a first-token distribution that this test rejects with probability
    > 0.99 at n = 3000 (exact distribution, noncentral chi-square), and running it through the
    driver is rejected."""
    V, n = 6, 3000
    sampling = {"top_k": 0, "top_p": 1.0, **sampling}
    target = tiny_model("llama", vocab=V, seed=13, init_std=0.1)  # flat: p_max ~ 0.3
    heads = _random_heads(target, num_heads=2, std=0.3, seed=2)
    prompt = [3, 4, 5, 0]
    expected = _two_token_distribution(target, prompt, **sampling)
    p1 = expected.sum(1)
    # the heads' first-step distribution and the wrong variant's first token
    with torch.no_grad():
        hidden = target.model(input_ids=torch.tensor([prompt[:-1]])).last_hidden_state[:, -1]
        head_logits = heads(hidden)
    wrong_tree = medusa_tree(head_logits, cartesian_tree((2, 2)), 6, sampling, sampler=_deterministic_top_s)
    root_children = wrong_tree.tokens[0][(wrong_tree.parents[0] == -1) & (wrong_tree.depth[0] == 1)].tolist()
    q1 = torch.tensor([float(x) for x in processed_probs(head_logits[0, 0], **sampling)])
    wrong_first = _rrs_wor_first_token(p1, q1, root_children)
    assert chi_square_power(p1, wrong_first, n) > 0.99

    def run():
        return speculative_generate(
            target,
            None,
            torch.tensor([prompt] * n),
            max_new_tokens=2,
            drafter="medusa",
            medusa_heads=heads,
            num_draft_tokens=6,
            num_drafts=2,
            seed=1,
            eos_token_id=[],
            **sampling,
        )

    out = run()
    pairs = out.sequences[:, len(prompt) :]
    assert 0.05 < out.stats.acceptance_rate < 0.95  # both accept and reject paths ran
    assert chi_square_pvalue(pairs[:, 0] * V + pairs[:, 1], expected.flatten()) > ALPHA
    assert chi_square_pvalue(pairs[:, 0], p1) > ALPHA
    monkeypatch.setattr(medusa, "candidate_tokens", _deterministic_top_s)
    wrong = run().sequences[:, len(prompt)]
    assert chi_square_pvalue(wrong, p1) < ALPHA


# ---- arguments and synchronisation


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(medusa_heads=None), ValueError, "medusa_heads"),
        (dict(medusa_heads="heads"), TypeError, "MedusaHeads"),
        (dict(method="kseq"), ValueError, "rrs_wor"),
        (dict(draft="self"), ValueError, "draft=None"),
        (dict(num_draft_tokens=64), ValueError, "<= 64"),
        (dict(cache_implementation="static", compile_target=True), ValueError, "compile_target"),
        (dict(medusa_heads=MedusaHeads(32, 97)), ValueError, "hidden size"),
        (dict(medusa_heads=MedusaHeads(64, 90)), ValueError, "vocabulary"),
    ],
)
def test_bad_arguments(target, kwargs, error, match):
    call = dict(draft=None, medusa_heads=MedusaHeads(64, 97), drafter="medusa")
    call.update(kwargs)
    if call["draft"] == "self":
        call["draft"] = target
    with pytest.raises(error, match=match):
        speculative_generate(target, call.pop("draft"), torch.randint(3, 97, (1, 4)), max_new_tokens=2, **call)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_at_most_two_host_syncs_per_step(target, temperature, monkeypatch):
    from .test_step_syncs import syncs_per_step

    heads = _random_heads(target)
    ids = torch.randint(3, 97, (4, 6), generator=torch.Generator().manual_seed(4))
    with syncs_per_step(monkeypatch) as per_step:
        out = speculative_generate(
            target,
            None,
            ids,
            max_new_tokens=12,
            drafter="medusa",
            medusa_heads=heads,
            num_draft_tokens=12,
            num_drafts=3,
            temperature=temperature,
            eos_token_id=[],
        )
    assert out.stats.steps == len(per_step) > 0
    assert max(per_step) <= 2, per_step
