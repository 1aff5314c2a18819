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


@pytest.fixture(autouse=True)
def _torch_threads_unchanged():
    """A test (or code it calls in-process, like ``specdec demo``) must leave torch's thread count as
    it found it: a leaked count makes every later test of that worker oversubscribed."""
    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    if after != before:
        torch.set_num_threads(before)
        pytest.fail(f"the test left torch at {after} threads (it started at {before})")


@pytest.fixture(params=["vector", "avx2", "portable"])
def simd_path(request, monkeypatch):
    """Every code path of a native CPU kernel with SIMD paths: "vector" the widest this CPU has, "avx2"
    at most AVX2 (SPECDEC_CPU_SIMD=avx2: a kernel's AVX2 path on a CPU with AVX-512 too), "portable"
    the plain loops (SPECDEC_CPU_SIMD=0)."""
    if request.param != "vector":
        monkeypatch.setenv("SPECDEC_CPU_SIMD", "0" if request.param == "portable" else "avx2")
    return request.param


@pytest.fixture
def device():
    return DEVICE


def _moved(obj, device):
    """obj with every tensor in it (dataclass fields, tuples, lists, dicts) copied to device."""
    import copy
    import dataclasses

    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        names = vars(obj) if hasattr(obj, "__dict__") else [f.name for f in dataclasses.fields(obj)]
        for name in list(names):  # fields and anything cached beside them
            object.__setattr__(out, name, _moved(getattr(obj, name), device))
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_moved(v, device) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_moved(v, device) for v in obj)
    if isinstance(obj, dict):
        return {k: _moved(v, device) for k, v in obj.items()}
    return obj


def _on_cuda(fn, is_cpu_call):
    """fn run on CUDA copies of its arguments when is_cpu_call(args, kwargs), the result copied back."""

    def wrapper(*args, **kwargs):
        if not is_cpu_call(args, kwargs):
            return fn(*args, **kwargs)
        return _moved(fn(*_moved(args, "cuda"), **_moved(kwargs, "cuda")), "cpu")

    return wrapper


@pytest.fixture(autouse=True)
def triton_kernels_run_on_the_gpu(monkeypatch):
    """With CUDA present the interpreter is off and the Triton kernels compile for the GPU, which cannot
    read CPU tensors (the library says so: a ValueError). Tests build their problems on the CPU and ask
    for the Triton kernels by name; on such a machine those launches run on CUDA copies of the checked
    arguments and their outputs come back to the CPU, so every kernel test checks the compiled kernels
    against the CPU references. (Stride patterns of views do not survive the copy: strided-view tests
    check the kernels' stride handling in the interpreter only.)"""
    from specdec_kernels._interpreter import interpreter_requested

    if HAS_CUDA and not interpreter_requested():
        install_gpu_harness(monkeypatch)


def install_gpu_harness(monkeypatch):
    """The patches of ``triton_kernels_run_on_the_gpu`` (a function, so a CPU-only run can check that
    each one still finds its target: the first GPU run found one missing)."""
    import importlib

    from specdec_kernels import _dispatch

    # By module path: `specdec_kernels.ops.tree_attention` the attribute is the function of that name.
    tree_attention = importlib.import_module("specdec_kernels.ops.tree_attention")
    tree_metadata = importlib.import_module("specdec_kernels.ops.tree_metadata")

    def triton_on_cpu(logits_field):  # run_verify / run_tree (checked args, backend)
        def check(args, kwargs):
            backend = args[1] if len(args) > 1 else kwargs.get("backend", "auto")
            return backend == "triton" and getattr(args[0], logits_field).device.type == "cpu"

        return check

    def first_on_cpu(args, kwargs):
        return args[0].device.type == "cpu"

    monkeypatch.setattr(_dispatch, "run_verify", _on_cuda(_dispatch.run_verify, triton_on_cpu("target_logits")))
    monkeypatch.setattr(_dispatch, "run_tree", _on_cuda(_dispatch.run_tree, triton_on_cpu("target")))
    monkeypatch.setattr(tree_attention, "_launch", _on_cuda(tree_attention._launch, first_on_cpu))
    monkeypatch.setattr(
        tree_metadata, "_tree_metadata_triton", _on_cuda(tree_metadata._tree_metadata_triton, first_on_cpu)
    )
