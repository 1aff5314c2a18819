// fp32 linear layers of CPU models at the machine's read bandwidth (specdec_kernels/hf/cpu_f32.py).
// A decoding or verification forward of an fp32 target streams every weight once for a few rows;
// oneDNN's inner product reads them at ~70% of the bandwidth a plain stream gets on the 2-core AMD
// EPYC (AVX-512), and its row blocking makes 9 rows cost ~1.5x one. Here one 64-byte weight load feeds
// one FMA per row: memory-bound up to ~8 rows, then the FMA port's limit (panels_for, PREFETCH).
//
// Weights (packed in Python, cpu_f32.pack_f32): output rows in panels of PANEL = 16 (zero rows past N);
// panel p is [K][16]: for each input k the 16 rows' weights, one vector, read front to back.
//
// Sums: output (m, n) is acc = 0; for k = 0 .. K-1: acc = fma(w[n, k], x[m, k], acc); then acc + b[n].
// That order is the same for every row count, panel grouping, thread split and path (the AVX-512 and
// AVX2 lanes and the portable loop's std::fma round alike), so a row's result never depends on the other rows
// of the call: a verification forward's row is bit-identical to the one-token forward's.
#include "f32_linear.h"

#include <ATen/Parallel.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#define SK_HAVE_AVX512_F32 1
#include <immintrin.h>
#define SK_AVX512_F32 __attribute__((target("avx512f")))
#endif

namespace {

constexpr int64_t PANEL = 16;  // output rows interleaved in a packed panel (one fp32 vector's lanes)
constexpr int64_t ROWS = 12;   // input rows per pass: 12 x 2 accumulators + 2 weights + 1 broadcast <= 32

// Panels a pass of `rows` rows reads side by side: each weight vector loaded feeds `rows` FMAs per
// panel, and more panels mean fewer passes over the inputs' broadcasts per weight byte, while
// rows x panels accumulators + one weight per panel + one broadcast fit the 32 vector registers
// (6 x 4, 9 x 3, 12 x 2). Measured on the 2-core AMD EPYC, 1 thread, 8960 x 1536 and 1536 x 8960
// layers streamed: 5-6 rows 15-19% faster with 4 panels than 2, 7-9 rows 5-14% with 3.
constexpr int64_t panels_for(int64_t rows) { return rows <= 6 ? 4 : rows <= 9 ? 3 : 2; }
// Passes of more than PREFETCH_ROWS rows prefetch each panel PREFETCH inputs (64-byte vectors) ahead:
// at 5-12 rows the FMAs between two loads of a panel leave the hardware prefetcher behind (4-10%
// faster at 8-9 rows there, 10-16% at 10-12); at 1-4 rows it keeps up and a prefetch is only one
// more instruction.
constexpr int64_t PREFETCH = 8;
constexpr int PREFETCH_ROWS = 4;

// The portable path for panels [p, p + np), rows [0, M): the same sums, lane by lane.
void panels_scalar(const float* w, int64_t K, const float* x, float* y, int64_t M, int64_t N, int64_t p, int64_t np,
                   const float* bias) {
  for (int64_t t = 0; t < np; ++t) {
    const float* panel = w + (p + t) * K * PANEL;
    for (int64_t j = 0; j < PANEL; ++j) {
      const int64_t n = (p + t) * PANEL + j;
      if (n >= N) break;
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc = std::fma(panel[k * PANEL + j], x[m * K + k], acc);
        y[m * N + n] = bias != nullptr ? acc + bias[n] : acc;
      }
    }
  }
}

#ifdef SK_HAVE_AVX512_F32
// M rows times NP panels (p .. p + NP - 1, all < P): one weight vector per panel and input, the input
// broadcast, one FMA per row and panel; the accumulators stay in registers to the end of K.
template <int M, int NP>
SK_AVX512_F32 void panels_avx512(const float* w, int64_t K, const float* x, float* y, int64_t N, int64_t p,
                                 const float* bias) {
  __m512 acc[M][NP];
  for (int m = 0; m < M; ++m)
    for (int t = 0; t < NP; ++t) acc[m][t] = _mm512_setzero_ps();
  const float* panel = w + p * K * PANEL;
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NP];
    for (int t = 0; t < NP; ++t) wv[t] = _mm512_loadu_ps(panel + (t * K + k) * PANEL);
    if constexpr (M > PREFETCH_ROWS) {  // (past a panel's end: a hint, never a fault)
      for (int t = 0; t < NP; ++t)
        _mm_prefetch(reinterpret_cast<const char*>(panel + (t * K + k + PREFETCH) * PANEL), _MM_HINT_T0);
    }
    for (int m = 0; m < M; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * K + k]);
      for (int t = 0; t < NP; ++t) acc[m][t] = _mm512_fmadd_ps(wv[t], xb, acc[m][t]);
    }
  }
  for (int t = 0; t < NP; ++t) {
    const int64_t n = (p + t) * PANEL;
    const __mmask16 real =
        n + PANEL <= N ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (N - n)) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(real, bias + n) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) {
      const __m512 out = bias != nullptr ? _mm512_add_ps(acc[m][t], b) : acc[m][t];
      _mm512_mask_storeu_ps(y + m * N + n, real, out);
    }
  }
}

template <int M>
void panels_avx512_np(int64_t np, const float* w, int64_t K, const float* x, float* y, int64_t N, int64_t p,
                      const float* bias) {
  if constexpr (panels_for(M) >= 4) {
    if (np == 4) return panels_avx512<M, 4>(w, K, x, y, N, p, bias);
  }
  if constexpr (panels_for(M) >= 3) {
    if (np == 3) return panels_avx512<M, 3>(w, K, x, y, N, p, bias);
  }
  if (np == 2) return panels_avx512<M, 2>(w, K, x, y, N, p, bias);
  return panels_avx512<M, 1>(w, K, x, y, N, p, bias);
}

// rows (1 .. ROWS) x np (1, 2 or panels_for(rows)) panels from p.
void panels_fast(int64_t rows, int64_t np, const float* w, int64_t K, const float* x, float* y, int64_t N, int64_t p,
                 const float* bias) {
  switch (rows) {
    case 1: return panels_avx512_np<1>(np, w, K, x, y, N, p, bias);
    case 2: return panels_avx512_np<2>(np, w, K, x, y, N, p, bias);
    case 3: return panels_avx512_np<3>(np, w, K, x, y, N, p, bias);
    case 4: return panels_avx512_np<4>(np, w, K, x, y, N, p, bias);
    case 5: return panels_avx512_np<5>(np, w, K, x, y, N, p, bias);
    case 6: return panels_avx512_np<6>(np, w, K, x, y, N, p, bias);
    case 7: return panels_avx512_np<7>(np, w, K, x, y, N, p, bias);
    case 8: return panels_avx512_np<8>(np, w, K, x, y, N, p, bias);
    case 9: return panels_avx512_np<9>(np, w, K, x, y, N, p, bias);
    case 10: return panels_avx512_np<10>(np, w, K, x, y, N, p, bias);
    case 11: return panels_avx512_np<11>(np, w, K, x, y, N, p, bias);
    default: return panels_avx512_np<12>(np, w, K, x, y, N, p, bias);
  }
}
#endif

#ifdef SK_HAVE_AVX2_PATH
// The AVX2 path (CPUs without AVX-512): a panel's 16 rows are two 8-lane vectors per input, each
// lane the same FMA chain as above. M x NP x 2 accumulators + one panel's 2 weights + 1 broadcast fit
// the 16 vector registers: up to 6 rows a sub-pass (AVX2_ROWS), two panels side by side up to 3 rows.
// Measured on a Zen 3 EPYC (1 thread, 8960 x 1536 streamed): 3 rows 5.9 -> 4.6 ms with two panels
// (1 row 4.2); sub-passes of 3 rows, two panels each, were 15-25% slower at 4-12 rows than of 6.
constexpr int64_t AVX2_ROWS = 6;
// prefetch distance in inputs (64-byte vectors) of each panel, at every row count: prefetching 8
// ahead took the 151,936 x 1536 layer at 4 rows from 96 to 78 ms; 32 and 64 were alike at 1-12 rows
constexpr int64_t AVX2_PREFETCH = 32;

template <int M, int NP>
SK_AVX2 void panels_avx2(const float* w, int64_t K, const float* x, float* y, int64_t N, int64_t p,
                         const float* bias) {
  __m256 acc[M][NP][2];
  for (int m = 0; m < M; ++m)
    for (int t = 0; t < NP; ++t) acc[m][t][0] = acc[m][t][1] = _mm256_setzero_ps();
  const float* panel = w + p * K * PANEL;
  for (int64_t k = 0; k < K; ++k) {
    for (int t = 0; t < NP; ++t)
      _mm_prefetch(reinterpret_cast<const char*>(panel + (t * K + k + AVX2_PREFETCH) * PANEL), _MM_HINT_T0);
    for (int t = 0; t < NP; ++t) {  // one panel's two weight vectors live at a time
      const __m256 w0 = _mm256_loadu_ps(panel + (t * K + k) * PANEL);
      const __m256 w1 = _mm256_loadu_ps(panel + (t * K + k) * PANEL + PANEL / 2);
      for (int m = 0; m < M; ++m) {
        const __m256 xb = _mm256_set1_ps(x[m * K + k]);
        acc[m][t][0] = _mm256_fmadd_ps(w0, xb, acc[m][t][0]);
        acc[m][t][1] = _mm256_fmadd_ps(w1, xb, acc[m][t][1]);
      }
    }
  }
  for (int t = 0; t < NP; ++t) {
    for (int h = 0; h < 2; ++h) {
      const int64_t n = (p + t) * PANEL + h * (PANEL / 2);
      if (n >= N) break;
      const int64_t real = std::min<int64_t>(PANEL / 2, N - n);
      float b[PANEL / 2] = {}, tail[PANEL / 2];
      if (bias != nullptr) std::copy(bias + n, bias + n + real, b);
      const __m256 bv = _mm256_loadu_ps(b);
      for (int m = 0; m < M; ++m) {
        const __m256 out = bias != nullptr ? _mm256_add_ps(acc[m][t][h], bv) : acc[m][t][h];
        if (real == PANEL / 2) {
          _mm256_storeu_ps(y + m * N + n, out);
        } else {
          _mm256_storeu_ps(tail, out);
          std::copy(tail, tail + real, y + m * N + n);
        }
      }
    }
  }
}

template <int M>
void panels_avx2_np(int64_t np, const float* w, int64_t K, const float* x, float* y, int64_t N, int64_t p,
                    const float* bias) {
  int64_t t = 0;
  if constexpr (M <= 3) {
    for (; t + 2 <= np; t += 2) panels_avx2<M, 2>(w, K, x, y, N, p + t, bias);
  }
  for (; t < np; ++t) panels_avx2<M, 1>(w, K, x, y, N, p + t, bias);
}

// rows (1 .. ROWS) x np panels from p, in sub-passes of at most AVX2_ROWS rows (as even as they come).
void panels_avx2_rows(int64_t rows, int64_t np, const float* w, int64_t K, const float* x, float* y, int64_t N,
                      int64_t p, const float* bias) {
  const int64_t subs = (rows + AVX2_ROWS - 1) / AVX2_ROWS, per = (rows + subs - 1) / subs;
  for (int64_t m0 = 0; m0 < rows; m0 += per) {
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    switch (std::min(per, rows - m0)) {
      case 1: panels_avx2_np<1>(np, w, K, xm, ym, N, p, bias); break;
      case 2: panels_avx2_np<2>(np, w, K, xm, ym, N, p, bias); break;
      case 3: panels_avx2_np<3>(np, w, K, xm, ym, N, p, bias); break;
      case 4: panels_avx2_np<4>(np, w, K, xm, ym, N, p, bias); break;
      case 5: panels_avx2_np<5>(np, w, K, xm, ym, N, p, bias); break;
      default: panels_avx2_np<6>(np, w, K, xm, ym, N, p, bias); break;
    }
  }
}
#endif

}  // namespace

// Which path f32_linear runs here: AVX-512, else AVX2 (with FMA), else the portable loop
// (SPECDEC_CPU_SIMD: "0" the portable loop, "avx2" at most AVX2).
const char* f32_linear_path() {
#ifdef SK_HAVE_AVX512_F32
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512 && sk::simd::env_allows_avx512()) return "avx512";
#endif
#ifdef SK_HAVE_AVX2_PATH
  if (sk::simd::enabled()) return "avx2";
#endif
  return "portable";
}

bool f32_linear_fast_path() { return std::strcmp(f32_linear_path(), "portable") != 0; }

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && wp.device().is_cpu(), "f32_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "f32_linear: x must be [M, K] fp32 contiguous");
  TORCH_CHECK(N >= 0, "f32_linear: out_features must be >= 0");
  const int64_t M = x.size(0), K = x.size(1), P = (N + PANEL - 1) / PANEL;
  TORCH_CHECK(wp.dim() == 2 && wp.scalar_type() == at::kFloat && wp.is_contiguous() && wp.size(0) == P &&
                  wp.size(1) == K * PANEL,
              "f32_linear: wp must be [", P, ", ", K * PANEL, "] fp32 contiguous (cpu_f32.pack_f32's panels)");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "f32_linear: bias must be [N] fp32 contiguous");
    TORCH_CHECK(bias->device().is_cpu(), "f32_linear: CPU tensors only");
    b = bias->data_ptr<float>();
  }
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const char* path = f32_linear_path();
  const bool avx512 = std::strcmp(path, "avx512") == 0, avx2 = std::strcmp(path, "avx2") == 0;
  const float* w = wp.data_ptr<float>();
  const float* xs = x.data_ptr<float>();
  float* y = out.data_ptr<float>();
  // Row passes of at most ROWS rows, as even as they come; a group of panels is read by every pass
  // in turn (from cache after the first) before the next group.
  const int64_t passes = (M + ROWS - 1) / ROWS, per_pass = (M + passes - 1) / passes;
  const int64_t group = panels_for(per_pass);
  at::parallel_for(0, (P + group - 1) / group, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * group, np = std::min(group, P - p);
      for (int64_t m0 = 0; m0 < M; m0 += per_pass) {
        const int64_t rows = std::min(per_pass, M - m0);
#ifdef SK_HAVE_AVX512_F32
        if (avx512) {
          int64_t done = 0;  // the group's panels in widths group / 2 / 1 (a tail group may be short)
          for (const int64_t width : {group, int64_t{2}, int64_t{1}}) {
            for (; done + width <= np; done += width)
              panels_fast(rows, width, w, K, xs + m0 * K, y + m0 * N, N, p + done, b);
          }
          continue;
        }
#endif
#ifdef SK_HAVE_AVX2_PATH
        if (avx2) {
          panels_avx2_rows(rows, np, w, K, xs + m0 * K, y + m0 * N, N, p, b);
          continue;
        }
#endif
        panels_scalar(w, K, xs + m0 * K, y + m0 * N, rows, N, p, np, b);
      }
    }
  });
  return out;
}
