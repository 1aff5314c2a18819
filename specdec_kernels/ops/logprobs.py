"""Log-probabilities of the emitted tokens (``return_logprobs=True`` / ``num_logprobs=n``).

A post-pass after any backend: it gathers only the target rows of the emitted positions and
processes them once with the vectorized backend's row statistics (``ops/vectorized/chain.py``:
sanitise, top-k / top-p thresholds with the call's tie rule, normaliser), so the fused kernels are
not changed and every backend (and layout) gets the same numbers. Cost: one gather of at most
B (G+1) rows and one processing pass over them; ``num_logprobs`` adds one ``torch.topk`` per row
(no sort of the vocabulary). The specification is ``reference/logprobs.py``. On vocabulary
shards the same post-pass runs with the shards' scorer (``ops/vocab_parallel/logprobs.py``).
Exception (native logprobs, ``return_logprobs`` without top-n): these backends write the logprobs
themselves from the row statistics their pass already has, and this post-pass returns at once:
the csrc builds, CPU (backend="cpu", also "auto" on CPU tensors when it picks the build) and CUDA
(backend="cuda", except top_p_ties="by_index", which it leaves to this post-pass), for chains and
for trees and verify_multi (the accepted path: ``csrc/verify_logprobs.h``'s chain and tree
programs), the Triton chain kernels (backend="triton", and
"auto" on CUDA when it picks Triton; padded and flattened layouts: ``ops/triton/chain.py``'s
``_emitted_logprobs``) and the Triton tree kernels for verify_tree and verify_multi (every method,
one-hot candidates included; ragged trees; the walk scores the accepted tokens and greedy requests'
last one with the record of the row it used there, the race's merge the raced token:
``ops/triton/tree/walk.py``'s ``_walk_logprobs``). Every other backend (the vectorized and
reference backends), ``num_logprobs > 0``, vocabulary shards and torch.compile
graphs (one custom-op node) run this post-pass.

The value at an emitted token x of row r: log p_r(x) = (x_r - max_r) / T - log Z_r on the entries
temperature, top-k and top-p keep (-inf elsewhere), computed in float64 (the Triton kernels: from
their float32 records, within 1e-5) and returned as float32.
Greedy requests (temperature 0) are scored at temperature 1 with their top-k / top-p: the
log_softmax an engine reports for a greedy request. NaN where no token was emitted (tokens == -1)
and for a row without a finite logit (flagged in ``nonfinite``).

Rows: chain position d of request b is target row (b, d) (flattened layout: cu[b] + b + d). In a
tree the token at depth d is scored by the row the walk used there: the root row for d = 0, then
the row of the first node (lowest index) of the set spelling the accepted prefix - the accepted
node's row when siblings carry distinct tokens (``reference/verify_tree.py``'s walk).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .._bitmask import masked_rows
from .._params import MIN_TEMPERATURE
from .._tree_args import TreeArgs
from .._types import TreeVerifyOutput, VerifyOutput
from .._validation import VerifyArgs, _capturing
from .vectorized.chain import _kept_at, _row_stats, sanitize

# At most this many top logprobs per position: the OpenAI API's top_logprobs limit, which vLLM and
# SGLang follow; it also bounds the topk width (the selection stays a small partial one).
MAX_NUM_LOGPROBS = 20


def logprobs_request(return_logprobs, num_logprobs) -> int | None:
    """None (no logprobs) or the number of top logprobs asked for; TypeError / ValueError naming
    the bad option."""
    if not isinstance(return_logprobs, bool):
        raise TypeError(f"return_logprobs must be a bool, got {return_logprobs!r}")
    if isinstance(num_logprobs, bool) or not isinstance(num_logprobs, int):
        raise TypeError(f"num_logprobs must be an int in [0, {MAX_NUM_LOGPROBS}], got {num_logprobs!r}")
    if not 0 <= num_logprobs <= MAX_NUM_LOGPROBS:
        raise ValueError(f"num_logprobs must be in [0, {MAX_NUM_LOGPROBS}], got {num_logprobs}")
    if num_logprobs and not return_logprobs:
        raise ValueError(f"num_logprobs={num_logprobs} needs return_logprobs=True")
    return num_logprobs if return_logprobs else None


def _emitted(tokens: Tensor) -> tuple[Tensor, Tensor]:
    """(b, d) of the emitted positions (tokens != -1) of a [B, D+1] token tensor (the post-pass's
    first step and first host synchronisation)."""
    if _capturing(tokens.device):
        raise ValueError("return_logprobs synchronises with the host: it cannot be captured in a CUDA graph")
    b, d = (tokens >= 0).nonzero(as_tuple=True)
    return b, d


@torch.compiler.disable  # inside torch.compile: a graph break, the post-pass runs eagerly
def chain_logprobs(args: VerifyArgs, out: VerifyOutput, num_logprobs: int, score=None):
    """``out`` with logprobs (and the top ``num_logprobs``) of its emitted tokens, under the call's
    grammar mask if any (``args.token_bitmask``). score: ``emitted_logprobs`` (default) or the
    vocabulary shards' scorer (``ops/vocab_parallel/logprobs.py``). A backend that computed
    the logprobs itself (the CPU build, ``num_logprobs=0``) leaves nothing to do."""
    if num_logprobs == 0 and out.logprobs is not None and score is None:
        return out
    b, d = _emitted(out.tokens)
    if args.cu is None:
        index = (b, d)
    else:
        index = (args.cu[b] + b + d,)
    fields = _fill(args, out.tokens, index, b, d, num_logprobs, args.target_logits, score)
    return replace(out, **fields)


@torch.compiler.disable  # inside torch.compile: a graph break, the post-pass runs eagerly
def tree_logprobs(args: TreeArgs, out: TreeVerifyOutput, num_logprobs: int, score=None):
    """``out`` with logprobs of the accepted path's tokens and the emitted one; mask and score as
    for :func:`chain_logprobs` (the CPU build's and the Triton kernels' native logprobs: nothing to do)."""
    if num_logprobs == 0 and out.logprobs is not None and score is None:
        return out
    b, d = _emitted(out.tokens)
    k_row, s_row = walk_rows(args, out.tokens, out.num_accepted)
    index = (b, k_row[b, d], s_row[b, d])
    fields = _fill(args, out.tokens, index, b, d, num_logprobs, args.target, score)
    return replace(out, **fields)


def walk_rows(args: TreeArgs, tokens: Tensor, num_accepted: Tensor) -> tuple[Tensor, Tensor]:
    """[B, D+1] (chain, slot) target row the walk scored each output column with: [0, 0] (the root)
    for column 0, then the row of the first node of the set S_d of nodes spelling the accepted
    prefix (the candidates - children of S_{d-1} - whose token is the d-th accepted token)."""
    B, N, G, dev = args.B, args.N, args.G, args.target.device
    D1 = tokens.shape[1]
    k_row = torch.zeros((B, D1), dtype=torch.int64, device=dev)
    s_row = torch.zeros((B, D1), dtype=torch.int64, device=dev)
    deepest = int(num_accepted.max()) if B > 0 else 0
    if deepest == 0:
        return k_row, s_row
    node = torch.arange(N, device=dev)
    if args.parents is not None:
        parents = args.parents.to(torch.int64)
    else:  # chains: node i's parent is i - 1 within its chain, the root at each chain's first slot
        parents = torch.where(node % G == 0, -1, node - 1).expand(B, N)
    counts = args.num_nodes if args.num_nodes is not None else torch.full((B,), N, device=dev)
    live = node[None, :] < counts.to(dev)[:, None]
    node_tokens = args.tokens.reshape(B, N)
    S = None  # the root
    for depth in range(1, deepest + 1):
        if S is None:
            children = parents == -1
        else:
            children = (parents >= 0) & S.gather(1, parents.clamp(0, N - 1))  # padding nodes: any junk
        S = children & live & (node_tokens == tokens[:, depth - 1 : depth])
        first = S.to(torch.int8).argmax(1)  # the first True (0 where S is empty: never read)
        k_row[:, depth] = first // G
        s_row[:, depth] = first % G + 1
    return k_row, s_row


def _fill(args, tokens: Tensor, index: tuple, b: Tensor, d: Tensor, num_logprobs: int, target, score) -> dict:
    """The output fields: logprobs (and the top-n) scattered to the emitted positions (b, d) of
    ``tokens``; ``index`` selects their rows of ``target``."""
    B, D1, dev = tokens.shape[0], tokens.shape[1], tokens.device
    logprobs = torch.full((B, D1), float("nan"), dtype=torch.float32, device=dev)
    fields = {"logprobs": logprobs}
    if num_logprobs > 0:
        fields["top_logprob_ids"] = torch.full((B, D1, num_logprobs), -1, dtype=torch.int64, device=dev)
        fields["top_logprobs"] = torch.full((B, D1, num_logprobs), float("nan"), dtype=torch.float32, device=dev)
    if b.numel() == 0:  # nothing emitted (B = 0); replicated, so vocabulary shards all skip together
        return fields
    rows = target[index]  # [M, V]: only the emitted positions' rows
    if args.token_bitmask is not None:  # the call's grammar words (this rank's slice on shards)
        rows = masked_rows(rows, args.token_bitmask[index])
    sampling = args.sampling
    # float32 first, as every backend reads the parameters (top-p's boundary depends on the rounding)
    params = {k: v.to(dev)[b] for k, v in sampling.per_request_cpu(B).items()}
    t = params["temperature"].double()
    t = torch.where(t >= MIN_TEMPERATURE, t, 1.0)  # greedy: scored at temperature 1
    top_k, top_p = params["top_k"], params["top_p"].double()
    by_index = sampling.top_p_ties == "by_index"  # also for greedy rows: their top-p is active here
    score = score or emitted_logprobs
    lp, ids, top = score(rows, tokens[b, d], t, top_k, top_p, args.has_filter, by_index, num_logprobs)
    logprobs[b, d] = lp
    if num_logprobs > 0:
        fields["top_logprob_ids"][b, d] = ids
        fields["top_logprobs"][b, d] = top
    return fields


def emitted_logprobs(
    rows: Tensor, tok: Tensor, t: Tensor, top_k: Tensor, top_p: Tensor, filtered: bool, by_index: bool, n: int
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(log p(tok) [M] float32, top-n ids [M, n] int64, top-n logprobs [M, n] float32 (None when
    n = 0)) of raw rows [M, V] processed with per-row temperature t (float64, > 0), top_k, top_p."""
    M, V = rows.shape
    x, _, m, _ = sanitize(rows)
    empty = m == float("-inf")  # nothing finite: no distribution (NaN)
    m = m.masked_fill(empty, 0.0)
    thr, z, cut = _row_stats(x, m, t, top_k, top_p, filtered, by_index)
    log_z = torch.log(z)
    x_tok = x.gather(1, tok[:, None]).squeeze(1)
    lp = torch.where(_kept_at(x_tok, tok, thr, cut), (x_tok.double() - m) / t - log_z, float("-inf"))
    lp = lp.masked_fill(empty, float("nan")).float()
    if n == 0:
        return lp, None, None
    kept = _kept_at(x, torch.arange(V, device=x.device), thr[:, None], cut[:, None])
    vals, ids = top_n(x.masked_fill(~kept, float("-inf")), n)
    top = ((vals.double() - m[:, None]) / t[:, None] - log_z[:, None]).float()
    absent = (vals == float("-inf")) | empty[:, None]  # fewer than n tokens kept
    return lp, ids.masked_fill(absent, -1), top.masked_fill(absent, float("nan"))


def top_n(x: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """(values, ids) [M, n] of the n largest entries of each row of x [M, V], descending, ties by
    lower index (padding -inf / 0 past V): one ``torch.topk`` of width n + 1, whose choice among
    equal values at the n-th place is fixed up in the rows where a tie group straddles it."""
    M, V = x.shape
    k = min(n, V)
    vals, ids = torch.topk(x, min(n + 1, V), dim=-1)
    if k > 0:
        fix = torch.zeros(M, dtype=torch.bool, device=x.device)
        if vals.shape[1] > k:  # the (k+1)-th equals the k-th: topk may have seated any of the group
            fix = (vals[:, k] == vals[:, k - 1]) & (vals[:, k - 1] > float("-inf"))
        vals, ids = vals[:, :k], ids[:, :k]
        fix = fix.nonzero().squeeze(1)
        if fix.numel() > 0:  # seat the boundary tie group's lowest indices
            xf, kth = x[fix], vals[fix, k - 1 :]
            at = xf == kth
            need = k - (xf > kth).sum(-1, keepdim=True)
            take = (xf > kth) | (at & (at.cumsum(-1) <= need))
            ids[fix] = take.nonzero()[:, 1].reshape(-1, k)
        ids = ids.sort(-1).values  # ascending index, then a stable sort by value: ties by index
        vals, order = x.gather(1, ids).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(1, order)
    if k < n:
        vals = torch.cat([vals, vals.new_full((M, n - k), float("-inf"))], 1)
        ids = torch.cat([ids, ids.new_zeros((M, n - k))], 1)
    return vals, ids
