"""Each time a GPU run measured beside ``bench_static``'s estimate for the same call.

``bench/run_gpu.sh all`` runs this after its timed stages (issue 28, goal 6): for every row of the
``ours`` provider (the Triton kernels, which the static model compiles) of the verify, verify_tree
and tree_attention CSVs whose shape the static model has a case for, one line with the measured
``median_us`` (host wall, launches included), ``graph_us`` (a CUDA-graph replay: device time, the
number the estimate models) and the estimate (the ``(call)`` row's ``estimate_us`` of the static
CSV's newest section), and measured / estimate. Rows without a static case are counted, not shown.

Usage: python bench/static_vs_measured.py [--static bench/results/static_sm90.csv] MEASURED.csv ...
       python bench/static_vs_measured.py --dry-run      # read the static CSV, print its case count
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import print_table  # noqa: E402

STATIC_CSV = Path(__file__).resolve().parent / "results" / "static_sm90.csv"
# bench_verify's modes as the static model's settings (it models T = 0.7; temperature moves no bytes)
VERIFY_SETTINGS = {
    "stochastic": "sampled draft=logits",
    "t0.7": "sampled draft=logits",
    "greedy": "greedy draft=logits",
    "ngram": "sampled draft=none",
    "topk_topp": "topk50_topp0.9 draft=logits",
    "t0.7_topk_topp": "topk50_topp0.9 draft=logits",
}
COLUMNS = ["case", "variant", "median_us", "graph_us", "estimate_us", "measured_per_estimate"]


def static_estimates(path: Path) -> dict[str, float]:
    """Case name -> estimate_us of its ``(call)`` row; a case in several sections: the newest."""
    out: dict[str, tuple[str, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("kernel") == "(call)" and row.get("estimate_us"):
                date = row.get("date", "")
                if row["case"] not in out or date >= out[row["case"]][0]:
                    out[row["case"]] = (date, float(row["estimate_us"]))
    return {case: estimate for case, (_date, estimate) in out.items()}


def static_case(row: dict) -> str | None:
    """The static model's case name for one measured CSV row (None: the model has no such call)."""
    if row.get("provider") != "ours" or row.get("dtype") != "bf16":
        return None
    if "mode" in row and row.get("mode") in VERIFY_SETTINGS:  # bench_verify
        return f"verify V={row['V']} B={row['B']} G={row['G']} bf16 {VERIFY_SETTINGS[row['mode']]}"
    if row.get("api") == "multi":  # bench_verify_tree (its api=tree chains are no static case)
        return f"verify_multi K={row['K']} G={row['G']} V={row['V']} B={row['B']} bf16 {row['method']}"
    if "prefix" in row and "Hq" in row:  # bench_tree_attention
        shape = f"Hq/Hkv={row['Hq']}/{row['Hkv']} D={row['D']} prefix={row['prefix']} N={row['N']} B={row['B']}"
        return f"tree_attention {shape} bf16"
    return None


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def compare(estimates: dict[str, float], measured: list[Path]) -> tuple[list[dict], int]:
    """(one line per measured row with a static case, the count of rows without one)."""
    lines, unmatched = [], 0
    for path in measured:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                case = static_case(row)
                if case is None or case not in estimates:
                    unmatched += 1
                    continue
                median, graph, estimate = _number(row.get("median_us")), _number(row.get("graph_us")), estimates[case]
                device_time = graph if graph is not None else median
                ratio = round(device_time / estimate, 2) if device_time is not None and estimate > 0 else None
                lines.append(
                    dict(
                        case=case,
                        variant=row.get("mode") or row.get("gqa") or "",  # what the case name leaves out
                        median_us=median,
                        graph_us=graph,
                        estimate_us=estimate,
                        measured_per_estimate=ratio,
                    )
                )
    return lines, unmatched


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Measured GPU times beside bench_static's estimates.")
    p.add_argument("measured", nargs="*", type=Path, help="CSVs of bench_verify / bench_verify_tree / attention")
    p.add_argument("--static", type=Path, default=STATIC_CSV, help=f"static CSV (default {STATIC_CSV})")
    p.add_argument("--dry-run", action="store_true", help="read the static CSV, print its case count, exit")
    args = p.parse_args(argv)
    estimates = static_estimates(args.static)
    if args.dry_run:
        print(f"# static_vs_measured: {len(estimates)} static call estimates in {args.static}; dry-run ok")
        return 0
    lines, unmatched = compare(estimates, [path for path in args.measured if path.exists()])
    print("# measured (provider ours) beside bench_static's estimate; measured_per_estimate uses graph_us if present")
    print_table(lines, COLUMNS)
    print(f"# {len(lines)} rows with a static estimate, {unmatched} without")
    return 0


if __name__ == "__main__":
    sys.exit(main())
