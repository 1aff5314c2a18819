"""Loading and calling the compiled backend of ``csrc/`` (chain and tree verification).

Two builds of the same sources:

* the CUDA extension (``backend="cuda"``): ``csrc/binding.cpp`` + ``verify_cpu.cpp`` + ``verify_cuda.cu``
  with ``-DSPECDEC_WITH_CUDA``. Either prebuilt (module ``specdec_kernels.ops.csrc._csrc_cuda``) by
  ``SPECDEC_BUILD_CUDA=1 pip install --no-build-isolation -e .`` or compiled just in time on first use with
  ``torch.utils.cpp_extension.load`` (ninja + nvcc; honours ``TORCH_CUDA_ARCH_LIST`` and ``MAX_JOBS``;
  set ``SPECDEC_NO_JIT=1`` to forbid it).
* the CPU build (``backend="cpu"``, :func:`load_cpu_core`): ``binding.cpp`` + ``verify_cpu.cpp`` compiled
  by the host C++ compiler with -O3 and OpenMP. It runs the very per-row code of the CUDA kernels
  (``csrc/verify_core.h``, all ``__host__ __device__``) spread over the cores, so it is both the fast
  CPU backend and the token-for-token test of the CUDA math on machines with no GPU. Built just in
  time on first use (about a minute; ninja) or ahead of time by
  ``SPECDEC_BUILD_CPU=1 pip install --no-build-isolation -e .`` (module ``specdec_kernels.ops.csrc._csrc_cpu``).

Prebuilt modules live beside this loader (this package), so loading one never imports upward.

Sources and flags of both builds are declared once, in ``csrc/build.json`` (setup.py reads it too).
With ``SPECDEC_CSRC_SANITIZE=1`` :func:`load_cpu_core` loads a third, just-in-time build instead of the
CPU one: the same sources under AddressSanitizer and UndefinedBehaviorSanitizer (``cpu_sanitize`` in
build.json; any report aborts the process). Its process must start with the ASan runtime preloaded
(``LD_PRELOAD=$(gcc -print-file-name=libasan.so)``, ``ASAN_OPTIONS=detect_leaks=0``): see
``tests/ops/test_csrc_sanitized.py``, which runs the csrc tests that way.

A wheel carries the sources as package data (``specdec_kernels/csrc/``, copied there by setup.py's
``build_py``); a source checkout or editable install reads the checkout's ``csrc/``.

Just-in-time builds go to a per-user cache, never into site-packages or the source tree:
``$SPECDEC_BUILD_DIR`` if set, else ``$TORCH_EXTENSIONS_DIR``, else ``$XDG_CACHE_HOME/specdec_kernels``
(``~/.cache/specdec_kernels``); one subdirectory per build name and fingerprint of the sources, flags,
torch and Python versions, so checkouts with different sources and torch upgrades never share a
binary. A location that cannot be written falls back to the temporary directory, with one warning.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from ..._interpreter import multiprocessors
from ..._types import METHODS, TreeVerifyOutput, VerifyOutput
from ..._validation import VerifyArgs

_PACKAGE = Path(__file__).resolve().parents[2]  # specdec_kernels/ (this file: specdec_kernels/ops/csrc/__init__.py)
_PACKAGED_CSRC = _PACKAGE / "csrc"  # a wheel: package data (setup.py's build_py)
_CHECKOUT_CSRC = _PACKAGE.parent / "csrc"  # a source checkout or an editable install
CSRC = _PACKAGED_CSRC if (_PACKAGED_CSRC / "build.json").is_file() else _CHECKOUT_CSRC


def build_config() -> dict:
    """csrc/build.json: sources, headers and flags of the CPU and CUDA builds (empty without csrc/)."""
    path = CSRC / "build.json"
    return json.loads(path.read_text()) if path.is_file() else {"headers": [], "cpu": {}, "cuda": {}}


_HOW_TO_BUILD = (
    "Build it with `SPECDEC_BUILD_CUDA=1 pip install --no-build-isolation -e .` (CUDA toolkit matching torch, ninja; "
    "TORCH_CUDA_ARCH_LIST, default '8.0;9.0', and MAX_JOBS are honoured) or let it compile just in time "
    "on first use (needs nvcc / CUDA_HOME and ninja). Or use backend='triton'."
)

_cuda_core = None
_cpu_core = None


def cache_root() -> Path:
    """Where just-in-time builds go: $SPECDEC_BUILD_DIR, $TORCH_EXTENSIONS_DIR, else the user's cache."""
    for variable in ("SPECDEC_BUILD_DIR", "TORCH_EXTENSIONS_DIR"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "specdec_kernels"


def _fingerprint(kind: str) -> str:
    """Sources, headers, flags, torch and Python versions of one build: a binary is reused only by
    the very same inputs (another checkout's sources or another torch get their own directory)."""
    config = build_config()
    digest = hashlib.sha256(json.dumps(config.get(kind) or {}, sort_keys=True).encode())
    digest.update(f"{torch.__version__} {sys.version_info[:2]} {torch.version.cuda}".encode())
    for name in sorted(set((config.get(kind) or {}).get("sources", []) + config["headers"])):
        path = CSRC / name
        digest.update(name.encode() + (path.read_bytes() if path.is_file() else b""))
    return digest.hexdigest()[:16]


_WARNED_READ_ONLY = False


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def build_dir(name: str, kind: str = "cpu") -> Path:
    """The cache directory of one build (created); the temporary directory if the cache is read-only."""
    global _WARNED_READ_ONLY
    leaf = f"{name}-{_fingerprint(kind)}"
    path = cache_root() / leaf
    if _writable(path):
        return path
    fallback = Path(tempfile.gettempdir()) / f"specdec_kernels-{os.getuid()}" / leaf
    if not _WARNED_READ_ONLY:
        _WARNED_READ_ONLY = True
        warnings.warn(
            f"specdec_kernels: cannot write the build cache {path.parent} (set SPECDEC_BUILD_DIR or "
            f"TORCH_EXTENSIONS_DIR to a writable directory); building into {fallback.parent} instead",
            RuntimeWarning,
            stacklevel=2,
        )
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


_BUILDING = {  # the one line printed before a just-in-time build (it takes a while, once)
    "cpu": "specdec_kernels: building the native CPU backend (once, ~1 min) into {}",
    "cuda": "specdec_kernels: building the CUDA backend (once, several minutes) into {}",
    "cpu_sanitize": "specdec_kernels: building the sanitized CPU backend (SPECDEC_CSRC_SANITIZE=1) into {}",
}


def _load(kind: str, verbose: bool):
    """Compile (or load the cached build of) the "cpu" or "cuda" build declared in csrc/build.json."""
    from torch.utils.cpp_extension import load

    config = build_config()
    build = config.get(kind) or {}
    sources = build.get("sources", [])
    missing = [s for s in sources + config["headers"] if not (CSRC / s).is_file()] or (
        [] if sources else ["build.json"]
    )
    if missing:
        raise RuntimeError(
            f"csrc sources not found ({', '.join(missing)} under {CSRC}): reinstall specdec_kernels "
            "(its wheel carries them as specdec_kernels/csrc) or use a source checkout"
        )
    kwargs = {"extra_cuda_cflags": build["cuda_cflags"]} if kind == "cuda" else {}
    directory = build_dir(build["name"], kind)
    if not (directory / f"{build['name']}.so").is_file():
        print(_BUILDING[kind].format(directory), file=sys.stderr, flush=True)
    return load(
        name=build["name"],
        sources=[str(CSRC / s) for s in sources],
        extra_cflags=build["cflags"],
        extra_ldflags=build.get("ldflags", []),
        extra_include_paths=[str(CSRC)],
        build_directory=str(directory),
        with_cuda=kind == "cuda",
        verbose=verbose,
        **kwargs,
    )


def _prebuilt(kind: str):
    """The module setup.py built beside this loader (``SPECDEC_BUILD_CPU=1`` / ``SPECDEC_BUILD_CUDA=1``), or None."""
    try:
        if kind == "cpu":
            from . import _csrc_cpu as module
        else:
            from . import _csrc_cuda as module
    except ImportError:
        return None
    return module


_CPU_FAILURE: str | None = None


def load_cpu_core(verbose: bool = False):
    """The CPU build of the csrc core: prebuilt, or compiled once just in time and cached (the
    sanitized build when SPECDEC_CSRC_SANITIZE=1; see the module docstring).

    Raises RuntimeError if it cannot be built; the failure is remembered for the process."""
    global _cpu_core, _CPU_FAILURE
    if _cpu_core is not None:
        return _cpu_core
    if _CPU_FAILURE is not None:
        raise RuntimeError(_CPU_FAILURE)
    sanitize = os.environ.get("SPECDEC_CSRC_SANITIZE", "0") not in ("", "0")
    ext = None if sanitize else _prebuilt("cpu")  # the prebuilt module is never the sanitized one
    if ext is None:
        if os.environ.get("SPECDEC_NO_JIT", "0") not in ("", "0"):
            _CPU_FAILURE = "the CPU build specdec_kernels.ops.csrc._csrc_cpu is not built and SPECDEC_NO_JIT is set"
            raise RuntimeError(_CPU_FAILURE)
        try:
            ext = _load("cpu_sanitize" if sanitize else "cpu", verbose)
        except Exception as exc:  # no compiler, no ninja, no sources: say why, once
            _CPU_FAILURE = f"building the CPU backend failed: {str(exc).strip().splitlines()[-1][:300]}"
            raise RuntimeError(_CPU_FAILURE) from exc
    _cpu_core = ext
    return ext


def cpu_failure() -> str | None:
    """Why the CPU build could not be loaded (None if it loaded or was never tried)."""
    return _CPU_FAILURE


def cpu_backend_ready() -> bool:
    """The CPU build loads (compiling it on first call if needed)."""
    try:
        load_cpu_core()
        return True
    except RuntimeError:
        return False


def cuda_extension_ready() -> bool:
    """The CUDA extension is built or loaded already (nothing would be compiled) and a GPU exists."""
    return torch.cuda.is_available() and (_cuda_core is not None or _prebuilt("cuda") is not None)


def load_cuda_extension(verbose: bool = False):
    """The CUDA extension: prebuilt, or compiled just in time. RuntimeError saying how to build."""
    global _cuda_core
    if _cuda_core is not None:
        return _cuda_core
    if not torch.cuda.is_available():
        raise RuntimeError("backend='cuda' needs a CUDA GPU, and torch.cuda.is_available() is False. " + _HOW_TO_BUILD)
    ext = _prebuilt("cuda")
    if ext is None:
        if os.environ.get("SPECDEC_NO_JIT", "0") not in ("", "0"):
            raise RuntimeError(
                "the CUDA extension specdec_kernels.ops.csrc._csrc_cuda is not built and SPECDEC_NO_JIT is set. "
                + _HOW_TO_BUILD
            )
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None or shutil.which("ninja") is None:
            raise RuntimeError(
                "the CUDA extension specdec_kernels.ops.csrc._csrc_cuda is not built and cannot be compiled just "
                f"in time (CUDA_HOME={CUDA_HOME}, ninja={'found' if shutil.which('ninja') else 'missing'}). "
                + _HOW_TO_BUILD
            )
        try:
            ext = _load("cuda", verbose)
        except Exception as exc:  # compiler errors: keep the log, say how to build
            raise RuntimeError(f"compiling the CUDA extension just in time failed: {exc}\n" + _HOW_TO_BUILD) from exc
    _cuda_core = ext
    return ext


def _num_chunks(args: VerifyArgs, threads: int) -> int:
    """Vocab chunks per row so that a small batch still fills the GPU: ~4 row-statistics blocks per
    SM over the B * (G + 1) rows, and ~2 accept blocks per SM over the B requests (the accept kernel
    races over one row per request, B x C blocks: with the rows' count alone, B = 64, G = 4 gave 2
    chunks, 128 blocks for 132 SMs, and the H200 took 462 us against the Triton kernels' 148 us)."""
    if args.has_filter:
        return 1
    rows = args.B * (args.G + 1)
    sms = multiprocessors(args.target_logits.device)
    per_block = 4 * threads * 4  # four quads per thread at least
    fill = max(math.ceil(4 * sms / max(rows, 1)), math.ceil(2 * sms / max(args.B, 1)))
    return max(1, min(math.ceil(args.V / per_block), fill, 64))


# (row, chunk) items per thread the CPU row pass aims for: with fewer, a thread that gets one more
# item than the others sets the pace (5 rows over 2 threads: 3 rows' time instead of 2.5); with
# CPU_ITEMS_PER_THREAD items each the imbalance is at most one item in that many.
CPU_ITEMS_PER_THREAD = 4
CPU_MIN_CHUNK = 8192  # entries: a smaller chunk's record and merge cost more than its share of the row


def _cpu_chunks(args: VerifyArgs) -> int:
    """Vocab chunks per row on the CPU: about CPU_ITEMS_PER_THREAD (row, chunk) items per thread
    when the rows alone give fewer, chunks of at least CPU_MIN_CHUNK entries."""
    threads = torch.get_num_threads()
    if threads <= 1:
        return 1
    rows = args.B * (args.G + 1)
    want = CPU_ITEMS_PER_THREAD * threads
    if rows == 0 or rows >= want:
        return 1
    return max(1, min(math.ceil(want / rows), args.V // CPU_MIN_CHUNK))


def _sampling_args(args, logprobs: bool = False, has_filter: bool | None = None) -> tuple:
    """The sampling arguments both csrc entry points take, in binding.cpp's order: (temperature
    tensor, scalar), (top_k tensor, scalar), (top_p tensor, scalar), (seed tensor, scalar), whether
    any filter is on (``has_filter``: args.has_filter, when the caller has it already), whether
    top-p ties break by index (with logprobs also for a greedy call: the logprobs score greedy rows
    at temperature 1 with their top-p and its tie rule)."""
    sampling = args.sampling
    by_index = sampling.ties_by_index() or (logprobs and sampling.top_p_ties == "by_index")
    if has_filter is None:
        has_filter = args.has_filter
    return (*sampling.flat_args(), bool(has_filter), bool(by_index))


def _stream(t: torch.Tensor) -> int:
    """The current CUDA stream's handle on the device of ``t`` (0 on the CPU)."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


# run_chain / run_tree's logprobs=2 (binding.cpp's LOGPROBS_GPU_PROGRAMS; CPU tensors only): the CPU
# build scores greedy rows with the CUDA kernels' greedy_normaliser_program (csrc/verify_logprobs.h),
# which tests that code without a GPU.
LOGPROBS_GPU_PROGRAMS = 2


def chain_threads(has_filter: bool) -> int:
    """Threads per block of the chain programs (CUDA; the CPU build ignores them): 512 with a top-k /
    top-p filter, else 256 (run_chain's default; ``bench_overhead.py`` passes the same)."""
    return 512 if has_filter else 256


def run_chain(
    ext,
    args: VerifyArgs,
    num_chunks: int | None = None,
    threads: int | None = None,
    logprobs: bool | int = False,
    block: bool = False,
) -> VerifyOutput:
    """Call ``ext.verify_chain`` (CPU core or CUDA extension) on checked arguments (padded layout);
    a ``token_bitmask`` is applied by the programs themselves (both builds). logprobs: the output's
    ``logprobs`` (return_logprobs) from the row statistics, no post-pass (both builds; 2, a CPU test
    entry: greedy rows scored with the CUDA kernels' statistics, ``LOGPROBS_GPU_PROGRAMS``). block
    (both builds): method="block" (``reference/block.py``, ``csrc/verify_block.h``) for the sampled
    requests."""
    target = args.target_logits
    has_filter = args.has_filter
    if threads is None:
        threads = chain_threads(has_filter)
    if num_chunks is None:
        num_chunks = _num_chunks(args, threads) if target.is_cuda else _cpu_chunks(args)

    tokens, accepted, nonfinite, *lp = ext.verify_chain(
        target,
        args.draft_tokens,
        args.draft,
        args.draft_mode,
        args.num_draft_tokens,
        *_sampling_args(args, logprobs, has_filter),
        int(num_chunks),
        int(threads),
        _stream(target),
        args.token_bitmask,  # applied natively by both builds
        int(logprobs),
        bool(block),
    )
    return VerifyOutput(tokens, accepted, nonfinite, logprobs=lp[0] if lp else None)


def run_tree(ext, args, threads: int = 256, logprobs: bool | int = False):
    """Call ``ext.verify_tree`` (CPU core or CUDA extension) on checked TreeArgs. logprobs (as for
    :func:`run_chain`): the output's ``logprobs`` (return_logprobs) of the accepted path from the row
    statistics, no post-pass."""
    tokens, accepted, nodes, nonfinite, *lp = ext.verify_tree(
        args.target,
        args.tokens,
        args.parents,
        args.draft,
        args.draft_mode,
        args.num_nodes,
        *_sampling_args(args, logprobs),
        METHODS[args.method],
        int(args.max_depth),
        int(threads),
        _stream(args.target),
        args.token_bitmask,
        int(logprobs),
    )
    return TreeVerifyOutput(tokens, accepted, nodes, nonfinite, logprobs=lp[0] if lp else None)


def _require_cuda_tensors(target: torch.Tensor) -> None:
    if not torch.cuda.is_available():
        load_cuda_extension()  # raises: no GPU, and how to build
    if not target.is_cuda:
        raise RuntimeError(
            f"backend='cuda' needs CUDA tensors, got target_logits on {target.device}. "
            "Move the inputs to the GPU or use backend='triton' / 'torch'."
        )


def cuda_native_logprobs(args) -> bool:
    """Whether the CUDA kernels can write return_logprobs for this call: not with the "by_index" top-p
    tie rule, which the CUDA build does not implement (it scores greedy rows with top-p too, so the
    logprobs post-pass of ``ops/logprobs.py`` scores such calls instead)."""
    return args.sampling.top_p_ties != "by_index"


def verify_chain(
    args: VerifyArgs, num_chunks: int | None = None, logprobs: bool = False, method: str = "token"
) -> VerifyOutput:
    """backend='cuda' for ``sk.verify``; logprobs: return_logprobs computed by the kernels (``run_chain``)
    where :func:`cuda_native_logprobs` allows it, else ``out.logprobs`` stays None for the post-pass;
    method: "token" or "block" (block verification, ``csrc/verify_block.h``)."""
    _require_cuda_tensors(args.target_logits)
    native = logprobs and cuda_native_logprobs(args)
    return run_chain(load_cuda_extension(), args, num_chunks, logprobs=native, block=method == "block")


def verify_tree(args, logprobs: bool = False):
    """backend='cuda' for ``sk.verify_tree`` / ``sk.verify_multi`` (checked TreeArgs); logprobs: as for
    :func:`verify_chain`, for the accepted path."""
    _require_cuda_tensors(args.target)
    return run_tree(load_cuda_extension(), args, logprobs=logprobs and cuda_native_logprobs(args))


def _require_cpu_tensors(target: torch.Tensor) -> None:
    if not target.is_cpu:  # (is_cpu: cheaper than device.type; this runs on every call)
        raise RuntimeError(f"backend='cpu' needs CPU tensors, got target_logits on {target.device}")


def verify_chain_cpu(
    args: VerifyArgs, num_chunks: int | None = None, logprobs: bool = False, method: str = "token"
) -> VerifyOutput:
    """backend='cpu' for ``sk.verify``; logprobs: return_logprobs computed natively (``run_chain``);
    method: "token" or "block" (block verification in the same row pass, ``csrc/verify_block.h``)."""
    _require_cpu_tensors(args.target_logits)
    return run_chain(load_cpu_core(), args, num_chunks, logprobs=logprobs, block=method == "block")


def verify_tree_cpu(args, logprobs: bool = False) -> TreeVerifyOutput:
    """backend='cpu' for ``sk.verify_tree`` / ``sk.verify_multi``; logprobs: return_logprobs of the
    accepted path computed natively (``run_tree``)."""
    _require_cpu_tensors(args.target)
    return run_tree(load_cpu_core(), args, logprobs=logprobs)
