"""Native fp32 linear layers for CPU inference: a target's forward at the machine's read bandwidth.

Why this exists. A decoding step of an fp32 model on a CPU streams every weight once; a verification
step does the same for a few more rows. oneDNN's inner product (``cpu_linear.OneDnnLinear``) reads
them at ~70% of what a plain stream gets on the 2-core AMD EPYC (AVX-512, 1 thread), and its row
blocking makes 9 rows cost ~1.4x one. The native kernel (``csrc/f32_linear.cpp``, in the native CPU
build) packs the weight in panels of 16 output rows and feeds each 64-byte weight load to one FMA
per input row: memory-bound up to ~8 rows, then the FMA port's limit. CPUs without AVX-512 run an
AVX2 path (two 8-lane vectors a panel row; on a Zen 3 EPYC, 1 thread, 2.1-2.4x oneDNN's speed at one
row and 1.3-1.7x at 4-9). Measured side by side per layer and for the Qwen2.5-Coder 1.5B target's
forward: docs/performance.md.

Results. Each output is the sum over the inputs *in order* (one fused multiply-add each) plus the
bias, whatever the number of rows, the thread split or the path (AVX-512, AVX2 or the portable loop): a row
of a multi-row forward is bit-identical to the same row alone, so a verification forward scores a
token exactly as the one-token forward of ``generate`` does (oneDNN does not promise that). Against
``nn.Linear`` the results agree to rounding, not bit for bit (another summation order).

:func:`use_native_linears` swaps a model's fp32 ``nn.Linear`` layers for :class:`NativeLinear`, in
place; inference only, CPU. Apply it to every model a comparison runs (a baseline ``generate`` gets
the same speed-up), as with ``use_onednn_linears``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.csrc import cpu_backend_ready, cpu_failure, load_cpu_core
from .layer_swap import swap_children

__all__ = ["F32_PANEL", "NativeLinear", "native_linear_available", "pack_f32", "unpack_f32", "use_native_linears"]

F32_PANEL = 16  # output rows a packed panel interleaves (csrc/f32_linear.cpp: PANEL, one vector's lanes)


def native_linear_available() -> bool:
    """Whether the native fp32 linear runs fast here: the native CPU build loads (compiling it on first
    use) and this CPU has its AVX-512 or AVX2 path (the portable loop is for checking, not for speed)."""
    return cpu_backend_ready() and bool(load_cpu_core().f32_linear_fast_path())


@torch.no_grad()
def pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """[P, 16 K] fp32: ``weight`` [N, K] in the native kernel's panels, P = ceil(N / 16). Panel p is
    [K][16]: for each input k the weights of output rows 16 p .. 16 p + 15 (zero past N).
    :func:`unpack_f32` inverts it."""
    N, K = weight.shape
    P = -(-N // F32_PANEL)
    full = torch.zeros(P * F32_PANEL, K, dtype=torch.float32)
    full[:N] = weight.detach()
    return full.reshape(P, F32_PANEL, K).transpose(1, 2).reshape(P, K * F32_PANEL).contiguous()


def unpack_f32(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """The weight [N, K] of :func:`pack_f32`'s panels (a copy)."""
    P = packed.shape[0]
    return packed.reshape(P, K, F32_PANEL).transpose(1, 2).reshape(P * F32_PANEL, K)[:N].clone()


class NativeLinear(nn.Module):
    """``y = x @ W^T + b`` by the native fp32 kernel on a weight packed once (module docstring).

    Made from an fp32 CPU ``nn.Linear`` (:meth:`from_linear`); the packed weight replaces the original
    (a buffer, not a parameter: inference only). Inputs: any shape ``[..., in_features]`` and strides,
    fp32, on the CPU. Output ``[..., out_features]`` fp32.
    """

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", packed, persistent=False)  # [ceil(out / 16), 16 in] fp32 panels
        self.bias = bias  # [out_features] or None: the original Parameter, shared
        self._bias = None if bias is None else bias.detach().contiguous()

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Module) -> NativeLinear:
        weight = linear.weight.detach()
        bias = linear.bias
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError(f"NativeLinear needs a CPU fp32 weight, got {weight.dtype} on {weight.device}")
        if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"):
            raise ValueError(f"NativeLinear needs a CPU fp32 bias, got {bias.dtype} on {bias.device}")
        if not cpu_backend_ready():
            raise ValueError(f"NativeLinear: the native CPU build does not load ({cpu_failure()})")
        N, K = weight.shape
        return cls(pack_f32(weight), bias, K, N)

    @property
    def weight(self) -> torch.Tensor:
        """The weight as a plain ``[out_features, in_features]`` tensor, unpacked on each access (a copy:
        for code that inspects an output layer's shape or dtype, not for the hot path)."""
        return unpack_f32(self.packed, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"NativeLinear: input's last dimension is {x.shape[-1]}, expected {self.in_features}")
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"NativeLinear: input must be fp32 on the CPU, got {x.dtype} on {x.device}")
        lead = x.shape[:-1]
        rows = x.reshape(lead.numel(), self.in_features).contiguous()  # (-1 is ambiguous at 0 inputs)
        y = load_cpu_core().f32_linear(rows, self.packed, self._bias, self.out_features)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_native_linears(model: nn.Module) -> int:
    """Replace every fp32 CPU ``nn.Linear`` of ``model`` with a :class:`NativeLinear`, in place.

    Returns how many were replaced: 0 where the kernel has no fast path here (no native build, no
    AVX-512: keep ``use_onednn_linears``) or nothing is an fp32 CPU layer (bf16 layers are left as
    they are: combine with ``use_onednn_linears`` for them). Inference only: the packed weights are
    not parameters, so ``state_dict()``, ``.to(device)`` and training no longer see them. A tied output
    layer gets its own packed copy (the input embedding keeps the original weight).

    Example::

        target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        use_native_linears(target)  # on CPU: the fp32 weights streamed at the read bandwidth
    """
    if not native_linear_available():
        return 0
    return swap_children(model, lambda _name, layer: NativeLinear.from_linear(layer) if _plain_fp32(layer) else None)


def _plain_fp32(layer: nn.Module) -> bool:
    """Exactly an fp32 nn.Linear on the CPU (a subclass may change forward, quantised or LoRA, and must
    keep it; OneDnnLinear / NativeLinear layers stay as they are)."""
    fp32 = torch.float32
    if type(layer) is not nn.Linear or layer.weight.device.type != "cpu":
        return False
    return layer.weight.dtype == fp32 and (layer.bias is None or layer.bias.dtype == fp32)
