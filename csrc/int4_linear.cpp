// Int4 weights times int8 activations (W4A8) for the linear layers of a CPU *draft* model
// (specdec_kernels/hf/cpu_int4.py). A decoding draft forward streams its weights from memory: int4
// halves the bytes of fbgemm's int8 layers, and at one row the arithmetic (AVX-512 VNNI: 64
// multiply-adds an instruction) keeps up with the bandwidth. Each group's float step (scales) is per
// row, so at 3-4 rows this is slower than fbgemm's int8 layer with its one scale per row.
//
// Weights (packed in Python, cpu_int4.pack_int4): symmetric, one fp16 scale per group of GROUP = 32
// inputs of an output row, values q in [-8, 7] stored as q + 8 in a nibble: byte 16 g + i of a row
// holds element i of its group g in the low nibble and element 16 + i in the high nibble. So one
// 64-byte load covers a block of four groups (BLOCK = 128 inputs) and gives, by mask and shift, their
// first and second halves as two vectors. A row's last block may hold 1-3 groups (K % 32 == 0): it is
// loaded under a mask.
//
// Activations: quantised per call, per row and group of 32: int8 in [-127, 127] with scale
// amax / 127 (round to nearest even), per block the four groups' first halves (64 bytes), then their
// second halves; rows padded with zeros to whole blocks. A group's dot product is
//   s_w s_a sum_i (q_i + 8) a_i  -  8 s_w s_a sum_i a_i,
// the first sum by vpdpbusd (unsigned nibbles times signed activations, exact in int32), the second a
// per-call constant of the group (its activation sum). Accumulation is in fp32.
//
// Exactness is not at stake here: the driver verifies the drafts against the law of the draft's own
// logits, whatever computed them; this only has to be fast and close to the float layer (tested
// against the same quantisation in plain PyTorch, tests/hf/test_cpu_int4.py).
#include "int4_linear.h"

#include <ATen/Parallel.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#if defined(__x86_64__) && defined(__GNUC__)
#define SK_HAVE_AVX512_W4 1
#include <immintrin.h>
#define SK_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#endif

namespace {

constexpr int64_t GROUP = 32;   // inputs per weight / activation scale
constexpr int64_t BLOCK = 128;  // inputs per 64-byte block of a packed row (four groups)
constexpr int LANES = 4;        // int32 lanes of a vpdpbusd result per group (16 bytes each)
constexpr int64_t TILE_N = 16;  // output rows a parallel task takes (parallel_for's grain)

inline int64_t padded(int64_t K) { return (K + BLOCK - 1) / BLOCK * BLOCK; }

inline float half_to_float(uint16_t h) {
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Activations of rows [M, K] -> int8 in block layout, and per group: the scale s_a, and
// c = -8 s_a (sum of the group's int8 values) / LANES (each of a group's LANES result lanes adds a
// quarter of the offset term). A group with a non-finite entry gets s_a = NaN: its rows' outputs are
// NaN. aq [M, Kp] and sa, cc [M, Gp] (Kp = K rounded up to BLOCK, Gp = Kp / GROUP) arrive zeroed where
// K ends before Kp: the padding stays zero.
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* aq, float* sa, float* cc) {
  const int64_t G = K / GROUP, Kp = padded(K), Gp = Kp / GROUP;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    for (int64_t g = 0; g < G; ++g) {
      float amax = 0.f;
      bool finite = true;
      for (int64_t i = 0; i < GROUP; ++i) {
        const float v = xr[g * GROUP + i];
        finite = finite && std::isfinite(v);
        amax = std::max(amax, std::fabs(v));
      }
      const float s = finite ? amax / 127.f : NAN;
      const float inv = (finite && amax > 0.f) ? 127.f / amax : 0.f;
      int32_t sum = 0;
      int8_t* block = aq + m * Kp + (g / 4) * BLOCK + (g % 4) * 16;
      for (int64_t i = 0; i < GROUP; ++i) {
        const float v = finite ? std::nearbyint(xr[g * GROUP + i] * inv) : 0.f;
        const int q = static_cast<int>(std::min(127.f, std::max(-127.f, v)));
        sum += q;
        block[(i < 16 ? 0 : 64) + (i & 15)] = static_cast<int8_t>(q);
      }
      sa[m * Gp + g] = s;
      cc[m * Gp + g] = -8.f * s * static_cast<float>(sum) / LANES;
    }
  }
}

// The portable path: the same sums, one group at a time.
void gemv_scalar(const uint8_t* wq, const uint16_t* ws, const int8_t* aq, const float* sa, const float* cc, float* out,
                 int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t G = K / GROUP, Kp = padded(K), Gp = Kp / GROUP;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = wq + n * (K / 2);
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* ar = aq + m * Kp;
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* wb = wr + g * 16;
        const int8_t* ab = ar + (g / 4) * BLOCK + (g % 4) * 16;
        int32_t d = 0;
        for (int i = 0; i < 16; ++i) d += (wb[i] & 0x0F) * ab[i] + (wb[i] >> 4) * ab[64 + i];
        acc += half_to_float(ws[n * G + g]) * (static_cast<float>(d) * sa[m * Gp + g] + LANES * cc[m * Gp + g]);
      }
      out[m * N + n] = acc;
    }
  }
}

#ifdef SK_HAVE_AVX512_W4
// M activation rows times NT weight rows at a time (the activations' vectors are loaded once for the
// NT rows; M and NT fixed at compile time keep the M x NT accumulators in registers).
template <int M, int NT>
SK_AVX512_VNNI void gemv_vnni(const uint8_t* wq, const uint16_t* ws, const int8_t* aq, const float* sa,
                              const float* cc, float* out, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t Kp = padded(K), B = Kp / BLOCK, G = K / GROUP;
  const int tail_groups = static_cast<int>(G - (B - 1) * 4);  // groups in the last block: 1-4
  const __mmask64 tail_bytes = tail_groups == 4 ? ~0ULL : (1ULL << (16 * tail_groups)) - 1;
  const __mmask8 tail_scales = static_cast<__mmask8>((1u << tail_groups) - 1);
  const __m512i low = _mm512_set1_epi8(0x0F);
  // group w of a block covers result lanes 4w .. 4w + 3: spread four fp32 scales over them
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) {
    __m512 acc[M][NT];
    for (int m = 0; m < M; ++m)
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      __m512i lo[NT], hi[NT];
      __m512 sw[NT];
      const bool last = b == B - 1;  // a short last block: no byte past the row's end is read
      for (int t = 0; t < NT; ++t) {
        const uint8_t* wb = wq + (n + t) * (K / 2) + b * (BLOCK / 2);
        const uint16_t* sb = ws + (n + t) * G + b * 4;
        const __m512i v = last ? _mm512_maskz_loadu_epi8(tail_bytes, wb) : _mm512_loadu_si512(wb);
        lo[t] = _mm512_and_si512(v, low);
        hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        const __m128i s16 = last ? _mm_maskz_loadu_epi16(tail_scales, sb)
                                 : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb));
        sw[t] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(s16)));
      }
      for (int m = 0; m < M; ++m) {
        const int8_t* ar = aq + m * Kp + b * BLOCK;
        const __m512i a_first = _mm512_loadu_si512(ar), a_second = _mm512_loadu_si512(ar + 64);
        const __m512 sav = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(sa + (m * B + b) * 4)));
        const __m512 cv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(cc + (m * B + b) * 4)));
        for (int t = 0; t < NT; ++t) {
          __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[t], a_first);
          d = _mm512_dpbusd_epi32(d, hi[t], a_second);
          acc[m][t] = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sav, cv), sw[t], acc[m][t]);
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int t = 0; t < NT; ++t) out[m * N + n + t] = _mm512_reduce_add_ps(acc[m][t]);
  }
  if (NT > 1 && n < n1) gemv_vnni<M, 1>(wq, ws, aq, sa, cc, out, N, K, n, n1);
}

// Up to 8 activation rows per pass: NT = 4 weight rows for 1-2 (24 vector registers), 2 beyond.
void gemv_vnni_rows(int64_t M, const uint8_t* wq, const uint16_t* ws, const int8_t* aq, const float* sa,
                    const float* cc, float* out, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  switch (M) {
    case 1: return gemv_vnni<1, 4>(wq, ws, aq, sa, cc, out, N, K, n0, n1);
    case 2: return gemv_vnni<2, 4>(wq, ws, aq, sa, cc, out, N, K, n0, n1);
    case 3: return gemv_vnni<3, 2>(wq, ws, aq, sa, cc, out, N, K, n0, n1);
    case 4: return gemv_vnni<4, 2>(wq, ws, aq, sa, cc, out, N, K, n0, n1);
    case 5: return gemv_vnni<5, 2>(wq, ws, aq, sa, cc, out, N, K, n0, n1);
    case 6: return gemv_vnni<6, 2>(wq, ws, aq, sa, cc, out, N, K, n0, n1);
    case 7: return gemv_vnni<7, 2>(wq, ws, aq, sa, cc, out, N, K, n0, n1);
    default: return gemv_vnni<8, 2>(wq, ws, aq, sa, cc, out, N, K, n0, n1);
  }
}
#endif

}  // namespace

bool w4a8_fast_path() {
#ifdef SK_HAVE_AVX512_W4
  static const bool cpu_ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                             __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  return cpu_ok && sk::simd::env_allows();
#else
  return false;
#endif
}

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& ws,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && wq.device().is_cpu() && ws.device().is_cpu(), "w4a8_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "w4a8_linear: x must be [M, K] fp32 contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = wq.size(0);
  TORCH_CHECK(K % GROUP == 0 && K > 0, "w4a8_linear: in_features must be a positive multiple of ", GROUP, ", got ", K);
  TORCH_CHECK(wq.dim() == 2 && wq.scalar_type() == at::kByte && wq.is_contiguous() && wq.size(1) == K / 2,
              "w4a8_linear: wq must be [N, K / 2] uint8 contiguous");
  TORCH_CHECK(ws.dim() == 2 && ws.scalar_type() == at::kHalf && ws.is_contiguous() && ws.size(0) == N &&
                  ws.size(1) == K / GROUP,
              "w4a8_linear: ws must be [N, K / 32] fp16 contiguous");
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const int64_t Kp = padded(K), Gp = Kp / GROUP;
  const bool fast = w4a8_fast_path();
  auto zeros_or_empty = [&](at::IntArrayRef shape, at::ScalarType dtype) {  // padding must read as zero
    return Kp != K ? at::zeros(shape, x.options().dtype(dtype)) : at::empty(shape, x.options().dtype(dtype));
  };
  auto aq = zeros_or_empty({M, Kp}, at::kChar);
  auto sa = zeros_or_empty({M, Gp}, at::kFloat);
  auto cc = zeros_or_empty({M, Gp}, at::kFloat);
  quantize_rows(x.data_ptr<float>(), M, K, aq.data_ptr<int8_t>(), sa.data_ptr<float>(), cc.data_ptr<float>());
  const auto* w = wq.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(ws.data_ptr<at::Half>());
  float* y = out.data_ptr<float>();
  at::parallel_for(0, (N + TILE_N - 1) / TILE_N, 1, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * TILE_N, n1 = std::min(N, t1 * TILE_N);
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t rows = std::min<int64_t>(8, M - m0);
#ifdef SK_HAVE_AVX512_W4
      if (fast) {
        gemv_vnni_rows(rows, w, s, aq.data_ptr<int8_t>() + m0 * Kp, sa.data_ptr<float>() + m0 * Gp,
                       cc.data_ptr<float>() + m0 * Gp, y + m0 * N, N, K, n0, n1);
        continue;
      }
#endif
      gemv_scalar(w, s, aq.data_ptr<int8_t>() + m0 * Kp, sa.data_ptr<float>() + m0 * Gp,
                  cc.data_ptr<float>() + m0 * Gp, y + m0 * N, rows, N, K, n0, n1);
    }
  });
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "w4a8_linear: bias must be [N]");
    out.add_(bias->to(at::kFloat));
  }
  return out;
}
