"""The `specdec` console script: help, and the demo's measured acceptance against theory."""

import math
import re

import pytest
import torch

from specdec_kernels.cli import main


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "demo" in capsys.readouterr().out


def test_verify_demo_agrees_with_theory(capsys):
    B = 384
    assert (
        main(
            [
                "verify-demo",
                "--batch",
                str(B),
                "--vocab",
                "32",
                "--num-draft-tokens",
                "3",
                "--num-drafts",
                "2",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "greedy: accepted tokens equal the target argmax chain" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*(close|medium|far)\s", line)]
    assert len(rows) == 3
    assert all(row[-3] == "PASS" for row in rows), out  # the demo's own verdict (|z| < 4)
    for row in rows:
        alpha_theory, alpha_measured = float(row[1]), float(row[2].split("+-")[0])
        kseq_theory, kseq_measured = float(row[5]), float(row[6].split("+-")[0])
        for theory, measured in ((alpha_theory, alpha_measured), (kseq_theory, kseq_measured)):
            sigma = math.sqrt(max(theory * (1 - theory), 1e-3) / B)  # (theory is itself a mean over rows)
            assert abs(measured - theory) < 6 * sigma + 0.02, (row, theory, measured)


def _demo_weights_present() -> bool:
    from specdec_kernels.demo import WEIGHTS_DIR

    return all((WEIGHTS_DIR / name / "model.safetensors").is_file() for name in ("target", "draft"))


def test_demo_runs_and_greedy_rows_match_the_target(capsys):
    """`specdec demo` (the README's first command), small: every greedy row equals target.generate."""
    assert _demo_weights_present(), "demo weights missing: run scripts/train_demo_pair.py"
    assert main(["demo", "--prompts", "2", "--max-new-tokens", "12", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines() if line.split()[-1:] in (["True"], ["False"], ["(baseline)"])]
    assert len(table) == 5, out  # target only (greedy and sampled baselines), chain, SpecTr, Medusa
    assert all(row[-1] in ("True", "(baseline)") for row in table), out
    assert "T=0.7" in out and "draft fwd" in out and "torch pinned to" in out and "Medusa 4 heads" in out
    assert ">>> generated" in out  # prompt and continuation visibly separated


def test_generate_streams_with_the_embedded_pair(capsys):
    prompt = "def add(a, b):\n    "
    assert (
        main(
            [
                "generate",
                "--target",
                "demo",
                "--prompt",
                prompt,
                "--max-new-tokens",
                "10",
                "--num-drafts",
                "2",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith(prompt)
    assert "acceptance" in out.lower()


def test_generate_with_the_demo_medusa_heads(capsys):
    prompt = "def add(a, b):\n    "
    argv = ["generate", "--target", "demo", "--drafter", "medusa", "--prompt", prompt, "--max-new-tokens", "10"]
    assert main([*argv, "--num-draft-tokens", "12", "--num-drafts", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt) and re.search(r"draft forwards\s+0\n", out)


@pytest.mark.parametrize(
    "argv, argument",
    [
        (["generate", "--target", "/nonexistent/model", "--prompt", "x"], "--target"),
        (["generate", "--target", "demo", "--draft", "/nonexistent", "--prompt", "x"], "--draft"),
        (["generate", "--target", "demo", "--prompt", "x", "--temperature", "-1"], "--temperature"),
        (["generate", "--target", "demo", "--prompt", "x", "--temperature", "nan"], "--temperature"),
        (["generate", "--target", "demo", "--prompt", "x", "--temperature", "inf"], "--temperature"),
        (["generate", "--target", "demo", "--prompt", "x", "--top-p", "1.5"], "--top-p"),
        (["generate", "--target", "demo", "--prompt", "x", "--num-drafts", "0"], "--num-drafts"),
        (["generate", "--target", "demo", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["generate", "--target", "demo", "--prompt", "x", "--seed", "-3"], "--seed"),
        (["demo", "--prompts", "0"], "--prompts"),
        (["demo", "--prompts", "-1"], "--prompts"),
        (["demo", "--prompts", "10"], "--prompts"),
        (["demo", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["demo", "--num-draft-tokens", "40", "--num-drafts", "2"], "--num-drafts"),
        (["demo", "--medusa-nodes", "64"], "--medusa-nodes"),
        (["demo", "--medusa-candidates", "0"], "--medusa-candidates"),
        (["generate", "--target", "demo", "--prompt", "x", "--drafter", "medusa", "--method", "kseq"], "--method"),
        (
            ["generate", "--target", "demo", "--prompt", "x", "--drafter", "medusa", "--num-draft-tokens", "70"],
            "--num-",
        ),
        (["generate", "--target", "demo", "--prompt", "x", "--medusa-heads", "/nonexistent"], "--medusa-heads"),
        (["verify-demo", "--vocab", "0"], "--vocab"),
        (["verify-demo", "--batch", "0"], "--batch"),
        (["verify-demo", "--num-draft-tokens", "0"], "--num-draft-tokens"),
        (["verify-demo", "--device", "cuda"], "--device"),
    ],
)
def test_bad_invocations_are_one_line_errors(argv, argument, capsys):
    if argument == "--device" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and argument in err and "Traceback" not in err, err


def test_debug_shows_the_traceback():
    from specdec_kernels.cli import UsageError

    with pytest.raises(UsageError):
        main(["demo", "--prompts", "0", "--debug"])
