"""Every zero-size dimension, every public op, every backend (issue 24).

A table of ops (verify, its flattened layout, verify_tree, verify_multi, tree_metadata,
tree_attention, and the vocabulary-parallel entry points ``process_group=``) x backends x zero
dimensions (B = 0, G = 0, N = 0, num_nodes / num_draft_tokens all 0, ragged batches with some
requests at 0): no exception, outputs of the documented shapes and dtypes, equal to the reference.
With no drafts the documented output is one bonus token per request drawn from the root row, as
the reference draws it; the same token whichever op spells "no drafts".

Small shapes (V = 20): Triton runs in its interpreter here. Before the fix the CPU build died with
SIGFPE on a tree without nodes (a division by G = 0), which kills the test worker.
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _dispatch
from specdec_kernels.ops.tree_attention import tree_attention_allowed, tree_attention_torch
from specdec_kernels.reference.tree_attention import tree_attention_reference
from specdec_kernels.reference.verify_tree import tree_metadata_reference

from .conftest import cpu_core_or_skip

V = 20
BACKENDS = ("auto", "cpu", "vectorized", "torch", "triton")
PARAMS = {"sampled": dict(temperature=0.8, top_p=0.9), "greedy": dict(temperature=0.0)}


def _long(*values):
    return torch.tensor(values, dtype=torch.int64)


def _zeros(*shape):
    return torch.zeros(shape, dtype=torch.int64)


def _logits(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


def _ids(*shape, seed=1):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------
# the cases: name -> (op, positional args, keyword args); the same call on every backend

CHAIN_PARENTS = _long(-1, 0, 1)  # a 3-node chain as a tree
BRANCHY_PARENTS = _long(-1, -1, 0)


def _verify_cases():
    return {
        "verify_B0": (sk.verify, (_logits(0, 3, V), _zeros(0, 2), _logits(0, 2, V)), {}),
        "verify_G0": (sk.verify, (_logits(2, 1, V), _zeros(2, 0), _logits(2, 0, V)), {}),
        "verify_G0_ngram": (sk.verify, (_logits(3, 1, V), _zeros(3, 0)), {}),
        "verify_B0_G0": (sk.verify, (_logits(0, 1, V), _zeros(0, 0)), {}),
        "verify_counts_all_0": (
            sk.verify,
            (_logits(2, 3, V), _ids(2, 2), _logits(2, 2, V, seed=3)),
            dict(num_draft_tokens=_zeros(2)),
        ),
        "verify_ragged_some_0": (
            sk.verify,
            (_logits(3, 3, V), _ids(3, 2), _logits(3, 2, V, seed=3)),
            dict(num_draft_tokens=_long(0, 2, 0)),
        ),
        "flat_B0": (sk.verify, (_logits(0, V), _zeros(0), _logits(0, V)), dict(cu_num_draft_tokens=_zeros(1))),
        "flat_no_drafts": (sk.verify, (_logits(2, V), _zeros(0), _logits(0, V)), dict(cu_num_draft_tokens=_zeros(3))),
        "flat_ragged_some_0": (
            sk.verify,
            (_logits(5, V), _ids(2), _logits(2, V, seed=3)),
            dict(cu_num_draft_tokens=_long(0, 0, 2, 2)),
        ),
    }


def _tree_cases():
    return {
        "tree_B0": (sk.verify_tree, (_logits(0, 4, V), _zeros(0, 3), _zeros(0, 3), _logits(0, 3, V)), {}),
        "tree_N0": (sk.verify_tree, (_logits(2, 1, V), _zeros(2, 0), _zeros(2, 0), _logits(2, 0, V)), {}),
        "tree_N0_onehot": (sk.verify_tree, (_logits(2, 1, V), _zeros(2, 0), _zeros(2, 0)), {}),
        "tree_B0_N0": (sk.verify_tree, (_logits(0, 1, V), _zeros(0, 0), _zeros(0, 0)), {}),
        "tree_num_nodes_all_0": (
            sk.verify_tree,
            (_logits(2, 4, V), _ids(2, 3), CHAIN_PARENTS.expand(2, 3), _logits(2, 3, V, seed=3)),
            dict(num_nodes=_zeros(2)),
        ),
        "tree_ragged_some_0": (
            sk.verify_tree,
            (_logits(3, 4, V), _ids(3, 3), BRANCHY_PARENTS.expand(3, 3), _logits(3, 3, V, seed=3)),
            dict(num_nodes=_long(0, 3, 0)),
        ),
        "multi_B0": (sk.verify_multi, (_logits(0, 2, 3, V), _zeros(0, 2, 2), _logits(0, 2, 2, V)), {}),
        "multi_G0": (sk.verify_multi, (_logits(2, 3, 1, V), _zeros(2, 3, 0), _logits(2, 3, 0, V)), {}),
        "multi_G0_onehot": (sk.verify_multi, (_logits(2, 2, 1, V), _zeros(2, 2, 0)), {}),
        "multi_B0_G0": (sk.verify_multi, (_logits(0, 2, 1, V), _zeros(0, 2, 0)), {}),
    }


VERIFY_CASES = sorted(_verify_cases())
TREE_CASES = sorted(_tree_cases())


def _case(name):
    return {**_verify_cases(), **_tree_cases()}[name]


@pytest.fixture
def use_backend(monkeypatch):
    """Backend names as users get them: "auto" on CPU tensors is the CPU build (tests/ops/conftest.py
    points it at Triton for the kernel tests); "cpu" needs the toolchain."""

    def prepare(backend):
        monkeypatch.setattr(_dispatch, "_CPU_AUTO", None)
        if backend == "cpu":
            cpu_core_or_skip()
        return backend

    return prepare


def _fields(out):
    return {name: getattr(out, name) for name in out.__dataclass_fields__ if getattr(out, name) is not None}


def _assert_same(out, ref):
    got, want = _fields(out), _fields(ref)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape, name
        assert torch.equal(got[name], want[name]), (name, got[name], want[name])


def _expected_shapes(op, args, kw, out):
    """The documented output shapes of the case (independent of any backend)."""
    if op is sk.verify:
        B = kw["cu_num_draft_tokens"].shape[0] - 1 if "cu_num_draft_tokens" in kw else args[0].shape[0]
        assert out.tokens.shape[0] == B and out.tokens.dtype == torch.int64
    else:
        B = args[0].shape[0]
        D = out.tokens.shape[1] - 1
        assert out.accepted_nodes.shape == (B, D) and out.accepted_nodes.dtype == torch.int64
    assert out.num_accepted.shape == (B,) and out.num_accepted.dtype == torch.int32
    assert out.nonfinite.shape == (B,) and out.nonfinite.dtype == torch.bool
    if B:  # every request emits its accepted drafts and one more token
        n = out.num_accepted.long()
        assert bool((out.tokens.gather(1, n[:, None]) >= 0).all())


@pytest.mark.parametrize("params", sorted(PARAMS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", VERIFY_CASES + TREE_CASES)
def test_zero_size_matches_reference(case, backend, params, use_backend):
    op, args, kw = _case(case)
    kw = dict(kw, seed=7, **PARAMS[params])
    ref = op(*args, backend="torch", **kw)
    out = op(*args, backend=use_backend(backend), **kw)
    _expected_shapes(op, args, kw, ref)
    _assert_same(out, ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("out_dtype", [torch.int32, torch.int64])
def test_empty_batch_out_dtype(backend, out_dtype, use_backend):
    backend = use_backend(backend)
    out = sk.verify(_logits(0, 3, V), _zeros(0, 2), seed=1, backend=backend, out_dtype=out_dtype)
    assert out.tokens.shape == (0, 3) and out.tokens.dtype == out_dtype
    tree = sk.verify_tree(_logits(0, 1, V), _zeros(0, 0), _zeros(0, 0), seed=1, backend=backend, out_dtype=out_dtype)
    assert tree.tokens.shape == (0, 1) and tree.accepted_nodes.shape == (0, 0)
    assert tree.tokens.dtype == tree.accepted_nodes.dtype == out_dtype


@pytest.mark.parametrize("params", sorted(PARAMS))
def test_no_drafts_is_one_bonus_token_from_the_root_row(params):
    """The documented output without drafts, spelled four ways: the reference's bonus token from
    the root row (greedy: its argmax), num_accepted 0, no accepted nodes."""
    B = 4
    root = _logits(B, 1, V, seed=5)
    seeds = torch.tensor([3, -1, 2**40, 9], dtype=torch.int64)
    kw = dict(seed=seeds, backend="torch", **PARAMS[params])
    chain = sk.verify(root, _zeros(B, 0), **kw)
    tree = sk.verify_tree(root, _zeros(B, 0), _zeros(B, 0), **kw)
    multi = sk.verify_multi(torch.cat([root[:, None], _logits(B, 2, 1, V, seed=6)], 1), _zeros(B, 3, 0), **kw)
    ragged = sk.verify_tree(
        torch.cat([root, _logits(B, 3, V, seed=7)], 1),
        _ids(B, 3),
        CHAIN_PARENTS.expand(B, 3),
        num_nodes=_zeros(B),
        **kw,
    )
    for out in (chain, tree, multi, ragged):
        assert out.tokens.shape == (B, 1)
        assert torch.equal(out.tokens, chain.tokens)
        assert torch.equal(out.num_accepted, torch.zeros(B, dtype=torch.int32))
    if params == "greedy":
        assert torch.equal(chain.tokens[:, 0], root[:, 0].argmax(-1))
    for out in (tree, multi, ragged):
        assert out.accepted_nodes.shape == (B, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_zero_chains_is_a_value_error(backend, use_backend):
    """K = 0 chains leave no root row [0, 0] to draw the bonus token from: a ValueError saying so
    (documented in verify_multi), whatever B and G."""
    backend = use_backend(backend)
    for B, G in ((2, 2), (2, 0), (0, 2)):
        with pytest.raises(ValueError, match="K >= 1 chains"):
            sk.verify_multi(_logits(B, 0, G + 1, V), _zeros(B, 0, G), seed=1, backend=backend)


# --------------------------------------------------------------------------------------------
# tree_metadata and tree_attention

METADATA_CASES = {
    "B0": (_zeros(0, 3), None),
    "B0_counts": (_zeros(0, 3), _zeros(0)),
    "N0": (_zeros(2, 0), None),
    "B0_N0": (_zeros(0, 0), None),
    "num_nodes_all_0": (BRANCHY_PARENTS.expand(2, 3), _zeros(2)),
    "ragged_some_0": (BRANCHY_PARENTS.expand(3, 3), _long(3, 0, 2)),
}


@pytest.mark.parametrize("backend", ("auto", "torch", "triton"))
@pytest.mark.parametrize("case", sorted(METADATA_CASES))
def test_tree_metadata_zero_size(case, backend):
    parents, num_nodes = METADATA_CASES[case]
    B, N = parents.shape
    n = num_nodes if num_nodes is not None else torch.full((B,), N, dtype=torch.int64)
    ref = tree_metadata_reference(parents, n)
    out = sk.tree_metadata(parents, num_nodes, backend=backend)
    assert out.depth.dtype == torch.int32 and out.ancestor_mask.dtype == torch.int64
    assert out.depth.shape == out.ancestor_mask.shape == (B, N)
    assert torch.equal(out.depth, ref.depth.to(torch.int32))
    assert torch.equal(out.ancestor_mask, ref.ancestor_mask)


ATTENTION_CASES = {  # (B, N, S, num_nodes)
    "B0": (0, 3, 5, None),
    "N0": (2, 0, 4, None),
    "N0_S0": (2, 0, 0, None),
    "B0_N0": (0, 0, 4, None),
    "num_nodes_all_0": (2, 3, 5, (0, 0)),
    "ragged_some_0": (3, 3, 6, (0, 3, 1)),
}


@pytest.mark.parametrize("impl", ("tree_attention", "tree_attention_torch"))
@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_tree_attention_zero_size(case, impl):
    B, N, S, counts = ATTENTION_CASES[case]
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, h, n, 16, generator=gen) for h, n in ((2, N), (1, S), (1, S)))
    parents = BRANCHY_PARENTS[:N].expand(B, N) if N <= 3 else None
    num_nodes = None if counts is None else _long(*counts)
    prefix = torch.full((B,), S - N, dtype=torch.int64)
    ref = tree_attention_reference(q, k, v, prefix, parents, num_nodes=num_nodes)
    if impl == "tree_attention":
        out = sk.tree_attention(q, k, v, prefix, parents, num_nodes=num_nodes)
    else:
        meta = sk.tree_metadata(parents, num_nodes)
        start, end = torch.zeros(B, dtype=torch.int32), prefix.to(torch.int32)
        allowed = tree_attention_allowed(start, end, end, meta.ancestor_mask, S, tree_slots=N)
        out = tree_attention_torch(q, k, v, start, end, end, meta.ancestor_mask, tree_slots=N, allowed=allowed)
    assert out.shape == (B, 2, N, 16) and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# vocabulary-parallel entry points (process_group=): one rank of gloo, in this process (one_rank_group:
# conftest.py)


SHARDED_CASES = [c for c in VERIFY_CASES + TREE_CASES if not c.startswith("flat")]  # no flattened layout


@pytest.mark.parametrize("params", sorted(PARAMS))
@pytest.mark.parametrize("backend", ("auto", "torch"))
@pytest.mark.parametrize("case", SHARDED_CASES)
def test_zero_size_vocab_parallel(case, backend, params, one_rank_group):
    op, args, kw = _case(case)
    kw = dict(kw, seed=7, **PARAMS[params])
    ref = op(*args, backend="torch", **kw)
    out = op(*args, backend=backend, process_group=one_rank_group, vocab_size=V, **kw)
    _assert_same(out, ref)
