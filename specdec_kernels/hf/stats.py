"""Counters and the phase timer of one ``speculative_generate`` call."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

PHASES = ("prefill", "draft", "target", "verify", "commit", "other")


@dataclass
class SpeculativeStats:
    """Counters of one ``speculative_generate`` call.

    ``time_s`` splits the wall time into the prompts' prefill (the target's and the drafter's), draft
    forwards (and draft sampling), the target's verification forward, verification, cache commit
    (with the step's one host synchronisation) and everything else. On a GPU the phases are timed
    without extra synchronisation, so asynchronous work is attributed to the phase that waits for
    it (``exact_timing=True`` synchronises instead).
    """

    num_draft_tokens: int
    num_drafts: int
    steps: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    proposed: int = 0  # draft tokens offered to the verifier, summed over requests and steps
    nodes: int = 0  # draft-token slots the target scored (tree nodes), summed over requests and steps
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
        """Share of wall time per phase (prefill, draft, target, verify, commit, other)."""
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

    def record_step(self, result, rows: list[int]) -> None:
        """Adds one step's counts (``result``: the session's StepResult for the batch rows ``rows``)."""
        g = result.drafted
        self.target_forwards += 1
        self.draft_forwards += result.draft_forwards
        self.steps += 1
        self.draft_length_histogram[g] = self.draft_length_histogram.get(g, 0) + 1
        acc = torch.tensor(result.accepted)
        self.proposed += sum(result.offered)
        self.nodes += result.nodes * len(result.offered)
        self.accepted += int(acc.sum())
        self.rejections += int((acc < torch.tensor(result.offered)).sum())
        self.request_steps += len(result.accepted)
        self.new_tokens += sum(result.emitted)
        self.accepted_length_histogram.index_put_((torch.tensor(rows), acc), torch.ones_like(acc), accumulate=True)

    def finish(self, wall_time_s: float) -> None:
        """Sets the wall time; "other" is what the timed phases leave of it."""
        self.wall_time_s = wall_time_s
        timed = sum(v for k, v in self.time_s.items() if k != "other")
        self.time_s["other"] = max(0.0, wall_time_s - timed)


@dataclass
class SpeculativeOutput:
    sequences: torch.Tensor  # [B, T + new] int64: prompt (as given) + generated, pad_token_id after EOS
    stats: SpeculativeStats


class PhaseTimer:
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
