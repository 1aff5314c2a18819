// Int8-weight linear layer for CPU draft models (hf/cpu_int8.py): declared for binding.cpp.
#pragma once

#include <torch/extension.h>

// y [M, N] fp32 = x [M, K] (fp32, contiguous) times the int8 weight in panels (wq [P, 16 Kp] int8,
// P = ceil(N / 16), Kp = K rounded up to 4; layout in int8_linear.cpp; sw [16 P] fp32 scales; wsum
// [16 P] int32 row sums) + bias [N] fp32 (optional).
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& sw, const at::Tensor& wsum,
                       const c10::optional<at::Tensor>& bias, int64_t N);

// The path w8a8_linear runs on this CPU: "avx512-vnni", "avx2" or "portable" (SPECDEC_CPU_SIMD: "0"
// the portable loop, "avx2" at most AVX2); fast path: not the portable loop.
const char* w8a8_path();
bool w8a8_fast_path();
