"""Adapters between the tensors engines hold and ``specdec_kernels``' verification ops.

Runnable on CPU or CUDA:  python python/engine_adapters.py   (tests/test_engine_adapters.py tests
every function here). Each adapter is a few lines on purpose: the mapping is the documentation.

* vLLM (v1 rejection sampler): flattened rows, per-request ends of the draft counts, -1 padding,
  ``num_sampled = num_accepted + 1``.
* SGLang (EAGLE trees): node 0 of each tree is the root (the last verified token); the tree is
  stored as first-child / next-sibling links; outputs are ``predicts`` (the token chosen after each
  flat node slot), ``accept_index`` (flat slots of the accepted path, root first, -1 padded) and
  ``accept_length``.
* FlashInfer (``chain_speculative_sampling``): target and draft *probabilities*, padded chains,
  ``output_token_ids`` with -1 padding and the number of emitted draft tokens.
"""

from __future__ import annotations

import torch

import specdec_kernels as sk

# --------------------------------------------------------------------------------------------
# vLLM


def vllm_cu_to_offsets(cu_num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """vLLM keeps the *ends* of each request's drafts ([B], no leading 0); we take offsets [B+1]."""
    return torch.cat([cu_num_draft_tokens.new_zeros(1), cu_num_draft_tokens])


def vllm_rejection_sample(
    logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's step: ``output_token_ids [B, max_spec_len + 1]`` int32 (-1 = placeholder) and
    ``num_sampled [B]``.

    logits:          [N + B, V] the target's rows as vLLM computes them, before it splits them into
                     draft-position and bonus rows: request b's n_b draft positions, then its bonus row.
    draft_token_ids: [N] int; cu_num_draft_tokens: [B] ends (vLLM's convention).
    draft_probs:     [N, V] (a model drafter) or None (n-gram / EAGLE greedy: one-hot q).
    temperature:     [B], 0 = greedy. vLLM divides logits by temperature itself before sampling; if
                     yours already are, pass ``logits_scaled=True`` to sk.verify instead.
    """
    out = sk.verify(
        logits,
        draft_token_ids,
        draft_probs=draft_probs,
        cu_num_draft_tokens=vllm_cu_to_offsets(cu_num_draft_tokens),
        max_num_draft_tokens=max_spec_len,
        temperature=temperature,
        seed=seeds,
        validate=False,
        out_dtype=torch.int32,
    )
    return out.tokens, out.num_accepted + 1


# --------------------------------------------------------------------------------------------
# SGLang


def parents_from_links(first_child: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """Parent links for ``sk.verify_tree`` from first-child / next-sibling links.

    first_child, next_sibling: [B, n] int, -1 = none; node 0 is the root (the last verified token,
    not a draft). Returns parents [B, n - 1] for the n - 1 draft nodes (node i -> our node i - 1):
    -1 for children of the root, else the parent's index in our numbering. Nodes must be numbered
    so that a parent comes before its children (EAGLE's trees are). Runs on the host: trees are tiny.
    """
    B, n = first_child.shape
    fc, ns = first_child.tolist(), next_sibling.tolist()
    parents = torch.full((B, n - 1), -1, dtype=torch.int64)
    for b in range(B):
        stack = [0]
        while stack:
            node = stack.pop()
            child = fc[b][node]
            while child != -1:
                parents[b, child - 1] = node - 1  # the root (0) becomes -1
                stack.append(child)
                child = ns[b][child]
    return parents.to(first_child.device)


def sglang_verify_tree(
    target_probs: torch.Tensor,
    candidates: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    temperature: float | torch.Tensor = 1.0,
    seed: int | torch.Tensor | None = None,
    method: str = "rrs",
):
    """SGLang-style tree verification: ``(predicts [B*n], accept_index [B, D+1], accept_length [B])``.

    target_probs: [B, n, V] the target's distribution after each node (row 0: after the root).
    candidates:   [B, n] tokens, candidates[:, 0] = the root's (already verified) token.
    draft_probs:  [B, n - 1, V] the distribution each draft node was sampled from, or None (one-hot:
                  EAGLE's deterministic top-k trees).
    accept_index[b, t] is the flat slot ``b * n + node`` of the t-th node of the accepted path (the
    root first), -1 padded; predicts[slot] is the token emitted after that node (the next accepted
    draft, or the recovered / bonus token after the last); accept_length[b] = accepted drafts.
    """
    B, n, _ = target_probs.shape
    parents = parents_from_links(first_child, next_sibling)
    out = sk.verify_tree(
        None if target_probs is None else torch.log(target_probs),
        candidates[:, 1:],
        parents,
        draft_probs=draft_probs,
        temperature=temperature,
        seed=seed,
        method=method,
    )
    D = out.accepted_nodes.shape[1]
    steps = torch.arange(D + 1, device=target_probs.device)
    path = torch.cat([torch.zeros_like(out.accepted_nodes[:, :1]), out.accepted_nodes + 1], dim=1)  # root first
    on_path = steps[None, :] <= out.num_accepted[:, None].long()
    base = (torch.arange(B, device=target_probs.device) * n)[:, None]
    accept_index = torch.where(on_path, base + path, torch.full_like(path, -1))
    predicts = torch.zeros(B * n, dtype=torch.int64, device=target_probs.device)
    predicts[accept_index[on_path]] = out.tokens[on_path]
    return predicts, accept_index, out.num_accepted


# --------------------------------------------------------------------------------------------
# FlashInfer


def flashinfer_chain_speculative_sampling(
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    seed: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's chain sampling contract: ``output_token_ids [B, G+1]`` int32 (-1 padded) and the
    number of emitted draft tokens [B].

    draft_probs [B, G, V], draft_token_ids [B, G], target_probs [B, G+1, V]: probabilities as
    given (already processed by the caller), so temperature is 1 and no filter is applied here.
    (FlashInfer also counts drafts that *would* have been accepted after the first rejection, an
    acceptance statistic; it is not part of the sampled output and is not computed here.)
    """
    out = sk.verify(
        None,
        draft_token_ids,
        draft_probs=draft_probs,
        target_probs=target_probs,
        temperature=1.0,
        seed=seed,
        out_dtype=torch.int32,
    )
    return out.tokens, out.num_accepted


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    V = 100

    # vLLM: 3 requests with 2, 0 and 3 drafts, flattened.
    ends = torch.tensor([2, 2, 5])
    logits = torch.randn(5 + 3, V, generator=gen).to(device)
    drafts = torch.randint(0, V, (5,), generator=gen).to(device)
    probs = torch.softmax(torch.randn(5, V, generator=gen), -1).to(device)
    out_ids, num_sampled = vllm_rejection_sample(
        logits, drafts, ends.to(device), 3, probs, torch.tensor([0.0, 0.8, 1.0], device=device), torch.arange(3)
    )
    print("vLLM output_token_ids:", out_ids.tolist(), "num_sampled:", num_sampled.tolist())

    # SGLang: root 0 with children 1, 2; node 1 with child 3.
    first_child = torch.tensor([[1, 3, -1, -1]])
    next_sibling = torch.tensor([[-1, 2, -1, -1]])
    print("parents from links:", parents_from_links(first_child, next_sibling).tolist())
    target = torch.softmax(torch.randn(1, 4, V, generator=gen), -1).to(device)
    cands = torch.tensor([[7, 11, 12, 13]], device=device)
    predicts, accept_index, accept_length = sglang_verify_tree(
        target, cands, first_child.to(device), next_sibling.to(device), temperature=0.0
    )
    print("SGLang accept_index:", accept_index.tolist(), "accept_length:", accept_length.tolist())

    # FlashInfer: 2 chains of 3 drafts.
    q = torch.softmax(torch.randn(2, 3, V, generator=gen), -1).to(device)
    p = torch.softmax(torch.randn(2, 4, V, generator=gen), -1).to(device)
    ids = torch.multinomial(q.reshape(-1, V).cpu(), 1, generator=gen).reshape(2, 3).to(device)
    tokens, emitted = flashinfer_chain_speculative_sampling(q, ids, p, seed=5)
    print("FlashInfer output_token_ids:", tokens.tolist(), "emitted drafts:", emitted.tolist())
