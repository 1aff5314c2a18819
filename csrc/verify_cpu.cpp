// Chain and tree verification on the CPU (backend="cpu"): the programs of verify_core.h and
// verify_tree_core.h, each run by one thread ("programs" of one lane: every reduction is the
// identity), spread over the cores with OpenMP: row statistics over (row, vocab chunk), accept
// programs over (request, chunk), the tree walk over requests. Same code, same Philox stream and
// hence the same tokens as the CUDA kernels, the Triton kernels and the reference.
//
// Top-k / top-p thresholds are found before the row pass by selection on each row (nth_element
// and a sort of the kept logits, the reference's own definition in double precision) instead of
// the GPU programs' radix-select passes; the row pass can then split filtered rows into chunks too.
#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <vector>

#include "verify_api.h"
#include "verify_cpu_simd.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace sk {
namespace {

// Threshold of one sanitised row, as reference/sampling.py's filter_threshold defines it:
// top-k keeps logits >= the k-th largest finite one; top-p then keeps the smallest set of the
// highest logits whose mass exp((x - max) / T) (float64, in descending order) reaches top_p of
// the kept mass, ties at the boundary kept. -inf: nothing filtered. `buf` is scratch.
// by_index (top_p_ties="by_index"): ties at the boundary are ordered by index, higher first, and
// only those whose mass before them is < the goal stay: `cut` gets the lowest index kept of the
// boundary tie group (kept_at), 0 when the whole group stays.
// The index of the m-th highest-index entry of the row equal to thr (m >= 1), or 0 when the row
// holds no more than m of them (the whole tie group stays). `mask`: the row's token_bitmask words.
template <class T>
int32_t tie_cut(const T* row, const int32_t* mask, int64_t V, float thr, int64_t m) {
  int unused = 0;
  int64_t seen = 0, total = 0;
  for (int64_t x = 0; x < V; ++x) total += mask_logit(load_logit(row, x, unused), mask, x) == thr ? 1 : 0;
  if (total <= m) return 0;
  for (int64_t x = V - 1; x >= 0; --x) {
    if (mask_logit(load_logit(row, x, unused), mask, x) == thr && ++seen == m) return int32_t(x);
  }
  return 0;
}

template <class T>
float selected_threshold(const T* row, const int32_t* mask, int64_t V, float temperature, int32_t top_k,
                         float top_p, std::vector<float>& buf, bool by_index, int32_t& cut) {
  cut = 0;
  buf.clear();
  int unused = 0;
  for (int64_t x = 0; x < V; ++x) {
    const float v = mask_logit(load_logit(row, x, unused), mask, x);
    if (v > neg_inf()) buf.push_back(v);
  }
  float thr = neg_inf();
  const auto descending = std::greater<float>();
  if (top_k > 0 && top_k < V && int64_t(buf.size()) >= top_k) {
    std::nth_element(buf.begin(), buf.begin() + (top_k - 1), buf.end(), descending);
    thr = buf[top_k - 1];
  }
  if (top_p < 1.0f) {
    auto kept_end = std::partition(buf.begin(), buf.end(), [thr](float v) { return v >= thr; });
    if (kept_end == buf.begin()) return thr;
    std::sort(buf.begin(), kept_end, descending);
    const int64_t n = kept_end - buf.begin();
    const double top = buf[0];
    std::vector<double> mass(n);
    double total = 0.0;
    for (int64_t e = 0; e < n; ++e) {
      total += std::exp((double(buf[e]) - top) / double(temperature));
      mass[e] = total;
    }
    const double goal = double(top_p) * total;
    const int64_t first = std::lower_bound(mass.begin(), mass.end(), goal) - mass.begin();
    const int64_t last = first < n ? first : n - 1;  // the last kept position
    thr = buf[last];
    if (by_index) {  // kept from the tie group: the kept positions past the entries above thr
      const int64_t above = std::lower_bound(buf.begin(), kept_end, thr, descending) - buf.begin();
      cut = tie_cut(row, mask, V, thr, last + 1 - above);
    }
  }
  return thr;
}

// Threads only pay off for enough vocabulary entries: below this a parallel region costs more than
// the work (on a busy machine an OpenMP barrier waits for a descheduled thread: tens of ms for a
// call that takes 0.1 ms on one thread).
constexpr int64_t kMinEntriesForThreads = int64_t(1) << 16;

inline bool worth_threads(int64_t rows, int64_t V) { return rows * V >= kMinEntriesForThreads; }

inline bool simd_enabled() {
#ifdef SK_HAVE_AVX2_PATH
  return simd::enabled();
#else
  return false;
#endif
}

// Thresholds of every row the row pass reads (rows i <= n of sampled requests), into P.thr.
template <class TT, class TD>
void thresholds_by_selection(const ChainParams& P, int64_t rows) {
#pragma omp parallel if (worth_threads(rows, P.V))
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t bk = row / (P.G + 1), i = row % (P.G + 1);
      const int64_t b = bk / P.K, k = bk % P.K;
      const Request rq = load_request(P, b);
      P.thr[row * 2 + 0] = neg_inf();
      P.thr[row * 2 + 1] = neg_inf();
      int32_t cut[2] = {0, 0};
      const bool by_index = P.cut != nullptr;
      if (i <= rq.n && !rq.greedy) {
        const TT* t_row = static_cast<const TT*>(P.target) + b * P.stride_tb + k * P.stride_tk + i * P.stride_tg;
        P.thr[row * 2 + 0] = selected_threshold(t_row, target_mask(P, b, k, i), P.V, rq.temperature, rq.top_k,
                                                rq.top_p, buf, by_index, cut[0]);
        if (P.draft_mode == DRAFT_LOGITS && i < rq.n && i < P.G) {
          const TD* d_row = static_cast<const TD*>(P.draft) + b * P.stride_db + k * P.stride_dk + i * P.stride_dg;
          P.thr[row * 2 + 1] = selected_threshold(d_row, draft_mask(P, b, k, i), P.V, rq.temperature, rq.top_k,
                                                  rq.top_p, buf, by_index, cut[1]);
        }
      }
      if (by_index) {
        P.cut[row * 2 + 0] = cut[0];
        P.cut[row * 2 + 1] = cut[1];
      }
    }
  }
}

// Program 1 for a greedy row on the CPU: the same record as row_stats_program (greedy needs only
// the argmax and the non-finite count), in two vectorisable passes instead of a branchy online
// argmax: the max over the chunk (SIMD reduction), then the first index holding it.
// `mask`: the row's token_bitmask words (null: none).
template <class TT>
void greedy_row_stats(const ChainParams& P, int64_t row, int64_t chunk, const TT* t_row, const int32_t* mask) {
  const int64_t start = chunk * P.chunk_size;
  const int64_t end = start + P.chunk_size < P.V ? start + P.chunk_size : P.V;
  float m = neg_inf();
  int bad = 0;
  if (mask != nullptr) {
    // masked before sanitised: a disallowed entry is -inf, never a non-finite one
    for (int64_t x = start; x < end; ++x) m = std::max(m, sanitize_logit(mask_logit(to_float(t_row[x]), mask, x), bad));
  } else {
#pragma omp simd reduction(max : m) reduction(+ : bad)
    for (int64_t x = start; x < end; ++x) {
      const float v = to_float(t_row[x]);
      const bool is_bad = (v != v) || v == INFINITY;
      bad += is_bad ? 1 : 0;
      m = std::max(m, is_bad ? neg_inf() : v);
    }
  }
  int32_t idx = 0;  // no finite logit: index 0, as index_or_zero() reports
  if (m > neg_inf()) {
    for (int64_t x = start; x < end; ++x) {
      if (mask_logit(to_float(t_row[x]), mask, x) == m) {
        idx = int32_t(x);
        break;
      }
    }
  }
  float* s = P.stats + (row * P.num_chunks + chunk) * NUM_STATS;
  s[0] = neg_inf();
  s[1] = 0.0f;
  s[2] = neg_inf();
  s[3] = 0.0f;
  s[4] = m;
  s[5] = float(bad);
  s[6] = 0.0f;
  P.g_idx[row * P.num_chunks + chunk] = idx;
}

template <class TT, class TD>
void row_stats_item(const ChainParams& P, int64_t row, int64_t chunk, bool simd_on) {
  const int64_t bk = row / (P.G + 1), i = row % (P.G + 1);
  const int64_t b = bk / P.K, k = bk % P.K;
  const Request rq = load_request(P, b);
  const TT* t_row = static_cast<const TT*>(P.target) + b * P.stride_tb + k * P.stride_tk + i * P.stride_tg;
  const int32_t* mask = target_mask(P, b, k, i);
#ifdef SK_HAVE_AVX2_PATH
  if (simd_on && rq.greedy && i <= rq.n) return simd::greedy_row_stats(P, row, chunk, t_row, mask);
  if (simd_on && !rq.greedy && P.thresholds_given == P.has_filter) return simd::sampled_row_stats<TT, TD>(P, row, chunk);
#else
  (void)simd_on;
#endif
  if (rq.greedy && i <= rq.n) {
    greedy_row_stats(P, row, chunk, t_row, mask);
    return;
  }
  SeqReducer red;
  row_stats_program<SeqReducer, TT, TD>(P, row, chunk, red);
}

// ------------------------------------------------------------------------------------------
// method="block": verify_block.h's block_decide_program, with the residual mass in AVX2 when on.

// r = sum_x max(w p(x) - q(x), 0) over row i of request b: block_decide_program's residual.
template <class TT, class TD>
double residual_mass(const ChainParams& P, const Request& rq, int64_t b, int64_t i, const RowStats& s, int64_t tok,
                     double w, bool simd_on) {
#ifdef SK_HAVE_AVX2_PATH
  if (simd_on) return simd::residual_mass<TT, TD>(P, rq, row_ref<TT, TD>(P, b * (P.G + 1) + i), s, tok, w);
#else
  (void)simd_on;
#endif
  SeqReducer red;
  return residual_mass_program<SeqReducer, TT, TD>(P, rq, b, i, s, tok, w, red);
}

// Program 2 of (request, chunk): the accept tests (or block verification's row tau), then this
// chunk's race (AVX2 when on).
template <class TT, class TD>
void accept_item(const ChainParams& P, int64_t b, int64_t chunk, bool simd_on) {
  SeqReducer red;
  const Request rq = load_request(P, b);
  const AcceptWalk w = P.block_w != nullptr && !rq.greedy ? block_walk(P, rq, b)
                                                          : accept_walk<SeqReducer, TT, TD>(P, rq, b, chunk, red);
  Argmax res, pk;
  if (!rq.greedy) {
    const int64_t start = chunk * P.chunk_size, end = chunk_end(P, chunk);
#ifdef SK_HAVE_AVX2_PATH
    if (simd_on) simd::race_range<TT, TD>(P, rq, b, w, start, end, res, pk);
    else race_range<SeqReducer, TT, TD>(P, rq, b, w, start, end, red, res, pk);
#else
    (void)simd_on;
    race_range<SeqReducer, TT, TD>(P, rq, b, w, start, end, red, res, pk);
#endif
  }
  store_race(P, b, chunk, red, res, pk);
}

// The statistics return_logprobs scores a greedy request's row with, which the row pass did not
// keep (only the argmax): temperature 1 with the request's top-k / top-p - the threshold (thr, cut:
// selection, as for sampled rows) and z, the sum of exp(x - m) over the kept entries (m: the row's
// max). One pass over the row (two with a filter). The CPU build's GreedyNorm (verify_logprobs.h).
template <class TT>
double greedy_row_normaliser(const ChainParams& P, const Request& rq, const TT* t_row, const int32_t* mask, float m,
                             std::vector<float>& buf, bool simd_on, float& thr, int32_t& cut) {
  thr = neg_inf();
  cut = 0;
  if (P.has_filter) thr = selected_threshold(t_row, mask, P.V, 1.0f, rq.top_k, rq.top_p, buf, P.cut != nullptr, cut);
  double z = 0.0;
#ifdef SK_HAVE_AVX2_PATH
  if (simd_on) z = simd::sum_exp(t_row, mask, 0, P.V, m, 1.0f, thr, cut);
#endif
  if (!simd_on && m > neg_inf()) {
    int unused = 0;
    for (int64_t x = 0; x < P.V; ++x) {
      const float v = sanitize_logit(mask_logit(to_float(t_row[x]), mask, x), unused);
      if (v > neg_inf() && kept_at(v, x, thr, cut)) z += double(expf(v - m));
    }
  }
  return z;
}

// The GreedyNorm of return_logprobs (verify_logprobs.h) on the CPU: greedy_row_normaliser, or with
// `gpu` (a test entry: binding.cpp's logprobs mode 2) the CUDA kernels' greedy_normaliser_program
// run by one thread, so that the GPU's statistics of greedy rows are checked without a GPU.
template <class TT>
struct CpuGreedyNorm {
  const ChainParams& P;
  bool simd_on, gpu;
  std::vector<float> buf;
  std::unique_ptr<ThresholdScratch> scratch;

  CpuGreedyNorm(const ChainParams& params, bool simd, bool gpu_programs)
      : P(params), simd_on(simd), gpu(gpu_programs),
        scratch(gpu_programs && params.has_filter ? std::make_unique<ThresholdScratch>() : nullptr) {}

  double operator()(const Request& rq, const TT* t_row, const int32_t* mask, float m, float& thr, int32_t& cut) {
    if (!gpu) return greedy_row_normaliser(P, rq, t_row, mask, m, buf, simd_on, thr, cut);
    SeqReducer red;
    return greedy_normaliser_program(P, rq, red, scratch.get(), t_row, mask, m, thr, cut);
  }
};

template <class TT, class TD>
void row_pass(ChainParams& P, int64_t rows) {
  if (P.has_filter) {
    thresholds_by_selection<TT, TD>(P, rows);
    P.thresholds_given = true;
  }
  const int64_t C = P.num_chunks;
  const bool simd_on = simd_enabled();
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(rows, P.V))
  for (int64_t item = 0; item < rows * C; ++item) row_stats_item<TT, TD>(P, item / C, item % C, simd_on);
}

}  // namespace

int cpu_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void row_pass_cpu(const ChainParams& params, int target_dtype, int draft_dtype) {
  ChainParams P = params;
  dispatch_dtypes(target_dtype, draft_dtype, [&](auto tt, auto td) {
    row_pass<decltype(tt), decltype(td)>(P, P.B * (P.G + 1));
  });
}

void verify_chain_cpu(const ChainParams& params, int target_dtype, int draft_dtype, bool gpu_logprobs) {
  ChainParams P = params;
  dispatch_dtypes(target_dtype, draft_dtype, [&](auto tt, auto td) {
    using TT = decltype(tt);
    using TD = decltype(td);
    row_pass<TT, TD>(P, P.B * (P.G + 1));
    const int64_t C = P.num_chunks;
    const bool simd_on = simd_enabled();
    if (P.block_w != nullptr) {
      const auto residual = [&](const Request& rq, int64_t b, int64_t i, const RowStats& s, int64_t tok, double w) {
        return residual_mass<TT, TD>(P, rq, b, i, s, tok, w, simd_on);
      };
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(P.B, P.V))
      for (int64_t b = 0; b < P.B; ++b) {
        SeqReducer red;
        block_decide_program<SeqReducer, TT, TD>(P, b, red, residual);
      }
    }
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(P.B, P.V))
    for (int64_t item = 0; item < P.B * C; ++item) accept_item<TT, TD>(P, item / C, item % C, simd_on);
    if (C > 1) {
#pragma omp parallel for if (worth_threads(P.B, P.V))
      for (int64_t b = 0; b < P.B; ++b) finalize_request(P, b);
    }
    if (P.out_logprobs != nullptr) {
#pragma omp parallel if (worth_threads(P.B, P.V))
      {
        SeqReducer red;
        CpuGreedyNorm<TT> norm(P, simd_on, gpu_logprobs);
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < P.B; ++b) chain_logprobs_program<SeqReducer, TT, TD>(P, b, red, norm);
      }
    }
  });
}

void verify_tree_cpu(const ChainParams& params, int target_dtype, int draft_dtype, bool gpu_logprobs) {
  ChainParams P = params;
  dispatch_dtypes(target_dtype, draft_dtype, [&](auto tt, auto td) {
    using TT = decltype(tt);
    using TD = decltype(td);
    row_pass<TT, TD>(P, P.B * P.K * (P.G + 1));
    const bool simd_on = simd_enabled();
#pragma omp parallel if (worth_threads(P.B, P.V))
    {
      CpuGreedyNorm<TT> norm(P, simd_on, gpu_logprobs);
#pragma omp for schedule(dynamic, 1)
      for (int64_t b = 0; b < P.B; ++b) {
        SeqReducer red;
        TreeWalkScratch scratch;
        tree_walk_program<SeqReducer, TT, TD>(P, b, red, scratch);
        if (P.out_logprobs != nullptr) tree_logprobs_program<SeqReducer, TT>(P, b, red, norm);
      }
    }
  });
}

}  // namespace sk
