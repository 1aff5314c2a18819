"""return_logprobs=True without top-n on trees and verify_multi, computed by the backend itself, no
post-pass over the rows: the CPU build (backend="cpu": csrc/verify_cpu.cpp ``tree_logprobs`` scores
the accepted path from the records of the rows the walk used) and the Triton tree kernels
(backend="triton": the walk scores the tokens it knows, the race's merge the raced ones, from the
row records: ops/triton/tree/walk.py ``_walk_logprobs``). Equal, within 1e-5, to the post-pass
(ops/logprobs.py) on the same output and to the reference (reference/logprobs.py); the post-pass's
row gather is made to raise, so a silent fallback fails. (Chains on the CPU build and the Triton
kernels: test_cpu_logprobs.py, whose helpers these tests share.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _dispatch
from specdec_kernels._bitmask import pack
from specdec_kernels._tree_args import check_tree_args
from specdec_kernels.ops import logprobs as post_pass
from specdec_kernels.reference.logprobs import logprobs_reference, tree_rows

from ._trees import make_tree_problem
from .conftest import cpu_core_or_skip
from .test_cpu_logprobs import TOL, _check, allowed_of


@pytest.fixture(params=["cpu", "triton"])
def backend(request):
    """The backends with native tree logprobs (Triton: its interpreter here, so small vocabularies)."""
    if request.param == "cpu":
        cpu_core_or_skip()
    return request.param


def _tree_native_and_expected(monkeypatch, op, *inputs, mask=None, backend="cpu", probs=False, **kw):
    """(native output, the post-pass's logprobs on it, the reference's) of one verify_tree /
    verify_multi call; kw: the op's sampling keywords; probs: the draft tensor is draft_probs."""
    multi = op == "multi"
    call = dict(kw, seed=kw.get("seed", 3), backend=backend, token_bitmask=mask, return_logprobs=True)
    target, tokens, parents, draft = inputs if not multi else (inputs[0], inputs[1], None, inputs[2])
    logits, dprobs = (None, draft) if probs else (draft, None)
    if multi:
        out = sk.verify_multi(target, tokens, draft_logits=logits, draft_probs=dprobs, **call)
    else:
        out = sk.verify_tree(target, tokens, parents, draft_logits=logits, draft_probs=dprobs, **call)
    monkeypatch.undo()  # the post-pass back, for the expected values
    sampling = [kw.get("temperature", 1.0), kw.get("top_k", 0), kw.get("top_p", 1.0), 0]
    tree = (kw.get("num_nodes"), kw.get("method", "kseq"), kw.get("max_depth"))
    args = check_tree_args(
        target, tokens, parents, logits, dprobs, *sampling, *tree, multi=multi,
        top_p_ties=kw.get("top_p_ties", "keep"), token_bitmask=mask,
    )  # fmt: skip
    after = post_pass.tree_logprobs(args, replace(out, logprobs=None), 0).logprobs
    allowed = allowed_of(mask, args.target.shape)
    ref = logprobs_reference(args, args.target, out.tokens, tree_rows(args, out.tokens, out.num_accepted), 0, allowed)
    return out, after, ref["logprobs"]


TREE_SETTINGS = [
    dict(temperature=torch.tensor([0.9, 0.0, 1.1]), top_k=4, top_p=0.95),
    dict(temperature=0.0),  # greedy: the walk kept only the argmax; scored at T = 1
    dict(temperature=0.0, top_k=3, top_p=0.8, top_p_ties="by_index"),
    dict(temperature=0.7, top_p=0.6, top_p_ties="by_index"),
]


@pytest.mark.parametrize("method", ["kseq", "rrs", "rrs_wor"])
@pytest.mark.parametrize("setting", TREE_SETTINGS, ids=range(len(TREE_SETTINGS)))
def test_tree_equals_post_pass(no_post_pass, backend, setting, method):
    """V = 6: sibling duplicates are common, so the walk's row (the first node spelling the prefix)
    and the accepted node's row differ."""
    inputs = make_tree_problem(3, 6, 6, seed=13, without_replacement=method == "rrs_wor")
    out, after, ref = _tree_native_and_expected(
        no_post_pass, "tree", *inputs, method=method, backend=backend, **setting
    )
    _check(out, after, ref)


def test_tree_ragged_bitmask_and_dtypes(no_post_pass, backend):
    """Ragged trees (padding nodes with junk parents), a grammar mask (a row allowing nothing is
    NaN), bf16 logits, an odd vocabulary."""
    num_nodes = torch.tensor([6, 0, 3])
    target, tokens, parents, draft = make_tree_problem(3, 6, 67, seed=15, num_nodes=num_nodes, dtype=torch.bfloat16)
    parents[1, :] = torch.tensor([5, 7, -9, 2, 4, 100])  # request 1 has no nodes: every parent is padding
    allowed = torch.rand(target.shape, generator=torch.Generator().manual_seed(3)) < 0.6
    allowed[1, 0] = False  # request 1's root allows nothing: NaN there
    kw = dict(num_nodes=num_nodes, temperature=torch.tensor([0.8, 0.0, 0.0]), top_k=9)
    out, after, ref = _tree_native_and_expected(
        no_post_pass, "tree", target, tokens, parents, draft, mask=pack(allowed), backend=backend, **kw
    )
    _check(out, after, ref)
    assert torch.isnan(out.logprobs[1, 0])


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_multi_equals_post_pass(no_post_pass, backend, temperature):
    gen = torch.Generator().manual_seed(14)
    B, K, G, V = 3, 3, 3, 5
    target = torch.randn(B, K, G + 1, V, generator=gen)
    drafts = torch.randint(0, V, (B, K, G), generator=gen)
    draft = torch.randn(B, K, G, V, generator=gen)
    out, after, ref = _tree_native_and_expected(
        no_post_pass, "multi", target, drafts, draft, temperature=temperature, top_p=0.9, backend=backend
    )
    _check(out, after, ref)


def test_tree_zero_sizes(no_post_pass, backend):
    """No requests, no drafts (the root's token alone), a one-token vocabulary."""
    call = dict(backend=backend, return_logprobs=True)
    empty = torch.zeros(0, 2, dtype=torch.int64)
    out = sk.verify_tree(torch.randn(0, 3, 8), empty, empty, **call)
    assert out.logprobs.shape == out.tokens.shape and out.logprobs.dtype == torch.float32
    target = torch.randn(2, 2, 1, 8)
    out = sk.verify_multi(target, torch.zeros(2, 2, 0, dtype=torch.int64), seed=1, **call)
    want = torch.log_softmax(target[:, 0, 0].double(), -1).gather(1, out.tokens)[:, 0].float()
    torch.testing.assert_close(out.logprobs[:, 0], want, atol=TOL, rtol=0)
    chain = torch.tensor([[-1, 0], [-1, 0]])  # V = 1: every token is 0, with log p = 0
    out = sk.verify_tree(torch.randn(2, 3, 1), torch.zeros(2, 2, dtype=torch.int64), chain, seed=1, **call)
    assert torch.equal(out.logprobs, torch.zeros(2, 3)) and torch.equal(out.tokens, torch.zeros(2, 3).long())


def test_tree_plain_calls_unchanged(no_post_pass, backend):
    """The tokens of a logprobs call are those of a plain call (greedy rows' extra thresholds change
    nothing); a plain call gets no logprobs; top-n stays on the post-pass, with the same values."""
    target, tokens, parents, draft = make_tree_problem(3, 4, 9, seed=4)
    kw = dict(temperature=torch.tensor([0.8, 0.0, 1.2]), top_k=5, seed=5, backend=backend)
    plain = sk.verify_tree(target, tokens, parents, draft, **kw)
    native = sk.verify_tree(target, tokens, parents, draft, return_logprobs=True, **kw)
    assert plain.logprobs is None and torch.equal(plain.tokens, native.tokens)
    assert torch.equal(plain.accepted_nodes, native.accepted_nodes)
    no_post_pass.undo()
    top = sk.verify_tree(target, tokens, parents, draft, return_logprobs=True, num_logprobs=2, **kw)
    torch.testing.assert_close(native.logprobs, top.logprobs, atol=TOL, rtol=0, equal_nan=True)


# ---- the Triton tree kernels (interpreted here, so small vocabularies): one-hot candidates and draft
# probabilities, vocabulary chunks and the two-launch thresholds, top-p tie groups, outputs wider than
# the tree, non-finite rows, verify_multi with a grammar mask


@pytest.mark.parametrize(
    ("mode", "method"), [("none", "kseq"), ("probs", "kseq"), ("probs", "rrs"), ("probs", "rrs_wor")]
)
def test_triton_tree_draft_modes(no_post_pass, mode, method):
    """One-hot candidates (no draft distribution: the walk's own test) and draft probabilities;
    mixed greedy / sampled requests with top-k and top-p."""
    target, tokens, parents, draft = make_tree_problem(3, 7, 9, seed=21, without_replacement=method == "rrs_wor")
    draft = None if mode == "none" else torch.softmax(draft, -1)
    kw = dict(temperature=torch.tensor([0.8, 0.0, 1.3]), top_k=6, top_p=0.9, method=method, backend="triton")
    inputs = (target, tokens, parents, draft)
    out, after, ref = _tree_native_and_expected(no_post_pass, "tree", *inputs, probs=mode == "probs", **kw)
    _check(out, after, ref)


@pytest.mark.parametrize("temperature", [torch.tensor([0.0, 0.9, 0.0]), 0.0], ids=["mixed", "greedy"])
@pytest.mark.parametrize("ties", ["keep", "by_index"])
def test_triton_tree_chunks_and_tie_rules(no_post_pass, ties, temperature):
    """Rows split into vocabulary chunks (blocks of 32, records merged), integer logits whose tie
    groups straddle the top-p boundary (greedy rows apply top-p at T = 1 with the call's tie rule:
    all-greedy calls too). (The two-launch thresholds, which the tree shares with the chain's row
    pass, cost 9 s interpreted here: test_verify_tree.py runs them on trees.)"""
    target, tokens, parents, draft = make_tree_problem(3, 4, 64, seed=5)
    target = target.round()
    kw = dict(temperature=temperature, top_k=40, top_p=0.6, top_p_ties=ties, backend="triton")
    with _dispatch.launch_overrides(num_chunks=2, block_v=32):
        out, after, ref = _tree_native_and_expected(no_post_pass, "tree", target, tokens, parents, draft, **kw)
    _check(out, after, ref)


def test_triton_tree_wide_output_and_nonfinite_rows(no_post_pass):
    """max_depth past the deepest tree (NaN past the emitted token); a root row without a finite
    logit is NaN (flagged); NaN / +inf entries read as -inf."""
    target, tokens, parents, draft = make_tree_problem(3, 5, 11, seed=9, shape="chain")
    target[0, 0] = float("nan")
    target[1, :, 3] = float("inf")
    target[2, :, :2] = float("nan")
    kw = dict(temperature=torch.tensor([0.7, 0.0, 1.0]), top_p=0.9, max_depth=7, backend="triton")
    out, after, ref = _tree_native_and_expected(no_post_pass, "tree", target, tokens, parents, draft, **kw)
    assert out.tokens.shape == (3, 8) and bool(out.nonfinite.all()) and torch.isnan(out.logprobs[0, 0])
    _check(out, after, ref)


def test_triton_multi_bitmask_and_probs(no_post_pass):
    """verify_multi (K chains of G slots) with a grammar mask on every target row, draft
    probabilities and per-request top-p."""
    gen = torch.Generator().manual_seed(22)
    B, K, G, V = 3, 3, 2, 40
    target = torch.randn(B, K, G + 1, V, generator=gen)
    drafts = torch.randint(0, V, (B, K, G), generator=gen)
    draft = torch.softmax(torch.randn(B, K, G, V, generator=gen), -1)
    allowed = torch.rand(target.shape, generator=gen) < 0.7
    kw = dict(temperature=torch.tensor([1.0, 0.0, 0.6]), top_p=torch.tensor([0.9, 0.5, 1.0]), backend="triton")
    out, after, ref = _tree_native_and_expected(
        no_post_pass, "multi", target, drafts, draft, mask=pack(allowed), probs=True, **kw
    )
    _check(out, after, ref)
