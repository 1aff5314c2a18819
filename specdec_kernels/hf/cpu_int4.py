"""Int4 linear layers for a CPU *draft* model: a cheaper one-query draft forward than int8, the same output law.

Why this exists. On a CPU a decoding draft forward streams the draft's weights from memory, and with
the int8 layers of :mod:`.cpu_int8` those linears were still ~25 of the 0.5B Qwen2.5-Coder draft's
~40 ms a token (1 thread, the 2-core AMD EPYC), at ~14-20 GB/s. Int4 weights halve the bytes again.
PyTorch 2.13's CPU int4 / int8 weight-only kernels are 30-80x slower than fbgemm at 1-4 rows, so the
layer runs our own kernel (``csrc/int4_linear.cpp``, in the native CPU build): int4 weights with one
fp16 scale per group of 32 inputs, the input quantised per call to int8 per row and group of 32,
multiplied with AVX-512 VNNI (a portable loop elsewhere). Per layer, 1 row, weights streamed
(1 thread, same machine; ms, int4 / fbgemm int8): 896 x 4864 0.10-0.14 / 0.21-0.30, 4864 x 896
0.13 / 0.15-0.22, the 896 x 151,936 output layer 4.2-4.8 / 7.0-8.4. The per-group scales cost a
float step per group and row that fbgemm's one scale per row does not, so more rows cost more: the
whole 0.5B draft's forward (300 cached tokens, CPU time, int8 / int4) took 39.7 / 32.2 ms for one
query, 44.4 / 42.2 for two, 49.6 / 58.5 for four. Use it for chains (one query a forward, two for the
first of a step); a tree's 2-4-node frontiers run faster on the int8 layers.

Quality. Per-group activation scales make up for most of what the weights lose: teacher-forced on
the Qwen pair (6 code / 4 prose passages, 400 tokens each), the draft's top-1 agreement with the
target was 0.749 / 0.617 (code / prose) with every layer int4, 0.758 / 0.623 with fbgemm int8, 0.775 /
0.641 in fp32; its overlap sum min(p, q) at T = 0.7 0.772 / 0.602 against int8's 0.771 / 0.582. In
generation (bench_e2e, two runs) its drafts were accepted 4-8% less often than int8's, which took back
most of the faster forward: end to end within a few % of the int8 draft (docs/performance.md).

Exactness. As for any draft: the driver samples the drafts from the logits of the draft forward it
hands the verifier, so the output law is the target's whatever the layers compute (greedy: identical
to ``generate``). The per-row activation scales also keep a row's logits independent of the other
rows of the forward (fbgemm's int8 layer shares one scale over them). Apply it to drafts only: an int4
target is another model.

:func:`use_int4_linears` swaps a model's ``nn.Linear`` / :class:`OneDnnLinear` layers (not
:class:`Int8Linear` ones) for :class:`Int4Linear` in place; inference only, CPU, fp32 or bf16 weights
whose input width is a multiple of :data:`INT4_GROUP` (others are left as they are).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..ops.csrc import cpu_backend_ready, cpu_failure, load_cpu_core
from .cpu_linear import _DTYPES, replace_cpu_linears

__all__ = ["INT4_GROUP", "Int4Linear", "dequantize_int4", "int4_linear_available", "pack_int4", "use_int4_linears"]

INT4_GROUP = 32  # inputs per weight scale and per activation scale (csrc/int4_linear.cpp: GROUP)
INT4_MAX = 7  # symmetric int4: q in [-8, 7], scale = max |w| / 7 per group


def int4_linear_available() -> bool:
    """Whether the native CPU build (which holds the int4 kernel) loads here (compiling it on first use)."""
    return cpu_backend_ready()


@torch.no_grad()
def pack_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(wq [N, K / 2] uint8, ws [N, K / 32] fp16): ``weight`` [N, K] in the kernel's layout.

    Per group of 32 inputs of a row: scale s = max |w| / 7 rounded to fp16, q = round(w / s) clamped
    to [-8, 7], stored as q + 8; group g holds element i in the low nibble of byte 16 g + i and
    element 16 + i in its high nibble. :func:`dequantize_int4` inverts it."""
    N, K = weight.shape
    if K % INT4_GROUP or K == 0:
        raise ValueError(f"pack_int4: the input width ({K}) must be a positive multiple of {INT4_GROUP}")
    w = weight.detach().float().reshape(N, K // INT4_GROUP, INT4_GROUP)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("pack_int4: the weight has NaN or infinite entries")
    scale = (w.abs().amax(-1) / INT4_MAX).half()  # [N, G]
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("pack_int4: a weight group's scale overflows fp16 (|w| > 458,528)")
    s = scale.float()[..., None]
    q = torch.where(s > 0, torch.round(w / torch.where(s > 0, s, 1.0)), 0.0).clamp(-8, INT4_MAX).to(torch.int16) + 8
    byte = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)  # [N, G, 16]
    return byte.reshape(N, K // 2).contiguous(), scale.contiguous()


def dequantize_int4(wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] that ``pack_int4``'s output stands for."""
    N = wq.shape[0]
    byte = wq.reshape(N, -1, 16).to(torch.int16)
    q = torch.cat([byte & 0x0F, byte >> 4], dim=-1) - 8  # [N, G, 32]
    return (q.float() * ws.float()[..., None]).reshape(N, -1)


class Int4Linear(nn.Module):
    """``y = x @ W^T + b`` on int4 weights (:func:`pack_int4`) and the input quantised per call to
    int8 per row and group of 32 (``csrc/int4_linear.cpp``); fp32 accumulation.

    Made from an ``nn.Linear`` or an :class:`OneDnnLinear` (:meth:`from_linear`). Inputs: any shape
    ``[..., in_features]`` and strides, fp32 or bf16, on the CPU; the output has the input's dtype."""

    def __init__(self, wq: torch.Tensor, ws: torch.Tensor, bias, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("wq", wq, persistent=False)  # [out, in / 2] uint8
        self.register_buffer("ws", ws, persistent=False)  # [out, in / 32] fp16
        self.bias = bias  # [out_features] or None: the original's, as given
        self._bias32 = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Module) -> Int4Linear:
        weight = linear.weight.detach()  # [out, in] (OneDnnLinear: an unpacked copy)
        if weight.device.type != "cpu" or weight.dtype not in _DTYPES:
            raise ValueError(f"Int4Linear needs a CPU fp32/bf16 weight, got {weight.dtype} on {weight.device}")
        wq, ws = pack_int4(weight)
        return cls(wq, ws, linear.bias, weight.shape[1], weight.shape[0])

    def select_rows(self, ids: torch.Tensor) -> Int4Linear:
        """A layer of the output rows ``ids`` [R] int64 (CPU) only: their packed int4 values and scales
        (and bias) as they are."""
        bias = self.bias.detach().index_select(0, ids) if self.bias is not None else None
        wq, ws = self.wq.index_select(0, ids).contiguous(), self.ws.index_select(0, ids).contiguous()
        return Int4Linear(wq, ws, bias, self.in_features, ids.numel())

    @property
    def weight(self) -> torch.Tensor:
        """The int4 weight dequantised, ``[out_features, in_features]`` fp32 (a copy: for code that
        inspects or restricts an output layer, not for the hot path)."""
        return dequantize_int4(self.wq, self.ws)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Int4Linear: input's last dimension is {x.shape[-1]}, expected {self.in_features}")
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).float().contiguous()
        y = load_cpu_core().w4a8_linear(rows, self.wq, self.ws, self._bias32)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_int4_linears(model: nn.Module, keep: tuple[str, ...] | list[str] = ()) -> int:
    """Replace the linear layers (``nn.Linear``, :class:`OneDnnLinear`) of a CPU fp32/bf16 *draft*
    ``model`` with :class:`Int4Linear`, in place, except those whose qualified name contains one of
    ``keep`` (e.g. ``("lm_head",)``) and those whose input width is not a multiple of
    :data:`INT4_GROUP`. Returns how many were replaced.

    Raises ``ValueError`` when the native CPU build cannot be loaded (asked for and not possible is an
    error, not a silent no-op); warns (``RuntimeWarning``) where the kernel has no SIMD path (no
    AVX-512 VNNI: its portable loop is for checking, not for speed). Layers on a GPU or in other
    dtypes are left as they are. Inference only. Use it on the draft: the output law stays the
    target's (module docstring).

    Example::

        draft = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        use_int4_linears(draft)  # half int8's weight bytes; faster one-query forwards (chains)
        speculative_generate(target, draft, input_ids, ...)
    """
    if isinstance(keep, str):
        raise ValueError(f"use_int4_linears: keep must be a list of name parts, got the string {keep!r}")
    if not int4_linear_available():
        raise ValueError(f"use_int4_linears: the native CPU build does not load ({cpu_failure()})")
    if not load_cpu_core().w4a8_fast_path():  # the same results, at the portable loop's speed
        warnings.warn(
            "use_int4_linears: the int4 kernel has no SIMD path on this CPU (it needs AVX-512 VNNI) and runs "
            "its portable loop, many times slower than use_int8_linears' kernel here (AVX2 or AVX-512 VNNI)",
            RuntimeWarning,
            stacklevel=2,
        )
    width_ok = lambda layer: layer.weight.shape[1] % INT4_GROUP == 0 and layer.weight.shape[1] > 0  # noqa: E731
    return replace_cpu_linears(model, keep, Int4Linear.from_linear, width_ok)
