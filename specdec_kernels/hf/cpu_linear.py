"""oneDNN linear layers for CPU inference: multi-token forwards at about the cost of one token.

Why this exists. Speculative decoding pays when the target's forward over the g + 1 tokens of a
verification step costs about what a one-token decoding step costs: the weights are read once
either way, and reading them is what a decoding step spends its time on. PyTorch's CPU
``nn.Linear`` in fp32 calls MKL's ``sgemm``, which on some CPUs (measured: a 2-core AMD EPYC with
AVX-512) leaves that regime for a handful of rows: a 1536 x 8960 layer took 3.0 ms at 1 row,
6.5 ms at 2 rows and 10.0 ms at 3, so a 1.5B target's 2-, 3- and 4-token forwards cost 2.3x, 3.1x
and 2.8x its one-token forward and short drafts could never pay. oneDNN's inner-product kernel on
pre-packed weights, which PyTorch ships (``torch.ops.mkldnn``), keeps 1 to 9 rows near one weight
read: 1.4-1.8 ms for the same layer, and 263-318 ms for the whole 1.5B target at 1-9 tokens
against 382-918 ms with MKL (bench/bench_e2e.py's README row has the end-to-end numbers). On
another machine of that kind its 1- to 3-row kernels were the slow ones (``MIN_ROWS``): such inputs
are padded to 4 rows, so one token costs what 4 do (``bench/bench_forward_rows.py`` measures a
model's forward by rows).

:func:`use_onednn_linears` swaps a model's ``nn.Linear`` modules for :class:`OneDnnLinear` in place.
Use it for *inference only* (there is no backward through the packed weight), on CPU models in
fp32 or bf16, and apply it to every model a comparison runs (a baseline ``target.generate`` gets
the same speed-up for its one-token steps). Results agree with ``nn.Linear`` to rounding, not bit
for bit: oneDNN sums in another order, as MKL itself does between 1 and 5 rows.
"""

from __future__ import annotations

import torch
from torch import nn

from .cpu_f32 import NativeLinear, use_native_linears
from .layer_swap import swap_children

__all__ = ["CPU_LINEARS", "OneDnnLinear", "onednn_linear_available", "use_cpu_linears", "use_onednn_linears"]

_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN's inner product picks its kernel by the number of rows, and below 4 rows it picks worse ones:
# on the 2-core AMD EPYC (AVX-512, torch 2.13, 1 thread) an fp32 1536 x 151,936 output layer took
# 62 / 66 / 49 / 43 ms at 1 / 2 / 3 / 4 rows and a 1536 x 8960 one 4.2 / 4.4 / 2.9 / 2.7 ms (4 rows
# read the weight once, at copy speed), and a bf16 layer *with a bias* took 158 ms at 1 row against
# 0.26 at 4 (896 x 4864: a reference path). So inputs of 1 to 3 rows are padded with zero rows to 4
# (the padding is never read back): the Qwen2.5-Coder 1.5B fp32 target's one-token forward went from
# 455-525 ms to 346 ms, the 0.5B bf16 draft's from 88-96 to 90 (its 4-row forward: 79).
MIN_ROWS = 4


def onednn_linear_available() -> bool:
    """Whether this PyTorch build has oneDNN's linear ops (x86-64 and aarch64 wheels do)."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def _onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 linears on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: on an
    AVX2-only CPU such as a Zen 3 EPYC its weight reorder raises)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


def _onednn_takes(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _onednn_bf16())


class OneDnnLinear(nn.Module):
    """``y = x @ W^T + b`` by oneDNN on a weight packed once into its blocked layout.

    Made from an ``nn.Linear`` (:meth:`from_linear`); the packed weight replaces the original
    (an opaque oneDNN tensor, not a parameter: this module is for inference). Inputs: any shape
    ``[..., in_features]`` and strides, the weight's dtype, on the CPU. Output ``[..., out_features]``.
    """

    def __init__(self, packed_weight: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.packed_weight = packed_weight  # [out_features, in_features], oneDNN's blocked layout
        self.bias = bias  # [out_features] or None: the original Parameter, shared

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> OneDnnLinear:
        weight = linear.weight.detach()
        if weight.device.type != "cpu" or weight.dtype not in _DTYPES:
            raise ValueError(f"OneDnnLinear needs a CPU fp32/bf16 weight, got {weight.dtype} on {weight.device}")
        if not _onednn_takes(weight.dtype):
            raise ValueError("OneDnnLinear: oneDNN has no bf16 linear on this CPU (it needs AVX-512 or AVX-NE-CONVERT)")
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        return cls(packed, linear.bias, linear.in_features, linear.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """The weight as a plain ``[out_features, in_features]`` tensor, unpacked on each access (a copy:
        for code that inspects an output layer's shape or dtype, not for the hot path)."""
        return self.packed_weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"OneDnnLinear: input's last dimension is {x.shape[-1]}, expected {self.in_features}")
        rows = x.numel() // self.in_features
        if 0 < rows < MIN_ROWS:  # see MIN_ROWS: a 4-row call costs less than a 1-row one
            flat = x.reshape(rows, self.in_features)
            padded = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, self.in_features)])
            y = self._linear(padded)[:rows]
            return y.reshape(*x.shape[:-1], self.out_features)
        return self._linear(x)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_onednn_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of a CPU fp32/bf16 ``model`` with an :class:`OneDnnLinear`, in place.

    Returns how many were replaced (0 when this PyTorch has no oneDNN, or the model is on a GPU or
    in another dtype, or bf16 on a CPU where oneDNN has no bf16 linear: nothing to gain there, and
    those layers are left as they were). Inference only: the packed weights are not parameters, so
    ``state_dict()``, ``.to(device)`` and training no longer see them (save or move the model before
    the swap). A tied output layer gets its own packed copy (the input embedding keeps the original
    weight).

    Example::

        target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        use_onednn_linears(target)  # on CPU: multi-token forwards at about one token's cost
    """
    if not onednn_linear_available():
        return 0

    def replacement(_name: str, child: nn.Module):
        # exactly nn.Linear: a subclass may change forward (quantised, LoRA) and must keep it
        if type(child) is nn.Linear and child.weight.device.type == "cpu" and _onednn_takes(child.weight.dtype):
            return OneDnnLinear.from_linear(child)
        return None

    return swap_children(model, replacement)


# The CPU linear kernels a run may pick (bench --cpu-linear, specdec generate --cpu-linear):
# "native": the fp32 layers by our kernel (cpu_f32.NativeLinear), the others (bf16) by oneDNN;
# "onednn": every fp32/bf16 layer by oneDNN; "torch": PyTorch's own (MKL in fp32).
CPU_LINEARS = ("native", "onednn", "torch")


def use_cpu_linears(model: nn.Module, kind: str) -> tuple[int, int]:
    """Swap ``model``'s CPU linear layers for the kernels ``kind`` names (:data:`CPU_LINEARS`), in place.
    Returns (layers on the native fp32 kernel, layers on oneDNN). "native" where the native kernel has
    no fast path here (no native build, no AVX-512) is oneDNN for every layer (first return value 0)."""
    if kind not in CPU_LINEARS:
        raise ValueError(f"cpu linear kind must be one of {CPU_LINEARS}, got {kind!r}")
    native = 0
    if kind == "native":
        native = use_native_linears(model)
    onednn = use_onednn_linears(model) if kind in ("native", "onednn") else 0
    return native, onednn


def replace_cpu_linears(model: nn.Module, keep, make, takes=lambda layer: True) -> int:
    """The walk of the quantised-draft swaps (``use_int8_linears``, ``use_int4_linears``): replace each
    ``nn.Linear`` / :class:`OneDnnLinear` / ``cpu_f32.NativeLinear`` of ``model`` whose qualified name
    contains no part of ``keep``, that is a CPU fp32/bf16 layer and that ``takes`` accepts, by
    ``make(layer)``, in place. Returns how many were replaced."""

    def replacement(full: str, child: nn.Module):
        if type(child) not in (nn.Linear, OneDnnLinear, NativeLinear) or any(part in full for part in keep):
            return None
        # OneDnnLinear / NativeLinear are CPU fp32/bf16 layers by construction; an nn.Linear may be neither
        if type(child) is nn.Linear and (child.weight.device.type != "cpu" or child.weight.dtype not in _DTYPES):
            return None
        return make(child) if takes(child) else None

    return swap_children(model, replacement)
