// method="block" (reference/block.py; Sun et al. 2024) of the sampled requests, on the row pass's
// statistics, shared by the CPU build (verify_cpu.cpp) and the CUDA kernels (verify_cuda.cu): one
// program per request between the row pass and the accept programs.
//
// The weights w_i = min(w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i), 1) from the drafts' p and q (what the
// accept tests read: no pass over a row), then tau = the last i in 1..n with eta_i <= h_i (eta_i:
// the token rule's accept uniform of position i - 1; h_n = w_n), scanned from i = n down so that it
// stops at the first i that stops. h_i = r_i / (r_i + 1 - w_i) needs the residual mass
// r_i = sum_x max(w_i p_i(x) - q_i(x), 0): one more pass over row i (target, and the draft row in
// mode 1), in double. Since r_i <= w_i (sum_x p_i(x) = 1), h_i <= w_i: a position with eta_i > w_i
// (w_i = 0 included) cannot stop and needs no pass. Cost: at most n - 1 extra row passes per
// request (one each for the positions i < n the scan reaches with eta_i <= w_i), none when
// tau = n; then the accept programs race row tau (block_walk) as the token rule races row j.
#pragma once

#include "verify_core.h"

namespace sk {

// Slack on h_i <= w_i: the float32 probabilities of a row sum to 1 within ~1e-6, so r_i can exceed
// w_i by rounding; a position is skipped only when eta_i > w_i + this (then h_i < eta_i surely).
constexpr double BLOCK_BOUND_SLACK = 1e-5;

// r = sum_x max(w p(x) - q(x), 0) over row i of request b (statistics s; tok: the draft token there,
// for one-hot q), in double: each thread adds its entries, the program adds the threads
// (red.sum(double)). The CPU build's AVX2 path is simd::residual_mass.
template <class R, class TT, class TD>
SK_HD double residual_mass_program(const ChainParams& P, const Request& rq, int64_t b, int64_t i, const RowStats& s,
                                   int64_t tok, double w, R& red) {
  const RowRef<TT, TD> ref = row_ref<TT, TD>(P, b * (P.G + 1) + i);
  double r = 0.0;
  int unused = 0;
  for (int64_t x = red.rank(); x < P.V; x += red.size()) {
    const float xt = mask_logit(load_logit(ref.t, x, unused), ref.tm, x);
    const float p = prob_of(xt, s.t.m, s.t.z, s.thr_t, rq.inv_t, x, s.cut_t);
    if (!(p > 0.0f)) continue;  // q >= 0
    float q = x == tok ? 1.0f : 0.0f;
    if (P.draft_mode == DRAFT_LOGITS) {
      q = prob_of(mask_logit(load_logit(ref.d, x, unused), ref.dm, x), s.q.m, s.q.z, s.thr_q, rq.inv_t, x, s.cut_q);
    } else if (P.draft_mode == DRAFT_PROBS) {
      q = load_prob(ref.d, x, unused);
    }
    const double e = w * double(p) - double(q);
    r += e < 0.0 ? 0.0 : e;  // max(e, 0)
  }
  return red.sum(r);
}

// Block verification of request b (sampled): tau into first_reject[b], w_tau into block_w[b], and
// the flag (any of rows 0 .. n, as the reference reads them all). The weights go to
// P.block_ws[b, 0 .. n] (rank 0 writes them; every thread reads them after a barrier).
// residual(rq, b, i, s, tok, w): residual_mass_program of row i (or the CPU build's AVX2 one),
// called by every thread.
template <class R, class TT, class TD, class Residual>
SK_HD void block_decide_program(const ChainParams& P, int64_t b, R& red, Residual&& residual) {
  const Request rq = load_request(P, b);
  if (rq.greedy) return;  // the argmax chain, the token rule's (accept_walk)
  const int64_t n = rq.n;  // drafts end at the first placeholder (load_request)
  const int64_t* toks = P.draft_tokens + b * P.stride_xb;
  double* w = P.block_ws + b * (P.G + 1);
  double w_i = 1.0;
  if (red.rank() == 0) w[0] = 1.0;
  bool flagged = false;
  for (int64_t i = 0; i <= n; ++i) {
    const RowStats s = combine_row(P, b * (P.G + 1) + i, rq);
    flagged |= row_flagged(s, rq);
    if (i == n) break;
    float p, q;
    draft_token_probs<TT, TD>(P, rq, b, i, toks[i], s, p, q);
    // ratio p / q (+inf for q = 0 < p); w stays 0 once 0 (the reference's 0 * inf = NaN acts as 0)
    const double ratio = p > 0.0f ? (q > 0.0f ? double(p) / double(q) : INFINITY) : 0.0;
    const double next = w_i * ratio;
    w_i = w_i > 0.0 ? (1.0 < next ? 1.0 : next) : 0.0;  // min(w_i ratio, 1)
    if (red.rank() == 0) w[i + 1] = w_i;
  }
  red.sync();
  int64_t tau = 0;
  for (int64_t i = n; i >= 1; --i) {
    const double eta = uniform_open(rq.seed, 0, uint32_t(i - 1), PURPOSE_ACCEPT);
    if (i == n) {  // h_n = w_n
      if (eta <= w[n]) {
        tau = n;
        break;
      }
      continue;
    }
    if (!(w[i] > 0.0 && eta <= w[i] + BLOCK_BOUND_SLACK)) continue;  // h_i <= w_i < eta_i
    const RowStats s = combine_row(P, b * (P.G + 1) + i, rq);
    const double r = residual(rq, b, i, s, toks[i], w[i]);
    if (r > 0.0 && eta <= r / (r + 1.0 - w[i])) {
      tau = i;
      break;
    }
  }
  if (red.rank() == 0) {
    P.first_reject[b] = int32_t(tau);
    P.direct[b] = 0;  // a greedy request's token only
    P.flagged[b] = flagged ? 1 : 0;
    P.block_w[b] = float(w[tau]);
  }
}

}  // namespace sk
