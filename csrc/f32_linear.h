// fp32 linear layer for CPU models (hf/cpu_f32.py): declared for binding.cpp.
#pragma once

#include <torch/extension.h>

// y [M, N] fp32 = x [M, K] (fp32, contiguous) times the fp32 weight in panels (wp [P, 16 K] fp32,
// P = ceil(N / 16); layout in f32_linear.cpp) + bias [N] fp32 (optional). Each output's sum runs over
// k in order, whatever M: a row's result does not depend on the other rows.
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias, int64_t N);

// The path f32_linear runs on this CPU: "avx512", "avx2" or "portable" (SPECDEC_CPU_SIMD: "0" the
// portable loop, "avx2" at most AVX2); fast path: not the portable loop.
const char* f32_linear_path();
bool f32_linear_fast_path();
