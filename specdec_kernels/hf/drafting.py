"""Drafting helpers: the draft's sampling distribution, K-chain sampling, prompt lookup, tree layouts."""

from __future__ import annotations

import torch

from .._params import MIN_TEMPERATURE


def draft_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """fp32 probabilities [..., V] the drafter samples from (temperature, then top-k, then top-p).

    The one definition of the draft's law: the driver samples its drafts from these probabilities
    and hands the verifier exactly them (``draft_probs``), so the output is exactly target-distributed
    whatever this processing is. It follows the verifier's own processing of the target (which
    maximises acceptance): logits minus the row maximum, times 1/T, so near-tied logits keep their
    spacing however small T is (x / T itself would round at the magnitude of x / T); a temperature
    below ``MIN_TEMPERATURE`` (0 included) is the greedy limit T -> 0, one-hot at the first argmax,
    as the kernels treat it.
    """
    x = logits.float()
    V = x.shape[-1]
    if not temperature >= MIN_TEMPERATURE:  # (NaN included, as in the kernels)
        return torch.nn.functional.one_hot(x.argmax(dim=-1), V).float()
    x = (x - x.amax(dim=-1, keepdim=True)) * (1.0 / temperature)
    if 0 < top_k < V:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_first_tokens(
    probs: torch.Tensor,
    logits: torch.Tensor,
    K: int,
    *,
    greedy: bool,
    distinct: bool,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """[B, K] first draft tokens of K chains from the root distribution [B, V].

    greedy: the K most likely tokens (distinct, so the chains differ). distinct: without replacement
    (what ``rrs_wor`` needs). Otherwise K independent samples (K-SEQ / RRS).
    """
    if greedy:
        return torch.topk(logits.float(), K, dim=-1).indices
    return torch.multinomial(probs, K, replacement=not distinct, generator=generator)


def sample_next_tokens(
    probs: torch.Tensor, logits: torch.Tensor, *, greedy: bool, generator: torch.Generator | None
) -> torch.Tensor:
    """[...] one token per row of [..., V]."""
    if greedy:
        return logits.float().argmax(dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def chains_tree_parents(K: int, G: int, device) -> torch.Tensor:
    """[1 + K*G] parents of the verification tree: node 0 is the root (the last committed token),
    node 1 + k*G + (t-1) is chain k's t-th draft; each chain hangs off the root."""
    parents = torch.empty(1 + K * G, dtype=torch.int64)
    parents[0] = -1
    for k in range(K):
        for t in range(1, G + 1):
            parents[1 + k * G + t - 1] = 0 if t == 1 else 1 + k * G + t - 2
    return parents.to(device)


def prompt_lookup(history: list[list[int]], G: int, max_ngram: int = 3, min_ngram: int = 1) -> list[list[int]]:
    """Draft up to G tokens per request by n-gram lookup in its own prompt + output.

    The longest suffix n-gram (max_ngram down to min_ngram) that occurred earlier proposes the tokens
    that followed its most recent earlier occurrence. No match: no drafts for that request.
    """
    drafts = []
    for seq in history:
        proposal: list[int] = []
        L = len(seq)
        for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
            suffix = seq[L - n :]
            for start in range(L - n - 1, -1, -1):  # most recent earlier occurrence first
                if seq[start : start + n] == suffix:
                    proposal = seq[start + n : start + n + G]
                    break
            if proposal:
                break
        drafts.append(proposal)
    return drafts
