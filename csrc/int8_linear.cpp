// Int8 weights times uint8 activations (W8A8) for the linear layers of a CPU *draft* model
// (specdec_kernels/hf/cpu_int8.py). A decoding draft forward streams its weights from memory; this
// kernel keeps that stream at the machine's read bandwidth at 1-8 rows (AVX-512 VNNI: one 64-byte
// weight load feeds one vpdpbusd per row, and the sums stay in int32 to the end of the row). CPUs
// without VNNI run an AVX2 path with the same int32 sums (gemv_avx2): at the read bandwidth at one row,
// compute-bound from ~4 rows.
//
// Weights (packed in Python, cpu_int8.pack_int8): symmetric per output row, q = round(w / s_w) in
// [-127, 127] with s_w = max |w| / 127; wsum holds each row's sum of q. Rows are interleaved in panels
// of PANEL = 16 (zero rows past N): panel p is [Kp / 4][16][4], so one 64-byte vector holds four
// consecutive inputs (zero past K) of each of its 16 rows, and a panel is read front to back.
//
// Activations: quantised per call and per row to uint8 with a zero point, as fbgemm's dynamic linear
// does per call (so at one row the two quantise alike): lo = min(x, 0), hi = max(x, 0),
// s_a = (hi - lo) / 255, z = round(-lo / s_a) in [0, 255], a = clamp(round(x / s_a) + z, 0, 255).
// Then y = s_a s_w (sum_k a_k q_k - z wsum) + bias, the sum exact in int32 (|a q| <= 255 * 127, so
// K <= MAX_K). Per-row scales keep a row's output independent of the other rows of the call.
//
// Exactness is not at stake: the driver verifies drafts against the law of the draft's own logits,
// whatever computed them; this only has to be fast and close to the float layer (tested against the
// same quantisation in plain PyTorch, tests/hf/test_cpu_int8.py).
#include "int8_linear.h"

#include <ATen/Parallel.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#define SK_HAVE_AVX512_W8 1
#include <immintrin.h>
#define SK_AVX512_VNNI_W8 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#endif

namespace {

constexpr int64_t QUAD = 4;                     // inputs per int32 lane of vpdpbusd
constexpr int64_t PANEL = 16;                   // output rows interleaved in a packed panel (one vector's lanes)
constexpr int64_t MAX_K = (1LL << 31) / 32385;  // 255 * 127 per product: int32 sums stay exact up to here
constexpr int64_t ROWS = 8;                     // activation rows per pass over a panel's weights
// Panels of at most this many padded inputs (16 KB) are read one at a time, front to back: with
// in_features = 896 (the 0.5B draft's every layer but its MLP's down projection) one stream beat 2
// or 4 side by side at 1-8 rows by 15-35% (e.g. its 151,936-row head at 4 rows: 5.1 against 7.6 ms,
// 1 thread, Zen 4; notes in docs/performance.md). Longer panels keep 4 (1-4 rows) or 2 side by side.
constexpr int64_t SHORT_PANEL_KP = 1024;
// Passes of more than 4 rows over short panels prefetch each panel this many quads (4 KB) ahead:
// their extra vpdpbusd per load leave the stream too slow for the hardware prefetcher alone. (The
// AVX2 path's first sweep over a panel prefetches as far at every row count.)
constexpr int PREFETCH_QUADS = 64;

inline int64_t padded(int64_t K) { return (K + QUAD - 1) / QUAD * QUAD; }

// Rows [M, K] -> uint8 [M, Kp] (the padding arrives zeroed), scale s_a and zero point per row. A row
// with a non-finite entry gets s_a = NaN (its outputs are NaN) and zero codes.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, uint8_t* aq, float* sa, int32_t* za) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float lo = 0.f, hi = 0.f;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      finite = finite && std::isfinite(xr[k]);
      lo = std::min(lo, xr[k]);
      hi = std::max(hi, xr[k]);
    }
    uint8_t* ar = aq + m * Kp;
    if (!finite || hi == lo) {  // all zero (s_a = 0: outputs are the bias) or non-finite
      std::fill(ar, ar + K, uint8_t{0});
      sa[m] = finite ? 0.f : NAN;
      za[m] = 0;
      continue;
    }
    const float s = (hi - lo) / 255.f, inv = 1.f / s;
    const int32_t z = static_cast<int32_t>(std::min(255.f, std::max(0.f, std::nearbyint(-lo * inv))));
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::nearbyint(xr[k] * inv) + static_cast<float>(z);
      ar[k] = static_cast<uint8_t>(std::min(255.f, std::max(0.f, v)));
    }
    sa[m] = s;
    za[m] = z;
  }
}

// (sum_k a_k q_k - z wsum) exact in int32 (|a - z| <= 255), then scaled.
inline float finish(int32_t dot, float sa, int32_t za, float sw, int32_t wsum) {
  return sa * sw * static_cast<float>(dot - za * wsum);
}

// The portable path over panels [p0, p1): the same integer sums.
void gemv_scalar(const int8_t* wq, const float* sw, const int32_t* wsum, const uint8_t* aq, const float* sa,
                 const int32_t* za, float* out, int64_t M, int64_t N, int64_t Kp, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* panel = wq + p * Kp * PANEL;
    for (int64_t j = 0; j < PANEL && p * PANEL + j < N; ++j) {
      const int64_t n = p * PANEL + j;
      for (int64_t m = 0; m < M; ++m) {
        const uint8_t* ar = aq + m * Kp;
        int32_t d = 0;
        for (int64_t q = 0; q < Kp / QUAD; ++q)
          for (int64_t i = 0; i < QUAD; ++i) d += static_cast<int32_t>(ar[q * QUAD + i]) * panel[(q * PANEL + j) * QUAD + i];
        out[m * N + n] = finish(d, sa[m], za[m], sw[n], wsum[n]);
      }
    }
  }
}

#ifdef SK_HAVE_AVX512_W8
// M activation rows times NP panels (16 output rows each) at a time: a panel's vector holds its 16 rows'
// weights for 4 inputs, the activation's 4 bytes are broadcast, and vpdpbusd adds the 16 rows' partial
// sums lane by lane (no horizontal sums; each panel one sequential stream).
template <int M, int NP, int PF>
SK_AVX512_VNNI_W8 void gemv_vnni(const int8_t* wq, const float* sw, const int32_t* wsum, const uint8_t* aq,
                                 const float* sa, const int32_t* za, float* out, int64_t N, int64_t Kp, int64_t p0,
                                 int64_t p1) {
  int64_t p = p0;
  const int64_t Q = Kp / QUAD;
  for (; p + NP <= p1; p += NP) {
    __m512i acc[M][NP];
    for (int m = 0; m < M; ++m)
      for (int t = 0; t < NP; ++t) acc[m][t] = _mm512_setzero_si512();
    const int8_t* panel = wq + p * Kp * PANEL;
    for (int64_t q = 0; q < Q; ++q) {
      __m512i w[NP];
      for (int t = 0; t < NP; ++t) w[t] = _mm512_loadu_si512(panel + (t * Q + q) * PANEL * QUAD);
      if constexpr (PF > 0)  // past the weights' end is harmless: a prefetch never faults
        for (int t = 0; t < NP; ++t)
          _mm_prefetch(reinterpret_cast<const char*>(panel + (t * Q + q + PF) * PANEL * QUAD), _MM_HINT_T0);
      for (int m = 0; m < M; ++m) {
        int32_t quad;
        std::memcpy(&quad, aq + m * Kp + q * QUAD, sizeof(quad));
        const __m512i a = _mm512_set1_epi32(quad);
        for (int t = 0; t < NP; ++t) acc[m][t] = _mm512_dpbusd_epi32(acc[m][t], a, w[t]);
      }
    }
    for (int t = 0; t < NP; ++t) {
      const int64_t n = (p + t) * PANEL;
      const __mmask16 real = n + PANEL <= N ? static_cast<__mmask16>(0xFFFF)
                                            : static_cast<__mmask16>((1u << (N - n)) - 1);
      const __m512 swv = _mm512_loadu_ps(sw + n);
      const __m512i wsv = _mm512_loadu_si512(wsum + n);
      for (int m = 0; m < M; ++m) {
        const __m512i d = _mm512_sub_epi32(acc[m][t], _mm512_mullo_epi32(_mm512_set1_epi32(za[m]), wsv));
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(sa[m]), swv), _mm512_cvtepi32_ps(d));
        _mm512_mask_storeu_ps(out + m * N + n, real, y);
      }
    }
  }
  if (NP > 1 && p < p1) gemv_vnni<M, 1, PF>(wq, sw, wsum, aq, sa, za, out, N, Kp, p, p1);
}

// M (1..ROWS) activation rows a pass: NP_FEW panels side by side up to 4 rows, NP_MANY (prefetching
// PF_MANY quads ahead) beyond, so that M x NP accumulators + NP weights + 1 fit in 32 registers.
template <int NP_FEW, int NP_MANY, int PF_MANY>
void gemv_vnni_plan(int64_t M, const int8_t* wq, const float* sw, const int32_t* wsum, const uint8_t* aq,
                    const float* sa, const int32_t* za, float* out, int64_t N, int64_t Kp, int64_t p0, int64_t p1) {
  switch (M) {
    case 1: return gemv_vnni<1, NP_FEW, 0>(wq, sw, wsum, aq, sa, za, out, N, Kp, p0, p1);
    case 2: return gemv_vnni<2, NP_FEW, 0>(wq, sw, wsum, aq, sa, za, out, N, Kp, p0, p1);
    case 3: return gemv_vnni<3, NP_FEW, 0>(wq, sw, wsum, aq, sa, za, out, N, Kp, p0, p1);
    case 4: return gemv_vnni<4, NP_FEW, 0>(wq, sw, wsum, aq, sa, za, out, N, Kp, p0, p1);
    case 5: return gemv_vnni<5, NP_MANY, PF_MANY>(wq, sw, wsum, aq, sa, za, out, N, Kp, p0, p1);
    case 6: return gemv_vnni<6, NP_MANY, PF_MANY>(wq, sw, wsum, aq, sa, za, out, N, Kp, p0, p1);
    case 7: return gemv_vnni<7, NP_MANY, PF_MANY>(wq, sw, wsum, aq, sa, za, out, N, Kp, p0, p1);
    default: return gemv_vnni<8, NP_MANY, PF_MANY>(wq, sw, wsum, aq, sa, za, out, N, Kp, p0, p1);
  }
}

// Short panels (SHORT_PANEL_KP) one at a time, longer ones 4 or 2 side by side.
void gemv_vnni_rows(int64_t M, const int8_t* wq, const float* sw, const int32_t* wsum, const uint8_t* aq,
                    const float* sa, const int32_t* za, float* out, int64_t N, int64_t Kp, int64_t p0, int64_t p1) {
  if (Kp <= SHORT_PANEL_KP)
    return gemv_vnni_plan<1, 1, PREFETCH_QUADS>(M, wq, sw, wsum, aq, sa, za, out, N, Kp, p0, p1);
  gemv_vnni_plan<4, 2, 0>(M, wq, sw, wsum, aq, sa, za, out, N, Kp, p0, p1);
}
#endif

#ifdef SK_HAVE_AVX2_PATH
// The AVX2 path (no vpdpbusd on these CPUs; vpmaddubsw's int16 pair sums would saturate at 255 x 127
// x 2): the same packed panels, weights widened to int16 on the fly and the activations widened once
// per call, so vpmaddwd adds each pair of products exactly into an int32 lane. One 16-byte chunk of a
// panel's 64-byte quad holds 4 inputs of 4 output rows; widened and multiplied by the row's 4 inputs
// (broadcast), its 8 lanes are 2 partial sums per output row, added pairwise at the end. The same
// int32 sums as the other paths, so the same outputs, bit for bit.
// A sweep over the panel covers C of its 4 chunks (16 vector registers: M x C accumulators + C
// weights + 1 broadcast), the later sweeps reading the panel from cache.
template <int M, int C>
SK_AVX2 void gemv_avx2(const int8_t* wq, const float* sw, const int32_t* wsum, const int16_t* a16, const float* sa,
                       const int32_t* za, float* out, int64_t N, int64_t Kp, int64_t p0, int64_t p1) {
  const int64_t Q = Kp / QUAD;
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* panel = wq + p * Kp * PANEL;
    for (int c0 = 0; c0 < PANEL / QUAD; c0 += C) {
      __m256i acc[M][C];
      for (int m = 0; m < M; ++m)
        for (int t = 0; t < C; ++t) acc[m][t] = _mm256_setzero_si256();
      for (int64_t q = 0; q < Q; ++q) {
        const int8_t* block = panel + (q * PANEL + c0 * QUAD) * QUAD;  // chunk c0 of quad q
        if (c0 == 0)  // the first sweep streams the panel from memory, the later ones read it from cache
          _mm_prefetch(reinterpret_cast<const char*>(panel + (q + PREFETCH_QUADS) * PANEL * QUAD), _MM_HINT_T0);
        __m256i w[C];
        for (int t = 0; t < C; ++t)
          w[t] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + t * QUAD * QUAD)));
        for (int m = 0; m < M; ++m) {
          int64_t four;  // the row's 4 inputs of this quad, int16
          std::memcpy(&four, a16 + m * Kp + q * QUAD, sizeof(four));
          const __m256i a = _mm256_set1_epi64x(four);
          for (int t = 0; t < C; ++t) acc[m][t] = _mm256_add_epi32(acc[m][t], _mm256_madd_epi16(w[t], a));
        }
      }
      for (int t = 0; t < C; ++t) {
        const int64_t n = p * PANEL + (c0 + t) * QUAD;  // the chunk's 4 output rows
        if (n >= N) break;
        const int64_t real = std::min<int64_t>(QUAD, N - n);
        float tail_sw[QUAD] = {}, tail_y[QUAD];
        int32_t tail_ws[QUAD] = {};
        std::memcpy(tail_sw, sw + n, real * sizeof(float));  // the chunk's real rows (zero past N)
        std::memcpy(tail_ws, wsum + n, real * sizeof(int32_t));
        const __m128 swv = _mm_loadu_ps(tail_sw);
        const __m128i wsv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tail_ws));
        for (int m = 0; m < M; ++m) {
          const __m256i h = _mm256_hadd_epi32(acc[m][t], acc[m][t]);  // [r0 r1 r0 r1 | r2 r3 r2 r3]
          const __m128i dot = _mm_unpacklo_epi64(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
          const __m128i d = _mm_sub_epi32(dot, _mm_mullo_epi32(_mm_set1_epi32(za[m]), wsv));
          const __m128 y = _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(sa[m]), swv), _mm_cvtepi32_ps(d));
          if (real == QUAD) {
            _mm_storeu_ps(out + m * N + n, y);
          } else {
            _mm_storeu_ps(tail_y, y);
            std::memcpy(out + m * N + n, tail_y, real * sizeof(float));
          }
        }
      }
    }
  }
}

// M (1..ROWS) activation rows a pass: all 4 chunks of a panel in one sweep up to 2 rows, 2 up to 4, then 1.
void gemv_avx2_rows(int64_t M, const int8_t* wq, const float* sw, const int32_t* wsum, const int16_t* a16,
                    const float* sa, const int32_t* za, float* out, int64_t N, int64_t Kp, int64_t p0, int64_t p1) {
  switch (M) {
    case 1: return gemv_avx2<1, 4>(wq, sw, wsum, a16, sa, za, out, N, Kp, p0, p1);
    case 2: return gemv_avx2<2, 4>(wq, sw, wsum, a16, sa, za, out, N, Kp, p0, p1);
    case 3: return gemv_avx2<3, 2>(wq, sw, wsum, a16, sa, za, out, N, Kp, p0, p1);
    case 4: return gemv_avx2<4, 2>(wq, sw, wsum, a16, sa, za, out, N, Kp, p0, p1);
    case 5: return gemv_avx2<5, 1>(wq, sw, wsum, a16, sa, za, out, N, Kp, p0, p1);
    case 6: return gemv_avx2<6, 1>(wq, sw, wsum, a16, sa, za, out, N, Kp, p0, p1);
    case 7: return gemv_avx2<7, 1>(wq, sw, wsum, a16, sa, za, out, N, Kp, p0, p1);
    default: return gemv_avx2<8, 1>(wq, sw, wsum, a16, sa, za, out, N, Kp, p0, p1);
  }
}
#endif

}  // namespace

// Which path w8a8_linear takes here: AVX-512 VNNI, else AVX2, else the portable loop (SPECDEC_CPU_SIMD:
// "0" the portable loop, "avx2" at most AVX2).
const char* w8a8_path() {
#ifdef SK_HAVE_AVX512_W8
  static const bool vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  if (vnni && sk::simd::env_allows_avx512()) return "avx512-vnni";
#endif
#ifdef SK_HAVE_AVX2_PATH
  if (sk::simd::enabled()) return "avx2";
#endif
  return "portable";
}

bool w8a8_fast_path() { return std::strcmp(w8a8_path(), "portable") != 0; }

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& sw, const at::Tensor& wsum,
                       const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && wq.device().is_cpu() && sw.device().is_cpu() && wsum.device().is_cpu(),
              "w8a8_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "w8a8_linear: x must be [M, K] fp32 contiguous");
  const int64_t M = x.size(0), K = x.size(1), Kp = padded(K), P = (N + PANEL - 1) / PANEL;
  TORCH_CHECK(K <= MAX_K, "w8a8_linear: in_features must be <= ", MAX_K, ", got ", K);  // 0: outputs the bias
  TORCH_CHECK(N >= 0, "w8a8_linear: out_features must be >= 0");
  TORCH_CHECK(wq.dim() == 2 && wq.scalar_type() == at::kChar && wq.is_contiguous() && wq.size(0) == P &&
                  wq.size(1) == Kp * PANEL,
              "w8a8_linear: wq must be [", P, ", ", Kp * PANEL, "] int8 contiguous (cpu_int8.pack_int8's panels)");
  TORCH_CHECK(sw.dim() == 1 && sw.scalar_type() == at::kFloat && sw.is_contiguous() && sw.size(0) == P * PANEL,
              "w8a8_linear: sw must be [", P * PANEL, "] fp32 contiguous");
  TORCH_CHECK(wsum.dim() == 1 && wsum.scalar_type() == at::kInt && wsum.is_contiguous() && wsum.size(0) == P * PANEL,
              "w8a8_linear: wsum must be [", P * PANEL, "] int32 contiguous");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "w8a8_linear: bias must be [N]");
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  auto byte = x.options().dtype(at::kByte);
  auto aq = Kp != K ? at::zeros({M, Kp}, byte) : at::empty({M, Kp}, byte);
  auto sa = at::empty({M}, x.options());
  auto za = at::empty({M}, x.options().dtype(at::kInt));
  quantize_rows(x.data_ptr<float>(), M, K, Kp, aq.data_ptr<uint8_t>(), sa.data_ptr<float>(), za.data_ptr<int32_t>());
  const char* path = w8a8_path();
  const bool vnni = std::strcmp(path, "avx512-vnni") == 0, avx2 = std::strcmp(path, "avx2") == 0;
  at::Tensor a16;  // the AVX2 path's activations widened to int16 [M, Kp]
  if (avx2) a16 = aq.to(at::kShort);
  const int8_t* w = wq.data_ptr<int8_t>();
  const float* s = sw.data_ptr<float>();
  const int32_t* ws = wsum.data_ptr<int32_t>();
  const uint8_t* a = aq.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {  // a task's panels stay in cache over the row passes
      const int64_t rows = std::min<int64_t>(ROWS, M - m0);
      const float* sa_m = sa.data_ptr<float>() + m0;
      const int32_t* za_m = za.data_ptr<int32_t>() + m0;
#ifdef SK_HAVE_AVX512_W8
      if (vnni) {
        gemv_vnni_rows(rows, w, s, ws, a + m0 * Kp, sa_m, za_m, y + m0 * N, N, Kp, p0, p1);
        continue;
      }
#endif
#ifdef SK_HAVE_AVX2_PATH
      if (avx2) {
        gemv_avx2_rows(rows, w, s, ws, a16.data_ptr<int16_t>() + m0 * Kp, sa_m, za_m, y + m0 * N, N, Kp, p0, p1);
        continue;
      }
#endif
      gemv_scalar(w, s, ws, a + m0 * Kp, sa_m, za_m, y + m0 * N, rows, N, Kp, p0, p1);
    }
  });
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  return out;
}
