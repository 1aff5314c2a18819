"""Vocabulary-parallel verification vs all-gathering the logits (gloo, CPU, side by side in one run).

Each of ``--world`` processes holds a contiguous vocabulary shard. Two providers per shape and mode:

* ``allgather``: what TP engines do today: all-gather the target (and draft) logits, then verify the
  full rows on every rank (``sk.verify``, backend auto: the CPU build of csrc on CPU tensors);
* ``sharded``: ``sk.verify(..., process_group=pg)`` on the shards (ops/vocab_parallel/).

Bytes: what one rank receives into collective result buffers (all-gather: world x input, all-reduce:
the buffer), counted by wrapping ``torch.distributed.all_gather`` / ``all_reduce`` /
``all_gather_into_tensor``, and computed from the shapes (``bytes_model``: B (2G+1) V logits for
``allgather``; ``sharded_bytes_model`` for ours, O(B (G+1)) float64 records). Times:
median wall and process-CPU milliseconds per call on rank 0, after a barrier. Both providers must
return the same tokens (checked). Rows are appended to bench/results/vocab_parallel.csv
(``--smoke``: a tiny run on CPU, rows to a temporary file unless ``--out``). ``--method block``:
both providers verify with ``method="block"`` (the CSV's mode then reads e.g. ``sampled+block``).

    python bench/bench_vocab_parallel.py --smoke
    python bench/bench_vocab_parallel.py --smoke --method block
    python bench/bench_vocab_parallel.py --world 2 --B 1 8 --V 32000 128256 --rep 5
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

MODES = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8),
    "top_k_top_p": dict(temperature=0.8, top_k=50, top_p=0.9),
}
COLUMNS = [
    "date", "commit", "device", "torch", "world", "mode", "B", "G", "V", "dtype", "provider",
    "bytes_counted", "bytes_model", "collectives", "bytes_ratio_vs_allgather", "wall_ms", "cpu_ms",
    "speedup_vs_allgather", "rep", "mean_accepted",
]  # fmt: skip


class Counter:
    """Wraps the collectives this benchmark's processes call and counts result-buffer bytes."""

    def __init__(self):
        self.bytes = self.calls = 0
        for name in ("all_gather", "all_reduce", "all_gather_into_tensor"):
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            if name == "all_gather":
                self.bytes += sum(t.numel() * t.element_size() for t in args[0])
            else:
                self.bytes += args[0].numel() * args[0].element_size()
            self.calls += 1
            return fn(*args, **kwargs)

        return counted

    def reset(self):
        self.bytes = self.calls = 0


def _inputs(B, G, V, mode, seed):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(B, G + 1, V, generator=g) * 2
    draft = target[:, :G] + torch.randn(B, G, V, generator=g) * 0.5
    tokens = draft.argmax(-1)
    return target, draft, tokens, dict(MODES[mode], seed=seed)


def sharded_bytes_model(B, G, world, mode, method="token") -> int:
    """What our collectives should move for a chain call with draft logits (result buffers, one
    rank; float64 records): the signature all-gather (11 numbers), row stats (3 per row), softmax
    sums with the draft-token lookups (2 per row), the top-k gather (k + 2 per row) and the race
    winners (4 per request). Greedy calls need the target rows' stats only. method="block" adds
    the residual masses' all-reduce: at most one number per draft position 1 .. G-1 (only those
    that can stop are sent, so this part is an upper bound)."""
    rows = B * (G + 1) + (0 if mode == "greedy" else B * G)  # target rows, then draft rows
    total = world * 11 + world * rows * 3
    if mode != "greedy":
        total += rows * 2 + world * B * 4 + (B * max(G - 1, 0) if method == "block" else 0)
    if "top_k" in MODES[mode]:
        total += world * rows * (MODES[mode]["top_k"] + 2)
    return 8 * total


def _timed(fn, rep):
    walls, cpus, out = [], [], None
    for _ in range(rep):
        dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        walls.append((time.perf_counter() - w0) * 1e3)
        cpus.append((time.process_time() - c0) * 1e3)
    return out, statistics.median(walls), statistics.median(cpus)


def _measure(sk, counter, world, rank, B, G, V, mode, rep, method) -> list[dict]:
    """Both providers on one shape and mode: rows for the CSV."""
    lo, hi = rank * V // world, (rank + 1) * V // world
    target, draft, tokens, kw = _inputs(B, G, V, mode, seed=B * 7 + V)
    kw["method"] = method
    t_sh, d_sh = target[..., lo:hi].contiguous(), draft[..., lo:hi].contiguous()

    def sharded():
        return sk.verify(t_sh, tokens, d_sh, **kw, process_group=dist.group.WORLD)

    def allgather():
        full = []
        for part in (t_sh, d_sh):  # even shards here: one all-gather each, then concatenate
            bufs = [torch.empty_like(part) for _ in range(world)]
            dist.all_gather(bufs, part)
            full.append(torch.cat(bufs, -1))
        return sk.verify(full[0], tokens, full[1], **kw, backend="auto")

    stats = {}
    for name, fn in (("sharded", sharded), ("allgather", allgather)):
        fn()  # warm-up (builds, caches)
        counter.reset()
        fn()
        counted, calls = counter.bytes, counter.calls
        out, wall, cpu = _timed(fn, rep)
        stats[name] = (out, counted, calls, wall, cpu)
    same = torch.equal(stats["sharded"][0].tokens, stats["allgather"][0].tokens)
    assert same, f"sharded and all-gathered tokens differ (B={B} V={V} {mode} {method})"
    models = {"allgather": (B * (G + 1) * V + B * G * V) * target.element_size()}
    models["sharded"] = sharded_bytes_model(B, G, world, mode, method)
    rows = []
    label = mode if method == "token" else f"{mode}+{method}"  # the CSV keeps its columns
    for name, (out, counted, calls, wall, cpu) in stats.items():
        rows.append(
            dict(
                world=world, mode=label, B=B, G=G, V=V, dtype="fp32", provider=name,
                bytes_counted=counted, bytes_model=models[name],
                collectives=calls, bytes_ratio_vs_allgather=counted / stats["allgather"][1],
                wall_ms=wall, cpu_ms=cpu, speedup_vs_allgather=stats["allgather"][3] / wall,
                rep=rep, mean_accepted=float(out.num_accepted.float().mean()),
            )
        )  # fmt: skip
    return rows


def _worker(rank, world, init_file, cfg, out_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import specdec_kernels as sk

    counter = Counter()
    rows = []
    for V in cfg["V"]:
        for B in cfg["B"]:
            for mode in cfg["modes"]:
                rows += _measure(sk, counter, world, rank, B, cfg["G"], V, mode, cfg["rep"], cfg["method"])
    if rank == 0:
        Path(out_file).write_text(json.dumps(rows))
    # every rank leaves its last collective before any tears gloo down: one smoke run in five aborted
    # ("terminate called without an active exception", SIGABRT in a spawned rank) without it
    dist.barrier()
    dist.destroy_process_group()


def _metadata():
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        commit = commit.stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    device = f"{platform.processor() or platform.machine()} cpu"
    return dict(date=now, commit=commit, device=device, torch=torch.__version__)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 1 rep, rows to a temporary CSV")
    p.add_argument("--world", type=int, default=2, help="gloo processes (default 2)")
    p.add_argument("--B", type=int, nargs="+", help="batch sizes (default 1 8; smoke 2)")
    p.add_argument("--G", type=int, help="drafts per request (default 4; smoke 2)")
    p.add_argument("--V", type=int, nargs="+", help="vocabulary sizes (default 32000 128256; smoke 1000)")
    p.add_argument("--mode", nargs="+", choices=tuple(MODES), help="default: all")
    p.add_argument("--rep", type=int, help="timed calls per provider (default 5; smoke 1)")
    p.add_argument("--method", choices=("token", "block"), default="token", help="verification rule (default token)")
    p.add_argument("--out", help="CSV to append to (default bench/results/vocab_parallel.csv)")
    a = p.parse_args(argv)
    cfg = dict(
        B=a.B or ([2] if a.smoke else [1, 8]),
        G=a.G or (2 if a.smoke else 4),
        V=a.V or ([1000] if a.smoke else [32000, 128256]),
        modes=a.mode or list(MODES),
        rep=a.rep or (1 if a.smoke else 5),
        method=a.method,
    )
    out_csv = Path(a.out) if a.out else None
    if out_csv is None:
        out_csv = Path(tempfile.mkstemp(suffix=".csv")[1]) if a.smoke else ROOT / "bench/results/vocab_parallel.csv"
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rows.json")
        args = (a.world, os.path.join(tmp, "init"), cfg, result)
        mp.start_processes(_worker, args=args, nprocs=a.world, start_method="spawn")
        rows = [dict(_metadata(), **r) for r in json.loads(Path(result).read_text())]
    print(f"# vocab_parallel  world={a.world} (gloo, CPU)  {rows[0]['device']}  commit {rows[0]['commit']}")
    head = ["mode", "B", "G", "V", "provider", "bytes_counted", "bytes_model", "collectives", "wall_ms", "cpu_ms"]
    print("  ".join(f"{h:>13}" for h in head + ["bytes_ratio", "speedup"]))
    for r in rows:
        cells = [r[h] for h in head] + [r["bytes_ratio_vs_allgather"], r["speedup_vs_allgather"]]
        print("  ".join(f"{c:>13.4g}" if isinstance(c, float) else f"{c!s:>13}" for c in cells))
    new = not out_csv.exists() or out_csv.stat().st_size == 0
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    with open(out_csv, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
    print(f"# rows appended to {out_csv}")


if __name__ == "__main__":
    main()
