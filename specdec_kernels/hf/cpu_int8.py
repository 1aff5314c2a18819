"""Int8 linear layers for a CPU *draft* model: cheaper draft forwards, the same exact output law.

Why this exists. On a CPU a decoding forward streams the model's weights from memory, and the draft's
forwards are about half of a speculative step (the 0.5B bf16 draft of the Qwen2.5-Coder pair drafts
4-8 tokens a step, at ~0.2 of the 1.5B target's forward each). Int8 weights halve the bytes. PyTorch
ships a fast kernel for them, fbgemm's dynamic-quantised linear (``torch.ops.quantized``): it
quantises each call's input to uint8 (one scale and zero point over the call's rows) and multiplies
on int8 weights packed once, with one int8 scale per output row. On the 2-core AMD EPYC (AVX-512 VNNI,
torch 2.13, 1 thread), with the weights streamed from memory (24 layers in turn): 896 x 4864 took
0.31 ms against 0.52 for oneDNN bf16 on packed weights, 4864 x 896 0.25-0.29 against 0.53, at 1
and at 4 rows alike. The 0.5B draft's one-token forward (256 cached tokens, CPU time): 84 ms in bf16
with oneDNN linears, 59 ms with int8 linears and the rest in bf16, **42 ms with int8 linears and the
rest in fp32** (the layer computes in fp32; bf16 norms and attention cost more in conversions than
they save on a CPU without native bf16 math). So quantise an fp32 draft.

The native kernel (``kernel="native"``, the default where the native CPU build loads and runs one of
its SIMD paths, AVX-512 VNNI or AVX2; ``csrc/int8_linear.cpp``). fbgemm streamed those weights at
10-19 GB/s of the machine's ~26 GB/s (a one-thread sum): short rows (896 inputs) cost it most. Ours
keeps 16 output rows interleaved in a panel, so each 64-byte load is four inputs of 16 rows and
feeds one vpdpbusd per input row with no horizontal sums; the input is quantised per row (as fbgemm
per call: at one row alike). Same machine, weights streamed, ms (ours / fbgemm), 1 row: 896 x 896
0.043-0.049 / 0.074-0.080, 4864 x 896 0.22 / 0.28, 896 x 4864 0.19-0.21 / 0.23-0.24, the 151,936 x
896 output layer 6.1-6.4 / 7.5-8.8; at 4 rows 1.1-1.5x faster too. The whole 0.5B draft's forward
(300 cached tokens, median of 25 interleaved, CPU time): 35.9 / 41.9 ms at one query, 42.3 / 48.4 at
two, 47.7 / 51.2 at four.

Exactness. A speculative decoder's output law is the target's whatever the draft proposes, as long
as the verifier is told the law the drafts were drawn from; the driver samples drafts from the
logits of the draft forward it hands the verifier, so an int8 draft stays exact. What changes is how
often drafts are accepted: on the pair above, teacher-forced, the int8 draft's top-1 token agreed with
the target's as often as the bf16 draft's on code (0.716 vs 0.714) and a little less on prose
(0.640 vs 0.690). Two consequences of fbgemm's per-call activation scale: a row's logits depend
slightly on the other rows of the same forward (a batch's requests, a tree's frontier), and so does
a seeded sampled draft; the output law does not (the native kernel's rows are independent). Apply
this to drafts, not to a target whose law users asked for: an int8 target is another model.

:func:`use_int8_linears` swaps a model's linear layers (``nn.Linear`` or :class:`OneDnnLinear`) for
:class:`Int8Linear` in place; inference only, CPU, fp32 or bf16 models (the layer computes in fp32
and returns the input's dtype).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
from torch import nn

from ..ops.csrc import cpu_backend_ready, cpu_failure, load_cpu_core
from .cpu_linear import _DTYPES, replace_cpu_linears

__all__ = ["INT8_KEEP", "Int8Linear", "int8_linear_available", "pack_int8", "unpack_int8", "use_int8_linears"]

# fbgemm-backed quantised engines, in order of preference ("x86" picks fbgemm or oneDNN per shape)
_ENGINES = ("x86", "fbgemm")
# Layers left in their dtype by default: none. Measured on the Qwen2.5-Coder pair (teacher-forced
# top-1 agreement with the target, 500 tokens): quantising the output layer too changed it by < 0.01
# on code and prose and saves its ~8 ms of a 57 ms forward; keeping the MLP's down projection in bf16
# recovers 0.02-0.03 on prose for ~5 ms (``use_int8_linears(model, keep=("down_proj",))``).
INT8_KEEP: tuple[str, ...] = ()
INT8_MAX = 127  # symmetric int8 weights: q in [-127, 127], scale = max |w| / 127 per output row
# the native kernel's int32 sums are exact while in_features * 255 * 127 < 2^31 (csrc: MAX_K)
INT8_MAX_K = (1 << 31) // (255 * INT8_MAX)
INT8_PANEL = 16  # output rows a packed panel interleaves (csrc/int8_linear.cpp: PANEL, one vector's lanes)


def _engine() -> str | None:
    supported = torch.backends.quantized.supported_engines
    return next((e for e in _ENGINES if e in supported), None)


def int8_linear_available() -> bool:
    """Whether an int8 kernel is available here: the native CPU build's or PyTorch's fbgemm (x86-64 wheels)."""
    return _fbgemm_available() or native_int8_available()


@contextlib.contextmanager
def _quantized_engine(name: str):
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def native_int8_available() -> bool:
    """Whether the native CPU build (which holds our int8 kernel) loads here (compiling it on first use)."""
    return cpu_backend_ready()


def _row_scales(w: torch.Tensor) -> torch.Tensor:
    """[N] fp32: each output row's symmetric int8 scale max |w| / 127 (a tiny positive one for an
    all-zero or empty row, so that q = round(w / s) stays 0)."""
    amax = w.abs().amax(dim=1) if w.shape[1] else w.new_zeros(w.shape[0])
    return (amax / INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)


@torch.no_grad()
def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(wq [P, 16 Kp] int8, sw [16 P] fp32, wsum [16 P] int32): ``weight`` [N, K] in the native
    kernel's layout (``csrc/int8_linear.cpp``), P = ceil(N / 16), Kp = K rounded up to 4.

    Per output row: scale s = max |w| / 127, q = round(w / s) in [-127, 127], wsum = the row's sum of
    q. Rows are interleaved in panels of 16: panel p is [Kp / 4][16][4] (four inputs of each of its
    rows a 64-byte vector); padding rows and inputs are zero. :func:`unpack_int8` inverts it."""
    N, K = weight.shape
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("pack_int8: the weight has NaN or infinite entries")
    scale = _row_scales(w)
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    P, Kp = -(-N // INT8_PANEL), -(-K // 4) * 4
    full = torch.zeros(P * INT8_PANEL, Kp, dtype=torch.int8)
    full[:N, :K] = q
    wq = full.reshape(P, INT8_PANEL, Kp // 4, 4).permute(0, 2, 1, 3).reshape(P, Kp * INT8_PANEL).contiguous()
    sw = torch.zeros(P * INT8_PANEL)
    sw[:N] = scale
    wsum = torch.zeros(P * INT8_PANEL, dtype=torch.int32)
    wsum[:N] = q.sum(dim=1, dtype=torch.int32)
    return wq, sw, wsum


def unpack_int8(wq: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """The int8 values [N, K] of :func:`pack_int8`'s panels."""
    P, Kp = wq.shape[0], wq.shape[1] // INT8_PANEL
    return wq.reshape(P, Kp // 4, INT8_PANEL, 4).permute(0, 2, 1, 3).reshape(P * INT8_PANEL, Kp)[:N, :K]


class Int8Linear(nn.Module):
    """``y = x @ W^T + b`` on int8 weights (one fp32 scale per output row, symmetric) and the input
    quantised per call to uint8 with a zero point; int32 sums, fp32 scaling.

    Two kernels (``kernel``): "native" (``csrc/int8_linear.cpp``, in the native CPU build: the input
    quantised per *row*, so a row's output does not depend on the call's other rows; 1.2-1.7x faster
    than fbgemm at 1-4 rows, module docstring) and "fbgemm" (PyTorch's dynamic-quantised linear: one
    scale over the call's rows). At one row the two quantise the input alike. Made from an
    ``nn.Linear`` or an :class:`OneDnnLinear` (:meth:`from_linear`; default: native where the build
    loads and runs a SIMD path). Inputs: any shape ``[..., in_features]`` and strides, fp32 or bf16,
    on the CPU; the output has the input's dtype.
    """

    def __init__(self, kernel: str, weights: tuple, scales: torch.Tensor, bias, in_features: int, out_features: int):
        super().__init__()
        self.kernel = kernel
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("scales", scales, persistent=False)  # [out_features] fp32
        self.bias = bias  # [out_features] or None: the original's, as given
        self._bias32 = None if bias is None else bias.detach().float().contiguous()
        self.packed = None  # fbgemm: its packed int8 weight and fp32 bias (an opaque object)
        self.reduce_range = kernel == "fbgemm" and not _fbgemm_sums_exact()  # fbgemm: 7-bit inputs (see forward)
        if kernel == "fbgemm":
            (self.packed,) = weights
        else:  # native: pack_int8's panels [P, 16 Kp] int8, scales and row sums [16 P]
            wq, sw, wsum = weights
            self.register_buffer("wq", wq, persistent=False)
            self.register_buffer("sw", sw, persistent=False)
            self.register_buffer("wsum", wsum, persistent=False)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Module, kernel: str | None = None) -> Int8Linear:
        """``kernel``: "native", "fbgemm" or None (see :func:`_pick_kernel`)."""
        kernel = _pick_kernel(kernel)
        weight = linear.weight.detach()  # [out, in] (OneDnnLinear: an unpacked copy)
        if weight.device.type != "cpu" or weight.dtype not in _DTYPES:
            raise ValueError(f"Int8Linear needs a CPU fp32/bf16 weight, got {weight.dtype} on {weight.device}")
        w = weight.float()
        N, K = w.shape
        if kernel == "native":
            if K > INT8_MAX_K:
                raise ValueError(f"Int8Linear: the native kernel takes <= {INT8_MAX_K} inputs, got {K} (fbgemm's does)")
            wq, sw, wsum = pack_int8(w)
            return cls(kernel, (wq, sw, wsum), sw[:N], linear.bias, K, N)  # scales: a view of the panels' own
        scales = _row_scales(w)
        zero = torch.zeros(N, dtype=torch.long)
        with warnings.catch_warnings():  # quantised tensor creation is deprecated; the packed weight is what we keep
            warnings.filterwarnings("ignore", message=".*quantize_per_channel.*", category=UserWarning)
            qweight = torch.quantize_per_channel(w, scales.double(), zero, 0, torch.qint8)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        with _quantized_engine(_engine()):
            packed = torch.ops.quantized.linear_prepack(qweight, bias)
        return cls(kernel, (packed,), scales, linear.bias, K, N)

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weight dequantised, ``[out_features, in_features]`` fp32 (a copy: for code that
        inspects or restricts an output layer, not for the hot path)."""
        if self.kernel == "native":
            return unpack_int8(self.wq, self.out_features, self.in_features).float() * self.scales[:, None]
        qweight, _bias = torch.ops.quantized.linear_unpack(self.packed)
        return qweight.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Int8Linear: input's last dimension is {x.shape[-1]}, expected {self.in_features}")
        lead = x.shape[:-1]
        rows = x.reshape(lead.numel(), self.in_features).float().contiguous()  # (-1 is ambiguous at 0 inputs)
        if self.kernel == "native":
            y = load_cpu_core().w8a8_linear(rows, self.wq, self.sw, self.wsum, self._bias32, self.out_features)
            return y.to(x.dtype).reshape(*lead, self.out_features)
        if rows.shape[0] == 0:
            return x.new_zeros(*lead, self.out_features)
        # reduce_range: where fbgemm has VNNI its int32 sums are exact over the full uint8 range; on
        # other CPUs (AVX2, AVX-512 without VNNI) its vpmaddubsw adds pairs of products in saturating
        # int16 (2 x 255 x 127 overflows), so there it quantises the input to 7 bits (0..127) instead.
        # (Measured on a Zen 3 EPYC without VNNI, full range: 61% of a test layer's outputs off its
        # exact emulation by up to 30x, and a draft's greedy acceptance 0.17 against 0.5 or more.)
        # The op's one overload, called directly: the packet's per-call scan of its arguments for
        # Python-dispatched objects cost ~7 us a call (measured on the 0.5B draft's one-token
        # forward of ~40 ms: 0.3-1.2 ms less, bit-identical outputs).
        y = torch.ops.quantized.linear_dynamic.default(rows, self.packed, self.reduce_range)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}, kernel={self.kernel}"


@functools.cache
def _fbgemm_sums_exact() -> bool:
    """Whether fbgemm's int8 sums are exact over the full uint8 input range here: the CPU has AVX-512
    VNNI (read from /proc/cpuinfo's flags; elsewhere assumed not, the safe side)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "avx512_vnni" in line.split() for line in f)
    except OSError:
        return False


def _fbgemm_available() -> bool:
    quantized = getattr(torch.ops, "quantized", None)
    ops = ("linear_dynamic", "linear_prepack", "linear_unpack")
    return _engine() is not None and hasattr(torch, "quantize_per_channel") and all(hasattr(quantized, o) for o in ops)


def _pick_kernel(kernel: str | None) -> str:
    if kernel not in (None, "native", "fbgemm"):
        raise ValueError(f"Int8Linear: kernel must be 'native', 'fbgemm' or None, got {kernel!r}")
    if kernel is None:  # native where its SIMD path runs; else fbgemm's where it exists; else native's loop
        native = native_int8_available()
        fast = native and bool(load_cpu_core().w8a8_fast_path())
        kernel = "native" if fast or (native and not _fbgemm_available()) else "fbgemm"
    if kernel == "native" and not native_int8_available():
        raise ValueError(f"Int8Linear: kernel='native': the native CPU build does not load ({cpu_failure()})")
    if kernel == "fbgemm" and not _fbgemm_available():
        raise ValueError("Int8Linear: kernel='fbgemm' needs PyTorch's fbgemm int8 linear (torch.ops.quantized, x86-64)")
    return kernel


def use_int8_linears(model: nn.Module, keep: tuple[str, ...] | list[str] = INT8_KEEP, kernel: str | None = None) -> int:
    """Replace the linear layers (``nn.Linear``, :class:`OneDnnLinear`) of a CPU fp32/bf16 *draft*
    ``model`` with :class:`Int8Linear`, in place, except those whose qualified name contains one of
    ``keep`` (e.g. ``("down_proj",)``). Returns how many were replaced. ``kernel``: see
    :class:`Int8Linear` (None: native where the native CPU build runs a SIMD path, else fbgemm).

    Raises ``ValueError`` when no int8 kernel (or not the one asked for) is available here (asked for
    and not possible is an error, not a silent no-op). Layers on a GPU or in other dtypes are left as
    they are. Inference only: the packed weights are not parameters. Use it on the draft: the output
    law stays the target's (module docstring); on a target it would change the model.

    Example::

        draft = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        use_int8_linears(draft)  # ~2x cheaper draft forwards on CPU than a bf16 draft
        speculative_generate(target, draft, input_ids, ...)
    """
    if not int8_linear_available():
        raise ValueError("use_int8_linears: no int8 kernel here (neither the native CPU build nor fbgemm's)")
    if isinstance(keep, str):
        raise ValueError(f"use_int8_linears: keep must be a list of name parts, got the string {keep!r}")
    kernel = _pick_kernel(kernel)
    return replace_cpu_linears(model, keep, lambda linear: Int8Linear.from_linear(linear, kernel))
