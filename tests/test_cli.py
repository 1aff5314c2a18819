"""The `specdec` console script: help, and the demo's measured acceptance against theory."""

import math
import re

from specdec_kernels.cli import main


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "demo" in capsys.readouterr().out


def test_verify_demo_agrees_with_theory(capsys):
    B = 384
    assert main(["verify-demo", "--batch", str(B), "--vocab", "32", "--num-draft-tokens", "3", "--num-drafts", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "greedy: accepted tokens equal the target argmax chain" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*(close|medium|far)\s", line)]
    assert len(rows) == 3
    for row in rows:
        alpha_theory, alpha_measured = float(row[1]), float(row[2])
        kseq_theory, kseq_measured = float(row[5]), float(row[6])
        for theory, measured in ((alpha_theory, alpha_measured), (kseq_theory, kseq_measured)):
            sigma = math.sqrt(max(theory * (1 - theory), 1e-3) / B)  # (theory is itself a mean over rows)
            assert abs(measured - theory) < 6 * sigma + 0.02, (row, theory, measured)
