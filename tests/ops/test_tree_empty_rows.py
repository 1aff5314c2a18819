"""Greedy tree walks flag a row without a finite logit, as ``sk.verify`` does (issue 25 (b)).

Such a row is what a grammar mask allowing nothing leaves (or a target row of -inf): its argmax is
token 0 and the request is flagged in ``nonfinite``. Sampled walks always flagged it (p = 0
everywhere); greedy tree and multi-draft walks did not.
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels._bitmask import pack

from .conftest import cpu_core_or_skip

V = 70
BACKENDS = ["torch", "vectorized", "cpu", "triton"]


def _backend(backend: str) -> dict:
    if backend == "cpu":
        cpu_core_or_skip()
    return dict(backend=backend, seed=1, temperature=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tree_flags_a_mask_row_allowing_nothing(backend):
    """Request 0: its root row allows nothing (token 0, nothing accepted). Request 1: its root
    allows only its first node's token, accepted; that node's row allows nothing. Request 2: no
    empty row (not flagged)."""
    target = torch.randn(3, 4, V, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[3, 5, 7], [1, 2, 4], [9, 8, 6]])
    parents = torch.tensor([[-1, 0, -1], [-1, 0, 1], [-1, -1, 0]])
    allowed = torch.ones(3, 4, V, dtype=torch.bool)
    allowed[0, 0] = False
    allowed[1, 0] = False
    allowed[1, 0, 1] = True
    allowed[1, 1] = False
    out = sk.verify_tree(target, tokens, parents, token_bitmask=pack(allowed), **_backend(backend))
    assert out.tokens[:2, :2].tolist() == [[0, -1], [1, 0]]
    assert out.num_accepted[:2].tolist() == [0, 1]
    assert out.nonfinite.tolist() == [True, True, False]


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tree_and_multi_flag_a_row_of_minus_infinity(backend):
    """Without a mask: a target row of -inf reached by the walk flags the request; an unreached one
    does not."""
    target = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([[4, 6], [4, 6]])
    target[0, 0] = float("-inf")  # request 0's root
    target[1, 2] = float("-inf")  # request 1: the row after node 1, which the walk does not reach
    out = sk.verify_tree(target, tokens, torch.tensor([[-1, 0], [-1, 0]]), **_backend(backend))
    assert int(out.tokens[0, 0]) == 0 and out.nonfinite.tolist() == [True, False]
    multi = sk.verify_multi(target[:, None], tokens[:, None], **_backend(backend))
    assert int(multi.tokens[0, 0]) == 0 and multi.nonfinite.tolist() == [True, False]
