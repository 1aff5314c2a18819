"""Running the Triton kernels without a GPU.

Without CUDA the kernels run in Triton's interpreter, which executes each program instance in
NumPy. Two things must happen before the first ``@triton.jit`` decorator runs:

* ``TRITON_INTERPRET=1`` must be set (we set it only when CUDA is absent and the user has not
  chosen), and
* the interpreter's per-call cost must be tamed: it re-patches ``triton.language`` on *every*
  device-function call (``tl.max``, ``tl.sum`` and ``tl.philox`` are device functions), about a
  millisecond each, which made our statistical tests (20,000+ samples) take tens of minutes.
  Once the language is patched for the running kernel, patching again is a no-op, so we skip it.

When something imported ``triton.language`` before we could set the variable (``transformers``
and ``torch`` do, through their own Triton kernels), Triton's library functions (``tl.zeros``,
``tl.max``, ``tl.sum``...) were built for the compiler and raise "Cannot call @triton.jit'd outside
of the scope of a kernel" inside the interpreter; we rebuild them as interpreter functions.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_triton_device(device, what: str) -> None:
    """ValueError unless the Triton kernels of ``what`` can run on ``device``: CUDA tensors, or any
    tensors while the interpreter is on (no CUDA, or TRITON_INTERPRET=1 set before the import).
    Without it a CPU tensor on a machine with a GPU reached the compiled launcher and failed there."""
    if device.type == "cuda" or interpreter_requested() or planned_as_gpu():
        return
    raise ValueError(
        f"{what}: the Triton kernels need CUDA tensors, got {device.type} tensors. On {device.type} tensors "
        "they run only in Triton's interpreter, which is off because this machine has CUDA (set "
        "TRITON_INTERPRET=1 before importing specdec_kernels to force it). Move the tensors to CUDA, or "
        "use backend='auto', 'cpu' or 'vectorized'."
    )


# Set by ``plan_as_gpu``: the launch plans are made as on a GPU with this many SMs.
_PLAN_AS_GPU: contextvars.ContextVar[int | None] = contextvars.ContextVar("specdec_plan_as_gpu", default=None)


@contextlib.contextmanager
def plan_as_gpu(sms: int = 132):
    """Make the launchers plan their grids and tiles as for a GPU with ``sms`` multiprocessors,
    whatever the tensors' device (the static performance model, bench/bench_static.py, captures
    these launches and compiles them for sm_90 without a GPU). Nothing must *run* inside."""
    token = _PLAN_AS_GPU.set(int(sms))
    try:
        yield
    finally:
        _PLAN_AS_GPU.reset(token)


def planned_as_gpu() -> bool:
    """Whether ``plan_as_gpu`` is active: launchers take the path a CUDA call takes."""
    return _PLAN_AS_GPU.get() is not None


def plans_for_interpreter(device) -> bool:
    """Whether launches on `device` get the interpreter's plan (big tiles, no vocabulary split)."""
    if planned_as_gpu():
        return False
    return interpreter_requested() or device.type != "cuda"


def multiprocessors(device) -> int:
    """SM count the launch plans fill (the device's, or the one ``plan_as_gpu`` sets)."""
    sms = _PLAN_AS_GPU.get()
    if sms is not None:
        return sms
    import torch

    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


@functools.cache
def _sm_count(index: int) -> int:
    """The SM count of CUDA device `index`, asked once per process (each launch plan wants it: two
    property lookups a call were ~15 us of the ~450 us host time of an eager call on the H200)."""
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def use_interpreter_without_cuda() -> bool:
    """Set TRITON_INTERPRET=1 when CUDA is absent (and the user did not decide); return the mode."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    if interpreter_requested():
        _interpret_preimported_language()
        _skip_redundant_language_patching()
        return True
    return False


def _interpret_preimported_language() -> None:
    """Swap compiler-mode ``@triton.jit`` functions of an already imported ``triton.language`` for
    interpreter ones (what the import would have built had TRITON_INTERPRET been set first)."""
    import sys

    if "triton.language" not in sys.modules:
        return
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return
    swapped: dict[int, object] = {}  # one replacement per function, however many modules re-export it
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in swapped:
                    swapped[id(value)] = InterpretedFunction(
                        value.fn,
                        version=value.version,
                        do_not_specialize=value.do_not_specialize,
                        do_not_specialize_on_alignment=value.do_not_specialize_on_alignment,
                        debug=getattr(value, "debug", None),
                        noinline=value.noinline,
                        launch_metadata=value.launch_metadata,
                    )
                setattr(module, attr, swapped[id(value)])


_PATCHED = False


def _skip_redundant_language_patching() -> None:
    global _PATCHED
    if _PATCHED:
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # no triton: nothing to speed up
        return
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None:  # interpreter internals changed: stay correct, slow
        return

    def already_patched(fn) -> bool:
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        return bool(langs) and all(not tl.core.is_builtin(getattr(lang, "program_id", None)) for lang in langs)

    def patch_lang_once(fn):
        if already_patched(fn):
            return scope_type()  # nothing to restore: the enclosing launch owns the patch
        return original(fn)

    interpreter._patch_lang = patch_lang_once
    _PATCHED = True
