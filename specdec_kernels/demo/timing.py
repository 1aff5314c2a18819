"""How ``specdec demo`` times its rows so that they hold on a busy machine.

* The native CPU backend is built (or loaded from its cache) before anything is timed, with a
  one-line notice: a first run used to pay the ~1 min build inside its first verified step.
* Each speculative mode is timed in pairs interleaved per prompt (target, mode, target, mode, ...):
  both halves of a pair see the same load, so a neighbour process that starts or stops mid-run
  shifts both. The speedup is the median of the per-prompt ratios (target wall / mode wall), with
  their spread (lowest - highest), and the same for CPU time.
* A warning when the 1-minute load average exceeds the cores: then every number is suspect.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


def prepare_native_backend(device: str, out=None) -> None:
    """Build or load the native CPU backend now, before any timing (one line on ``out``)."""
    if device != "cpu":
        return
    out = out or sys.stderr
    from ..ops import csrc

    print("specdec demo: loading the native CPU backend (built once per machine, ~1 min)...", file=out, flush=True)
    try:
        csrc.load_cpu_core()
    except (ImportError, RuntimeError, OSError) as exc:  # auto then uses the vectorised PyTorch backend
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"specdec demo: native CPU backend unavailable ({first}); using the PyTorch backend", file=out)


def load_warning(cores: int | None = None) -> str | None:
    """A warning when the 1-minute load average exceeds the cores (None when it does not, or unknown)."""
    cores = cores or os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None
    if load <= cores:
        return None
    return (
        f"warning: load average {load:.1f} exceeds the {cores} cores: other processes compete for the CPU, "
        "timings are noisy (pairs are interleaved per prompt to keep the ratios comparable)"
    )


def timed(fn: Callable[[], object]) -> tuple[object, float, float]:
    """(result, wall seconds, process CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def format_ratio(ratios: Sequence[float]) -> str:
    """Median of the per-prompt ratios with their spread: '1.42x [1.30-1.55]'."""
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"


@dataclass
class Pairs:
    """Interleaved (target, mode) timings of one mode, one entry per prompt."""

    target_wall: list[float] = field(default_factory=list)
    target_cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def add(self, target: tuple[float, float], mode: tuple[float, float]) -> None:
        self.target_wall.append(target[0])
        self.target_cpu.append(target[1])
        self.wall.append(mode[0])
        self.cpu.append(mode[1])

    def wall_ratios(self) -> list[float]:
        return [t / m for t, m in zip(self.target_wall, self.wall, strict=True) if m > 0]

    def cpu_ratios(self) -> list[float]:
        return [t / m for t, m in zip(self.target_cpu, self.cpu, strict=True) if m > 0]


def time_interleaved(
    prompts: Sequence,
    run_target: Callable[[int, object], object],
    run_mode: Callable[[int, object], object],
) -> tuple[Pairs, list[object], list[object]]:
    """For each prompt i: the target on it, then the mode on it, each timed. Returns the pairs and
    both sides' results (per prompt)."""
    pairs, target_out, mode_out = Pairs(), [], []
    for i, prompt in enumerate(prompts):
        t_res, t_wall, t_cpu = timed(lambda: run_target(i, prompt))  # noqa: B023 (called at once)
        m_res, m_wall, m_cpu = timed(lambda: run_mode(i, prompt))  # noqa: B023
        pairs.add((t_wall, t_cpu), (m_wall, m_cpu))
        target_out.append(t_res)
        mode_out.append(m_res)
    return pairs, target_out, mode_out


def _generate(target, draft, tok, ids, mask, kwargs, sampled: bool, settings: dict, seed: int):
    """One prompt through the target alone (kwargs None) or speculative decoding: (new ids, stats)."""
    from ..hf import speculative_generate

    new, T = settings["max_new_tokens"], settings["temperature"]
    if kwargs is None:
        with torch.no_grad():
            torch.manual_seed(seed)
            out = target.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                do_sample=sampled,
                temperature=T if sampled else None,
                top_k=0 if sampled else None,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        return out[0, ids.shape[1] :].tolist(), None
    common = dict(max_new_tokens=new, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    common["num_draft_tokens"] = settings["num_draft_tokens"]
    sampling = dict(temperature=T, seed=seed) if sampled else {}
    model = None if kwargs.get("drafter") == "medusa" else draft
    result = speculative_generate(target, model, ids, mask, **{**common, **kwargs, **sampling})
    return result.sequences[0, ids.shape[1] :].tolist(), result.stats


def demo_rows(target, draft, tok, device: str, prompts: Sequence[str], modes, settings: dict, progress=None):
    """The demo's table: every speculative mode timed in pairs with the target, interleaved per
    prompt. ``modes``: (name, speculative kwargs or None for the target alone, sampled); settings:
    max_new_tokens, temperature, num_draft_tokens, seed. Returns (rows, {mode name: outputs})."""
    batches = [tok([p], return_tensors="pt") for p in prompts]
    inputs = [(b["input_ids"].to(device), b["attention_mask"].to(device)) for b in batches]
    rows, outputs, target_rows, baselined = [], {}, {}, set()
    for name, kwargs, sampled in progress(modes) if progress else modes:
        if kwargs is None:
            target_rows[sampled] = name
            continue
        stats = []

        def run_target(i, _p, sampled=sampled):
            return _generate(target, draft, tok, *inputs[i], None, sampled, settings, settings["seed"] + i)[0]

        def run_mode(i, _p, kwargs=kwargs, sampled=sampled, stats=stats):
            seq, st = _generate(target, draft, tok, *inputs[i], kwargs, sampled, settings, settings["seed"] + i)
            stats.append(st)
            return seq

        pairs, base, seqs = time_interleaved(prompts, run_target, run_mode)
        outputs[name] = seqs
        if sampled not in baselined:  # the target's row: its side of the first pairs of this sampling
            baselined.add(sampled)
            tokens = sum(len(s) for s in base)
            rows.append(_row(target_rows.get(sampled, "target only"), tokens, pairs.target_wall, pairs.target_cpu))
            rows[-1].update(speedup="(baseline)", **{"target fwd": tokens, "greedy = target": "(baseline)"})
        tokens = sum(len(s) for s in seqs)
        accepted, proposed = sum(st.accepted for st in stats), sum(st.proposed for st in stats)
        row = _row(name, tokens, pairs.wall, pairs.cpu)
        row.update(
            speedup=format_ratio(pairs.wall_ratios()),
            **{
                "cpu speedup": format_ratio(pairs.cpu_ratios()),
                "accept": f"{accepted / proposed:.2f}" if proposed else "-",
                "target fwd": sum(st.target_forwards for st in stats),
                "draft fwd": sum(st.draft_forwards for st in stats),
                "greedy = target": "n/a (sampled)" if sampled else str(seqs == base),
            },
        )
        rows.append(row)
    return rows, outputs


def _row(name: str, tokens: int, wall: Sequence[float], cpu: Sequence[float]) -> dict:
    total_wall, total_cpu = sum(wall), sum(cpu)
    return {
        "mode": name,
        "tokens": tokens,
        "wall s": total_wall,
        "cpu s": total_cpu,
        "tok/s": tokens / total_wall if total_wall > 0 else float("nan"),
        "speedup": "-",
        "cpu speedup": "-",
        "accept": "-",
        "target fwd": 0,
        "draft fwd": 0,
        "greedy = target": "-",
    }
