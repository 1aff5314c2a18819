"""Every Triton kernel compiles to PTX for sm_80 and sm_90 (no GPU needed).

The interpreter runs programs the real compiler rejects; this keeps GPU builds from breaking
silently on CPU-only CI. Runs in a subprocess because the interpreter is active in this one.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~4 minutes of compiling on 2 cores (every variant, both archs)
def test_kernels_compile_for_sm80_and_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run(
        [sys.executable, "-m", "tests.ops._compile_kernels"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "compiled" in result.stdout
