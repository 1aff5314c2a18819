"""The state of one generate call and its step: draft -> target forward -> verify -> commit.

The step does not know which drafter it runs: the drafter proposes (``hf/drafters``), the target
scores root + proposal in **one** forward through the tree-attention backend, the proposal verifies
the logits with the fused kernels, and the commit keeps exactly the committed tokens in the target
cache (the accepted root-to-node path gathered into contiguous slots, ``cache.commit_paths``) while
the drafter commits its own state. Requests that finish (EOS, max_new_tokens) leave the batch.

Invariant between steps: the target cache holds every committed token but the last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import tree_attention_metadata
from .cache import commit_paths, select_requests
from .config import SpecConfig
from .drafters.base import Drafter, Verified
from .forwards import forward, prefill
from .processors import node_paths
from .stats import PhaseTimer, SpeculativeStats


@dataclass
class Batch:
    """The active requests: position a of every [A] tensor is original request ``rows[a]``."""

    rows: list[int]
    index: torch.Tensor  # [A] int64 on the device: rows
    target_cached: torch.Tensor  # [A] int64: committed tokens in the target cache (= len - 1)
    attention_backend: str = "auto"

    def keep(self, positions: list[int]) -> torch.Tensor:
        """Keeps the requests at ``positions``; returns them as a device index [A']."""
        index = torch.tensor(positions, dtype=torch.long, device=self.target_cached.device)
        self.rows = [self.rows[p] for p in positions]
        self.index = self.index[index]
        self.target_cached = self.target_cached[index]
        return index


@dataclass
class Tokens:
    """Committed tokens of every original request, on the device: seq[b, :length[b]] = prompt + output."""

    seq: torch.Tensor  # [B, W] int64
    length: torch.Tensor  # [B] int64
    generated: torch.Tensor  # [B] int64: output tokens so far
    history: list[list[int]] | None  # host copies, kept only where a host-side drafter needs them

    @classmethod
    def start(cls, prompts: list[list[int]], room: int, device, keep_history: bool) -> Tokens:
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
class StepResult:
    """What the host learns from one step (one transfer): per active row, in batch order."""

    accepted: list[int]
    emitted: list[int]  # tokens committed after the max_new_tokens / EOS cut
    finished: list[bool]
    offered: list[int]
    tokens: list[list[int]] | None  # the emitted tokens (streamer / host-side drafter only)
    drafted: int  # draft tokens per chain this step (fewer than asked when drafting stopped early)
    draft_forwards: int = 0  # the drafter's forwards this step
    nodes: int = 0  # draft-token slots the target scored per request (a tree's nodes, K * drafted for chains)


class Session:
    """Target, drafter, caches and settings of one generate call; ``step`` runs draft -> verify -> commit."""

    def __init__(
        self,
        target,
        drafter: Drafter,
        prompts: list[list[int]],
        config: SpecConfig,
        device,
        *,
        timer: PhaseTimer | None = None,
        target_forward=None,
        keep_history: bool = False,
    ):
        """Prefills the target (and, through ``drafter.start``, the drafter) for ``prompts``.

        target_forward: a compiled ``target.forward`` or None (eager). The caches are StaticCaches
        of ``static_len`` slots with ``cache_implementation="static"``: the caches' shared end is the
        longest *unfinished* request's cached length (a finishing request keeps nothing of its last
        step, see ``_commit``), at most prompt + max_new - 2, plus the proposal's tree (+ 2 spare).
        """
        self.target, self.drafter, self.config, self.prompts = target, drafter, config, prompts
        self.device = torch.device(device)
        self.V = config.vocab_size
        self.sampling = dict(config.sampling, top_p_ties=config.top_p_ties)
        self.generator = torch.Generator().manual_seed(config.seed % 2**63)
        self.target_forward = target_forward
        self.nodes = 0  # the last step's draft-token slots per request (``StepResult.nodes``)
        self.timer = timer or PhaseTimer(SpeculativeStats(config.num_draft_tokens, config.num_drafts), False)
        longest = max(len(p) for p in prompts)
        self.static_len = None
        if config.cache_implementation == "static":
            self.static_len = longest + config.max_new_tokens + drafter.max_tree_nodes + 2
        self.eos = torch.tensor(sorted(config.eos), dtype=torch.long, device=device)
        # Medusa-like drafters read the prefill's hidden state at each prompt's end: the target then
        # keeps every position's output layer input (the hook sees what the output layer sees).
        every = drafter.reads_target_hidden
        with self.timer("prefill"):
            self.t_cache = prefill(target, prompts, device, self.static_len, every_position=every)
        self.t_len = max(0, longest - 1)  # slots in use (tracked on the host: no reads of cache counters)
        lens = torch.tensor([len(p) for p in prompts], device=device)
        A = len(prompts)
        self.batch = Batch(list(range(A)), torch.arange(A, device=device), lens - 1, config.attention_backend)
        room = min(config.max_new_tokens, 2**20) + drafter.max_tree_nodes + drafter.max_depth + 2
        self.grammar = None
        if config.grammar is not None:
            from .grammar import GrammarMasker

            self.grammar = GrammarMasker(config.grammar, self.V)
        # The rows' processing (None: the fused path): the processors (with the grammar between them
        # and the warpers), or the grammar alone: the draft's rows masked, the target's words handed
        # to the verifier (token_bitmask=; the kernels then apply temperature / top-k / top-p).
        self.processor = config.row_processor if config.row_processor is not None else self.grammar
        keep_history = keep_history or drafter.keeps_history or self.processor is not None
        self.tokens = Tokens.start(prompts, room, device, keep_history)
        with self.timer("prefill"):  # (the draft model's prefill)
            drafter.start(self)

    def check_room(self, which: str, used: int, new: int) -> None:
        """A forward appending ``new`` slots after ``used`` fits the static buffers (a host check: on
        CUDA an out-of-range cache write is a device assert, which kills the process)."""
        if self.static_len is not None and used + new > self.static_len:
            raise RuntimeError(
                f"internal error: the {which} StaticCache needs {used + new} slots but has {self.static_len}; "
                "please report this with the call's arguments"
            )

    def step(self, g: int | None = None) -> StepResult:
        """One speculative step with ``g`` drafts per chain (default G) for every active request.

        Target and drafter are committed and the tokens (cut at EOS / max_new_tokens) appended before
        returning; the caller drops finished requests (``drop_finished_rows``).
        """
        g = self.config.num_draft_tokens if g is None else g
        with self.timer("draft"):
            proposal = self.drafter.propose(self, g)
        with self.timer("target"):
            tree_start = self.t_len
            logits = self._target_forward(proposal)
            bitmask = None  # the grammar's words when it is the only processing (the verifier applies them)
            if self.processor is not None:  # each row with its own path's prefix
                tokens, parents, _ = proposal.nodes()
                paths = node_paths(tokens, parents)
                if self.processor is self.grammar:
                    bitmask = self.grammar.words(self, paths)
                else:
                    logits = self.processor(self, logits, paths)
        with self.timer("verify"):
            out, path = proposal.verify(
                logits, self.config.method, self.sampling, self.generator, self.config.verification, bitmask
            )
        with self.timer("commit"):
            return self._commit(proposal, out, path, tree_start)

    def _target_forward(self, proposal) -> torch.Tensor:
        """The target scores root + the proposal's tree in one forward: logits [A, 1 + N, V]."""
        batch = self.batch
        tokens, parents, num_nodes = proposal.nodes()
        N = 1 + tokens.shape[1]
        self.nodes = N - 1
        self.check_room("target", self.t_len, N)
        ids = torch.cat([self.tokens.last(batch.index, 1), tokens], dim=1)
        meta = tree_attention_metadata(
            parents,
            batch.target_cached,
            self.t_len,
            num_nodes=num_nodes,
            backend=batch.attention_backend,
            validate=False,
        )
        logits = forward(self.target, self.t_cache, ids, meta, self.V, self.target_forward)
        self.t_len += N
        return logits

    # ---- commit: one host synchronisation per step

    def _commit(self, proposal, out, path, tree_start: int) -> StepResult:
        batch, tokens, g = self.batch, self.tokens, proposal.depth
        device = batch.index.device
        A = len(batch.rows)
        accepted = out.num_accepted.long()
        # Tokens this step commits, cut at max_new_tokens and after the first EOS.
        new = out.tokens[:, : g + 1]
        col = torch.arange(g + 1, device=device)
        room = self.config.max_new_tokens - tokens.generated[batch.index]
        emitted = torch.minimum(accepted + 1, room)
        is_eos = torch.isin(new, self.eos) & (col < emitted[:, None])
        first_eos = torch.where(is_eos, col, g + 1).min(dim=1).values
        emitted = torch.minimum(emitted, first_eos + 1)
        finished = (emitted >= room) | (first_eos <= g)
        # The target keeps root + accepted path. A request that finishes keeps nothing (it leaves the
        # batch): its accepted drafts past the max_new_tokens cut would otherwise hold the caches'
        # shared end past the static bound for the others.
        t_lengths = torch.where(finished, 0, 1 + accepted)
        t_src = torch.cat([path.new_zeros(A, 1), path.clamp_min(0)], dim=1) + tree_start  # (path: [A, 0] when g = 0)
        verified = Verified(proposal, out, path, accepted, finished)
        lens = [(batch.target_cached + t_lengths).max()] + self.drafter.host_values(self, verified)
        packed = [accepted, emitted, finished.long(), proposal.offered(), torch.stack(lens)]
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
        verified.accepted_host = acc_h
        self.drafter.update(self, verified, new_lens[1:])
        step_tokens = None
        if with_tokens:
            flat_new = host[4 * A + len(lens) :]
            step_tokens = [flat_new[a * (g + 1) : a * (g + 1) + emit_h[a]] for a in range(A)]
            for b, t in zip(batch.rows, step_tokens, strict=True):
                tokens.history[b].extend(t)
            if self.grammar is not None:  # the matchers follow the committed tokens
                self.grammar.commit(batch.rows, step_tokens)
        finished_h = [bool(f) for f in fin_h]
        return StepResult(acc_h, emit_h, finished_h, off_h, step_tokens, g, proposal.draft_forwards, self.nodes)

    def drop_finished_rows(self, finished: list[bool]) -> None:
        keep = [a for a, done in enumerate(finished) if not done]
        if len(keep) < len(self.batch.rows):
            index = self.batch.keep(keep)
            select_requests(self.t_cache, index)
            self.drafter.select(index, keep)

    def drop_finished(self, done: list[bool]) -> None:
        """Drop requests by original index (before the first step)."""
        self.drop_finished_rows([done[b] for b in self.batch.rows])
