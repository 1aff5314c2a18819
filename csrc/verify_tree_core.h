// Tree / multi-draft verification walk (SpecTr K-SEQ, RRS with and without replacement), one
// program per request, on top of the row statistics of verify_core.h (launched with one chunk).
// A line-by-line port of _tree_walk_kernel in specdec_kernels/ops/verify_tree.py: every scalar
// of the walk is computed redundantly by each thread of the program; vocabulary passes (K-SEQ's
// beta sums, RRS normalisers, the final race) are split across threads and reduced.
#pragma once

#include "verify_core.h"

namespace sk {

constexpr int MAX_TREE_NODES = 64;  // node sets are 64-bit masks
constexpr int RHO_POINTS = 16;      // must match ops/verify_tree.py
constexpr int RHO_ROUNDS = 4;

// Statistics record of a node's target row (node -1 = root) or of its draft row.
SK_HD int64_t tree_record(const ChainParams& P, int64_t b, int64_t node, int target) {
  const int64_t chain = node < 0 ? 0 : node / P.G;
  const int64_t slot = node < 0 ? 0 : node % P.G + target;
  return (b * P.K + chain) * (P.G + 1) + slot;
}

template <class T>
SK_HD const T* tree_row(const void* base, int64_t b, int64_t node, int64_t sb, int64_t sk_, int64_t sg, int64_t G,
                        int target) {
  const int64_t chain = node < 0 ? 0 : node / G;
  const int64_t slot = node < 0 ? 0 : node % G + target;
  return static_cast<const T*>(base) + b * sb + chain * sk_ + slot * sg;
}

// Unnormalised RRS residual after `steps` rejections: r_0 = p, r_{l+1} = max(r_l / Z_l - q_l, 0)
// with q_l = q (with replacement) or q without the tokens rejected before l, over D_l.
SK_HD float rrs_residual(float p, float q, int steps, const float* zs, const int64_t* xs, const float* ds, int64_t x,
                         bool wor) {
  float r = p;
  bool removed = false;
  for (int l = 0; l < steps; ++l) {
    float q_l = q;
    if (wor) {
      const float d = ds[l];
      q_l = (removed || d <= 0.0f) ? 0.0f : q / (d > 0.0f ? d : 1.0f);
      removed = removed || x == xs[l];
    }
    const float z = zs[l];
    const float nxt = (z > 0.0f ? r / z : 0.0f) - q_l;
    r = nxt > 0.0f ? nxt : 0.0f;
  }
  return r;
}

// p and q at vocab entry x of the position (q only where `with_q`).
template <class TT, class TD>
SK_HD void position_pq(const ChainParams& P, const TT* t_row, const TD* d_row, int64_t x, bool with_q, float m_t,
                       float z_t, float thr_t, float m_q, float z_q, float thr_q, float inv_t, float& xt, float& p,
                       float& q) {
  int unused = 0;
  xt = load_logit(t_row, x, unused);
  p = prob_of(xt, m_t, z_t, thr_t, inv_t);
  q = 0.0f;
  if (!with_q) return;
  if (P.draft_mode == DRAFT_LOGITS) {
    q = prob_of(load_logit(d_row, x, unused), m_q, z_q, thr_q, inv_t);
  } else if (P.draft_mode == DRAFT_PROBS) {
    q = load_prob(d_row, x, unused);
  }
}

template <class R, class TT, class TD>
SK_HD void tree_walk_program(const ChainParams& P, int64_t b, R& red) {
  const Request rq = load_request(P, b);
  const bool greedy = rq.greedy, stochastic = !rq.greedy;
  const int64_t N = P.K * P.G, V = P.V;
  const bool wor = P.method == 2;
  int unused = 0;

  // ---- the tree
  int64_t tok[MAX_TREE_NODES];
  int par[MAX_TREE_NODES];
  bool flagged = false;
  for (int64_t n = 0; n < N; ++n) {
    const bool node_ok = n < rq.n;
    int64_t t = node_ok ? P.draft_tokens[b * P.stride_xb + (n / P.G) * P.stride_xk + n % P.G] : -1;
    const bool ok = t >= 0 && t < V;
    tok[n] = ok ? t : -1;  // placeholder ids (outside [0, V)) never become candidates; no error
    int p = P.parents ? int(node_ok ? P.parents[b * P.stride_pb + n] : -1) : (n % P.G == 0 ? -1 : int(n - 1));
    par[n] = node_ok ? p : -2;  // padding nodes are nobody's children
  }

  // ---- walk state
  bool at_root = true, done = false;
  uint64_t in_set = 0;  // the nodes spelling the accepted prefix
  int64_t rep = -1, last = -1, depth = 0;
  int64_t* out_tok = P.out_tokens + b * P.stride_ob;
  if (red.rank() == 0)
    for (int64_t d = 0; d <= P.D; ++d) out_tok[d] = -1;

  for (int64_t d = 0; d <= P.D && !done; ++d) {
    // candidates: children of the current node set, in node order
    bool cand[MAX_TREE_NODES];
    int rank[MAX_TREE_NODES];
    int k = 0;
    int64_t first = -1;
    for (int64_t n = 0; n < N; ++n) {
      const bool in_pos = par[n] >= 0 ? ((in_set >> par[n]) & 1) != 0 : (par[n] == -1 && at_root);
      cand[n] = in_pos && tok[n] >= 0;
      rank[n] = k;
      if (cand[n]) {
        if (first < 0) first = n;
        ++k;
      }
    }
    const bool has_cand = k > 0;
    const uint32_t counter = uint32_t(rep + 1);  // Philox row of this position

    const int64_t rec_t = tree_record(P, b, rep, 1);
    const float* st = P.stats + rec_t * NUM_STATS;
    const float m_t = st[0], z_t = st[1];
    const int64_t g_idx = P.g_idx[rec_t];
    const float thr_t = (P.has_filter && stochastic) ? P.thr[rec_t * 2] : neg_inf();
    flagged |= st[5] > 0.0f || (stochastic && z_t == 0.0f);
    const TT* t_row = tree_row<TT>(P.target, b, rep, P.stride_tb, P.stride_tk, P.stride_tg, P.G, 1);

    // draft distribution of the position: the first candidate's draft row
    const int64_t first_safe = has_cand ? first : 0;
    const int64_t rec_q = tree_record(P, b, first_safe, 0);
    const TD* d_row = tree_row<TD>(P.draft, b, first_safe, P.stride_db, P.stride_dk, P.stride_dg, P.G, 0);
    const bool use_q = stochastic && has_cand;
    const float m_q = use_q ? P.stats[rec_q * NUM_STATS + 2] : 0.0f;
    const float z_q = use_q ? P.stats[rec_q * NUM_STATS + 3] : 0.0f;
    float thr_q = neg_inf();
    // unusable draft logits / probabilities in the row of this position flag the request
    flagged |= P.draft_mode != DRAFT_NONE && use_q && P.stats[rec_q * NUM_STATS + 6] > 0.0f;
    if (P.draft_mode == DRAFT_LOGITS && P.has_filter && use_q) thr_q = P.thr[rec_q * 2 + 1];
    float p_c[MAX_TREE_NODES], q_c[MAX_TREE_NODES], u[MAX_TREE_NODES];
    for (int64_t n = 0; n < N; ++n) {
      p_c[n] = q_c[n] = 0.0f;
      u[n] = 1.0f;
      if (!cand[n]) continue;
      p_c[n] = prob_of(load_logit(t_row, tok[n], unused), m_t, z_t, thr_t, rq.inv_t);
      if (P.draft_mode == DRAFT_LOGITS) {
        q_c[n] = prob_of(load_logit(d_row, tok[n], unused), m_q, z_q, thr_q, rq.inv_t);
      } else if (P.draft_mode == DRAFT_PROBS) {
        q_c[n] = load_prob(d_row, tok[n], unused);
      } else {
        q_c[n] = 1.0f;
      }
      u[n] = uniform_open(rq.seed, uint32_t(rank[n]), counter, PURPOSE_ACCEPT);
    }

    // ---- decide: the accepted candidate (-1 = none)
    float rho = 1.0f, scale = 1.0f;
    float zs[MAX_TREE_NODES + 1], ds[MAX_TREE_NODES + 1];
    int64_t xs[MAX_TREE_NODES + 1];
    for (int n = 0; n <= MAX_TREE_NODES; ++n) {
      zs[n] = ds[n] = n == 0 ? 1.0f : 0.0f;
      xs[n] = -1;
    }
    int steps = 0;
    bool accept[MAX_TREE_NODES];
    for (int64_t n = 0; n < N; ++n) accept[n] = false;
    if (P.draft_mode == DRAFT_NONE) {
      // one-hot drafts: p_j = p without the earlier (distinct) rejected tokens, renormalised
      float removed_before = 0.0f;
      for (int64_t n = 0; n < N; ++n) {
        bool repeated = false;
        for (int64_t m = 0; m < n; ++m) repeated |= cand[m] && tok[m] == tok[n];
        const float fresh = (cand[n] && !repeated) ? p_c[n] : 0.0f;
        const float left = 1.0f - removed_before;
        const float p_j = (repeated || left <= 0.0f) ? 0.0f : p_c[n] / (left > 0.0f ? left : 1.0f);
        accept[n] = cand[n] && p_j > 0.0f && u[n] <= p_j;
        removed_before += fresh;
      }
    } else if (P.method == 0) {
      // K-SEQ: bracket rho* in [1, k] with RHO_POINTS points per vocabulary pass
      const bool search = stochastic && k > 1;
      const float kf = float(k);
      float lo = 1.0f, hi = kf > 1.0f ? kf : 1.0f, beta_hi = 0.0f;
      if (search) {
        for (int round = 0; round < RHO_ROUNDS; ++round) {
          float pts[RHO_POINTS], beta[RHO_POINTS];
          for (int i = 0; i < RHO_POINTS; ++i) {
            pts[i] = i == RHO_POINTS - 1 ? hi : lo + (hi - lo) * (float(i + 1) / float(RHO_POINTS));
            beta[i] = 0.0f;
          }
          SK_FOR_QUADS(red, 0, V, q4) {
            for (int e = 0; e < 4 && q4 * 4 + e < V; ++e) {
              float xt, pv, qv;
              position_pq<TT, TD>(P, t_row, d_row, q4 * 4 + e, true, m_t, z_t, thr_t, m_q, z_q, thr_q, rq.inv_t, xt,
                                  pv, qv);
              for (int i = 0; i < RHO_POINTS; ++i) {
                const float a = pv / pts[i];
                beta[i] += qv < a ? qv : a;
              }
            }
          }
          int m_star = RHO_POINTS - 1;
          for (int i = RHO_POINTS - 1; i >= 0; --i) {
            beta[i] = red.sum(beta[i]);
          }
          for (int i = 0; i < RHO_POINTS; ++i) {
            const float om = 1.0f - beta[i];
            const float f = 1.0f - expf(kf * logf(om > 0.0f ? om : 0.0f)) - pts[i] * beta[i];
            if (f <= 0.0f) {
              m_star = i;
              break;
            }
          }
          const float new_lo = m_star > 0 ? pts[m_star - 1] : lo;
          lo = new_lo;
          hi = pts[m_star];
          beta_hi = beta[m_star];
        }
      }
      rho = search ? hi : 1.0f;
      const float om = 1.0f - beta_hi;
      const float pow_k = expf(kf * logf(om > 0.0f ? om : 0.0f));
      scale = search ? (beta_hi > 0.0f ? (1.0f - pow_k) / beta_hi : kf) : 1.0f;
      for (int64_t n = 0; n < N; ++n) accept[n] = cand[n] && p_c[n] > 0.0f && u[n] * rho * q_c[n] <= p_c[n];
    } else {
      // RRS: test candidates in rank order; each rejection renormalises the residual (one pass)
      bool decided = !stochastic;
      for (int j = 0; j < k; ++j) {
        int64_t at = -1;
        for (int64_t n = 0; n < N; ++n)
          if (cand[n] && rank[n] == j) at = n;
        const bool live = !decided;
        const int64_t x_j = tok[at];
        if (j > 0 && live) {  // Z_j: one pass over the vocabulary
          float z_j = 0.0f;
          SK_FOR_QUADS(red, 0, V, q4) {
            for (int e = 0; e < 4 && q4 * 4 + e < V; ++e) {
              const int64_t x = q4 * 4 + e;
              float xt, pv, qv;
              position_pq<TT, TD>(P, t_row, d_row, x, true, m_t, z_t, thr_t, m_q, z_q, thr_q, rq.inv_t, xt, pv, qv);
              z_j += rrs_residual(pv, qv, steps, zs, xs, ds, x, wor);
            }
          }
          zs[j] = red.sum(z_j);
        }
        const float r_x = rrs_residual(p_c[at], q_c[at], steps, zs, xs, ds, x_j, wor);
        const float z_now = zs[j];
        const float p_j = z_now > 0.0f ? r_x / z_now : 0.0f;
        bool repeated = false;
        float q_j = q_c[at];
        if (wor) {
          const float d_now = ds[j];
          for (int l = 0; l <= MAX_TREE_NODES; ++l) repeated |= xs[l] == x_j;
          q_j = (repeated || d_now <= 0.0f) ? 0.0f : q_c[at] / (d_now > 0.0f ? d_now : 1.0f);
          if (live) {
            ds[j + 1] = repeated ? d_now : d_now - q_c[at];
            if (!repeated) xs[j] = x_j;
          }
        }
        const bool ok = live && !repeated && p_j > 0.0f && u[at] * q_j <= p_j;
        accept[at] = accept[at] || ok;
        decided = decided || ok;
        if (live && !ok) ++steps;
      }
    }
    int64_t chosen = -1;
    if (greedy) {
      for (int64_t n = 0; n < N && chosen < 0; ++n)
        if (cand[n] && tok[n] == g_idx) chosen = n;
    } else {
      for (int64_t n = 0; n < N && chosen < 0; ++n)
        if (accept[n]) chosen = n;
    }
    const bool accepted = chosen >= 0;

    // ---- recovered / bonus token: exponential race over the residual of this position
    int64_t final_tok = g_idx;
    if (!accepted && !greedy) {
      const uint32_t purpose = has_cand ? PURPOSE_RECOVER : PURPOSE_BONUS;
      const float log_z = logf(z_t > 0.0f ? z_t : 1.0f);
      const float m_ref = safe_max(m_t);
      Argmax best, pk;
      SK_FOR_QUADS(red, 0, V, q4) {
        const Philox4 words = philox(rq.seed, uint32_t(q4), counter, purpose, 0);
        for (int e = 0; e < 4 && q4 * 4 + e < V; ++e) {
          const int64_t x = q4 * 4 + e;
          float xt, pv, qv;
          position_pq<TT, TD>(P, t_row, d_row, x, has_cand, m_t, z_t, thr_t, m_q, z_q, thr_q, rq.inv_t, xt, pv, qv);
          float w;
          if (P.draft_mode == DRAFT_NONE) {
            bool gone = false;
            for (int64_t n = 0; n < N; ++n) gone |= cand[n] && tok[n] == x;
            w = gone ? 0.0f : pv;
          } else if (P.method == 0) {
            const float a = pv / rho;
            const float v = pv - scale * (qv < a ? qv : a);
            w = v > 0.0f ? v : 0.0f;
          } else {
            w = rrs_residual(pv, qv, steps, zs, xs, ds, x, wor);
          }
          if (!has_cand) w = pv;
          const float noise = race_noise_from_uniform(uniform_from_bits(words.w[e]));
          if (w > 0.0f) best.add(logf(w > 1e-38f ? w : 1e-38f) + noise, x);
          if (pv > 0.0f) pk.add((xt - m_ref) * rq.inv_t - log_z + noise, x);
        }
      }
      best.reduce(red);
      pk.reduce(red);
      final_tok = best.key > neg_inf() ? best.idx : pk.index_or_zero();
    }
    final_tok = final_tok < 0 ? 0 : (final_tok > V - 1 ? V - 1 : final_tok);

    // ---- advance
    const int64_t chosen_tok = accepted ? tok[chosen] : 0;
    if (red.rank() == 0) out_tok[d] = accepted ? chosen_tok : final_tok;
    if (accepted) {
      uint64_t new_set = 0;
      int64_t new_rep = -1;
      for (int64_t n = 0; n < N; ++n) {
        if (cand[n] && tok[n] == chosen_tok) {
          new_set |= uint64_t(1) << n;
          if (new_rep < 0) new_rep = n;
        }
      }
      in_set = new_set;
      rep = new_rep;
      last = chosen;
      at_root = false;
      ++depth;
    } else {
      done = true;
    }
  }

  if (red.rank() == 0) {
    int64_t* out_nodes = P.out_nodes + b * P.stride_nb;
    for (int64_t t = 0; t < P.D; ++t) out_nodes[t] = -1;
    int64_t node = last;
    for (int64_t pos = depth - 1; pos >= 0 && node >= 0; --pos) {
      if (pos < P.D) out_nodes[pos] = node;
      node = par[node];
    }
    P.out_accepted[b] = int32_t(depth);
    P.out_nonfinite[b] = flagged;
  }
}

}  // namespace sk
