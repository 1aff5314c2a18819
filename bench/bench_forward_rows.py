#!/usr/bin/env python
"""What a model forward costs by the number of rows it scores: why a tree pays, or does not, on a CPU.

A verification step's target forward scores 1 + (drafted nodes) rows, a tree's draft forward one row
per node of the depth it feeds. On a GPU both are flat for tens of rows (the weights are read once);
on a CPU the linears leave that regime after a few rows, so a 16-node tree can cost the target twice
what a 4-draft chain costs, and no acceptance gain recovers that. This script measures it for a
model pair, side by side in one run: for each model and each row count r, the forward of r new tokens
after a cached prompt of ``--prefix`` tokens (the cache cut back to the prompt after each call), with
the linears the e2e bench uses (oneDNN on packed weights by default, ``--cpu-linear``; several kinds,
e.g. ``--cpu-linear native onednn``, time one copy of each model per kind, call by call in turn) and
the driver's causal SDPA path (a tree's mask costs the same: the linears dominate).

Columns: ``rows``, ``wall_ms`` / ``cpu_ms`` (median of ``--rep`` calls, process CPU time beside wall
time), ``vs_one_row`` (wall over the model's 1-row forward), ``ms_per_extra_row`` (the marginal cost
of a row past the first). The printed summary answers the tree question directly: for each
width-k depth step, the draft forward's cost over a 1-row forward, and the target forward of a
1 + N tree over a 1 + d chain's.

    python bench/bench_forward_rows.py --target bench/models/Qwen2.5-Coder-1.5B-Instruct \\
        --draft bench/models/Qwen2.5-Coder-0.5B-Instruct --dtype fp32 --draft-dtype bf16 --threads 1
    python bench/bench_forward_rows.py --smoke        # tiny random models, seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common  # noqa: E402

COLUMNS = common.csv_columns(
    "model role model_dtype cpu_linear threads prefix rows wall_ms cpu_ms vs_one_row ms_per_extra_row"
)
DEFAULT_ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 33)  # chains of 1..8, trees of 8 / 16 / 32 nodes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny random models (no files)")
    p.add_argument("--target", help="the target's Hugging Face directory")
    p.add_argument("--draft", help="the draft's Hugging Face directory")
    p.add_argument("--dtype", default="fp32", choices=tuple(common.DTYPES))
    p.add_argument("--draft-dtype", default=None, choices=tuple(common.DTYPES))
    p.add_argument(
        "--draft-int8",
        action="store_true",
        help="also time a copy of the draft with int8 linears (the rest fp32), as bench_e2e's *_int8 modes run it",
    )
    p.add_argument(
        "--cpu-linear",
        nargs="+",
        default=["onednn"],
        choices=("native", "onednn", "torch"),  # hf.cpu_linear.CPU_LINEARS
        help="linear kernels; several: one copy of each model per kind, timed alternately (side by side)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (pinned)")
    p.add_argument("--prefix", type=int, default=256, help="cached prompt tokens before the timed rows")
    p.add_argument("--rows", type=int, nargs="+", default=None, help=f"row counts (default {DEFAULT_ROWS})")
    p.add_argument("--rep", type=int, default=None, help="timed calls per row count (default 5; smoke 2)")
    p.add_argument("--out", default=str(common.REPO_ROOT / "bench" / "results" / "forward_rows_cpu.csv"))
    p.add_argument("--no-save", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    if not args.smoke and not (args.target or args.draft):
        p.error("--target and/or --draft is required unless --smoke")
    args.rows = args.rows or ((1, 2, 4, 9) if args.smoke else DEFAULT_ROWS)
    args.rep = args.rep or (2 if args.smoke else 5)
    if args.smoke:
        args.prefix = min(args.prefix, 32)
    if min(args.rows) < 1 or args.prefix < 1:
        p.error("--rows and --prefix must be >= 1")
    return args


def _models(args):
    """[(role, name, model)] on the CPU, in their dtypes, linears swapped as the e2e bench does."""
    import torch

    if args.smoke:
        from _e2e_inputs import smoke_models

        target, draft = smoke_models("cpu", torch.float32)
        models = [("target", "smoke-target", target), ("draft", "smoke-draft", draft)]
    else:
        from transformers import AutoModelForCausalLM

        models = []
        for role, path in (("target", args.target), ("draft", args.draft)):
            if path:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, common.DTYPES[args.dtype]))
                models.append((role, Path(path).name, model.eval()))
    import copy

    from specdec_kernels.hf.cpu_linear import use_cpu_linears

    dtypes = {"target": args.dtype, "draft": args.draft_dtype or args.dtype}
    out = []
    for role, name, model in models:
        model = model.to(getattr(torch, common.DTYPES[dtypes[role]]))
        int8 = _int8_copy(model) if role == "draft" and args.draft_int8 else None  # before the swaps below
        for i, kind in enumerate(args.cpu_linear):
            swapped = model if i == len(args.cpu_linear) - 1 else copy.deepcopy(model)
            use_cpu_linears(swapped, kind)
            out.append((role, name, kind, swapped, dtypes[role]))
        if int8 is not None:
            out.append(("draft_int8", name, "int8", int8, "fp32"))
    return out


def _int8_copy(draft):
    """The draft with int8 linears, the rest fp32, as bench_e2e's ``*_int8`` modes run it (None, with a
    note, where no int8 kernel loads)."""
    from _e2e_inputs import quantised_copy

    made = quantised_copy(draft, 8)
    if made is None:
        print("# --draft-int8: no int8 kernel on this machine; its rows are skipped")
        return None
    return made[0]


def time_rows(models: list, prefix: int, rows: list[int], rep: int) -> list[dict[int, tuple[float, float]]]:
    """Per model: rows -> (median wall ms, median process CPU ms) of a forward of that many new tokens
    after ``prefix`` cached ones; the models take turns call by call (side by side)."""
    import torch
    from transformers import DynamicCache

    from specdec_kernels.hf.cache import cache_kwargs
    from specdec_kernels.hf.forwards import last_logits_only

    V = models[0].config.get_text_config(decoder=True).vocab_size
    gen = torch.Generator().manual_seed(0)
    caches = [DynamicCache() for _ in models]
    prompt = torch.randint(0, V, (1, prefix), generator=gen)
    with torch.no_grad():
        for model, cache in zip(models, caches, strict=True):
            model(input_ids=prompt, use_cache=True, **cache_kwargs(model, cache))
        out = [{} for _ in models]
        for r in rows:
            ids = torch.randint(0, V, (1, r), generator=gen)
            positions = torch.arange(prefix, prefix + r)[None]
            walls, cpus = [[] for _ in models], [[] for _ in models]
            for i in range(rep + 1):  # the first call is untimed (allocations, oneDNN primitive caches)
                for m, (model, cache) in enumerate(zip(models, caches, strict=True)):
                    # every row's logits: a verification scores them all
                    kw = dict(last_logits_only(model, r), **cache_kwargs(model, cache))
                    w0, c0 = time.perf_counter(), time.process_time()
                    model(input_ids=ids, position_ids=positions, use_cache=True, **kw)
                    w1, c1 = time.perf_counter(), time.process_time()
                    cache.crop(-r)  # back to the prompt
                    if i:
                        walls[m].append((w1 - w0) * 1e3)
                        cpus[m].append((c1 - c0) * 1e3)
            for m in range(len(models)):
                out[m][r] = (sorted(walls[m])[len(walls[m]) // 2], sorted(cpus[m])[len(cpus[m]) // 2])
    return out


def summary(times: dict[str, dict[int, tuple[float, float]]]) -> list[str]:
    """The tree-vs-chain lines: draft cost of a width-k depth, target cost of a 1 + N tree over 1 + d."""
    lines = []
    for role, t in times.items():
        one = t[min(t)][0]
        for k in (2, 4):
            if k in t:
                lines.append(f"{role}: a {k}-row forward costs {t[k][0] / one:.2f}x a 1-row forward")
    for label, target in times.items():
        if not label.startswith("target"):
            continue
        for tree, chain in ((9, 5), (17, 5), (17, 9), (33, 9)):
            if tree in target and chain in target:
                lines.append(
                    f"{label}: 1 + {tree - 1} tree rows cost {target[tree][0] / target[chain][0]:.2f}x "
                    f"1 + {chain - 1} chain rows"
                )
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (no kernels run here; keeps the import CPU-safe)
    common.add_repo_root_to_path()
    import torch

    torch.set_num_threads(args.threads)
    meta = common.environment_metadata("cpu")
    rows, times = [], {}
    models = _models(args)
    for role in dict.fromkeys(m[0] for m in models):  # each role's copies side by side
        mine = [m for m in models if m[0] == role]
        timed = time_rows([m[3] for m in mine], args.prefix, sorted(set(args.rows)), args.rep)
        for (_, name, kind, _, dtype), t in zip(mine, timed, strict=True):
            times[role if len(mine) == 1 else f"{role} ({kind})"] = t
            rows += _rows(meta, args, name, role, kind, dtype, t)
    common.print_table(rows, ["role", "cpu_linear", "rows", "wall_ms", "cpu_ms", "vs_one_row", "ms_per_extra_row"])
    for line in summary(times):
        print("#", line)
    if not args.no_save and not args.smoke:
        common.append_rows_csv(args.out, rows, COLUMNS)
        print(f"# rows appended to {args.out}")
    return 0


def _rows(meta, args, name, role, kind, dtype, t) -> list[dict]:
    one = t[min(t)][0]
    rows = []
    for r, (wall, cpu) in t.items():
        rows.append(
            dict(
                meta,
                model=name,
                role=role,
                model_dtype=dtype,
                cpu_linear=kind,
                threads=args.threads,
                prefix=args.prefix,
                rows=r,
                wall_ms=wall,
                cpu_ms=cpu,
                vs_one_row=wall / one,
                ms_per_extra_row=(wall - one) / (r - 1) if r > 1 else None,
                warmup=1,
                rep=args.rep,
            )
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
