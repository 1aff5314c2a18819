"""How many tokens to draft per step (adaptive drafting of ``speculative_generate``, chains).

A chain of g drafts with per-draft acceptance a commits ``(1 - a^(g+1)) / (1 - a)`` tokens per step.
What a step costs depends on the hardware as much as on the models: a draft forward's share of the
target's, and how the target's verification forward grows with its g + 1 tokens (on a CPU, BLAS picks
another kernel past a few rows: a 1.5B target's 4-token forward cost 1.8x its 3-token one on the
2-core machine this was measured on, while 1 to 3 tokens cost about the same). The policy maximises
expected tokens per second with one of two cost models:

* ``shapes``: a step of g drafts costs ``1 + g * c + r * max(0, g + 1 - FREE_ROWS)`` target
  forwards, c from the models' shapes (:func:`draft_cost_estimate`) or given, r what a row of the
  target's forward past ``FREE_ROWS`` adds (:func:`row_cost_estimate`: on a CPU a row's arithmetic
  outgrows the weight read; 0 on a GPU). Timing-free: a seeded sampled call draws the same tokens
  every time.
* ``measured``: the wall time of the steps themselves, per draft length and per number of active
  requests, remembered per (target, draft) pair for the process (so it is measured once per pair:
  the first call explores, later ones start informed). Used by default for greedy decoding, where
  the output is the target's greedy output whatever the draft lengths.

Either way the length is decided on the host from past steps only (no synchronisation), so the
output stays exact: the number of drafts never depends on the drafts it would propose.

**Target-only steps (G = 0).** When the draft accepts little, a draft forward costs more than the
tokens it adds: a step of g drafts commits ``expected_tokens(a, g)`` tokens for its cost, a plain
target step (no draft forward, one target forward over the pending token, the next token drawn
from the target's row as a bonus token is) commits exactly 1 for its own. The policy takes G = 0
when its rate beats every g >= 1 (ties go to drafting); its cost is measured as any arm's
(``measured``) or is 1 target forward (``shapes``). A target-only step tests no draft, so nothing
would ever bring the policy back: after ``PROBE_EVERY`` of them in a row it drafts once (the best
g >= 1) to re-test the draft, and the acceptance it reads forgets old steps (``ACCEPTANCE_MEMORY``),
so a few accepted probes make it draft again when the text becomes predictable. The draft cache
lags behind during target-only steps; the next drafting step feeds the draft the tokens it missed
in its first forward (``hf/drafters/model.py``). That catch-up inflates the step's time, so a
drafting step right after a target-only one is not timed. ``adaptive_draft=False`` (G pinned)
never takes a target-only step: that call has no policy.

Why the output law is unchanged: a step's G (0 included) is a function of the past steps' accepted
counts and wall times only, fixed before the step's drafts are drawn and before its verification
draws its random numbers. Given G, the step's tokens follow the target's law exactly: for G >= 1 by
the verifier's theorem, for G = 0 because the verifier with zero drafts draws the bonus token from
the target's processed row (``sk.verify``, as after an all-accepted chain). So every committed token
is drawn from the target's law given the tokens before it, whatever sequence of G's ran; only the
random numbers consumed differ (a seeded ``measured`` call is reproducible only up to timing, as before).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass, field

from torch import nn

from .cpu_f32 import NativeLinear
from .cpu_int4 import Int4Linear
from .cpu_int8 import Int8Linear
from .cpu_linear import MIN_ROWS

PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.7, 4  # acceptance before any test: 0.7, worth 4 tested drafts
EXPLORE_WITHIN = 0.7  # an unmeasured length is tried once if its predicted rate is within 70% of the best
REFRESH_EVERY = 16  # every 16th timed step re-measures a neighbour of the best length
SMOOTHING = 0.3  # weight of a new step time in its length's running mean
# Acceptance estimates stay inside [1%, 99%]: expected_tokens divides by 1 - a, and a draft never
# judged hopeless (or perfect) keeps every arm comparable.
ACCEPTANCE_BOUNDS = (0.01, 0.99)
# After 8 target-only steps in a row one drafting step re-tests the draft: it costs at most the
# drafting arm's loss (a draft forward over the ~9 tokens it missed plus its chain) once per 9 steps,
# a few % of a step when drafting loses, and lets the policy see the text become predictable again.
PROBE_EVERY = 8
# The policy's acceptance weighs a tested draft by (1 - 1/32)^(drafts tested after it): stationary
# text gets the estimate of the last ~32 drafts (error ~0.08 at a = 0.3), and after a change a few
# probes move it (5 accepted one-draft probes take 0.15 to ~0.3 when the draft becomes good).
ACCEPTANCE_MEMORY = 32
# Set to 1 to turn the target-only arm off (benchmarks of before / after in one checkout).
NO_TARGET_ONLY_ENV = "SPECDEC_NO_TARGET_ONLY_STEPS"


# A CPU forward's fixed cost per decoder layer (framework dispatch, norms, rotary, attention over a short
# cache) in bytes of weights it could have read instead: ~1 ms a layer at ~25 GB/s on the 2-core AMD
# EPYC where it was measured (Qwen2.5-Coder 1.5B fp32 / 0.5B bf16: 278 / 65 ms per token with oneDNN
# linears; 6.2 / 0.99 GB of weights). It predicts the 0.5B bf16 draft at 0.23 of the fp32 target
# (measured 0.23) and the embedded demo pair at 0.11.
CPU_LAYER_BYTES = 25e6
# A CPU's arithmetic per byte of weights it streams (its FLOP/s over its bytes/s): a forward of r rows
# does 2 r FLOPs per weight, so rows past FREE_ROWS make it compute-bound. 6.9 on the 2-core AMD
# EPYC (1 thread): each row past 4 of the Qwen2.5-Coder 1.5B fp32 target's forward cost 20-25 ms of a
# 341 ms one-row forward (bench/bench_forward_rows.py), r = 0.065 by row_cost_estimate.
CPU_FLOPS_PER_BYTE = 6.9
# What each row past the first adds to a CPU draft forward that feeds several tree nodes, per decoder
# layer, in bytes of weights it could have read instead: the per-row work around the linears (attention
# over the cache, norms, rotary, activation quantisation), ~0.24 ms a layer-row at ~25 GB/s. Measured
# on the 2-core AMD EPYC (1 thread, 256 cached tokens): the 0.5B int8 draft's 4-row forward cost
# 1.44-1.50x its 1-row one (30-32 ms), 0.13-0.17 a row; this gives 0.13 (draft_row_cost_estimate).
CPU_LAYER_ROW_BYTES = 6e6
# Rows a forward scores at about a one-row forward's cost: oneDNN's linears pad 1-3 rows to 4
# (hf/cpu_linear.MIN_ROWS), and a GPU's 64 (the shape model prices no row there: r = 0).
FREE_ROWS = MIN_ROWS


def draft_cost_estimate(target, draft) -> float:
    """A draft forward's cost relative to the target's, from the two models' shapes (not timings, so
    that a seeded call draws the same tokens every time).

    On the CPU: weight bytes (what a decoding forward streams) plus a fixed cost per layer
    (``CPU_LAYER_BYTES``), so a bf16 draft counts half its parameters. Elsewhere (GPU): the mean of
    the parameter ratio and the layer ratio, the layer term standing for per-layer launch overhead,
    which dominates eager forwards of small models there."""

    (n_t, b_t, _, l_t, device), (n_d, b_d, _, l_d, _) = _shape(target), _shape(draft)
    if device == "cpu":
        return _one_row_bytes(b_d, l_d) / max(_one_row_bytes(b_t, l_t), 1.0)
    return 0.5 * (n_d / max(n_t, 1)) + 0.5 * (l_d / l_t)


def row_cost_estimate(target) -> float:
    """What each row of the target's forward past ``FREE_ROWS`` adds, relative to its one-row
    forward, from its shape (timing-free, as :func:`draft_cost_estimate`): on the CPU the row's
    2 FLOPs per streamed weight at ``CPU_FLOPS_PER_BYTE`` over the one-row forward's bytes and layer
    costs (an fp32 1.5B target: 0.065); 0 on a GPU."""
    _, nbytes, weights, layers, device = _shape(target)
    if device != "cpu":
        return 0.0
    return 2.0 * weights / CPU_FLOPS_PER_BYTE / max(_one_row_bytes(nbytes, layers), 1.0)


def draft_row_cost_estimate(draft) -> float:
    """What each row past the first adds to a draft forward, relative to its one-row forward, from its
    shape (timing-free, as :func:`draft_cost_estimate`): on the CPU ``CPU_LAYER_ROW_BYTES`` per layer
    over the one-row forward's bytes and layer costs (the 0.5B int8 draft: 0.13); 0 on a GPU. A tree
    step's draft forwards feed up to k nodes each, a chain's one."""
    _, nbytes, _, layers, device = _shape(draft)
    if device != "cpu":
        return 0.0
    return layers * CPU_LAYER_ROW_BYTES / max(_one_row_bytes(nbytes, layers), 1.0)


def _one_row_bytes(nbytes: int, layers: int) -> float:
    """A one-row CPU forward's cost in bytes of weights: what it streams plus ``CPU_LAYER_BYTES`` a layer."""
    return nbytes + layers * CPU_LAYER_BYTES


def _shape(model) -> tuple[int, int, int, int, str]:
    """What the shape models read of a model: (parameters, streamed bytes, streamed weights
    (``_streamed``), decoder layers, device type; "cpu" for a model without parameters)."""
    params = list(model.parameters())
    device = params[0].device.type if params else "cpu"
    layers = max(1, int(model.config.get_text_config(decoder=True).num_hidden_layers))
    return (sum(p.numel() for p in params), *_streamed(model), layers, device)


def shape_cost(forwards: float, rows: int, cost: float, row_cost: float) -> float:
    """The shape model's step, in target forwards: ``forwards`` one-row draft forwards at ``cost``
    each (a tree's wider forwards count more: ``tree_budget``) and a target forward over ``rows`` rows
    (``row_cost`` for each past ``FREE_ROWS``)."""
    return 1.0 + forwards * cost + row_cost * max(0, rows - FREE_ROWS)


def _streamed_bytes(model) -> int:
    return _streamed(model)[0]


def _streamed(model) -> tuple[int, int]:
    """(Bytes, weights) a one-token forward reads: every parameter but the input embedding (of which
    it reads one row) unless that matrix is also the output layer (tied), plus the weights of linear
    layers swapped for oneDNN, native fp32, int8 or int4 ones (``hf/cpu_linear.py``, ``hf/cpu_f32.py``,
    ``hf/cpu_int8.py``, ``hf/cpu_int4.py``), which are not parameters (native fp32: its panels, rows
    padded to 16; int8: a byte a weight and an fp32 scale a row; the native kernel's also an int32 row
    sum and padding; int4: half a byte a weight and an fp16 scale per 32)."""
    embedding = model.get_input_embeddings()
    output = model.get_output_embeddings()
    tied = embedding is not None and isinstance(output, nn.Linear) and output.weight is embedding.weight
    skip = {id(embedding.weight)} if embedding is not None and not tied else set()
    kept = [p for p in model.parameters() if id(p) not in skip]
    nbytes, weights = sum(p.numel() * p.element_size() for p in kept), sum(p.numel() for p in kept)
    for m in model.modules():
        packed = getattr(m, "packed_weight", None)
        if packed is not None:
            nbytes += m.in_features * m.out_features * packed.element_size()
            weights += m.in_features * m.out_features
        elif isinstance(m, NativeLinear):
            nbytes += m.packed.numel() * m.packed.element_size()
            weights += m.in_features * m.out_features
        elif isinstance(m, Int8Linear):
            if m.kernel == "native":  # its panels (rows padded to 16, inputs to 4), scales and row sums
                nbytes += m.wq.numel() + 4 * m.sw.numel() + 4 * m.wsum.numel()
            else:
                nbytes += m.in_features * m.out_features + 4 * m.out_features
            weights += m.in_features * m.out_features
        elif isinstance(m, Int4Linear):
            nbytes += m.wq.numel() + m.ws.numel() * m.ws.element_size()
            weights += m.in_features * m.out_features
    return nbytes, weights


def acceptance_estimate(accepted: int, rejections: int) -> float:
    """Per-position acceptance, the maximum-likelihood estimate of the geometric model (accepted
    drafts over drafts tested: every accepted one, plus one rejection per step that ended in one),
    shrunk towards the prior while few drafts have been tested."""
    a = (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (accepted + rejections + PRIOR_WEIGHT)
    return _bounded(a)


def _bounded(a: float) -> float:
    lo, hi = ACCEPTANCE_BOUNDS
    return min(max(a, lo), hi)


def expected_tokens(a: float, g: int) -> float:
    """Tokens one step of g drafts commits per request: accepted drafts + the recovered/bonus one."""
    return (1 - a ** (g + 1)) / (1 - a)


def best_by_shapes(a: float, G_max: int, cost: float, target_only: bool = False, row_cost: float = 0.0) -> int:
    """The g in 1..G_max with the most expected tokens per ``shape_cost(g, g + 1, cost, row_cost)``
    target forwards (shorter on near-ties); with ``target_only``, 0 (1 token per target forward)
    where it beats them all by more than a near-tie."""
    best, best_rate = 1, 0.0
    for g in range(1, G_max + 1):
        rate = expected_tokens(a, g) / shape_cost(g, g + 1, cost, row_cost)
        if rate > best_rate * (1 + 1e-3):
            best, best_rate = g, rate
    return 0 if target_only and 1.0 > best_rate * (1 + 1e-3) else best


@dataclass
class StepTimes:
    """Running mean wall time of a step per draft length (one number of active requests)."""

    seconds: dict = field(default_factory=dict)  # g -> running mean of a step's wall time
    timed_steps: int = 0

    def add(self, g: int, seconds: float) -> None:
        old = self.seconds.get(g)
        self.seconds[g] = seconds if old is None else (1 - SMOOTHING) * old + SMOOTHING * seconds
        self.timed_steps += 1

    def predicted(self, g: int, cost: float) -> float:
        """A step's time for g drafts: measured, else scaled by the shape model from the measured
        length nearest to g."""
        if g in self.seconds:
            return self.seconds[g]
        near = min(self.seconds, key=lambda m: (abs(m - g), m))
        return self.seconds[near] * (1 + g * cost) / (1 + near * cost)


# target -> draft -> what the policies remember of the pair for the process; weak, so the models can be freed
_PAIR_TIMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pair_memory(target, draft) -> dict:
    """The process's memory of a (target, draft) pair: the chain policy's step times per number of
    active requests (``pair_step_times``), the tree policy's per tree setting (``tree_budget``)."""
    per_draft = _PAIR_TIMES.setdefault(target, weakref.WeakKeyDictionary())
    return per_draft.setdefault(draft, {})


def pair_step_times(target, draft, active: int) -> StepTimes:
    return pair_memory(target, draft).setdefault(active, StepTimes())


_FORCED: list[list[int]] = []  # test hook: the schedules of ``forced_lengths`` blocks, innermost last


@contextlib.contextmanager
def forced_lengths(schedule: list[int]):
    """Test hook: inside the block the i-th step of every adaptive call drafts
    ``min(schedule[i % len(schedule)], G_max)`` tokens, 0 being a target-only step. It forces the
    policy's choice only: a call with ``adaptive_draft=False`` (no policy) still drafts G every step."""
    if not schedule or any(int(g) != g or g < 0 for g in schedule):
        raise ValueError(f"forced_lengths needs a non-empty list of ints >= 0, got {schedule!r}")
    _FORCED.append([int(g) for g in schedule])
    try:
        yield
    finally:
        _FORCED.pop()


class DraftLengthPolicy:
    """Chooses the drafts of each step (0 to G_max; 0 is a target-only step) and learns from the
    steps' wall times when ``measured`` (see the module docstring). ``target_only=False`` (or the
    environment variable ``SPECDEC_NO_TARGET_ONLY_STEPS=1``) keeps every step at g >= 1. ``draft``: what
    the pair's measured times are kept under (the draft model, or its restricted output layer)."""

    def __init__(
        self, target, draft, G_max: int, cost: float, measured: bool, target_only: bool = True, row_cost: float = 0.0
    ):
        self.target, self.draft, self.G_max, self.cost, self.measured = target, draft, G_max, cost, measured
        self.row_cost = row_cost  # the shape model's target row past FREE_ROWS (row_cost_estimate)
        self.lowest = 1 if not target_only or os.environ.get(NO_TARGET_ONLY_ENV, "0") not in ("", "0") else 0
        self.steps = 0  # steps recorded
        self.chosen = 0  # steps chosen (the forced schedule's index)
        self.target_only_run = 0  # target-only steps since the last drafting step
        self.previous: int | None = None  # the last recorded step's drafts
        # decayed (accepted, rejections), starting at the prior; the call's totals seen so far
        self.recent = [PRIOR_ACCEPTANCE * PRIOR_WEIGHT, (1 - PRIOR_ACCEPTANCE) * PRIOR_WEIGHT]
        self.seen = (0, 0)

    def acceptance(self, accepted: float, rejections: float) -> float:
        """The per-draft acceptance from the call's running totals: the geometric model's estimate
        (as :func:`acceptance_estimate`) over exponentially forgotten counts, the prior included."""
        new_accepted, new_rejections = accepted - self.seen[0], rejections - self.seen[1]
        self.seen = (accepted, rejections)
        if new_accepted or new_rejections:
            keep = (1 - 1 / ACCEPTANCE_MEMORY) ** (new_accepted + new_rejections)
            self.recent = [keep * self.recent[0] + new_accepted, keep * self.recent[1] + new_rejections]
        return _bounded(self.recent[0] / sum(self.recent))

    def choose(self, accepted: int, rejections: int, active: int) -> int:
        a = self.acceptance(accepted, rejections)
        if _FORCED:
            schedule = _FORCED[-1]
            g = min(schedule[self.chosen % len(schedule)], self.G_max)
        else:
            g = self._best(a, active, self.lowest)
            if g == 0 and self.target_only_run >= PROBE_EVERY:  # re-test the draft now and then
                g = self._best(a, active, 1)
        self.chosen += 1
        self.target_only_run = self.target_only_run + 1 if g == 0 else 0
        return g

    def _best(self, a: float, active: int, lowest: int) -> int:
        """The arm in lowest..G_max to run next: the best, an unmeasured plausible one, or now and
        then a neighbour of the best (to keep its time fresh)."""
        times = pair_step_times(self.target, self.draft, active) if self.measured else None
        if times is None or not times.seconds:
            return best_by_shapes(a, self.G_max, self.cost, target_only=lowest == 0, row_cost=self.row_cost)
        rates = {g: expected_tokens(a, g) / times.predicted(g, self.cost) for g in range(lowest, self.G_max + 1)}
        best = max(rates, key=lambda g: (rates[g], g > 0, -g))  # ties: drafting, then shorter
        unmeasured = [g for g in rates if g not in times.seconds and rates[g] >= EXPLORE_WITHIN * rates[best]]
        if unmeasured:  # try each plausible length once (then the measurements decide)
            return min(unmeasured, key=lambda g: (abs(g - best), g))
        if times.timed_steps % REFRESH_EVERY == REFRESH_EVERY - 1:  # keep the neighbours' times fresh
            side = -1 if (times.timed_steps // REFRESH_EVERY) % 2 else 1
            return min(max(best + side, lowest), self.G_max)
        return best

    def record(self, g: int, active: int, seconds: float, shape: tuple[int, int] | None = None) -> None:
        """A step's wall time. Not timed: the call's first step (it pays one-off costs) and a
        drafting step right after a target-only one (its draft forward also catches up). ``shape``
        (draft forwards, node columns) is the tree policy's; a chain's cost is per length."""
        self.steps += 1
        catching_up = g > 0 and self.previous == 0
        self.previous = g
        if self.measured and self.steps > 1 and not catching_up:
            pair_step_times(self.target, self.draft, active).add(g, seconds)
