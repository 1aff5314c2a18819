"""The engine adapters of python/engine_adapters.py: each mapping checked against the padded call."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import specdec_kernels as sk

_PATH = Path(__file__).resolve().parent.parent / "python" / "engine_adapters.py"
_spec = importlib.util.spec_from_file_location("engine_adapters", _PATH)
adapters = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(adapters)

V = 64


def _pad_rows(flat: torch.Tensor, starts: list[int], counts: list[int], width: int) -> torch.Tensor:
    out = flat.new_zeros((len(starts), width) + tuple(flat.shape[1:]))
    for b, (s, c) in enumerate(zip(starts, counts)):
        out[b, :c] = flat[s : s + c]
    return out


def test_vllm_adapter_equals_the_padded_call():
    g = torch.Generator().manual_seed(1)
    counts = [2, 0, 3, 1]
    ends = torch.tensor(counts).cumsum(0)
    N, B, G = int(ends[-1]), len(counts), 3
    logits = torch.randn(N + B, V, generator=g)
    drafts = torch.randint(0, V, (N,), generator=g)
    probs = torch.softmax(torch.randn(N, V, generator=g), -1)
    T = torch.tensor([0.0, 0.8, 1.0, 0.5])
    ids, num_sampled = adapters.vllm_rejection_sample(logits, drafts, ends, G, probs, T, torch.arange(B))
    starts = [int(e) - c for e, c in zip(ends, counts)]
    target = _pad_rows(logits, [s + b for b, s in enumerate(starts)], [c + 1 for c in counts], G + 1)
    ref = sk.verify(
        target,
        _pad_rows(drafts, starts, counts, G),
        draft_probs=_pad_rows(probs, starts, counts, G),
        num_draft_tokens=torch.tensor(counts),
        temperature=T,
        seed=torch.arange(B),
        backend="torch",
    )
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ref.tokens)
    assert torch.equal(num_sampled, ref.num_accepted + 1)
    for b in range(B):  # vLLM's rows: num_sampled real ids, then -1 placeholders
        assert (ids[b, : num_sampled[b]] >= 0).all() and (ids[b, num_sampled[b] :] == -1).all()


def test_parents_from_links():
    # root 0 -> 1, 2, 3;  1 -> 4, 5;  3 -> 6;  4 -> 7
    first_child = torch.tensor([[1, 4, -1, 6, 7, -1, -1, -1]])
    next_sibling = torch.tensor([[-1, 2, 3, -1, 5, -1, -1, -1]])
    parents = adapters.parents_from_links(first_child, next_sibling)
    assert parents.tolist() == [[-1, -1, -1, 0, 0, 2, 3]]
    assert sk.tree_metadata(parents).depth.tolist() == [[1, 1, 1, 2, 2, 2, 3]]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_sglang_adapter_matches_verify_tree(temperature):
    g = torch.Generator().manual_seed(2)
    first_child = torch.tensor([[1, 3, -1, -1, -1], [1, -1, -1, -1, -1]])
    next_sibling = torch.tensor([[-1, 2, -1, 4, -1], [-1, 2, 3, 4, -1]])
    B, n = first_child.shape
    target = torch.softmax(torch.randn(B, n, V, generator=g) * 3, -1)
    cands = torch.randint(0, V, (B, n), generator=g)
    cands[0, 1] = int(target[0, 0].argmax())  # greedy accepts node 1, then tests its children
    predicts, accept_index, accept_length = adapters.sglang_verify_tree(
        target, cands, first_child, next_sibling, temperature=temperature, seed=torch.tensor([3, 4])
    )
    parents = adapters.parents_from_links(first_child, next_sibling)
    ref = sk.verify_tree(
        torch.log(target), cands[:, 1:], parents, temperature=temperature, seed=torch.tensor([3, 4]), backend="torch"
    )
    assert torch.equal(accept_length, ref.num_accepted)
    for b in range(B):
        k = int(ref.num_accepted[b])
        path = [0] + (ref.accepted_nodes[b, :k] + 1).tolist()
        assert accept_index[b, : k + 1].tolist() == [b * n + node for node in path]
        assert (accept_index[b, k + 1 :] == -1).all()
        # predicts after each path node: the next accepted draft's token, then the emitted one
        assert [int(predicts[b * n + node]) for node in path] == ref.tokens[b, : k + 1].tolist()
        assert all(int(cands[b, node]) == int(predicts[b * n + prev]) for prev, node in zip(path, path[1:]))


def test_flashinfer_adapter_equals_the_probability_call():
    g = torch.Generator().manual_seed(3)
    B, G = 3, 4
    q = torch.softmax(torch.randn(B, G, V, generator=g), -1)
    p = torch.softmax(torch.randn(B, G + 1, V, generator=g), -1)
    ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, G)
    tokens, emitted = adapters.flashinfer_chain_speculative_sampling(q, ids, p, seed=9)
    ref = sk.verify(torch.log(p), ids, draft_probs=q, temperature=1.0, seed=9, backend="torch")
    assert tokens.dtype == torch.int32 and torch.equal(tokens.long(), ref.tokens)
    assert torch.equal(emitted, ref.num_accepted)
