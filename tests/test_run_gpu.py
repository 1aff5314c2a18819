"""bench/run_gpu.sh's pieces that run without a GPU: the benches' --dry-run (CI runs the whole
script's `--dry-run` as a stage) and the measured-beside-static table of the real run (issue 28,
goal 6)."""

import csv
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench import bench_verify, static_vs_measured  # noqa: E402


def _write(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_bench_dry_run_checks_arguments_imports_and_exits(capsys, tmp_path):
    out = tmp_path / "rows.csv"
    argv = ["--providers", "ours", "cuda", "--B", "1", "64", "--V", "151936", "--out", str(out), "--dry-run"]
    assert bench_verify.main(argv) == 0
    assert "dry-run ok" in capsys.readouterr().out
    assert not out.exists(), "a dry run makes no inputs and writes no rows"
    with pytest.raises(SystemExit):  # the arguments are still checked
        bench_verify.main(["--B", "0", "--dry-run"])


def test_measured_times_beside_the_newest_static_estimate(tmp_path):
    case = "verify V=151936 B=64 G=4 bf16 sampled draft=logits"
    static = _write(
        tmp_path / "static.csv",
        [
            dict(date="2026-01-01", case=case, kernel="(call)", estimate_us="90.0"),
            dict(date="2026-02-01", case=case, kernel="(call)", estimate_us="80.0"),  # the newest section
            dict(date="2026-02-01", case=case, kernel="_verify_row_stats_kernel", estimate_us="50.0"),
            dict(
                date="2026-02-01", case="verify_multi K=4 G=4 V=151936 B=1 bf16 kseq", kernel="(call)", estimate_us="10"
            ),
        ],
    )
    verify = dict(provider="ours", mode="stochastic", B="64", G="4", V="151936", dtype="bf16", median_us="200")
    measured = _write(
        tmp_path / "verify_gpu.csv",
        [
            dict(verify, graph_us="160"),
            dict(verify, provider="eager", graph_us=""),  # no static case: counted, not shown
            dict(verify, mode="greedy", graph_us=""),  # the static CSV has no greedy case here
        ],
    )
    tree = dict(provider="ours", api="multi", method="kseq", B="1", K="4", G="4", V="151936", dtype="bf16")
    tree_csv = _write(tmp_path / "verify_tree_gpu.csv", [dict(tree, median_us="30", graph_us="")])
    lines, unmatched = static_vs_measured.compare(static_vs_measured.static_estimates(static), [measured, tree_csv])
    assert unmatched == 2
    assert [(r["case"], r["estimate_us"], r["measured_per_estimate"]) for r in lines] == [
        (case, 80.0, 2.0),  # graph_us (device time) / estimate
        ("verify_multi K=4 G=4 V=151936 B=1 bf16 kseq", 10.0, 3.0),  # no graph: median_us
    ]
    assert static_vs_measured.main(["--static", str(static), "--dry-run"]) == 0


def test_an_interrupted_bench_keeps_the_rows_it_measured(tmp_path, monkeypatch, capsys):
    """run_gpu.sh stops a stage at its time limit with SIGINT: the rows measured before it are
    written (a verify stage cut at 100 s on the H200 had lost all 27 of its rows), exit code 1."""
    from bench import _common as common

    out = tmp_path / "rows.csv"
    args = bench_verify.parse_args(["--device", "cpu", "--providers", "eager", "--B", "1", "--out", str(out)])
    row = dict(provider="eager", median_us=1.0, frac_of_floor=0.5)

    def sweep(run):
        rows = common.run_providers(["eager"], "B=1", run, lambda provider: dict(row))
        assert rows == [row]
        raise KeyboardInterrupt

    monkeypatch.setattr(common, "measure_copy_bandwidth", lambda device: 1.0)
    code = common.bench_main("verify", args, sweep, table_columns=["provider"], csv_columns=["provider", "median_us"])
    assert code == 1
    assert "interrupted" in capsys.readouterr().err
    with open(out) as f:
        assert [r["provider"] for r in csv.DictReader(f)] == ["eager"]
