"""Reference logprobs of the emitted tokens: the specification of ``return_logprobs=True`` /
``num_logprobs=n`` (``ops/logprobs.py`` computes the same in batch).

For every emitted position: take the target row that scored it, make a disallowed token -inf
(``allowed``, optional), process the row (temperature, then top-k, then top-p with the call's tie
rule: ``kept_entries``), and take ``log_softmax`` of the kept logits divided by the temperature
(-inf elsewhere). Greedy requests use temperature 1. logprobs[b, d] is that at the emitted token
(NaN where tokens == -1, or the row has no finite logit); the top-n are the n largest values,
ties by lower index (a stable sort), -1 / NaN past the kept entries.
"""

from __future__ import annotations

import torch

from .._params import MIN_TEMPERATURE
from .sampling import kept_entries, sanitize_logits
from .verify_tree import _Tree


def processed_log_probs(row, temperature: float, top_k: int, top_p: float, ties: str = "keep", allowed=None):
    """float64 log-probabilities [V] of one raw target row after processing (greedy: temperature 1)."""
    x, _ = sanitize_logits(row)
    if allowed is not None:
        x = torch.where(allowed.cpu(), x, torch.full_like(x, float("-inf")))
    t = temperature if temperature >= MIN_TEMPERATURE else 1.0
    kept = kept_entries(x, t, top_k, top_p, ties)
    y = torch.where(kept, x.double() / t, torch.full(x.shape, float("-inf"), dtype=torch.float64))
    return torch.log_softmax(y, 0)  # NaN everywhere when nothing is kept


def chain_rows(args, tokens) -> list[list]:
    """Per request, the target rows (as index tuples into args.target_logits) of its emitted tokens."""
    out = []
    for b in range(tokens.shape[0]):
        emitted = int((tokens[b] >= 0).sum())
        if args.cu is None:
            out.append([(b, d) for d in range(emitted)])
        else:
            start = int(args.cu[b]) + b
            out.append([(start + d,) for d in range(emitted)])
    return out


def tree_rows(args, tokens, num_accepted) -> list[list]:
    """Per request, the target rows (index tuples into args.target) the walk scored its tokens with:
    the root row, then the row of the first node spelling the accepted prefix at each depth."""
    out = []
    parents = args.parents_cpu()
    counts = args.per_request_cpu()["num_nodes"]
    node_tokens = args.tokens.cpu().reshape(args.B, args.N)
    for b in range(args.B):
        tree = _Tree(None, None, node_tokens[b], parents[b], int(counts[b]), args.G)
        current, rows = None, [(b, 0, 0)]
        for d in range(int(num_accepted[b])):
            current = [c for c in tree.children_of(current) if int(node_tokens[b, c]) == int(tokens[b, d])]
            rows.append((b, current[0] // args.G, current[0] % args.G + 1))
        out.append(rows)
    return out


def logprobs_reference(args, target, tokens, rows, num_logprobs: int = 0, allowed=None) -> dict:
    """{"logprobs": [B, D+1] float32, and with num_logprobs: "top_logprob_ids" [B, D+1, n] int64,
    "top_logprobs" [B, D+1, n] float32}. rows: ``chain_rows`` / ``tree_rows``; target: the tensor
    they index (args.target_logits or args.target); allowed: an optional bool mask shaped like it."""
    tokens = tokens.cpu()
    B, D1 = tokens.shape
    params = args.sampling.per_request_cpu(B)
    logprobs = torch.full((B, D1), float("nan"), dtype=torch.float32)
    ids = torch.full((B, D1, num_logprobs), -1, dtype=torch.int64)
    top = torch.full((B, D1, num_logprobs), float("nan"), dtype=torch.float32)
    for b in range(B):
        setting = (float(params["temperature"][b]), int(params["top_k"][b]), float(params["top_p"][b]))
        for d, index in enumerate(rows[b]):
            mask = allowed[index] if allowed is not None else None
            lp = processed_log_probs(target[index].cpu(), *setting, args.sampling.top_p_ties, mask)
            logprobs[b, d] = lp[int(tokens[b, d])]
            values, order = torch.sort(lp, descending=True, stable=True)
            n = min(num_logprobs, int((values > float("-inf")).sum()))  # NaN rows: none
            ids[b, d, :n] = order[:n]
            top[b, d, :n] = values[:n].float()
    out = {"logprobs": logprobs.to(tokens.device)}
    if num_logprobs > 0:
        out.update(top_logprob_ids=ids, top_logprobs=top)
    return out
