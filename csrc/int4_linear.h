// Int4-weight linear layer for CPU draft models (hf/cpu_int4.py): declared for binding.cpp.
#pragma once

#include <torch/extension.h>

// y [M, N] fp32 = x [M, K] (fp32, contiguous) times the int4 weight (wq [N, K / 2] uint8, ws [N, K / 32]
// fp16; layout in int4_linear.cpp) + bias [N] fp32 (optional). K % 32 == 0.
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& ws,
                       const c10::optional<at::Tensor>& bias);

// Whether w4a8_linear runs its AVX-512 VNNI path on this CPU (SPECDEC_CPU_SIMD=0 turns it off).
bool w4a8_fast_path();
