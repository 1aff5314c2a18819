// What the native CPU kernels share about their SIMD paths: the switch SPECDEC_CPU_SIMD=0 (the
// portable loops, read per call), and on x86-64 the AVX2 attribute, SLEEF's vector exp / log and the
// AVX2 check. The verify core's AVX2 paths (verify_cpu_simd.h) and the int8 / int4 draft layers
// (int8_linear.cpp, int4_linear.cpp: their own AVX-512 checks) use it.
#pragma once

#include <cstdlib>
#include <cstring>

namespace sk {
namespace simd {

// SPECDEC_CPU_SIMD is not "0": a kernel may take its SIMD path (if the CPU has the instructions).
inline bool env_allows() {
  const char* env = std::getenv("SPECDEC_CPU_SIMD");
  return !(env != nullptr && env[0] == '0');
}

// SPECDEC_CPU_SIMD is neither "0" nor "avx2": a kernel with an AVX-512 path and an AVX2 one may take
// the AVX-512 path ("avx2" runs the AVX2 path on a CPU that has both: tests check all three paths).
inline bool env_allows_avx512() {
  const char* env = std::getenv("SPECDEC_CPU_SIMD");
  return env_allows() && !(env != nullptr && std::strcmp(env, "avx2") == 0);
}

}  // namespace simd
}  // namespace sk

#if defined(__x86_64__) && defined(__GNUC__)
#define SK_HAVE_AVX2_PATH 1
#include <immintrin.h>

extern "C" {
// SLEEF's dispatching entry points, exported by libtorch_cpu (declared here: sleef.h hides the
// __m256 overloads from a translation unit compiled without -mavx).
__m256 Sleef_expf8_u10(__m256);
__m256 Sleef_logf8_u10(__m256);
}

#define SK_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace sk {
namespace simd {

// Whether the AVX2 paths run: the CPU has the instructions and SPECDEC_CPU_SIMD is not "0".
inline bool enabled() {
  static const bool cpu_ok =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return cpu_ok && env_allows();
}

}  // namespace simd
}  // namespace sk
#endif  // x86-64
