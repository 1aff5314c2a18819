"""Test configuration. First thing: run Triton in its interpreter when there is no CUDA GPU.

TRITON_INTERPRET must be set before any @triton.jit decorator runs, i.e. before specdec_kernels
is imported; importing the package does it as well, but tests may import triton directly.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# One torch thread per test process: `pytest -n 2` on two cores would otherwise run 2 x N threads,
# and on a machine busy with other work oversubscription made the HF tests 4-6x slower.
torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "1")))

import specdec_kernels  # noqa: E402,F401  (applies the interpreter set-up)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return DEVICE
