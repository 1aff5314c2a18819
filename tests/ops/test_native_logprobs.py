"""return_logprobs=True without top-n on trees and verify_multi, computed by the CPU build itself
(backend="cpu": csrc/verify_cpu.cpp ``tree_logprobs`` scores the accepted path from the records of
the rows the walk used), no post-pass over the rows. Equal, within 1e-5, to the post-pass
(ops/logprobs.py) on the same output and to the reference (reference/logprobs.py); the post-pass's
row gather is made to raise, so a silent fallback fails. (Chains on the CPU build and the Triton
kernels: test_cpu_logprobs.py, whose helpers these tests share.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels._bitmask import pack
from specdec_kernels._tree_args import check_tree_args
from specdec_kernels.ops import logprobs as post_pass
from specdec_kernels.reference.logprobs import logprobs_reference, tree_rows

from ._trees import make_tree_problem
from .conftest import cpu_core_or_skip
from .test_cpu_logprobs import TOL, _check, allowed_of

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
