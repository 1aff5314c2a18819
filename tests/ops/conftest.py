"""The kernel tests exercise the Triton kernels: on CPU tensors ``backend="auto"`` means the native
CPU backend for users, so here (no GPU) auto is pointed at Triton (its interpreter) instead. Tests
of the other backends name them explicitly."""

import pytest
import torch

from specdec_kernels import _dispatch


@pytest.fixture(autouse=True)
def auto_means_triton_on_cpu(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setattr(_dispatch, "_CPU_AUTO", "triton")
