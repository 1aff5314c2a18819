"""Helpers shared by the microbenchmarks in ``bench/``: the scaffolding, so that each script is only
its shapes, its providers and its columns.

Every benchmark script here follows the same recipe (``bench_main`` runs it):

1. ``parse_args``: ``make_parser`` (``--smoke``, ``--seed``, ``--device``, ``--out``, ``--json``,
   ``--warmup``/``--rep``, the script's sweep ``Axis`` flags, ``--providers``, ``--dtype``...), then
   ``resolve_common`` fills what was not given (smoke values under ``--smoke``; explicit flags win).
2. ``prepare_environment(device)`` before anything imports ``specdec_kernels``: puts the repo root
   on ``sys.path`` and, when CUDA is absent, sets ``TRITON_INTERPRET=1`` *before* Triton kernels are
   decorated.
3. ``measure_copy_bandwidth(device)`` once per run: the practical memory-bandwidth ceiling the
   rows' ``floor_us`` is computed against.
4. The script's sweep: per shape, ``make_or_report`` its inputs, ``run_providers`` over its
   providers, each ``timed_row`` (untimed first call + output check, ``time_fn``, the bandwidth
   columns).
5. ``save_rows``: ``print_table`` for people, ``append_rows_csv`` (and ``write_json`` with
   ``--json``) for history; ``environment_metadata()`` is in every row (date, commit, GPU name,
   torch / triton / CUDA / Python versions) so that rows of different runs share one CSV.

Columns every microbenchmark shares
-----------------------------------
* ``median_us`` (``p20_us``/``p80_us``): wall time of one call. CUDA: CUDA events around each call
  (launch gaps count when the host cannot keep the GPU fed). CPU: ``time.perf_counter`` (and
  ``cpu_us``, process CPU time per call, the steadier number on a shared machine); on CPU the
  Triton kernels run in the *interpreter*, so CPU numbers only show that a script works.
* ``bytes_read_once``: the bytes any implementation must read at least once (each script says
  which); outputs are small and ignored.
* ``copy_GBps``: device-to-device copy bandwidth measured in this run ((read + write) / time on a
  1 GiB buffer on GPU, 64 MiB on CPU) -- the practical bandwidth ceiling of this machine.
* ``GBps`` = bytes_read_once / median time: the effective bandwidth of the provider.
* ``floor_us`` = bytes_read_once / copy bandwidth: the time a kernel that streams its inputs once at
  copy speed would take; no memory-bound implementation can be much faster.
* ``frac_of_floor`` = floor_us / median_us, in (0, ~1]: the fraction of the bandwidth-bound ideal
  achieved (0.5: twice the ideal, e.g. two passes or launch overhead at small shapes). Shapes that
  fit in L2 (caches are not flushed between repetitions) can read above 1.

Units: times in microseconds, bandwidth in GB/s with GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# Buffer sizes for the copy-bandwidth probe. 1 GiB on a GPU is far larger than any L2 cache, so the
# copy streams from and to DRAM; on CPU a smaller buffer keeps the probe quick (it is only indicative
# there anyway: CPU runs go through the Triton interpreter and are not about bandwidth).
GPU_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 64 << 20

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype names -> torch attributes

# The columns that open and close every microbenchmark's CSV rows (environment_metadata and timing).
LEAD_COLUMNS = ("date", "commit", "device", "torch", "triton")
TRAIL_COLUMNS = ("warmup", "rep", "triton_interpret", "cuda", "python")


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


def add_repo_root_to_path() -> None:
    """Let ``import specdec_kernels`` find the working tree when a script runs as ``python bench/x.py``."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)


def use_triton_interpreter_without_cuda(device: str | None = None) -> bool:
    """Set ``TRITON_INTERPRET=1`` when CUDA is absent or ``device`` is the CPU (unless the user chose).

    Returns whether the interpreter is on. Must run before ``specdec_kernels`` is imported: Triton
    reads the variable when the kernels are decorated, so setting it later has no effect.
    """
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        # Compiled Triton kernels need CUDA tensors; CPU tensors only work through the interpreter.
        if not torch.cuda.is_available() or str(device or "").startswith("cpu"):
            os.environ["TRITON_INTERPRET"] = "1"
    return triton_interpreter_enabled()


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def prepare_environment(device: str | None = None) -> None:
    """Call first in a benchmark's main(), before anything imports ``specdec_kernels``."""
    add_repo_root_to_path()
    use_triton_interpreter_without_cuda(device)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def git_commit() -> str:
    """Short commit hash of the repo, or "unknown" (no git, no commits yet, not a checkout).
    ``$SPECDEC_COMMIT`` wins: a copy of a working tree whose git metadata is not its code's (the lent
    GPU machine's copy carries the landed commit's) is named by whoever made the copy."""
    if os.environ.get("SPECDEC_COMMIT"):
        return os.environ["SPECDEC_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else "unknown"


def _cpu_model_name() -> str:
    # platform.processor() is empty on many Linux systems; /proc/cpuinfo has the marketing name.
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_name(device: str | None = None) -> str:
    import torch

    device = device or default_device()
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    # the vector ISA PyTorch dispatches to ("AVX2", "AVX512", ...): VMs report one "AMD EPYC" name for
    # a Zen 3 (AVX2) and a Zen 4 (AVX-512 VNNI), whose kernels and figures differ
    return f"{_cpu_model_name()} cpu ({torch.backends.cpu.get_cpu_capability()})"


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return getattr(triton, "__version__", "unknown")


def utc_now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def environment_metadata(device: str | None = None) -> dict:
    """What a benchmark row needs to be comparable later: when, which code, which machine and stack."""
    import torch

    device = device or default_device()
    return {
        "date": utc_now_iso(),
        "commit": git_commit(),
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
        # CPU rows time the Triton *interpreter*; keep that visible next to every number.
        "triton_interpret": int(triton_interpreter_enabled()),
    }


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted, non-empty sequence."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize_us(samples_us: Sequence[float]) -> dict:
    s = sorted(samples_us)
    return {
        "median_us": _quantile(s, 0.5),
        "p20_us": _quantile(s, 0.2),
        "p80_us": _quantile(s, 0.8),
    }


def _time_cuda_us(fn: Callable[[], object], rep: int) -> list[float]:
    import torch

    # One event pair per call, read after a single synchronisation, so the host keeps launching
    # ahead exactly as it would in a serving loop. If launching is slower than the GPU work, the
    # idle gap between the events is counted too, which is what a caller would experience.
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for start, end in zip(starts, ends, strict=False):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in zip(starts, ends, strict=False)]


def _time_cpu_us(fn: Callable[[], object], rep: int) -> list[float]:
    samples = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return samples


def time_cuda_graph_us(fn: Callable[[], object], rep: int) -> float | None:
    """Median microseconds of one replay of ``fn`` captured in a CUDA graph: the device time of its
    launches with no host work between them (how engines that capture their decode step run it).
    None if ``fn`` cannot be captured (a host synchronisation, say)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):  # allocations of the warm-up call stay out of the capture
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # noqa: BLE001 - any capture failure means "not capturable"
        torch.cuda.synchronize()
        print(f"[graph] not capturable: {str(e).splitlines()[0][:160]}", file=sys.stderr)
        return None
    graph.replay()
    torch.cuda.synchronize()
    return summarize_us(_time_cuda_us(graph.replay, rep))["median_us"]


def time_fn(fn: Callable[[], object], warmup: int, rep: int, device: str | None = None) -> dict:
    """Time ``fn()`` ``rep`` times after ``warmup`` untimed calls.

    CUDA: CUDA events around each call. CPU: ``time.perf_counter``. (Not ``triton.testing.do_bench``:
    it needs a GPU and fails under the Triton interpreter.) Caches are not flushed between calls.

    Returns ``{"median_us", "p20_us", "p80_us"}``.
    """
    import torch

    if rep < 1:
        raise ValueError(f"rep must be >= 1, got {rep}")
    on_cuda = str(device or default_device()).startswith("cuda")
    for _ in range(max(0, warmup)):
        fn()
    if on_cuda:
        torch.cuda.synchronize()
        return summarize_us(_time_cuda_us(fn, rep))
    cpu_start = time.process_time()  # process CPU time: steadier than wall time on a shared machine
    samples = _time_cpu_us(fn, rep)
    return {**summarize_us(samples), "cpu_us": (time.process_time() - cpu_start) / rep * 1e6}


def measure_copy_bandwidth(
    device: str | None = None, nbytes: int | None = None, warmup: int = 3, rep: int = 10
) -> float:
    """Device-to-device copy bandwidth in GB/s: (bytes read + bytes written) / median copy time.

    This is the practical ceiling for a kernel that streams its input once, so ``bytes / this``
    is the time such a kernel cannot beat on this machine.
    """
    import torch

    device = str(device or default_device())
    if nbytes is None:
        nbytes = GPU_COPY_BYTES if device.startswith("cuda") else CPU_COPY_BYTES

    def time_copy() -> dict:  # the buffers live only while timed (freed before empty_cache)
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        src.fill_(1)  # touch the pages so that the first timed copy does not pay for page faults
        dst = torch.empty_like(src)
        return time_fn(lambda: dst.copy_(src), warmup=warmup, rep=rep, device=device)

    stats = time_copy()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return 2 * nbytes / (stats["median_us"] * 1e-6) / 1e9


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _read_csv(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def replace_commit_rows_csv(path: str | os.PathLike, rows: Sequence[Mapping], columns: Sequence[str]) -> None:
    """One section per commit: drop the CSV's rows of the commit ``rows`` carry, then append them
    (a rerun at the same commit replaces its section instead of doubling it)."""
    path = Path(path)
    commits = {str(r.get("commit")) for r in rows}
    if path.exists() and path.stat().st_size > 0:
        old_columns, old_rows = _read_csv(path)
        kept = [r for r in old_rows if r.get("commit") not in commits]
        merged = old_columns + [c for c in columns if c not in old_columns]
        _write_csv(path, merged, kept, mode="w", header=True)
    append_rows_csv(path, rows, columns)


def append_rows_csv(path: str | os.PathLike, rows: Iterable[Mapping], columns: Sequence[str] | None = None) -> None:
    """Append ``rows`` to the CSV at ``path``; create it (and its folder) with a header if missing.

    ``columns`` defaults to the keys of the first row. If the file already exists with other
    columns (an older version of the script), it is rewritten once with the union of the columns so
    that history is kept and no column silently disappears.
    """
    rows = [dict(r) for r in rows]
    if not rows:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(columns or rows[0].keys())
    if path.exists() and path.stat().st_size > 0:
        old_columns, old_rows = _read_csv(path)
        if old_columns == columns:
            _write_csv(path, columns, rows, mode="a", header=False)
            return
        merged = old_columns + [c for c in columns if c not in old_columns]
        _write_csv(path, merged, old_rows + rows, mode="w", header=True)
        return
    _write_csv(path, columns, rows, mode="w", header=True)


def _write_csv(path: Path, columns: Sequence[str], rows: Sequence[Mapping], mode: str, header: bool) -> None:
    with open(path, mode, newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore", restval="")
        if header:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(v) for k, v in row.items()})


def _csv_value(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def write_json(path: str | os.PathLike, rows: Sequence[Mapping], metadata: Mapping | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"metadata": dict(metadata or {}), "rows": [dict(r) for r in rows]}, f, indent=2)
        f.write("\n")


def format_cell(v) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, float):
        if v != v:  # NaN
            return "nan"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.3g}" if abs(v) < 0.01 else f"{v:.2f}"
    return str(v)


def print_table(rows: Sequence[Mapping], columns: Sequence[str], file=None) -> None:
    """Print ``rows`` as a fixed-width text table: text columns left-aligned, numbers right-aligned."""
    file = file or sys.stdout
    cells = [[format_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) in (None, "") for r in rows) for c in columns]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=False))

    print(line(list(columns)), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells:
        print(line(row), file=file)
    file.flush()


# --------------------------------------------------------------------------------------------
# The command-line and output conventions every script shares
# --------------------------------------------------------------------------------------------


def add_output_args(p, name: str, *, timing: bool = True) -> None:
    """``--warmup/--rep`` (when ``timing``), ``--out``, ``--json`` and ``--device`` for script ``name``."""
    if timing:
        p.add_argument("--warmup", type=int, help="untimed calls before timing (default 10; smoke: 0)")
        p.add_argument("--rep", type=int, help="timed calls (default 100; smoke: 1)")
    p.add_argument("--out", help=f"CSV to append rows to (default bench/results/{name}.csv; smoke: a temporary file)")
    p.add_argument("--json", help="also write the rows and run metadata as JSON to this path")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")


def resolve_timing(args, parser) -> None:
    """Microbenchmark defaults: 10 warmup / 100 timed calls, 0 / 1 in --smoke; explicit flags win."""
    args.warmup = args.warmup if args.warmup is not None else (0 if args.smoke else 10)
    args.rep = args.rep if args.rep is not None else (1 if args.smoke else 100)
    # Smoke shapes are tiny, so smoke runs on whatever device is there (CPU + interpreter in CI).
    args.device = args.device or default_device()
    if args.rep < 1 or args.warmup < 0:
        parser.error("--rep must be >= 1 and --warmup >= 0")


def output_csv_path(args, name: str) -> Path:
    """``--out``, else a temporary file in --smoke (smoke rows never enter the history), else
    ``bench/results/<name>.csv``."""
    if args.out:
        return Path(args.out)
    if args.smoke:
        fd, path = tempfile.mkstemp(prefix=f"bench_{name}_smoke_", suffix=".csv")
        os.close(fd)
        return Path(path)
    return REPO_ROOT / "bench" / "results" / f"{name}.csv"


def print_run_header(name: str, meta: Mapping, args, copy_gbps: float | None = None) -> None:
    """The first lines of every run: what, when, which commit, on what; ends with the CPU caveat."""
    print(f"# {name} benchmark  {meta['date']}  commit {meta['commit']}")
    extra = f"  transformers {meta['transformers']}" if "transformers" in meta else ""
    print(
        f"# device {meta['device']} ({args.device})  torch {meta['torch']}  triton {meta['triton']}{extra}"
        f"  TRITON_INTERPRET={meta['triton_interpret']}"
    )
    if copy_gbps is not None:
        print(f"# copy bandwidth {copy_gbps:.1f} GB/s  warmup {args.warmup}  rep {args.rep}")


def print_cpu_caveat(args) -> None:
    if not args.device.startswith("cuda") and not args.smoke:
        print(
            "# note: on CPU backend='auto' runs the native CPU build; only backend='triton' runs the"
            " interpreter (not kernel performance)"
        )
    sys.stdout.flush()


def save_rows(
    rows: Sequence[Mapping], args, name: str, meta: Mapping, table_columns: Sequence[str], csv_columns: Sequence[str]
) -> None:
    """Print the table, append the rows to the CSV, and write JSON when ``--json`` asks for it."""
    if not rows:
        return
    print()
    print_table(rows, table_columns)
    csv_path = output_csv_path(args, name)
    append_rows_csv(csv_path, rows, csv_columns)
    print(f"\n{len(rows)} rows appended to {csv_path}")
    if args.json:
        write_json(args.json, rows, {**meta, "argv": sys.argv[1:]})
        print(f"rows written to {args.json}")


def exit_code(errors: Sequence[str]) -> int:
    """0, or 1 after listing the errors on stderr (--smoke in CI fails on any)."""
    if not errors:
        return 0
    print(f"\n{len(errors)} error(s):", file=sys.stderr)
    for e in errors:
        print(f"  {e}", file=sys.stderr)
    return 1


# --------------------------------------------------------------------------------------------
# Scaffolding: columns, sweep axes, the parse / resolve / main skeleton, the provider loop
# --------------------------------------------------------------------------------------------


def csv_columns(middle: str) -> tuple[str, ...]:
    """A script's CSV columns: LEAD_COLUMNS, the space-separated ``middle``, TRAIL_COLUMNS."""
    return (*LEAD_COLUMNS, *middle.split(), *TRAIL_COLUMNS)


def torch_dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def free_device_memory(device: str) -> None:
    """Give cached CUDA blocks back between shapes (a no-op on CPU)."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def is_out_of_memory(e: BaseException) -> bool:
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    text = str(e).lower()
    return isinstance(e, (RuntimeError, MemoryError)) and ("out of memory" in text or "can't allocate" in text)


def bandwidth_columns(nbytes: int, median_us: float, copy_gbps: float) -> dict:
    """``GBps``, ``floor_us`` and ``frac_of_floor`` of a call that must read ``nbytes``."""
    floor_us = nbytes / (copy_gbps * 1e9) * 1e6
    return {"GBps": nbytes / (median_us * 1e-6) / 1e9, "floor_us": floor_us, "frac_of_floor": floor_us / median_us}


@dataclass(frozen=True)
class Axis:
    """One swept dimension: ``--NAME`` with ``default`` values in a sweep, ``smoke`` values in --smoke.

    ``many=False`` makes it a single value (e.g. head count) instead of a list."""

    help: str
    default: object
    smoke: object
    many: bool = True

    def add_to(self, parser, name: str) -> None:
        default, smoke = (list(self.default), list(self.smoke)) if self.many else (self.default, self.smoke)
        text = f"{self.help} (default {default}; smoke: {smoke})"
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, dest=name, type=int, nargs="+" if self.many else None, help=text)

    def resolve(self, args, name: str) -> None:
        if getattr(args, name) is None:
            value = self.smoke if args.smoke else self.default
            setattr(args, name, list(value) if self.many else value)


def make_parser(
    name: str,
    description: str,
    *,
    axes: Mapping[str, Axis] | None = None,
    providers: Sequence[str] = (),
    smoke_help: str,
    seed_help: str,
    dtype_help: str | None = None,
    validate_help: str | None = None,
    all_providers_help: str | None = None,
    timing: bool = True,
) -> argparse.ArgumentParser:
    """The flags every script shares; the script adds its own before calling ``parse_args``."""
    p = argparse.ArgumentParser(description=description)
    for axis_name, axis in (axes or {}).items():
        axis.add_to(p, axis_name)
    if providers:
        p.add_argument("--providers", nargs="+", choices=tuple(providers), help="default: all")
    if dtype_help:
        p.add_argument("--dtype", choices=tuple(DTYPES), help=dtype_help)
    add_output_args(p, name, timing=timing)
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check the arguments, set up the environment, import the package and the providers' modules, "
        "then exit without making inputs or timing (bench/run_gpu.sh --dry-run: every stage starts)",
    )
    if all_providers_help:
        p.add_argument("--all-providers", action="store_true", help=all_providers_help)
    if validate_help:
        p.add_argument("--validate", action="store_true", help=validate_help)
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    return p


def resolve_common(args, parser, axes: Mapping[str, Axis] | None = None, providers: Sequence[str] = ()) -> None:
    """Fill the shared options: the axes, all providers, fp32 in --smoke (bf16 otherwise), the timing
    (``resolve_timing``; it also picks the device)."""
    for axis_name, axis in (axes or {}).items():
        axis.resolve(args, axis_name)
    if providers:
        args.providers = args.providers or list(providers)
    args.dtype = args.dtype or ("fp32" if args.smoke else "bf16")
    resolve_timing(args, parser)


class SetupError(Exception):
    """Raised by a sweep before it measures anything (models missing, bad method): exit code 2."""


@dataclass
class Run:
    """What a sweep needs besides its own options: the metadata every row carries, the copy
    bandwidth of this run, and the list errors are collected in (any error: exit code 1)."""

    args: argparse.Namespace
    meta: dict
    copy_gbps: float | None = None
    errors: list[str] = field(default_factory=list)
    done: list[dict] = field(default_factory=list)  # every measured row so far (kept if the run is interrupted)

    def error(self, what: str, e: BaseException | None = None) -> None:
        self.errors.append(f"{what}: {e!r}" if e is not None else what)
        if e is not None:
            traceback.print_exc()


def bench_main(
    name: str,
    args,
    sweep: Callable[[Run], list[dict]],
    *,
    table_columns: Sequence[str],
    csv_columns: Sequence[str],
    header: Callable[[Run], None] | None = None,
    after: Callable[[Run, list[dict]], None] | None = None,
    bandwidth: bool = True,
    extra_meta: Callable[[], dict] | None = None,
    modules: Sequence[str] = (),
) -> int:
    """The main of every script: environment, metadata (+ ``extra_meta()``), copy bandwidth (unless
    ``bandwidth=False``), header lines (``header``), the sweep, the rows, ``after``, the exit code.
    ``--dry-run`` stops after the environment and the imports of specdec_kernels and ``modules`` (the
    ones the providers import lazily)."""
    prepare_environment(args.device)  # before anything imports specdec_kernels
    if getattr(args, "dry_run", False):
        return dry_run(name, args, modules)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    run = Run(args, {**environment_metadata(args.device), **(extra_meta() if extra_meta else {})})
    if bandwidth:
        run.copy_gbps = measure_copy_bandwidth(args.device)
    print_run_header(name, run.meta, args, run.copy_gbps)
    if header:
        header(run)
    print_cpu_caveat(args)
    try:
        rows = sweep(run)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a time limit (run_gpu.sh stops a stage with SIGINT): keep what was measured
        rows = run.done
        print(f"# interrupted: saving the {len(rows)} rows measured so far", file=sys.stderr)
        run.errors.append("interrupted")
    meta = {**run.meta, "copy_GBps": run.copy_gbps} if bandwidth else run.meta
    save_rows(rows, args, name, meta, table_columns, csv_columns)
    if after:
        after(run, rows)
    return exit_code(run.errors)


def dry_run(name: str, args, modules: Sequence[str]) -> int:
    """``--dry-run``: the arguments were checked by the parser; import what the providers need."""
    import importlib

    for module in ("specdec_kernels", *modules):
        importlib.import_module(module)
    providers = " ".join(getattr(args, "providers", None) or [])
    print(
        f"# {name}: arguments ok (device {args.device}; providers {providers or '-'}); imported specdec_kernels", end=""
    )
    print(f" {' '.join(modules)}; dry-run ok")
    return 0


def make_or_report(make: Callable[[], object], label: str, run: Run):
    """``make()``, or None after recording the error (e.g. out of memory for the inputs themselves)."""
    try:
        return make()
    except Exception as e:
        run.error(f"{label}: making inputs failed", e)
        return None


class CheckFailed(Exception):
    """A provider's output failed its check: an error without a traceback, that provider not timed."""


def timed_row(
    fn: Callable[[], object],
    run: Run,
    nbytes: int,
    *,
    check=None,
    cap: tuple[int, int] | None = None,
    graph: bool = False,
):
    """Time ``fn`` after one untimed call (compile / autotune, and ``check(out)``: a list of problems);
    ``cap`` = (most warmup, most rep) for a slow provider (a reference that loops in Python). With
    ``graph`` on CUDA, also ``graph_us``: a CUDA-graph replay of ``fn`` (device time, no host overhead);
    not under ``--validate``, whose value checks synchronise with the host.

    Returns (the measured columns, the first call's output); raises CheckFailed on problems."""
    args = run.args
    out = fn()
    problems = check(out) if check else []
    if problems:
        raise CheckFailed("; ".join(problems))
    warmup, rep = (min(args.warmup, cap[0]), min(args.rep, cap[1])) if cap else (args.warmup, args.rep)
    timing = time_fn(fn, warmup=warmup, rep=rep, device=args.device)
    if graph and not getattr(args, "validate", False) and str(args.device).startswith("cuda"):
        timing["graph_us"] = time_cuda_graph_us(fn, rep)
    return {
        **timing,
        **bandwidth_columns(nbytes, timing["median_us"], run.copy_gbps),
        "copy_GBps": run.copy_gbps,
        "bytes_read_once": nbytes,
        "warmup": warmup,
        "rep": rep,
    }, out


def run_providers(
    providers: Sequence[str],
    label: str,
    run: Run,
    measure: Callable[[str], dict],
    *,
    skip: Callable[[str], str | None] | None = None,
    on_oom: Callable[[str], dict] | None = None,
) -> list[dict]:
    """``measure(provider)`` -> row for each provider; skips (``skip`` gives why), records errors
    (out of memory: ``on_oom`` gives the row to keep instead), prints one progress line each."""
    rows = []
    width = max(len(p) for p in providers) if providers else 0
    for provider in providers:
        if skip and (why := skip(provider)):
            print(f"[skip] {provider} at {label}: {why}", file=sys.stderr)
            continue
        try:
            row = measure(provider)
        except CheckFailed as e:
            print(f"[FAIL] {provider} at {label}: {e}", file=sys.stderr)
            run.errors.append(f"{provider} at {label}: {e}")
            continue
        except Exception as e:
            free_device_memory(run.args.device)
            if on_oom and is_out_of_memory(e):
                print(f"[skip] {provider} at {label}: out of memory", file=sys.stderr)
                rows.append(on_oom(provider))
                continue
            run.error(f"{provider} at {label}", e)
            continue
        rows.append(row)
        run.done.append(row)
        print(
            f"[done] {provider:{width}s} {label}: median {row['median_us']:.1f} us, "
            f"frac_of_floor {row['frac_of_floor']:.3g}"
            + (f", graph {row['graph_us']:.1f} us" if row.get("graph_us") is not None else ""),
            file=sys.stderr,
        )
    free_device_memory(run.args.device)
    return rows


def ratio_columns(rows: list[dict], key: str, **baselines: tuple[str, bool]) -> None:
    """Per row of one shape, ``column = baseline / row`` (or ``row / baseline`` when the flag is
    False) of ``key`` where the baseline provider ran; None where it did not."""
    for column, (baseline, baseline_over_row) in baselines.items():
        base = next((r for r in rows if r.get("provider") == baseline and r.get(key)), None)
        for r in rows:
            if not r.get(key):
                continue
            if base is None:
                r[column] = None
            else:
                r[column] = base[key] / r[key] if baseline_over_row else r[key] / base[key]
