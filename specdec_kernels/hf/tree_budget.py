"""How big a dynamic draft tree to grow each step (``draft_tree="dynamic"`` with ``adaptive_draft``).

The arms are the shapes a step may take, by depth d (d draft forwards per step):

* the tree of depth d: ``min(N, k * d)`` nodes, k = ``tree_width`` children per node (d <= ceil(N / k);
  a shaped tree, ``tree_threshold`` > 0, up to ``min(N, MAX_SHAPED_DEPTH)`` deep, its nodes a budget);
* the chain of d drafts (width 1), for d <= min(N, ``MAX_CHAIN``): the fallback when trees do not pay
  (on a CPU the target's forward over 1 + N rows can cost much more than over 1 + d).

Expected tokens per step and request follow the chain policy's geometric model
(``draft_length.expected_tokens``), with one per-depth acceptance for chains and one for trees,
each estimated from the steps that used that kind (accepted drafts over drafts tested). The cost of a
step is, as for chains, either measured (the wall times of this call's own steps per arm and number
of active requests; the default when greedy) or the shape model (``draft_length.shape_cost``: d draft
forwards at c, each node a tree's forward feeds past its first at c * e more, and the target's rows
past ``FREE_ROWS`` at r each; e, r > 0 on a CPU; the default when sampling, so a seeded call is
reproducible). Measured times are remembered per (target, draft) pair
and tree settings for the process, as the chain policy's are (``draft_length.pair_step_times``): the
first call explores the arms, later calls start informed (up to 8 tree and 8 chain arms: a short
call that starts from nothing spends many of its steps trying them). The arm is decided on the host
from past steps only: the tree's shape never depends on this step's draws or on the verifier's random
numbers, and the output stays exact.

Node threshold (shaped trees, measured cost): a node whose path the draft scores s adds about s
tokens to a step and its target row c seconds; at the step's rate r (tokens per second per request)
it pays when s > c * r. ``RowCost`` fits c from the steps' times, draft forwards and node columns
(they vary apart from step to step in a shaped tree), and ``node_threshold`` raises the step's
``tree_threshold`` to c * r (at most MAX_NODE_THRESHOLD). Set ``SPECDEC_FIXED_TREE_THRESHOLD=1`` to
keep the user's threshold (benchmarks of before / after in one checkout).
"""

from __future__ import annotations

import math
import os

import torch

from .draft_length import (
    EXPLORE_WITHIN,
    REFRESH_EVERY,
    StepTimes,
    acceptance_estimate,
    expected_tokens,
    pair_memory,
    shape_cost,
)

MAX_CHAIN = 8  # the chain fallback's longest length (the chain policy's lengths past 8 never won on our pairs)
# The node threshold's fit (``RowCost``) forgets a step by this factor per later step (memory ~32 steps,
# as the chain policy's acceptance) and needs this many timed steps before it is used.
ROW_COST_MEMORY, ROW_COST_MIN_STEPS = 32, 8
# A learned node threshold never exceeds this: a node the draft gives a 1-in-2 chance always pays its row.
MAX_NODE_THRESHOLD = 0.5
FIXED_THRESHOLD_ENV = "SPECDEC_FIXED_TREE_THRESHOLD"  # 1: no learned threshold (benchmarks of before / after)


def learned_threshold_on() -> bool:
    """Whether shaped trees learn their node threshold (not when ``SPECDEC_FIXED_TREE_THRESHOLD=1``)."""
    return os.environ.get(FIXED_THRESHOLD_ENV, "0") in ("", "0")


def pair_tree_times(target, draft, settings: tuple) -> dict[int, StepTimes]:
    """The measured step times of a (target, draft) pair's tree and chain arms for ``settings`` (the
    drafter's node budget, width, threshold and lookup branch: what the arms' steps cost), per number
    of active requests; kept in the pair's memory beside the chain policy's (``pair_memory``)."""
    return pair_memory(target, draft).setdefault(("tree", settings), {})


def pair_row_costs(target, draft, settings: tuple) -> dict[int, RowCost]:
    """The node-cost fits (``RowCost``) of a pair's tree steps for ``settings``, per number of active
    requests, kept for the process beside ``pair_tree_times``."""
    return pair_memory(target, draft).setdefault(("tree rows", settings), {})


class RowCost:
    """What one more tree node costs a step, learned from the steps themselves: a least-squares fit of
    step seconds = a + b * (draft forwards) + c * (node columns the target scored), each step weighted
    by (1 - 1 / ROW_COST_MEMORY) ** (steps after it). A shaped tree's depth and node count vary from
    step to step, which is what separates b from c. ``per_node()``: c in seconds, None until the fit
    has ROW_COST_MIN_STEPS steps and both kinds of variation (else it cannot tell them apart)."""

    def __init__(self):
        self.gram = [[0.0] * 4 for _ in range(4)]  # weighted sums of x_i x_j over x = (1, forwards, nodes, seconds)
        self.steps = 0

    def add(self, forwards: int, nodes: int, seconds: float) -> None:
        keep = 1 - 1 / ROW_COST_MEMORY
        x = (1.0, float(forwards), float(nodes), float(seconds))
        self.gram = [
            [keep * g + xi * xj for g, xj in zip(row, x, strict=True)] for row, xi in zip(self.gram, x, strict=True)
        ]
        self.steps += 1

    def per_node(self) -> float | None:
        if self.steps < ROW_COST_MIN_STEPS:
            return None
        gram = torch.tensor(self.gram, dtype=torch.float64)
        a, rhs = gram[:3, :3], gram[:3, 3]
        if torch.linalg.matrix_rank(a, rtol=1e-3) < 3:  # depth and nodes (nearly) never varied apart
            return None
        return float(torch.linalg.solve(a, rhs)[2])


class TreeBudgetPolicy:
    """``choose`` returns the step's node budget and sets ``width`` (k, or 1 for a chain arm)."""

    def __init__(
        self,
        nodes: int,
        width: int,
        cost: float,
        measured: bool,
        max_depth: int | None = None,
        times=None,
        chain_times=None,
        row_costs=None,
        row_cost: float = 0.0,
        draft_row_cost: float = 0.0,
    ):
        """times: where measured step times live (``pair_tree_times``; default: this policy only).
        chain_times: active -> the chain policy's measured step seconds per draft length for this pair
        (``draft_length.pair_step_times``), the first guess for a chain arm this policy has not timed.
        row_costs: where the node-cost fits live per number of active requests (default: this policy).
        row_cost: the shape model's target row past FREE_ROWS (``draft_length.row_cost_estimate``).
        draft_row_cost: the shape model's draft row past a forward's first, in draft forwards
        (``draft_length.draft_row_cost_estimate``): a tree's forwards at depths 1 .. d - 1 feed up to
        k nodes each."""
        self.cost, self.measured, self.row_cost = cost, measured, row_cost
        self.draft_row_cost = draft_row_cost
        depths = max_depth or math.ceil(nodes / width)  # a shaped tree (tree_threshold) may go deeper
        self.arms = [("tree", d, min(nodes, width * d), width) for d in range(1, depths + 1)]
        if width > 1:
            self.arms += [("chain", d, d, 1) for d in range(1, min(nodes, MAX_CHAIN) + 1)]
        self.counts = {"tree": [0, 0], "chain": [0, 0]}  # kind -> [accepted, rejections]
        self.last = (0, 0)  # the call's accepted / rejections when the last arm was chosen
        self.arm, self.width = self.arms[0], width  # (choose picks the first step's arm)
        # active requests -> running mean step seconds per arm
        self.times: dict[int, StepTimes] = {} if times is None else times
        self.chain_times = chain_times
        self.steps = 0
        self.row_costs: dict[int, RowCost] = {} if row_costs is None else row_costs  # active -> fit
        self.rate = 0.0  # the chosen arm's predicted tokens per second per request (measured policies)
        self.active = 1  # active requests at the last choice

    def _rate(self, arm, times: dict, chain: dict) -> float:
        kind, d = arm[0], arm[1]
        tokens = expected_tokens(acceptance_estimate(*self.counts[kind]), d)
        return tokens / self._seconds(arm, times, chain)

    def _seconds(self, arm, times: dict, chain: dict) -> float:
        """Measured, else the chain policy's measured step of that length (a chain arm), else scaled by
        the shape model from the nearest measured arm (same kind first). The shape model prices the
        target's rows (1 + nodes) past FREE_ROWS at ``row_cost`` each: on a CPU a tree step over 4x the
        rows cost 2.1x the chain's (Qwen pair, 2026-11-27); without it a tree and a chain of one depth
        cost alike and a chain never looked worth a try until measured."""
        shape = self._shape(arm)
        if not times:
            return shape
        if arm in times:
            return times[arm]
        if arm[0] == "chain" and arm[1] in chain:
            return chain[arm[1]]
        near = min(times, key=lambda m: (m[0] != arm[0], abs(m[1] - arm[1]), m[1]))
        return times[near] * shape / self._shape(near)

    def _shape(self, arm) -> float:
        """The shape model's step of ``arm`` in target forwards. Depth d means d draft forwards: the
        first feeds the committed tokens, the one at depth j < d that depth's nodes (at most k); the
        rows past one a forward cost ``draft_row_cost`` each (a chain feeds one node a forward)."""
        _, depth, nodes, width = arm
        extra_rows = max(0, min(nodes, width * (depth - 1)) - (depth - 1))
        return shape_cost(depth + self.draft_row_cost * extra_rows, 1 + nodes, self.cost, self.row_cost)

    def choose(self, accepted: int, rejections: int, active: int) -> int:
        kind = self.arm[0]
        self.counts[kind][0] += accepted - self.last[0]
        self.counts[kind][1] += rejections - self.last[1]
        self.last = (accepted, rejections)
        times = self.times.setdefault(active, StepTimes()).seconds if self.measured else {}
        chain = self.chain_times(active).seconds if self.measured and self.chain_times is not None else {}
        # ties: the tree (asked for), then the shallower arm
        rates = {arm: self._rate(arm, times, chain) for arm in self.arms}
        best = max(rates, key=lambda a: (rates[a] * (1 + 1e-9), a[0] == "tree", -a[1]))
        choice = best
        if times:
            unmeasured = [a for a in rates if a not in times and rates[a] >= EXPLORE_WITHIN * rates[best]]
            if unmeasured:  # try each plausible arm once (then the measurements decide)
                choice = min(unmeasured, key=lambda a: (a[0] != best[0], abs(a[1] - best[1]), a[1]))
            elif self.steps % REFRESH_EVERY == REFRESH_EVERY - 1:  # keep a neighbour's time fresh
                same = [a for a in self.arms if a[0] == best[0] and abs(a[1] - best[1]) == 1]
                choice = same[(self.steps // REFRESH_EVERY) % len(same)] if same else best
        self.arm, self.width = choice, choice[3]
        self.rate = rates[choice] if times else 0.0
        self.active = active
        return choice[2]

    def node_threshold(self) -> float:
        """The path score below which a shaped tree's node costs more than it brings (0: unknown).

        A node whose path the draft scores s adds about s accepted tokens to its request's step (the
        chance the verifier walks through it) and its row c seconds to the step (``RowCost``, fitted
        per number of active requests); at the step's predicted rate r (tokens per second per
        request) it pays when s / c > r, i.e. s > c * r. On the 2-core EPYC a Qwen 1.5B target row
        costs ~20-25 ms of a ~0.8 s step committing ~4-5 tokens: s > ~0.1-0.15, where 0.05 was the default
        guess. Decided from past steps only (exactness as for the arms)."""
        if not learned_threshold_on():
            return 0.0
        fit = self.row_costs.get(self.active) if self.measured else None
        c = fit.per_node() if fit is not None else None
        if c is None or c <= 0.0 or self.rate <= 0.0:
            return 0.0
        return min(c * self.rate, MAX_NODE_THRESHOLD)

    def observe_chain(self, accepted: int, rejections: int) -> None:
        """A tree step's chain-equivalent counts (``dynamic_tree.chain_equivalent``): the chain arms'
        acceptance learns from tree steps too, so a chain is judged on what it would accept here, not
        on the prior while the policy grows trees."""
        self.counts["chain"][0] += accepted
        self.counts["chain"][1] += rejections

    def record(self, nodes: int, active: int, seconds: float, shape: tuple[int, int] | None = None) -> None:
        """The step's wall time (the call's first step is skipped: it pays one-off costs); ``shape``
        (the draft forwards the step ran, the node columns the target scored) feeds the node-cost fit."""
        self.steps += 1
        if self.measured and self.steps > 1:
            self.times.setdefault(active, StepTimes()).add(self.arm, seconds)
            if shape is not None:
                self.row_costs.setdefault(active, RowCost()).add(*shape, seconds)
