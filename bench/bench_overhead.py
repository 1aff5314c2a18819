"""Call overhead of ``sk.verify`` on CPU tensors (issue 28 goal 1): the fixed host cost of a call.

Row type "call overhead": one plain chain call (target [B, G+1, V] fp32, draft_probs [B, G, V],
draft ids, a [B] seed tensor) at a tiny vocabulary (V = 8 by default), so the kernel is
negligible and what is left is the Python around it: argument checks, dispatch, the csrc wrapper,
output assembly. Providers:

* ``auto`` / ``cpu``: ``sk.verify(..., backend=...)`` (auto on CPU tensors is the CPU build).
* ``native``: the CPU build's ``verify_chain`` called directly with the same checked arguments:
  the part of a call no Python change can remove (pybind11 argument conversion, output tensors).

Columns: ``cpu_us`` (process CPU time per call, the least of ``--batches`` batches of ``--calls``
calls: on a shared machine the steadier number), ``wall_us`` (the least batch's wall time per
call), ``python_us`` = cpu_us - the native row's cpu_us of the same mode and threads: the fixed
Python cost a call adds.

Usage::

    taskset -c 1 python bench/bench_overhead.py                  # -> bench/results/overhead_cpu.csv
    python bench/bench_overhead.py --V 8 32000 --threads 1 2 --no-save
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import _common` when run or imported
import _common as common  # noqa: E402

MODES = {  # name -> sampling keywords of sk.verify
    "greedy": dict(temperature=0.0),
    "t0.7": dict(temperature=0.7),
    "t0.7_topk_topp": dict(temperature=0.7, top_k=50, top_p=0.9),
}
PROVIDERS = ("native", "auto", "cpu")
COLUMNS = "provider mode validate B G V threads cpu_us wall_us python_us".split()
# Calls before timing: the CPU build is loaded and every code path warm.
WARMUP_CALLS = 200


def min_per_call_us(fn, calls: int, batches: int) -> tuple[float, float]:
    """(process CPU time, wall time) per call in microseconds, each the least over the batches."""
    for _ in range(WARMUP_CALLS):
        fn()
    best_cpu = best_wall = float("inf")
    for _ in range(batches):
        c0, w0 = time.process_time_ns(), time.perf_counter_ns()
        for _ in range(calls):
            fn()
        c1, w1 = time.process_time_ns(), time.perf_counter_ns()
        best_cpu, best_wall = min(best_cpu, (c1 - c0) / calls / 1e3), min(best_wall, (w1 - w0) / calls / 1e3)
    return best_cpu, best_wall


def call(provider: str, mode: str, validate: bool, B: int, G: int, V: int):
    """A zero-argument call of ``provider`` on fixed inputs."""
    import torch

    import specdec_kernels as sk
    from specdec_kernels._validation import check_verify_args
    from specdec_kernels.ops import csrc

    gen = torch.Generator().manual_seed(0)
    target = torch.randn((B, G + 1, V), generator=gen)
    draft_probs = torch.softmax(torch.randn((B, G, V), generator=gen), dim=-1)
    tokens = torch.randint(0, V, (B, G), generator=gen)
    seeds = torch.arange(B, dtype=torch.int64) + 7
    sampling = MODES[mode]
    if provider != "native":
        options = dict(draft_probs=draft_probs, seed=seeds, validate=validate, backend=provider, **sampling)
        return lambda: sk.verify(target, tokens, **options)
    args = check_verify_args(
        target, tokens, None, draft_probs, sampling["temperature"], sampling.get("top_k", 0),
        sampling.get("top_p", 1.0), None, seeds, validate=False,
    )  # fmt: skip
    ext, flat = csrc.load_cpu_core(), csrc._sampling_args(args)
    threads = csrc.chain_threads(args.has_filter)  # as csrc.run_chain picks them
    chunks = csrc._cpu_chunks(args)
    return lambda: ext.verify_chain(target, tokens, draft_probs, args.draft_mode, None, *flat, chunks, threads, 0,
                                    None, False, False)  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--V", type=int, nargs="+", default=[8], help="vocabulary sizes (default 8: kernel negligible)")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--G", type=int, default=4)
    p.add_argument("--mode", nargs="+", choices=tuple(MODES), default=list(MODES))
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--threads", type=int, nargs="+", default=[1], help="torch / OpenMP threads")
    p.add_argument("--calls", type=int, default=1000, help="calls per timed batch")
    p.add_argument("--batches", type=int, default=20, help="timed batches (the least is reported)")
    p.add_argument("--out", default=str(common.REPO_ROOT / "bench" / "results" / "overhead_cpu.csv"))
    p.add_argument("--no-save", action="store_true", help="print the table only")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    common.prepare_environment("cpu")
    import torch

    meta, rows = common.environment_metadata("cpu"), []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for V in args.V:
            for mode in args.mode:
                native = None
                for provider in args.providers:
                    for validate in (False,) if provider == "native" else (False, True):
                        fn = call(provider, mode, validate, args.B, args.G, V)
                        cpu_us, wall_us = min_per_call_us(fn, args.calls, args.batches)
                        native = cpu_us if provider == "native" else native
                        python_us = None if native is None or provider == "native" else cpu_us - native
                        shape = dict(provider=provider, mode=mode, validate=int(validate), B=args.B, G=args.G, V=V)
                        row = dict(shape, threads=threads, cpu_us=cpu_us, wall_us=wall_us, python_us=python_us)
                        rows.append({**meta, **row})
                        print(common.format_cell(cpu_us), row, file=sys.stderr, flush=True)
    common.print_table(rows, COLUMNS)
    if not args.no_save:
        common.append_rows_csv(args.out, rows, list(meta) + COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
