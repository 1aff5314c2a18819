// return_logprobs from the row statistics (reference/logprobs.py), shared by the CPU build
// (verify_cpu.cpp) and the CUDA kernels (verify_cuda.cu): one program per request, run after the
// request's tokens are written (chains: after finalize; trees and verify_multi: after the walk).
//
// A sampled row is scored with the statistics the row pass already keeps (max m, normaliser z,
// top-k / top-p threshold): (x - m) / T - log z. A greedy row is scored at temperature 1 with the
// request's top-k / top-p (the log_softmax an engine reports), statistics the row pass does not
// keep (it needs only the argmax): a `GreedyNorm` callable finds them, one pass over the row (two
// with a filter), with the signature
//
//   double norm(const Request& rq, const TT* t_row, const int32_t* mask, float m, float& thr, int32_t& cut)
//
// (z = the sum of exp(x - m) over the entries the threshold thr / cut keeps; m the row's max).
// The CPU build passes its selection and AVX2 sums (verify_cpu.cpp greedy_row_normaliser); the
// CUDA kernels pass greedy_normaliser_program below (the GPU's radix-select threshold and a
// thread-block sum). Every thread of a program calls the programs here; only rank 0 writes.
#pragma once

#include "verify_core.h"

namespace sk {

// log p(tok) under a processed target row from its statistics (max m, normaliser z, top-k / top-p
// threshold thr / cut, temperature t; x the token's masked logit): (x - m) / t - log z for a kept
// token, -inf outside the kept set (reference/logprobs.py). In double, like the post-pass
// (ops/logprobs.py).
SK_HD float kept_logprob(float x, int64_t tok, float m, double z, float thr, int32_t cut, double t) {
  const bool kept = kept_at(x, tok, thr, cut) && x > neg_inf() && z > 0.0;
  return kept ? float((double(x) - double(safe_max(m))) / t - log(z)) : neg_inf();
}

// The statistics of a greedy row as the GPU programs find them (the GreedyNorm of the CUDA
// kernels): the top-k / top-p threshold of the row at temperature 1 by radix select
// (filter_threshold; `scratch` is needed with P.has_filter only), then z = sum of exp(x - m) over
// the kept entries, each thread adding its entries in R::Wide and the program adding the threads.
// No index cut (top_p_ties="by_index" is the CPU build's only).
template <class R, class TT>
SK_HD double greedy_normaliser_program(const ChainParams& P, const Request& rq, R& red, ThresholdScratch* scratch,
                                       const TT* t_row, const int32_t* mask, float m, float& thr, int32_t& cut) {
  thr = neg_inf();
  cut = 0;
  if (P.has_filter) thr = filter_threshold(red, *scratch, t_row, P.V, 1.0f, rq.top_k, rq.top_p, mask);
  typename R::Wide z = 0.0f;
  if (m > neg_inf()) {  // a row-wide value: every thread takes the same branch
    for (int32_t o = int32_t(red.rank()), o_end = int32_t((P.V + 7) / 8); o < o_end; o += int32_t(red.size())) {
      float v[8];
      load_oct(t_row, int64_t(o) * 8, P.V, v);
      mask_run(mask, int64_t(o) * 8, v);
      int unused = 0;
      for (int e = 0; e < 8; ++e) {
        const int64_t x = int64_t(o) * 8 + e;
        const float xv = sanitize_logit(v[e], unused);  // entries past V read -inf: never kept
        if (xv > neg_inf() && kept_at(xv, x, thr, 0)) z += typename R::Wide(expf(xv - m));
      }
    }
  }
  return double(red.sum(float(z)));
}

// return_logprobs of chain request b (after finalize_request): log p(token) of each emitted
// position i under row i's processed target distribution, kept_logprob on the row statistics
// (greedy requests: T = 1 with their top-k / top-p, whose statistics `norm` finds for the emitted
// rows 0 .. j and records as chunk 0's, the other chunks empty, the threshold into P.thr / P.cut),
// -inf for a token outside the kept set, NaN where no token was emitted or the row has no finite
// logit.
template <class R, class TT, class TD, class GreedyNorm>
SK_HD void chain_logprobs_program(const ChainParams& P, int64_t b, R& red, GreedyNorm&& norm) {
  const Request rq = load_request(P, b);
  if (rq.greedy) {
    for (int64_t i = 0; i <= P.first_reject[b]; ++i) {
      const int64_t row = b * (P.G + 1) + i;
      const TT* t_row = static_cast<const TT*>(P.target) + b * P.stride_tb + i * P.stride_tg;
      float m = neg_inf();
      for (int64_t c = 0; c < P.num_chunks; ++c) {
        const float g_max = P.stats[(row * P.num_chunks + c) * NUM_STATS + 4];
        m = g_max > m ? g_max : m;
      }
      float thr = neg_inf();
      int32_t cut = 0;
      const double z = norm(rq, t_row, target_mask(P, b, 0, i), m, thr, cut);
      if (red.rank() == 0) {
        if (P.has_filter) {
          P.thr[row * 2] = thr;
          if (P.cut != nullptr) P.cut[row * 2] = cut;
        }
        for (int64_t c = 0; c < P.num_chunks; ++c) {
          float* s = P.stats + (row * P.num_chunks + c) * NUM_STATS;
          s[0] = c == 0 ? m : neg_inf();
          s[1] = c == 0 ? float(z) : 0.0f;
        }
      }
    }
    red.sync();  // the records above, before rank 0 reads them back
  }
  if (red.rank() != 0) return;
  const double t = rq.greedy ? 1.0 : double(rq.temperature);
  const int64_t* out = P.out_tokens + b * P.stride_ob;
  float* lp = P.out_logprobs + b * P.stride_lb;
  int unused = 0;
  for (int64_t i = 0; i <= P.G; ++i) {
    const int64_t tok = out[i];
    const RowStats s = tok >= 0 ? combine_row(P, b * (P.G + 1) + i, rq) : RowStats{};
    if (tok < 0 || tok >= P.V || !(s.g_max > neg_inf())) {
      lp[i] = NAN;
      continue;
    }
    const float x = mask_logit(target_logit<TT, TD>(P, b, i, tok, unused), target_mask(P, b, 0, i), tok);
    lp[i] = kept_logprob(x, tok, s.t.m, double(s.t.z), s.thr_t, s.cut_t, t);
  }
}

// return_logprobs of tree request b (after its walk): log p(token) of each emitted position d under
// the processed target row the walk scored it with (P.walk_rows: the root's, then that of the first
// node of the set spelling the accepted prefix), from the row's record (one chunk), as
// chain_logprobs_program scores a chain's rows (greedy requests: `norm` on each emitted row).
template <class R, class TT, class GreedyNorm>
SK_HD void tree_logprobs_program(const ChainParams& P, int64_t b, R& red, GreedyNorm&& norm) {
  const Request rq = load_request(P, b);
  const int64_t* out = P.out_tokens + b * P.stride_ob;
  float* lp = P.out_logprobs + b * P.stride_lb;
  for (int64_t d = 0; d <= P.D; ++d) {  // the branches below depend on per-row values only
    const int64_t tok = out[d];
    const int64_t rec = d <= P.out_accepted[b] ? P.walk_rows[b * (P.D + 1) + d] : -1;
    const float* st = P.stats + (rec < 0 ? 0 : rec) * NUM_STATS;
    if (rec < 0 || tok < 0 || tok >= P.V || !(st[4] > neg_inf())) {
      if (red.rank() == 0) lp[d] = NAN;
      continue;
    }
    const int64_t k = (rec / (P.G + 1)) % P.K, i = rec % (P.G + 1);
    const TT* t_row = static_cast<const TT*>(P.target) + b * P.stride_tb + k * P.stride_tk + i * P.stride_tg;
    const int32_t* mask = target_mask(P, b, k, i);
    float m = st[0], thr = P.has_filter ? P.thr[rec * 2] : neg_inf();
    int32_t cut = P.cut != nullptr ? P.cut[rec * 2] : 0;
    double z = st[1];
    if (rq.greedy) {
      m = st[4];
      z = norm(rq, t_row, mask, m, thr, cut);
    }
    int unused = 0;
    const float x = sanitize_logit(mask_logit(to_float(t_row[tok]), mask, tok), unused);
    if (red.rank() == 0) lp[d] = kept_logprob(x, tok, m, z, thr, cut, rq.greedy ? 1.0 : double(rq.temperature));
  }
}

}  // namespace sk
