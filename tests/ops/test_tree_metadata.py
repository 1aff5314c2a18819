"""sk.tree_metadata against the reference (depths, ancestor bitmasks), including 64-node trees."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels.reference import tree_metadata_reference

from ._trees import tree_parents


@pytest.mark.parametrize("shape", ["random", "chain", "star"])
@pytest.mark.parametrize("N", [1, 7, 64])
def test_matches_reference(shape, N, device):
    gen = torch.Generator().manual_seed(N)
    parents = torch.stack([tree_parents(shape, N, gen) for _ in range(5)]).to(device)
    num_nodes = torch.tensor([N, 0, N // 2, 1, N], device=device)
    for n in (None, num_nodes):
        meta = sk.tree_metadata(parents, n)
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


def test_strided_arguments(device):
    """parents strided along nodes and expanded along the batch, num_nodes an int32 slice of stride 2."""
    parents = torch.tensor([[-1, 0, 0, 1, 3, -1]], device=device)
    B, N = 4, parents.shape[1]
    wide = torch.stack([parents, torch.full_like(parents, 77)], dim=-1).reshape(1, 2 * N)[:, ::2].expand(B, N)
    num_nodes = torch.tensor([6, -9, 2, -9, 0, -9, 4, -9], dtype=torch.int32, device=device)[::2]
    assert wide.stride() == (0, 2) and num_nodes.stride(0) == 2
    meta = sk.tree_metadata(wide, num_nodes)
    ref = tree_metadata_reference(wide.contiguous(), num_nodes.contiguous())
    assert torch.equal(meta.depth.cpu(), ref.depth.cpu())
    assert torch.equal(meta.ancestor_mask.cpu(), ref.ancestor_mask.cpu())


@pytest.mark.parametrize(
    "parents, num_nodes, match",
    [
        ([[-1, 0, 2]], None, "topological"),  # own index
        ([[-1, 0, 5]], None, "topological"),  # past the tree
        ([[-1, -2, 0]], None, "topological"),  # below -1
        ([[-1, 0, 1]], [4], "num_nodes must lie"),
        ([[-1, 0, 1]], [-1], "num_nodes must lie"),
    ],
)
def test_bad_values(parents, num_nodes, match, device):
    parents = torch.tensor(parents, device=device)
    n = None if num_nodes is None else torch.tensor(num_nodes, device=device)
    with pytest.raises(ValueError, match=match):
        sk.tree_metadata(parents, n)
    sk.tree_metadata(parents, n, validate=False)  # the fast path trusts the caller: no error, no crash


def test_padding_nodes_are_not_validated(device):
    """Padding nodes may hold anything (engines fill them with placeholders)."""
    parents = torch.tensor([[-1, 0, 99, -7]], device=device)
    meta = sk.tree_metadata(parents, torch.tensor([2], device=device))
    assert meta.depth.tolist() == [[1, 2, 0, 0]]


def test_custom_op_and_compile():
    from specdec_kernels.ops.tree_metadata import tree_metadata_op

    parents = torch.tensor([[-1, 0, 0, 1], [-1, -1, 1, 2]])
    num_nodes = torch.tensor([4, 3])
    torch.library.opcheck(tree_metadata_op, (parents, num_nodes), test_utils=("test_schema", "test_faketensor"))
    torch._dynamo.reset()
    compiled = torch.compile(lambda p, n: sk.tree_metadata(p, n).ancestor_mask, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(parents, num_nodes), sk.tree_metadata(parents, num_nodes).ancestor_mask)
