// Per-row math of chain verification, shared by the CUDA kernels (verify_cuda.cu) and the
// sequential CPU build (verify_cpu.cpp) that tests them without a GPU.
//
// Everything here is a __host__ __device__ function (SK_HD), so g++ compiles the very code the
// CUDA kernels run. The three "programs" at the bottom are the bodies of the three kernels; they
// are written against a Reducer that abstracts the threads of one program:
//
//   rank(), size()      this thread's index and the number of threads; element loops stride by size()
//   sum(v), max(v)      reductions over the threads, result returned to every thread
//   argmax(key, idx)    max key, lowest index among equal keys, returned to every thread
//
// The CUDA Reducer is a thread block (shared memory + warp shuffles); the CPU Reducer is a single
// thread for which every reduction is the identity. Reductions must be reached by all threads of
// a program: every branch around them depends on per-row values only.
//
// Conventions (identical to the Triton kernels, specdec_kernels/ops/_triton_helpers.py, and to the
// reference, specdec_kernels/reference/{philox,sampling}.py):
//   * Philox4x32-10 keyed by the request's 64-bit seed (k0 = low word, k1 = high word), counter
//     (c0, c1, c2, 0) = (vocab index / 4 or 0, row, purpose);
//   * uniform u = ((bits >> 9) + 0.5) * 2^-23, strictly inside (0, 1);
//   * accept test: u = word 0 of Philox(seed; 0, i, ACCEPT); accept iff u * q(x) <= p(x) and p(x) > 0;
//   * exponential race: vocab entry x gets word x % 4 of Philox(seed; x / 4, row, purpose) and
//     key log w(x) - log(-log u_x); the argmax (lowest index on ties) samples norm(w);
//   * scalar seeds are mixed per request exactly like request_seed();
//   * logits are read as fp32 with NaN / +inf -> -inf (counted, flagged);
//   * draft probabilities are read as fp32 with NaN / +inf / negative -> 0 (counted, flagged).
#pragma once

#include <stdint.h>

#include <cmath>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define SK_HD __host__ __device__ __forceinline__
#define SK_UNROLL _Pragma("unroll")
#else
#define SK_HD inline
#define SK_UNROLL
#endif

namespace sk {

constexpr uint32_t PURPOSE_ACCEPT = 0;
constexpr uint32_t PURPOSE_RECOVER = 1;
constexpr uint32_t PURPOSE_BONUS = 2;

constexpr int DRAFT_NONE = 0;    // one-hot q on the draft token
constexpr int DRAFT_LOGITS = 1;  // raw draft logits, processed like the target
constexpr int DRAFT_PROBS = 2;   // the probabilities the draft sampled from

constexpr int DTYPE_F32 = 0;
constexpr int DTYPE_F16 = 1;
constexpr int DTYPE_BF16 = 2;

constexpr int NUM_STATS = 7;  // per (row, chunk): m_t, z_t, m_q, z_q, g_max, bad target, bad draft (logits or probs)
constexpr int32_t NO_INDEX = 2147483647;

// ------------------------------------------------------------------------------------------
// scalars

SK_HD float neg_inf() { return -INFINITY; }

SK_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
#endif
}

SK_HD float bits_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
#endif
}

// Storage types of the 16-bit floats (raw bits, so the header needs no CUDA types on the host).
struct f16 {
  uint16_t bits;
};
struct bf16 {
  uint16_t bits;
};

SK_HD float to_float(float x) { return x; }
SK_HD float to_float(bf16 x) { return bits_float(uint32_t(x.bits) << 16); }
SK_HD float to_float(f16 x) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(x.bits));
#else
  const uint32_t sign = uint32_t(x.bits >> 15) << 31;
  const uint32_t exp = (x.bits >> 10) & 0x1F;
  const uint32_t mant = x.bits & 0x3FF;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in fp32
    const float v = std::ldexp(float(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7F800000u | (mant << 13));  // inf / nan
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
#endif
}

// A logit with NaN / +inf replaced by -inf; `bad` counts replacements.
SK_HD float sanitize_logit(float v, int& bad) {
  const bool is_bad = (v != v) || v == INFINITY;
  bad += is_bad ? 1 : 0;
  return is_bad ? neg_inf() : v;
}

// Grammar masks (token_bitmask=, specdec_kernels/_bitmask.py): int32 words, bit j of word w set =
// token 32 w + j allowed; a null row allows everything. A disallowed logit is read as -inf before
// anything else (sanitising included: a disallowed NaN is no non-finite entry), exactly what the
// backends without a native mask see in their masked copy of the rows.
SK_HD bool token_allowed(const int32_t* words, int64_t x) {
  return words == nullptr || ((uint32_t(words[x >> 5]) >> (x & 31)) & 1u) != 0;
}
SK_HD float mask_logit(float v, const int32_t* words, int64_t x) { return token_allowed(words, x) ? v : neg_inf(); }

// mask_logit on the run v = row[x0 .. x0 + N - 1] (x0 % N == 0, N <= 32: one word holds the run).
template <int N>
SK_HD void mask_run(const int32_t* words, int64_t x0, float (&v)[N]) {
  if (words == nullptr) return;
  const uint32_t bits = uint32_t(words[x0 >> 5]) >> (x0 & 31);
  for (int e = 0; e < N; ++e) v[e] = ((bits >> e) & 1u) ? v[e] : neg_inf();
}

// fp32 logit with NaN / +inf replaced by -inf; `bad` counts replacements.
template <class T>
SK_HD float load_logit(const T* row, int64_t x, int& bad) {
  return sanitize_logit(to_float(row[x]), bad);
}

// The raw values row[x0 .. x0 + 7] as fp32 (entries at or past `end`: -inf). On the GPU a whole,
// aligned run is 128-bit loads: one for 16-bit types, two for fp32.
template <class T>
SK_HD void load_oct(const T* row, int64_t x0, int64_t end, float (&v)[8]) {
#if defined(__CUDA_ARCH__)
  const T* p = row + x0;
  if (x0 + 8 <= end && reinterpret_cast<uintptr_t>(p) % 16 == 0) {
    if constexpr (sizeof(T) == 2) {
      const uint4 w = *reinterpret_cast<const uint4*>(p);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
      for (int e = 0; e < 4; ++e) {
        v[2 * e] = to_float(T{uint16_t(words[e] & 0xFFFFu)});
        v[2 * e + 1] = to_float(T{uint16_t(words[e] >> 16)});
      }
    } else {
      const float4 a = reinterpret_cast<const float4*>(p)[0];
      const float4 b = reinterpret_cast<const float4*>(p)[1];
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
      v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    }
    return;
  }
#endif
  for (int e = 0; e < 8; ++e) v[e] = x0 + e < end ? to_float(row[x0 + e]) : neg_inf();
}

// The raw values row[x0 .. x0 + 3] as fp32 (entries at or past `end`: -inf). On the GPU a whole,
// aligned quad is one vector load (8 bytes for 16-bit types, 16 for fp32) instead of four.
template <class T>
SK_HD void load_quad(const T* row, int64_t x0, int64_t end, float (&v)[4]) {
#if defined(__CUDA_ARCH__)
  const T* p = row + x0;
  if (x0 + 4 <= end && reinterpret_cast<uintptr_t>(p) % (4 * sizeof(T)) == 0) {
    if constexpr (sizeof(T) == 2) {
      const uint2 w = *reinterpret_cast<const uint2*>(p);
      v[0] = to_float(T{uint16_t(w.x & 0xFFFFu)});
      v[1] = to_float(T{uint16_t(w.x >> 16)});
      v[2] = to_float(T{uint16_t(w.y & 0xFFFFu)});
      v[3] = to_float(T{uint16_t(w.y >> 16)});
    } else {
      const float4 w = *reinterpret_cast<const float4*>(p);
      v[0] = w.x;
      v[1] = w.y;
      v[2] = w.z;
      v[3] = w.w;
    }
    return;
  }
#endif
  for (int e = 0; e < 4; ++e) v[e] = x0 + e < end ? to_float(row[x0 + e]) : neg_inf();
}

// fp32 draft probability with NaN / +inf / negative replaced by 0 (no probability: the accept
// ratio and the residual count it as 0); `bad` counts replacements.
template <class T>
SK_HD float load_prob(const T* row, int64_t x, int& bad) {
  const float v = to_float(row[x]);
  const bool is_bad = !(v >= 0.0f && v < INFINITY);  // NaN fails both comparisons
  bad += is_bad ? 1 : 0;
  return is_bad ? 0.0f : v;
}

// The max to subtract before exp: -inf (nothing kept yet) subtracts 0, not -inf.
SK_HD float safe_max(float m) { return m == neg_inf() ? 0.0f : m; }

// int32 key with the order of the float32 values (radix select of thresholds).
SK_HD int32_t order_key(float x) {
  const int32_t b = int32_t(float_bits(x));
  return b < 0 ? (b ^ 0x7FFFFFFF) : b;
}

SK_HD float key_to_float(int64_t key) {
  const int32_t k = int32_t(key);
  return bits_float(uint32_t(k < 0 ? (k ^ 0x7FFFFFFF) : k));
}

// (greedy, 1 / T): greedy rows (T = 0) get 1 so that nothing divides by zero.
// T below the smallest normal float (1/T overflows; validation rejects it) and NaN act as greedy.
SK_HD bool greedy_temperature(float temperature) { return !(temperature >= 1.17549435e-38f); }
SK_HD float inverse_temperature(float temperature) {
  return greedy_temperature(temperature) ? 1.0f : 1.0f / temperature;
}

// ------------------------------------------------------------------------------------------
// random numbers

struct Philox4 {
  uint32_t w[4];
};

SK_HD uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return uint32_t((uint64_t(a) * uint64_t(b)) >> 32);
#endif
}

// Philox4x32-10's round multipliers and key increments (Salmon et al. 2011; tl.philox's).
constexpr uint32_t PHILOX_M0 = 0xD2511F53u, PHILOX_M1 = 0xCD9E8D57u;
constexpr uint32_t PHILOX_W0 = 0x9E3779B9u, PHILOX_W1 = 0xBB67AE85u;
constexpr int PHILOX_ROUNDS = 10;

// Philox4x32-10 with key = seed (k0 low word, k1 high word); bit-identical to tl.philox.
SK_HD Philox4 philox(int64_t seed, uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) {
  uint32_t k0 = uint32_t(uint64_t(seed));
  uint32_t k1 = uint32_t(uint64_t(seed) >> 32);
  SK_UNROLL
  for (int r = 0; r < PHILOX_ROUNDS; ++r) {
    const uint32_t hi_b = mulhi32(PHILOX_M1, c2), lo_b = PHILOX_M1 * c2;
    const uint32_t hi_a = mulhi32(PHILOX_M0, c0), lo_a = PHILOX_M0 * c0;
    const uint32_t n0 = hi_b ^ c1 ^ k0;
    const uint32_t n2 = hi_a ^ c3 ^ k1;
    c1 = lo_b;
    c3 = lo_a;
    c0 = n0;
    c2 = n2;
    k0 += PHILOX_W0;
    k1 += PHILOX_W1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// uint32 -> uniform on (0, 1): ((bits >> 9) + 0.5) * 2^-23 (exact in fp32, never 0 or 1).
SK_HD float uniform_from_bits(uint32_t bits) { return (float(bits >> 9) + 0.5f) * 1.1920928955078125e-07f; }

// Uniform from Philox(seed; c0, c1, c2, 0), word 0.
SK_HD float uniform_open(int64_t seed, uint32_t c0, uint32_t c1, uint32_t c2) {
  return uniform_from_bits(philox(seed, c0, c1, c2, 0).w[0]);
}

// -log(E), E ~ Exp(1), from a uniform: the race noise.
SK_HD float race_noise_from_uniform(float u) { return -logf(-logf(u)); }

// The Philox key of request b: the given per-request seed, or mixed from the scalar seed exactly
// like request_seed() in the Triton kernels (int64 arithmetic wraps; the shift is arithmetic).
SK_HD int64_t request_seed(const int64_t* seeds, int64_t scalar, int64_t b) {
  if (seeds != nullptr) return seeds[b];
  const uint64_t x = uint64_t(b + scalar) * 0x5851F42D4C957F2DULL + 0x14057B7EF767814FULL;
  const int64_t s = int64_t(x);
  return s ^ (s >> 29);
}

// ------------------------------------------------------------------------------------------
// online softmax and argmax

// Running (max, sum of exp((x - max) / T)) of one thread; x = -inf entries contribute nothing.
// W: the type z is summed in, the reducer's Wide (a CPU thread adds all V terms of a row in
// sequence: in float32 those sums came out ~1.6e-4 low at V = 152k, so the CPU sums in double; a
// GPU thread adds V / blockDim terms and stays float). Merges and reductions are float.
template <class W = float>
struct SoftmaxAcc {
  float m = neg_inf();
  W z = 0.0f;

  SK_HD void add(float x, float inv_t) {
    if (x > m) {
      z = z * W(expf((m - x) * inv_t)) + W(1.0f);  // m = -inf: exp(-inf) = 0 and z = 0
      m = x;
    } else if (x > neg_inf()) {
      z += W(expf((x - m) * inv_t));
    }
  }

  // Merge another (max, sum-exp) pair (a chunk's statistics).
  SK_HD void merge(float m_c, float z_c, float inv_t) {
    const float m_new = m > m_c ? m : m_c;
    const float ref = safe_max(m_new);
    z = z * W(expf((m - ref) * inv_t)) + W(z_c * expf((m_c - ref) * inv_t));
    m = m_new;
  }

  // Combine the threads of a program: every thread gets the program's (max, sum-exp).
  template <class R>
  SK_HD void reduce(R& red, float inv_t) {
    const float m_all = red.max(m);
    const float ref = safe_max(m_all);
    z = W(red.sum(float(z * W(expf((m - ref) * inv_t)))));
    m = m_all;
  }
};
using Softmax = SoftmaxAcc<float>;

// Running (max, lowest index of the max): strict > keeps the earlier entry on ties.
struct Argmax {
  float key = neg_inf();
  int32_t idx = NO_INDEX;

  SK_HD void add(float k, int64_t x) {
    if (k > key) {
      key = k;
      idx = int32_t(x);
    }
  }
  template <class R>
  SK_HD void reduce(R& red) {
    red.argmax(key, idx);
  }
  // The index when nothing beat -inf: 0 (as the Triton kernels report).
  SK_HD int32_t index_or_zero() const { return key > neg_inf() ? idx : 0; }
};

// Whether entry idx (logit x) passes the top-k/top-p threshold: x >= thr, or with
// top_p_ties="by_index" x > thr, or x == thr at an index >= cut (the lowest index kept of the
// boundary tie group; cut 0 keeps the whole group, which is x >= thr).
SK_HD bool kept_at(float x, int64_t idx, float thr, int32_t cut) { return x > thr || (x == thr && idx >= cut); }

// p(x) of the processed distribution given its statistics (0 for filtered or -inf logits); idx and
// cut: see kept_at.
SK_HD float prob_of(float x, float m, float z, float thr, float inv_t, int64_t idx = 0, int32_t cut = 0) {
  const bool kept = kept_at(x, idx, thr, cut) && (x > neg_inf()) && (z > 0.0f);
  return kept ? expf((x - safe_max(m)) * inv_t) / z : 0.0f;
}

// Element loop of one program over [start, end): thread `rank` takes the quads (4 consecutive
// entries, start % 4 == 0) rank, rank + size, ... so a race needs one Philox call per quad.
// 32-bit quad indices (V < 2^31): cheaper index math than int64 in the hottest loops.
#define SK_FOR_QUADS(red, start, end, quad)                                                       \
  for (int32_t quad = int32_t((start) / 4) + int32_t((red).rank()), quad##_end = int32_t(((end) + 3) / 4); \
       quad < quad##_end; quad += int32_t((red).size()))

// ------------------------------------------------------------------------------------------
// top-k / top-p threshold: radix select on the GPU

// The order key as an unsigned integer (monotone in x) and back.
SK_HD uint32_t radix_key(float x) { return uint32_t(order_key(x)) ^ 0x80000000u; }
SK_HD float radix_key_float(uint32_t key) { return key_to_float(int64_t(int32_t(key ^ 0x80000000u))); }

// Three digits of the 32-bit key, most significant first: 11 + 11 + 10 bits, so a threshold costs
// three passes over the row (the bisection it replaces cost 32 per filter).
constexpr int RADIX_PASSES = 3;
constexpr int RADIX_BINS = 2048;
constexpr int RADIX_GROUP = 32;  // bins per group of the two-level scan
constexpr int RADIX_GROUPS = RADIX_BINS / RADIX_GROUP;
SK_HD int radix_shift(int pass) { return pass == 0 ? 21 : (pass == 1 ? 10 : 0); }
SK_HD int radix_width(int pass) { return pass == 2 ? 10 : 11; }

// Top-k survivors gathered in one pass so that top-p needs no further pass over the row.
constexpr int THRESHOLD_CANDIDATES = 2048;

// Per-program scratch of the threshold search (shared memory on the GPU, ~25 KB).
struct ThresholdScratch {
  unsigned long long bins[RADIX_BINS];  // weight per digit: entry counts (top-k) or fixed-point mass (top-p)
  unsigned long long groups[RADIX_GROUPS];
  float cand[THRESHOLD_CANDIDATES];
  int32_t num_cand;
};

SK_HD void atomic_add_u64(unsigned long long* p, unsigned long long v) {
#if defined(__CUDA_ARCH__)
  atomicAdd(p, v);
#else
  *p += v;  // one thread per program on the host
#endif
}

SK_HD int32_t atomic_next(int32_t* p) {
#if defined(__CUDA_ARCH__)
  return atomicAdd(p, 1);
#else
  return (*p)++;
#endif
}

// exp-mass in fixed point: integer sums do not depend on the order the threads add in, so the
// threshold is deterministic. Terms are <= 1 (x <= the row max); the scale leaves 63 bits for
// sums over V entries.
SK_HD float mass_scale(int64_t V) { return V <= (int64_t(1) << 23) ? 1099511627776.0f : 4294967296.0f; }

// The largest key t such that the entries with key >= t weigh at least goal_of(total), where
// total is the weight of all entries, by an MSB-first radix select: per digit, a histogram of the
// weights of the entries that share the digits found so far; the scan from the top picks the digit
// where the running weight reaches the goal. `each(f)` calls f(x) for this thread's entries;
// weight(x) is 0 for entries that do not count. Returns false (key untouched) when the goal is 0
// or above the total. Every thread must call it; all of them get the same key.
template <class R, class Each, class Weight, class Goal>
SK_HD bool radix_select(R& red, ThresholdScratch& s, Each&& each, Weight&& weight, Goal&& goal_of, uint32_t& key) {
  uint32_t prefix = 0;
  unsigned long long above = 0, goal = 0;  // weight of the entries above the prefix's range
  for (int pass = 0; pass < RADIX_PASSES; ++pass) {
    const int shift = radix_shift(pass);
    const uint32_t digit_mask = (1u << radix_width(pass)) - 1u;
    const uint32_t high = pass == 0 ? 0u : ~0u << (shift + radix_width(pass));
    for (int64_t j = red.rank(); j < RADIX_BINS; j += red.size()) s.bins[j] = 0;
    red.sync();
    each([&](float x) {
      const unsigned long long w = weight(x);
      const uint32_t k = radix_key(x);
      if (w != 0 && (k & high) == prefix) atomic_add_u64(&s.bins[(k >> shift) & digit_mask], w);
    });
    red.sync();
    for (int64_t g = red.rank(); g < RADIX_GROUPS; g += red.size()) {
      unsigned long long t = 0;
      for (int e = 0; e < RADIX_GROUP; ++e) t += s.bins[g * RADIX_GROUP + e];
      s.groups[g] = t;
    }
    red.sync();
    if (pass == 0) {
      unsigned long long total = 0;
      for (int g = 0; g < RADIX_GROUPS; ++g) total += s.groups[g];
      goal = goal_of(total);
      if (goal == 0 || total < goal) {
        red.sync();
        return false;
      }
    }
    // every thread scans the same numbers in the same order: the group, then the bin, where the
    // running weight from the top reaches the goal (above < goal holds before and after)
    int g = RADIX_GROUPS - 1;
    while (g > 0 && above + s.groups[g] < goal) above += s.groups[g--];
    int j = (g + 1) * RADIX_GROUP - 1;
    while (j > g * RADIX_GROUP && above + s.bins[j] < goal) above += s.bins[j--];
    prefix |= uint32_t(j) << shift;
    red.sync();  // all threads have read the bins before the next pass clears them
  }
  key = prefix;
  return true;
}

// Raw-logit threshold implementing top-k then top-p (keep x >= threshold), exactly as
// reference/sampling.py's filter_threshold defines it (ties at the boundary kept; -inf when nothing
// is filtered), without sorting:
//   top-k: the k-th largest finite logit, a radix select on entry counts (3 passes);
//   top-p: the largest logit whose kept mass at or above it reaches top_p of the kept mass, a radix
//          select on exp-mass. After top-k its survivors are gathered in one pass and searched in
//          `s` (4 passes over the row in all); without top-k (or with more than
//          THRESHOLD_CANDIDATES survivors) one max pass and the radix passes over the row.
template <class R, class T>
SK_HD float filter_threshold(R& red, ThresholdScratch& s, const T* row, int64_t V, float inv_t, int32_t top_k,
                             float top_p, const int32_t* mask = nullptr) {
  const auto row_entries = [&](auto&& f) {  // runs of 8: 128-bit loads of bf16 / fp16 rows
    for (int32_t o = int32_t(red.rank()), o_end = int32_t((V + 7) / 8); o < o_end; o += int32_t(red.size())) {
      float v[8];
      load_oct(row, int64_t(o) * 8, V, v);
      mask_run(mask, int64_t(o) * 8, v);
      int unused = 0;
      for (int e = 0; e < 8; ++e) f(sanitize_logit(v[e], unused));
    }
  };
  float thr = neg_inf();
  uint32_t key = 0;
  if (top_k > 0 && top_k < V) {
    const unsigned long long k = (unsigned long long)top_k;
    const auto finite = [](float x) -> unsigned long long { return x > neg_inf() ? 1ull : 0ull; };
    // fewer finite logits than k: nothing filtered
    if (radix_select(red, s, row_entries, finite, [k](unsigned long long) { return k; }, key))
      thr = radix_key_float(key);
  }
  if (top_p < 1.0f) {
    bool gathered = false;
    if (thr > neg_inf()) {
      if (red.rank() == 0) s.num_cand = 0;
      red.sync();
      row_entries([&](float x) {
        if (x >= thr) {
          const int32_t slot = atomic_next(&s.num_cand);
          if (slot < THRESHOLD_CANDIDATES) s.cand[slot] = x;
        }
      });
      red.sync();
      gathered = s.num_cand <= THRESHOLD_CANDIDATES;
    }
    const int32_t n = gathered ? s.num_cand : 0;
    const auto cand_entries = [&](auto&& f) {
      for (int32_t c = int32_t(red.rank()); c < n; c += int32_t(red.size())) f(s.cand[c]);
    };
    float m = neg_inf();
    const auto track_max = [&](float x) { m = x >= thr && x > m ? x : m; };
    if (gathered) cand_entries(track_max); else row_entries(track_max);
    m = red.max(m);
    if (m > neg_inf()) {
      const float scale = mass_scale(V);
      const auto mass = [=](float x) -> unsigned long long {
        return x >= thr && x > neg_inf() ? (unsigned long long)(expf((x - m) * inv_t) * scale) : 0ull;
      };
      const auto goal = [top_p](unsigned long long total) {
        const double g = ceil(double(top_p) * double(total));
        return g < 1.0 ? 1ull : (unsigned long long)g;
      };
      const bool found = gathered ? radix_select(red, s, cand_entries, mass, goal, key)
                                  : radix_select(red, s, row_entries, mass, goal, key);
      if (found) thr = radix_key_float(key);
    }
  }
  return thr;
}

// ------------------------------------------------------------------------------------------
// the three programs of chain verification

// Everything a program needs; pointers are raw, strides in elements. Per-request parameters are a
// [B] array (canonical dtype) or, when the pointer is null, the scalar.
// Tree ops use the same struct with K chains of G slots ([B, K, G+1, V] target rows, see
// specdec_kernels/_tree_args.py); chain verification is K = 1, n_max = G.
struct ChainParams {
  const void* target;  // [B, (K,) G+1, V] fp32 | fp16 | bf16, last dim contiguous
  int64_t stride_tb, stride_tk, stride_tg;
  const void* draft;  // [B, (K,) G, V] draft logits (mode 1) or probs (mode 2); null in mode 0
  int64_t stride_db, stride_dk, stride_dg;
  int draft_mode;
  const int64_t* draft_tokens;  // [B, G] (row stride stride_xb)
  int64_t stride_xb;
  const int64_t* num_draft;  // [B] or null (= G)
  const float* temperature;  // [B] or null
  float temperature_s;
  const int32_t* top_k;  // [B] or null
  int32_t top_k_s;
  const float* top_p;  // [B] or null
  float top_p_s;
  const int64_t* seed;  // [B] Philox keys, or null: keys mixed from seed_s
  int64_t seed_s;
  int64_t B, G, V;
  int64_t K = 1;      // chains per request (tree ops)
  int64_t n_max = 0;  // bound of num_draft / num_nodes: G (chains) or N = K * G (trees)
  int64_t num_chunks, chunk_size;  // vocab split; chunk_size % 8 == 0; 1 chunk with filters
  bool has_filter;
  bool thresholds_given = false;  // thr holds every row's thresholds before the row pass
  bool placeholders_end = false;  // chains: a draft id outside [0, V) ends the draft there
  // workspaces
  float* stats;    // [B*(G+1), C, NUM_STATS]
  int32_t* g_idx;  // [B*(G+1), C]
  float* thr;      // [B*(G+1), 2] (has_filter)
  int32_t* cut = nullptr;  // [B*(G+1), 2] top_p_ties="by_index" index cuts (kept_at; CPU build), or null
  int32_t* first_reject;  // [B]
  int32_t* direct;        // [B] greedy token
  uint8_t* flagged;       // [B]
  float* race_key;        // [B, C, 2]: residual race, p race
  int32_t* race_idx;      // [B, C, 2]
  // outputs
  int64_t* out_tokens;  // [B, G+1] (row stride stride_ob)
  int64_t stride_ob;
  int32_t* out_accepted;  // [B]
  bool* out_nonfinite;    // [B]
  // return_logprobs (null: not asked for): [B, G+1] float32 (row stride stride_lb). The emitted rows
  // of greedy requests then get thresholds and (m, z) at temperature 1 after the accept program
  // (verify_logprobs.h chain_logprobs_program).
  float* out_logprobs = nullptr;
  int64_t stride_lb = 0;
  // method="block" (chains; null: the token rule): [B] w_tau of each sampled request, written with
  // first_reject by verify_block.h's block_decide_program before the race of row tau (block_walk),
  // and its workspace [B, G+1] of the weights w_i
  float* block_w = nullptr;
  double* block_ws = nullptr;
  // tree walk only
  const int64_t* parents;  // [B, N] (row stride stride_pb), or null: K chains (verify_multi)
  int64_t stride_pb;
  int64_t stride_xk;  // tokens [B, K, G]: chain stride
  int64_t D;          // max depth (output width D + 1)
  int method;         // 0 kseq, 1 rrs, 2 rrs_wor
  int64_t* out_nodes;  // [B, D] (row stride stride_nb)
  int64_t stride_nb;
  // return_logprobs (trees; null: not asked for): [B, D+1] the record of the target row the walk
  // scored each position with (out_logprobs, stride_lb: [B, D+1], verify_logprobs.h tree_logprobs_program)
  int64_t* walk_rows = nullptr;
  // token_bitmask (null: none): int32 words [B, (K,) G+1, ceil(V / 32)] laid out like
  // the target rows (strides in words, the last dim contiguous); draft rows use draft_mask's rows
  const int32_t* mask = nullptr;
  int64_t stride_mb = 0, stride_mk = 0, stride_mg = 0;
};

// The mask words of target row (b, k, i), or null (no mask).
SK_HD const int32_t* target_mask(const ChainParams& P, int64_t b, int64_t k, int64_t i) {
  return P.mask == nullptr ? nullptr : P.mask + b * P.stride_mb + k * P.stride_mk + i * P.stride_mg;
}

// The mask words of draft row (b, k, i) (i < G): those of the target row it is verified at, row i of
// its chain, or in a tree (parents) row parents[b, i] + 1, the parent clamped to [-1, G - 1] as
// _bitmask.tree_draft_mask clamps it.
SK_HD const int32_t* draft_mask(const ChainParams& P, int64_t b, int64_t k, int64_t i) {
  if (P.mask == nullptr || P.parents == nullptr) return target_mask(P, b, k, i);
  const int64_t par = P.parents[b * P.stride_pb + i];
  return target_mask(P, b, k, (par < -1 ? -1 : (par > P.G - 1 ? P.G - 1 : par)) + 1);
}

struct Request {
  int64_t n;  // drafts to verify
  float temperature, inv_t;
  bool greedy;
  int32_t top_k;
  float top_p;
  int64_t seed;
};

SK_HD Request load_request(const ChainParams& P, int64_t b) {
  Request r;
  const int64_t n = P.num_draft ? P.num_draft[b] : P.n_max;
  r.n = n < 0 ? 0 : (n > P.n_max ? P.n_max : n);  // validated by the caller; clamped for memory safety
  if (P.placeholders_end) {  // a placeholder (e.g. -1) ends the draft: that position draws the bonus from p
    for (int64_t i = 0; i < r.n; ++i) {
      const int64_t tok = P.draft_tokens[b * P.stride_xb + i];
      if (tok < 0 || tok >= P.V) {
        r.n = i;
        break;
      }
    }
  }
  r.temperature = P.temperature ? P.temperature[b] : P.temperature_s;
  r.greedy = greedy_temperature(r.temperature);
  r.inv_t = inverse_temperature(r.temperature);
  r.top_k = P.top_k ? P.top_k[b] : P.top_k_s;
  r.top_p = P.top_p ? P.top_p[b] : P.top_p_s;
  r.seed = request_seed(P.seed, P.seed_s, b);
  return r;
}

// Program 1 (row, chunk): statistics of target row i (and draft row i in mode 1) over one chunk:
// max / sum-exp of the processed logits, greedy argmax, non-finite count (of the draft row too, in
// modes 1 and 2: unusable draft probabilities are counted like non-finite logits); thresholds first.
// Rows are (b * K + k) * (G + 1) + i; rows with i > n (past the bonus row / a ragged tree's last
// node) are skipped.
// Request b, chain k, position i of row (b * K + k) * (G + 1) + i, and its target / draft rows.
// tm / dm: the mask words of both rows (null: no mask; dm null past the draft rows).
template <class TT, class TD>
struct RowRef {
  int64_t b, i;
  const TT* t;
  const TD* d;
  const int32_t* tm;
  const int32_t* dm;
};

template <class TT, class TD>
SK_HD RowRef<TT, TD> row_ref(const ChainParams& P, int64_t row) {
  const int64_t bk = row / (P.G + 1), i = row % (P.G + 1);
  const int64_t b = bk / P.K, k = bk % P.K;
  return {b, i, static_cast<const TT*>(P.target) + b * P.stride_tb + k * P.stride_tk + i * P.stride_tg,
          static_cast<const TD*>(P.draft) + b * P.stride_db + k * P.stride_dk + i * P.stride_dg,
          target_mask(P, b, k, i), i < P.G ? draft_mask(P, b, k, i) : nullptr};
}

// The thresholds (and by-index cuts) of a row computed before the row pass.
SK_HD void given_thresholds(const ChainParams& P, int64_t row, float& thr_t, float& thr_q, int32_t& cut_t,
                            int32_t& cut_q) {
  thr_t = P.thr[row * 2 + 0];
  thr_q = P.thr[row * 2 + 1];
  if (P.cut) {
    cut_t = P.cut[row * 2 + 0];
    cut_q = P.cut[row * 2 + 1];
  }
}

template <class R, class TT, class TD>
SK_HD void row_stats_program(const ChainParams& P, int64_t row, int64_t chunk, R& red,
                             ThresholdScratch* scratch = nullptr) {
  const RowRef<TT, TD> ref = row_ref<TT, TD>(P, row);
  const int64_t b = ref.b, i = ref.i;
  const Request rq = load_request(P, b);
  if (i > rq.n) return;
  const TT* t_row = ref.t;
  const TD* d_row = ref.d;
  const bool draft_row = P.draft_mode != DRAFT_NONE && i < rq.n && i < P.G && !rq.greedy;
  float thr_t = neg_inf(), thr_q = neg_inf();
  int32_t cut_t = 0, cut_q = 0;
  if (P.has_filter && !rq.greedy) {
    if (P.thresholds_given) {  // computed beforehand (the CPU build: by selection, any chunking)
      given_thresholds(P, row, thr_t, thr_q, cut_t, cut_q);
    } else {  // launched with one chunk and a scratch: the program owns the whole row
      thr_t = filter_threshold(red, *scratch, t_row, P.V, rq.inv_t, rq.top_k, rq.top_p, ref.tm);
      if (draft_row && P.draft_mode == DRAFT_LOGITS)
        thr_q = filter_threshold(red, *scratch, d_row, P.V, rq.inv_t, rq.top_k, rq.top_p, ref.dm);
      if (red.rank() == 0) {
        P.thr[row * 2 + 0] = thr_t;
        P.thr[row * 2 + 1] = thr_q;
      }
    }
  }
  const int64_t start = chunk * P.chunk_size;
  const int64_t end = start + P.chunk_size < P.V ? start + P.chunk_size : P.V;
  SoftmaxAcc<typename R::Wide> st, sq;
  Argmax g;
  int bad = 0, bad_q = 0;
  const bool draft_logits = draft_row && P.draft_mode == DRAFT_LOGITS;
  // runs of 8 entries (start is a multiple of 8): 128-bit loads of bf16 / fp16 rows
  for (int32_t o = int32_t(start / 8) + int32_t(red.rank()), o_end = int32_t((end + 7) / 8); o < o_end;
       o += int32_t(red.size())) {
    float tv[8], dv[8];
    load_oct(t_row, int64_t(o) * 8, end, tv);
    mask_run(ref.tm, int64_t(o) * 8, tv);
    if (draft_logits) {
      load_oct(d_row, int64_t(o) * 8, end, dv);
      mask_run(ref.dm, int64_t(o) * 8, dv);
    }
    for (int e = 0; e < 8 && o * 8 + e < end; ++e) {
      const int64_t x = o * 8 + e;
      const float v = sanitize_logit(tv[e], bad);
      g.add(v, x);
      if (rq.greedy) continue;  // greedy needs the argmax only
      st.add(kept_at(v, x, thr_t, cut_t) ? v : neg_inf(), rq.inv_t);
      if (draft_logits) {
        const float d = sanitize_logit(dv[e], bad_q);
        sq.add(kept_at(d, x, thr_q, cut_q) ? d : neg_inf(), rq.inv_t);
      } else if (draft_row) {  // probabilities are used as given: only count the unusable ones
        load_prob(d_row, x, bad_q);
      }
    }
  }
  st.reduce(red, rq.inv_t);
  sq.reduce(red, rq.inv_t);
  g.reduce(red);
  bad = red.sum(bad);
  bad_q = red.sum(bad_q);
  if (red.rank() == 0) {
    float* s = P.stats + (row * P.num_chunks + chunk) * NUM_STATS;
    s[0] = st.m;
    s[1] = float(st.z);
    s[2] = sq.m;
    s[3] = float(sq.z);
    s[4] = g.key;
    s[5] = float(bad);
    s[6] = float(bad_q);
    P.g_idx[row * P.num_chunks + chunk] = g.index_or_zero();
  }
}

// Combined statistics of one row (all chunks merged, chunks in order).
struct RowStats {
  Softmax t, q;
  float g_max = neg_inf();
  int32_t g_idx = 0;
  float bad = 0.0f;
  float thr_t = neg_inf(), thr_q = neg_inf();
  int32_t cut_t = 0, cut_q = 0;
};

SK_HD RowStats combine_row(const ChainParams& P, int64_t row, const Request& rq) {
  RowStats r;
  for (int64_t c = 0; c < P.num_chunks; ++c) {
    const float* s = P.stats + (row * P.num_chunks + c) * NUM_STATS;
    r.t.merge(s[0], s[1], rq.inv_t);
    r.q.merge(s[2], s[3], rq.inv_t);
    if (s[4] > r.g_max) {  // strict: the earlier chunk keeps ties (lowest index)
      r.g_max = s[4];
      r.g_idx = P.g_idx[row * P.num_chunks + c];
    }
    r.bad += s[5] + s[6];
  }
  if (P.has_filter && (!rq.greedy || P.out_logprobs != nullptr)) {  // greedy rows: for the logprobs only
    r.thr_t = P.thr[row * 2 + 0];
    r.thr_q = P.thr[row * 2 + 1];
    if (P.cut) {
      r.cut_t = P.cut[row * 2 + 0];
      r.cut_q = P.cut[row * 2 + 1];
    }
  }
  return r;
}

template <class TT, class TD>
SK_HD float target_logit(const ChainParams& P, int64_t b, int64_t i, int64_t x, int& bad) {
  return load_logit(static_cast<const TT*>(P.target) + b * P.stride_tb + i * P.stride_tg, x, bad);
}

// Program 3 for one request: the recovered / bonus / greedy token and the output row.
SK_HD void finalize_request(const ChainParams& P, int64_t b) {
  const Request rq = load_request(P, b);
  const int64_t j = P.first_reject[b];
  int64_t token = P.direct[b];
  if (!rq.greedy) {
    Argmax res, pk;
    for (int64_t c = 0; c < P.num_chunks; ++c) {  // strict >: the earlier chunk keeps ties
      const int64_t rec = (b * P.num_chunks + c) * 2;
      if (P.race_key[rec] > res.key) { res.key = P.race_key[rec]; res.idx = P.race_idx[rec]; }
      if (P.race_key[rec + 1] > pk.key) { pk.key = P.race_key[rec + 1]; pk.idx = P.race_idx[rec + 1]; }
    }
    // Recovery: the residual race; an empty residual (p == q to fp32 rounding) falls back to p.
    // Bonus (j == n): the race over p. No finite logit at all: token 0.
    token = (j < rq.n && res.key > neg_inf()) ? res.idx : pk.index_or_zero();
  }
  token = token < 0 ? 0 : (token > P.V - 1 ? P.V - 1 : token);
  int64_t* out = P.out_tokens + b * P.stride_ob;
  for (int64_t t = 0; t <= P.G; ++t) out[t] = t < j ? P.draft_tokens[b * P.stride_xb + t] : (t == j ? token : -1);
  P.out_accepted[b] = int32_t(j);
  P.out_nonfinite[b] = P.flagged[b] != 0;
}

// A row that flags its request (nonfinite): a non-finite logit / unusable draft probability, or
// nothing to sample (greedy or not).
SK_HD bool row_flagged(const RowStats& s, const Request& rq) {
  return s.bad > 0.0f || (rq.greedy ? s.g_max == neg_inf() : s.t.z == 0.0f);
}

// p(x) and q(x) of draft token x = tok at position j of request b (a sampled request; row j's
// merged statistics s): q = 1 for one-hot drafts (mode 0). The accept test's and block
// verification's (verify_cpu.cpp) operands.
template <class TT, class TD>
SK_HD void draft_token_probs(const ChainParams& P, const Request& rq, int64_t b, int64_t j, int64_t tok,
                             const RowStats& s, float& p, float& q) {
  int unused = 0;
  const float xt = mask_logit(target_logit<TT, TD>(P, b, j, tok, unused), target_mask(P, b, 0, j), tok);
  p = prob_of(xt, s.t.m, s.t.z, s.thr_t, rq.inv_t, tok, s.cut_t);
  q = 1.0f;
  if (P.draft_mode == DRAFT_LOGITS) {
    const TD* d_row = static_cast<const TD*>(P.draft) + b * P.stride_db + j * P.stride_dg;
    const float xd = mask_logit(load_logit(d_row, tok, unused), draft_mask(P, b, 0, j), tok);
    q = prob_of(xd, s.q.m, s.q.z, s.thr_q, rq.inv_t, tok, s.cut_q);
  } else if (P.draft_mode == DRAFT_PROBS) {
    q = load_prob(static_cast<const TD*>(P.draft) + b * P.stride_db + j * P.stride_dg, tok, unused);
  }
}

// Where the accept tests of request b stopped: j (the first rejection, or n when every draft
// was accepted), row j's merged statistics, and the draft token at j (0 when out of range).
struct AcceptWalk {
  int64_t j = 0;
  RowStats s;
  int64_t tok_j = 0;
  float w = 1.0f;  // the residual's weight, max(w p - q, 0): 1 (token rule) or block verification's w_tau
};

// The accept tests of program 2, in order up to the first rejection; chunk 0's thread 0 records
// j, the greedy token and the flag.
template <class R, class TT, class TD>
SK_HD AcceptWalk accept_walk(const ChainParams& P, const Request& rq, int64_t b, int64_t chunk, R& red) {
  const int64_t G1 = P.G + 1;
  bool flagged = false;
  AcceptWalk w;
  for (;; ++w.j) {
    const int64_t j = w.j;
    w.s = combine_row(P, b * G1 + j, rq);
    const RowStats& s = w.s;
    flagged |= row_flagged(s, rq);  // every row used up to j
    if (j == rq.n) break;
    const int64_t tok = P.draft_tokens[b * P.stride_xb + j];
    const bool tok_ok = tok >= 0 && tok < P.V;
    w.tok_j = tok_ok ? tok : 0;
    const int64_t tok_j = w.tok_j;
    bool accept;
    if (rq.greedy) {
      accept = tok == s.g_idx;
    } else {
      float p, q;
      draft_token_probs<TT, TD>(P, rq, b, j, tok_j, s, p, q);
      const float u = uniform_open(rq.seed, 0, uint32_t(j), PURPOSE_ACCEPT);
      accept = (u * q <= p) && (p > 0.0f);  // u > 0: p = 0 is never accepted
    }
    if (!(accept && tok_ok)) break;
  }
  if (red.rank() == 0 && chunk == 0) {
    P.first_reject[b] = int32_t(w.j);
    P.direct[b] = w.s.g_idx;
    P.flagged[b] = flagged ? 1 : 0;
  }
  return w;
}

// The race over row j's entries [start, end) (start % 4 == 0, end the chunk's end): the residual
// max(w p - q, 0) (purpose RECOVER; w = aw.w, 1 for the token rule) when a draft was rejected, p
// itself (purpose BONUS) into `pk`.
template <class R, class TT, class TD>
SK_HD void race_range(const ChainParams& P, const Request& rq, int64_t b, const AcceptWalk& aw, int64_t start,
                      int64_t end, R& red, Argmax& res, Argmax& pk) {
  const int64_t j = aw.j;
  const RowStats& s = aw.s;
  int unused = 0;
  const bool recover = j < rq.n;
  const uint32_t purpose = recover ? PURPOSE_RECOVER : PURPOSE_BONUS;
  const TT* t_row = static_cast<const TT*>(P.target) + b * P.stride_tb + j * P.stride_tg;
  const TD* d_row = static_cast<const TD*>(P.draft) + b * P.stride_db + j * P.stride_dg;
  const float log_z = logf(s.t.z > 0.0f ? s.t.z : 1.0f);
  const float m_ref = safe_max(s.t.m);
  const bool draft_logits = recover && P.draft_mode == DRAFT_LOGITS;
  const int32_t* t_mask = target_mask(P, b, 0, j);
  const int32_t* d_mask = draft_logits ? draft_mask(P, b, 0, j) : nullptr;
  SK_FOR_QUADS(red, start, end, q4) {
    const Philox4 words = philox(rq.seed, uint32_t(q4), uint32_t(j), purpose, 0);
    float tv[4], dv[4];
    load_quad(t_row, q4 * 4, end, tv);
    mask_run(t_mask, int64_t(q4) * 4, tv);
    if (draft_logits) {
      load_quad(d_row, q4 * 4, end, dv);
      mask_run(d_mask, int64_t(q4) * 4, dv);
    }
    for (int e = 0; e < 4 && q4 * 4 + e < end; ++e) {
      const int64_t x = q4 * 4 + e;
      const float xt = sanitize_logit(tv[e], unused);
      const float p = prob_of(xt, s.t.m, s.t.z, s.thr_t, rq.inv_t, x, s.cut_t);
      if (!(p > 0.0f)) continue;
      const float noise = race_noise_from_uniform(uniform_from_bits(words.w[e]));
      pk.add((xt - m_ref) * rq.inv_t - log_z + noise, x);
      if (recover) {
        const float wp = aw.w * p;  // exactly p for the token rule (w = 1)
        float r;
        if (P.draft_mode == DRAFT_LOGITS) {
          const float q = prob_of(sanitize_logit(dv[e], unused), s.q.m, s.q.z, s.thr_q, rq.inv_t, x, s.cut_q);
          r = wp - q > 0.0f ? wp - q : 0.0f;
        } else if (P.draft_mode == DRAFT_PROBS) {
          const float q = load_prob(d_row, x, unused);
          r = wp - q > 0.0f ? wp - q : 0.0f;
        } else {  // one-hot q: max(w p(tok) - 1, 0) = 0 (w, p <= 1)
          r = x == aw.tok_j ? 0.0f : wp;
        }
        if (r > 0.0f) res.add(logf(r > 1e-38f ? r : 1e-38f) + noise, x);
      }
    }
  }
}

// This chunk's race records (and, with one chunk, the request's output row).
template <class R>
SK_HD void store_race(const ChainParams& P, int64_t b, int64_t chunk, R& red, Argmax& res, Argmax& pk) {
  res.reduce(red);
  pk.reduce(red);
  if (red.rank() == 0) {
    const int64_t rec = (b * P.num_chunks + chunk) * 2;
    P.race_key[rec] = res.key;
    P.race_key[rec + 1] = pk.key;
    P.race_idx[rec] = res.idx;
    P.race_idx[rec + 1] = pk.idx;
    if (P.num_chunks == 1) finalize_request(P, b);
  }
}

SK_HD int64_t chunk_end(const ChainParams& P, int64_t chunk) {
  const int64_t end = (chunk + 1) * P.chunk_size;
  return end < P.V ? end : P.V;
}

// Program 2's walk for a block-verified sampled request: row tau (verify_block.h) with w_tau.
SK_HD AcceptWalk block_walk(const ChainParams& P, const Request& rq, int64_t b) {
  AcceptWalk aw;
  aw.j = P.first_reject[b];
  aw.s = combine_row(P, b * (P.G + 1) + aw.j, rq);
  aw.tok_j = aw.j < rq.n ? P.draft_tokens[b * P.stride_xb + aw.j] : 0;
  aw.w = P.block_w[b];
  return aw;
}

// Program 2 (request, chunk): merge the row statistics, run the accept tests in order up to the
// first rejection j (method="block": row tau of block_decide_program), then this chunk's part of
// the race over row j: the residual max(p - q, 0) (purpose RECOVER) when a draft was rejected, p
// itself (purpose BONUS) when all were accepted. With one chunk the program also finalizes the
// request (no third launch).
template <class R, class TT, class TD>
SK_HD void accept_program(const ChainParams& P, int64_t b, int64_t chunk, R& red) {
  const Request rq = load_request(P, b);
  const AcceptWalk w = P.block_w != nullptr && !rq.greedy ? block_walk(P, rq, b)
                                                          : accept_walk<R, TT, TD>(P, rq, b, chunk, red);
  Argmax res, pk;
  if (!rq.greedy) race_range<R, TT, TD>(P, rq, b, w, chunk * P.chunk_size, chunk_end(P, chunk), red, res, pk);
  store_race(P, b, chunk, red, res, pk);
}

}  // namespace sk
