"""Speculative decoding of Hugging Face causal LMs with the fused verification kernels.

One step, for the active requests of the batch:

1. Draft. ``drafter="model"``: K chains of G tokens from the draft model, one batched draft forward
   per depth (forward 0 feeds the uncached committed tokens, 1 or 2 per request; forward t feeds the
   K depth-t tokens), all through the tree-attention backend so the chains share the prompt's KV
   cache. ``drafter="prompt_lookup"``: n-gram lookup in each request's own tokens, no draft model.
2. Verify. The target scores the root (last committed token) and all K*G drafts in **one** forward
   (a chain for K = 1, K chains hanging off the root otherwise), then ``sk.verify`` /
   ``sk.verify_multi`` decides: accepted drafts plus one recovered-or-bonus token per request.
   ``drafter="medusa"``: Medusa heads on the target's last hidden state (captured from the previous
   verification forward at the last accepted node, no extra forward) propose a token tree
   (``hf/medusa.py``) that the target scores in the same one forward and ``sk.verify_tree`` decides.
3. Commit. Each cache keeps exactly the committed tokens: the accepted root-to-node path is gathered
   into contiguous slots, everything else is dropped (``cache.commit_paths``). Requests that finish
   (EOS, max_new_tokens) leave the batch.

Invariant between steps: the target cache holds every committed token but the last; the draft cache
every committed token but the last u_b (u_b = 2 when all G drafts were accepted, since the draft never
fed its own last draft, else 1).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass, field

import torch

from .. import api as ops
from .._params import SEED_RANGE, check_temperature_value, check_top_p_ties
from .._types import MAX_NODES, METHODS
from . import medusa as _medusa
from .attention import (
    TreeAttentionMetadata,
    tree_attention_context,
    tree_attention_metadata,
    using_tree_attention,
)
from .cache import cache_kwargs, commit_paths, select_requests
from .draft_length import DraftLengthPolicy, draft_cost_estimate
from .drafting import (
    chains_tree_parents,
    draft_distribution,
    prompt_lookup,
    sample_first_tokens,
    sample_next_tokens,
)

DRAFTERS = ("model", "prompt_lookup", "medusa")
CACHE_IMPLEMENTATIONS = ("dynamic", "static")


PHASES = ("draft", "target", "verify", "commit", "other")


@dataclass
class SpeculativeStats:
    """Counters of one ``speculative_generate`` call.

    ``time_s`` splits the wall time into draft forwards (and draft sampling), the target's
    verification forward, verification, cache commit (with the step's one host synchronisation) and
    everything else. On a GPU the phases are timed without extra synchronisation, so asynchronous
    work is attributed to the phase that waits for it (``exact_timing=True`` synchronises instead).
    """

    num_draft_tokens: int
    num_drafts: int
    steps: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    proposed: int = 0  # draft tokens offered to the verifier, summed over requests and steps
    accepted: int = 0  # of which accepted
    rejections: int = 0  # (request, step) pairs that ended at a rejected draft
    request_steps: int = 0  # (request, step) pairs: each commits accepted + 1 tokens
    new_tokens: int = 0
    wall_time_s: float = 0.0
    accepted_length_histogram: torch.Tensor = field(default=None)  # [B, G+1]: steps with a accepted drafts
    time_s: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    draft_length_histogram: dict = field(default_factory=dict)  # drafts per step (adaptive) -> steps

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

    def breakdown(self) -> dict[str, float]:
        """Share of wall time per phase (draft, target, verify, commit, other)."""
        total = self.wall_time_s or 1.0
        return {phase: t / total for phase, t in self.time_s.items()}

    def table(self) -> str:
        lengths = ", ".join(f"{g}: {n}" for g, n in sorted(self.draft_length_histogram.items()))
        rows = [
            ("new tokens", f"{self.new_tokens}"),
            ("wall time", f"{self.wall_time_s:.2f} s"),
            ("tokens/s", f"{self.tokens_per_s:.1f}"),
            ("target forwards", f"{self.target_forwards}"),
            ("draft forwards", f"{self.draft_forwards}"),
            ("acceptance rate", f"{self.acceptance_rate:.3f}"),
            ("mean accepted length", f"{self.mean_accepted_length:.2f} tokens/step"),
            ("drafts per step", lengths or "-"),
        ]
        rows += [
            (f"time: {phase}", f"{self.time_s[phase]:.3f} s ({share:.0%})") for phase, share in self.breakdown().items()
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


@dataclass
class SpeculativeOutput:
    sequences: torch.Tensor  # [B, T + new] int64: prompt (as given) + generated, pad_token_id after EOS
    stats: SpeculativeStats


@dataclass
class _Batch:
    """The active requests: position a of every [A] tensor is original request ``rows[a]``."""

    rows: list[int]
    index: torch.Tensor  # [A] int64 on the device: rows
    target_cached: torch.Tensor  # [A] int64: committed tokens in the target cache (= len - 1)
    draft_cached: torch.Tensor  # [A] int64: committed tokens in the draft cache (= len - uncached)
    uncached: torch.Tensor  # [A] int64: 1 or 2 committed tokens the draft has not fed yet
    uncached_host: list[int]  # the same on the host (known from the last step's transfer)
    attention_backend: str = "auto"

    def keep(self, positions: list[int], caches) -> None:
        index = torch.tensor(positions, dtype=torch.long, device=self.target_cached.device)
        self.rows = [self.rows[p] for p in positions]
        self.index = self.index[index]
        self.target_cached = self.target_cached[index]
        self.draft_cached = self.draft_cached[index]
        self.uncached = self.uncached[index]
        self.uncached_host = [self.uncached_host[p] for p in positions]
        for cache in caches:
            if cache is not None:
                select_requests(cache, index)


@dataclass
class _Tokens:
    """Committed tokens of every original request, on the device: seq[b, :length[b]] = prompt + output."""

    seq: torch.Tensor  # [B, W] int64
    length: torch.Tensor  # [B] int64
    generated: torch.Tensor  # [B] int64: output tokens so far
    history: list[list[int]] | None  # host copies, kept only where a host-side drafter needs them

    @classmethod
    def start(cls, prompts: list[list[int]], room: int, device, keep_history: bool) -> _Tokens:
        lengths = [len(p) for p in prompts]
        seq = torch.zeros(len(prompts), max(lengths) + room, dtype=torch.long)
        for b, p in enumerate(prompts):
            seq[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        history = [list(p) for p in prompts] if keep_history else None
        length = torch.tensor(lengths, dtype=torch.long)
        return cls(seq.to(device), length.to(device), torch.zeros_like(length).to(device), history)

    def output(self, pad: int) -> torch.Tensor:
        """[B, max generated] the generated tokens of every request, pad after its end."""
        width = int(self.generated.max()) if self.generated.numel() else 0
        cols = torch.arange(width, device=self.seq.device)
        out = self.seq.gather(1, ((self.length - self.generated)[:, None] + cols).clamp_max(self.seq.shape[1] - 1))
        return torch.where(cols < self.generated[:, None], out, pad)

    def last(self, index: torch.Tensor, n: int) -> torch.Tensor:
        """[A, n]: the last n committed tokens of requests ``index`` (left part clamped to slot 0)."""
        cols = self.length[index][:, None] - n + torch.arange(n, device=index.device)
        return self.seq[index].gather(1, cols.clamp_min(0))


@dataclass
class _StepResult:
    """What the host learns from one step (one transfer): per active row, in batch order."""

    accepted: list[int]
    emitted: list[int]  # tokens committed after the max_new_tokens / EOS cut
    finished: list[bool]
    offered: list[int]
    tokens: list[list[int]] | None  # the emitted tokens (streamer / host-side drafter only)
    drafted: int  # draft tokens per chain this step (fewer than asked when drafting stopped early)


class _PhaseTimer:
    """Adds wall time per phase to ``stats.time_s``; ``sync`` makes GPU attribution exact."""

    def __init__(self, stats: SpeculativeStats, sync: bool):
        self.stats, self.sync = stats, sync

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.stats.time_s[phase] += time.perf_counter() - start


def speculative_generate(
    target,
    draft,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 128,
    num_draft_tokens: int = 4,
    num_drafts: int = 1,
    method: str | None = None,
    drafter: str = "model",
    medusa_heads=None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    top_p_ties: str = "by_index",
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    streamer=None,
    vocab_size: int | None = None,
    attention_backend: str = "auto",
    cache_implementation: str = "dynamic",
    compile_target: bool | dict = False,
    adaptive_draft: bool = True,
    draft_confidence: float = 0.0,
    exact_timing: bool = False,
    draft_cost: float | str | None = None,
) -> SpeculativeOutput:
    """Generate with a draft model (or prompt lookup) and exact verification by the target.

    Args:
        target, draft: ``transformers`` causal LMs sharing a vocabulary; ``draft=None`` with
            ``drafter="prompt_lookup"`` or ``drafter="medusa"``.
        input_ids:      [B, T] int64 prompts, left-padded when ragged (as for ``generate``).
        attention_mask: [B, T], 1 for real tokens; 0s only on the left (left padding).
        num_draft_tokens: G, drafts per chain and step (the maximum when ``adaptive_draft``).
            num_drafts: K chains (K > 1: a tree, verified with ``method`` "kseq" (SpecTr K-SEQ),
            "rrs" or "rrs_wor"; default "kseq"). 1 + K*G <= 64.
        drafter: "model" (the draft model), "prompt_lookup" (n-grams of each request's own tokens) or
            "medusa" (``medusa_heads``, a :class:`specdec_kernels.hf.medusa.MedusaHeads` on the target's
            last hidden state). Medusa: ``num_draft_tokens`` = N tree nodes besides the root (1 + N <= 64),
            ``num_drafts`` = s candidates per head (top-s when greedy; s draws without replacement from
            the head's distribution when sampling); the tree keeps the N best nodes of the heads'
            Cartesian product by product of sorted head probabilities and is verified by
            ``sk.verify_tree`` with ``method="rrs_wor"`` (the only method; the default for Medusa).
        temperature, top_k, top_p: the target's sampling; temperature 0 = greedy (output identical to
            ``target.generate(do_sample=False)``). Sampled output is exactly target-distributed.
        top_p_ties: the tokens kept from the tie group at the top-p boundary (``sk.verify``):
            "by_index" (default) as ``target.generate``'s TopPLogitsWarper (the higher token index
            counts as more probable; the Triton kernels on a GPU, the CPU build on CPU tensors);
            "keep" keeps the whole group.
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
            ``cache_implementation="static"`` (and fixes the draft length: one graph per shape).
        adaptive_draft: chains (K = 1, draft model) choose the drafts per step (at most
            ``num_draft_tokens``) from the running acceptance and the measured draft/target cost.
        draft_confidence: with ``adaptive_draft``, each request's chain ends at the first draft whose
            distribution's most likely token has probability below this (that draft included; a
            property of the draft's distribution, not of its sample, so sampled output stays exact).
            On the CPU, drafting stops once every request's chain has ended. 0 (default) = off: on
            the demo pair a distilled draft is accepted often even where unsure, and the cut cost
            10-20% tokens/s.
        exact_timing: synchronise the GPU around each phase of ``stats.time_s`` (slower; CPU: no-op).
        draft_cost: the cost model of ``adaptive_draft`` (``hf/draft_length.py``): ``"measured"``
            (the steps' own wall times per draft length, remembered per model pair for the process),
            ``"shapes"`` (a draft forward costs :func:`draft_cost_estimate` target forwards), or that
            relative cost as a number. Default: measured when greedy (the output does not depend on
            the lengths), shapes when sampling (timings would make seeded runs irreproducible).

    Each step synchronises with the host once (to learn the accepted lengths), whatever the batch size.

    Returns:
        ``SpeculativeOutput(sequences [B, T + new], stats)``.

    Example:
        >>> out = speculative_generate(target, draft, ids, mask, max_new_tokens=64, num_drafts=2, temperature=0.7)
        >>> print(out.stats.table())
    """
    G, K = _as_int("num_draft_tokens", num_draft_tokens), _as_int("num_drafts", num_drafts)
    max_new_tokens = _as_int("max_new_tokens", max_new_tokens)
    if cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"cache_implementation must be one of {CACHE_IMPLEMENTATIONS}, got {cache_implementation!r}")
    if compile_target and cache_implementation != "static":
        raise ValueError("compile_target needs cache_implementation='static' (fixed cache buffers)")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64):
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    if not (draft_cost in (None, "measured", "shapes") or _is_number(draft_cost) and draft_cost >= 0):
        raise ValueError(f"draft_cost must be 'measured', 'shapes', None or a number >= 0, got {draft_cost!r}")
    check_top_p_ties(top_p_ties)
    if not (isinstance(draft_confidence, (int, float)) and 0.0 <= draft_confidence <= 1.0):
        raise ValueError(f"draft_confidence must be in [0, 1], got {draft_confidence!r}")
    use_medusa = drafter == "medusa"
    if method is None:
        method = "rrs_wor" if use_medusa else "kseq"
    if use_medusa:
        _check_medusa(draft, medusa_heads, method, compile_target)
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
        medusa_heads,
    )
    device = input_ids.device
    B, T = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    prompts = [input_ids[b][mask[b].bool()].tolist() for b in range(B)]
    gen_cfg = getattr(target, "generation_config", None)
    eos = _as_set(eos_token_id if eos_token_id is not None else getattr(gen_cfg, "eos_token_id", None))
    pad = pad_token_id if pad_token_id is not None else getattr(gen_cfg, "pad_token_id", None)
    pad = pad if pad is not None else (min(eos) if eos else 0)
    seed = seed if seed is not None else int(torch.randint(0, SEED_RANGE, (1,)))
    generator = torch.Generator().manual_seed(seed % 2**63)
    depth = medusa_heads.num_heads if use_medusa else G  # the deepest accepted path
    tree_nodes = G if use_medusa else K * G  # drafts in one verification tree
    stats = SpeculativeStats(G, K, accepted_length_histogram=torch.zeros(B, depth + 1, dtype=torch.long))
    sampling = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
    use_draft = drafter == "model"
    adaptive = adaptive_draft and use_draft and K == 1 and not compile_target
    timer = _PhaseTimer(stats, exact_timing and torch.device(device).type == "cuda")

    if streamer is not None:
        streamer.put(input_ids.cpu())
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(using_tree_attention(target))
        if use_draft:
            stack.enter_context(using_tree_attention(draft))
        hidden = stack.enter_context(_lm_head_input(target)) if use_medusa else None
        # Occupancy bound. The caches' shared end is the longest *unfinished* request's cached length
        # (a finishing request keeps nothing of its last step, see _commit): committed - 1 with
        # committed <= prompt + max_new - 1 (target), committed - u (draft). On top come the 1 +
        # K*G tree (target), or u + (G-1)*K fed tokens (draft, u <= 2). _Session checks it per forward.
        static_len = max(len(p) for p in prompts) + max_new_tokens + tree_nodes + 2
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
            max_new_tokens=max_new_tokens,
            eos=eos,
            timer=timer,
            keep_history=drafter == "prompt_lookup" or streamer is not None,
            draft_confidence=draft_confidence if adaptive else 0.0,
            medusa=(medusa_heads, hidden) if use_medusa else None,
            top_p_ties=top_p_ties,
        )
        session.drop_finished([max_new_tokens == 0] * len(prompts))
        policy = _draft_length_policy(target, draft, G, draft_cost, sampling) if adaptive else None
        while session.batch.rows:
            active = len(session.batch.rows)
            g = policy.choose(stats.accepted, stats.rejections, active) if policy else G
            step_start = time.perf_counter()
            result = session.step(g)  # ends with the step's one host synchronisation
            g = result.drafted  # (a confidence stop on the CPU may have drafted fewer)
            if policy:
                policy.record(g, active, time.perf_counter() - step_start)
            stats.target_forwards += 1
            stats.draft_forwards += g if use_draft else 0
            stats.steps += 1
            stats.draft_length_histogram[g] = stats.draft_length_histogram.get(g, 0) + 1
            with timer("other"):
                acc = torch.tensor(result.accepted)
                stats.proposed += sum(result.offered)
                stats.accepted += int(acc.sum())
                stats.rejections += int((acc < torch.tensor(result.offered)).sum())
                stats.request_steps += len(result.accepted)
                stats.new_tokens += sum(result.emitted)
                stats.accepted_length_histogram.index_put_(
                    (torch.tensor(session.batch.rows), acc), torch.ones_like(acc), accumulate=True
                )
                if streamer is not None and result.tokens[0]:
                    streamer.put(torch.tensor(result.tokens[0]))
                session.drop_finished_rows(result.finished)
    stats.wall_time_s = time.perf_counter() - start
    stats.time_s["other"] = max(0.0, stats.wall_time_s - sum(v for k, v in stats.time_s.items() if k != "other"))
    if streamer is not None:
        streamer.end()
    return SpeculativeOutput(torch.cat([input_ids.long(), session.tokens.output(pad)], dim=1), stats)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _draft_length_policy(target, draft, G: int, draft_cost, sampling: dict) -> DraftLengthPolicy:
    measured = draft_cost == "measured" or (draft_cost is None and sampling["temperature"] == 0.0)
    cost = draft_cost if _is_number(draft_cost) else draft_cost_estimate(target, draft)
    return DraftLengthPolicy(target, draft, G, float(cost), measured)


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
    t_len: int  # slots in use in each cache (tracked on the host: no reads of cache counters)
    d_len: int
    batch: _Batch
    tokens: _Tokens
    G: int
    K: int
    V: int
    method: str
    sampling: dict
    generator: torch.Generator
    target_forward: object = None  # a compiled target.forward, or None (eager)
    max_new_tokens: int = 2**62
    eos: torch.Tensor | None = None  # [E] int64 on the device
    timer: object = None
    draft_confidence: float = 0.0
    medusa: object = None  # MedusaHeads, or None
    hidden_input: object = None  # _LMHeadInput: the target's last hidden states of its latest forward
    hidden: torch.Tensor | None = None  # [A, H] the heads' input: hidden state of each last accepted node
    cartesian: object = None  # medusa.CartesianTree over (num_drafts,) * heads
    static_len: int | None = None  # slots of each StaticCache layer (None: DynamicCache)
    top_p_ties: str = "by_index"  # the verifier's top-p tie rule (the drafter's own does not matter)

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
        *,
        max_new_tokens: int = 2**62,
        eos=(),
        timer=None,
        keep_history: bool = True,
        draft_confidence: float = 0.0,
        medusa=None,
        top_p_ties: str = "by_index",
    ):
        """``medusa``: (MedusaHeads, the _LMHeadInput hooked on the target) for drafter="medusa"."""
        # Medusa's heads read the prefill's hidden state at each prompt's end: the target then
        # keeps every position's output layer input (the hook sees what the output layer sees).
        t_cache = _prefill(target, prompts, device, static_len, every_position=medusa is not None)
        d_cache = _prefill(draft, prompts, device, static_len) if draft is not None else None
        width = max(0, max(len(p) for p in prompts) - 1)
        lens = torch.tensor([len(p) for p in prompts], device=device)
        A = len(prompts)
        batch = _Batch(
            list(range(A)),
            torch.arange(A, device=device),
            lens - 1,
            lens - 1,
            torch.ones_like(lens),
            [1] * A,
            attention_backend,
        )
        depth = medusa[0].num_heads if medusa is not None else G
        tokens = _Tokens.start(prompts, min(max_new_tokens, 2**20) + K * G + depth + 2, device, keep_history)
        eos_t = torch.tensor(sorted(eos), dtype=torch.long, device=device)
        session = cls(
            target,
            draft,
            t_cache,
            d_cache,
            width,
            width if draft is not None else 0,
            batch,
            tokens,
            G,
            K,
            V,
            method,
            sampling,
            generator,
            target_forward,
            max_new_tokens,
            eos_t,
            timer or _PhaseTimer(SpeculativeStats(G, K), False),
            draft_confidence,
        )
        session.top_p_ties = top_p_ties
        if medusa is not None:
            heads, hidden_input = medusa
            session.medusa, session.hidden_input = heads, hidden_input
            session.cartesian = _medusa.cartesian_tree((K,) * heads.num_heads, device)
            session.hidden = _prefill_hidden(hidden_input, lens, width, heads.hidden_size, device)
        session.static_len = static_len
        return session

    def _check_room(self, which: str, used: int, new: int) -> None:
        """A forward appending ``new`` slots after ``used`` fits the static buffers (a host check: on
        CUDA an out-of-range cache write is a device assert, which kills the process)."""
        if self.static_len is not None and used + new > self.static_len:
            raise RuntimeError(
                f"internal error: the {which} StaticCache needs {used + new} slots but has {self.static_len}; "
                "please report this with the call's arguments"
            )

    def step(self, g: int | None = None) -> _StepResult:
        """One speculative step with ``g`` drafts per chain (default G) for every active request.

        Both caches are committed and the tokens (cut at EOS / max_new_tokens) appended before
        returning; the caller drops finished requests (``drop_finished_rows``).
        """
        if self.medusa is not None:
            return self._medusa_step()
        batch, K = self.batch, self.K
        g = self.G if g is None else g
        with self.timer("draft"):
            if self.draft is not None:
                drafts, draft_rows, fed, n_drafts = self._draft_chains(g)
                g = drafts.shape[2]
            else:
                drafts, n_drafts = _lookup_drafts(self.tokens.history, batch.rows, g, batch.index.device)
                draft_rows = fed = None
        with self.timer("target"):
            tree_start = self.t_len
            logits = self._target_forward(drafts, n_drafts, g)
        with self.timer("verify"):
            sampling = dict(self.sampling, top_p_ties=self.top_p_ties)
            out, path = _verify(logits, drafts, draft_rows, n_drafts, g, K, self.method, sampling, self.generator)
        with self.timer("commit"):
            return self._commit(out, path, tree_start, fed, n_drafts, g)

    def _medusa_step(self) -> _StepResult:
        """Heads -> tree -> one target forward over root + tree -> ``sk.verify_tree`` -> commit; the
        hidden state at the last accepted node (or the root) feeds the next step's heads."""
        batch, V, sampling = self.batch, self.V, self.sampling
        device = batch.index.device
        A = len(batch.rows)
        D = self.medusa.num_heads
        with self.timer("draft"):
            head_logits = self.medusa(self.hidden)[..., :V]  # [A, D, V]
            tree = _medusa.medusa_tree(
                head_logits,
                self.cartesian,
                self.G,
                sampling,
                generator=_gen_for(self.generator, device),
                sampler=_medusa.candidate_tokens,  # looked up per call (tests swap in wrong variants)
            )
        with self.timer("target"):
            tree_start = self.t_len
            logits = self._target_forward_tree(tree)  # [A, 1 + N, V]
        with self.timer("verify"):
            seeds = torch.randint(0, SEED_RANGE, (A,), generator=self.generator).to(device)
            draft_kw = {} if tree.probs is None else {"draft_probs": tree.probs}
            out = ops.verify_tree(
                logits,
                tree.tokens,
                tree.parents,
                **draft_kw,
                num_nodes=tree.num_nodes,
                seed=seeds,
                method=self.method,
                max_depth=D,
                validate=False,
                top_p_ties=self.top_p_ties,
                **sampling,
            )
            path = torch.where(out.accepted_nodes >= 0, out.accepted_nodes + 1, -1)  # forward slots
            n = out.num_accepted.long()
            last = torch.where(n > 0, path.gather(1, (n - 1).clamp_min(0)[:, None])[:, 0], 0)
            self.hidden = self.hidden_input.value[torch.arange(A, device=device), last]
        with self.timer("commit"):
            return self._commit(out, path, tree_start, None, tree.max_depth, D)

    def _target_forward_tree(self, tree) -> torch.Tensor:
        """The target scores root + tree (verify_tree's parents, shifted by the root) in one forward."""
        batch = self.batch
        A, N = tree.tokens.shape
        self._check_room("target", self.t_len, 1 + N)
        root = self.tokens.last(batch.index, 1)
        ids = torch.cat([root, tree.tokens], dim=1)
        parents = torch.cat([torch.full_like(root, -1), tree.parents.clamp_min(-1) + 1], dim=1)
        meta = tree_attention_metadata(
            parents,
            batch.target_cached,
            self.t_len,
            num_nodes=1 + tree.num_nodes,
            backend=batch.attention_backend,
            validate=False,
        )
        logits = _forward(self.target, self.t_cache, ids, meta, self.V, self.target_forward)
        self.t_len += 1 + N
        return logits

    # ---- drafting

    def _draft_chains(self, g: int):
        """K chains of g draft tokens per request: drafts [A, K, g], the probabilities [A, K, g, V]
        each draft was sampled from (what the verifier is told q is; None when greedy), the cache
        slots the draft fed (for the commit), and ragged draft counts [A] or None."""
        batch, K, V, sampling = self.batch, self.K, self.V, self.sampling
        device = batch.index.device
        A = len(batch.rows)
        greedy = sampling["temperature"] == 0.0
        u = batch.uncached
        U = max(batch.uncached_host)  # known on the host: no synchronisation
        S = self.d_len
        self._check_room("draft", S, U + (g - 1) * K)
        # Forward 0: the uncached committed tokens (1 or 2 per request), right-aligned; the last is the root.
        ids0 = self.tokens.last(batch.index, U)  # right-aligned; left-align the u real ones (the rest is padding)
        ids0 = ids0.gather(1, (torch.arange(U, device=device) + U - u[:, None]) % U)
        parents0 = torch.arange(U, device=device).expand(A, U) - 1
        meta0 = tree_attention_metadata(
            parents0, batch.draft_cached, S, num_nodes=u, backend=batch.attention_backend, validate=False
        )
        # Only the root's logits are needed: when every request feeds U tokens (always at batch 1),
        # the root is the last position and the output layer runs on it alone.
        uniform = min(batch.uncached_host) == U
        logits0 = _forward(self.draft, self.d_cache, ids0, meta0, V, keep_last=uniform)
        self.d_len = S + U
        root_logits = logits0[:, -1] if uniform else logits0[torch.arange(A, device=device), u - 1]  # [A, V]
        gen = _gen_for(self.generator, device)
        probs = None if greedy else draft_distribution(root_logits, **sampling)
        first = sample_first_tokens(
            probs, root_logits, K, greedy=greedy, distinct=self.method == "rrs_wor" and K > 1, generator=gen
        )
        tokens, rows = [first], [None if greedy else probs[:, None].expand(A, K, V)]
        confident = [self._confident(root_logits, probs)]
        # A chain keeps its drafts up to its first unsure one. On the CPU a flag costs nothing
        # to read (no device to wait for), so drafting stops once every request has met one: the
        # forwards after it would only make drafts that verification cuts. (On a GPU that read
        # would be a synchronisation per draft token; there the drafts are cut, not skipped.)
        stop_early = self.draft_confidence > 0.0 and K == 1 and device.type == "cpu"
        met_unsure = ~confident[0]
        # Forwards 1..g-1: the K depth-t tokens, each seeing the root chain and its own chain.
        root_bits = (torch.ones_like(u) << u) - 1  # [A]
        chain_bits = torch.zeros(K, dtype=torch.int64, device=device)
        for t in range(1, g):
            if stop_early and bool(met_unsure.all()):
                break
            slots = U + (t - 1) * K + torch.arange(K, device=device)
            chain_bits = chain_bits | (torch.ones(K, dtype=torch.int64, device=device) << slots)
            masks = root_bits[:, None] | chain_bits[None, :]
            positions = (batch.draft_cached + u - 1 + t)[:, None].expand(A, K)
            meta = TreeAttentionMetadata(
                meta0.key_start, meta0.prefix_end, meta0.tree_start, masks, positions, U + (g - 1) * K, meta0.backend
            )
            logits = _forward(self.draft, self.d_cache, tokens[-1], meta, V)  # [A, K, V]
            self.d_len += K
            probs = None if greedy else draft_distribution(logits, **sampling)
            tokens.append(sample_next_tokens(probs, logits, greedy=greedy, generator=gen))
            rows.append(probs)
            confident.append(self._confident(logits[:, 0], None if probs is None else probs[:, 0]))
            met_unsure |= ~confident[-1]
        drafts = torch.stack(tokens, dim=2)  # [A, K, g]
        draft_rows = None if greedy else torch.stack(rows, dim=2)  # [A, K, g, V]
        n_drafts = None
        if self.draft_confidence > 0.0:  # chains only: drafts up to and including the first unsure one
            # (that one is already drawn, and one more row costs the target's forward next to nothing)
            sure_run = torch.stack(confident, dim=1).long().cumprod(dim=1).sum(dim=1)
            n_drafts = (sure_run + 1).clamp_max(drafts.shape[2])
        return drafts, draft_rows, (S, U), n_drafts

    def _confident(self, logits: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
        """[A] bool: the draft's distribution at this position has a token of probability >= the
        threshold (decided before looking at the sampled token, which keeps sampling exact)."""
        if self.draft_confidence <= 0.0:
            return torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        p = probs if probs is not None else torch.softmax(logits.float(), dim=-1)
        return p.max(dim=-1).values >= self.draft_confidence

    # ---- verification forward

    def _target_forward(self, drafts, n_drafts, g):
        """The target scores root + K*g drafts in one forward: logits [A, 1 + K*g, V]."""
        batch = self.batch
        device = batch.index.device
        A, K = len(batch.rows), self.K
        N = 1 + K * g
        self._check_room("target", self.t_len, N)
        root = self.tokens.last(batch.index, 1)
        ids = torch.cat([root, drafts.reshape(A, K * g)], dim=1)
        parents = chains_tree_parents(K, g, device).expand(A, N)
        num_nodes = None if n_drafts is None else 1 + n_drafts
        meta = tree_attention_metadata(
            parents,
            batch.target_cached,
            self.t_len,
            num_nodes=num_nodes,
            backend=batch.attention_backend,
            validate=False,
        )
        logits = _forward(self.target, self.t_cache, ids, meta, self.V, self.target_forward)
        self.t_len += N
        return logits

    # ---- commit: one host synchronisation per step

    def _commit(self, out, path, tree_start: int, fed, n_drafts, g: int) -> _StepResult:
        batch, tokens, K = self.batch, self.tokens, self.K
        device = batch.index.device
        A = len(batch.rows)
        accepted = out.num_accepted.long()
        # Tokens this step commits, cut at max_new_tokens and after the first EOS.
        new = out.tokens[:, : g + 1]
        col = torch.arange(g + 1, device=device)
        room = self.max_new_tokens - tokens.generated[batch.index]
        emitted = torch.minimum(accepted + 1, room)
        is_eos = torch.isin(new, self.eos) & (col < emitted[:, None])
        first_eos = torch.where(is_eos, col, g + 1).min(dim=1).values
        emitted = torch.minimum(emitted, first_eos + 1)
        finished = (emitted >= room) | (first_eos <= g)
        # Cache commits: the target keeps root + accepted path, the draft what it fed of it. A request
        # that finishes keeps nothing (it leaves the batch): its accepted drafts past the max_new_tokens
        # cut would otherwise hold the caches' shared end past the static bound for the others.
        t_lengths = torch.where(finished, 0, 1 + accepted)
        t_src = torch.cat([torch.zeros_like(path[:, :1]), path.clamp_min(0)], dim=1) + tree_start
        d_src = d_kept = None
        if self.draft is not None:
            d_src, d_kept = _draft_commit_slots(fed, path, accepted, batch, g, K)
            d_kept = torch.where(finished, 0, d_kept)
        offered = n_drafts if n_drafts is not None else torch.full((A,), g, dtype=torch.long, device=device)
        lens = [batch.target_cached + t_lengths] + ([batch.draft_cached + d_kept] if d_kept is not None else [])
        packed = [accepted, emitted, finished.long(), offered, torch.stack([x.max() for x in lens])]
        with_tokens = tokens.history is not None
        flat = torch.cat([x.reshape(-1) for x in packed] + ([new.reshape(-1)] if with_tokens else []))
        host = flat.tolist()  # the step's one host synchronisation
        acc_h, emit_h, fin_h, off_h = (host[i * A : (i + 1) * A] for i in range(4))
        new_lens = host[4 * A : 4 * A + len(lens)]
        # Committed tokens: seq[b, length[b] + j] = new[a, j] for j < emitted[a].
        rows = batch.index[:, None].expand(A, g + 1)
        dst = (tokens.length[batch.index][:, None] + col).clamp_max(tokens.seq.shape[1] - 1)
        keep_old = tokens.seq[rows, dst]
        tokens.seq[rows, dst] = torch.where(col < emitted[:, None], new, keep_old)
        tokens.length[batch.index] += emitted
        tokens.generated[batch.index] += emitted
        commit_paths(self.t_cache, t_src, batch.target_cached, t_lengths, new_lens[0])
        self.t_len = new_lens[0]
        batch.target_cached = batch.target_cached + t_lengths
        if self.draft is not None:
            commit_paths(self.d_cache, d_src, batch.draft_cached, d_kept, new_lens[1])
            self.d_len = new_lens[1]
            batch.draft_cached = batch.draft_cached + d_kept
            batch.uncached = torch.where(accepted == g, 2, 1)
            batch.uncached_host = [2 if a == g else 1 for a in acc_h]
        step_tokens = None
        if with_tokens:
            flat_new = host[4 * A + len(lens) :]
            step_tokens = [flat_new[a * (g + 1) : a * (g + 1) + emit_h[a]] for a in range(A)]
            for b, t in zip(batch.rows, step_tokens, strict=True):
                tokens.history[b].extend(t)
        return _StepResult(acc_h, emit_h, [bool(f) for f in fin_h], off_h, step_tokens, g)

    def drop_finished_rows(self, finished: list[bool]) -> None:
        keep = [a for a, done in enumerate(finished) if not done]
        if len(keep) < len(self.batch.rows):
            self.batch.keep(keep, (self.t_cache, self.d_cache))
            if self.hidden is not None:
                self.hidden = self.hidden[torch.tensor(keep, dtype=torch.long, device=self.hidden.device)]

    def drop_finished(self, done: list[bool]) -> None:
        """Drop requests by original index (before the first step)."""
        self.drop_finished_rows([done[b] for b in self.batch.rows])


def _prefill(model, prompts: list[list[int]], device, static_len: int | None = None, every_position: bool = False):
    """Cache every prompt token but the last, left-aligned (right padding), through plain SDPA, in a
    ``DynamicCache`` or (``static_len`` slots) a ``StaticCache``. Its logits are not used: the output
    layer runs on the last position only (a prompt's worth of vocabulary rows otherwise: 15-30% of a
    1.5B / 0.5B Qwen prefill) unless ``every_position``."""
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
            raise RuntimeError("cache_implementation='static' needs transformers >= 5.4 (StaticLayer write counters)")
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
        use_cache=True,
        **cache_kwargs(model, cache),
        **({} if every_position else _last_logits_only(model)),
    )
    return cache


class _LMHeadInput:
    """Keeps the input of the model's output layer (the last hidden states, [B, T, H]) of its
    latest forward: a forward pre-hook, so the heads need no forward of their own."""

    def __init__(self, model):
        layer = model.get_output_embeddings()
        if layer is None:
            raise ValueError("drafter='medusa' needs a target with an output layer (get_output_embeddings())")
        self.value = None
        self.handle = layer.register_forward_pre_hook(self._keep)

    def _keep(self, module, args):
        self.value = args[0]


@contextlib.contextmanager
def _lm_head_input(model):
    capture = _LMHeadInput(model)
    try:
        yield capture
    finally:
        capture.handle.remove()


def _prefill_hidden(capture: _LMHeadInput, lens: torch.Tensor, width: int, hidden_size: int, device) -> torch.Tensor:
    """[B, H] the last hidden state of each prompt's prefill (position len - 2, the token before the
    root); zeros for one-token prompts (no prefill: the first tree then comes from a zero state,
    which costs acceptance, not exactness)."""
    B = lens.shape[0]
    if width == 0 or capture.value is None:
        return torch.zeros(B, hidden_size, device=device)
    h = capture.value[torch.arange(B, device=device), (lens - 2).clamp_min(0)]
    return torch.where((lens >= 2)[:, None], h, torch.zeros_like(h))


def _forward(
    model, cache, ids: torch.Tensor, meta: TreeAttentionMetadata, V: int, compiled=None, keep_last: bool = False
) -> torch.Tensor:
    """The model's logits [A, N, V] for the N input tokens, or [A, 1, V] (the last) with ``keep_last``
    when the model can restrict its output layer (else [A, N, V] all the same: callers take [:, -1])."""
    with tree_attention_context(meta):
        if compiled is None:
            kw = _last_logits_only(model) if keep_last else {}
            kw.update(cache_kwargs(model, cache))
            out = model(input_ids=ids, position_ids=meta.position_ids, use_cache=True, **kw)
        else:  # the metadata as an argument: its tensors become graph inputs (the context is not traceable)
            kw = cache_kwargs(model, cache)
            out = compiled(input_ids=ids, position_ids=meta.position_ids, use_cache=True, specdec_tree=meta, **kw)
    return out.logits[..., :V]


def _last_logits_only(model) -> dict:
    """``{"logits_to_keep": 1}`` where the model's forward takes it (``transformers`` causal LMs):
    the output layer, V rows of the hidden size, then runs on the last position only."""
    return {"logits_to_keep": 1} if _takes_logits_to_keep(type(model)) else {}


@functools.cache
def _takes_logits_to_keep(model_type: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_type.forward).parameters


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


def _gen_for(generator: torch.Generator, device) -> torch.Generator | None:
    """torch.multinomial needs a generator on the tensor's device; CPU runs use the seeded one."""
    return generator if torch.device(device).type == "cpu" else None


def _lookup_drafts(history: list[list[int]], rows: list[int], G: int, device):
    """Prompt-lookup drafts [A, 1, G] and their counts [A] (an n-gram search in each request's own
    tokens: host work on the histories the step transfer keeps)."""
    proposals = prompt_lookup([history[b] for b in rows], G)
    drafts = torch.zeros(len(proposals), 1, G, dtype=torch.long)
    for a, p in enumerate(proposals):
        drafts[a, 0, : len(p)] = torch.tensor(p, dtype=torch.long)
    n = torch.tensor([len(p) for p in proposals], dtype=torch.long)
    return drafts.to(device), n.to(device)


def _verify(logits, drafts, draft_rows, n_drafts, G, K, method, sampling, generator):
    """The fused verification of the target's logits [A, 1 + K*G, V]; returns (out, path) with path
    [A, G] the accepted nodes' tree indices (1 + chain*G + slot), -1 padding.

    draft_rows: the exact probabilities the drafts were sampled from (``draft_distribution``), handed
    over as ``draft_probs`` so that q is the drafter's law by construction; None when greedy."""
    A, N, V = logits.shape
    device = logits.device
    seeds = torch.randint(0, SEED_RANGE, (A,), generator=generator).to(device)
    draft_kw = {} if draft_rows is None else {"draft_probs": draft_rows}
    # validate=False: every input here is built by the driver (ids < V, probabilities normalised),
    # and value checks would synchronise with the GPU once per step.
    if K == 1:
        draft_kw = {name: rows[:, 0] for name, rows in draft_kw.items()}
        out = ops.verify(
            logits, drafts[:, 0], **draft_kw, num_draft_tokens=n_drafts, seed=seeds, validate=False, **sampling
        )
        slots = torch.arange(1, G + 1, device=device).expand(A, G)
        path = torch.where(slots <= out.num_accepted.long()[:, None], slots, -1)
        return out, path
    rows = torch.cat([logits[:, :1, None, :].expand(A, K, 1, V), logits[:, 1:].reshape(A, K, G, V)], dim=2)
    out = ops.verify_multi(rows, drafts, **draft_kw, seed=seeds, method=method, validate=False, **sampling)
    path = torch.where(out.accepted_nodes >= 0, out.accepted_nodes + 1, -1)
    return out, path


def _draft_commit_slots(fed, path, accepted, batch: _Batch, G: int, K: int):
    """Draft-cache slots to keep, [A, U + G - 1] (left-aligned), and their counts [A]: the committed
    tokens fed in forward 0 (u per request) and the accepted drafts the draft fed itself (depths
    1..min(a, G-1) of the accepted chain; any chain through that prefix holds the same KV)."""
    S, U = fed
    device = accepted.device
    u = batch.uncached
    j = torch.arange(U + G - 1, device=device)[None, :]
    t = (j - u[:, None] + 1).clamp(1, max(G - 1, 1))  # depth of the j-th kept draft slot
    chain = (path.gather(1, (t - 1).clamp_max(G - 1)) - 1).clamp_min(0) // G
    src = torch.where(j < u[:, None], S + j, S + U + (t - 1) * K + chain)
    kept = u + torch.clamp(accepted, max=G - 1)
    return src, kept


def _check_medusa(draft, heads, method, compile_target) -> None:
    if heads is None:
        raise ValueError("drafter='medusa' needs medusa_heads= (e.g. specdec_kernels.demo.load_medusa_heads())")
    if not isinstance(heads, _medusa.MedusaHeads):
        raise TypeError(f"medusa_heads must be a MedusaHeads, got {type(heads).__name__}")
    if draft is not None:
        raise ValueError("drafter='medusa' drafts with the heads: pass draft=None")
    if method != "rrs_wor":
        raise ValueError(
            f"drafter='medusa' samples each node's children without replacement: method must be 'rrs_wor' "
            f"(the default), got {method!r}"
        )
    if compile_target:
        raise ValueError("compile_target is not supported with drafter='medusa' yet")


def _as_set(eos) -> set[int]:
    if eos is None:
        return set()
    if isinstance(eos, int):
        return {eos}
    return {int(e) for e in (eos.tolist() if isinstance(eos, torch.Tensor) else eos)}


def _as_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return value


def _vocab_rows(model) -> int:
    """Rows of the model's output layer (its logits' width); ``out_features`` first because the
    ``weight`` of an output layer swapped for :class:`~specdec_kernels.hf.cpu_linear.OneDnnLinear` is
    an unpacked copy."""
    emb = model.get_output_embeddings()
    if emb is None:
        return model.config.vocab_size
    rows = getattr(emb, "out_features", None)
    return int(rows) if rows is not None else emb.weight.shape[0]


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
    medusa_heads=None,
) -> int:
    """Validate everything up front; returns the vocabulary size the verifier sees."""
    if drafter not in DRAFTERS:
        raise ValueError(f"drafter must be one of {DRAFTERS}, got {drafter!r}")
    if drafter == "model" and draft is None:
        raise ValueError("draft=None needs drafter='prompt_lookup'")
    if drafter == "prompt_lookup" and K != 1:
        raise ValueError("drafter='prompt_lookup' proposes one chain: use num_drafts=1")
    if method not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")
    if G < 1 or K < 1:
        raise ValueError(f"num_draft_tokens and num_drafts must be >= 1, got {G} and {K}")
    if drafter == "medusa":
        if 1 + G > MAX_NODES:
            raise ValueError(f"drafter='medusa': 1 + num_draft_tokens (tree nodes) must be <= {MAX_NODES}, got 1 + {G}")
    elif 1 + K * G > MAX_NODES or (drafter == "model" and 2 + (G - 1) * K > MAX_NODES):
        raise ValueError(f"1 + num_drafts * num_draft_tokens must be <= {MAX_NODES}, got 1 + {K} * {G}")
    check_temperature_value(temperature)  # finite, >= 0, and 0 or >= 2**-126 (1/T fits float32)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if method == "rrs_wor" and K > 1 and 0 < top_k < K and temperature > 0 and drafter != "medusa":
        raise ValueError(f"method='rrs_wor' samples {K} distinct first drafts: top_k={top_k} leaves too few")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError("input_ids must be a non-empty [B, T] tensor")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}")
    if attention_mask is not None:
        # Left padding only: a request's real tokens are one run that ends at the last column.
        monotone = attention_mask.bool().long().diff(dim=1) >= 0
        if not bool(monotone.all()):
            raise ValueError(
                "attention_mask must be left-padded (0s then 1s in every row, as for generate with "
                "tokenizer.padding_side='left'); got right padding or holes"
            )
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
    if drafter == "medusa":
        V_h = medusa_heads.vocab_size
        if V_h != V_t and vocab_size is None:
            raise ValueError(
                f"the Medusa heads' vocabulary ({V_h}) differs from the target's ({V_t}); pass vocab_size= "
                f"(the real token count) if only the embedding matrices are padded differently"
            )
        V = min(V_t, V_h)
        hidden = target.config.get_text_config(decoder=True).hidden_size
        if medusa_heads.hidden_size != hidden:
            raise ValueError(f"the Medusa heads read hidden size {medusa_heads.hidden_size}, the target has {hidden}")
    if vocab_size is not None:
        if vocab_size > V:
            raise ValueError(f"vocab_size={vocab_size} exceeds the models' vocabulary ({V})")
        V = int(vocab_size)
    if int(input_ids.max()) >= V or int(input_ids.min()) < 0:
        raise ValueError(f"input_ids must lie in [0, {V})")
    return V
