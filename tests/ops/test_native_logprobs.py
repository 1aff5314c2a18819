"""return_logprobs=True without top-n computed by the kernels themselves, no post-pass over the rows:
the Triton chain kernels (backend="triton": the finalize kernel scores the emitted tokens from the
row records, ops/triton/chain.py ``_emitted_logprobs``) and the CPU build's trees / multi-draft
(backend="cpu": csrc/verify_cpu.cpp ``tree_logprobs``, the accepted path). Equal, within 1e-5, to the post-pass
(ops/logprobs.py) on the same output and to the reference (reference/logprobs.py); the post-pass's
row gather is made to raise, so a silent fallback fails. (The CPU build's chains:
test_cpu_logprobs.py, whose helpers these tests share.)"""

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

from ._inputs import flattened_problem, make_problem
from ._trees import make_tree_problem
from .conftest import cpu_core_or_skip
from .test_cpu_logprobs import TOL, _check, _native_and_expected


@pytest.fixture
def no_post_pass(monkeypatch):
    """Make the post-pass's row gather raise: a native result must not need it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the logprobs post-pass ran")

    monkeypatch.setattr(post_pass, "_fill", refuse)
    return monkeypatch


def _triton(monkeypatch, target, drafts, draft, **kw):
    return _native_and_expected(monkeypatch, target, drafts, draft, backend="triton", **kw)


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_k=7, top_p=0.8),
    dict(temperature=0.0),  # greedy: scored at temperature 1 (log_softmax of the raw row)
    dict(temperature=0.0, top_k=4, top_p=0.9),  # greedy with filters: at temperature 1 with them
    dict(temperature=torch.tensor([0.0, 0.9, 0.5]), top_k=torch.tensor([0, 3, 10]), top_p=0.85),
]


@pytest.mark.parametrize("mode", ["logits", "probs", "none"])
@pytest.mark.parametrize("setting", SETTINGS, ids=range(len(SETTINGS)))
def test_triton_equals_post_pass(no_post_pass, setting, mode):
    target, drafts, draft = make_problem(3, 3, 37, seed=len(mode), closeness=0.3)
    if mode == "probs":
        draft = torch.softmax(draft, -1)
    kw = dict(setting, num_draft_tokens=torch.tensor([3, 0, 2]))
    draft = None if mode == "none" else draft
    out, after, ref = _triton(no_post_pass, target, drafts, draft, probs=mode == "probs", **kw)
    _check(out, after, ref)


@pytest.mark.parametrize("num_chunks", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_vocab_chunks_and_dtypes(no_post_pass, num_chunks, dtype):
    """Rows split into vocabulary chunks (their records merged) and 16-bit logits, odd V."""
    target, drafts, draft = make_problem(3, 2, 131, seed=2, dtype=dtype)
    kw = dict(temperature=torch.tensor([0.9, 0.0, 0.6]), top_k=50, top_p=0.95)
    with _dispatch.launch_overrides(num_chunks=num_chunks, block_v=32):
        out, after, ref = _triton(no_post_pass, target, drafts, draft, **kw)
    _check(out, after, ref)


@pytest.mark.parametrize("temperature", [torch.tensor([1.0, 0.0, 0.6]), 0.0], ids=["mixed", "greedy"])
@pytest.mark.parametrize("ties", ["keep", "by_index"])
def test_triton_top_p_tie_rules(no_post_pass, ties, temperature):
    """Integer logits: tie groups straddle the top-p boundary (greedy rows apply top-p at T = 1 with
    the call's tie rule: the row pass then computes their index cuts too)."""
    gen = torch.Generator().manual_seed(1)
    target = torch.randint(-2, 3, (3, 3, 40), generator=gen).float()
    drafts = torch.randint(0, 40, (3, 2), generator=gen)
    out, after, ref = _triton(no_post_pass, target, drafts, None, temperature=temperature, top_p=0.5, top_p_ties=ties)
    _check(out, after, ref)


def test_triton_flattened_layout(no_post_pass):
    cu, rows, ids, draft = flattened_problem(37, seed=8)
    kw = dict(temperature=torch.tensor([0.7, 0.0, 1.0]), top_k=9, cu_num_draft_tokens=cu, max_num_draft_tokens=4)
    out, after, ref = _triton(no_post_pass, rows, ids, draft, **kw)
    assert out.tokens.shape == (3, 5)
    _check(out, after, ref)


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_triton_token_bitmask(no_post_pass, temperature):
    """Disallowed tokens read -inf before processing; a row with nothing allowed is NaN."""
    target, drafts, draft = make_problem(3, 3, 70, seed=13)
    allowed = torch.rand(target.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    allowed[2, 0] = False  # request 2's first row allows nothing: NaN there
    mask = pack(allowed)
    out, after, ref = _triton(no_post_pass, target, drafts, draft, mask=mask, temperature=temperature, top_k=20)
    _check(out, after, ref)
    assert torch.isnan(out.logprobs[2, 0])


def test_triton_flattened_bitmask(no_post_pass):
    cu, rows, ids, draft = flattened_problem(37, seed=4)
    allowed = torch.rand(rows.shape, generator=torch.Generator().manual_seed(2)) < 0.6
    kw = dict(temperature=torch.tensor([0.0, 0.8, 1.0]), top_p=0.9, cu_num_draft_tokens=cu, max_num_draft_tokens=4)
    out, after, ref = _triton(no_post_pass, rows, ids, draft, mask=pack(allowed), **kw)
    _check(out, after, ref)


def test_triton_nonfinite_rows(no_post_pass):
    """A row without a finite logit is NaN; NaN / +inf entries of a row read as -inf."""
    target, drafts, draft = make_problem(3, 2, 37, seed=11)
    target[0, 0] = float("nan")
    target[1, :, :5] = float("inf")
    target[2, :, 3] = float("nan")
    out, after, ref = _triton(no_post_pass, target, drafts, draft, temperature=0.9, top_p=0.9)
    assert bool(out.nonfinite.all()) and torch.isnan(out.logprobs[0]).all()
    _check(out, after, ref)


def test_triton_zero_sizes(no_post_pass):
    call = dict(backend="triton", return_logprobs=True)
    out = sk.verify(torch.randn(0, 3, 37), torch.zeros(0, 2, dtype=torch.int64), **call)
    assert out.logprobs.shape == (0, 3) and out.logprobs.dtype == torch.float32
    target = torch.randn(2, 1, 37)
    out = sk.verify(target, torch.zeros(2, 0, dtype=torch.int64), seed=1, **call)
    want = torch.log_softmax(target[:, 0].double(), -1).gather(1, out.tokens)[:, 0].float()
    torch.testing.assert_close(out.logprobs[:, 0], want, atol=TOL, rtol=0)
    out = sk.verify(torch.randn(2, 3, 1), torch.zeros(2, 2, dtype=torch.int64), **call)
    assert torch.equal(out.logprobs, torch.zeros(2, 3)) and torch.equal(out.tokens, torch.zeros(2, 3).long())


def test_triton_top_n_and_plain_calls_unchanged():
    """num_logprobs > 0 stays on the post-pass; the tokens of a logprobs call are those of a plain
    call (greedy rows' thresholds, computed for the logprobs only, change nothing)."""
    target, drafts, draft = make_problem(3, 3, 45, seed=6)
    kw = dict(temperature=torch.tensor([0.8, 0.0, 1.2]), top_k=6, top_p=0.9, seed=5, backend="triton")
    plain = sk.verify(target, drafts, draft, **kw)
    native = sk.verify(target, drafts, draft, return_logprobs=True, **kw)
    top = sk.verify(target, drafts, draft, return_logprobs=True, num_logprobs=2, **kw)
    assert plain.logprobs is None and native.top_logprobs is None and top.top_logprobs is not None
    assert torch.equal(plain.tokens, native.tokens) and torch.equal(plain.tokens, top.tokens)
    assert torch.equal(plain.num_accepted, native.num_accepted) and torch.equal(plain.nonfinite, native.nonfinite)
    torch.testing.assert_close(native.logprobs, top.logprobs, atol=TOL, rtol=0, equal_nan=True)


# ---- trees and multi-draft on the CPU build (csrc/verify_cpu.cpp ``tree_logprobs``: the walk records
# the row it scored each position with, the logprobs come from that row's record)


def _tree_native_and_expected(monkeypatch, op, *inputs, mask=None, **kw):
    """(native backend="cpu" output, the post-pass's logprobs on it, the reference's) of one
    verify_tree / verify_multi call; kw: the op's sampling keywords."""
    cpu_core_or_skip()
    multi = op == "multi"
    call = dict(kw, seed=kw.get("seed", 3), backend="cpu", token_bitmask=mask, return_logprobs=True)
    out = (sk.verify_multi if multi else sk.verify_tree)(*inputs, **call)
    monkeypatch.undo()  # the post-pass back, for the expected values
    target, tokens, parents, draft = inputs if not multi else (inputs[0], inputs[1], None, inputs[2])
    sampling = [kw.get("temperature", 1.0), kw.get("top_k", 0), kw.get("top_p", 1.0), 0]
    tree = (kw.get("num_nodes"), kw.get("method", "kseq"), kw.get("max_depth"))
    args = check_tree_args(
        target, tokens, parents, draft, None, *sampling, *tree, multi=multi, top_p_ties=kw.get("top_p_ties", "keep"),
        token_bitmask=mask,
    )  # fmt: skip
    after = post_pass.tree_logprobs(args, replace(out, logprobs=None), 0).logprobs
    allowed = None
    if mask is not None:  # the reference's allowed mask: bit x of the row's words
        bits = (mask[..., :, None] >> torch.arange(32)) & 1
        allowed = bits.flatten(-2)[..., : args.V].bool().reshape(args.target.shape)
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
def test_cpu_tree_equals_post_pass(no_post_pass, setting, method):
    """V = 6: sibling duplicates are common, so the walk's row (the first node spelling the prefix)
    and the accepted node's row differ."""
    inputs = make_tree_problem(3, 6, 6, seed=13, without_replacement=method == "rrs_wor")
    out, after, ref = _tree_native_and_expected(no_post_pass, "tree", *inputs, method=method, **setting)
    _check(out, after, ref)


def test_cpu_tree_ragged_bitmask_and_dtypes(no_post_pass):
    """Ragged trees (padding nodes with junk parents), a grammar mask (a row allowing nothing is
    NaN), bf16 logits, an odd vocabulary."""
    num_nodes = torch.tensor([6, 0, 3])
    target, tokens, parents, draft = make_tree_problem(3, 6, 67, seed=15, num_nodes=num_nodes, dtype=torch.bfloat16)
    parents[1, :] = torch.tensor([5, 7, -9, 2, 4, 100])  # request 1 has no nodes: every parent is padding
    allowed = torch.rand(target.shape, generator=torch.Generator().manual_seed(3)) < 0.6
    allowed[1, 0] = False  # request 1's root allows nothing: NaN there
    kw = dict(num_nodes=num_nodes, temperature=torch.tensor([0.8, 0.0, 0.0]), top_k=9)
    out, after, ref = _tree_native_and_expected(
        no_post_pass, "tree", target, tokens, parents, draft, mask=pack(allowed), **kw
    )
    _check(out, after, ref)
    assert torch.isnan(out.logprobs[1, 0])


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_cpu_multi_equals_post_pass(no_post_pass, temperature):
    gen = torch.Generator().manual_seed(14)
    B, K, G, V = 3, 3, 3, 5
    target = torch.randn(B, K, G + 1, V, generator=gen)
    drafts = torch.randint(0, V, (B, K, G), generator=gen)
    draft = torch.randn(B, K, G, V, generator=gen)
    out, after, ref = _tree_native_and_expected(
        no_post_pass, "multi", target, drafts, draft, temperature=temperature, top_p=0.9
    )
    _check(out, after, ref)


def test_cpu_tree_zero_sizes_and_plain_calls(no_post_pass):
    cpu_core_or_skip()
    call = dict(backend="cpu", return_logprobs=True)
    empty = torch.zeros(0, 2, dtype=torch.int64)
    out = sk.verify_tree(torch.randn(0, 3, 8), empty, empty, **call)
    assert out.logprobs.shape == out.tokens.shape and out.logprobs.dtype == torch.float32
    target = torch.randn(2, 2, 1, 8)
    out = sk.verify_multi(target, torch.zeros(2, 2, 0, dtype=torch.int64), seed=1, **call)
    want = torch.log_softmax(target[:, 0, 0].double(), -1).gather(1, out.tokens)[:, 0].float()
    torch.testing.assert_close(out.logprobs[:, 0], want, atol=TOL, rtol=0)
    # the tokens of a logprobs call are those of a plain call; top-n stays on the post-pass
    target, tokens, parents, draft = make_tree_problem(3, 6, 9, seed=4)
    kw = dict(temperature=torch.tensor([0.8, 0.0, 1.2]), top_k=5, seed=5, backend="cpu")
    plain = sk.verify_tree(target, tokens, parents, draft, **kw)
    native = sk.verify_tree(target, tokens, parents, draft, return_logprobs=True, **kw)
    assert plain.logprobs is None and torch.equal(plain.tokens, native.tokens)
    assert torch.equal(plain.accepted_nodes, native.accepted_nodes)
    no_post_pass.undo()
    top = sk.verify_tree(target, tokens, parents, draft, return_logprobs=True, num_logprobs=2, **kw)
    torch.testing.assert_close(native.logprobs, top.logprobs, atol=TOL, rtol=0, equal_nan=True)
