"""Static GPU performance model: the kernels compiled for sm_90 at the launchers' real configurations.

No GPU is needed. For each shape the real public call runs on CPU tensors inside
``plan_as_gpu(132)`` (the launchers plan grids and tiles as on an H100) with every Triton launch
*captured* instead of run; each captured launch is compiled for sm_90 by Triton's own compiler,
with the argument specialisations the JIT would apply (16-byte divisible pointers and sizes,
ints equal to 1 as constants). From the cubin (Triton's bundled ``cuobjdump`` / ``nvdisasm``):

* registers, spills (local memory), stack, shared memory, occupancy on an H100 SM (65,536
  registers, 228 KB shared memory, 2,048 threads, 32 CTAs) and what limits it;
* programs (CTAs) against 132 SMs;
* the hot loops: SASS instructions per iteration, and *SASS per vocab entry* = instructions a
  thread issues per logit it reads (loop SASS x threads / logits one iteration reads: a target
  and a draft row count as two);
* bytes read from the logits per call (from the launch shapes; ``tests/test_static.py`` checks the
  formula against loads counted in the interpreter) and *passes* = bytes / one read of every target
  and draft row;
* **estimate** per kernel = max(bytes / 3.35 TB/s, issue bound), the issue bound being the warp
  instructions of the busiest SM (ceil(programs / 132) programs) at 4 per cycle and 1.755 GHz;
  the call's estimate is the sum over its launches (they run one after another).

These are estimates from compiled code, not measurements: latency, cache behaviour and
instruction mix are not modelled. ``bench/run_gpu.sh`` measures when a GPU is lent.

Usage: python bench/bench_static.py [--smoke] [--csv PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import environment_metadata, print_table  # noqa: E402

# Run as a script, the kernels must be compiled, never interpreted (nothing runs here); the
# environment is set in __main__ before specdec_kernels is imported. Imported (by the tests), only
# the pure functions (bytes model, occupancy) are used.

H100 = dict(sms=132, regs=65536, smem=228 * 1024, threads=2048, ctas=32, warps=64, hbm=3.35e12, ghz=1.755)
BIN = None  # Triton's bundled CUDA tools, found lazily
COLUMNS = [
    "date",
    "commit",
    "triton",
    "arch",
    "case",
    "kernel",
    "grid",
    "config",
    "regs",
    "spill_bytes",
    "stack",
    "smem",
    "occupancy",
    "limiter",
    "ctas",
    "waves",
    "loop_sass",
    "sass_per_entry",
    "bytes",
    "passes",
    "byte_floor_us",
    "issue_bound_us",
    "estimate_us",
]


@dataclasses.dataclass
class Launch:
    kernel: object  # JITFunction
    grid: tuple
    args: tuple
    kwargs: dict


@contextlib.contextmanager
def captured_launches():
    """Record every ``kernel[grid](...)`` launch instead of running it."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    original = JITFunction.__getitem__

    def capture(self, grid):
        def launch(*args, **kwargs):
            launches.append(Launch(self, tuple(grid), args, kwargs))

        return launch

    JITFunction.__getitem__ = capture
    try:
        yield launches
    finally:
        JITFunction.__getitem__ = original


_TYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.int64": "i64"}
_TYPES.update({"torch.int32": "i32", "torch.bool": "i1", "torch.int8": "i8", "torch.uint8": "u8"})


def _specialise(launch: Launch):
    """(signature, constexprs, attributes, options) the JIT would compile this launch with."""
    import torch

    fn = launch.kernel
    bound = dict(zip(fn.arg_names, launch.args, strict=False))
    bound.update({k: v for k, v in launch.kwargs.items() if k in fn.arg_names})
    options = {k: v for k, v in launch.kwargs.items() if k not in fn.arg_names}
    constexprs = {p.name for p in fn.params if p.is_constexpr}
    sig, consts, attrs = {}, {}, {}
    for index, name in enumerate(fn.arg_names):
        value = bound[name]
        if name in constexprs or value is None:
            sig[name], consts[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[str(value.dtype)]
            attrs[(index,)] = [["tt.divisibility", 16]]  # allocations are 256-byte aligned
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                sig[name], consts[name] = "constexpr", 1  # the JIT specialises ints equal to 1
            else:
                sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
                if value % 16 == 0:
                    attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return sig, consts, attrs, options


_COMPILED: dict = {}


def compile_sm90(launch: Launch):
    """(cubin path, metadata) of a captured launch compiled for sm_90 (cached per specialisation)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    sig, consts, attrs, options = _specialise(launch)
    key = (launch.kernel.fn.__name__, repr(sorted(sig.items())), repr(sorted(consts.items(), key=str)))
    key += (repr(sorted(attrs.items())), repr(sorted(options.items())))
    if key not in _COMPILED:
        src = ASTSource(launch.kernel, sig, {(launch.kernel.arg_names.index(k),): v for k, v in consts.items()}, attrs)
        kernel = triton_compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        path = Path(tempfile.mkdtemp()) / "k.cubin"
        path.write_bytes(kernel.asm["cubin"])
        _COMPILED[key] = (path, kernel.metadata)
    return _COMPILED[key]


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resources(cubin: Path) -> dict:
    out = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    fields = dict(re.findall(r"([A-Z]+(?:\[0\])?):(\d+)", line))
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"]), "local": int(fields["LOCAL"])}


def sass_loops(cubin: Path) -> list[dict]:
    """Loops of the disassembly in program order (a backward branch closes one): instructions
    per iteration and whether they load from global memory."""
    text = subprocess.run([_tool("nvdisasm"), "-c", "-g", str(cubin)], capture_output=True, text=True).stdout
    instructions, labels = [], {}
    for line in text.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        ins = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?);", line)
        if ins:
            instructions.append(ins.group(1))
    loops = []
    for end, ins in enumerate(instructions):
        target = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", ins)
        if target and target.group(1) in labels and labels[target.group(1)] <= end:
            body = instructions[labels[target.group(1)] : end + 1]
            if len(body) > 4:
                loops.append(
                    {"sass": len(body), "loads": sum("LDG" in b for b in body), "start": labels[target.group(1)]}
                )
    loops = sorted(loops, key=lambda loop: loop["start"])
    # innermost loops only: a backward branch around another loop is control flow, not a hot loop
    inner = [a for a in loops if not any(a["start"] < b["start"] < a["start"] + a["sass"] for b in loops)]
    return inner, len(instructions)


def occupancy(regs: int, smem: int, warps: int) -> tuple[float, str, int]:
    threads = 32 * warps
    per_thread = max(8, -(-regs // 8) * 8)
    limits = {
        "registers": H100["regs"] // (per_thread * threads),
        "shared memory": H100["smem"] // (smem + 1024) if smem else 1 << 30,
        "threads": H100["threads"] // threads,
        "CTAs": H100["ctas"],
    }
    limiter = min(limits, key=limits.get)
    ctas = max(0, limits[limiter])
    return ctas * warps / H100["warps"], limiter, ctas


# --------------------------------------------------------------------------------------------
# what each kernel's hot loops are, and how many entries they cover


def _loop_model(launch: Launch, loops: list[dict], total: int = 0) -> tuple[list[tuple[dict, float]], float]:
    """([(loop, iterations per program)], entries one iteration covers) for a captured launch;
    `total`: SASS instructions of the whole kernel (the selection's code outside its loops)."""
    kw, name = launch.kwargs, launch.kernel.fn.__name__
    bound = dict(zip(launch.kernel.arg_names, launch.args, strict=False))
    reading = [loop for loop in loops if loop["loads"]]
    tensors = 2 if kw.get("DRAFT_MODE") in (1, 2) else 1  # logit rows read per row / request
    phase = kw.get("PHASE", 0)
    if name == "_verify_row_stats_kernel" and phase:
        # one row per program; axis 1 interleaves target and draft (draft logits), which run the same
        # code on rows of the same length: one copy's loops count
        slots = 2 if kw["DRAFT_MODE"] == 1 else 1
        if phase == 1:  # candidates: one tile of FILTER_BLOCK entries per chunk this program takes; the
            # loop with the sum-exp (first) runs only for top-p without top-k
            trips = math.ceil(bound["num_chunks"] / (launch.grid[1] // slots))
            with_z = kw["PER_REQ_K"] or kw["PER_REQ_P"] or (bound["top_k"] == 0 and bound["top_p"] < 1.0)
            return [(reading[0 if with_z else 1], trips)], kw["FILTER_BLOCK"]
        # selection: the code outside loops (all of it, as if run once: an upper bound) and the two
        # bisections in registers: the k-th largest inside its key16 step (16 - SHIFT low key bits:
        # none for bf16; a k-th largest more than 254 bf16 steps below the max bisects up to 16 more),
        # the top-p threshold over at most 32 - SHIFT key bits (SHIFT = 16 for bf16; fp16 counted as fp32)
        shift = 16 if str(bound["target_ptr"].dtype) == "torch.bfloat16" else 0
        register_loops = [loop for loop in loops if not loop["loads"]]
        straight = {"sass": total - sum(loop["sass"] for loop in loops), "loads": 0, "start": -1}
        return [(straight, 1), (register_loops[0], 16 - shift), (register_loops[1], 32 - shift)], 0.0
    if name == "_verify_row_stats_kernel":
        return [(reading[0], bound["chunk_size"] / kw["BLOCK_V"])], kw["BLOCK_R"] * kw["BLOCK_V"] * tensors
    if name == "_verify_accept_kernel":  # (the chunk combine when not merged before,) the race over row j
        race = reading[-1]
        greedy = not kw["PER_REQ_T"] and bound["temperature"] == 0.0  # greedy requests run no race
        hot = [(race, 0 if greedy else bound["chunk_size"] / kw["BLOCK_V"])]
        if len(reading) > 1:
            hot.insert(0, (reading[0], bound["stat_chunks"]))
        return hot, kw["BLOCK_B"] * kw["BLOCK_V"] * tensors
    return [], 0.0


def _bytes(case: dict, launch: Launch) -> float:
    """Bytes a launch reads from the logits (target and draft rows), from the call's shapes."""
    name, kw = launch.kernel.fn.__name__, launch.kwargs
    B, G, V, esize = case["B"], case["G"], case["V"], case["esize"]
    sampled = case["temperature"] > 0
    draft_rows = B * G if (sampled and case["draft"] in ("logits", "probs")) else 0
    draft_esize = esize if case["draft"] == "logits" else 4
    if name == "_verify_row_stats_kernel" and kw.get("PHASE", 0) == 2:  # scratch only (and the select
        return 0.0  # phase's bisection fallback, which a row needs only when the candidates miss its kept set)
    if name == "_verify_row_stats_kernel" and kw.get("PHASE", 0) == 1:  # candidates: one read
        filtered = B * (G + 1) if sampled else 0
        return V * (filtered * esize + (draft_rows * esize if case["draft"] == "logits" else 0))
    if name == "_verify_row_stats_kernel":
        return V * (B * (G + 1) * esize + draft_rows * draft_esize)
    if name == "_verify_accept_kernel" and sampled:  # row j of target and draft per request
        return V * B * (esize + (draft_esize if case["draft"] != "none" else 0))
    return 0.0


def one_read(case: dict) -> float:
    """Bytes of reading every target and draft row of the call once."""
    B, G, V, esize = case["B"], case["G"], case["V"], case["esize"]
    draft = {"logits": esize, "probs": 4, "none": 0}[case["draft"]] if case["temperature"] > 0 else 0
    return V * (B * (G + 1) * esize + B * G * draft)


_PHASES = ["", " (threshold candidates)", " (select)"]


def launch_row(case: dict, launch: Launch) -> dict:
    cubin, meta = compile_sm90(launch)
    res = resources(cubin)
    loops, total = sass_loops(cubin)
    warps = launch.kwargs.get("num_warps", 4)
    smem = int(getattr(meta, "shared", 0) or 0)
    occ, limiter, ctas = occupancy(res["regs"], smem, warps)
    programs = math.prod(launch.grid)
    hot, entries = _loop_model(launch, loops, total)
    per_program = sum(loop["sass"] * trips for loop, trips in hot) * warps  # warp instructions
    busiest = math.ceil(programs / H100["sms"]) * per_program
    issue_us = busiest / (4 * H100["ghz"] * 1e3)
    nbytes = _bytes(case, launch)
    floor_us = nbytes / H100["hbm"] * 1e6
    first = hot[-1][0]["sass"] if hot else 0
    return {
        "case": case["name"],
        "kernel": launch.kernel.fn.__name__ + _PHASES[launch.kwargs.get("PHASE", 0)],
        "grid": "x".join(map(str, launch.grid)),
        "config": ",".join(
            f"{k}={v}" for k, v in launch.kwargs.items() if k.startswith(("BLOCK", "FILTER", "num_")) and v is not None
        ),
        "regs": res["regs"],
        "spill_bytes": res["local"],
        "stack": res["stack"],
        "smem": smem,
        "occupancy": round(occ, 3),
        "limiter": limiter,
        "ctas": programs,
        "waves": round(programs / (H100["sms"] * max(ctas, 1)), 2),
        "loop_sass": "+".join(str(loop["sass"]) for loop, _ in hot),
        "sass_per_entry": round(first * 32 * warps / entries, 1) if entries else "",
        "bytes": int(nbytes),
        "passes": round(nbytes / one_read(case), 2),
        "byte_floor_us": round(floor_us, 2),
        "issue_bound_us": round(issue_us, 2),
        "estimate_us": round(max(floor_us, issue_us), 2),
    }


# --------------------------------------------------------------------------------------------
# the calls


def chain_cases(smoke: bool) -> list[dict]:
    vocabs, batches = ([32000], [1]) if smoke else ([151936, 32000], [1, 8, 64])
    settings = [("greedy", 0.0, 0, 1.0), ("sampled", 0.7, 0, 1.0), ("topk50_topp0.9", 0.7, 50, 0.9)]
    drafts = ["logits"] if smoke else ["logits", "probs", "none"]
    cases = []
    for V in vocabs:
        for B in batches:
            for label, temperature, top_k, top_p in settings if not smoke else settings[1:]:
                for draft in drafts if temperature > 0 else ["logits"]:
                    name = f"verify V={V} B={B} G=4 bf16 {label} draft={draft}"
                    case = dict(name=name, V=V, B=B, G=4, esize=2, draft=draft)
                    cases.append(dict(case, temperature=temperature, top_k=top_k, top_p=top_p))
    return cases


def capture_chain(case: dict) -> list[Launch]:
    import torch

    import specdec_kernels as sk
    from specdec_kernels._interpreter import plan_as_gpu

    B, G, V = case["B"], case["G"], case["V"]
    target = torch.empty(B, G + 1, V, dtype=torch.bfloat16)
    tokens = torch.zeros(B, G, dtype=torch.int64)
    draft = {
        "logits": {"draft_logits": torch.empty(B, G, V, dtype=torch.bfloat16)},
        "probs": {"draft_probs": torch.empty(B, G, V, dtype=torch.float32)},
        "none": {},
    }[case["draft"]]
    kw = dict(temperature=case["temperature"], top_k=case["top_k"], top_p=case["top_p"], seed=1)
    with plan_as_gpu(H100["sms"]), captured_launches() as launches:
        sk.verify(target, tokens, **draft, **kw, validate=False, backend="triton")
    return launches


def run(smoke: bool) -> list[dict]:
    meta = environment_metadata("cpu")
    rows = []
    for case in chain_cases(smoke):
        launches = capture_chain(case)
        kernel_rows = [launch_row(case, launch) for launch in launches]
        total = {k: sum(r[k] for r in kernel_rows) for k in ("bytes", "byte_floor_us", "issue_bound_us", "estimate_us")}
        call = dict(case=case["name"], kernel="(call)", grid="", config=f"{len(launches)} launches", **total)
        call["passes"] = round(total["bytes"] / one_read(case), 2)
        for row in [*kernel_rows, call]:
            rows.append(
                {"date": meta["date"], "commit": meta["commit"], "triton": meta["triton"], "arch": "sm_90", **row}
            )
    return rows


# --------------------------------------------------------------------------------------------
# the CUDA C++ backend (csrc/verify_cuda.cu), when nvcc is present


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    if found is None and (Path(home) / "bin" / "nvcc").is_file():
        found = str(Path(home) / "bin" / "nvcc")
    return found


def csrc_rows(meta: dict) -> list[dict]:
    """Registers, stack, spills, shared memory and occupancy of every csrc kernel instantiation
    (target x draft dtype), compiled for sm_90 with the build's flags. The launchers use 256
    threads per block (512 for chain calls with top-k / top-p); occupancy is given at 256."""
    nvcc = _nvcc()
    if nvcc is None:
        return []
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    flags = json.loads((csrc / "build.json").read_text())["cuda"]["cuda_cflags"]
    cubin = Path(tempfile.mkdtemp()) / "verify_cuda.cubin"
    cmd = [nvcc, "-cubin", "-std=c++17", f"-I{csrc}", *flags, "-arch=sm_90", str(csrc / "verify_cuda.cu")]
    subprocess.run([*cmd, "-o", str(cubin)], check=True, capture_output=True, text=True)
    out = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    rows = []
    for name, usage in re.findall(r"Function (\S+):\s*\n\s*(REG:.*)", out):
        fields = dict(re.findall(r"([A-Z]+(?:\[0\])?):(\d+)", usage))
        kernel = re.search(r"(row_stats|accept|finalize|tree_walk)_kernel(?:I(.*)EEv)?", name)
        dtypes = ",".join(_demangled_types(kernel.group(2) or ""))  # target and draft element types
        regs, smem = int(fields["REG"]), int(fields["SHARED"])
        occ, limiter, _ = occupancy(regs, smem, 8)
        rows.append(
            {
                "date": meta["date"],
                "commit": meta["commit"],
                "triton": meta["triton"],
                "arch": "sm_90",
                "case": "csrc verify_cuda.cu (nvcc " + _nvcc_version(nvcc) + ")",
                "kernel": f"{kernel.group(1)}_kernel<{dtypes}>" if dtypes else f"{kernel.group(1)}_kernel",
                "config": "threads=256",
                "regs": regs,
                "spill_bytes": int(fields["LOCAL"]),
                "stack": int(fields["STACK"]),
                "smem": smem,
                "occupancy": round(occ, 3),
                "limiter": limiter,
            }
        )
    return rows


def _demangled_types(mangled: str) -> list[str]:
    """Itanium-mangled template arguments of a csrc kernel: f = float, sk::bf16, sk::f16, S2_ = the
    first of them again."""
    names = {"f": "f32", "NS_4bf16E": "bf16", "NS_3f16E": "f16"}
    types = []
    while mangled:
        token = next((t for t in (*names, "S2_") if mangled.startswith(t)), None)
        if token is None:
            return [mangled]
        types.append(types[0] if token == "S2_" else names[token])
        mangled = mangled[len(token) :]
    return types


def _nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release ([\d.]+)", out)
    return found.group(1) if found else "?"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one small shape (CI)")
    parser.add_argument(
        "--no-csrc", dest="csrc", action="store_false", help="skip the csrc kernels (compiled when nvcc is found)"
    )
    parser.add_argument("--csv", default=str(Path(__file__).parent / "results" / "static_sm90.csv"))
    args = parser.parse_args(argv)
    rows = run(args.smoke)
    print("# static model, sm_90 (H100 SXM: 132 SMs, 3.35 TB/s): *estimates*, not measurements")
    print_table(
        rows, ["case", "kernel", "grid", "regs", "stack", "occupancy", "sass_per_entry", "passes", "estimate_us"]
    )
    if args.csrc and not args.smoke:
        csrc = csrc_rows(environment_metadata("cpu"))
        print("# csrc (CUDA C++ backend), sm_90: " + (f"{len(csrc)} kernels" if csrc else "nvcc not found"))
        print_table(csrc, ["kernel", "regs", "spill_bytes", "stack", "smem", "occupancy", "limiter"])
        rows += csrc
    if not args.smoke:
        from bench._common import append_rows_csv

        append_rows_csv(args.csv, rows, COLUMNS)
        print(f"{len(rows)} rows appended to {args.csv}")
    return 0


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"
    sys.exit(main())
