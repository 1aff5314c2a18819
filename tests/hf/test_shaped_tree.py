"""Shaped dynamic trees (``draft_tree="dynamic"``, ``tree_threshold`` > 0): the nodes whose path
score clears the threshold, k per depth at most, N in all, up to MAX_SHAPED_DEPTH deep; greedy
identity with generate, the exact shape on a draft with known probabilities, early ends on the CPU,
host reads, caches, refusals. The sampled law: tests/hf/test_dynamic_tree.py's chi-square test runs
shaped trees too."""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("transformers")

from specdec_kernels.hf import speculative_generate  # noqa: E402
from specdec_kernels.hf.drafters import dynamic_tree  # noqa: E402
from specdec_kernels.hf.drafters.dynamic_tree import MAX_SHAPED_DEPTH, DynamicTreeDrafter  # noqa: E402
from specdec_kernels.hf.generate import open_session  # noqa: E402

from ._models import fixed_logits_model, tiny_model  # noqa: E402
from .test_dynamic_tree import step_and_check_draft_cache  # noqa: E402
from .test_generate import PAD, _greedy_reference, _near_copy, _ragged_prompts  # noqa: E402


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=1)


@pytest.fixture(scope="module")
def near(target):
    return _near_copy(target, 0.05, seed=5)  # (test_dynamic_tree.py's near copy)


def _shaped(target, draft, ids, mask, N, k, threshold, **kw):
    kw = dict(max_new_tokens=12, eos_token_id=[], pad_token_id=PAD) | kw
    return speculative_generate(
        target, draft, ids, mask, num_draft_tokens=N, draft_tree="dynamic", tree_width=k, tree_threshold=threshold, **kw
    )


def _proposals(monkeypatch) -> list:
    """Records (proposal, budget g, depths this step) of every DynamicTreeDrafter.propose."""
    seen = []
    real = DynamicTreeDrafter.propose

    def propose(self, session, g):
        proposal = real(self, session, g)
        seen.append((proposal, g, len(self.per_depth)))
        return proposal

    monkeypatch.setattr(DynamicTreeDrafter, "propose", propose)
    return seen


@pytest.mark.parametrize(
    "N, k, threshold, adaptive, early",
    [(15, 2, 0.05, True, True), (15, 4, 0.3, False, True), (63, 4, 0.01, True, True), (8, 3, 0.2, False, False)],
)
def test_greedy_equals_target_generate(target, near, monkeypatch, N, k, threshold, adaptive, early):
    """Batch 3, ragged prompts: generate's tokens, with the CPU's early ends and without (a GPU's
    fixed depths, emulated)."""
    monkeypatch.setattr(dynamic_tree, "_stops_early", lambda device: early)
    ids, mask = _ragged_prompts()
    out = _shaped(target, near, ids, mask, N, k, threshold, adaptive_draft=adaptive)
    assert torch.equal(out.sequences, _greedy_reference(target, ids, mask, 12))
    assert out.stats.accepted > 0


def _expected_shape(probs: list[float], N: int, k: int, threshold: float, depth: int) -> list[int]:
    """The shaped tree of a draft whose distribution is ``probs`` at every position (sorted, greedy):
    its parents list, built by the rule as the docstring states it."""
    ranked = sorted(probs, reverse=True)[:k]
    parents, scores, frontier, left = [], [], [(-1, 1.0)], N
    for d in range(1, depth + 1):
        cands = [(s * p, node) for node, s in frontier for p in ranked]  # parent order, then rank
        cands.sort(key=lambda c: -c[0])  # (stable: ties keep parent, rank order)
        kept = [c for i, c in enumerate(cands[:k]) if (c[0] >= threshold or (d == 1 and i == 0))][:left]
        if not kept:
            break
        frontier = []
        for s, node in kept:
            parents.append(node)
            scores.append(s)
            frontier.append((len(parents) - 1, s))
        left -= len(kept)
        if left == 0:
            break
    return parents


@pytest.mark.parametrize(
    "N, k, threshold", [(12, 3, 0.05), (12, 3, 0.3), (6, 2, 0.01), (5, 2, 0.01), (20, 4, 0.02), (9, 3, 0.9)]
)  # fmt: skip
def test_shape_follows_the_rule(monkeypatch, N, k, threshold):
    """A draft with the same q everywhere: every step's tree is exactly the rule's (nodes clearing the
    threshold, best first, k per depth, N in all, depth 1 never empty, deeper than ceil(N / k))."""
    row = [2.0, 0.37, 1.2, -1.0, 0.0, 1.55]  # (no two paths of 8 nodes or fewer score within 1%)
    q = torch.softmax(torch.tensor(row), -1).tolist()
    draft = fixed_logits_model(row)
    tgt = fixed_logits_model([0.1 * x for x in row])
    seen = _proposals(monkeypatch)
    _shaped(tgt, draft, torch.tensor([[3, 4]]), None, N, k, threshold, adaptive_draft=False, max_new_tokens=3)
    want = _expected_shape(q, N, k, threshold, min(N, MAX_SHAPED_DEPTH))
    assert seen
    for proposal, g, _ in seen:
        n = int(proposal.num_nodes[0])
        assert proposal.parents[0, :n].tolist() == want
        assert proposal.tokens.shape[1] == n <= g  # no padding column on the CPU


def test_trees_go_deeper_than_the_unshaped(monkeypatch):
    """A confident draft (q = 0.9 on one token, the target's copy): the shaped tree of N = 8, k = 4
    is a path 8 deep (the unshaped one has 2 depths of 4), each step accepting all of it."""
    row = [0.0] * 12
    row[7] = math.log(0.9 * 11 / 0.1)  # softmax: 0.9 on token 7
    tgt = fixed_logits_model(row)
    seen = _proposals(monkeypatch)
    ids = torch.tensor([[3, 4], [5, 6]])
    kw = dict(adaptive_draft=False, max_new_tokens=18)
    shaped = _shaped(tgt, copy.deepcopy(tgt), ids, None, 8, 4, 0.3, **kw)
    assert {d for _, _, d in seen} == {8} and all(p.parents[0].tolist() == list(range(-1, 7)) for p, _, _ in seen)
    plain = _shaped(tgt, copy.deepcopy(tgt), ids, None, 8, 4, 0.0, **kw)
    assert shaped.stats.steps == 2 < plain.stats.steps  # 9 tokens per step
    assert torch.equal(shaped.sequences, plain.sequences)


def test_early_end_saves_draft_forwards(monkeypatch):
    """On the CPU a depth without a node ends the tree (no more draft forwards); with the GPU's fixed
    depths the same tokens come out after more forwards."""
    row = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]  # flat: paths fall below 0.05 by depth 2
    draft, tgt = fixed_logits_model(row), fixed_logits_model(row[::-1])
    ids = torch.tensor([[3, 4], [5, 1]])
    runs = {}
    for early in (True, False):
        monkeypatch.setattr(dynamic_tree, "_stops_early", lambda device, e=early: e)
        runs[early] = _shaped(tgt, draft, ids, None, 12, 3, 0.05, adaptive_draft=False)
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    assert runs[True].stats.draft_forwards < runs[False].stats.draft_forwards


def test_at_most_two_host_syncs_per_step_on_a_gpu(target, near, monkeypatch):
    """Without the CPU's early ends (a GPU), a shaped step reads the host at most twice."""
    from .test_step_syncs import syncs_per_step

    monkeypatch.setattr(dynamic_tree, "_stops_early", lambda device: False)
    ids = torch.randint(3, 97, (3, 6), generator=torch.Generator().manual_seed(4))
    with syncs_per_step(monkeypatch) as per_step:
        out = _shaped(target, near, ids, None, 15, 4, 0.05, temperature=0.9)
    assert out.stats.steps == len(per_step) > 0
    assert max(per_step) <= 2, per_step


@pytest.mark.parametrize("temperature, early", [(0.0, True), (0.9, True), (0.9, False)])
def test_draft_cache_equals_a_fresh_prefill(target, near, monkeypatch, temperature, early):
    """After every step the draft cache holds the committed tokens but the last 1 or 2, as a fresh
    forward computes them (a tree that ended early: its last fed depth is not kept)."""
    monkeypatch.setattr(dynamic_tree, "_stops_early", lambda device: early)
    ids, mask = _ragged_prompts()
    with open_session(
        target, near, ids, mask, max_new_tokens=10, num_draft_tokens=15, draft_tree="dynamic", tree_width=3,
        tree_threshold=0.05, temperature=temperature, seed=3, eos_token_id=[], pad_token_id=PAD,
    ) as session:  # fmt: skip
        step_and_check_draft_cache(session, near, steps=3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(draft_tree=None, tree_width=None, tree_threshold=0.1), "tree_threshold= is read only"),
        (dict(tree_threshold=1.0), "tree_threshold must be"),
        (dict(tree_threshold=-0.1), "tree_threshold must be"),
        (dict(tree_threshold="0.1"), "tree_threshold must be"),
        (dict(tree_threshold=math.nan), "tree_threshold must be"),
    ],
)
def test_bad_thresholds_are_value_errors(target, near, kwargs, match):
    call = dict(draft_tree="dynamic", num_draft_tokens=8, tree_width=2) | kwargs
    with pytest.raises(ValueError, match=match):
        speculative_generate(target, near, torch.randint(3, 97, (1, 4)), max_new_tokens=2, **call)


def test_row_cost_fit_recovers_a_nodes_cost():
    """RowCost: step seconds = a + b forwards + c nodes, fitted from steps whose depth and node count
    vary apart; None before ROW_COST_MIN_STEPS steps or when nodes always follow the depth."""
    from specdec_kernels.hf.tree_budget import ROW_COST_MIN_STEPS, RowCost

    fit, collinear = RowCost(), RowCost()
    gen = torch.Generator().manual_seed(0)
    for i in range(40):
        f, n = 1 + i % 5, 1 + int(torch.randint(1, 9, (1,), generator=gen))
        fit.add(f, n, 0.3 + 0.08 * f + 0.025 * n)
        collinear.add(f, 4 * f, 0.3 + 0.18 * f)
        if i + 1 < ROW_COST_MIN_STEPS:
            assert fit.per_node() is None
    assert fit.per_node() == pytest.approx(0.025, rel=1e-6)
    assert collinear.per_node() is None


def _fitted_policy(per_node: float):
    """A measured TreeBudgetPolicy whose node-cost fit (1 active request) has 12 steps costing
    0.3 + 0.08 s a draft forward + ``per_node`` s a node column, forwards and nodes varying apart."""
    from specdec_kernels.hf.tree_budget import RowCost, TreeBudgetPolicy

    policy = TreeBudgetPolicy(8, 4, 0.2, True)
    fit = policy.row_costs.setdefault(1, RowCost())
    for i in range(12):
        f, n = 1 + i % 4, 1 + (i * 3) % 7
        fit.add(f, n, 0.3 + 0.08 * f + per_node * n)
    return policy


def test_node_threshold_prices_a_row_against_the_rate():
    """A node pays when its path score exceeds (its row's seconds) x (tokens per second per request),
    capped at MAX_NODE_THRESHOLD; 0 (use tree_threshold) without a fit or when not measured."""
    from specdec_kernels.hf.tree_budget import MAX_NODE_THRESHOLD, TreeBudgetPolicy

    assert TreeBudgetPolicy(8, 4, 0.2, True).node_threshold() == 0.0
    policy = _fitted_policy(per_node=0.025)
    policy.rate = 6.0  # tokens per second per request
    assert policy.node_threshold() == pytest.approx(0.15)
    policy.rate = 100.0
    assert policy.node_threshold() == MAX_NODE_THRESHOLD
    policy.measured = False
    assert policy.node_threshold() == 0.0


def test_learned_threshold_raises_the_users_and_keeps_greedy_identity(monkeypatch, target, near):
    """A learned node threshold above tree_threshold is every shaped step's threshold, one below it
    never lowers the user's, and the output is still target.generate's."""
    ids, mask = _ragged_prompts()
    seen = _proposals(monkeypatch)
    thresholds = []
    real = DynamicTreeDrafter._step_threshold

    def learned(self):
        thresholds.append(real(self))
        return thresholds[-1]

    monkeypatch.setattr(dynamic_tree.TreeBudgetPolicy, "node_threshold", lambda self: 0.3)
    monkeypatch.setattr(DynamicTreeDrafter, "_step_threshold", learned)
    # the shape model's costs: every step a tree arm (measured times could pick chains, no threshold)
    out = _shaped(target, near, ids, mask, 15, 3, 0.05, draft_cost="shapes")
    assert thresholds and set(thresholds) == {0.3}
    assert torch.equal(out.sequences, _greedy_reference(target, ids, mask, 12))
    monkeypatch.setattr(dynamic_tree.TreeBudgetPolicy, "node_threshold", lambda self: 0.01)
    thresholds.clear()
    _shaped(target, near, ids, mask, 15, 3, 0.05, draft_cost="shapes")
    assert set(thresholds) == {0.05}
    assert seen


def test_fixed_threshold_switch(monkeypatch):
    """SPECDEC_FIXED_TREE_THRESHOLD=1 keeps the user's threshold (before / after benchmarks)."""
    from specdec_kernels.hf.tree_budget import FIXED_THRESHOLD_ENV

    policy = _fitted_policy(per_node=0.02)
    policy.rate = 5.0
    assert policy.node_threshold() == pytest.approx(0.1)
    monkeypatch.setenv(FIXED_THRESHOLD_ENV, "1")
    assert policy.node_threshold() == 0.0
