"""bench/plot.py renders every committed result CSV: a PNG per file, labelled axes, titles that say
where the numbers come from (CPU measurement or static estimate). Skipped without matplotlib
(``pip install -e ".[bench]"``)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import plot  # noqa: E402


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    return plot.render(out=tmp_path_factory.mktemp("plots"), dpi=40)


def _labels(fig) -> set[tuple[str, str]]:
    return {(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes}


def _figure(figures, name):
    return next(fig for png, fig in figures.items() if png.name == name)


def test_a_non_empty_png_per_result_csv(figures):
    expected = {
        p.stem + ".png" for p in (ROOT / "bench" / "results").glob("*.csv") if not p.name.startswith("verify_tree")
    }
    expected = {n for n in expected if n.startswith(("e2e", "verify", "static"))}
    assert expected and {png.name for png in figures} == expected
    for png in figures:
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000, png


def test_e2e_axes_and_title(figures):
    fig = _figure(figures, "e2e_cpu_demo.png")
    labels = _labels(fig)
    assert ("γ = G, draft tokens per chain", "speedup vs target.generate (wall time)") in labels
    assert ("γ = G, draft tokens per chain", "acceptance rate (accepted / proposed)") in labels
    assert "CPU" in fig.get_suptitle() and "not GPU" in fig.get_suptitle()
    assert any(line.get_label().startswith("ours, K = 2") for ax in fig.axes for line in ax.get_lines())
    qwen = _figure(figures, "e2e_cpu_qwen.png")  # its newest run sweeps G: against gamma (one G: against K)
    assert any(x.startswith(("γ = G", "K, draft chains")) for x, _ in _labels(qwen))


def test_verify_and_static_axes_and_titles(figures):
    verify = _figure(figures, "verify_cpu.png")
    assert ("batch size B (requests per call)", "median time per verify call (µs)") in _labels(verify)
    assert "CPU" in verify.get_suptitle()
    static = _figure(figures, "static_sm90.png")
    assert _labels(static) == {("byte floor per call (µs): logits bytes / 3.35 TB/s", "static estimate per call (µs)")}
    assert "ESTIMATES" in static.get_suptitle() and "not measurements" in static.get_suptitle()


def test_smoke_command(tmp_path):
    """The CI command on one CSV; an empty results folder is an error (exit 1)."""
    (tmp_path / "static_x.csv").write_bytes((ROOT / "bench" / "results" / "static_sm90.csv").read_bytes())
    assert plot.main(["--smoke", "--results", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert [p.name for p in (tmp_path / "out").glob("*.png")] == ["static_x.png"]
    assert plot.main(["--smoke", "--results", str(tmp_path / "out"), "--out", str(tmp_path / "none")]) == 1


def test_e2e_dynamic_tree_sweep_against_n(figures):
    """A file with dynamic-tree rows: speedup (wall and CPU time) and tokens per target forward
    against N, one line each for the chain, the tree and the tree with its lookup branch."""
    fig = _figure(figures, "e2e_cpu_demo_dyntree_sweep.png")
    xlabel = "N, draft tokens per step (chain: G, tree: nodes)"
    for ylabel in ("speedup vs target.generate (CPU time)", "tokens per target forward"):
        assert (xlabel, ylabel) in _labels(fig)
    lines = {line.get_label() for ax in fig.axes for line in ax.get_lines()}
    for label in ("ours, K = 1", "ours, dynamic tree,", "ours, dynamic tree + lookup branch"):
        assert any(line.startswith(label) for line in lines), label
