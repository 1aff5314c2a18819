"""sk.tree_metadata against the reference (depths, ancestor bitmasks), including 64-node trees."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels.reference import tree_metadata_reference

from ._trees import tree_parents


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("shape", ["random", "chain", "star"])
@pytest.mark.parametrize("N", [1, 7, 64])
def test_matches_reference(shape, N, backend, device):
    gen = torch.Generator().manual_seed(N)
    parents = torch.stack([tree_parents(shape, N, gen) for _ in range(5)]).to(device)
    num_nodes = torch.tensor([N, 0, N // 2, 1, N], device=device)
    for n in (None, num_nodes):
        meta = sk.tree_metadata(parents, n, backend=backend)
        ref = tree_metadata_reference(parents, n)
        assert torch.equal(meta.depth.cpu(), ref.depth.cpu())
        assert torch.equal(meta.ancestor_mask.cpu(), ref.ancestor_mask.cpu())
    if shape == "chain":
        assert meta.depth[0].tolist() == list(range(1, N + 1))


def test_bad_input(device):
    with pytest.raises(ValueError, match="at most 64 tree nodes"):
        sk.tree_metadata(torch.full((1, 65), -1, device=device))
    with pytest.raises(TypeError, match="parents has dtype"):
        sk.tree_metadata(torch.zeros(1, 3, device=device))


@pytest.mark.parametrize(
    "parents, num_nodes, message",
    [
        ([[-1, 0, 3, 1, 2]], None, r"parents\[0, 2\] = 3"),  # a forward parent
        ([[-1, 0, 99]], None, r"parents\[0, 2\] = 99"),
        ([[-1, -2, 0]], None, r"parents\[0, 1\] = -2"),
        ([[-1, 0, 1]], [4], r"num_nodes must be in \[0, N=3\]"),
        ([[-1, 0, 1]], [-1], r"num_nodes must be in \[0, N=3\]"),
    ],
)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_values_are_clear_errors(parents, num_nodes, message, backend):
    parents = torch.tensor(parents)
    n = None if num_nodes is None else torch.tensor(num_nodes)
    with pytest.raises(ValueError, match=message):
        sk.tree_metadata(parents, n, backend=backend)


def test_unchecked_bad_parents_read_as_root_children_in_both_backends():
    """validate=False trusts the caller; a bad parent never reads out of range (it acts as -1)."""
    parents = torch.tensor([[-1, 0, 3, 1, 99]])
    a = sk.tree_metadata(parents, validate=False, backend="triton")
    b = sk.tree_metadata(parents, validate=False, backend="torch")
    assert torch.equal(a.depth, b.depth) and torch.equal(a.ancestor_mask, b.ancestor_mask)
    assert a.depth.tolist() == [[1, 2, 1, 3, 1]]


def test_strided_views_equal_contiguous():
    gen = torch.Generator().manual_seed(3)
    parents = torch.stack([tree_parents("random", 9, gen) for _ in range(4)])
    wide = torch.zeros(4, 18, dtype=torch.int64)
    wide[:, ::2] = parents
    n = torch.tensor([[9, 0], [3, 0], [0, 0], [7, 0]])[:, 0]  # stride 2
    for backend in ("triton", "torch"):
        a = sk.tree_metadata(wide[:, ::2], n, backend=backend)
        b = sk.tree_metadata(parents, n.contiguous(), backend=backend)
        assert torch.equal(a.depth, b.depth) and torch.equal(a.ancestor_mask, b.ancestor_mask)


def test_tree_metadata_and_attention_compile_as_one_graph():
    """torch.compile(fullgraph=True) traces both public ops (validate=False: value checks read tensors)."""
    B, Hq, Hkv, D, S = 2, 4, 2, 32, 24
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    prefix_lens = torch.tensor([10, 15])
    q, k, v = torch.randn(B, Hq, 4, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)

    def f(q, k, v, prefix_lens, parents):
        meta = sk.tree_metadata(parents, validate=False)
        return sk.tree_attention(q, k, v, prefix_lens, parents, validate=False), meta.depth, meta.ancestor_mask

    expected = f(q, k, v, prefix_lens, parents)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, prefix_lens, parents)
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])
