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

Exactness. A speculative decoder's output law is the target's whatever the draft proposes, as long
as the verifier is told the law the drafts were drawn from; the driver samples drafts from the
logits of the draft forward it hands the verifier, so an int8 draft stays exact. What changes is how
often drafts are accepted: on the pair above, teacher-forced, the int8 draft's top-1 token agreed with
the target's as often as the bf16 draft's on code (0.716 vs 0.714) and a little less on prose
(0.640 vs 0.690). Two consequences of the per-call activation scale: a row's logits depend slightly
on the other rows of the same forward (a batch's requests, a tree's frontier), and so does a seeded
sampled draft; the output law does not. Apply this to drafts, not to a target whose law users asked
for: an int8 target is another model.

:func:`use_int8_linears` swaps a model's linear layers (``nn.Linear`` or :class:`OneDnnLinear`) for
:class:`Int8Linear` in place; inference only, CPU, fp32 or bf16 models (the layer computes in fp32
and returns the input's dtype).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from .cpu_linear import _DTYPES, replace_cpu_linears

__all__ = ["INT8_KEEP", "Int8Linear", "int8_linear_available", "use_int8_linears"]

# fbgemm-backed quantised engines, in order of preference ("x86" picks fbgemm or oneDNN per shape)
_ENGINES = ("x86", "fbgemm")
# Layers left in their dtype by default: none. Measured on the Qwen2.5-Coder pair (teacher-forced
# top-1 agreement with the target, 500 tokens): quantising the output layer too changed it by < 0.01
# on code and prose and saves its ~8 ms of a 57 ms forward; keeping the MLP's down projection in bf16
# recovers 0.02-0.03 on prose for ~5 ms (``use_int8_linears(model, keep=("down_proj",))``).
INT8_KEEP: tuple[str, ...] = ()


def _engine() -> str | None:
    supported = torch.backends.quantized.supported_engines
    return next((e for e in _ENGINES if e in supported), None)


def int8_linear_available() -> bool:
    """Whether this PyTorch build has the fbgemm int8 linear (x86-64 wheels do)."""
    quantized = getattr(torch.ops, "quantized", None)
    ops = ("linear_dynamic", "linear_prepack", "linear_unpack")
    return _engine() is not None and hasattr(torch, "quantize_per_channel") and all(hasattr(quantized, o) for o in ops)


@contextlib.contextmanager
def _quantized_engine(name: str):
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


class Int8Linear(nn.Module):
    """``y = x @ W^T + b`` on int8 weights (one fp32 scale per output row, symmetric) and the input
    quantised per call to uint8 (fbgemm's dynamic linear; fp32 accumulation of int32 sums).

    Made from an ``nn.Linear`` or an :class:`OneDnnLinear` (:meth:`from_linear`). Inputs: any shape
    ``[..., in_features]`` and strides, fp32 or bf16, on the CPU; the output has the input's dtype.
    """

    def __init__(self, packed, scales: torch.Tensor, bias, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.packed = packed  # fbgemm's packed int8 weight and fp32 bias (an opaque object)
        self.register_buffer("scales", scales, persistent=False)  # [out_features] fp32 (for .weight)
        self.bias = bias  # [out_features] or None: the original's, as given

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Module) -> Int8Linear:
        if not int8_linear_available():
            raise ValueError("Int8Linear needs PyTorch's fbgemm int8 linear (torch.ops.quantized on x86-64)")
        weight = linear.weight.detach()  # [out, in] (OneDnnLinear: an unpacked copy)
        if weight.device.type != "cpu" or weight.dtype not in _DTYPES:
            raise ValueError(f"Int8Linear needs a CPU fp32/bf16 weight, got {weight.dtype} on {weight.device}")
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantised tensor creation is deprecated; the packed weight is what we keep
            warnings.filterwarnings("ignore", message=".*quantize_per_channel.*", category=UserWarning)
            qweight = torch.quantize_per_channel(w, scales.double(), zero, 0, torch.qint8)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        with _quantized_engine(_engine()):
            packed = torch.ops.quantized.linear_prepack(qweight, bias)
        return cls(packed, scales, linear.bias, w.shape[1], w.shape[0])

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weight dequantised, ``[out_features, in_features]`` fp32 (a copy: for code that
        inspects or restricts an output layer, not for the hot path)."""
        qweight, _bias = torch.ops.quantized.linear_unpack(self.packed)
        return qweight.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Int8Linear: input's last dimension is {x.shape[-1]}, expected {self.in_features}")
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).float()
        if rows.shape[0] == 0:
            return x.new_zeros(*lead, self.out_features)
        # reduce_range=False: the full uint8 range (VNNI sums without the 16-bit saturation
        # reduce_range guards against on older AVX2 parts; there it costs accuracy, never exactness).
        # The op's one overload, called directly: the packet's per-call scan of its arguments for
        # Python-dispatched objects cost ~7 us a call (measured on the 0.5B draft's one-token
        # forward of ~40 ms: 0.3-1.2 ms less, bit-identical outputs).
        y = torch.ops.quantized.linear_dynamic.default(rows.contiguous(), self.packed, False)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_int8_linears(model: nn.Module, keep: tuple[str, ...] | list[str] = INT8_KEEP) -> int:
    """Replace the linear layers (``nn.Linear``, :class:`OneDnnLinear`) of a CPU fp32/bf16 *draft*
    ``model`` with :class:`Int8Linear`, in place, except those whose qualified name contains one of
    ``keep`` (e.g. ``("down_proj",)``). Returns how many were replaced.

    Raises ``ValueError`` when this PyTorch has no fbgemm int8 linear (asked for and not possible is
    an error, not a silent no-op). Layers on a GPU or in other dtypes are left as they are. Inference
    only: the packed weights are not parameters. Use it on the draft: the output law stays the target's
    (module docstring); on a target it would change the model.

    Example::

        draft = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        use_int8_linears(draft)  # ~2x cheaper draft forwards on CPU than a bf16 draft
        speculative_generate(target, draft, input_ids, ...)
    """
    if not int8_linear_available():
        raise ValueError("use_int8_linears: this PyTorch build has no fbgemm int8 linear (torch.ops.quantized)")
    if isinstance(keep, str):
        raise ValueError(f"use_int8_linears: keep must be a list of name parts, got the string {keep!r}")
    return replace_cpu_linears(model, keep, Int8Linear.from_linear)
