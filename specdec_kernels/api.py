"""The public verification functions: ``sk.verify``, ``sk.verify_tree``, ``sk.verify_multi``.

Each checks its arguments (``_validation`` / ``_tree_args``; errors name the argument) and hands the
checked arguments to the dispatch layer (``_dispatch``), which picks the backend. While
``torch.compile`` traces a caller, the call becomes one opaque ``torch.library`` custom op instead.

Parts of ``sk.verify``'s contract that its docstring refers to this module's docstring for:

Inputs engines already hold:
    target_probs:     instead of target_logits (pass None for it): fp32 | fp16 | bf16
                      probabilities, as FlashInfer's callers hold them. They are used as the
                      logits log(p) (one elementwise pass before the kernels), so temperature=1
                      samples from p as given, 0 is greedy, and top-k / top-p still apply. NaN,
                      +inf or negative entries flag the request, like non-finite logits.
    logits_scaled:    True when target_logits (and draft_logits) are already divided by the
                      temperature, as vLLM holds them: the kernels then scale by 1, and
                      ``temperature`` only tells greedy (0) from sampled (> 0) requests.
                      top-p masses are computed on the logits as given.

out_dtype: torch.int64 (default) or torch.int32 for ``tokens`` (and ``accepted_nodes`` of the tree
    ops), as vLLM / SGLang / FlashInfer hold ids. Engine conventions: vLLM's num_sampled =
    num_accepted + 1 (tokens[b, :num_accepted + 1] are the output ids); SGLang's accept_index is
    ``accepted_nodes`` (verify_tree) and its predicts the emitted tokens; FlashInfer's
    chain_speculative_sampling output = ``tokens`` with -1 padding.

Vocabulary parallel (the LM head sharded over the vocabulary, as tensor-parallel engines hold it):
    process_group:    a torch.distributed process group (NCCL on GPU, gloo on CPU). Each rank passes
                      its contiguous vocabulary shard in rank order (sizes may differ): target_logits
                      [B, G+1, V_r] and draft_logits / draft_probs [B, G, V_r] (or target_probs).
                      draft_tokens (global ids in [0, V)), num_draft_tokens, temperature, top_k,
                      top_p and seed are the same on every rank; seed=None uses rank 0's draw.
                      Every rank returns the tokens, num_accepted and nonfinite of the unsharded
                      call with the same seed (float sums run in another order across shards:
                      equal except at measure-zero ties). backend: "auto" or "torch" (a
                      vectorised PyTorch shard implementation, any device; it synchronises
                      with the host, so it cannot be captured in a CUDA graph).
    vocab_size:       V; checked against the sum of the shard sizes, which one tiny all-gather
                      always exchanges (it also makes an argument error raise on every rank
                      instead of leaving the others waiting in a collective).
    Math: instead of all-gathering B (G+1) V logits, ranks exchange O(B (G+1)) numbers per
    collective: per row the max and first argmax (all-gather of per-rank pairs); the softmax
    normaliser with the owner's w(x_i) folded in (all-reduce: p(x_i) = w(x_i) / Z as unsharded);
    the exact top-k / top-p thresholds (top-k <= 256: one all-gather of every rank's k largest
    values, on which top-p is computed as unsharded; else radix select over the 32-bit order
    keys of the logits, 4 all-reduces of [rows, 256] histograms: counts for top-k, softmax mass
    for top-p; ties kept as the reference keeps them); and the race winner at the emitting row:
    the race key of entry x uses Philox(seed; x // 4, row, purpose) with the global index x, so
    each shard draws the unsharded call's numbers, and the winner is the (max key, lowest index)
    over ranks (all-gather). NaN logits in one rank's shard flag the request on every rank.
    method="block" too: the weights w_i from the drafts' (replicated) p and q, the residual masses
    r_i as shard sums plus one all-reduce (the positions that can stop, all requests together),
    then the race of row tau; ranks must pass the same method.
    Example (rank r of w ranks, an even split):
        >>> lo, hi = r * V // w, (r + 1) * V // w
        >>> out = sk.verify(target_logits[..., lo:hi], draft_tokens, draft_logits[..., lo:hi],
        ...                 temperature=0.8, seed=seeds, process_group=dist.group.WORLD)

Non-finite inputs and placeholders:
    Non-finite logits: NaN and +inf are treated as -inf (never accepted or sampled) and the
    request is flagged in ``nonfinite``; a row with no finite logit emits token 0, flagged.
    Unusable draft probabilities: a NaN, +inf or negative (-inf included) entry of draft_probs is
    no probability; it counts as q(x) = 0 in the accept test and in the residual max(p - q, 0)
    (so a draft whose own q(x) is unusable is accepted whenever p(x) > 0), and the request is
    flagged. Flags follow the rows a request uses, as for non-finite draft logits: draft rows
    0 .. j (up to its first rejection) of sampled requests; greedy requests never read q.
    Every backend applies this rule and returns the same tokens.
    With validate=False a draft id outside [0, V) (an engine's -1 padding) is a placeholder: the
    request's draft ends there and that position draws the bonus token from p (nothing masked, not
    flagged), as ``verify_multi`` / ``verify_tree`` do for a node without valid children.
Grammar masks (token_bitmask=):
    int32 words [B, G+1, ceil(V/32)] ([N + B, W] flattened; any strides), bit j of word w set =
    token 32w + j allowed (xgrammar's / llguidance's layout). A disallowed logit is -inf before
    temperature/top-k/top-p in target row i and in draft-logits row i (the draft sampled under the
    same grammar state); draft_probs are used as given (a disallowed draft has p = 0: rejected; the
    residual is 0 there), so the output law is the masked, processed target and no disallowed
    token is emitted. Greedy: argmax over the allowed tokens. A row allowing nothing is a row
    without a finite logit (token 0, flagged). Shards: each rank's words cover its own slice.
    Rules, exactness, cost: ``specdec_kernels._bitmask`` and docs/verify.md.

Logprobs (return_logprobs=True, num_logprobs=n with 0 <= n <= 20):
    also return ``logprobs`` [B, G+1] float32, log p(token) under the processed target
    distribution of its position (mask included; NaN where tokens == -1), and the top-n ids /
    logprobs [B, G+1, n] of that distribution; greedy requests are scored at temperature 1 with
    their top-k / top-p. A post-pass over the emitted rows (docs/verify.md), vocabulary shards
    included; under torch.compile it runs eagerly after a graph break.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from . import _dispatch
from ._tree_args import check_tree_args
from ._types import TreeVerifyOutput, VerifyOutput
from ._validation import (
    VerifyArgs,
    check_out_dtype,
    check_sharded_ties,
    check_verify_call,
    check_vocab_size_use,
)
from .ops.logprobs import chain_logprobs, logprobs_request, tree_logprobs


def verify(
    target_logits: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    draft_logits: torch.Tensor | None = None,
    *,
    draft_probs: torch.Tensor | None = None,
    target_probs: torch.Tensor | None = None,
    logits_scaled: bool = False,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    top_p_ties: str = "keep",
    num_draft_tokens: torch.Tensor | None = None,
    cu_num_draft_tokens: torch.Tensor | None = None,
    max_num_draft_tokens: int | None = None,
    seed: int | torch.Tensor | None = None,
    validate: bool = True,
    backend: str = "auto",
    out_dtype: torch.dtype = torch.int64,
    process_group=None,
    vocab_size: int | None = None,
    method: str = "token",
    return_logprobs: bool = False,
    num_logprobs: int = 0,
    token_bitmask: torch.Tensor | None = None,
) -> VerifyOutput:
    """Verify one draft chain per request; the emitted tokens are exactly target-distributed.

    Shapes and dtypes:
        target_logits:    [B, G+1, V] fp32 | fp16 | bf16 raw target logits; row i scores the token
                          after draft i-1 (row 0: after the committed prefix); row n_b is the bonus row.
        draft_tokens:     [B, G] int32 | int64.
        draft_logits:     [B, G, V] raw draft logits; q = the same processing as the target's.
        draft_probs:      [B, G, V] float, instead of draft_logits: the probabilities the draft
                          sampled from, used as given (unusable entries: see below). Neither:
                          one-hot q (n-gram drafters).
        temperature:      float or [B] tensor; 0 = greedy for that request.
        top_k:            int or [B] tensor; 0 = off. top_p: float or [B] tensor in (0, 1]; 1 = off.
        top_p_ties:       the tie group at the top-p boundary: "keep" (default: all of it stays) or
                          "by_index" (the higher token index counts as more probable: transformers'
                          TopPLogitsWarper; every backend but "cuda", which raises ValueError:
                          "auto" runs "triton" then on CUDA tensors; see ``specdec_kernels._params``).
        num_draft_tokens: [B] int; request b verifies drafts [0, n_b) and draws its bonus from row n_b.
        Zero sizes:       B = 0 returns empty outputs ([0, G+1], [0], [0]); G = 0 (or n_b = 0) means no
                          drafts: tokens[b, 0] is one bonus token drawn from row 0 (greedy: its argmax),
                          num_accepted 0.
        seed:             int (per-request seeds derived from (seed, b)) or [B] int64 tensor (results
                          independent of batch composition). Use a new seed for every call.
        validate:         check tensor values (ids in range, temperature >= 0, ...) on the host. Skipped
                          automatically during CUDA-graph capture; the kernels stay memory-safe either way.
        backend:          "auto" (default: on a GPU the fastest available backend, measured once per
                          shape class; on CPU tensors "cpu", or "vectorized" when the CPU build cannot
                          be compiled, said once with the reason), "triton" (fused Triton kernels),
                          "cuda" (the CUDA C++ kernels of csrc/; RuntimeError if no GPU or the
                          extension cannot be built), "cpu" (the csrc core compiled for the host,
                          OpenMP), "vectorized" (batched PyTorch tensor ops, no compiler needed) or
                          "torch" (the plain-PyTorch reference; loops, slow). All return the same
                          tokens for the same seed.

    Math (p = target, q = draft; processing = temperature, then top-k, then top-p, ties kept):
        accept x_i iff u_i * q_i(x_i) <= p_i(x_i) with u_i in (0, 1), in order; at the first rejection j
        emit y ~ norm(max(p_j - q_j, 0)) (one-hot q: p_j without x_j); if all n_b are accepted emit
        y ~ p_{n_b}. Greedy: accept while x_i == argmax(row i) (lowest index on ties); emit the argmax.
        Sampling uses the exponential race argmax_x log r(x) - log E_x, E_x ~ Exp(1).

    Non-finite logits, unusable draft probabilities, placeholder ids, inputs engines already hold
    (target_probs=, logits_scaled=): this module's docstring.

    Flattened ragged layout (vLLM / SGLang hold rows this way; read in place, no padding copy):
        cu_num_draft_tokens: [B+1] int32 | int64 offsets, cu[0] = 0: request b has the
                          n_b = cu[b+1] - cu[b] drafts draft_tokens[cu[b]:cu[b+1]]. Then
                          target_logits is [N + B, V] (rows cu[b] + b ... cu[b+1] + b: request b's
                          n_b draft positions, then its bonus row), draft_tokens [N], draft_logits /
                          draft_probs [N, V], and num_draft_tokens must be None.
        max_num_draft_tokens: G, the output width - 1; default max n_b (a host synchronisation:
                          pass it to stay sync-free, e.g. under CUDA graphs).
        The output is as for the padded call: tokens [B, G+1] (-1 padded), num_accepted [B]. The
        Triton kernels read the flattened rows in place; the cpu / cuda / torch backends gather a
        padded copy first.

    out_dtype: torch.int64 (default) or torch.int32 for ``tokens``; engine conventions: this module's docstring.

    method: "token" (the rule above) or "block" (Sun et al. 2024, ``reference/block.py``: exact, never
    fewer accepted drafts in expectation; backends cpu, cuda, triton, vectorized, torch, and auto = cpu
    on CPU tensors, triton on CUDA tensors; vocabulary shards too). Under it a sampled
    request is flagged by any of its rows 0 .. n_b (block verification reads them all).

    Vocabulary parallel (process_group=, vocab_size=), return_logprobs / num_logprobs, token_bitmask
    (grammar masks [B, G+1, ceil(V/32)] int32 words): this module's docstring.

    Returns VerifyOutput(tokens [B, G+1] int64 (or out_dtype), num_accepted [B] int32, nonfinite [B]
    bool; logprobs fields when asked for).

    Example:
        >>> out = sk.verify(target_logits, draft_tokens, draft_logits, temperature=0.7, seed=seeds)
        >>> n = out.num_accepted  # commit out.tokens[b, : n[b] + 1]
    """
    sharded = process_group is not None
    check_vocab_size_use(process_group, vocab_size)
    _dispatch.check_verify_method(method, backend, sharded)
    logprobs = logprobs_request(return_logprobs, num_logprobs)
    # A partial, not a closure over this function's arguments: a closure makes every one of them a
    # cell, which slowed each access of this hot function (~2 us a call, issue 28).
    checked = partial(
        _check_chain, backend, out_dtype, sharded, target_logits, draft_tokens, draft_logits, draft_probs,
        temperature, top_k, top_p, num_draft_tokens, seed, cu_num_draft_tokens, max_num_draft_tokens, target_probs,
        logits_scaled, validate, top_p_ties, token_bitmask,
    )  # fmt: skip
    if sharded:  # vocabulary shards: see ops/vocab_parallel/
        out = _dispatch.run_verify_sharded(checked, process_group, vocab_size, validate, logprobs, method)
    else:
        run = _dispatch.run_verify_block if method == "block" else _dispatch.run_verify
        out = _run_local(checked(), backend, run, _dispatch.call_verify_chain, chain_logprobs, logprobs)
    return out if out_dtype is torch.int64 else replace(out, tokens=out.tokens.to(out_dtype))


def _check_chain(
    backend, out_dtype, sharded, target_logits, draft_tokens, draft_logits, draft_probs, temperature, top_k, top_p,
    num_draft_tokens, seed, cu_num_draft_tokens, max_num_draft_tokens, target_probs, logits_scaled, validate,
    top_p_ties, token_bitmask,
) -> VerifyArgs:  # fmt: skip
    """sk.verify's checks after its options': the backend's name, out_dtype, then the tensors."""
    if sharded:
        _dispatch.check_sharded_backend(backend)
    else:
        _dispatch.check_backend(backend)
    check_out_dtype(out_dtype)
    return check_verify_call(
        target_logits, draft_tokens, draft_logits, draft_probs, temperature, top_k, top_p, num_draft_tokens, seed,
        cu_num_draft_tokens=cu_num_draft_tokens, max_num_draft_tokens=max_num_draft_tokens,
        target_probs=target_probs, logits_scaled=logits_scaled, validate=validate, top_p_ties=top_p_ties,
        sharded=sharded, token_bitmask=token_bitmask,
    )  # fmt: skip


def _run_local(args, backend: str, run, call, with_logprobs, logprobs: int | None):
    """One checked call on this process's tensors: ``run(args, backend, logprobs)`` (one opaque
    custom op while torch.compile traces), then the logprobs post-pass when asked for."""
    out = call(args, backend) if torch.compiler.is_compiling() else run(args, backend, logprobs)
    return out if logprobs is None else with_logprobs(args, out, logprobs)


def verify_tree(
    target_logits: torch.Tensor,
    tree_tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_logits: torch.Tensor | None = None,
    *,
    draft_probs: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    top_p_ties: str = "keep",
    seed: int | torch.Tensor | None = None,
    num_nodes: torch.Tensor | None = None,
    method: str = "kseq",
    max_depth: int | None = None,
    validate: bool = True,
    backend: str = "auto",
    out_dtype: torch.dtype = torch.int64,
    process_group=None,
    vocab_size: int | None = None,
    return_logprobs: bool = False,
    num_logprobs: int = 0,
    token_bitmask: torch.Tensor | None = None,
) -> TreeVerifyOutput:
    """Verify a token tree of drafts per request; the emitted tokens are exactly target-distributed.

    Shapes and dtypes:
        target_logits: [B, N+1, V] fp32 | fp16 | bf16: row 0 scores the token after the committed
                       prefix (the root), row i+1 the token after node i.
        tree_tokens:   [B, N] int: token of each node. parents: [B, N] int, -1 for children of the
                       root, else parents[b, i] < i (topological; N <= 64).
        draft_logits:  [B, N, V]: the draft distribution node i was sampled from (the one at its
                       parent; siblings share it - the first sibling's row is used). Or draft_probs
                       [B, N, V]; neither = one-hot drafts (deterministic top-k trees, EAGLE/Medusa).
                       Non-finite logits and unusable draft_probs entries (NaN, +inf, negative:
                       q = 0) are handled and flagged as in :func:`verify`; the draft rows a
                       request uses are those of the positions whose candidates it tests.
        temperature, top_k, top_p, top_p_ties, seed: as for :func:`verify`. num_nodes: [B] int, ragged trees.
                       Zero sizes: B = 0 gives empty outputs; a tree without nodes (N = 0, or
                       num_nodes[b] = 0) is one bonus token drawn from the root row 0 (greedy: its
                       argmax), num_accepted 0 - the token :func:`verify` emits with G = 0.
        method:        "kseq" (SpecTr K-SEQ), "rrs" (recursive rejection sampling), "rrs_wor"
                       (without replacement; siblings must be distinct).
        max_depth:     output width D; default: the deepest tree (found while validating, a host
                       sync) or N when validate=False. Pass it to stay sync-free (CUDA graphs).
        backend:       "auto" | "triton" | "cuda" | "cpu" | "vectorized" | "torch" (reference), as for
                       :func:`verify`.
        token_bitmask: grammar masks as for :func:`verify`, [B, N+1, ceil(V/32)] int32 words of the
                       target rows; node i's draft-logits row uses the mask of row parents[i] + 1
                       (the row at which it is a candidate; row 0 for the root's children).
        process_group, vocab_size: vocabulary shards, as for :func:`verify`: each rank passes
                       target_logits [B, N+1, V_r] and draft rows [B, N, V_r] of its contiguous shard;
                       tokens are global ids. The walk runs one depth per step with the per-row
                       collectives of :func:`verify`, plus the K-SEQ rho search (at most 3
                       all-reduces of 8 sums of min(rho q, p)) or, for RRS, one lookup and one sum
                       per candidate.
        return_logprobs, num_logprobs: as for :func:`verify`, for the accepted path and the emitted
                       token; position d is scored by the row the walk used there (docs/verify.md).

    Math: walk from the root; at each position the children are samples from the draft's q there;
    K-SEQ accepts child X_i (first in order) w.p. min(1, p(X_i) / (rho* q(X_i))) with rho* solving
    1 - (1 - beta)^k = rho beta, beta = sum_x min(q, p / rho), and otherwise draws from
    norm(p - c min(q, p/rho*)); RRS tests children with min(1, p_j / q) and renormalises
    max(p_j - q, 0) after each rejection. At a leaf the bonus token is drawn from p. Greedy follows
    the child equal to argmax p. Siblings with equal tokens act as one position with multiplicity.
    The full specification is ``specdec_kernels.reference.verify_tree``.

    Returns:
        TreeVerifyOutput(tokens [B, D+1], num_accepted [B], accepted_nodes [B, D], nonfinite [B]).

    Example:
        >>> out = sk.verify_tree(logits, tokens, parents, draft_logits, temperature=0.8, seed=seeds)
        >>> keep = out.accepted_nodes[b, : out.num_accepted[b]]  # KV rows to keep, in order
    """
    tree = (target_logits, tree_tokens, parents, draft_logits, draft_probs, temperature, top_k, top_p, seed)
    options = dict(out_dtype=out_dtype, process_group=process_group, vocab_size=vocab_size, top_p_ties=top_p_ties)
    options.update(return_logprobs=return_logprobs, num_logprobs=num_logprobs, token_bitmask=token_bitmask)
    return _run_tree(backend, *tree, num_nodes, method, max_depth, validate=validate, **options)


def verify_multi(  # verify_tree's options less the tree's (parents, num_nodes, max_depth): one line a group
    target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_logits: torch.Tensor | None = None, *,
    draft_probs: torch.Tensor | None = None, temperature: float | torch.Tensor = 1.0, top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0, top_p_ties: str = "keep", seed: int | torch.Tensor | None = None,
    method: str = "kseq", validate: bool = True, backend: str = "auto", out_dtype: torch.dtype = torch.int64,
    process_group=None, vocab_size: int | None = None, return_logprobs: bool = False, num_logprobs: int = 0,
    token_bitmask: torch.Tensor | None = None,
) -> TreeVerifyOutput:  # fmt: skip
    """Verify K independent draft chains per request (SpecTr multi-draft).

    Shapes: target_logits [B, K, G+1, V] (row [k, i] scores the token after chain k's first i
    drafts; row [0, 0] is used for the shared root), draft_tokens [B, K, G], draft_logits or
    draft_probs [B, K, G, V]. The chains are verified as one tree in which chains sharing a
    prefix are merged with multiplicity: at each depth the candidates are the next drafts of every
    chain that agrees with the accepted prefix. Options (backend included) as :func:`verify_tree`.
    With K = 1 this is exactly :func:`verify` (same tokens for the same seeds). accepted_nodes
    index chain * G + slot. return_logprobs / num_logprobs: as :func:`verify_tree`.

    Zero sizes: B = 0 gives empty outputs. G = 0 (chains without drafts: target_logits
    [B, K, 1, V], draft_tokens [B, K, 0]) is one bonus token per request drawn from the root row
    [b, 0, 0] (greedy: its argmax), num_accepted 0, accepted_nodes [B, 0] - as :func:`verify` with
    G = 0. K = 0 is a ValueError: without a chain there is no root row to draw that token from
    (pass K >= 1 chains of G = 0 drafts for "no drafts").

    token_bitmask: grammar masks as for :func:`verify`, [B, K, G+1, ceil(V/32)] int32 words; draft
    row [k, i] uses mask row [k, i].

    Vocabulary parallel: ``process_group=`` (and ``vocab_size=``) as for :func:`verify`: each rank
    passes target_logits [B, K, G+1, V_r] and draft_logits / draft_probs [B, K, G, V_r] of its
    contiguous shard; draft ids are global; every rank returns the unsharded call's output.

    Example:
        >>> out = sk.verify_multi(logits, drafts, draft_logits, method="kseq", seed=seeds)
        >>> out = sk.verify_multi(logits[..., lo:hi], drafts, draft_logits[..., lo:hi], seed=seeds,
        ...                       process_group=dist.group.WORLD)  # this rank's shard [lo, hi)
    """
    # chains: no parents (implicit), num_nodes or max_depth
    chains = (target_logits, draft_tokens, None, draft_logits, draft_probs, temperature, top_k, top_p, seed)
    options = dict(out_dtype=out_dtype, process_group=process_group, vocab_size=vocab_size, top_p_ties=top_p_ties)
    options.update(return_logprobs=return_logprobs, num_logprobs=num_logprobs, token_bitmask=token_bitmask)
    return _run_tree(backend, *chains, None, method, None, validate=validate, multi=True, **options)


def _run_tree(
    backend,
    *tree_args,
    validate: bool,
    multi: bool = False,
    out_dtype=torch.int64,
    process_group=None,
    vocab_size=None,
    top_p_ties="keep",
    return_logprobs=False,
    num_logprobs=0,
    token_bitmask=None,
) -> TreeVerifyOutput:
    """verify_tree and verify_multi: one check (``check_tree_args``), one dispatch."""
    check_vocab_size_use(process_group, vocab_size)
    logprobs = logprobs_request(return_logprobs, num_logprobs)
    if process_group is not None:  # vocabulary shards: see ops/vocab_parallel/

        def checked():
            _dispatch.check_sharded_backend(backend)
            check_out_dtype(out_dtype)
            args = check_tree_args(
                *tree_args, validate=False, multi=multi, top_p_ties=top_p_ties, token_bitmask=token_bitmask
            )
            check_sharded_ties(args)
            return args, tree_args[-1] is None and not multi  # max_depth not given: the deepest tree

        out = _dispatch.run_tree_sharded(checked, process_group, vocab_size, validate, multi, logprobs)
    else:
        backend = _dispatch.check_backend(backend)
        check_out_dtype(out_dtype)
        args = check_tree_args(
            *tree_args, validate=validate, multi=multi, top_p_ties=top_p_ties, token_bitmask=token_bitmask
        )
        out = _run_local(args, backend, _dispatch.run_tree, _dispatch.call_verify_tree, tree_logprobs, logprobs)
    if out_dtype == torch.int64:
        return out
    return replace(out, tokens=out.tokens.to(out_dtype), accepted_nodes=out.accepted_nodes.to(out_dtype))
