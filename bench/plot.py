"""Plots of the result CSVs in ``bench/results/`` (PNGs in ``bench/results/plots/``).

* ``e2e*.csv`` -> ``e2e*.png``: end-to-end speedup over ``target.generate`` (wall time) and draft
  acceptance rate against gamma (G, draft tokens per chain), one line per K (chains) and prompt
  lookup, a panel per (temperature, prompt set); against K when the file has a single G. Each run
  in the file (e.g. another prompt length) is its own line style, never averaged with another.
  Files with dynamic-tree rows (``ours_dyntree``, ``ours_dyntree_lookup``) plot against N, the draft
  tokens per step (a chain's G, a tree's node budget): speedup (wall and process CPU time) and
  tokens per target forward, chain against tree.
* ``verify*.csv`` (not ``verify_tree``) -> median time per verify call against batch size, one line per
  (provider, V), a panel per mode.
* ``static*.csv`` -> the static model's per-call *estimate* against the byte floor (bytes / 3.35 TB/s).

Titles say where the numbers come from: CPU rows are CPU measurements (not GPU kernel speed), static
rows are estimates from compiled code, not measurements. The verify and static figures show the
newest run in their file.

Usage::

    pip install -e ".[bench]"                        # matplotlib
    python bench/plot.py                             # bench/results/*.csv -> bench/results/plots/*.png
    python bench/plot.py --smoke --out /tmp/plots    # the same at low resolution (CI)
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MODE_LABELS = {
    "ours_prompt_lookup": "ours, prompt lookup",
    "hf_assisted": "HF assisted (its own G)",
    "ours_dyntree": "ours, dynamic tree",
    "ours_dyntree_lookup": "ours, dynamic tree + lookup branch",
}
TREE_MODES = ("ours_dyntree", "ours_dyntree_lookup")


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def newest_run(rows: list[dict]) -> list[dict]:
    """The rows of the most recent run in a file (rows of one run share date and commit)."""
    last = max((r["date"], r.get("commit", "")) for r in rows)
    return [r for r in rows if (r["date"], r.get("commit", "")) == last]


def num(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def where(rows: list[dict]) -> str:
    """'CPU (Intel ...)' or the GPU name, from the rows' device column."""
    devices = sorted({r.get("device", "") for r in rows})
    cpu = all(d.endswith(" cpu") for d in devices)
    return ("CPU: " if cpu else "GPU: ") + ", ".join(d.removesuffix(" cpu") for d in devices)


def _figure(plt, nrows: int, ncols: int, width: float = 4.2, height: float = 3.2):
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, axes


# --------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------


def e2e_series(rows: list[dict], x: str, metric: str) -> dict[str, tuple[list, list]]:
    """{label: (x values, metric values)} for the speculative modes of one run and panel."""
    points = defaultdict(dict)
    for r in rows:
        value, xv = num(r.get(metric)), num(r.get(x))
        if r["status"] != "ok" or value is None or xv is None or not r["mode"].startswith("ours"):
            continue
        if r["mode"] in MODE_LABELS:
            label = MODE_LABELS[r["mode"]]
        else:
            label = f"ours, K = {int(num(r['K']))}" if x == "G" else f"ours, G = {int(num(r['G']))}"
        points[label][xv] = value
    return {label: (sorted(by_x), [by_x[v] for v in sorted(by_x)]) for label, by_x in sorted(points.items())}


SETUP_COLUMNS = ("target_model", "draft_model", "model_dtype", "draft_dtype", "cpu_linear", "threads")


def same_setup_as_newest(rows: list[dict]) -> list[dict]:
    """The runs made with the newest run's models, dtypes, linear layers and threads: a run with
    another setup measures another thing and would only blur the lines."""
    newest = newest_run(rows)[0]
    return [r for r in rows if all(r.get(c, "") == newest.get(c, "") for c in SETUP_COLUMNS)]


def e2e_figure(plt, rows: list[dict], name: str):
    rows = same_setup_as_newest(rows)
    trees = any(r["mode"] in TREE_MODES for r in rows)
    ours = [r for r in rows if r["mode"].startswith("ours_k") or r["mode"] in TREE_MODES]
    x = "G" if len({r["G"] for r in ours}) > 1 else "K"
    xlabel = "γ = G, draft tokens per chain" if x == "G" else f"K, draft chains (G = {ours[0]['G']})"
    if trees:
        xlabel = "N, draft tokens per step (chain: G, tree: nodes)"
    panels = sorted({(float(r["temperature"]), r["prompt_set"]) for r in rows})
    runs = sorted({r["date"] for r in rows})
    metrics = [
        ("speedup_vs_target", "speedup vs target.generate (wall time)"),
        ("acceptance_rate", "acceptance rate (accepted / proposed)"),
    ]
    if trees:  # a shared machine: process CPU time too; a tree's acceptance rate counts one path per step
        metrics = [
            ("speedup_vs_target", "speedup vs target.generate (wall time)"),
            ("cpu_speedup_vs_target", "speedup vs target.generate (CPU time)"),
            ("mean_accepted_length", "tokens per target forward"),
        ]
    fig, axes = _figure(plt, len(metrics), len(panels), width=4.6, height=3.6)
    for col, (temperature, prompt_set) in enumerate(panels):
        for row, (metric, ylabel) in enumerate(metrics):
            ax = axes[row][col]
            for run, style in zip(runs, ("-", "--", ":", "-."), strict=False):  # one line style per run
                mine = [
                    r
                    for r in rows
                    if r["date"] == run and float(r["temperature"]) == temperature and r["prompt_set"] == prompt_set
                ]
                if not mine:
                    continue
                tokens = f"{num(mine[0]['prompt_tokens_mean']):.0f}-tok prompts"
                for i, (label, (xs, ys)) in enumerate(e2e_series(mine, x, metric).items()):
                    ax.plot(xs, ys, style, marker="o", color=f"C{i}", label=f"{label}, {tokens}")
                hf = [num(r[metric]) for r in mine if r["mode"] == "hf_assisted" and num(r.get(metric))]
                if metric == "speedup_vs_target" and hf:
                    ax.axhline(hf[0], color="gray", linestyle=style, linewidth=1, label=f"HF assisted, {tokens}")
            if metric in ("speedup_vs_target", "cpu_speedup_vs_target"):
                ax.axhline(1.0, color="black", linewidth=0.8, label="target.generate")
                ax.legend(fontsize=6)
            ax.set_xticks(sorted({num(r[x]) for r in ours}))
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            sampling = "greedy" if temperature == 0 else f"temperature {temperature:g}"
            ax.set_title(f"{prompt_set} prompts, {sampling}", fontsize=10)
            ax.grid(alpha=0.3)
    first = rows[0]
    pair = f"{first['target_model']} / {first['draft_model']}, {first['model_dtype']}"
    if first.get("draft_dtype") and first["draft_dtype"] != first["model_dtype"]:
        pair += f" (draft {first['draft_dtype']})"
    if first.get("cpu_linear"):
        pair += f", {first['cpu_linear']} linears, {first.get('threads')} thread(s)"
    fig.suptitle(
        f"{name}: end-to-end speculative decoding, batch {rows[0]['batch_size']}, "
        f"{rows[0]['max_new_tokens']} new tokens\n{pair}\nmeasured on {where(rows)}: CPU wall time, not GPU numbers",
        fontsize=11,
    )
    return fig


# --------------------------------------------------------------------------------------------
# Verify microbenchmark
# --------------------------------------------------------------------------------------------


def verify_figure(plt, rows: list[dict], name: str):
    rows = newest_run(rows)
    modes = sorted({r["mode"] for r in rows})
    fig, axes = _figure(plt, 1, len(modes))
    for col, mode in enumerate(modes):
        ax = axes[0][col]
        series = defaultdict(list)
        for r in rows:
            if r["mode"] == mode and num(r.get("median_us")):
                series[(r["provider"], int(r["V"]))].append((int(r["B"]), num(r["median_us"])))
        for i, ((provider, V), points) in enumerate(sorted(series.items())):
            points.sort()
            style = "-" if provider != "eager" else "--"
            ax.plot(*zip(*points, strict=True), style, marker="o", color=f"C{i}", label=f"{provider}, V = {V:,}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        Bs = sorted({int(r["B"]) for r in rows})
        ax.set_xticks(Bs, [str(b) for b in Bs])
        ax.set_xlabel("batch size B (requests per call)")
        ax.set_ylabel("median time per verify call (µs)")
        G = sorted({r["G"] for r in rows if r["mode"] == mode})
        ax.set_title(f"mode {mode}, G = {', '.join(G)}", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=8)
    dtype = ", ".join(sorted({r["dtype"] for r in rows}))
    fig.suptitle(
        f"{name}: verify time vs batch ({dtype}), measured on {where(rows)}\n"
        "CPU timings of the native CPU build ('auto') and eager PyTorch; not GPU kernel speed",
        fontsize=11,
    )
    return fig


# --------------------------------------------------------------------------------------------
# Static model
# --------------------------------------------------------------------------------------------


def static_figure(plt, rows: list[dict], name: str):
    # the newest run of the chain verify calls (tree, attention and csrc rows are appended separately)
    chain = [r for r in rows if r["case"].startswith("verify V=") and "same rows" not in r["case"]]
    calls = [r for r in newest_run(chain) if r["kernel"] == "(call)" and num(r.get("byte_floor_us"))]
    fig, axes = _figure(plt, 1, 1, width=6.5, height=5.0)
    ax = axes[0][0]
    kinds = {"greedy": "C0", "sampled": "C1", "topk": "C3"}
    markers = {"draft=logits": "o", "draft=probs": "s", "draft=none": "^"}
    seen = set()
    for r in calls:
        kind = next((k for k in kinds if k in r["case"]), "sampled")
        draft = next((d for d in markers if d in r["case"]), "draft=logits")
        label = f"{'top-k/top-p' if kind == 'topk' else kind}, {draft}"
        ax.scatter(
            num(r["byte_floor_us"]),
            num(r["estimate_us"]),
            color=kinds[kind],
            marker=markers[draft],
            label=None if label in seen else label,
            alpha=0.8,
        )
        seen.add(label)
    lo = min(num(r["byte_floor_us"]) for r in calls)
    hi = max(num(r["estimate_us"]) for r in calls)
    for factor, style in ((1, "-"), (2, "--"), (10, ":")):
        ax.plot(
            [lo, hi],
            [factor * lo, factor * hi],
            style,
            color="gray",
            linewidth=0.8,
            label=f"estimate = {factor}x floor",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("byte floor per call (µs): logits bytes / 3.35 TB/s")
    ax.set_ylabel("static estimate per call (µs)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    arch = ", ".join(sorted({r.get("arch", "") for r in calls}))
    fig.suptitle(
        f"{name}: verify calls, static model for {arch} (H100 SXM), commit {calls[0]['commit']}\n"
        "ESTIMATES from compiled code (no GPU ran), not measurements",
        fontsize=11,
    )
    return fig


PLOTTERS = (("e2e", e2e_figure), ("verify_tree", None), ("verify", verify_figure), ("static", static_figure))


def render(results: Path = RESULTS, out: Path | None = None, dpi: int = 120) -> dict[Path, object]:
    """Write one PNG per plottable CSV in ``results`` to ``out``; returns {png path: matplotlib Figure}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out or results / "plots")
    out.mkdir(parents=True, exist_ok=True)
    figures = {}
    for path in sorted(Path(results).glob("*.csv")):
        plotter = next((fn for prefix, fn in PLOTTERS if path.name.startswith(prefix)), None)
        rows = read_rows(path) if plotter else []
        if not rows:
            continue
        fig = plotter(plt, rows, path.name)
        fig.tight_layout()
        png = out / f"{path.stem}.png"
        fig.savefig(png, dpi=dpi)
        plt.close(fig)
        figures[png] = fig
    return figures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(RESULTS), help="folder of result CSVs (default bench/results)")
    p.add_argument("--out", help="folder for the PNGs (default bench/results/plots)")
    p.add_argument("--smoke", action="store_true", help="low resolution (CI: checks that every figure renders)")
    args = p.parse_args(argv)
    try:
        figures = render(Path(args.results), Path(args.out) if args.out else None, dpi=50 if args.smoke else 120)
    except ImportError as e:
        print(f"error: {e}; install the bench extra: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    for png in figures:
        print(f"wrote {png} ({png.stat().st_size} bytes)")
    if not figures:
        print(f"error: no plottable CSV in {args.results}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
