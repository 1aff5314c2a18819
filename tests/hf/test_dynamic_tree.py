"""draft_tree="dynamic": greedy identity with generate, exact sampling, shapes from q only, refusals."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

pytest.importorskip("transformers")

from specdec_kernels import api  # noqa: E402
from specdec_kernels.hf import drafting, speculative_generate  # noqa: E402
from specdec_kernels.hf.drafters import DynamicTreeDrafter  # noqa: E402
from specdec_kernels.hf.drafters.dynamic_tree import chain_equivalent, tree_depths  # noqa: E402
from specdec_kernels.hf.drafting import prompt_lookup  # noqa: E402
from specdec_kernels.hf.generate import open_session  # noqa: E402
from specdec_kernels.hf.tree_budget import TreeBudgetPolicy  # noqa: E402

from ..ops._stats import ALPHA, chi_square_power, chi_square_pvalue  # noqa: E402
from ._models import fixed_logits_model, tiny_model  # noqa: E402
from .test_generate import PAD, _greedy_reference, _near_copy, _ragged_prompts, _two_token_distribution  # noqa: E402
from .test_medusa import _rrs_wor_first_token  # noqa: E402


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=1)


@pytest.fixture(scope="module")
def drafts(target):
    """A perfect draft (every path to the last depth accepted: the commit of unfed last-depth nodes)
    and a near copy (ragged acceptance)."""
    return {"copy": copy.deepcopy(target), "near": _near_copy(target, 0.05, seed=5)}


def _dynamic(target, draft, ids, mask, N, k, **kw):
    kw = dict(max_new_tokens=12, eos_token_id=[], pad_token_id=PAD) | kw
    return speculative_generate(target, draft, ids, mask, num_draft_tokens=N, draft_tree="dynamic", tree_width=k, **kw)


@pytest.mark.parametrize(
    "N, k, which",
    [(4, 1, "near"), (4, 4, "copy"), (15, 2, "near"), (15, 3, "copy"), (63, 1, "copy"), (63, 4, "near")],
)
def test_greedy_equals_target_generate(target, drafts, N, k, which):
    """Batch 3, ragged prompts (one of 3 tokens), every width 1..4 and N in {4, 15, 63}; the near
    copy with the adaptive budget (trees of several depths and chains), the copy with N pinned."""
    ids, mask = _ragged_prompts()
    expected = _greedy_reference(target, ids, mask, 12)
    out = _dynamic(target, drafts[which], ids, mask, N, k, adaptive_draft=which == "near")
    assert torch.equal(out.sequences, expected)
    assert out.stats.accepted > 0
    if which == "copy":  # the pinned tree: every step accepts its whole depth
        assert out.stats.steps <= -(-12 // (len(tree_depths(N, k)) + 1)) + 1


def test_greedy_eos_mid_batch(target, drafts):
    """A request that ends at EOS leaves the batch; the others go on (ragged trees per request)."""
    ids, mask = _ragged_prompts(seed=3)
    free = _greedy_reference(target, ids, mask, 10)
    eos = int(free[0, ids.shape[1] + 2])  # request 0's third token
    expected = _greedy_reference(target, ids, mask, 10, eos=eos)
    out = _dynamic(target, drafts["near"], ids, mask, 9, 3, max_new_tokens=10, eos_token_id=eos)
    assert torch.equal(out.sequences, expected[:, : out.sequences.shape[1]])


@pytest.mark.parametrize("N, k, adaptive, temperature", [(6, 2, False, 0.0), (15, 3, True, 0.9)])
def test_static_cache_gives_the_dynamic_caches_tokens(target, drafts, N, k, adaptive, temperature):
    """cache_implementation="static" (buffers allocated once, the accepted path moved in place):
    the same tokens as the dynamic cache for the same seed (greedy: generate's)."""
    ids, mask = _ragged_prompts()
    kw = dict(adaptive_draft=adaptive, temperature=temperature, seed=4)
    dynamic = _dynamic(target, drafts["near"], ids, mask, N, k, **kw)
    static = _dynamic(target, drafts["near"], ids, mask, N, k, cache_implementation="static", **kw)
    assert torch.equal(static.sequences, dynamic.sequences)
    if temperature == 0.0:
        assert torch.equal(static.sequences, _greedy_reference(target, ids, mask, 12))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_compiled_target_forward_with_trees(target, drafts, temperature):
    """compile_target (the pinned tree: 1 + N rows every step): one graph, no graph break, reused
    across steps (one per active batch size), and the eager call's tokens (greedy: generate's)."""
    from torch._dynamo.utils import counters

    ids, mask = _ragged_prompts()
    kw = dict(cache_implementation="static", temperature=temperature, seed=4)
    torch._dynamo.reset()
    counters.clear()
    compiled = _dynamic(target, drafts["near"], ids, mask, 7, 2, compile_target={"backend": "eager"}, **kw)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] <= 3 < compiled.stats.target_forwards + 1
    eager = _dynamic(target, drafts["near"], ids, mask, 7, 2, adaptive_draft=False, **kw)
    assert torch.equal(compiled.sequences, eager.sequences)
    if temperature == 0.0:
        assert torch.equal(compiled.sequences, _greedy_reference(target, ids, mask, 12))


def test_width_one_is_the_chain(target, drafts):
    """k = 1: the tree is a chain of N drafts, the chain drafter's (same tokens, same steps)."""
    ids, mask = _ragged_prompts()
    chain = speculative_generate(
        target, drafts["near"], ids, mask, max_new_tokens=12, num_draft_tokens=4, adaptive_draft=False,
        eos_token_id=[], pad_token_id=PAD,
    )  # fmt: skip
    tree = _dynamic(target, drafts["near"], ids, mask, 4, 1, adaptive_draft=False)
    assert torch.equal(tree.sequences, chain.sequences)
    assert (tree.stats.steps, tree.stats.accepted) == (chain.stats.steps, chain.stats.accepted)


def test_tree_depths():
    assert tree_depths(15, 4) == [4, 4, 4, 3]
    assert tree_depths(4, 1) == [1, 1, 1, 1]
    assert tree_depths(63, 4) == [4] * 15 + [3]
    assert tree_depths(3, 4) == [3]


def _simulate(policy: TreeBudgetPolicy, seconds, steps: int = 80) -> list:
    """Runs ``policy`` on synthetic steps (per-depth acceptance 0.8 for trees, 0.6 for chains, the
    expected counts of the geometric model; step time ``seconds(arm)``); returns the arms it chose."""
    accepted = rejections = 0
    chosen = []
    for _ in range(steps):
        policy.choose(accepted, rejections, 1)
        arm = policy.arm
        chosen.append(arm)
        a, d = (0.8 if arm[0] == "tree" else 0.6), arm[1]
        accepted += a * (1 - a**d) / (1 - a)  # expected accepted drafts of the geometric model
        rejections += 1 - a**d
        policy.record(arm[2], 1, seconds(arm))
    return chosen


def test_budget_policy_falls_back_to_a_chain_when_trees_do_not_pay():
    """Measured step times: verification rows that cost a lot (a CPU) make the policy settle on a
    chain; free rows (a GPU) on a tree; without measurements (sampling) it grows trees."""
    rows_cost = lambda arm: 1.0 + 0.2 * arm[1] + 0.5 * arm[2]  # noqa: E731
    rows_free = lambda arm: 1.0 + 0.2 * arm[1]  # noqa: E731
    assert {a[0] for a in _simulate(TreeBudgetPolicy(16, 4, 0.2, True), rows_cost)[-20:]} == {"chain"}
    assert {a[0] for a in _simulate(TreeBudgetPolicy(16, 4, 0.2, True), rows_free)[-20:]} == {"tree"}
    assert {a[0] for a in _simulate(TreeBudgetPolicy(16, 4, 0.2, False), rows_cost)} == {"tree"}
    assert all(arm[3] == 1 for arm in TreeBudgetPolicy(5, 1, 0.2, True).arms)  # width 1: chains only


def test_shape_model_prices_the_targets_rows():
    """Sampling (shape model, no timings): with the target's rows past FREE_ROWS priced (a CPU,
    ``row_cost``) a tree whose acceptance barely beats the chain's loses to the chain; with a clearly
    better tree, or free rows (a GPU), the policy keeps growing trees."""
    flat = lambda arm: 1.0  # noqa: E731  (never read: the shape model is timing-free)
    assert {a[0] for a in _simulate(TreeBudgetPolicy(16, 4, 0.2, False, row_cost=0.3), flat)[-20:]} == {"chain"}
    assert {a[0] for a in _simulate(TreeBudgetPolicy(16, 4, 0.2, False, row_cost=0.0), flat)[-20:]} == {"tree"}
    assert {a[0] for a in _simulate(TreeBudgetPolicy(16, 4, 0.2, False, row_cost=0.01), flat)[-20:]} == {"tree"}


def test_shape_model_prices_the_drafts_tree_rows():
    """Sampling: a tree's draft forward at depth j < d feeds that depth's nodes (up to k), a chain's
    one node. With those rows priced (a CPU, ``draft_row_cost``) deep trees cost more and the policy
    settles on shallower ones; the chain arms' price does not change."""
    flat = lambda arm: 1.0  # noqa: E731  (never read: the shape model is timing-free)
    free = TreeBudgetPolicy(16, 4, 0.2, False, draft_row_cost=0.0)
    priced = TreeBudgetPolicy(16, 4, 0.2, False, draft_row_cost=1.0)
    assert priced._shape(("tree", 3, 12, 4)) == pytest.approx(free._shape(("tree", 3, 12, 4)) + 0.2 * 6)
    assert priced._shape(("tree", 4, 16, 4)) == pytest.approx(free._shape(("tree", 4, 16, 4)) + 0.2 * 9)
    assert priced._shape(("tree", 1, 4, 4)) == free._shape(("tree", 1, 4, 4))  # one forward, over the root
    assert priced._shape(("chain", 5, 5, 1)) == free._shape(("chain", 5, 5, 1))
    deep = {a[1] for a in _simulate(free, flat)[-20:] if a[0] == "tree"}
    shallow = {a[1] for a in _simulate(priced, flat)[-20:] if a[0] == "tree"}
    assert shallow and deep and max(shallow) < min(deep)


def test_budget_policy_prices_untimed_chains_with_the_chain_policys_times():
    """A chain arm the tree policy has not timed takes the chain drafter's measured step of that
    length for the pair (``chain_times``) instead of a tree step's time scaled by depth: on a CPU a
    4-wide tree step cost 2.1x a chain step of the same depth (Qwen pair), and the scaled guess hid it."""
    from specdec_kernels.hf.draft_length import StepTimes

    def policy(chain_times):
        p = TreeBudgetPolicy(8, 4, 0.2, True, chain_times=chain_times)
        p.times[1] = StepTimes(seconds={("tree", 1, 4, 4): 1.6, ("tree", 2, 8, 4): 2.6})
        p.counts = {"tree": [900, 100], "chain": [0, 0]}
        p.observe_chain(750, 250)  # what the tree steps say a chain would have accepted
        p.arm = p.arms[1]
        p.last = (900, 100)
        p.choose(900, 100, 1)
        return p.arm

    chain_steps = StepTimes(seconds={4: 1.0, 8: 1.4})  # the chain policy's, per draft length
    assert policy(lambda active: chain_steps) == ("chain", 4, 4, 1)
    assert policy(None)[1] != 4  # scaled from the tree's times, depth 4 is not the pick


def test_chain_equivalent_counts():
    """What a chain of first candidates accepts in a tree step: the leading run of first children on
    the accepted path; a rejection where the run ends on a later sibling or where the path stops at a
    node with a first child in the tree; neither where it stops at a leaf (censored)."""
    # request 0: root -> node 0 (first), node 1; node 0 -> node 2 (first), node 3; node 2 -> node 4
    # (first); node 1 -> node 5 (first)
    parent0, first0 = [-1, -1, 0, 0, 2, 1], [True, False, True, False, True, True]
    # request 1: the root's first candidate pruned, only its second (node 0) kept, then padding
    parent1, first1 = [-1] * 6, [False] * 6
    cases = [  # (path of node + 1, accepted) -> (chain accepted, chain rejected)
        (([1, 3, 5], 3), (3, 0)),  # all first children, to a leaf: censored
        (([1, 3, -1], 2), (2, 1)),  # stops at node 2, whose first child (node 4) was rejected
        (([1, 4, -1], 2), (1, 1)),  # node 3 is a second child: the chain stopped at depth 2
        (([2, -1, -1], 1), (0, 1)),  # node 1 is a second child
        (([-1, -1, -1], 0), (0, 1)),  # nothing accepted: the root's first child was rejected
        (([1, -1, -1], 1), (1, 1)),
        (([2, 6, -1], 2), (0, 1)),  # a first child below a second one: the chain stopped at depth 1
    ]
    for (path, accepted), expected in cases:
        paths = torch.tensor([path, [-1, -1, -1]])
        acc = torch.tensor([accepted, 0])
        first = torch.tensor([first0, first1])
        parent = torch.tensor([parent0, parent1])
        run, rejected = chain_equivalent(paths, acc, first, parent)
        assert (int(run[0]), int(rejected[0])) == expected, (path, accepted)
        assert (int(run[1]), int(rejected[1])) == (0, 0)  # the chain's draft is not in the tree: censored
    empty = chain_equivalent(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long), first, parent)
    assert [t.tolist() for t in empty] == [[0, 0], [0, 0]]


@pytest.mark.parametrize("which", ["copy", "near"])
def test_tree_steps_teach_the_policy_the_chains_acceptance(target, drafts, which, monkeypatch):
    """Every tree step of the model's draws reports its chain-equivalent counts in the step's one
    transfer: never more accepted than the tree accepted; a perfect draft's chain is never rejected."""
    seen = []
    update = DynamicTreeDrafter.update

    def spy(self, session, verified, host):
        update(self, session, verified, host)
        if len(host) == 3:
            seen.append((sum(verified.accepted_host), host[1], host[2], self.policy.counts["chain"][:]))

    monkeypatch.setattr(DynamicTreeDrafter, "update", spy)
    ids, mask = _ragged_prompts()
    out = _dynamic(target, drafts[which], ids, mask, 12, 3)
    assert torch.equal(out.sequences, _greedy_reference(target, ids, mask, 12))
    assert seen, "no tree step reported chain-equivalent counts"
    assert all(chain <= tree for tree, chain, _, _ in seen)
    assert all(counts[0] >= chain for _, chain, _, counts in seen)  # the policy's chain counts include them
    if which == "copy":
        assert all(rejected == 0 for _, _, rejected, _ in seen)
    else:
        assert sum(rejected for _, _, rejected, _ in seen) > 0


def test_sampled_adaptive_trees_are_reproducible(target, drafts):
    """Sampling adapts the tree from acceptance and the shape model only (no timings): a seeded
    call draws the same tokens every time."""
    ids, mask = _ragged_prompts()
    a, b = (_dynamic(target, drafts["near"], ids, mask, 15, 3, temperature=0.9, seed=5) for _ in range(2))
    assert torch.equal(a.sequences, b.sequences)


def _proposals(monkeypatch) -> list:
    """Records every proposal of DynamicTreeDrafter.propose."""
    seen = []
    real = DynamicTreeDrafter.propose

    def propose(self, session, g):
        proposal = real(self, session, g)
        seen.append(proposal)
        return proposal

    monkeypatch.setattr(DynamicTreeDrafter, "propose", propose)
    return seen


def test_shape_depends_on_q_not_on_the_draws(monkeypatch):
    """A draft whose q is the same at every position: the tree's shape (parents, node counts) is the
    same for every seed although its tokens differ (a child is scored by its rank's probability,
    not by the token drawn there)."""
    V = 6
    target = tiny_model("llama", vocab=V, seed=13, init_std=0.3)
    draft = fixed_logits_model([0.0, 1.0, 0.5, 2.0, 1.5, 0.2])
    seen = _proposals(monkeypatch)
    ids = torch.tensor([[3, 4, 5, 0]] * 4)
    tokens = set()
    for seed in range(4):
        speculative_generate(
            target, draft, ids, max_new_tokens=6, num_draft_tokens=9, draft_tree="dynamic", tree_width=3,
            temperature=1.0, seed=seed, eos_token_id=[], adaptive_draft=False,
        )  # fmt: skip
    first = seen[0]
    for proposal in seen:
        A = proposal.parents.shape[0]
        assert torch.equal(proposal.parents, first.parents[:A]) and torch.equal(proposal.num_nodes, first.num_nodes[:A])
        tokens.add(tuple(proposal.tokens.flatten().tolist()))
    assert len(tokens) > 1  # the draws differ


def test_each_node_carries_the_q_row_of_its_parent(monkeypatch):
    """Sampling: every node's probs row is the draft's distribution after the prompt and the node's
    ancestors (a plain full forward), including depth-2+ nodes whose parents differ (the row a
    node's siblings share: a wrong parent's row would bias the verification)."""
    V = 8
    draft = tiny_model("llama", vocab=V, seed=21, init_std=1.0)
    target = tiny_model("llama", vocab=V, seed=22, init_std=1.0)
    seen = _proposals(monkeypatch)
    prompt = [3, 4, 5, 0]
    speculative_generate(
        target, draft, torch.tensor([prompt]), max_new_tokens=1, num_draft_tokens=9, draft_tree="dynamic",
        tree_width=3, temperature=1.0, seed=0, eos_token_id=[], adaptive_draft=False,
    )  # fmt: skip
    proposal = seen[0]
    tokens, parents = proposal.tokens[0].tolist(), proposal.parents[0].tolist()
    depth_two_parents = set()
    for i in range(int(proposal.num_nodes[0])):
        path, p = [], parents[i]
        while p >= 0:  # the node's ancestors, root side first
            path.insert(0, tokens[p])
            p = parents[p]
        if len(path) == 1:
            depth_two_parents.add(parents[i])
        with torch.no_grad():
            logits = draft(torch.tensor([prompt + path])).logits[0, -1].float()
        torch.testing.assert_close(proposal.probs[0, i], torch.softmax(logits, -1), atol=1e-5, rtol=1e-4)
    assert len(depth_two_parents) > 1  # the tree's second depth hangs off different parents


def test_shape_independent_of_the_verifier_seed(target, drafts, monkeypatch):
    """The step's tree is complete before the verifier draws its seeds: other verifier seeds give
    the same first tree (tokens and shape) and different outputs."""
    from specdec_kernels.hf.drafters import base

    seen = _proposals(monkeypatch)
    ids, mask = _ragged_prompts()
    outputs, firsts = [], []
    for verifier_seed in (1, 2):
        gen = torch.Generator().manual_seed(verifier_seed)
        seeds = lambda A, generator, device, g=gen: torch.randint(0, 2**31, (A,), generator=g)  # noqa: E731
        monkeypatch.setattr(base, "_seeds", seeds)
        firsts.append(len(seen))
        outputs.append(_dynamic(target, drafts["near"], ids, mask, 15, 3, temperature=1.0, seed=7).sequences)
    first_a, first_b = seen[firsts[0]], seen[firsts[1]]
    for name in ("tokens", "parents", "num_nodes", "probs"):
        assert torch.equal(getattr(first_a, name), getattr(first_b, name)), name
    assert not torch.equal(outputs[0], outputs[1])


def test_at_most_two_host_syncs_per_step(target, drafts, monkeypatch):
    from .test_step_syncs import syncs_per_step

    ids = torch.randint(3, 97, (3, 6), generator=torch.Generator().manual_seed(4))
    with syncs_per_step(monkeypatch) as per_step:
        out = _dynamic(target, drafts["near"], ids, None, 15, 4, temperature=0.9)
    assert out.stats.steps == len(per_step) > 0
    assert max(per_step) <= 2, per_step


def _first_token_law(p: torch.Tensor, q: torch.Tensor, k: int, without_replacement: bool) -> torch.Tensor:
    """Exact law of the first emitted token when the root's k children are drawn without replacement
    from q and verified by RRS that renormalises q after each candidate (rrs_wor) or not (rrs)."""
    law = torch.zeros_like(p, dtype=torch.float64)
    for toks in itertools.permutations(range(p.numel()), k):
        weight, left = 1.0, 1.0
        for x in toks:
            weight, left = weight * float(q[x]) / left, left - float(q[x])
        law += weight * _rrs_wor_first_token(p, q, list(toks), renormalise=without_replacement)
    return law


@pytest.mark.slow
@pytest.mark.parametrize("threshold", [0.0, 0.08])
def test_sampled_output_follows_the_target(monkeypatch, threshold):
    """Chi-square (alpha 1e-6) on the first two generated tokens (V = 6: 36 cells) of 3000 requests
    at T = 0.8 (trees of N = 6 nodes, width 2: three depths; or shaped by tree_threshold, whose
    number of nodes per depth follows the q rows) against the target's own law; and on the first
    token alone.

    Power, asserted from exact laws (noncentral chi-square): the draft's own two-token law and the
    biased variant (the same without-replacement trees verified with method="rrs", which treats the
    children as independent draws from q) are rejected with probability > 0.99 at n = 3000; the
    biased variant run through the driver is rejected."""
    V, n, k = 6, 3000, 2
    sampling = dict(temperature=0.8)
    target = tiny_model("llama", vocab=V, seed=13, init_std=0.3)
    draft = tiny_model("llama", vocab=V, seed=15, init_std=0.3, layers=1)
    prompt = [3, 4, 5, 0]
    expected = _two_token_distribution(target, prompt, **sampling)
    q_two = _two_token_distribution(draft, prompt, **sampling)
    p1, q1 = expected.sum(1), q_two.sum(1)
    assert chi_square_power(expected.flatten(), q_two.flatten(), n) > 0.99
    assert torch.allclose(_first_token_law(p1, q1, k, True), p1.double(), atol=1e-9)  # the exact rule
    wrong_first = _first_token_law(p1, q1, k, False)
    assert chi_square_power(p1, wrong_first, n) > 0.99

    def run():
        return speculative_generate(
            target, draft, torch.tensor([prompt] * n), max_new_tokens=2, num_draft_tokens=6,
            draft_tree="dynamic", tree_width=k, seed=1, eos_token_id=[], tree_threshold=threshold, **sampling,
        )  # fmt: skip

    out = run()
    pairs = out.sequences[:, len(prompt) :]
    assert 0.05 < out.stats.acceptance_rate < 0.95  # both accept and reject paths ran
    assert chi_square_pvalue(pairs[:, 0] * V + pairs[:, 1], expected.flatten()) > ALPHA
    assert chi_square_pvalue(pairs[:, 0], p1) > ALPHA
    real = api.verify_tree
    monkeypatch.setattr(api, "verify_tree", lambda *a, **kw: real(*a, **{**kw, "method": "rrs"}))
    wrong = run().sequences[:, len(prompt)]
    assert chi_square_pvalue(wrong, p1) < ALPHA


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(draft_tree="static"), "draft_tree must be"),
        (dict(draft_tree=None, tree_width=2), "tree_width"),
        (dict(tree_width=0), "tree_width must be >= 1"),
        (dict(num_draft_tokens=64), "<= 64"),
        (dict(num_drafts=2), "num_drafts"),
        (dict(method="kseq"), "method='kseq'"),
        (dict(drafter="prompt_lookup", draft=None), "drafter='prompt_lookup'"),
        (dict(verification="block"), "verification='block'"),
        (dict(draft_confidence=0.5), "draft_confidence"),
        (dict(generation_config="repetition"), "logits processors"),
        (dict(draft_tree=None, tree_width=None, prompt_lookup=True), "use drafter='prompt_lookup'"),
    ],
)
def test_unsupported_settings_are_value_errors(target, drafts, kwargs, match):
    call = dict(draft=drafts["near"], draft_tree="dynamic", num_draft_tokens=8, tree_width=2) | kwargs
    if call.get("generation_config") == "repetition":
        from transformers import GenerationConfig

        call["generation_config"] = GenerationConfig(repetition_penalty=1.3)
    ids = torch.randint(3, 97, (1, 4))
    with pytest.raises(ValueError, match=match):
        speculative_generate(target, call.pop("draft"), ids, max_new_tokens=2, **call)


def test_open_session_steps(target, drafts):
    """A caller-driven session steps with trees too (the drafter's commit keeps its cache consistent)."""
    ids, mask = _ragged_prompts()
    expected = _greedy_reference(target, ids, mask, 6)
    with open_session(
        target, drafts["near"], ids, mask, max_new_tokens=6, num_draft_tokens=7, draft_tree="dynamic",
        tree_width=2, eos_token_id=[], pad_token_id=PAD,
    ) as session:  # fmt: skip
        while session.batch.rows:
            session.drop_finished_rows(session.step().finished)
    assert torch.equal(torch.cat([ids, session.tokens.output(PAD)], dim=1), expected)


def _peaked_draft():
    """q > 0.999 on token 5 everywhere: when sampling, ranks past the first fall below
    MIN_RANK_PROB, so every depth keeps one node of its k slots (the nodes are compacted and their
    cache slots are no longer their indices)."""
    row = [0.0] * 97
    row[5] = 12.0
    return fixed_logits_model(row)


@pytest.mark.parametrize(
    "which, temperature, cache, lookup",
    [("near", 0.0, "dynamic", False), ("near", 0.9, "dynamic", False), ("peaked", 0.9, "dynamic", False),
     ("near", 0.9, "static", False), ("near", 0.0, "dynamic", True), ("copy", 0.9, "static", True)],
)  # fmt: skip
def test_draft_cache_equals_a_fresh_prefill(target, drafts, which, temperature, cache, lookup):
    """After every step the draft cache holds exactly the committed tokens it should (all but the
    last 1 or 2), as a fresh forward of them computes their keys and values (with the lookup
    branch: repetitive prompts, its nodes fed and kept where accepted)."""
    draft = drafts[which] if which != "peaked" else _peaked_draft()
    target = target if which != "peaked" else copy.deepcopy(draft)  # peaked: every depth accepted
    ids, mask = _repetitive_prompts() if lookup else _ragged_prompts()
    with open_session(
        target, draft, ids, mask, max_new_tokens=10, num_draft_tokens=15, draft_tree="dynamic",
        tree_width=3, temperature=temperature, seed=3, eos_token_id=[], pad_token_id=PAD, cache_implementation=cache,
        prompt_lookup=lookup,
    ) as session:  # fmt: skip
        step_and_check_draft_cache(session, draft, steps=3)


def step_and_check_draft_cache(session, draft, steps: int) -> None:
    """Runs up to ``steps`` steps of ``session``; after each, the draft cache holds the committed
    tokens but the last 1 or 2, with the keys and values a fresh forward of them computes."""
    drafter = session.drafter
    for _ in range(steps):
        if not session.batch.rows:
            break
        session.drop_finished_rows(session.step().finished)
        for a, b in enumerate(session.batch.rows):
            C, L = int(drafter.cached[a]), int(session.tokens.length[b])
            assert L - C == drafter.uncached_host[a] in (1, 2)
            fresh = draft(input_ids=session.tokens.seq[b, :C][None], use_cache=True).past_key_values
            for mine, ref in zip(drafter.cache.layers, fresh.layers, strict=True):
                torch.testing.assert_close(mine.keys[a, :, :C], ref.keys[0], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(mine.values[a, :, :C], ref.values[0], atol=1e-4, rtol=1e-4)


# ---- the prompt-lookup branch (prompt_lookup=True)

_PATTERN = [10, 11, 12, 13, 14, 15]


def _repetitive_prompts():
    """Batch 3, left-padded, each with an earlier occurrence of its last n-gram (a lookup match)."""
    prompts = [_PATTERN + _PATTERN[:3], [30, 31] + _PATTERN * 2, [20, 21, 22, 20, 21]]
    T = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (T - len(p)) + p for p in prompts])
    return ids, (ids != PAD).long()


def _lookup_proposals(monkeypatch) -> list:
    """Records (proposal, budget g, width k, the lookup continuations) of every step."""
    seen = []
    real = DynamicTreeDrafter.propose

    def propose(self, session, g):
        proposal = real(self, session, g)
        depth = len(self.per_depth)
        found = prompt_lookup([session.tokens.history[b] for b in session.batch.rows], depth)
        seen.append((proposal, g, max(self.per_depth), found))
        return proposal

    monkeypatch.setattr(DynamicTreeDrafter, "propose", propose)
    return seen


def _check_tree(proposal, g: int, k: int, found: list[list[int]], distinct: bool) -> int:
    """At most g nodes, k per depth; each lookup continuation is a path from the root (one node per
    token; distinct: siblings never repeat a token). Returns the lookup nodes seen."""
    nodes = 0
    for a, look in enumerate(found):
        n = int(proposal.num_nodes[a])
        tokens, parents = proposal.tokens[a, :n].tolist(), proposal.parents[a, :n].tolist()
        assert n <= g
        depth = []
        for p in parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        assert max((depth.count(d) for d in set(depth)), default=0) <= k
        if distinct:
            children = [(p, t) for p, t in zip(parents, tokens, strict=True)]
            assert len(set(children)) == len(children)
        at = -1
        for token in look[: max(depth, default=0)]:
            match = [i for i in range(n) if parents[i] == at and tokens[i] == token]
            assert match, (a, look, tokens, parents)
            at, nodes = match[0], nodes + 1
    return nodes


@pytest.mark.parametrize("N, k, which, adaptive", [(9, 3, "near", False), (15, 4, "near", True), (7, 2, "copy", False)])
def test_lookup_branch_greedy_equals_target_generate(target, drafts, monkeypatch, N, k, which, adaptive):
    """Batch 3, ragged, repetitive prompts: the lookup continuation is a root path of every tree
    (merged where the model proposes the same token: siblings distinct), the tree within N nodes
    and k per depth, and the output generate's."""
    seen = _lookup_proposals(monkeypatch)
    ids, mask = _repetitive_prompts()
    expected = _greedy_reference(target, ids, mask, 12)
    out = _dynamic(target, drafts[which], ids, mask, N, k, prompt_lookup=True, adaptive_draft=adaptive)
    assert torch.equal(out.sequences, expected)
    lookup_nodes = sum(_check_tree(p, g, width, found, True) for p, g, width, found in seen)
    assert lookup_nodes > 0 and all(found for found in seen[0][3])  # every prompt matched at first


def test_lookup_branch_adds_accepted_tokens():
    """A draft that proposes the same tokens everywhere (fixed logits) and a target whose output
    repeats itself: the lookup branch's nodes are accepted where the draft's are not (same output)."""
    V = 16
    draft_row = [0.0] * V
    draft_row[2] = 9.0
    target = tiny_model("llama", vocab=V, seed=3)
    draft = fixed_logits_model(draft_row)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    with torch.no_grad():
        greedy = target.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    plain, lookup = (
        speculative_generate(
            target,
            draft,
            ids,
            max_new_tokens=8,
            num_draft_tokens=6,
            draft_tree="dynamic",
            tree_width=2,
            eos_token_id=[],
            pad_token_id=PAD,
            adaptive_draft=False,
            prompt_lookup=on,
        )  # fmt: skip
        for on in (False, True)
    )
    assert torch.equal(lookup.sequences, greedy) and torch.equal(plain.sequences, greedy)
    assert lookup.stats.accepted > plain.stats.accepted and lookup.stats.steps < plain.stats.steps


def test_sampled_lookup_steps_verify_one_hot(target, drafts, monkeypatch):
    """Sampling: a step with a lookup match hands the verifier no draft probabilities (one-hot), a
    step without one its q rows; the seeded call is reproducible."""
    seen = _lookup_proposals(monkeypatch)
    ids, mask = _repetitive_prompts()
    runs = [_dynamic(target, drafts["near"], ids, mask, 9, 3, temperature=0.9, seed=2, prompt_lookup=True)]
    runs.append(_dynamic(target, drafts["near"], ids, mask, 9, 3, temperature=0.9, seed=2, prompt_lookup=True))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for proposal, g, k, found in seen:
        assert (proposal.probs is None) == any(found)
        _check_tree(proposal, g, k, found, False)
    assert seen[0][0].probs is None


def test_prompt_lookup_must_be_a_bool(target, drafts):
    with pytest.raises(TypeError, match="prompt_lookup must be a bool"):
        _dynamic(target, drafts["near"], torch.tensor([[3, 4, 3]]), None, 4, 2, prompt_lookup=3)


@pytest.mark.slow
def test_sampled_lookup_output_follows_the_target(monkeypatch):
    """Chi-square (alpha 1e-6) on the first two tokens (V = 6: 36 cells) of 3000 requests at T = 0.8
    from a prompt whose lookup continuation is [5, 3, 4] (a branch of every first tree), and on the
    first token alone, against the target's law. The biased variant treats the step's deterministic
    candidates (the lookup token first, then the draft's best other token) as rrs_wor draws from q
    (the q rows handed to the verifier): its exact first-token law is rejected with power > 0.99 at
    n = 3000, and its run through the driver is rejected."""
    V, n, k = 6, 3000, 2
    sampling = dict(temperature=0.8)
    draft_row = [0.0, 1.0, 0.5, 2.0, 1.5, -1.0]  # the lookup token 5 is the draft's least likely
    target = tiny_model("llama", vocab=V, seed=13, init_std=0.3)
    draft = fixed_logits_model(draft_row)
    prompt = [3, 4, 5, 3, 4]
    expected = _two_token_distribution(target, prompt, **sampling)
    p1 = expected.sum(1)
    q = drafting.draft_distribution(torch.tensor(draft_row), top_k=0, top_p=1.0, **sampling)
    best_other = int(torch.topk(q.masked_fill(torch.arange(V) == 5, -1.0), 1).indices)
    assert chi_square_power(p1, _rrs_wor_first_token(p1, q, [5, best_other]), n) > 0.99
    seen = _lookup_proposals(monkeypatch)

    def run():
        return speculative_generate(
            target, draft, torch.tensor([prompt] * n), max_new_tokens=2, num_draft_tokens=6, draft_tree="dynamic",
            tree_width=k, seed=1, eos_token_id=[], adaptive_draft=False, prompt_lookup=True, **sampling,
        )  # fmt: skip

    pairs = run().sequences[:, len(prompt) :]
    assert seen[0][3][0] == [5, 3, 4] and seen[0][0].probs is None
    assert chi_square_pvalue(pairs[:, 0] * V + pairs[:, 1], expected.flatten()) > ALPHA
    assert chi_square_pvalue(pairs[:, 0], p1) > ALPHA
    real = api.verify_tree

    def with_q_rows(logits, tokens, *args, **kw):
        kw.setdefault("draft_probs", q.expand(*tokens.shape, V).contiguous())
        return real(logits, tokens, *args, **kw)

    monkeypatch.setattr(api, "verify_tree", with_q_rows)
    wrong = run().sequences[:, len(prompt)]
    assert chi_square_pvalue(wrong, p1) < ALPHA


def test_stats_count_the_nodes_scored(target, drafts, monkeypatch):
    """stats.nodes sums the node slots the target scored per request and step (the trees' widths in
    nodes), the histogram the trees' depths."""
    seen = _lookup_proposals(monkeypatch)
    ids, mask = _repetitive_prompts()
    out = _dynamic(target, drafts["near"], ids, mask, 9, 3, adaptive_draft=False, prompt_lookup=True)
    assert out.stats.nodes == sum(p.tokens.shape[1] * p.tokens.shape[0] for p, *_ in seen) > 0
    assert out.stats.draft_length_histogram == {3: len(seen)}
