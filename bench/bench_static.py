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

Grammar masks (``token_bitmask=``, read natively by the Triton kernels): ``--cases mask`` compiles
the chain and tree calls with and without a mask and writes them as the commit's section; a mask adds
its words, ceil(V / 32) int32 = V / 8 bytes, per row read (``mask_bytes``).

Native logprobs (``return_logprobs=True``, read from the row records by the Triton finalize kernel,
on trees by the walk and the race's merge): ``--cases logprobs`` compiles the chain and tree calls
with and without them and writes them as the commit's section; the kernels add one logit per emitted
position (noise), and greedy rows with top-k / top-p go through the threshold phases too (their
logprobs apply the filters at T = 1).

Block verification (``method="block"``: the accept kernel's two block launches, ``ops/triton/block.py``):
``--cases block`` compiles the chain calls at V = 151,936, B = 64, G = 4, bf16 with the token rule and
with block verification and writes them as the commit's section. The residual-mass launch is modelled
at its worst case, a pass over every row 1 .. G - 1 of each request (target and draft); a call reads
only the rows whose uniform does not exceed their weight (fewer).

Usage: python bench/bench_static.py [--smoke] [--csv PATH] [--cases all|chain|tree|mask|mask+attention|logprobs|block]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
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
# The calls' seed: random-looking, as a user's. Triton would specialise a seed of 1 into a constant
# (and 16-divisible ones into aligned values), compiling kernels that real calls never run.
STATIC_SEED = 2**31 + 5
# Latency terms, calibrated on an H200 (2026-11-27, c23d175, CUDA graphs): the old chunk merge's loop
# over 149 chunk records, one dependent round trip each, took 42 us (0.28 us a trip), and the smallest
# verify launches (accept, finalize, row stats at B = 1) 2.4-4.6 us each. Bytes and issue slots alone
# priced those at ~0: a launch costs at least LAUNCH_FLOOR_US, a loop of dependent loads ROUND_TRIP_US a trip.
ROUND_TRIP_US = 0.28
LAUNCH_FLOOR_US = 2.0
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
    "local_ops",
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
    "latency_us",
    "estimate_us",
]


@dataclasses.dataclass
class Launch:
    kernel: object  # JITFunction
    grid: tuple
    args: tuple
    kwargs: dict


def launch_arguments(launch: Launch) -> dict:
    """Every argument of a captured launch by parameter name (the launchers pass most by keyword)."""
    return dict(zip(launch.kernel.arg_names, launch.args, strict=False)) | launch.kwargs


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
_TYPES["torch.float64"] = "fp64"  # block verification's residual masses
_TYPES.update({"torch.int32": "i32", "torch.bool": "i1", "torch.int8": "i8", "torch.uint8": "u8"})


def _specialise(launch: Launch):
    """(signature, constexprs, attributes, options) the JIT would compile this launch with."""
    import torch

    fn = launch.kernel
    bound = dict(zip(fn.arg_names, launch.args, strict=False))
    bound.update({k: v for k, v in launch.kwargs.items() if k in fn.arg_names})
    options = {k: v for k, v in launch.kwargs.items() if k not in fn.arg_names}
    params = {p.name: p for p in fn.params}
    sig, consts, attrs = {}, {}, {}
    for index, name in enumerate(fn.arg_names):
        param = params[name]
        value = bound[name] if name in bound else param.default  # a constexpr left at its default
        if param.is_constexpr or value is None:
            sig[name], consts[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[str(value.dtype)]
            attrs[(index,)] = [["tt.divisibility", 16]]  # allocations are 256-byte aligned
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            # as the JIT: an annotated type wins; do_not_specialize: no constant 1, no divisibility
            specialise = not param.do_not_specialize
            if value == 1 and specialise:
                sig[name], consts[name] = "constexpr", 1  # the JIT specialises ints equal to 1
            else:
                sig[name] = param.annotation_type or ("i32" if -(2**31) <= value < 2**31 else "i64")
                if value % 16 == 0 and specialise:
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
        path.with_suffix(".ptx").write_text(kernel.asm["ptx"])
        _COMPILED[key] = (path, kernel.metadata)
    return _COMPILED[key]


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


@functools.cache  # one compiled cubin serves many launch rows: run its tools once
def resources(cubin: Path) -> dict:
    """Registers, stack frame and spills of a compiled kernel. cuobjdump's LOCAL column is 0 when
    the spills live in the stack frame, so spills come from ptxas's own report on the kernel's PTX
    (``ptxas_report``), and ``local_ops`` counts the LDL / STL instructions of the SASS."""
    out = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    fields = dict(re.findall(r"([A-Z]+(?:\[0\])?):(\d+)", line))
    found = {"regs": int(fields["REG"]), "stack": int(fields["STACK"]), "local": int(fields["LOCAL"])}
    ptx = cubin.with_suffix(".ptx")
    report = ptxas_report(ptx.read_text()) if ptx.exists() else {}
    found["spill"] = max(found["local"], report.get("spill_stores", 0), report.get("spill_loads", 0))
    found["stack"] = max(found["stack"], report.get("stack", 0))
    found["local_ops"] = local_memory_instructions(cubin)
    return found


def ptxas_report(ptx: str, arch: str = "sm_90a") -> dict:
    """ptxas -v's figures for the (single) kernel of `ptx`: stack frame, spill stores and loads."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        # Triton's own ptxas command (backends/nvidia/compiler.py make_cubin), where this ptxas knows it
        flags = [["-lineinfo", "--regAllocOptLevel=2"], []]
        for ptxas, extra in itertools.product(("ptxas-blackwell", "ptxas"), flags):
            cmd = [_tool(ptxas), *extra, "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "k.o")]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode == 0:
                return parse_ptxas(done.stdout + done.stderr)
    return {}


def parse_ptxas(text: str) -> dict:
    """{stack, spill_stores, spill_loads} (bytes) from ptxas -v's output; {} when it printed none."""
    found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if not found:
        return {}
    stack, stores, loads = map(int, found.groups())
    return {"stack": stack, "spill_stores": stores, "spill_loads": loads}


def sass_loops(cubin: Path, innermost: bool = True) -> list[dict]:
    """Loops of the disassembly in program order (a backward branch closes one): instructions
    per iteration and whether they load from global memory (innermost ones only, unless told)."""
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
                    {
                        "sass": len(body),
                        "loads": sum("LDG" in b for b in body),
                        "local": sum(bool(re.search(r"\b(?:LDL|STL)\b", b)) for b in body),  # spill traffic
                        "start": labels[target.group(1)],
                    }
                )
    loops = sorted(loops, key=lambda loop: loop["start"])
    # innermost loops only: a backward branch around another loop is control flow, not a hot loop
    inner = [a for a in loops if not any(a["start"] < b["start"] < a["start"] + a["sass"] for b in loops)]
    return (inner if innermost else loops), len(instructions)


def local_memory_instructions(cubin: Path) -> int:
    """Local-memory loads and stores (LDL / STL) in the disassembly: 0 means a reported stack frame
    is reserved but never touched."""
    text = subprocess.run([_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
    return len(re.findall(r"\b(?:LDL|STL)\b", text))


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
    bound = launch_arguments(launch)
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
    if name == "_verify_accept_kernel" and kw.get("BLOCK", 0) == 1:  # residual masses: rows 1 .. G - 1 (worst case)
        trips = bound["chunk_size"] / kw["BLOCK_V"] * (bound["G"] - 1)
        return [(reading[-1], trips)], kw["BLOCK_B"] * kw["BLOCK_V"] * tensors
    if name == "_verify_accept_kernel" and kw.get("WRITE_TOKENS"):  # all greedy: the chunk combine, no race
        return [(reading[0], bound["stat_chunks"])] if reading else [], kw["BLOCK_B"] * kw["BLOCK_V"] * tensors
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
        filtered = B * (G + 1) if sampled or case.get("logprobs") else 0  # logprobs: greedy rows' thresholds too
        return V * (filtered * esize + (draft_rows * esize if case["draft"] == "logits" else 0))
    if name == "_verify_row_stats_kernel":
        return V * (B * (G + 1) * esize + draft_rows * draft_esize)
    if name == "_verify_accept_kernel" and sampled:  # row j of target and draft per request
        rows = G - 1 if kw.get("BLOCK", 0) == 1 else 1  # block's residual masses: rows 1 .. G - 1 (worst case)
        return V * B * rows * (esize + (draft_esize if case["draft"] != "none" else 0))
    return 0.0


def one_read(case: dict) -> float:
    """Bytes of reading every target and draft row of the call once."""
    B, G, V, esize = case["B"], case["G"], case["V"], case["esize"]
    draft = {"logits": esize, "probs": 4, "none": 0}[case["draft"]] if case["temperature"] > 0 else 0
    return V * (B * (G + 1) * esize + B * G * draft)


def mask_row_bytes(V: int) -> int:
    """Bytes of one token_bitmask row: ceil(V / 32) int32 words (V / 8 rounded up to a word)."""
    return 4 * ((V + 31) // 32)


def mask_bytes(case: dict, launch: Launch, logits_bytes: float) -> float:
    """Bytes of token_bitmask words a launch reads (0 without ``case["mask"]``): one mask row per
    logits row it reads, except that a chain's draft row i shares target row i's words, read by the
    same program (the row pass, the accept kernel's row j) or by its neighbour (the threshold phases'
    draft programs, L2), so chains count target rows only; a tree's draft row uses its parent's mask
    row, another program's, so every target and draft row counts."""
    if not case.get("mask") or not logits_bytes:
        return 0.0
    V, e, name = case["V"], case["esize"], launch.kernel.fn.__name__
    if "op" in case:  # trees: every logits row read (bf16 rows; the bytes model counts them at esize)
        return logits_bytes / (V * e) * mask_row_bytes(V)
    B, G, phase = case["B"], case["G"], launch.kwargs.get("PHASE", 0)
    if name == "_verify_row_stats_kernel" and phase in (0, 1):  # statistics / threshold candidates: target rows
        return B * (G + 1) * mask_row_bytes(V)
    if name == "_verify_accept_kernel":  # row j of each sampled request (the accept test's entries: noise)
        return B * (G - 1 if launch.kwargs.get("BLOCK", 0) == 1 else 1) * mask_row_bytes(V)
    return 0.0


_PHASES = ["", " (threshold candidates)", " (select)"]
_BLOCK_LAUNCHES = ["", " (block masses)", " (block race)"]  # the accept kernel's BLOCK constexpr


def latency_us(launch: Launch) -> float:
    """The launch's latency bound: LAUNCH_FLOOR_US, or its dependent round trips (the chunk merge:
    one per BLOCK_C chunks of a row; the chain accept kernel's own merge of unmerged records: one
    per chunk) at ROUND_TRIP_US each."""
    trips, name = 1, launch.kernel.fn.__name__
    if name == "_combine_row_stats_kernel":
        trips = math.ceil(launch_arguments(launch)["num_chunks"] / launch.kwargs.get("BLOCK_C", 1))
    elif name == "_verify_accept_kernel":
        trips = launch_arguments(launch)["stat_chunks"]
    return max(LAUNCH_FLOOR_US, trips * ROUND_TRIP_US)


def launch_row(case: dict, launch: Launch) -> dict:
    cubin, meta = compile_sm90(launch)
    res = resources(cubin)
    loops, total = sass_loops(cubin)
    warps = launch.kwargs.get("num_warps", 4)
    smem = int(getattr(meta, "shared", 0) or 0)
    occ, limiter, ctas = occupancy(res["regs"], smem, warps)
    programs = math.prod(launch.grid)
    model = case.get("model")  # tree cases carry their own loop and byte models
    hot, entries = model.loops(case, launch, loops) if model else _loop_model(launch, loops, total)
    per_program = sum(loop["sass"] * trips for loop, trips in hot) * warps  # warp instructions
    busiest = math.ceil(programs / H100["sms"]) * per_program
    issue_us = busiest / (4 * H100["ghz"] * 1e3)
    nbytes = model.bytes(case, launch) if model else _bytes(case, launch)
    nbytes += mask_bytes(case, launch, nbytes)
    floor_us = nbytes / H100["hbm"] * 1e6
    wait_us = latency_us(launch)
    first = hot[-1][0]["sass"] if hot else 0
    return {
        "case": case["name"],
        "kernel": launch.kernel.fn.__name__
        + _PHASES[launch.kwargs.get("PHASE", 0)]
        + _BLOCK_LAUNCHES[launch.kwargs.get("BLOCK", 0)],
        "grid": "x".join(map(str, launch.grid)),
        "config": ",".join(
            f"{k}={v}"
            for k, v in launch.kwargs.items()
            if k.startswith(("BLOCK", "FILTER", "num_")) and isinstance(v, (int, float, bool))  # not num_*_ptr tensors
        ),
        "regs": res["regs"],
        "spill_bytes": res["spill"],
        "local_ops": res["local_ops"],
        "stack": res["stack"],
        "smem": smem,
        "occupancy": round(occ, 3),
        "limiter": limiter,
        "ctas": programs,
        "waves": round(programs / (H100["sms"] * max(ctas, 1)), 2),
        "loop_sass": "+".join(str(loop["sass"]) for loop, _ in hot),
        "sass_per_entry": round(first * 32 * warps / entries, 1) if entries else "",
        "bytes": int(nbytes),
        "passes": round(nbytes / (model.one_read(case) if model else one_read(case)), 2),
        "byte_floor_us": round(floor_us, 2),
        "issue_bound_us": round(issue_us, 2),
        "latency_us": round(wait_us, 2),
        "estimate_us": round(max(floor_us, issue_us, wait_us), 2),
    }


# --------------------------------------------------------------------------------------------
# the calls


def chain_cases(smoke: bool) -> list[dict]:
    vocabs, batches = ([32000], [1]) if smoke else ([151936, 32000], [1, 8, 64])
    settings = [
        ("greedy", 0.0, 0, 1.0, "keep"),
        ("sampled", 0.7, 0, 1.0, "keep"),
        ("topk50_topp0.9", 0.7, 50, 0.9, "keep"),
        ("topk50_topp0.9_by_index", 0.7, 50, 0.9, "by_index"),  # top_p_ties: the index cut's kernels
    ]
    drafts = ["logits"] if smoke else ["logits", "probs", "none"]
    cases = []
    for V in vocabs:
        for B in batches:
            for label, temperature, top_k, top_p, ties in settings if not smoke else settings[1:]:
                for draft in drafts if temperature > 0 else ["logits"]:
                    name = f"verify V={V} B={B} G=4 bf16 {label} draft={draft}"
                    case = dict(name=name, V=V, B=B, G=4, esize=2, draft=draft, top_p_ties=ties)
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
    kw = dict(temperature=case["temperature"], top_k=case["top_k"], top_p=case["top_p"], seed=STATIC_SEED)
    kw["top_p_ties"] = case.get("top_p_ties", "keep")
    if case.get("mask"):  # grammar words of every target row (draft row i uses row i)
        kw["token_bitmask"] = torch.zeros(B, G + 1, (V + 31) // 32, dtype=torch.int32)
    if case.get("logprobs"):  # native: the finalize kernel's LOGPROBS variant, no post-pass
        kw["return_logprobs"] = True
    if case.get("block"):  # block verification: the accept kernel's BLOCK_MASS and BLOCK_RACE launches
        kw["method"] = "block"
    with plan_as_gpu(H100["sms"]), captured_launches() as launches:
        sk.verify(target, tokens, **draft, **kw, validate=False, backend="triton")
    return launches


# --------------------------------------------------------------------------------------------
# tree verification (verify_multi, verify_tree) and tree attention (issue 13)


def eagle_tree(n: int = 60) -> list[int]:
    """Parents of an EAGLE-like tree in BFS order: the root has 4 children, each of them 3, each of
    those 2, and the first remaining nodes one child each (n = 60: 17 positions with siblings, depth 4)."""
    parents, level, fan = [], [-1], [4, 3, 2, 1, 1, 1]
    for f in fan:
        nxt = []
        for node in level:
            for _ in range(f):
                if len(parents) < n:
                    parents.append(node)
                    nxt.append(len(parents) - 1)
        level = nxt
    return parents


def _sibling_positions(case: dict) -> list[int]:
    """Candidate counts of the positions with more than one candidate (distinct sibling tokens)."""
    if case["op"] == "verify_multi":
        return [case["K"]]
    children = {}
    for parent in case["parents"]:
        children[parent] = children.get(parent, 0) + 1
    return [k for k in children.values() if k > 1]


RHO_ACTIVITY_SAMPLES = 4  # synthetic (p, q) pairs per position with siblings


@functools.cache
def rho_round_activity(V: int, temperature: float, ks: tuple[int, ...], samples: int = RHO_ACTIVITY_SAMPLES):
    """Share of the positions with siblings whose K-SEQ rho search is still running in each round
    (round 0: all), *measured* with the reference's rule (``reference.verify_tree.rho_search``) on
    bench_verify_tree's synthetic world at its default mismatch (target 3 N(0, 1), draft = target +
    sigma N(0, 1), sigma = 1) at the case's temperature: ``samples`` pairs per position (k in ks).
    A position whose search stopped costs its round's programs one record load, no vocabulary; the
    worst case (every search runs every round) is RHO_ROUNDS full rounds."""
    import torch

    from bench.bench_verify_tree import DEFAULT_SIGMA, LOGIT_SCALE
    from specdec_kernels.reference.verify_tree import RHO_POINTS, RHO_ROUNDS, rho_search

    gen = torch.Generator().manual_seed(2026)
    running = [0] * RHO_ROUNDS
    for k in ks:
        for _ in range(samples):
            z = torch.randn(2, V, generator=gen, dtype=torch.float64)
            target = z[0] * LOGIT_SCALE
            p = torch.softmax(target / temperature, 0)
            q = torch.softmax((target + DEFAULT_SIGMA * z[1]) / temperature, 0)
            rounds = []

            def g_of(pts, p=p, q=q, rounds=rounds):
                rounds.append(1)
                return torch.stack([torch.minimum(pts[:, m : m + 1] * q, p).sum(1) for m in range(RHO_POINTS)], 1)

            rho_search(g_of, torch.tensor([k]))
            for r in range(len(rounds)):
                running[r] += 1
    return [n / (len(ks) * samples) for n in running]


class TreeVerifyModel:
    """Loops and bytes of the tree verification launches. The walk's vocabulary work depends on the
    random path; modelled: the request rejects every candidate at the root (one position with
    siblings, then the recovered-token race) - the least work any sampled request does."""

    @staticmethod
    def rows(case: dict) -> tuple[int, int]:
        """(target rows, draft rows) of one request."""
        if case["op"] == "verify_multi":
            return case["K"] * (case["G"] + 1), case["K"] * case["G"]
        return case["N"] + 1, case["N"]

    @staticmethod
    def one_read(case: dict) -> float:
        rows_t, rows_d = TreeVerifyModel.rows(case)
        return case["V"] * case["B"] * (rows_t + rows_d) * case["esize"]

    @staticmethod
    def used_rows(case: dict) -> tuple[int, int]:
        """(target rows, draft rows) of one request that the row pass reads (sibling tokens distinct):
        every position's target row (the root's once, not its copies in chains k > 0) and the draft row
        of each position's first candidate only (later siblings share its prefix)."""
        if case["op"] == "verify_multi":
            return 1 + case["K"] * case["G"], 1 + case["K"] * (case["G"] - 1)
        return case["N"] + 1, len(set(case["parents"]))

    @staticmethod
    def row_pass_read(case: dict) -> float:
        return case["V"] * case["B"] * sum(TreeVerifyModel.used_rows(case)) * case["esize"]

    @staticmethod
    def loops(case: dict, launch: Launch, loops: list[dict]):
        name, kw = launch.kernel.fn.__name__, launch.kwargs
        bound = launch_arguments(launch)
        reading = [loop for loop in loops if loop["loads"]]
        if name == "_verify_row_stats_kernel":
            return [(reading[0], bound["chunk_size"] / kw["BLOCK_V"])], kw["BLOCK_R"] * kw["BLOCK_V"] * 2
        if name == "_tree_walk_kernel" and kw["METHOD"] != 0:
            # RRS: the vocabulary loops hold the residual's per-rejection loop (counted once)
            every, _total = sass_loops(compile_sm90(launch)[0], innermost=False)
            nested = [
                a for a in every if a["loads"] and any(a["start"] < b["start"] < a["start"] + a["sass"] for b in every)
            ]
            reading = nested or reading
        if name == "_tree_race_kernel":
            every, _total = sass_loops(compile_sm90(launch)[0], innermost=False)
            outer = [a for a in every if a["loads"]]  # RRS / one-hot: the residual's loop is inside
            return [(outer[-1], bound["chunk_size"] / kw["BLOCK_V"])], kw["BLOCK_B"] * kw["BLOCK_V"] * 2
        if name == "_tree_walk_kernel" and "race_i_ptr" in launch.kernel.arg_names:
            trips = case["V"] / kw["BLOCK_V"]
            search = TreeVerifyModel.walk_searches(case, launch)
            return ([(reading[0], search * trips)] if search and reading else []), kw["BLOCK_B"] * kw["BLOCK_V"] * 2
        if name == "_tree_walk_kernel" and reading:
            trips = case["V"] / kw["BLOCK_V"]
            search = TreeVerifyModel.walk_searches(case, launch)
            hot = [(reading[0], search * trips), (reading[-1], trips)] if len(reading) > 1 else [(reading[0], trips)]
            return hot, kw["BLOCK_B"] * kw["BLOCK_V"] * 2
        return TreeVerifyModel.extra_loops(case, launch, loops, reading, bound)

    @staticmethod
    def rho_share(case: dict, bound: dict) -> float:
        """Share of the positions with siblings whose rho search runs in this round (measured)."""
        ks = tuple(sorted(_sibling_positions(case)))
        return rho_round_activity(case["V"], case["temperature"], ks)[bound["rnd"]]

    @staticmethod
    def walk_searches(case: dict, launch: Launch) -> int:
        """Vocabulary passes of the walk before its race at the root (K-SEQ's rho search in the walk
        itself, or RRS's residual masses), 0 once they run in _tree_rho_kernel."""
        kw = launch.kwargs
        k_root = _sibling_positions(case)[0]
        if kw["METHOD"] == 0:
            return 0 if "brk_ptr" in launch.kernel.arg_names else kw["RHO_R"]
        return 0 if "rrs_ptr" in launch.kernel.arg_names else k_root - 1

    @staticmethod
    def extra_loops(case, launch, loops, reading, bound):
        name, kw = launch.kernel.fn.__name__, launch.kwargs
        if name == "_tree_rrs_kernel":
            every, _total = sass_loops(compile_sm90(launch)[0], innermost=False)
            outer = [a for a in every if a["loads"]]  # the residual's per-rejection loop is inside
            programs = math.prod(launch.grid)
            active = case["B"] * sum(k > bound["rnd"] for k in _sibling_positions(case)) * launch.grid[1]
            share = math.ceil(active / H100["sms"]) / math.ceil(programs / H100["sms"])
            return [(outer[-1], bound["chunk_size"] / kw["BLOCK_V"] * share)], kw["BLOCK_P"] * kw["BLOCK_V"] * 2
        if name == "_tree_rho_kernel" and reading:
            # only programs of positions with siblings whose search runs this round work: scale to the
            # busiest SM's share of them
            programs = math.prod(launch.grid)
            active = round(case["B"] * len(_sibling_positions(case)) * TreeVerifyModel.rho_share(case, bound))
            active *= launch.grid[1]
            share = math.ceil(active / H100["sms"]) / math.ceil(programs / H100["sms"])
            trips = bound["chunk_size"] / kw["BLOCK_V"] * share
            return [(reading[-1], trips)], kw["BLOCK_P"] * kw["BLOCK_V"] * 2  # after the merge of the last round
        return [], 0.0

    @staticmethod
    def bytes(case: dict, launch: Launch) -> float:
        name = launch.kernel.fn.__name__
        B, V, e = case["B"], case["V"], case["esize"]
        if name == "_verify_row_stats_kernel":
            return TreeVerifyModel.row_pass_read(case)
        if name == "_tree_walk_kernel":
            search = TreeVerifyModel.walk_searches(case, launch)
            races = 0 if "race_i_ptr" in launch.kernel.arg_names else 1  # the race has its own launch now
            return B * (search + races) * 2 * V * e  # target and draft row of the root: searches + race
        if name == "_tree_race_kernel":
            return B * 2 * V * e
        if name == "_tree_rho_kernel":  # one round: target and draft row of every position still searching
            bound = launch_arguments(launch)
            return B * len(_sibling_positions(case)) * TreeVerifyModel.rho_share(case, bound) * 2 * V * e
        if name == "_tree_rrs_kernel":  # round j: the positions with more than j candidates
            j = launch_arguments(launch)["rnd"]
            return B * sum(k > j for k in _sibling_positions(case)) * 2 * V * e
        return TreeVerifyModel.extra_bytes(case, launch)

    @staticmethod
    def extra_bytes(case, launch):
        return 0.0


def tree_cases(smoke: bool) -> list[dict]:
    V, batches = (32000, [1]) if smoke else (151936, [1, 64])
    cases = []
    for B in batches:
        for method in ["kseq", "rrs", "rrs_wor"]:
            base = dict(V=V, B=B, esize=2, draft="logits", temperature=0.7, method=method, model=TreeVerifyModel)
            cases.append(
                dict(base, op="verify_multi", K=4, G=4, name=f"verify_multi K=4 G=4 V={V} B={B} bf16 {method}")
            )
            name = f"verify_tree N=60 (EAGLE-like) V={V} B={B} bf16 {method}"
            cases.append(dict(base, op="verify_tree", N=60, parents=eagle_tree(60), name=name))
    return cases


def capture_tree(case: dict) -> list[Launch]:
    import torch

    import specdec_kernels as sk
    from specdec_kernels._interpreter import plan_as_gpu

    B, V = case["B"], case["V"]
    kw = dict(temperature=case["temperature"], seed=STATIC_SEED, method=case["method"], validate=False)
    kw["backend"] = "triton"
    if case.get("logprobs"):  # native: the walk's and the race merge's LOGPROBS variants, no post-pass
        kw["return_logprobs"] = True
    W = (V + 31) // 32
    with plan_as_gpu(H100["sms"]), captured_launches() as launches:
        if case["op"] == "verify_multi":
            K, G = case["K"], case["G"]
            target = torch.empty(B, K, G + 1, V, dtype=torch.bfloat16)
            draft = torch.empty(B, K, G, V, dtype=torch.bfloat16)
            if case.get("mask"):
                kw["token_bitmask"] = torch.zeros(B, K, G + 1, W, dtype=torch.int32)
            sk.verify_multi(target, torch.zeros(B, K, G, dtype=torch.int64), draft_logits=draft, **kw)
        else:
            N = case["N"]
            parents = torch.tensor(case["parents"]).expand(B, N).contiguous()
            depth = max(tree_depths(case["parents"]))
            target = torch.empty(B, N + 1, V, dtype=torch.bfloat16)
            draft = torch.empty(B, N, V, dtype=torch.bfloat16)
            tokens = torch.zeros(B, N, dtype=torch.int64)
            if case.get("mask"):
                kw["token_bitmask"] = torch.zeros(B, N + 1, W, dtype=torch.int32)
            sk.verify_tree(target, tokens, parents, draft_logits=draft, max_depth=depth, **kw)
    return launches


def tree_depths(parents: list[int]) -> list[int]:
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


class ChainModel:
    """The chain model (``_loop_model``, ``_bytes``, ``one_read``) behind the tree models' interface."""

    loops = staticmethod(lambda case, launch, loops: _loop_model(launch, loops))
    bytes = staticmethod(lambda case, launch: _bytes(case, launch))
    one_read = staticmethod(lambda case: one_read(case))


class TreeAttentionModel:
    """Bytes: K/V of every prefix key once per program that covers it (query tiles of one (request,
    KV head) each read them; L2 reuse is not modelled), the tree keys, q (once per split), out and the split partials
    (per query row and split: the split's normalised output in q's dtype + fp32 max and sum, written by
    the kernel and read by the merge). One read = K and V once per (request, KV head)."""

    @staticmethod
    def kv_once(case: dict) -> float:
        return case["B"] * case["Hkv"] * (case["prefix"] + case["N"]) * case["D"] * 2 * case["esize"]

    one_read = kv_once

    @staticmethod
    def sdpa_floor_us(case: dict) -> float:
        qo = 2 * case["B"] * case["Hq"] * case["N"] * case["D"] * case["esize"]
        return (TreeAttentionModel.kv_once(case) + qo) / H100["hbm"] * 1e6

    @staticmethod
    def filled_bound_bytes(case: dict) -> float:
        """The fewest bytes any layout can move that reads K/V once per (request, KV head) and launches at
        least one program per SM (the issue's ">= 132 CTAs at B = 1"), counting every byte as HBM traffic.

        With fewer (request, KV head) pairs than SMs the keys of a pair are split over programs, P of them
        in all (the least multiple of the pair count >= the SMs, so that splits are even). Each program
        then needs the q rows of its whole GQA group (every row attends its prefix keys), and every program
        but one per pair must hand a partial result per row to a merge (in q's dtype + fp32 max and sum,
        written once and read once; the pair's last program could merge in place). Smaller tiles of rows
        do not help: a pair's keys would then be read once per tile. At B = 1, N = 16 this is 1.40x reading
        K/V once, at N = 64 2.57x: the 1.1x target needs L2 hits, which this model does not count."""
        B, Hq, Hkv, N, D, e = (case[k] for k in ("B", "Hq", "Hkv", "N", "D", "esize"))
        pairs, rows = B * Hkv, Hq // Hkv * N
        programs = max(pairs, math.ceil(H100["sms"] / pairs) * pairs)
        q_reads = programs * rows * D * e
        partials = 2 * (programs - pairs) * rows * (D * e + 8)
        return TreeAttentionModel.kv_once(case) + q_reads + partials + B * Hq * N * D * e

    @staticmethod
    def loops(case: dict, launch: Launch, loops: list[dict]):
        """The unmasked prefix loop, trips per program of the busiest SM: programs go to the SMs in
        grid order (split slowest); the last split of a split launch holds the tree keys only."""
        name, kw = launch.kernel.fn.__name__, launch.kwargs
        bound = launch_arguments(launch)
        reading = [loop for loop in loops if loop["loads"]]
        if name != "_tree_attention_kernel" or not reading:
            return [], 0.0
        pairs, splits = launch.grid[0], kw["NUM_SPLITS"]
        split_len = bound["split_len"]
        tiles = [
            max(0, min(case["prefix"], (s + 1) * split_len if s < splits - 1 else case["prefix"]) - s * split_len)
            / kw["BLOCK_N"]
            for s in range(splits)
        ]
        per_sm = [0.0] * H100["sms"]
        for program in range(pairs * splits):
            per_sm[program % H100["sms"]] += tiles[program // pairs]
        # launch_row multiplies by ceil(programs / SMs): give the busiest SM's trips per program slot
        return [(reading[0], max(per_sm) / math.ceil(pairs * splits / H100["sms"]))], 0.0

    @staticmethod
    def partial_bytes(case: dict, launch: Launch) -> float:
        splits = launch_arguments(launch)["NUM_SPLITS"]
        return case["B"] * case["Hq"] * case["N"] * splits * (launch.kwargs["BLOCK_D"] * case["esize"] + 8)

    @staticmethod
    def bytes(case: dict, launch: Launch) -> float:
        name, kw = launch.kernel.fn.__name__, launch.kwargs
        B, Hq, Hkv, N, D, e = (case[k] for k in ("B", "Hq", "Hkv", "N", "D", "esize"))
        q_or_out = B * Hq * N * D * e
        if name == "_tree_attention_kernel":
            m_tiles = math.prod(launch.grid[:1]) // (B * Hkv)
            kv = B * Hkv * m_tiles * (case["prefix"] + N) * D * 2 * e
            partials = TreeAttentionModel.partial_bytes(case, launch) if kw["NUM_SPLITS"] > 1 else q_or_out
            return kv + q_or_out * kw["NUM_SPLITS"] + partials  # every split's programs load their q rows
        if name == "_tree_attention_combine_kernel":
            return TreeAttentionModel.partial_bytes(case, launch) + q_or_out
        return 0.0


def attention_cases(smoke: bool) -> list[dict]:
    cases = []
    for B in [1] if smoke else [1, 64]:
        for N in [16] if smoke else [16, 64]:
            name = f"tree_attention Hq/Hkv=32/8 D=128 prefix=4096 N={N} B={B} bf16"
            case = dict(name=name, B=B, N=N, Hq=32, Hkv=8, D=128, prefix=4096, esize=2, model=TreeAttentionModel)
            cases.append(case)
    return cases


def capture_attention(case: dict) -> list[Launch]:
    import torch

    import specdec_kernels as sk
    from bench.bench_tree_attention import random_trees
    from specdec_kernels._interpreter import plan_as_gpu

    B, N, Hq, Hkv, D, prefix = (case[k] for k in ("B", "N", "Hq", "Hkv", "D", "prefix"))
    q = torch.empty(B, Hq, N, D, dtype=torch.bfloat16)
    k = torch.empty(B, Hkv, prefix + N, D, dtype=torch.bfloat16)
    v = torch.empty_like(k)
    lens = torch.full((B,), prefix, dtype=torch.int32)
    with plan_as_gpu(H100["sms"]), captured_launches() as launches:
        sk.tree_attention(q, k, v, lens, random_trees(B, N, 0), validate=False)
    return launches


def _call_rows(case: dict, launches: list[Launch], meta: dict) -> list[dict]:
    kernel_rows = [launch_row(case, launch) for launch in launches]
    total = {k: sum(r[k] for r in kernel_rows) for k in ("bytes", "byte_floor_us", "issue_bound_us", "estimate_us")}
    config = f"{len(launches)} launches"
    if case.get("model") is TreeAttentionModel:
        config += f"; unmasked SDPA byte floor {TreeAttentionModel.sdpa_floor_us(case):.2f} us"
        bound = TreeAttentionModel.filled_bound_bytes(case)
        config += f"; >= {H100['sms']} programs: >= {bound / TreeAttentionModel.kv_once(case):.2f} passes"
    call = dict(case=case["name"], kernel="(call)", grid="", config=config, **total)
    call["passes"] = round(total["bytes"] / case["model"].one_read(case), 2)
    head = {"date": meta["date"], "commit": meta["commit"], "triton": meta["triton"], "arch": "sm_90"}
    return [{**head, **row} for row in [*kernel_rows, call]]


def chain_equivalents(smoke: bool) -> list[dict]:
    """Chain ``verify`` calls reading the same rows as the tree cases (the targets' yardstick):
    B * K chains of G drafts for verify_multi, one chain of G = N drafts for verify_tree."""
    V, batches = (32000, [1]) if smoke else (151936, [1, 64])
    shapes = [(4, 4, "verify_multi K=4 G=4")] + ([] if smoke else [(1, 60, "verify_tree N=60")])
    cases = []
    for B in batches:
        for chains, G, like in shapes:
            name = f"verify V={V} B={B * chains} G={G} bf16 sampled draft=logits (same rows as {like} B={B})"
            cases.append(dict(name=name, V=V, B=B * chains, G=G, esize=2, draft="logits", temperature=0.7))
            cases[-1].update(top_k=0, top_p=1.0)
    return cases


def run_tree(smoke: bool, which: str = "all") -> list[dict]:
    """Rows of the tree verification and tree attention cases (and their chain yardsticks)."""
    meta = environment_metadata("cpu")
    rows = []
    if which in ("all", "verify"):
        for case in chain_equivalents(smoke):
            rows += _call_rows(dict(case, model=ChainModel), capture_chain(case), meta)
    if which in ("all", "verify"):
        for case in tree_cases(smoke):
            rows += _call_rows(case, capture_tree(case), meta)
    if which in ("all", "attention"):
        for case in attention_cases(smoke):
            rows += _call_rows(case, capture_attention(case), meta)
    return rows


def mask_cases() -> tuple[list[dict], list[dict]]:
    """(chain, tree) calls with and without token_bitmask: the chain at V = 151,936, G = 4, bf16, B = 1
    and 64, greedy / sampled / top-k 50 + top-p 0.9 (draft logits), and verify_tree N = 60 B = 64."""
    chain = []
    for case in chain_cases(False):
        if case["V"] == 151936 and case["B"] in (1, 64) and case["draft"] == "logits":
            if case["top_p_ties"] == "keep":
                chain += [dict(case, name=case["name"] + " mask=" + str(m).lower(), mask=m) for m in (False, True)]
    tree = []
    for case in tree_cases(False):
        if case["op"] == "verify_tree" and case["B"] == 64:
            tree += [dict(case, name=case["name"] + " mask=" + str(m).lower(), mask=m) for m in (False, True)]
    return chain, tree


def logprobs_cases() -> list[dict]:
    """Chain calls with and without return_logprobs: V = 151,936, G = 4, bf16, B = 1 and 64, draft
    logits; greedy, sampled, top-k 50 + top-p 0.9, and greedy with top-k 50 + top-p 0.9."""
    cases = []
    for case in chain_cases(False):
        if case["V"] == 151936 and case["B"] in (1, 64) and case["draft"] == "logits" and case["top_p_ties"] == "keep":
            cases.append(case)
            if case["top_k"] > 0:
                name = case["name"].replace("topk50", "greedy_topk50")
                cases.append(dict(case, name=name, temperature=0.0))
    both = itertools.product(cases, (False, True))
    return [dict(c, name=c["name"] + " logprobs=" + str(lp).lower(), logprobs=lp) for c, lp in both]


def block_cases() -> list[dict]:
    """Chain calls with the token rule and with block verification: V = 151,936, B = 64, G = 4, bf16,
    draft logits; sampled, and top-k 50 + top-p 0.9."""
    cases = []
    for case in chain_cases(False):
        if case["V"] == 151936 and case["B"] == 64 and case["draft"] == "logits" and case["top_p_ties"] == "keep":
            if case["temperature"] > 0:  # (greedy requests: the token rule's kernels under both)
                cases += [dict(case, name=case["name"] + " block=" + str(m).lower(), block=m) for m in (False, True)]
    return cases


def tree_logprobs_cases() -> list[dict]:
    """Tree calls with and without return_logprobs: verify_tree N = 60 (EAGLE-like) and verify_multi
    K = 4 G = 4 at V = 151,936, B = 64, bf16, T = 0.7, K-SEQ and RRS without replacement."""
    cases = [c for c in tree_cases(False) if c["B"] == 64 and c["method"] in ("kseq", "rrs_wor")]
    both = itertools.product(cases, (False, True))
    return [dict(c, name=c["name"] + " logprobs=" + str(lp).lower(), logprobs=lp) for c, lp in both]


def run(smoke: bool, cases: list[dict] | None = None) -> list[dict]:
    meta = environment_metadata("cpu")
    rows = []
    for case in chain_cases(smoke) if cases is None else cases:
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
    """nvcc on PATH, else under CUDA_HOME / CUDA_PATH / /usr/local/cuda (also used by the csrc
    compile tests)."""
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


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
        kernel = re.search(r"(row_stats|accept|finalize|tree_walk|block_decide|logprobs)_kernel(?:I(.*)EEv)?", name)
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
    first of them again; row_stats_kernel's bool THRESHOLDS (Lb1E: the instantiation that finds
    top-k / top-p thresholds, Lb0E: the one that does not, left out)."""
    names = {"f": "f32", "NS_4bf16E": "bf16", "NS_3f16E": "f16", "Lb1E": "thresholds", "Lb0E": ""}
    types = []
    while mangled:
        token = next((t for t in (*names, "S2_") if mangled.startswith(t)), None)
        if token is None:
            return [mangled]
        types.append(types[0] if token == "S2_" else names[token])
        mangled = mangled[len(token) :]
    return [t for t in types if t]


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
    parser.add_argument(
        "--cases",
        choices=["all", "chain", "tree", "mask", "mask+attention", "logprobs", "block"],
        default="all",
        help="which calls (mask / logprobs / block: the token_bitmask / return_logprobs / method='block' "
        "comparison, written as the commit's section; mask+attention: the mask cases and the tree attention cases)",
    )
    args = parser.parse_args(argv)
    if args.cases.startswith("mask"):
        return _main_mask(args.csv, attention=args.cases == "mask+attention")
    if args.cases == "logprobs":
        meta = environment_metadata("cpu")
        rows = run(False, logprobs_cases())
        rows += [row for case in tree_logprobs_cases() for row in _call_rows(case, capture_tree(case), meta)]
        return _main_compare(args.csv, rows, "logprobs")
    if args.cases == "block":
        return _main_compare(args.csv, run(False, block_cases()), "block")
    rows = run(args.smoke) if args.cases in ("all", "chain") else []
    rows += run_tree(args.smoke) if args.cases in ("all", "tree") else []
    print("# static model, sm_90 (H100 SXM: 132 SMs, 3.35 TB/s): *estimates*, not measurements")
    print_table(
        rows, ["case", "kernel", "grid", "regs", "spill_bytes", "stack", "occupancy", "sass_per_entry", "estimate_us"]
    )
    if args.csrc and not args.smoke:
        csrc = csrc_rows(environment_metadata("cpu"))
        print("# csrc (CUDA C++ backend), sm_90: " + (f"{len(csrc)} kernels" if csrc else "nvcc not found"))
        print_table(csrc, ["kernel", "regs", "spill_bytes", "stack", "smem", "occupancy", "limiter"])
        rows += csrc
    if not args.smoke and args.cases == "all" and args.csrc:
        from bench._common import replace_commit_rows_csv

        replace_commit_rows_csv(args.csv, rows, COLUMNS)
        print(f"{len(rows)} rows: the section of commit {rows[0]['commit']} in {args.csv}")
    elif not args.smoke:
        print(f"not written to {args.csv}: a commit's section holds every case (run without --cases / --no-csrc)")
    return 0


def _main_mask(csv: str, attention: bool = False) -> int:
    """The token_bitmask rows (``mask_cases``; with `attention` the tree attention cases too): printed
    with the mask's cost per call, written as the commit's section of `csv`."""
    chain, tree = mask_cases()
    meta = environment_metadata("cpu")
    rows = run(False, chain)
    for case in tree:
        rows += _call_rows(case, capture_tree(case), meta)
    for case in attention_cases(False) if attention else []:
        rows += _call_rows(case, capture_attention(case), meta)
    return _main_compare(csv, rows, "mask")


def _main_compare(csv: str, rows: list[dict], option: str) -> int:
    """Rows of calls named ``... {option}=false`` / ``=true`` printed with the option's cost per call,
    written as the commit's section of `csv`."""
    from bench._common import replace_commit_rows_csv

    print("# static model, sm_90 (H100 SXM: 132 SMs, 3.35 TB/s): *estimates*, not measurements")
    print_table(rows, ["case", "kernel", "regs", "spill_bytes", "sass_per_entry", "bytes", "estimate_us"])
    calls = {r["case"]: r["estimate_us"] for r in rows if r["kernel"] == "(call)"}
    on = f" {option}=true"
    for name, with_option in calls.items():
        if name.endswith(on):
            plain = calls[name[: -len("true")] + "false"]
            change = 100 * (with_option / plain - 1)
            print(f"{name[: -len(on)]}: {plain:.2f} -> {with_option:.2f} us ({change:+.1f}%)")
    replace_commit_rows_csv(csv, rows, COLUMNS)
    print(f"{len(rows)} rows: the section of commit {rows[0]['commit']} in {csv}")
    return 0


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"
    sys.exit(main())
