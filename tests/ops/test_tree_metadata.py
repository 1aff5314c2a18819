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
