// AVX2 paths of the CPU build (verify_cpu.cpp): the row pass and the race of verify_core.h eight
// vocabulary entries at a time, for x86-64 CPUs with AVX2 + FMA + F16C (checked at run time; the
// file is compiled for the baseline ISA, only these functions carry the target attribute).
//
// Same records, same random numbers, same decisions as the scalar programs they replace:
//   * sanitising, the top-k/top-p keep test (kept_at), the accept/race arithmetic and the argmax
//     rule (strict >, lowest index on ties: per lane, then the lowest index among the lanes that
//     hold the max) are the scalar code's, operation for operation (mul then sub: no FMA
//     contraction, so the keys round as the scalar ones do);
//   * Philox4x32-10 runs eight counters (quads) per vector and gives bit-identical words;
//   * exp and log are SLEEF's (Sleef_expf8_u10 / Sleef_logf8_u10, exported by libtorch_cpu: the
//     functions ATen's Vectorized<float> calls), within 1 ulp where glibc's expf / logf are
//     correctly rounded, and the row's sum-exp is summed in eight double lanes, not in order. So a
//     statistic may move by a few ulps (relative ~1e-7). That is the difference the backends
//     already have with each other (the Triton kernels sum in blocks, the reference in torch's
//     order): a token changes only when an accept test u * q <= p or the race's top two keys are
//     within that margin, probability ~1e-6 per call; tests/ops/test_cpu_simd.py checks token
//     equality with the scalar path (SPECDEC_CPU_SIMD=0) on many seeds, every mode and dtype.
// SPECDEC_CPU_SIMD=0 in the environment turns these paths off (read per call).
#pragma once

#include "verify_core.h"

#include "cpu_simd.h"

#ifdef SK_HAVE_AVX2_PATH

namespace sk {
namespace simd {

SK_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
SK_AVX2 inline __m256 load8(const bf16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
SK_AVX2 inline __m256 load8(const f16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// row[x .. x + 7] as fp32, -inf at or past `end` (a run that ends early goes through a buffer).
template <class T>
SK_AVX2 inline __m256 load8_upto(const T* row, int64_t x, int64_t end) {
  if (x + 8 <= end) return load8(row + x);
  alignas(32) float v[8];
  for (int e = 0; e < 8; ++e) v[e] = x + e < end ? to_float(row[x + e]) : neg_inf();
  return _mm256_load_ps(v);
}

// Per-lane shift counts moving bit 8h + e of a mask word into lane e's sign bit (the bit blendv
// reads), for the four runs of 8 entries h = 0 .. 3 of a word.
alignas(32) inline constexpr int32_t MASK_SHIFTS[4][8] = {{31, 30, 29, 28, 27, 26, 25, 24},
                                                         {23, 22, 21, 20, 19, 18, 17, 16},
                                                         {15, 14, 13, 12, 11, 10, 9, 8},
                                                         {7, 6, 5, 4, 3, 2, 1, 0}};

// mask_run on eight lanes v = row[x .. x + 7] (x % 8 == 0; words null: no mask): a disallowed lane
// is -inf. A broadcast of the word from memory, one variable shift and one blend: no scalar shift
// by x % 32 in the loop.
SK_AVX2 inline __m256 mask8(__m256 v, const int32_t* words, int64_t x) {
  if (words == nullptr) return v;
  const __m256i w = _mm256_set1_epi32(words[x >> 5]);
  const __m256i counts = _mm256_load_si256(reinterpret_cast<const __m256i*>(MASK_SHIFTS[(x >> 3) & 3]));
  return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, _mm256_castsi256_ps(_mm256_sllv_epi32(w, counts)));
}

// sanitize_logit on eight lanes: NaN / +inf -> -inf, counted into `bad`.
SK_AVX2 inline __m256 sanitize8(__m256 v, int& bad) {
  const __m256 is_bad =
      _mm256_or_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), _mm256_cmp_ps(v, _mm256_set1_ps(INFINITY), _CMP_EQ_OQ));
  bad += __builtin_popcount(unsigned(_mm256_movemask_ps(is_bad)));
  return _mm256_blendv_ps(v, _mm256_set1_ps(-INFINITY), is_bad);
}

// load_prob's count on eight lanes: entries not in [0, inf) (NaN included) are unusable.
SK_AVX2 inline int bad_probs8(__m256 v) {
  const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ),
                                  _mm256_cmp_ps(v, _mm256_set1_ps(INFINITY), _CMP_LT_OQ));
  return 8 - __builtin_popcount(unsigned(_mm256_movemask_ps(ok)));
}

SK_AVX2 inline __m256 prob8(__m256 v) {  // load_prob's value: unusable entries -> 0
  const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ),
                                  _mm256_cmp_ps(v, _mm256_set1_ps(INFINITY), _CMP_LT_OQ));
  return _mm256_and_ps(v, ok);
}

SK_AVX2 inline __m256i lane_index(int64_t x) {
  return _mm256_add_epi32(_mm256_set1_epi32(int32_t(x)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// kept_at on eight lanes: v > thr, or v == thr at an index >= cut.
SK_AVX2 inline __m256 kept8(__m256 v, __m256i idx, float thr, int32_t cut) {
  const __m256 t = _mm256_set1_ps(thr);
  const __m256 at_cut = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(cut - 1)));
  return _mm256_or_ps(_mm256_cmp_ps(v, t, _CMP_GT_OQ), _mm256_and_ps(_mm256_cmp_ps(v, t, _CMP_EQ_OQ), at_cut));
}

// Running first-argmax per lane (strict >: a lane keeps its earliest index on ties).
struct Argmax8 {
  __m256 key;
  __m256i idx;
  SK_AVX2 Argmax8() : key(_mm256_set1_ps(-INFINITY)), idx(_mm256_set1_epi32(NO_INDEX)) {}
  SK_AVX2 void add(__m256 k, __m256i i, __m256 mask) {
    const __m256 up = _mm256_and_ps(mask, _mm256_cmp_ps(k, key, _CMP_GT_OQ));
    key = _mm256_blendv_ps(key, k, up);
    idx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(idx), _mm256_castsi256_ps(i), up));
  }
  // The lanes merged: the max key, the lowest index among the lanes that hold it. Lanes hold
  // disjoint indices, so this is the first argmax of everything added.
  SK_AVX2 Argmax merged() const {
    alignas(32) float k[8];
    alignas(32) int32_t i[8];
    _mm256_store_ps(k, key);
    _mm256_store_si256(reinterpret_cast<__m256i*>(i), idx);
    Argmax a;
    for (int e = 0; e < 8; ++e) {
      if (k[e] > a.key || (k[e] == a.key && k[e] > neg_inf() && i[e] < a.idx)) {
        a.key = k[e];
        a.idx = i[e];
      }
    }
    return a;
  }
};

SK_AVX2 inline float hmax(__m256 v) {
  alignas(32) float a[8];
  _mm256_store_ps(a, v);
  float m = a[0];
  for (int e = 1; e < 8; ++e) m = a[e] > m ? a[e] : m;
  return m;
}

// Greedy row statistics (the record greedy_row_stats writes) in one pass: max, first index of
// the max, non-finite count.
template <class TT>
SK_AVX2 void greedy_row_stats(const ChainParams& P, int64_t row, int64_t chunk, const TT* t_row, const int32_t* mask) {
  const int64_t start = chunk * P.chunk_size, end = chunk_end(P, chunk);
  // four independent accumulators (32 entries a step) so that the compare-blend chains overlap
  Argmax8 g[4];
  __m256i bad4 = _mm256_setzero_si256();  // minus the count of non-finite entries, per lane
  const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), inf = _mm256_set1_ps(INFINITY);
  int bad = 0;
  int64_t x = start;
  for (; x + 32 <= end; x += 32) {
    for (int h = 0; h < 4; ++h) {
      const __m256 v = mask8(load8(t_row + x + 8 * h), mask, x + 8 * h);
      const __m256 is_bad = _mm256_or_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), _mm256_cmp_ps(v, inf, _CMP_EQ_OQ));
      bad4 = _mm256_add_epi32(bad4, _mm256_castps_si256(is_bad));
      g[h].add(_mm256_blendv_ps(v, _mm256_set1_ps(-INFINITY), is_bad), lane_index(x + 8 * h), all);
    }
  }
  for (; x < end; x += 8) g[0].add(sanitize8(mask8(load8_upto(t_row, x, end), mask, x), bad), lane_index(x), all);
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), bad4);
  for (int e = 0; e < 8; ++e) bad -= lanes[e];
  Argmax a;
  for (int h = 0; h < 4; ++h) {  // disjoint indices: the max key, the lowest index holding it
    const Argmax m = g[h].merged();
    if (m.key > a.key || (m.key == a.key && m.key > neg_inf() && m.idx < a.idx)) a = m;
  }
  float* s = P.stats + (row * P.num_chunks + chunk) * NUM_STATS;
  s[0] = neg_inf();
  s[1] = 0.0f;
  s[2] = neg_inf();
  s[3] = 0.0f;
  s[4] = a.key;
  s[5] = float(bad);
  s[6] = 0.0f;
  P.g_idx[row * P.num_chunks + chunk] = a.index_or_zero();
}

// Entries summed in float lanes (32 a lane) before the lanes are added into double: eight float
// lanes of V / 8 terms came out up to ~4e-5 low at V = 152k (small terms rounded against a lane's
// partial sum); blocks of 256 keep z within ~2e-7 (tests/ops/test_cpu_simd.py) at the cost of one
// conversion per block (no measurable time).
constexpr int64_t SUM_BLOCK = 256;

// sum over [start, end) of exp((v - m) * inv_t) for the kept entries (thresholds thr / cut; mask:
// the row's token_bitmask words or null): float lanes per block of SUM_BLOCK entries, the blocks
// added in double.
template <class T>
SK_AVX2 float sum_exp(const T* row, const int32_t* mask, int64_t start, int64_t end, float m, float inv_t, float thr,
                      int32_t cut) {
  if (!(m > neg_inf())) return 0.0f;
  __m256d z_lo = _mm256_setzero_pd(), z_hi = _mm256_setzero_pd();
  const __m256 mv = _mm256_set1_ps(m), it = _mm256_set1_ps(inv_t), ninf = _mm256_set1_ps(-INFINITY);
  int unused = 0;
  for (int64_t x0 = start; x0 < end; x0 += SUM_BLOCK) {
    const int64_t x1 = x0 + SUM_BLOCK < end ? x0 + SUM_BLOCK : end;
    __m256 z = _mm256_setzero_ps();
    for (int64_t x = x0; x < x1; x += 8) {
      const __m256 v = sanitize8(mask8(load8_upto(row, x, end), mask, x), unused);
      const __m256 keep = _mm256_and_ps(kept8(v, lane_index(x), thr, cut), _mm256_cmp_ps(v, ninf, _CMP_GT_OQ));
      const __m256 e = Sleef_expf8_u10(_mm256_mul_ps(_mm256_sub_ps(v, mv), it));
      z = _mm256_add_ps(z, _mm256_and_ps(e, keep));
    }
    z_lo = _mm256_add_pd(z_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(z)));
    z_hi = _mm256_add_pd(z_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(z, 1)));
  }
  alignas(32) double a[8];
  _mm256_store_pd(a, z_lo);
  _mm256_store_pd(a + 4, z_hi);
  return float(((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])));
}

// Program 1 for a sampled row (thresholds given): row_stats_program's record in two passes, the
// max (and argmax, non-finite counts), then the sum of exp over the kept entries.
template <class TT, class TD>
SK_AVX2 void sampled_row_stats(const ChainParams& P, int64_t row, int64_t chunk) {
  const RowRef<TT, TD> ref = row_ref<TT, TD>(P, row);
  const int64_t i = ref.i;
  const Request rq = load_request(P, ref.b);
  if (i > rq.n) return;
  const TT* t_row = ref.t;
  const TD* d_row = ref.d;
  const bool draft_row = P.draft_mode != DRAFT_NONE && i < rq.n && i < P.G;
  const bool draft_logits = draft_row && P.draft_mode == DRAFT_LOGITS;
  float thr_t = neg_inf(), thr_q = neg_inf();
  int32_t cut_t = 0, cut_q = 0;
  if (P.has_filter) given_thresholds(P, row, thr_t, thr_q, cut_t, cut_q);
  const int64_t start = chunk * P.chunk_size, end = chunk_end(P, chunk);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 mt = ninf, mq = ninf;
  Argmax8 g;
  int bad = 0, bad_q = 0;
  const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int64_t x = start; x < end; x += 8) {
    const __m256i idx = lane_index(x);
    const __m256 v = sanitize8(mask8(load8_upto(t_row, x, end), ref.tm, x), bad);
    g.add(v, idx, all);
    mt = _mm256_max_ps(mt, _mm256_blendv_ps(ninf, v, kept8(v, idx, thr_t, cut_t)));
    if (draft_logits) {
      const __m256 d = sanitize8(mask8(load8_upto(d_row, x, end), ref.dm, x), bad_q);
      mq = _mm256_max_ps(mq, _mm256_blendv_ps(ninf, d, kept8(d, idx, thr_q, cut_q)));
    } else if (draft_row) {
      const int n = end - x < 8 ? int(end - x) : 8;
      bad_q += bad_probs8(load8_upto(d_row, x, end)) - (8 - n);  // the -inf padding counts as unusable
    }
  }
  const float m_t = hmax(mt), m_q = draft_logits ? hmax(mq) : neg_inf();
  const Argmax a = g.merged();
  float* s = P.stats + (row * P.num_chunks + chunk) * NUM_STATS;
  s[0] = m_t;
  s[1] = sum_exp(t_row, ref.tm, start, end, m_t, rq.inv_t, thr_t, cut_t);
  s[2] = m_q;
  s[3] = draft_logits ? sum_exp(d_row, ref.dm, start, end, m_q, rq.inv_t, thr_q, cut_q) : 0.0f;
  s[4] = a.key;
  s[5] = float(bad);
  s[6] = float(bad_q);
  P.g_idx[row * P.num_chunks + chunk] = a.index_or_zero();
}

// 32-bit lanes: high and low words of a * k (k the same constant in every lane).
SK_AVX2 inline void mulhilo8(__m256i a, __m256i k, __m256i& hi, __m256i& lo) {
  lo = _mm256_mullo_epi32(a, k);
  const __m256i even = _mm256_mul_epu32(a, k);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), k);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// philox() for the counters (q0 + lane, c1, c2, 0) of eight lanes: words[e][lane].
SK_AVX2 inline void philox8(int64_t seed, uint32_t q0, uint32_t c1_, uint32_t c2_, uint32_t (&words)[4][8]) {
  __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(int32_t(q0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i c1 = _mm256_set1_epi32(int32_t(c1_)), c2 = _mm256_set1_epi32(int32_t(c2_)), c3 = _mm256_setzero_si256();
  uint32_t k0 = uint32_t(uint64_t(seed)), k1 = uint32_t(uint64_t(seed) >> 32);
  const __m256i mb = _mm256_set1_epi32(int32_t(PHILOX_M1)), ma = _mm256_set1_epi32(int32_t(PHILOX_M0));
  for (int r = 0; r < PHILOX_ROUNDS; ++r, k0 += PHILOX_W0, k1 += PHILOX_W1) {  // philox()'s round
    __m256i hi_b, lo_b, hi_a, lo_a;
    mulhilo8(c2, mb, hi_b, lo_b);
    mulhilo8(c0, ma, hi_a, lo_a);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi_b, c1), _mm256_set1_epi32(int32_t(k0)));
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi_a, c3), _mm256_set1_epi32(int32_t(k1)));
    c1 = lo_b, c3 = lo_a;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[0]), c0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[1]), c1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[2]), c2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[3]), c3);
}

// p(x) on eight lanes (prob_of): exp((v - safe_max(m)) * inv_t) / z for kept, finite v; 0 else.
SK_AVX2 inline __m256 prob8_of(__m256 v, __m256i idx, float m, float z, float thr, int32_t cut, float inv_t) {
  if (!(z > 0.0f)) return _mm256_setzero_ps();
  const __m256 keep = _mm256_and_ps(kept8(v, idx, thr, cut), _mm256_cmp_ps(v, _mm256_set1_ps(-INFINITY), _CMP_GT_OQ));
  const __m256 e = Sleef_expf8_u10(_mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(safe_max(m))), _mm256_set1_ps(inv_t)));
  return _mm256_and_ps(_mm256_div_ps(e, _mm256_set1_ps(z)), keep);
}

// race_range over [start, end) of row j, 32 entries (eight Philox quads) per step; the entries
// past the last whole step go through the scalar race_range.
template <class TT, class TD>
SK_AVX2 void race_range(const ChainParams& P, const Request& rq, int64_t b, const AcceptWalk& aw, int64_t start,
                        int64_t end, Argmax& res, Argmax& pk) {
  const int64_t j = aw.j;
  const RowStats& s = aw.s;
  const bool recover = j < rq.n;
  const uint32_t purpose = recover ? PURPOSE_RECOVER : PURPOSE_BONUS;
  const TT* t_row = static_cast<const TT*>(P.target) + b * P.stride_tb + j * P.stride_tg;
  const TD* d_row = static_cast<const TD*>(P.draft) + b * P.stride_db + j * P.stride_dg;
  const __m256 log_z = _mm256_set1_ps(logf(s.t.z > 0.0f ? s.t.z : 1.0f));
  const __m256 m_ref = _mm256_set1_ps(safe_max(s.t.m)), inv_t = _mm256_set1_ps(rq.inv_t);
  const __m256 zero = _mm256_setzero_ps(), tiny = _mm256_set1_ps(1e-38f);
  const __m256i tok = _mm256_set1_epi32(int32_t(aw.tok_j));
  const __m256 wv = _mm256_set1_ps(aw.w);  // the residual's weight (1: the token rule, w * p == p)
  const int32_t* t_mask = target_mask(P, b, 0, j);
  const int32_t* d_mask = recover && P.draft_mode == DRAFT_LOGITS ? draft_mask(P, b, 0, j) : nullptr;
  Argmax8 res8, pk8;
  int unused = 0;
  int64_t x0 = start;
  for (; x0 + 32 <= end; x0 += 32) {
    uint32_t words[4][8];
    philox8(rq.seed, uint32_t(x0 / 4), uint32_t(j), purpose, words);
    for (int h = 0; h < 4; ++h) {  // entries x0 + 8h .. x0 + 8h + 7: quads 2h and 2h + 1
      alignas(32) uint32_t bits[8];
      for (int e = 0; e < 8; ++e) bits[e] = words[e % 4][2 * h + e / 4];
      const int64_t x = x0 + 8 * h;
      const __m256i idx = lane_index(x);
      const __m256 xt = sanitize8(mask8(load8(t_row + x), t_mask, x), unused);
      const __m256 p = prob8_of(xt, idx, s.t.m, s.t.z, s.thr_t, s.cut_t, rq.inv_t);
      const __m256 live = _mm256_cmp_ps(p, zero, _CMP_GT_OQ);
      if (_mm256_movemask_ps(live) == 0) continue;
      const __m256i raw = _mm256_load_si256(reinterpret_cast<const __m256i*>(bits));
      const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(raw, 9)), _mm256_set1_ps(0.5f)),
                                     _mm256_set1_ps(1.1920928955078125e-07f));
      const __m256 noise = _mm256_sub_ps(zero, Sleef_logf8_u10(_mm256_sub_ps(zero, Sleef_logf8_u10(u))));
      pk8.add(_mm256_add_ps(_mm256_sub_ps(_mm256_mul_ps(_mm256_sub_ps(xt, m_ref), inv_t), log_z), noise), idx, live);
      if (!recover) continue;
      const __m256 wp = _mm256_mul_ps(wv, p);
      __m256 r;
      if (P.draft_mode == DRAFT_LOGITS) {
        const __m256 d = sanitize8(mask8(load8(d_row + x), d_mask, x), unused);
        r = _mm256_max_ps(_mm256_sub_ps(wp, prob8_of(d, idx, s.q.m, s.q.z, s.thr_q, s.cut_q, rq.inv_t)), zero);
      } else if (P.draft_mode == DRAFT_PROBS) {
        r = _mm256_max_ps(_mm256_sub_ps(wp, prob8(load8(d_row + x))), zero);
      } else {
        r = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(idx, tok)), wp);
      }
      const __m256 key = _mm256_add_ps(Sleef_logf8_u10(_mm256_max_ps(r, tiny)), noise);
      res8.add(key, idx, _mm256_and_ps(live, _mm256_cmp_ps(r, zero, _CMP_GT_OQ)));
    }
  }
  res = res8.merged();
  pk = pk8.merged();
  if (x0 < end) {  // later indices: strict > in add() keeps the earlier entry on ties
    SeqReducer red;
    Argmax res_t, pk_t;
    sk::race_range<SeqReducer, TT, TD>(P, rq, b, aw, x0, end, red, res_t, pk_t);
    if (res_t.key > res.key) res = res_t;
    if (pk_t.key > pk.key) pk = pk_t;
  }
}

// Block verification's residual mass of row i of request b (verify_cpu.cpp residual_mass, eight
// entries a step): sum_x max(w p(x) - q(x), 0), the difference and the sum in double lanes.
template <class TT, class TD>
SK_AVX2 double residual_mass(const ChainParams& P, const Request& rq, const RowRef<TT, TD>& ref, const RowStats& s,
                             int64_t tok, double w) {
  const __m256d wd = _mm256_set1_pd(w), zero = _mm256_setzero_pd();
  const __m256i tok8 = _mm256_set1_epi32(int32_t(tok));
  __m256d acc_lo = zero, acc_hi = zero;
  int unused = 0;
  for (int64_t x = 0; x < P.V; x += 8) {
    const __m256i idx = lane_index(x);
    const __m256 xt = sanitize8(mask8(load8_upto(ref.t, x, P.V), ref.tm, x), unused);
    const __m256 p = prob8_of(xt, idx, s.t.m, s.t.z, s.thr_t, s.cut_t, rq.inv_t);
    if (_mm256_movemask_ps(_mm256_cmp_ps(p, _mm256_setzero_ps(), _CMP_GT_OQ)) == 0) continue;  // q >= 0
    __m256 q;
    if (P.draft_mode == DRAFT_LOGITS) {
      const __m256 d = sanitize8(mask8(load8_upto(ref.d, x, P.V), ref.dm, x), unused);
      q = prob8_of(d, idx, s.q.m, s.q.z, s.thr_q, s.cut_q, rq.inv_t);
    } else if (P.draft_mode == DRAFT_PROBS) {
      q = prob8(load8_upto(ref.d, x, P.V));  // the -inf padding reads as 0
    } else {
      q = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(idx, tok8)), _mm256_set1_ps(1.0f));
    }
    const __m256d lo = _mm256_sub_pd(_mm256_mul_pd(wd, _mm256_cvtps_pd(_mm256_castps256_ps128(p))),
                                     _mm256_cvtps_pd(_mm256_castps256_ps128(q)));
    const __m256d hi = _mm256_sub_pd(_mm256_mul_pd(wd, _mm256_cvtps_pd(_mm256_extractf128_ps(p, 1))),
                                     _mm256_cvtps_pd(_mm256_extractf128_ps(q, 1)));
    acc_lo = _mm256_add_pd(acc_lo, _mm256_max_pd(lo, zero));
    acc_hi = _mm256_add_pd(acc_hi, _mm256_max_pd(hi, zero));
  }
  alignas(32) double a[8];
  _mm256_store_pd(a, acc_lo);
  _mm256_store_pd(a + 4, acc_hi);
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

}  // namespace simd
}  // namespace sk

#endif  // x86-64
