"""Speculative decoding of Hugging Face causal LMs with the fused verification kernels.

One step, for the active requests of the batch:

1. Draft. ``drafter="model"``: K chains of G tokens from the draft model, one batched draft forward
   per depth (forward 0 feeds the uncached committed tokens, 1 or 2 per request; forward t feeds the
   K depth-t tokens), all through the tree-attention backend so the chains share the prompt's KV
   cache. ``drafter="prompt_lookup"``: n-gram lookup in each request's own tokens, no draft model.
2. Verify. The target scores the root (last committed token) and all K*G drafts in **one** forward
   (a chain for K = 1, K chains hanging off the root otherwise), then ``sk.verify`` /
   ``sk.verify_multi`` decides: accepted drafts plus one recovered-or-bonus token per request.
3. Commit. Each cache keeps exactly the committed tokens: the accepted root-to-node path is gathered
   into contiguous slots, everything else is dropped (``cache.commit_paths``). Requests that finish
   (EOS, max_new_tokens) leave the batch.

Invariant between steps: the target cache holds every committed token but the last; the draft cache
every committed token but the last u_b (u_b = 2 when all G drafts were accepted, since the draft never
fed its own last draft, else 1).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from .. import api as ops
from .._tree_args import MAX_NODES
from .attention import (
    TreeAttentionMetadata,
    tree_attention_context,
    tree_attention_metadata,
    using_tree_attention,
)
from .cache import cache_length, commit_paths, select_requests
from .drafting import (
    chains_tree_parents,
    draft_distribution,
    prompt_lookup,
    sample_first_tokens,
    sample_next_tokens,
)

METHODS = ("kseq", "rrs", "rrs_wor")
DRAFTERS = ("model", "prompt_lookup")
CACHE_IMPLEMENTATIONS = ("dynamic", "static")


@dataclass
class SpeculativeStats:
    """Counters of one ``speculative_generate`` call (per-request arrays indexed like the batch)."""

    num_draft_tokens: int
    num_drafts: int
    steps: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    proposed: int = 0  # draft tokens offered to the verifier, summed over requests and steps
    accepted: int = 0  # of which accepted
    request_steps: int = 0  # (request, step) pairs: each commits accepted + 1 tokens
    new_tokens: int = 0
    wall_time_s: float = 0.0
    accepted_length_histogram: torch.Tensor = field(default=None)  # [B, G+1]: steps with a accepted drafts

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per request per target forward (accepted drafts + 1)."""
        return (self.accepted + self.request_steps) / self.request_steps if self.request_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s else 0.0

    def table(self) -> str:
        rows = [
            ("new tokens", f"{self.new_tokens}"),
            ("wall time", f"{self.wall_time_s:.2f} s"),
            ("tokens/s", f"{self.tokens_per_s:.1f}"),
            ("target forwards", f"{self.target_forwards}"),
            ("draft forwards", f"{self.draft_forwards}"),
            ("acceptance rate", f"{self.acceptance_rate:.3f}"),
            ("mean accepted length", f"{self.mean_accepted_length:.2f} tokens/step"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


@dataclass
class SpeculativeOutput:
    sequences: torch.Tensor  # [B, T + new] int64: prompt (as given) + generated, pad_token_id after EOS
    stats: SpeculativeStats


@dataclass
class _Batch:
    """State of the active requests (position a <-> original request rows[a])."""

    rows: list[int]
    history: list[list[int]]  # committed tokens per original request (prompt + output)
    target_cached: torch.Tensor  # [A] int64: committed tokens in the target cache (= len - 1)
    draft_cached: torch.Tensor  # [A] int64: committed tokens in the draft cache (= len - uncached)
    uncached: torch.Tensor  # [A] int64: 1 or 2
    attention_backend: str = "auto"

    def keep(self, positions: list[int], caches) -> None:
        index = torch.tensor(positions, dtype=torch.long, device=self.target_cached.device)
        self.rows = [self.rows[p] for p in positions]
        self.target_cached = self.target_cached[index]
        self.draft_cached = self.draft_cached[index]
        self.uncached = self.uncached[index]
        for cache in caches:
            if cache is not None:
                select_requests(cache, index)


def speculative_generate(
    target,
    draft,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 128,
    num_draft_tokens: int = 4,
    num_drafts: int = 1,
    method: str = "kseq",
    drafter: str = "model",
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    streamer=None,
    vocab_size: int | None = None,
    attention_backend: str = "auto",
    cache_implementation: str = "dynamic",
    compile_target: bool | dict = False,
) -> SpeculativeOutput:
    """Generate with a draft model (or prompt lookup) and exact verification by the target.

    Args:
        target, draft: ``transformers`` causal LMs sharing a vocabulary; ``draft=None`` with
            ``drafter="prompt_lookup"``.
        input_ids:      [B, T] int64 prompts, left-padded when ragged (as for ``generate``).
        attention_mask: [B, T], 1 for real tokens.
        num_draft_tokens: G, drafts per chain and step. num_drafts: K chains (K > 1: a tree, verified
            with ``method`` "kseq" (SpecTr K-SEQ), "rrs" or "rrs_wor"). 1 + K*G <= 64.
        temperature, top_k, top_p: the target's sampling; temperature 0 = greedy (output identical to
            ``target.generate(do_sample=False)``). Sampled output is exactly target-distributed.
        seed: makes sampling reproducible. eos_token_id / pad_token_id: default from the target's
            generation config. streamer: a transformers streamer (batch size 1).
        vocab_size: real token count when the two models pad their embedding matrices differently
            (e.g. ``len(tokenizer)``); logits past it are dropped.
        attention_backend: tree attention in the verification/draft forwards: "auto" (Triton kernel on
            CUDA, PyTorch on CPU), "triton" or "torch".
        cache_implementation: "dynamic" (``DynamicCache``, grown and cropped every step) or "static"
            (``StaticCache`` of max prompt + ``max_new_tokens`` + K*G + 2 slots per request, allocated
            once; the committed path is moved in place and the buffers never change address).
        compile_target: ``torch.compile`` the target's verification forward as one graph
            (``fullgraph=True``; on CUDA ``mode="reduce-overhead"``, i.e. CUDA graphs). True for those
            defaults, or a dict of ``torch.compile`` keyword arguments. Needs
            ``cache_implementation="static"``. A new graph is captured per active batch size.

    Returns:
        ``SpeculativeOutput(sequences [B, T + new], stats)``.

    Example:
        >>> out = speculative_generate(target, draft, ids, mask, max_new_tokens=64, num_drafts=2, temperature=0.7)
        >>> print(out.stats.table())
    """
    G, K = int(num_draft_tokens), int(num_drafts)
    if cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"cache_implementation must be one of {CACHE_IMPLEMENTATIONS}, got {cache_implementation!r}")
    if compile_target and cache_implementation != "static":
        raise ValueError("compile_target needs cache_implementation='static' (fixed cache buffers)")
    V = _check_inputs(
        target,
        draft,
        input_ids,
        attention_mask,
        G,
        K,
        method,
        drafter,
        temperature,
        top_k,
        top_p,
        max_new_tokens,
        vocab_size,
        streamer,
    )
    device = input_ids.device
    B, T = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    prompts = [input_ids[b][mask[b].bool()].tolist() for b in range(B)]
    gen_cfg = getattr(target, "generation_config", None)
    eos = _as_set(eos_token_id if eos_token_id is not None else getattr(gen_cfg, "eos_token_id", None))
    pad = pad_token_id if pad_token_id is not None else getattr(gen_cfg, "pad_token_id", None)
    pad = pad if pad is not None else (min(eos) if eos else 0)
    generator = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
    stats = SpeculativeStats(G, K, accepted_length_histogram=torch.zeros(B, G + 1, dtype=torch.long))
    sampling = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
    use_draft = drafter == "model"

    if streamer is not None:
        streamer.put(input_ids.cpu())
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(using_tree_attention(target))
        if use_draft:
            stack.enter_context(using_tree_attention(draft))
        # Occupancy bound: committed (<= prompt + max_new) - 1 + the 1 + K*G tree (target), or
        # committed - u + u + (G-1)*K drafted (draft, u <= 2).
        static_len = max(len(p) for p in prompts) + max_new_tokens + K * G + 2
        session = _Session.start(
            target,
            draft if use_draft else None,
            prompts,
            device,
            G,
            K,
            V,
            method,
            sampling,
            generator,
            attention_backend,
            static_len if cache_implementation == "static" else None,
            _compiled_forward(target, compile_target, device),
        )
        batch = session.batch
        done = [max_new_tokens == 0] * B
        session.drop_finished(done)
        while batch.rows:
            results = session.step()
            stats.target_forwards += 1
            stats.draft_forwards += G if use_draft else 0
            stats.steps += 1
            for b, new, acc, offered in results:
                stats.proposed += offered
                stats.accepted += acc
                stats.request_steps += 1
                stats.accepted_length_histogram[b, acc] += 1
                new, finished = _truncate(new, len(batch.history[b]) - len(prompts[b]), max_new_tokens, eos)
                batch.history[b].extend(new)
                stats.new_tokens += len(new)
                done[b] = finished
                if streamer is not None and new:
                    streamer.put(torch.tensor(new))
            session.drop_finished(done)
    stats.wall_time_s = time.perf_counter() - start
    if streamer is not None:
        streamer.end()
    generated = [batch.history[b][len(prompts[b]) :] for b in range(B)]
    width = max((len(g) for g in generated), default=0)
    tail = torch.full((B, width), pad, dtype=torch.long)
    for b, g in enumerate(generated):
        tail[b, : len(g)] = torch.tensor(g, dtype=torch.long)
    return SpeculativeOutput(torch.cat([input_ids.long(), tail.to(device)], dim=1), stats)


# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------


@dataclass
class _Session:
    """Models, caches and settings of one generate call; ``step`` runs draft -> verify -> commit."""

    target: object
    draft: object | None  # None: prompt lookup
    t_cache: object
    d_cache: object | None
    batch: _Batch
    G: int
    K: int
    V: int
    method: str
    sampling: dict
    generator: torch.Generator
    target_forward: object = None  # a compiled target.forward, or None (eager)

    @classmethod
    def start(
        cls,
        target,
        draft,
        prompts,
        device,
        G,
        K,
        V,
        method,
        sampling,
        generator,
        attention_backend,
        static_len=None,
        target_forward=None,
    ):
        t_cache = _prefill(target, prompts, device, static_len)
        d_cache = _prefill(draft, prompts, device, static_len) if draft is not None else None
        lens = torch.tensor([len(p) for p in prompts], device=device)
        batch = _Batch(
            list(range(len(prompts))),
            [list(p) for p in prompts],
            lens - 1,
            lens - 1,
            torch.ones_like(lens),
            attention_backend,
        )
        return cls(target, draft, t_cache, d_cache, batch, G, K, V, method, sampling, generator, target_forward)

    def step(self) -> list[tuple[int, list[int], int, int]]:
        """One speculative step for every active request: [(request, new tokens, accepted, offered)].

        Both caches are committed before returning; the caller appends the tokens to the history
        (after truncating them at EOS / max_new_tokens) and drops finished requests.
        """
        batch, G, K = self.batch, self.G, self.K
        device = batch.target_cached.device
        if self.draft is not None:
            drafts, probs, fed = _draft_chains(
                self.draft, self.d_cache, batch, G, K, self.V, self.method, self.sampling, self.generator
            )
            n_drafts = None
        else:
            drafts, n_drafts = _lookup_drafts(batch, G, device)
            probs = fed = None
        tree_start = cache_length(self.t_cache)
        out, path = _verify(
            self.target,
            self.t_cache,
            batch,
            drafts,
            probs,
            n_drafts,
            G,
            K,
            self.V,
            self.method,
            self.sampling,
            self.generator,
            self.target_forward,
        )
        accepted = out.num_accepted.long()
        _commit_target(self.t_cache, batch, tree_start, path, accepted)
        if self.draft is not None:
            _commit_draft(self.d_cache, batch, fed, path, accepted, G, K)
        tokens = out.tokens.cpu().tolist()
        acc = accepted.cpu().tolist()
        offered = n_drafts.cpu().tolist() if n_drafts is not None else [G] * len(acc)
        return [(b, tokens[a][: acc[a] + 1], acc[a], offered[a]) for a, b in enumerate(batch.rows)]

    def drop_finished(self, done: list[bool]) -> None:
        keep = [a for a, b in enumerate(self.batch.rows) if not done[b]]
        if len(keep) < len(self.batch.rows):
            self.batch.keep(keep, (self.t_cache, self.d_cache))


def _prefill(model, prompts: list[list[int]], device, static_len: int | None = None):
    """Cache every prompt token but the last, left-aligned (right padding), through plain SDPA, in a
    ``DynamicCache`` or (``static_len`` slots) a ``StaticCache``."""
    # Full-attention cache layers for every model: a sliding-window layer would drop its oldest keys
    # and break "slot key_start + t holds position t"; the tree backend applies the window itself.
    from transformers import DynamicCache
    from transformers.cache_utils import Cache, StaticLayer

    if static_len is None:
        cache = DynamicCache()
    else:
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        cache = Cache(layers=[StaticLayer(max_cache_len=static_len) for _ in range(layers)])
        if not all(hasattr(layer, "cumulative_length") for layer in cache.layers):
            raise RuntimeError("cache_implementation='static' needs transformers >= 5 (StaticCache write counters)")
    width = max(len(p) for p in prompts) - 1
    if width <= 0:
        return cache
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p) - 1] = torch.tensor(p[:-1])
        mask[b, : len(p) - 1] = 1
    positions = torch.arange(width).expand(len(prompts), width)
    model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        past_key_values=cache,
        use_cache=True,
    )
    return cache


def _forward(model, cache, ids: torch.Tensor, meta: TreeAttentionMetadata, V: int, compiled=None) -> torch.Tensor:
    with tree_attention_context(meta):
        if compiled is None:
            out = model(input_ids=ids, position_ids=meta.position_ids, past_key_values=cache, use_cache=True)
        else:  # the metadata as an argument: its tensors become graph inputs (the context is not traceable)
            out = compiled(
                input_ids=ids, position_ids=meta.position_ids, past_key_values=cache, use_cache=True, specdec_tree=meta
            )
    return out.logits[..., :V]


def _compiled_forward(model, compile_target: bool | dict, device):
    """``torch.compile(model.forward)`` with the driver's defaults, or None when not asked for."""
    if not compile_target:
        return None
    options = dict(fullgraph=True, dynamic=False)
    if torch.device(device).type == "cuda":
        options["mode"] = "reduce-overhead"  # CUDA graphs: one replay per verification step
    if isinstance(compile_target, dict):
        options.update(compile_target)
    return torch.compile(model.forward, **options)


def _draft_chains(draft, cache, batch: _Batch, G, K, V, method, sampling, generator):
    """K chains of G draft tokens per request: drafts [A, K, G], probs [A, K, G, V] or None (greedy),
    and the cache slots of the draft's fed tokens (for the commit)."""
    device = batch.target_cached.device
    A = len(batch.rows)
    greedy = sampling["temperature"] == 0.0
    u = batch.uncached
    U = int(u.max())
    S = cache_length(cache)
    # Forward 0: the uncached committed tokens (1 or 2 per request) as a chain; the last one is the root.
    ids0 = torch.zeros(A, U, dtype=torch.long)
    for a, b in enumerate(batch.rows):
        n = int(u[a])
        ids0[a, :n] = torch.tensor(batch.history[b][-n:])
    parents0 = torch.arange(U, device=device).expand(A, U) - 1
    meta0 = tree_attention_metadata(parents0, batch.draft_cached, S, num_nodes=u, backend=batch.attention_backend)
    logits0 = _forward(draft, cache, ids0.to(device), meta0, V)
    root_logits = logits0[torch.arange(A, device=device), u - 1]  # [A, V]
    root_probs = None if greedy else draft_distribution(root_logits, **sampling)
    first = sample_first_tokens(
        root_probs,
        root_logits,
        K,
        greedy=greedy,
        distinct=method == "rrs_wor" and K > 1,
        generator=_gen_for(generator, device),
    )
    tokens = [first]  # [A, K] per depth
    probs = [None if greedy else root_probs[:, None, :].expand(A, K, V)]
    # Forwards 1..G-1: the K depth-t tokens, each seeing the root chain and its own chain.
    root_bits = (torch.ones_like(u) << u) - 1  # [A]
    slot_of = lambda t: U + (t - 1) * K + torch.arange(K, device=device)  # noqa: E731  (tree slots of depth t)
    chain_bits = torch.zeros(K, dtype=torch.int64, device=device)
    for t in range(1, G):
        chain_bits = chain_bits | (torch.ones(K, dtype=torch.int64, device=device) << slot_of(t))
        masks = root_bits[:, None] | chain_bits[None, :]
        positions = (batch.draft_cached + u - 1 + t)[:, None].expand(A, K)
        meta = TreeAttentionMetadata(
            meta0.key_start, meta0.prefix_end, meta0.tree_start, masks, positions, U + (G - 1) * K, meta0.backend
        )
        logits = _forward(draft, cache, tokens[-1].to(device), meta, V)  # [A, K, V]
        step_probs = None if greedy else draft_distribution(logits, **sampling)
        tokens.append(sample_next_tokens(step_probs, logits, greedy=greedy, generator=_gen_for(generator, device)))
        probs.append(step_probs)
    drafts = torch.stack(tokens, dim=2)  # [A, K, G]
    stacked = None if greedy else torch.stack(probs, dim=2)  # [A, K, G, V]
    return drafts, stacked, (S, U)


def _gen_for(generator: torch.Generator, device) -> torch.Generator | None:
    """torch.multinomial needs a generator on the tensor's device; CPU runs use the seeded one."""
    return generator if torch.device(device).type == "cpu" else None


def _lookup_drafts(batch: _Batch, G: int, device):
    proposals = prompt_lookup([batch.history[b] for b in batch.rows], G)
    drafts = torch.zeros(len(proposals), 1, G, dtype=torch.long)
    for a, p in enumerate(proposals):
        drafts[a, 0, : len(p)] = torch.tensor(p, dtype=torch.long)
    n = torch.tensor([len(p) for p in proposals], dtype=torch.long, device=device)
    return drafts.to(device), n


def _verify(target, cache, batch: _Batch, drafts, probs, n_drafts, G, K, V, method, sampling, generator, compiled=None):
    """One target forward over root + K*G drafts, then the fused verification; returns (out, path)
    with path [A, G] the accepted nodes' tree indices (1 + chain*G + slot), -1 padding."""
    device = batch.target_cached.device
    A = len(batch.rows)
    N = 1 + K * G
    root = torch.tensor([batch.history[b][-1] for b in batch.rows], dtype=torch.long, device=device)
    ids = torch.cat([root[:, None], drafts.reshape(A, K * G)], dim=1)
    parents = chains_tree_parents(K, G, device).expand(A, N)
    num_nodes = None if n_drafts is None else 1 + n_drafts
    meta = tree_attention_metadata(
        parents, batch.target_cached, cache_length(cache), num_nodes=num_nodes, backend=batch.attention_backend
    )
    logits = _forward(target, cache, ids, meta, V, compiled)  # [A, N, V]
    seeds = torch.randint(0, 2**62, (A,), generator=generator).to(device)
    # validate=False: every input here is built by the driver (ids < V, probabilities normalised),
    # and value checks would synchronise with the GPU once per step.
    if K == 1:
        out = ops.verify(
            logits,
            drafts[:, 0],
            draft_probs=None if probs is None else probs[:, 0],
            num_draft_tokens=n_drafts,
            seed=seeds,
            validate=False,
            **sampling,
        )
        slots = torch.arange(1, G + 1, device=device).expand(A, G)
        path = torch.where(slots <= out.num_accepted.long()[:, None], slots, -1)
        return out, path
    rows = torch.cat([logits[:, :1, None, :].expand(A, K, 1, V), logits[:, 1:].reshape(A, K, G, V)], dim=2)
    out = ops.verify_multi(rows, drafts, draft_probs=probs, seed=seeds, method=method, validate=False, **sampling)
    path = torch.where(out.accepted_nodes >= 0, out.accepted_nodes + 1, -1)
    return out, path


def _commit_target(cache, batch: _Batch, tree_start: int, path, accepted) -> None:
    """Keep root + accepted path: slots tree_start + [0, path...] -> [C, C + 1 + a)."""
    src = torch.cat([torch.zeros_like(path[:, :1]), path.clamp_min(0)], dim=1) + tree_start
    lengths = 1 + accepted
    new_len = int((batch.target_cached + lengths).max())
    commit_paths(cache, src, batch.target_cached, lengths, new_len)
    batch.target_cached = batch.target_cached + lengths


def _commit_draft(cache, batch: _Batch, fed_slots, path, accepted, G: int, K: int) -> None:
    """Keep the committed tokens fed in forward 0 (u per request) and the accepted drafts the draft
    fed itself (depths 1..min(a, G-1) of the accepted chain); the rest of the drafted tree goes."""
    S, U = fed_slots
    u = batch.uncached.tolist()
    acc = accepted.tolist()
    nodes = path.tolist()
    rows = []
    for a in range(len(u)):
        slots = [S + i for i in range(u[a])]
        for t in range(1, min(acc[a], G - 1) + 1):
            chain = (nodes[a][t - 1] - 1) // G  # any chain through this prefix holds the same KV
            slots.append(S + U + (t - 1) * K + chain)
        rows.append(slots)
    width = max(len(r) for r in rows)
    src = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=accepted.device)
    kept = torch.tensor([len(r) for r in rows], dtype=torch.long, device=accepted.device)
    new_len = int((batch.draft_cached + kept).max())
    commit_paths(cache, src, batch.draft_cached, kept, new_len)
    batch.draft_cached = batch.draft_cached + kept
    batch.uncached = torch.where(accepted == G, 2, 1)


def _truncate(new: list[int], generated: int, max_new: int, eos: set[int]) -> tuple[list[int], bool]:
    """Cut the step's tokens at max_new_tokens and after the first EOS; returns (tokens, finished)."""
    room = max_new - generated
    new = new[:room]
    for i, tok in enumerate(new):
        if tok in eos:
            return new[: i + 1], True
    return new, generated + len(new) >= max_new


def _as_set(eos) -> set[int]:
    if eos is None:
        return set()
    if isinstance(eos, int):
        return {eos}
    return {int(e) for e in (eos.tolist() if isinstance(eos, torch.Tensor) else eos)}


def _vocab_rows(model) -> int:
    emb = model.get_output_embeddings()
    return emb.weight.shape[0] if emb is not None else model.config.vocab_size


def _check_inputs(
    target,
    draft,
    input_ids,
    attention_mask,
    G,
    K,
    method,
    drafter,
    temperature,
    top_k,
    top_p,
    max_new_tokens,
    vocab_size,
    streamer,
) -> int:
    """Validate everything up front; returns the vocabulary size the verifier sees."""
    if drafter not in DRAFTERS:
        raise ValueError(f"drafter must be one of {DRAFTERS}, got {drafter!r}")
    if drafter == "model" and draft is None:
        raise ValueError("draft=None needs drafter='prompt_lookup'")
    if drafter == "prompt_lookup" and K != 1:
        raise ValueError("drafter='prompt_lookup' proposes one chain: use num_drafts=1")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if G < 1 or K < 1:
        raise ValueError(f"num_draft_tokens and num_drafts must be >= 1, got {G} and {K}")
    if 1 + K * G > MAX_NODES or (drafter == "model" and 2 + (G - 1) * K > MAX_NODES):
        raise ValueError(f"1 + num_drafts * num_draft_tokens must be <= {MAX_NODES}, got 1 + {K} * {G}")
    if temperature < 0 or top_k < 0 or not (0.0 < top_p <= 1.0):
        raise ValueError(f"need temperature >= 0, top_k >= 0, 0 < top_p <= 1; got {temperature}, {top_k}, {top_p}")
    if method == "rrs_wor" and K > 1 and 0 < top_k < K and temperature > 0:
        raise ValueError(f"method='rrs_wor' samples {K} distinct first drafts: top_k={top_k} leaves too few")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError("input_ids must be a non-empty [B, T] tensor")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}")
    lens = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).sum(1)
    if bool((lens < 1).any()):
        raise ValueError("every prompt needs at least one token")
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("streamer needs batch size 1")
    V_t = _vocab_rows(target)
    V = V_t
    if drafter == "model":
        V_d = _vocab_rows(draft)
        if V_d != V_t and vocab_size is None:
            raise ValueError(
                f"draft vocabulary size ({V_d}) differs from the target's ({V_t}); if both use one tokenizer and "
                f"only pad their embedding matrices differently, pass vocab_size=len(tokenizer)"
            )
        V = min(V_t, V_d)
    if vocab_size is not None:
        if vocab_size > V:
            raise ValueError(f"vocab_size={vocab_size} exceeds the models' vocabulary ({V})")
        V = int(vocab_size)
    if int(input_ids.max()) >= V or int(input_ids.min()) < 0:
        raise ValueError(f"input_ids must lie in [0, {V})")
    return V
