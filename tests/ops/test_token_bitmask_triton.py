"""The Triton kernels' native token_bitmask (``helpers.allowed_at`` in every kernel that reads target
or draft-logits rows): token-equal to the reference (backend="torch", which masks the rows itself)
with no masked copy made, across the launch plans that read rows differently - the whole-row
threshold plan of the interpreter, the GPU's two threshold launches, the bisection fallback, rows
split into vocabulary chunks - and every layout (padded, flattened, tree, multi). Masks hold the
contract's special rows: one allowed token, only a token of the last partial word, nothing (flagged).
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _bitmask
from specdec_kernels._dispatch import launch_overrides

from ._inputs import make_problem, pack_bitmask
from ._trees import make_tree_problem

# Launch plans (``launch_overrides``) that read the rows through different kernels / device functions.
PLANS = {
    "whole": {},  # the interpreter's whole-row thresholds (filter_threshold_ties, tie_index)
    "two_launch": {"threshold_chunks": 3},  # chunk_candidates, then select_candidates
    "bisect": {"threshold_chunks": 2, "threshold_capacity": 16},  # bisect_threshold over the row
    "split_rows": {"num_chunks": 3, "block_v": 64},  # statistics and races over vocabulary chunks
}
PARAMS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.9),
    "filters": dict(temperature=0.8, top_k=9, top_p=0.9),
    "by_index": dict(temperature=0.8, top_k=12, top_p=0.7, top_p_ties="by_index"),
}


@pytest.fixture(autouse=True)
def _no_masked_copy(monkeypatch):
    """The Triton backend must not fall back on the masked copy: the copy raises here (the
    reference, backend="torch", never makes one either)."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("the masked copy was made")

    monkeypatch.setattr(_bitmask, "masked_rows", refuse)


def _allowed(lead: tuple, V: int, gen: torch.Generator, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """bool [*lead, V], about half allowed; row 1 allows one token, row 3 only the last token (in the
    last, partial word when V % 32 != 0), row 5 nothing; draft tokens [*lead[:-1], G] allowed at
    their rows (so accept paths run) except in the special rows."""
    allowed = torch.rand(*lead, V, generator=gen) < 0.5
    if tokens is not None and tokens.shape[-1] > 0:
        allowed[..., : tokens.shape[-1], :].scatter_(-1, tokens[..., None].clamp(0, V - 1), True)
    flat = allowed.view(-1, V)
    if flat.shape[0] >= 6:
        flat[1] = False
        flat[1, V // 3] = True
        flat[3] = False
        flat[3, V - 1] = True
        flat[5] = False
    return allowed


def _same(got, want, what: str) -> None:
    for field in ("tokens", "num_accepted", "nonfinite", "accepted_nodes"):
        if hasattr(want, field):
            assert torch.equal(getattr(got, field), getattr(want, field)), f"{what}: {field}\n{got}\n{want}"


def _both(op, *args, plan: str = "whole", **kwargs):
    """(triton under the plan, reference)."""
    with launch_overrides(**PLANS[plan]):
        got = op(*args, backend="triton", **kwargs)
    return got, op(*args, backend="torch", **kwargs)


@pytest.mark.parametrize("V", [5, 37, 1005])  # 5: tiles narrower than a word (allowed_tile's per-entry path)
@pytest.mark.parametrize("mode", ["logits", "probs", "ngram"])
@pytest.mark.parametrize("params", list(PARAMS))
def test_chain_equals_reference(V, mode, params):
    B, G = 8, 3
    target, tokens, draft = make_problem(B, G, V, seed=V + len(mode))
    allowed = _allowed((B, G + 1), V, torch.Generator().manual_seed(V), tokens)
    kw = dict(PARAMS[params], seed=torch.arange(B) * 5 + 1, token_bitmask=pack_bitmask(allowed))
    kw["num_draft_tokens"] = torch.tensor([3, 2, 0, 3, 1, 3, 3, 2])
    if mode == "logits":
        kw["draft_logits"] = draft
    elif mode == "probs":
        kw["draft_probs"] = torch.softmax(draft, -1)
    got, want = _both(sk.verify, target, tokens, **kw)
    _same(got, want, f"V={V} {mode} {params}")
    assert not bool(want.nonfinite[0])  # request 0's rows 1 and 3 allow a single token: no empty rows


def _slow(*values):
    return pytest.param(*values, marks=pytest.mark.slow)


@pytest.mark.parametrize(
    "plan, dtype",
    [
        ("whole", torch.float32),
        ("split_rows", torch.bfloat16),
        _slow("whole", torch.bfloat16),
        _slow("split_rows", torch.float32),
        _slow("two_launch", torch.float32),  # the interpreter's GPU-plan launches: minutes each
        _slow("two_launch", torch.bfloat16),
        _slow("bisect", torch.float32),
        _slow("bisect", torch.bfloat16),
    ],
)
def test_chain_plans_equal_reference(plan, dtype):
    """Every way the kernels read rows (thresholds whole / in two launches / by bisection, rows
    split into chunks), bf16 and fp32 rows, top-k + top-p with both tie rules."""
    B, G, V = 6, 3, 300
    target, tokens, draft = make_problem(B, G, V, seed=3, dtype=dtype)
    allowed = _allowed((B, G + 1), V, torch.Generator().manual_seed(4), tokens)
    mask = pack_bitmask(allowed)
    for params in ("filters", "by_index"):
        kw = dict(PARAMS[params], seed=torch.arange(B) + 7, token_bitmask=mask)
        got, want = _both(sk.verify, target, tokens, draft, plan=plan, **kw)
        _same(got, want, f"{plan} {params}")


def test_flattened_layout_equals_reference():
    """Draft n of request b uses mask row n + b (its target row), at a vocabulary split."""
    V, n = 1005, [3, 0, 2, 3, 1]
    B = len(n)
    target, tokens, draft = make_problem(B, 3, V, seed=5)
    allowed = _allowed((B, 4), V, torch.Generator().manual_seed(6), tokens)
    flat = (
        torch.cat([target[b, : n[b] + 1] for b in range(B)]),
        torch.cat([tokens[b, : n[b]] for b in range(B)]),
        torch.cat([draft[b, : n[b]] for b in range(B)]),
    )
    f_mask = pack_bitmask(torch.cat([allowed[b, : n[b] + 1] for b in range(B)]))
    cu = torch.tensor([0, *n]).cumsum(0)
    kw = dict(temperature=torch.tensor([0.9, 0.0, 1.2, 0.7, 1.0]), top_k=40, top_p=0.9, seed=torch.arange(B) + 40)
    for plan in ("whole", "split_rows"):
        got, want = _both(sk.verify, *flat, cu_num_draft_tokens=cu, token_bitmask=f_mask, plan=plan, **kw)
        _same(got, want, f"flattened {plan}")


def test_strided_masks_are_read_as_given():
    B, G, V = 4, 2, 70
    target, tokens, draft = make_problem(B, G, V, seed=13)
    mask = pack_bitmask(_allowed((B, G + 1), V, torch.Generator().manual_seed(1), tokens))
    wide = torch.zeros(G + 1, B, 2 * mask.shape[-1], dtype=torch.int32)
    wide[..., ::2] = mask.transpose(0, 1)
    strided = wide.transpose(0, 1)[..., ::2]  # non-contiguous in every dimension
    assert not strided.is_contiguous() and torch.equal(strided, mask)
    got, want = _both(sk.verify, target, tokens, draft, temperature=0.8, top_k=20, seed=2, token_bitmask=strided)
    _same(got, want, "strided chain")
    t_target, t_tokens, parents, t_draft = make_tree_problem(2, 5, V, seed=3)
    t_mask = pack_bitmask(torch.rand(2, 6, V, generator=torch.Generator().manual_seed(2)) < 0.6)
    t_strided = torch.zeros(2, 6, 2 * t_mask.shape[-1], dtype=torch.int32)
    t_strided[..., 1::2] = t_mask
    kw = dict(draft_logits=t_draft, temperature=0.8, seed=4, token_bitmask=t_strided[..., 1::2])
    got, want = _both(sk.verify_tree, t_target, t_tokens, parents, **kw)
    _same(got, want, "strided tree")


def test_nan_at_a_disallowed_token_is_masked_not_flagged():
    target, tokens, draft = make_problem(2, 2, 70, seed=18)
    allowed = torch.ones(2, 3, 70, dtype=torch.bool)
    allowed[:, :, 40] = False
    target[0, :, 40] = float("nan")  # disallowed: -inf like any disallowed entry
    draft[0, :, 40] = float("inf")
    target[1, :, 41] = float("nan")  # allowed: flagged as usual
    for temperature in (0.0, 0.9):
        kw = dict(temperature=temperature, top_p=0.9, seed=1, token_bitmask=pack_bitmask(allowed))
        got, want = _both(sk.verify, target, tokens, draft, **kw)
        _same(got, want, "nan")
        assert got.nonfinite.tolist() == [False, True]


@pytest.mark.parametrize("V", [37, 1005])
@pytest.mark.parametrize(
    "method, mode", [("kseq", "logits"), ("rrs", "probs"), ("rrs_wor", "logits"), ("kseq", "ngram"), ("rrs", "logits")]
)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_tree_equals_reference(V, method, mode, temperature):
    """Node i's draft row uses mask row parents[i] + 1; rows split into chunks at V = 1005."""
    B, N = 4, 7
    target, tokens, parents, draft = make_tree_problem(B, N, V, seed=8, without_replacement=method == "rrs_wor")
    allowed = torch.rand(B, N + 1, V, generator=torch.Generator().manual_seed(V)) < 0.5
    for b in range(B):  # node i is a candidate at row parents[i] + 1: allow every other one there
        for i in range(0, N, 2):
            allowed[b, int(parents[b, i]) + 1, int(tokens[b, i])] = True
    allowed[1, 0] = False  # request 1: its root allows nothing
    allowed[2, 0] = False
    allowed[2, 0, V - 1] = True  # request 2: only the last token at the root
    kw = dict(method=method, temperature=temperature, top_k=30, seed=torch.arange(B) + 5)
    kw["token_bitmask"] = pack_bitmask(allowed)
    if mode == "logits":
        kw["draft_logits"] = draft
    elif mode == "probs":
        kw["draft_probs"] = torch.softmax(draft, -1)
    got, want = _both(sk.verify_tree, target, tokens, parents, plan="split_rows" if V > 64 else "whole", **kw)
    _same(got, want, f"tree V={V} {method} {mode} T={temperature}")
    assert int(want.tokens[1, 0]) == 0
    if temperature > 0:
        assert bool(want.nonfinite[1]) and int(want.tokens[2, 0]) == V - 1


@pytest.mark.parametrize("method", ["kseq", "rrs", "rrs_wor"])
@pytest.mark.parametrize("params", ["greedy", "filters"])
def test_multi_equals_reference(method, params):
    """verify_multi's draft row [k, i] uses mask row [k, i]; chains sharing a prefix."""
    B, K, G, V = 3, 3, 3, 37
    target, tokens, draft = make_problem(B * K, G, V, seed=12)
    target, tokens, draft = target.view(B, K, G + 1, V), tokens.view(B, K, G), draft.view(B, K, G, V)
    if method != "rrs_wor":  # shared prefixes: candidates with multiplicity (rrs_wor's siblings are distinct)
        tokens[:, 1, 0] = tokens[:, 0, 0]
        tokens[:, 2, :2] = tokens[:, 0, :2]
    allowed = _allowed((B, K, G + 1), V, torch.Generator().manual_seed(3), tokens)
    kw = dict(PARAMS[params], method=method, seed=torch.arange(B) + 1, token_bitmask=pack_bitmask(allowed))
    got, want = _both(sk.verify_multi, target, tokens, draft, **kw)
    _same(got, want, f"multi {method} {params}")


@pytest.mark.parametrize("method", ["kseq", "rrs", "rrs_wor"])
def test_tree_disallowed_logits_far_above_the_allowed_max(method):
    """Disallowed target and draft logits 60 above the allowed ones at T = 0.5: 2^((x - max) c) of
    such an entry overflows (c = log2(e) / T), so a pass that folds the bits into its predicates
    (K-SEQ's rho sums, the walk, the race) must still give those entries p = q = 0, never inf * 0."""
    B, N, V = 3, 7, 101
    target, tokens, parents, draft = make_tree_problem(B, N, V, seed=9, without_replacement=method == "rrs_wor")
    allowed = torch.rand(B, N + 1, V, generator=torch.Generator().manual_seed(3)) < 0.5
    for b in range(B):
        for i in range(N):
            allowed[b, int(parents[b, i]) + 1, int(tokens[b, i])] = True
    # node i's draft row sees mask row parents[i] + 1
    draft_allowed = torch.gather(allowed, 1, (parents + 1).clamp(0, N)[..., None].expand(B, N, V))
    target = torch.where(allowed, target, target + 60.0)
    draft = torch.where(draft_allowed, draft, draft + 60.0)
    kw = dict(method=method, temperature=0.5, seed=torch.arange(B) + 1, token_bitmask=pack_bitmask(allowed))
    got, want = _both(sk.verify_tree, target, tokens, parents, draft_logits=draft, **kw)
    _same(got, want, f"tree {method}")
    assert not bool(want.nonfinite.any())
