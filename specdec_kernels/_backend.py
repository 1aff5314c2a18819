"""Backend selection for the verification ops: ``backend="auto" | "triton" | "cuda" | "torch"``.

* ``"triton"``: the fused Triton kernels (``ops/verify.py``, ``ops/verify_tree.py``); on CPU they run
  in Triton's interpreter.
* ``"cuda"``:   the CUDA C++ kernels of ``csrc/`` (chain and tree verification). Needs a GPU and the
  compiled extension: built by ``SPECDEC_BUILD_CUDA=1 pip install -e .`` or just in time on first use
  (see :mod:`specdec_kernels.ops._cuda_ext`). Without them: a RuntimeError that says how to build.
* ``"torch"``:  the plain-PyTorch references of ``specdec_kernels.reference`` (float64 loops; slow,
  the specification).
* ``"auto"``:   on CPU, triton. On a GPU, the fastest of the compiled backends available (triton, and
  cuda when its extension is already built: auto never starts a multi-minute JIT compile), measured
  once per (device, op, shape class) on the caller's own inputs and cached for the process. During
  CUDA-graph capture or torch.compile tracing nothing is measured: a cached choice or triton.

All backends return the same tokens for the same seed (same counter-based Philox stream).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

BACKENDS = ("auto", "triton", "cuda", "torch")

# (op, device index, shape class) -> backend name chosen by measurement.
_AUTO_CACHE: dict[tuple, str] = {}


def check_backend(backend) -> str:
    """The backend name, or ValueError / TypeError naming the allowed values."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, one of {BACKENDS}, got {backend!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def _bucket(n: int) -> int:
    """Power-of-two bucket of a size: shapes within a factor of two share a measurement."""
    return 1 << max(0, int(n) - 1).bit_length()


def _sampling_class(temperature, top_k, top_p) -> tuple:
    greedy = "tensor" if isinstance(temperature, torch.Tensor) else temperature == 0.0
    filtered = isinstance(top_k, torch.Tensor) or isinstance(top_p, torch.Tensor) or top_k > 0 or top_p < 1.0
    return greedy, filtered


def chain_shape_class(args) -> tuple:
    """Shape class of a chain verification (VerifyArgs) for the auto cache."""
    return (
        "verify",
        args.target_logits.dtype,
        args.draft_mode,
        *_sampling_class(args.temperature, args.top_k, args.top_p),
        _bucket(args.B),
        args.G,
        _bucket(args.V),
    )


def tree_shape_class(args) -> tuple:
    """Shape class of a tree / multi-draft verification (TreeArgs) for the auto cache."""
    return (
        "tree",
        args.target.dtype,
        args.draft_mode,
        args.method,
        args.parents is None,
        *_sampling_class(args.temperature, args.top_k, args.top_p),
        _bucket(args.B),
        args.K,
        args.G,
        _bucket(args.V),
    )


def _busy(device: torch.device) -> bool:
    """No measuring while capturing a CUDA graph or tracing for torch.compile."""
    if torch.compiler.is_compiling():
        return True
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _time_us(fn: Callable[[], object], reps: int = 5) -> float:
    fn()  # warm-up: compiles / autotunes
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def resolve(backend: str, device: torch.device, key: tuple, candidates: dict[str, Callable[[], object]]) -> str:
    """The concrete backend for a call. ``candidates``: name -> zero-argument runner of this call,
    in order of preference (the first is used when nothing can be measured)."""
    if backend != "auto":
        return backend
    names = list(candidates)
    if device.type != "cuda" or len(names) == 1:
        return names[0]
    cache_key = (device.index if device.index is not None else torch.cuda.current_device(), key)
    chosen = _AUTO_CACHE.get(cache_key)
    if chosen is not None:
        return chosen
    if _busy(device):
        return names[0]
    timings = {name: _time_us(run) for name, run in candidates.items()}
    chosen = min(timings, key=timings.get)
    _AUTO_CACHE[cache_key] = chosen
    return chosen


def auto_choices() -> dict[tuple, str]:
    """A copy of the measured auto choices, {(device index, shape class): backend}."""
    return dict(_AUTO_CACHE)


def clear_auto_cache() -> None:
    _AUTO_CACHE.clear()


# --------------------------------------------------------------------------------------------
# chain verification


def _chain_reference(args):
    from .reference.verify import verify_reference

    draft_kw = {1: "draft_logits", 2: "draft_probs"}.get(args.draft_mode)
    extra = {draft_kw: args.draft} if draft_kw else {}
    return verify_reference(
        args.target_logits,
        args.draft_tokens,
        **extra,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        num_draft_tokens=args.num_draft_tokens,
        seed=args.seed,
        validate=False,
    )


def run_verify(args, backend: str = "auto", num_chunks: int | None = None, block_v: int | None = None):
    """Run chain verification (checked VerifyArgs) on the requested backend; returns VerifyOutput."""
    from .ops import _cuda_ext
    from .ops.verify import _launch

    device = args.target_logits.device
    if backend == "torch":
        return _chain_reference(args)
    if backend == "cuda":
        return _cuda_ext.verify_chain(args, num_chunks=num_chunks)
    candidates = {"triton": lambda: _launch(args, num_chunks, block_v)}
    if backend == "auto" and device.type == "cuda" and _cuda_ext.cuda_extension_ready():
        candidates["cuda"] = lambda: _cuda_ext.verify_chain(args, num_chunks=num_chunks)
    chosen = resolve(backend, device, chain_shape_class(args), candidates)
    return candidates[chosen]()


# --------------------------------------------------------------------------------------------
# tree / multi-draft verification


def run_tree(args, backend: str = "auto", block_v: int | None = None):
    """Run tree / multi-draft verification (checked TreeArgs); returns TreeVerifyOutput."""
    from .ops.verify_tree import _launch_tree

    if backend == "torch":
        from .reference.verify_tree import _walk_all

        return _walk_all(args)
    from .ops import _cuda_ext

    if backend == "cuda":
        return _cuda_ext.verify_tree(args)
    candidates = {"triton": lambda: _launch_tree(args, block_v)}
    if backend == "auto" and args.target.device.type == "cuda" and _cuda_ext.cuda_extension_ready():
        candidates["cuda"] = lambda: _cuda_ext.verify_tree(args)
    chosen = resolve(backend, args.target.device, tree_shape_class(args), candidates)
    return candidates[chosen]()
