"""How `specdec demo` times its rows (specdec_kernels/demo/timing.py): pairs interleaved per prompt,
the median of per-prompt ratios with its spread, the load warning; and (slow) the chain greedy row
while another process keeps one core busy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import pytest

from specdec_kernels.demo import timing

RATIO = re.compile(r"^\d+\.\d\dx \[\d+\.\d\d-\d+\.\d\d\]$")
# Issue 28's bar for the chain greedy row on a 2-core machine with one core busy (reported, not
# asserted: a shared machine's load is not the code's).
TARGET_SPEEDUP = 1.3


def test_pairs_are_interleaved_per_prompt():
    calls = []
    pairs, base, seqs = timing.time_interleaved(
        ["a", "b", "c"], lambda i, p: calls.append(("target", p)) or i, lambda i, p: calls.append(("mode", p)) or -i
    )
    assert calls == [("target", "a"), ("mode", "a"), ("target", "b"), ("mode", "b"), ("target", "c"), ("mode", "c")]
    assert base == [0, 1, 2] and seqs == [0, -1, -2]
    assert len(pairs.wall_ratios()) == 3 and len(pairs.cpu_ratios()) == 3


def test_ratio_is_the_median_with_its_spread():
    assert timing.format_ratio([1.5, 1.0, 2.0]) == "1.50x [1.00-2.00]"
    assert timing.format_ratio([1.2, 1.4]) == "1.30x [1.20-1.40]"
    assert timing.format_ratio([]) == "-"
    assert RATIO.match(timing.format_ratio([0.987, 1.333, 2.5]))


def test_load_warning(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 1.0, 1.0))
    assert "load average 3.5 exceeds the 2 cores" in timing.load_warning(cores=2)
    assert timing.load_warning(cores=4) is None


def test_native_backend_notice_before_timing(capsys):
    timing.prepare_native_backend("cpu")
    err = capsys.readouterr().err
    assert err.count("\n") >= 1 and "native CPU backend" in err.splitlines()[0]
    timing.prepare_native_backend("cuda")  # nothing to build for a GPU run
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_chain_greedy_row_under_load(capsys):
    """The demo's chain greedy row (README settings: 5 prompts x 64 tokens, 2 threads) while a
    busy-loop process holds one core: the printed ratio is well formed and greedy output equals the
    target's; the speedup is reported (a warning below TARGET_SPEEDUP), not asserted."""
    import torch

    from specdec_kernels.demo import DEMO_PROMPTS, load_demo_pair

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
        timing.prepare_native_backend("cpu")
        target, draft, tok = load_demo_pair(device="cpu")
        modes = [("target only (greedy)", None, False), ("chain (greedy)", dict(num_drafts=1), False)]
        settings = dict(max_new_tokens=64, temperature=0.7, num_draft_tokens=4, seed=0)
        timing.demo_rows(target, draft, tok, "cpu", DEMO_PROMPTS[:1], modes, dict(settings, max_new_tokens=8))  # warm
        rows, _ = timing.demo_rows(target, draft, tok, "cpu", DEMO_PROMPTS[:5], modes, settings)
    finally:
        busy.kill()
        busy.wait()
        torch.set_num_threads(threads)
    chain = rows[-1]
    print(f"chain greedy under load: wall {chain['speedup']}, cpu {chain['cpu speedup']}")
    assert RATIO.match(chain["speedup"]) and RATIO.match(chain["cpu speedup"]), chain
    assert chain["greedy = target"] == "True"
    median = float(chain["speedup"].split("x")[0])
    if median < TARGET_SPEEDUP:
        warnings.warn(f"chain greedy {median:.2f}x < {TARGET_SPEEDUP}x under load", stacklevel=1)
