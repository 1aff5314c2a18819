"""Importing ``triton.language`` (as transformers and torch do) before specdec_kernels still works.

On a machine without CUDA the package switches Triton to its interpreter when it is imported. If
Triton's language was imported first, its library functions were built for the compiler and used
to fail inside the interpreter ("Cannot call @triton.jit'd outside of the scope of a kernel").
Runs in a fresh interpreter process: this test process has long imported everything.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = r"""
import torch
import triton.language as tl  # first, with TRITON_INTERPRET unset (what `import transformers` does)
import specdec_kernels as sk
from specdec_kernels.ops.tree_metadata import tree_metadata

depth = tree_metadata(torch.tensor([[-1, 0, 1, 0]]), None).depth
assert depth.tolist() == [[1, 2, 3, 2]], depth
logits = torch.tensor([[[0.0, 5.0, 1.0], [4.0, 0.0, 0.0]]])  # greedy: argmax 1, then 0
out = sk.verify(logits, torch.tensor([[1]]), temperature=0.0)
assert out.tokens.tolist() == [[1, 0]] and out.num_accepted.tolist() == [1], out
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is only switched on without CUDA")
def test_triton_language_imported_before_the_package():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_the_gpu_test_harness_finds_what_it_patches(monkeypatch):
    """tests/conftest.py's install_gpu_harness runs only where CUDA is present; its targets must exist here too."""
    from tests.conftest import install_gpu_harness

    install_gpu_harness(monkeypatch)
    from specdec_kernels import _dispatch

    assert _dispatch.run_verify.__name__ == "wrapper" and _dispatch.run_tree.__name__ == "wrapper"
