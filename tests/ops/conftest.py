"""The kernel tests exercise the Triton kernels: on CPU tensors ``backend="auto"`` means the native
CPU backend for users, so here (no GPU) auto is pointed at Triton (its interpreter) instead. Tests
of the other backends name them explicitly."""

import os

import pytest
import torch

from specdec_kernels import _dispatch


@pytest.fixture(autouse=True)
def auto_means_triton_on_cpu(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setattr(_dispatch, "_CPU_AUTO", "triton")


@pytest.fixture
def no_post_pass(monkeypatch):
    """The logprobs post-pass's row gather (ops/logprobs.py ``_fill``) made to raise: a backend's
    native logprobs must not need it (test_cpu_logprobs.py, test_native_logprobs.py)."""
    from specdec_kernels.ops import logprobs as post_pass

    def refuse(*args, **kwargs):
        raise AssertionError("the logprobs post-pass ran")

    monkeypatch.setattr(post_pass, "_fill", refuse)
    return monkeypatch


@pytest.fixture(scope="module")
def one_rank_group():
    """A gloo process group of this process alone: the vocabulary-parallel path (process_group=)
    with the whole vocabulary on one rank."""
    import tempfile

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs gloo")
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def cpu_core_or_skip():
    """The CPU build of csrc/, or a skip where no C++ toolchain can build it. CI sets
    SPECDEC_REQUIRE_CPU_BUILD=1 (it has a compiler): there a build that fails is a test failure,
    not a skip - a broken csrc/ must not pass as "no toolchain"."""
    from specdec_kernels.ops import csrc

    try:
        return csrc.load_cpu_core()
    except Exception as exc:
        if os.environ.get("SPECDEC_REQUIRE_CPU_BUILD") == "1":
            raise
        pytest.skip(f"cannot build the CPU core of csrc/: {str(exc)[:300]}")
