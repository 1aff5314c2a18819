"""The dispatch layer of the verification ops: backend choice and ``torch.library`` registration.

Below it: argument checking (``_validation``, ``_tree_args``, ``_params``), the kernels and their
launchers (``ops/``), the csrc loader (``ops/csrc``) and the references (``reference/``). Above
it: the public functions (``api``), which check their arguments and call :func:`run_verify` /
:func:`run_tree` here.

Backends, ``backend="auto" | "triton" | "cuda" | "cpu" | "vectorized" | "torch"``:

* ``"triton"``: the fused Triton kernels (``ops/triton/``); on CPU tensors
  they run in Triton's interpreter (slow; tests ask for it explicitly).
* ``"cuda"``:   the CUDA C++ kernels of ``csrc/`` (chain and tree verification). Needs a GPU and the
  compiled extension: built by ``SPECDEC_BUILD_CUDA=1 pip install --no-build-isolation -e .`` or just in
  time on first use (see :mod:`specdec_kernels.ops.csrc`). Without them: a RuntimeError that says how to build.
* ``"cpu"``:    the same csrc core compiled for the host (-O3, OpenMP over rows and vocab chunks), for
  CPU tensors; built just in time on first use (about a minute, cached) or by
  ``SPECDEC_BUILD_CPU=1 pip install --no-build-isolation -e .``.
* ``"vectorized"``: batched PyTorch tensor ops (``ops/vectorized/chain.py``, the tree walk in
  ``ops/vectorized/tree.py``): no compiler needed, no Python loop over requests, the
  reference's tokens.
* ``"torch"``:  the plain-PyTorch references of ``specdec_kernels.reference`` (float64 loops; slow,
  the specification).
* ``"auto"``:   on CPU tensors ``"cpu"``, or ``"vectorized"`` if the CPU build cannot be compiled (said
  once, with the reason); never the interpreter. On a GPU, the fastest of the compiled backends available
  (triton, and cuda when its extension is already built: auto never starts a multi-minute JIT
  compile), measured once per (device, op, shape class) on the caller's own inputs and cached for the
  process. During CUDA-graph capture or torch.compile tracing nothing is measured: a cached choice or
  triton.

All backends return the same tokens for the same seed (same counter-based Philox stream).
"""

from __future__ import annotations

import contextlib
import contextvars
import statistics
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from ._bitmask import apply_chain_mask, apply_tree_mask
from ._interpreter import require_triton_device
from ._params import SamplingParams
from ._tree_args import TreeArgs, validate_sharded_tree_values
from ._types import BACKENDS, VERIFY_METHODS, TreeVerifyOutput, VerifyOutput
from ._validation import VerifyArgs, validate_sharded_verify_values
from .ops import csrc, vocab_parallel
from .ops.logprobs import chain_logprobs, tree_logprobs
from .ops.triton.chain import launch_verify
from .ops.triton.tree import launch_tree
from .ops.vectorized.block import verify_block_vectorized
from .ops.vectorized.chain import verify_vectorized
from .ops.vectorized.tree import verify_tree_vectorized
from .ops.vocab_parallel.logprobs import sharded_scorer
from .reference.verify import verify_checked as reference_verify
from .reference.verify_tree import verify_tree_checked as reference_tree

# Launch-plan overrides for tests (vocab chunks, block size); see launch_overrides.
_OVERRIDES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("specdec_launch_overrides", default=None)

# (op, device index, shape class) -> backend name chosen by measurement.
_AUTO_CACHE: dict[tuple, str] = {}


@contextlib.contextmanager
def launch_overrides(
    num_chunks: int | None = None,
    block_v: int | None = None,
    threshold_chunks: int | None = None,
    threshold_capacity: int | None = None,
):
    """Force the vocabulary split and block size of the verification launches inside the block.

    For tests and benchmarks: ``num_chunks`` splits rows across programs (Triton and cuda),
    ``block_v`` sets the Triton tile width, ``threshold_chunks`` splits the top-k/top-p threshold
    phases and ``threshold_capacity`` sets their candidate slots per row (chain and tree verification,
    Triton). Not part of the public functions' signatures."""
    token = _OVERRIDES.set(
        {
            "num_chunks": num_chunks,
            "block_v": block_v,
            "threshold_chunks": threshold_chunks,
            "threshold_capacity": threshold_capacity,
        }
    )
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


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


def chain_shape_class(args) -> tuple:
    """Shape class of a chain verification (VerifyArgs) for the auto cache."""
    return (
        "verify",
        args.target_logits.dtype,
        args.cu is None,
        args.draft_mode,
        *args.sampling.shape_class(args.V),
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
        *args.sampling.shape_class(args.V),
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


def cpu_auto_backend() -> str:
    """What ``backend="auto"`` runs on CPU tensors: the CPU build of csrc, else the vectorised
    PyTorch path (one warning, the first time, saying which and why)."""
    global _CPU_AUTO
    if _CPU_AUTO is None:
        if csrc.cpu_backend_ready():
            _CPU_AUTO = "cpu"
        else:
            _CPU_AUTO = "vectorized"
            reason = str(csrc.cpu_failure() or "unknown reason")
            warnings.warn(
                "specdec_kernels: backend='auto' on CPU tensors uses 'vectorized' (batched PyTorch ops, the "
                f"same tokens as the CPU build) because the CPU build is unavailable: {reason}",
                RuntimeWarning,
                stacklevel=3,
            )
    return _CPU_AUTO


_CPU_AUTO: str | None = None
TIES_BY_INDEX_BACKENDS = ("vectorized", "torch", "triton", "cpu")  # those implementing top_p_ties="by_index"


def ties_backend(sampling, backend: str, device) -> str:
    """The backend for top_p_ties='by_index' with top-p active: "auto" runs "triton" on CUDA tensors
    (the CUDA build does not implement the rule) and picks as usual on CPU tensors ("cpu", or
    "vectorized" without the CPU build); backends without the rule raise (they would keep the whole
    boundary tie group)."""
    if not sampling.ties_by_index() or backend in TIES_BY_INDEX_BACKENDS:
        return backend
    if backend == "auto":
        return "triton" if device.type == "cuda" else backend
    raise ValueError(
        f"top_p_ties='by_index' is implemented by the backends {TIES_BY_INDEX_BACKENDS} only, got backend="
        f"{backend!r} (use top_p_ties='keep' to keep the whole tie group at the top-p boundary)"
    )


# Backends that apply token_bitmask themselves: the reference, the csrc programs (the CPU build's
# row pass, the CUDA kernels), the Triton kernels as they read each row; the others run on a masked
# copy of the rows (_bitmask.apply_chain_mask / apply_tree_mask). "auto" is resolved on CPU tensors
# before the mask is applied; on CUDA both its candidates read the mask.
NATIVE_MASK_BACKENDS = {"torch", "cpu", "cuda", "triton", "auto"}


def run_verify(args: VerifyArgs, backend: str = "auto", logprobs: int | None = None) -> VerifyOutput:
    """Run chain verification (checked VerifyArgs) on the requested backend. logprobs: the call's
    logprobs request (``ops/logprobs.logprobs_request``); the csrc builds (CPU and CUDA) and the Triton
    kernels fill ``out.logprobs`` themselves for return_logprobs without top-n (0), so the post-pass
    skips it."""
    target = args.target_logits
    device = target.device
    backend = ties_backend(args.sampling, backend, device)
    overrides = _OVERRIDES.get() or {}
    num_chunks, block_v = overrides.get("num_chunks"), overrides.get("block_v")
    if backend == "auto" and target.is_cpu:  # (is_cpu: cheaper than device.type, which runs every call)
        backend = cpu_auto_backend()
    if backend not in NATIVE_MASK_BACKENDS:  # token_bitmask: the others get masked rows
        args = apply_chain_mask(args)
    # Only the Triton kernels read the flattened layout in place; the others get a padded copy.
    if backend == "cpu":
        return csrc.verify_chain_cpu(args.padded(), num_chunks, logprobs=logprobs == 0)
    if backend == "torch":
        return reference_verify(args.padded())
    if backend == "vectorized":
        return verify_vectorized(args.padded())
    native_logprobs = logprobs == 0  # return_logprobs without top-n: the kernels write them
    if backend == "cuda":
        return csrc.verify_chain(args.padded(), num_chunks=num_chunks, logprobs=native_logprobs)
    require_triton_device(device, "sk.verify")
    threshold = (overrides.get("threshold_chunks"), overrides.get("threshold_capacity"))
    candidates = {"triton": lambda: launch_verify(args, num_chunks, block_v, *threshold, logprobs=native_logprobs)}
    if backend == "auto" and device.type == "cuda" and csrc.cuda_extension_ready():
        candidates["cuda"] = lambda: csrc.verify_chain(args.padded(), num_chunks=num_chunks, logprobs=native_logprobs)
    chosen = resolve(backend, device, chain_shape_class(args), candidates)
    return candidates[chosen]()


# Where method="block" is implemented: auto runs "cpu" on CPU tensors (or "vectorized" without the
# CPU build, as for the token rule) and "triton" on CUDA tensors ("cuda": the CUDA build, not yet run
# on a GPU, so auto does not pick it).
BLOCK_BACKENDS = ("auto", "cpu", "cuda", "vectorized", "torch", "triton")


def check_verify_method(method, backend: str, sharded: bool) -> None:
    """ValueError for a method sk.verify does not know, or block verification where it is not
    implemented yet (backends outside BLOCK_BACKENDS; torch.compile graphs). Vocabulary shards
    (process_group=) run both methods; their backends and options are checked as for the token
    rule (``check_sharded_backend``; top_p_ties="by_index" is refused for both methods)."""
    if method not in VERIFY_METHODS:
        raise ValueError(f"method must be one of {VERIFY_METHODS}, got {method!r}")
    if method == "token" or sharded:
        return
    if backend not in BLOCK_BACKENDS:
        raise ValueError(
            f"method='block' is not implemented in the {backend!r} backend yet: use backend 'auto' "
            "(the CPU build on CPU tensors, the Triton kernels on CUDA tensors), 'cpu', 'cuda', 'triton', "
            "'vectorized' or 'torch'"
        )
    if torch.compiler.is_compiling():
        raise ValueError("method='block' is not available inside torch.compile graphs yet")


def run_verify_block(args: VerifyArgs, backend: str = "auto", logprobs: int | None = None) -> VerifyOutput:
    """Block verification (``reference/block.py``) of checked VerifyArgs: the reference for
    backend="torch", the CPU build (``csrc/verify_block.h``: native token_bitmask, and the
    logprobs of return_logprobs without top-n as for the token rule) for "cpu" and "auto" on CPU
    tensors, the CUDA build (the same programs) for "cuda", the Triton chain kernels
    (``ops/triton/block.py``: native masks and logprobs, both layouts) for "triton" and "auto" on
    CUDA tensors, the batched tensor ops (``ops/vectorized/block.py``, on a masked copy) for
    "vectorized"."""
    device = args.target_logits.device
    if backend == "auto" and device.type in ("cpu", "cuda"):
        backend = cpu_auto_backend() if device.type == "cpu" else "triton"
    if backend == "triton":
        require_triton_device(device, "sk.verify")
        o = _OVERRIDES.get() or {}
        plan = (o.get("num_chunks"), o.get("block_v"), o.get("threshold_chunks"), o.get("threshold_capacity"))
        return launch_verify(args, *plan, logprobs=logprobs == 0, method="block")
    if backend == "torch":
        return reference_verify(args.padded(), method="block")
    if backend in ("cpu", "cuda"):  # the csrc builds: the same programs
        run = csrc.verify_chain_cpu if backend == "cpu" else csrc.verify_chain
        num_chunks = (_OVERRIDES.get() or {}).get("num_chunks")
        return run(args.padded(), num_chunks, logprobs=logprobs == 0, method="block")
    return verify_block_vectorized(apply_chain_mask(args).padded())


# --------------------------------------------------------------------------------------------
# tree / multi-draft verification


def run_tree(args: TreeArgs, backend: str = "auto", logprobs: int | None = None) -> TreeVerifyOutput:
    """Run tree / multi-draft verification (checked TreeArgs). logprobs: as for :func:`run_verify`
    (the csrc builds, CPU and CUDA, fill ``out.logprobs`` of the accepted path themselves without top-n)."""
    backend = ties_backend(args.sampling, backend, args.target.device)
    overrides = _OVERRIDES.get() or {}
    block_v, num_chunks = overrides.get("block_v"), overrides.get("num_chunks")
    if backend == "auto" and args.target.device.type == "cpu":
        backend = cpu_auto_backend()
    if backend not in NATIVE_MASK_BACKENDS:  # token_bitmask: as in run_verify
        args = apply_tree_mask(args)
    if backend == "cpu":
        return csrc.verify_tree_cpu(args, logprobs=logprobs == 0)
    if backend == "torch":
        return reference_tree(args)
    if backend == "vectorized":
        return verify_tree_vectorized(args)
    if backend == "cuda":
        return csrc.verify_tree(args, logprobs=logprobs == 0)
    require_triton_device(args.target.device, "sk.verify_tree / sk.verify_multi")
    threshold = (overrides.get("threshold_chunks"), overrides.get("threshold_capacity"))
    candidates = {"triton": lambda: launch_tree(args, block_v, num_chunks, *threshold, logprobs=logprobs == 0)}
    if backend == "auto" and args.target.device.type == "cuda" and csrc.cuda_extension_ready():
        candidates["cuda"] = lambda: csrc.verify_tree(args, logprobs=logprobs == 0)
    chosen = resolve(backend, args.target.device, tree_shape_class(args), candidates)
    return candidates[chosen]()


# --------------------------------------------------------------------------------------------
# vocabulary-parallel verification (process_group=): ops/vocab_parallel/

SHARDED_BACKENDS = ("auto", "torch")
# the operation in the layout exchange's signature: ranks calling different ones (block on one rank,
# token on another would run different collectives) raise instead of waiting in a collective
_KIND_CHAIN, _KIND_TREE, _KIND_MULTI, _KIND_CHAIN_BLOCK = 1, 2, 3, 4


def check_sharded_backend(backend: str) -> str:
    """Vocabulary shards run the vectorised PyTorch implementation (any device)."""
    backend = check_backend(backend)
    if backend not in SHARDED_BACKENDS:
        raise ValueError(
            f"process_group= runs the vectorised PyTorch shard implementation: backend must be one of "
            f"{SHARDED_BACKENDS}, got {backend!r}"
        )
    return backend


def _local_check(check: Callable[[], object]):
    """(checked arguments, None) or (None, the error): errors are raised on every rank later."""
    try:
        return check(), None
    except (TypeError, ValueError) as error:
        return None, error


def _group_device(process_group, args, attr: str) -> torch.device:
    if args is not None:
        return getattr(args, attr).device
    if torch.distributed.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def run_verify_sharded(
    check: Callable[[], VerifyArgs],
    process_group,
    vocab_size,
    validate: bool,
    num_logprobs: int | None = None,
    method: str = "token",
) -> VerifyOutput:
    """Chain verification over vocabulary shards. ``check`` returns this rank's checked arguments
    (shapes only: ids are global, checked here against the full vocabulary). num_logprobs: None,
    or the logprobs post-pass (``ops/logprobs.py``) on the shards with that many top logprobs.
    method: "token" or "block" (checked by ``check_verify_method``)."""
    args, error = _local_check(check)
    device = _group_device(process_group, args, "target_logits")
    validate = validate and not _capturing(device)
    dims = None if args is None else (args.B, args.G, 0)
    checksum = vocab_parallel.replicated_checksum(args) if validate and args is not None else -1
    kind = _KIND_CHAIN_BLOCK if method == "block" else _KIND_CHAIN
    shard, args = vocab_parallel.exchange_layout(process_group, device, kind, args, error, vocab_size, dims, checksum)
    if validate:  # the replicated arguments are equal on every rank (checksum): the same verdict everywhere
        validate_sharded_verify_values(args, shard.V)
    padded = apply_chain_mask(args).padded()  # local words: _bitmask
    out = vocab_parallel.verify_chain_sharded(shard, padded, method)
    if num_logprobs is not None:
        out = chain_logprobs(args, out, num_logprobs, score=sharded_scorer(shard))
    return out


def run_tree_sharded(
    check: Callable[[], tuple[TreeArgs, bool]],
    process_group,
    vocab_size,
    validate: bool,
    multi: bool,
    num_logprobs: int | None = None,
) -> TreeVerifyOutput:
    """Tree / multi-draft verification over vocabulary shards. ``check`` returns (this rank's
    checked arguments, whether max_depth may shrink to the deepest tree as the unsharded call's
    validation does); num_logprobs as for :func:`run_verify_sharded`."""
    checked, error = _local_check(check)
    args, tighten = checked if checked is not None else (None, False)
    device = _group_device(process_group, args, "target")
    validate = validate and not _capturing(device)
    dims = None if args is None else (args.B, args.K, args.G)
    checksum = vocab_parallel.replicated_checksum(args) if validate and args is not None else -1
    kind = _KIND_MULTI if multi else _KIND_TREE
    shard, args = vocab_parallel.exchange_layout(process_group, device, kind, args, error, vocab_size, dims, checksum)
    if validate:
        depth = validate_sharded_tree_values(args, shard.V, multi)
        if tighten and depth is not None:
            args.max_depth = depth
    out = vocab_parallel.verify_tree_sharded(shard, apply_tree_mask(args))  # local words: _bitmask
    if num_logprobs is not None:
        out = tree_logprobs(args, out, num_logprobs, score=sharded_scorer(shard))
    return out


# --------------------------------------------------------------------------------------------
# torch.library custom ops (torch.compile / CUDA graphs)
#
# ``specdec::verify_chain`` and ``specdec::verify_tree`` take the *checked* arguments with the
# sampling parameters flattened (``SamplingParams.op_args``) and return plain tensors. Each has a
# fake (meta) implementation giving the output shapes, so a ``torch.compile`` graph holds the op as
# one opaque node (no graph break inside the Triton launcher, which dynamo cannot trace), and
# ``mode="reduce-overhead"`` can capture it in a CUDA graph. The public functions call the op only
# while torch.compile traces them; eager calls go to :func:`run_verify` / :func:`run_tree` directly
# (same implementation, less dispatch overhead). Under torch.compile pass ``validate=False`` (value
# checks read tensors, a graph break) and an explicit ``seed`` (``seed=None`` draws a host random
# number, also a graph break).


@torch.library.custom_op("specdec::verify_chain", mutates_args=())
def verify_chain_op(
    target_logits: Tensor, draft_tokens: Tensor, draft: Tensor | None, draft_mode: int,
    sampling_tensors: list[Tensor | None], sampling_scalars: list[float], seed_t: Tensor | None, seed: int,
    num_draft_tokens: Tensor | None, cu: Tensor | None, max_drafts: int, backend: str,
    token_bitmask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """tokens [B, G+1] int64, num_accepted [B] int32, nonfinite [B] bool (see ``sk.verify``)."""
    sampling = SamplingParams.from_op_args(sampling_tensors, sampling_scalars, seed_t, seed)
    args = VerifyArgs(target_logits, draft_tokens, draft, draft_mode, sampling, num_draft_tokens, cu, max_drafts)
    args.token_bitmask = token_bitmask
    out = run_verify(args, backend)
    return out.tokens, out.num_accepted, out.nonfinite


@verify_chain_op.register_fake
def _verify_chain_fake(
    target_logits, draft_tokens, draft, draft_mode, st, ss, seed_t, seed, n, cu, max_drafts, _, token_bitmask=None
):
    if cu is None:
        B, G1 = target_logits.shape[0], target_logits.shape[1]
    else:
        B, G1 = cu.shape[0] - 1, max_drafts + 1
    return (
        target_logits.new_empty((B, G1), dtype=torch.int64),
        target_logits.new_empty((B,), dtype=torch.int32),
        target_logits.new_empty((B,), dtype=torch.bool),
    )


def call_verify_chain(args: VerifyArgs, backend: str) -> VerifyOutput:
    """Run the custom op on checked arguments."""
    sampling = args.sampling.op_args(with_ties=True)  # (tensors, scalars, seed tensor, seed int)
    tokens, accepted, nonfinite = verify_chain_op(
        args.target_logits, args.draft_tokens, args.draft, args.draft_mode, *sampling, args.num_draft_tokens, args.cu,
        args.max_drafts, backend, args.token_bitmask,
    )  # fmt: skip
    return VerifyOutput(tokens, accepted, nonfinite)


@torch.library.custom_op("specdec::verify_tree", mutates_args=())
def verify_tree_op(
    target: Tensor, tokens: Tensor, parents: Tensor | None, draft: Tensor | None, draft_mode: int,
    sampling_tensors: list[Tensor | None], sampling_scalars: list[float], seed_t: Tensor | None, seed: int,
    num_nodes: Tensor | None, method: str, max_depth: int, backend: str,
    token_bitmask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """tokens [B, D+1] int64, num_accepted [B] int32, accepted_nodes [B, D] int64, nonfinite [B] bool.

    target [B, K, G+1, V], tokens [B, K, G] (the K-chains view of ``_tree_args``)."""
    sampling = SamplingParams.from_op_args(sampling_tensors, sampling_scalars, seed_t, seed)
    args = TreeArgs(target, tokens, parents, draft, draft_mode, sampling, num_nodes, method, max_depth)
    args.token_bitmask = token_bitmask
    out = run_tree(args, backend)
    return out.tokens, out.num_accepted, out.accepted_nodes, out.nonfinite


@verify_tree_op.register_fake
def _verify_tree_fake(
    target,
    tokens,
    parents,
    draft,
    draft_mode,
    st,
    ss,
    seed_t,
    seed,
    num_nodes,
    method,
    max_depth,
    _,
    token_bitmask=None,
):
    B = target.shape[0]
    return (
        target.new_empty((B, max_depth + 1), dtype=torch.int64),
        target.new_empty((B,), dtype=torch.int32),
        target.new_empty((B, max_depth), dtype=torch.int64),
        target.new_empty((B,), dtype=torch.bool),
    )


def call_verify_tree(args: TreeArgs, backend: str) -> TreeVerifyOutput:
    """Run the custom op on checked arguments."""
    sampling = args.sampling.op_args(with_ties=True)  # (tensors, scalars, seed tensor, seed int)
    tokens, accepted, nodes, nonfinite = verify_tree_op(
        args.target, args.tokens, args.parents, args.draft, args.draft_mode, *sampling, args.num_nodes, args.method,
        args.max_depth, backend, args.token_bitmask,
    )  # fmt: skip
    return TreeVerifyOutput(tokens, accepted, nodes, nonfinite)
