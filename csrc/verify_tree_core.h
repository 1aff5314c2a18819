// Tree / multi-draft verification walk (SpecTr K-SEQ, RRS with and without replacement), one
// program per request, on top of the row statistics of verify_core.h (launched with one chunk).
// A line-by-line port of _tree_walk_kernel in specdec_kernels/ops/verify_tree.py: every scalar
// of the walk is computed redundantly by each thread of the program; vocabulary passes (K-SEQ's
// beta sums, RRS normalisers, the final race) are split across threads and reduced.
#pragma once

#include "verify_core.h"

namespace sk {

constexpr int MAX_TREE_NODES = 64;  // node sets are 64-bit masks
// K-SEQ's rho search: must match reference/verify_tree.py (rho_step)
constexpr int RHO_POINTS = 8;          // values of rho per vocabulary pass
constexpr int RHO_ROUNDS = 3;          // passes at most
constexpr float RHO_TOL = 5e-5f;       // stop once A(lo) - A(hi) <= RHO_TOL
constexpr int RHO_BISECT = 16;         // bisection steps placing the next points
constexpr float RHO_MARGIN = 0.125f;   // the next points span the sandwich's roots widened by this share
constexpr float RHO_EPS = 1.0f / 65536.0f;  // the next points' least margin, in f (the reference says why)

// Chain and slot of a node in the [K, G] layout; the root (node < 0) and any node of a tree with
// no slots (G = 0: no nodes exist, so the caller never reads the row) map to chain 0, slot 0.
SK_HD int64_t node_chain(int64_t node, int64_t G) { return (node < 0 || G <= 0) ? 0 : node / G; }
SK_HD int64_t node_slot(int64_t node, int64_t G, int target) { return (node < 0 || G <= 0) ? 0 : node % G + target; }

// Statistics record of a node's target row (node -1 = root) or of its draft row.
SK_HD int64_t tree_record(const ChainParams& P, int64_t b, int64_t node, int target) {
  const int64_t chain = node_chain(node, P.G);
  const int64_t slot = node_slot(node, P.G, target);
  return (b * P.K + chain) * (P.G + 1) + slot;
}

template <class T>
SK_HD const T* tree_row(const void* base, int64_t b, int64_t node, int64_t sb, int64_t sk_, int64_t sg, int64_t G,
                        int target) {
  const int64_t chain = node_chain(node, G);
  const int64_t slot = node_slot(node, G, target);
  return static_cast<const T*>(base) + b * sb + chain * sk_ + slot * sg;
}

// Unnormalised RRS residual after `steps` rejections: r_0 = p, r_{l+1} = max(r_l / Z_l - q_l, 0)
// with q_l = q (with replacement) or q without the tokens rejected before l, over D_l.
SK_HD float rrs_residual(float p, float q, int steps, const float* zs, const int32_t* xs, const float* ds, int64_t x,
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

// Walk state indexed by node or by rejection step. Dynamic indices would put per-thread arrays in
// local memory (a 3 KB stack per GPU thread), so it lives once per request: in shared memory on
// the GPU (one block per request), on the stack of the request's one thread on the CPU. Writes
// come from one thread (or one thread per node) and are followed by red.sync().
struct TreeWalkScratch {
  int32_t tok[MAX_TREE_NODES];    // draft id of each node; -1: placeholder (never a candidate)
  int8_t par[MAX_TREE_NODES];     // parent node; -1: the root; -2: padding (nobody's child)
  float zs[MAX_TREE_NODES + 1];   // RRS: residual mass after l rejections (zs[0] = 1)
  float ds[MAX_TREE_NODES + 1];   // RRS without replacement: draft mass left after l rejections
  int32_t xs[MAX_TREE_NODES + 1]; // RRS without replacement: token rejected at step l (-1: none)
};

SK_HD int popcount64(uint64_t v) {
#if defined(__CUDA_ARCH__)
  return __popcll(v);
#else
  return __builtin_popcountll(v);
#endif
}

SK_HD int lowest_bit(uint64_t v) {  // v != 0
#if defined(__CUDA_ARCH__)
  return __ffsll(static_cast<long long>(v)) - 1;
#else
  return __builtin_ctzll(v);
#endif
}

// What one tree position's vocabulary passes read: the target row of the node the walk stands on
// and the draft row of its first candidate, with their statistics.
template <class TT, class TD>
struct Position {
  const TT* t_row;
  const TD* d_row;
  float m_t, z_t, thr_t, m_q, z_q, thr_q, inv_t;
  int32_t cut_t = 0, cut_q = 0;  // top_p_ties="by_index" index cuts (kept_at)
  const int32_t* t_mask = nullptr;  // token_bitmask words of both rows (null: none)
  const int32_t* d_mask = nullptr;
};

// q at vocab entry x, given its raw draft value (logits: processed; probs: loaded; n-gram: 0).
template <class TT, class TD>
SK_HD float position_q(const ChainParams& P, const Position<TT, TD>& pos, float raw_d, int64_t x) {
  int unused = 0;
  if (P.draft_mode == DRAFT_LOGITS)
    return prob_of(sanitize_logit(raw_d, unused), pos.m_q, pos.z_q, pos.thr_q, pos.inv_t, x, pos.cut_q);
  if (P.draft_mode == DRAFT_PROBS) return load_prob(pos.d_row, x, unused);
  return 0.0f;
}

// Vocabulary loop of one position: f(x, target logit (sanitised), p, q) for x in [0, V), q only
// where `with_q`; target and draft logits in vector loads.
template <class R, class TT, class TD, class F>
SK_HD void for_each_entry(const ChainParams& P, R& red, const Position<TT, TD>& pos, bool with_q, F&& f) {
  int unused = 0;
  const bool draft_logits = with_q && P.draft_mode == DRAFT_LOGITS;
  SK_FOR_QUADS(red, 0, P.V, q4) {
    float tv[4], dv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    load_quad(pos.t_row, q4 * 4, P.V, tv);
    mask_run(pos.t_mask, int64_t(q4) * 4, tv);
    if (draft_logits) {
      load_quad(pos.d_row, q4 * 4, P.V, dv);
      mask_run(pos.d_mask, int64_t(q4) * 4, dv);
    }
    SK_UNROLL  // constant indices into tv / dv / the Philox words: registers, not a stack
    for (int e = 0; e < 4; ++e) {
      const int64_t x = int64_t(q4) * 4 + e;
      if (x >= P.V) continue;
      const float xt = sanitize_logit(tv[e], unused);
      const float p = prob_of(xt, pos.m_t, pos.z_t, pos.thr_t, pos.inv_t, x, pos.cut_t);
      const float q = with_q ? position_q(P, pos, dv[e], x) : 0.0f;
      f(q4, e, x, xt, p, q);
    }
  }
}

// p, q and the acceptance uniform of candidate node n (rank: its place among the candidates).
struct CandidateDraw {
  float p, q, u;
};

template <class TT, class TD>
SK_HD CandidateDraw candidate_draw(const ChainParams& P, const Request& rq, const Position<TT, TD>& pos,
                                   int64_t token, int rank, uint32_t counter) {
  int unused = 0;  // (the statistics pass flagged unusable entries already)
  CandidateDraw c;
  const float xt = mask_logit(load_logit(pos.t_row, token, unused), pos.t_mask, token);
  c.p = prob_of(xt, pos.m_t, pos.z_t, pos.thr_t, rq.inv_t, token, pos.cut_t);
  if (P.draft_mode == DRAFT_LOGITS) {
    const float xd = mask_logit(load_logit(pos.d_row, token, unused), pos.d_mask, token);
    c.q = prob_of(xd, pos.m_q, pos.z_q, pos.thr_q, rq.inv_t, token, pos.cut_q);
  } else if (P.draft_mode == DRAFT_PROBS) {
    c.q = load_prob(pos.d_row, token, unused);
  } else {
    c.q = 1.0f;
  }
  c.u = uniform_open(rq.seed, uint32_t(rank), counter, PURPOSE_ACCEPT);
  return c;
}

// f = 1 - (1 - beta)^k - rho beta with beta = g / rho (g = sum_x min(rho q, p)): decreasing, root rho*.
SK_HD float kseq_f(float rho, float g, float kf) {
  const float om = 1.0f - g / rho;
  return 1.0f - expf(kf * logf(om > 0.0f ? om : 0.0f)) - g;
}

// P(some draft accepted) = 1 - (1 - beta)^k at rho.
SK_HD float kseq_acceptance(float rho, float g, float kf) {
  const float om = 1.0f - g / rho;
  return 1.0f - expf(kf * logf(om > 0.0f ? om : 0.0f));
}

// Root of f on [a, b] with g replaced by its chord (lower bound) or the neighbours' extended chords.
SK_HD float rho_bisect(float a, float b, float ga, float gb, float s_left, float s_right, float chord, float kf,
                       bool upper) {
  float x_lo = a, x_hi = b;
  for (int i = 0; i < RHO_BISECT; ++i) {
    const float mid = 0.5f * (x_lo + x_hi);
    const float g = upper ? fminf(ga + s_left * (mid - a), gb - s_right * (b - mid)) : ga + chord * (mid - a);
    if (kseq_f(mid, g, kf) > 0.0f) {
      x_lo = mid;
    } else {
      x_hi = mid;
    }
  }
  return x_hi;
}

// K-SEQ: rho >= rho* and beta(rho) = g(rho) / rho, the reference's rho_search: RHO_POINTS points per
// vocabulary pass; after a pass, the bracket [lo, hi] around rho*; stop once A(lo) - A(hi) <= RHO_TOL,
// else the next points spread over the roots of f with g bounded by concavity (chord below, the
// neighbours' extended chords above). Arrays indexed only by unrolled constants: registers.
template <class R, class TT, class TD>
SK_HD void kseq_rho(const ChainParams& P, R& red, const Position<TT, TD>& pos, int k, float& rho, float& beta_hi) {
  const float kf = float(k);
  float pts[RHO_POINTS], gs[RHO_POINTS];
SK_UNROLL
  for (int i = 0; i < RHO_POINTS; ++i) pts[i] = 1.0f + (kf - 1.0f) * (float(i) / float(RHO_POINTS - 1));
  float lo = 1.0f, glo = 0.0f, hi = kf, ghi = 0.0f;
  for (int round = 0; round < RHO_ROUNDS; ++round) {
    typename R::Wide acc[RHO_POINTS];  // the reducer's accumulator type: double for one CPU thread
SK_UNROLL
    for (int i = 0; i < RHO_POINTS; ++i) acc[i] = 0.0f;
    for_each_entry(P, red, pos, true, [&](int32_t, int, int64_t, float, float pv, float qv) {
SK_UNROLL
      for (int i = 0; i < RHO_POINTS; ++i) {
        const float a = pts[i] * qv;
        acc[i] += a < pv ? a : pv;
      }
    });
SK_UNROLL
    for (int i = RHO_POINTS - 1; i >= 0; --i) gs[i] = red.sum(float(acc[i]));
    if (round == 0) {
      lo = pts[0];
      glo = gs[0];
    }
    // hi: the first point m where f <= 0 (else the last), lo: the point before it (else the old lo),
    // and their neighbours. One scan with constant indices: selecting pts[m - 1] etc. by comparing
    // i with m let the compiler index the arrays in local memory.
    int m = RHO_POINTS - 1;
    float a = lo, ga = glo, b = 0.0f, gb = 0.0f, an = 0.0f, gan = 0.0f, bn = 0.0f, gbn = 0.0f;
    bool found = false;
SK_UNROLL
    for (int i = 0; i < RHO_POINTS; ++i) {
      const bool here = !found && (kseq_f(pts[i], gs[i], kf) <= 0.0f || i == RHO_POINTS - 1);
      if (here) {
        m = i;
        b = pts[i], gb = gs[i];
        if (i >= 1) a = pts[i >= 1 ? i - 1 : 0], ga = gs[i >= 1 ? i - 1 : 0];
        if (i >= 2) an = pts[i >= 2 ? i - 2 : 0], gan = gs[i >= 2 ? i - 2 : 0];
        if (i + 1 < RHO_POINTS) bn = pts[i + 1 < RHO_POINTS ? i + 1 : i], gbn = gs[i + 1 < RHO_POINTS ? i + 1 : i];
      }
      found = found || here;
    }
    lo = a, glo = ga, hi = b, ghi = gb;
    if (kseq_acceptance(a, ga, kf) - kseq_acceptance(b, gb, kf) <= RHO_TOL || round == RHO_ROUNDS - 1) break;
    if (!(m >= 2 && an < a)) an = 0.0f, gan = 0.0f;  // no left neighbour: the chord from the origin
    const float s_left = (ga - gan) / (a - an);
    const bool right = m + 1 < RHO_POINTS && bn > b;
    const float s_right = right ? (gbn - gb) / (bn - b) : 0.0f;
    const float w = b - a;
    const float chord = (gb - ga) / (w > 0.0f ? w : 1.0f);
    const float r_lower = rho_bisect(a, b, ga, gb, s_left, s_right, chord, kf, false);
    const float r_upper = rho_bisect(a, b, ga, gb, s_left, s_right, chord, kf, true);
    float x0 = fminf(r_lower, r_upper), x1 = fmaxf(r_lower, r_upper);
    const float f_drop = fminf(fmaxf(kseq_f(a, ga, kf) - kseq_f(b, gb, kf), RHO_EPS), 1.0f);
    const float margin = RHO_MARGIN * (x1 - x0) + w * (RHO_EPS / f_drop);
    x0 = fmaxf(a, x0 - margin);
    x1 = fminf(b, x1 + margin);
SK_UNROLL
    for (int i = 0; i < RHO_POINTS; ++i) {
      pts[i] = i == RHO_POINTS - 1 ? b : x0 + (x1 - x0) * (float(i) / float(RHO_POINTS - 2));
    }
  }
  rho = hi;
  beta_hi = ghi / hi;
}

template <class R, class TT, class TD>
SK_HD void tree_walk_program(const ChainParams& P, int64_t b, R& red, TreeWalkScratch& s) {
  const Request rq = load_request(P, b);
  const bool greedy = rq.greedy, stochastic = !rq.greedy;
  const int64_t N = P.K * P.G, V = P.V;
  const bool wor = P.method == 2;

  // ---- the tree (one thread per node)
  for (int64_t n = red.rank(); n < N; n += red.size()) {
    const bool node_ok = n < rq.n;
    const int64_t t = node_ok ? P.draft_tokens[b * P.stride_xb + (n / P.G) * P.stride_xk + n % P.G] : -1;
    s.tok[n] = (t >= 0 && t < V) ? int32_t(t) : -1;  // placeholder ids (outside [0, V)): no error
    const int64_t p = P.parents ? (node_ok ? P.parents[b * P.stride_pb + n] : -1) : (n % P.G == 0 ? -1 : n - 1);
    s.par[n] = int8_t(node_ok ? p : -2);
  }
  red.sync();

  // ---- walk state
  bool at_root = true, done = false, flagged = false;
  uint64_t in_set = 0;  // the nodes spelling the accepted prefix
  int64_t rep = -1, last = -1, depth = 0;
  int64_t* out_tok = P.out_tokens + b * P.stride_ob;
  if (red.rank() == 0)
    for (int64_t d = 0; d <= P.D; ++d) out_tok[d] = -1;

  for (int64_t d = 0; d <= P.D && !done; ++d) {
    // candidates: children of the current node set, in node order (rank = place among them)
    uint64_t cand = 0;
    for (int64_t n = 0; n < N; ++n) {
      const int par = s.par[n];
      const bool in_pos = par >= 0 ? ((in_set >> par) & 1) != 0 : (par == -1 && at_root);
      if (in_pos && s.tok[n] >= 0) cand |= uint64_t(1) << n;
    }
    const int k = popcount64(cand);
    const bool has_cand = k > 0;
    const int64_t first = has_cand ? lowest_bit(cand) : 0;
    const uint32_t counter = uint32_t(rep + 1);  // Philox row of this position

    const int64_t rec_t = tree_record(P, b, rep, 1);
    const float* st = P.stats + rec_t * NUM_STATS;
    const int64_t g_idx = P.g_idx[rec_t];
    Position<TT, TD> pos;
    pos.m_t = st[0];
    pos.z_t = st[1];
    pos.thr_t = (P.has_filter && stochastic) ? P.thr[rec_t * 2] : neg_inf();
    pos.cut_t = (P.cut && P.has_filter && stochastic) ? P.cut[rec_t * 2] : 0;
    pos.inv_t = rq.inv_t;
    // a row without a finite logit (all -inf, or a mask allowing nothing) flags the request in
    // every mode, as the chain does: its greedy argmax is the documented token 0
    flagged |= st[5] > 0.0f || (stochastic ? pos.z_t == 0.0f : !(st[4] > neg_inf()));
    pos.t_row = tree_row<TT>(P.target, b, rep, P.stride_tb, P.stride_tk, P.stride_tg, P.G, 1);
    pos.t_mask = target_mask(P, b, node_chain(rep, P.G), node_slot(rep, P.G, 1));
    // draft distribution of the position: the first candidate's draft row
    const int64_t rec_q = tree_record(P, b, first, 0);
    pos.d_row = tree_row<TD>(P.draft, b, first, P.stride_db, P.stride_dk, P.stride_dg, P.G, 0);
    const bool use_q = stochastic && has_cand;
    pos.d_mask = has_cand ? draft_mask(P, b, node_chain(first, P.G), node_slot(first, P.G, 0)) : nullptr;
    pos.m_q = use_q ? P.stats[rec_q * NUM_STATS + 2] : 0.0f;
    pos.z_q = use_q ? P.stats[rec_q * NUM_STATS + 3] : 0.0f;
    pos.thr_q = (P.draft_mode == DRAFT_LOGITS && P.has_filter && use_q) ? P.thr[rec_q * 2 + 1] : neg_inf();
    pos.cut_q = (P.cut && P.draft_mode == DRAFT_LOGITS && P.has_filter && use_q) ? P.cut[rec_q * 2 + 1] : 0;
    // unusable draft logits / probabilities in the row of this position flag the request
    flagged |= P.draft_mode != DRAFT_NONE && use_q && P.stats[rec_q * NUM_STATS + 6] > 0.0f;

    // ---- decide: the accepted candidates (a mask; the walk takes the lowest)
    red.sync();  // the previous position's readers of zs / ds / xs are done
    for (int64_t l = red.rank(); l <= MAX_TREE_NODES; l += red.size()) {
      s.zs[l] = s.ds[l] = l == 0 ? 1.0f : 0.0f;
      s.xs[l] = -1;
    }
    red.sync();
    float rho = 1.0f, scale = 1.0f;
    int steps = 0;
    uint64_t accept = 0;
    if (!stochastic) {
      // greedy: the candidate spelling the target's argmax (below); no draws
    } else if (P.draft_mode == DRAFT_NONE) {
      // one-hot drafts: p_j = p without the earlier (distinct) rejected tokens, renormalised
      float removed_before = 0.0f;
      int j = 0;
      for (uint64_t rest = cand; rest; rest &= rest - 1, ++j) {
        const int n = lowest_bit(rest);
        bool repeated = false;
        for (uint64_t before = cand & ((uint64_t(1) << n) - 1); before; before &= before - 1)
          repeated |= s.tok[lowest_bit(before)] == s.tok[n];
        const CandidateDraw c = candidate_draw(P, rq, pos, s.tok[n], j, counter);
        const float left = 1.0f - removed_before;
        const float p_j = (repeated || left <= 0.0f) ? 0.0f : c.p / (left > 0.0f ? left : 1.0f);
        if (p_j > 0.0f && c.u <= p_j) accept |= uint64_t(1) << n;
        removed_before += repeated ? 0.0f : c.p;
      }
    } else if (P.method == 0) {
      // K-SEQ: accept x_j when u_j * rho * q(x_j) <= p(x_j)
      float beta_hi = 0.0f;
      if (k > 1) {
        kseq_rho(P, red, pos, k, rho, beta_hi);
        const float om = 1.0f - beta_hi;
        const float pow_k = expf(float(k) * logf(om > 0.0f ? om : 0.0f));
        scale = beta_hi > 0.0f ? (1.0f - pow_k) / beta_hi : float(k);
      }
      int j = 0;
      for (uint64_t rest = cand; rest; rest &= rest - 1, ++j) {
        const int n = lowest_bit(rest);
        const CandidateDraw c = candidate_draw(P, rq, pos, s.tok[n], j, counter);
        if (c.p > 0.0f && c.u * rho * c.q <= c.p) accept |= uint64_t(1) << n;
      }
    } else {
      // RRS: test candidates in rank order; each rejection renormalises the residual (one pass)
      int j = 0;
      float d_now = 1.0f;
      for (uint64_t rest = cand; rest && accept == 0; rest &= rest - 1, ++j) {
        const int n = lowest_bit(rest);
        const int32_t x_j = s.tok[n];
        float z_now = 1.0f;
        if (j > 0) {  // Z_j: one pass over the vocabulary
          typename R::Wide z_j = 0.0f;  // double for one CPU thread (SeqReducer::Wide)
          for_each_entry(P, red, pos, true, [&](int32_t, int, int64_t x, float, float pv, float qv) {
            z_j += rrs_residual(pv, qv, steps, s.zs, s.xs, s.ds, x, wor);
          });
          z_now = red.sum(float(z_j));
          if (red.rank() == 0) s.zs[j] = z_now;
        }
        const CandidateDraw c = candidate_draw(P, rq, pos, x_j, j, counter);
        const float r_x = rrs_residual(c.p, c.q, steps, s.zs, s.xs, s.ds, x_j, wor);
        const float p_j = z_now > 0.0f ? r_x / z_now : 0.0f;
        bool repeated = false;
        float q_j = c.q;
        if (wor) {
          for (int l = 0; l < steps; ++l) repeated |= s.xs[l] == x_j;
          q_j = (repeated || d_now <= 0.0f) ? 0.0f : c.q / (d_now > 0.0f ? d_now : 1.0f);
        }
        const bool ok = !repeated && p_j > 0.0f && c.u * q_j <= p_j;
        if (ok) {
          accept |= uint64_t(1) << n;
        } else {
          if (wor) {  // a repeated token leaves the draft mass as it was
            d_now -= repeated ? 0.0f : c.q;
            if (red.rank() == 0) {
              if (!repeated) s.xs[steps] = x_j;
              s.ds[steps + 1] = d_now;
            }
          }
          ++steps;
        }
        red.sync();  // zs[j], xs, ds visible to every thread before the next pass reads them
      }
    }
    int64_t chosen = -1;
    if (greedy) {
      for (uint64_t rest = cand; rest && chosen < 0; rest &= rest - 1)
        if (s.tok[lowest_bit(rest)] == g_idx) chosen = lowest_bit(rest);
    } else if (accept) {
      chosen = lowest_bit(accept);
    }
    const bool accepted = chosen >= 0;

    // ---- recovered / bonus token: exponential race over the residual of this position
    int64_t final_tok = g_idx;
    if (!accepted && !greedy) {
      const uint32_t purpose = has_cand ? PURPOSE_RECOVER : PURPOSE_BONUS;
      const float log_z = logf(pos.z_t > 0.0f ? pos.z_t : 1.0f);
      const float m_ref = safe_max(pos.m_t);
      Argmax best, pk;
      Philox4 words;
      int32_t words_quad = -1;
      for_each_entry(P, red, pos, has_cand, [&](int32_t q4, int e, int64_t x, float xt, float pv, float qv) {
        if (q4 != words_quad) {  // one Philox call per quad
          words = philox(rq.seed, uint32_t(q4), counter, purpose, 0);
          words_quad = q4;
        }
        float w;
        if (!has_cand) {
          w = pv;
        } else if (P.draft_mode == DRAFT_NONE) {
          bool gone = false;
          for (uint64_t rest = cand; rest; rest &= rest - 1) gone |= s.tok[lowest_bit(rest)] == x;
          w = gone ? 0.0f : pv;
        } else if (P.method == 0) {
          const float a = pv / rho;
          const float v = pv - scale * (qv < a ? qv : a);
          w = v > 0.0f ? v : 0.0f;
        } else {
          w = rrs_residual(pv, qv, steps, s.zs, s.xs, s.ds, x, wor);
        }
        const float noise = race_noise_from_uniform(uniform_from_bits(words.w[e]));
        if (w > 0.0f) best.add(logf(w > 1e-38f ? w : 1e-38f) + noise, x);
        if (pv > 0.0f) pk.add((xt - m_ref) * rq.inv_t - log_z + noise, x);
      });
      best.reduce(red);
      pk.reduce(red);
      final_tok = best.key > neg_inf() ? best.idx : pk.index_or_zero();
    }
    final_tok = final_tok < 0 ? 0 : (final_tok > V - 1 ? V - 1 : final_tok);

    // ---- advance
    const int64_t chosen_tok = accepted ? s.tok[chosen] : 0;
    if (red.rank() == 0) out_tok[d] = accepted ? chosen_tok : final_tok;
    if (red.rank() == 0 && P.walk_rows != nullptr) P.walk_rows[b * (P.D + 1) + d] = rec_t;  // its logprob's row
    if (accepted) {
      uint64_t new_set = 0;
      for (uint64_t rest = cand; rest; rest &= rest - 1)
        if (s.tok[lowest_bit(rest)] == chosen_tok) new_set |= uint64_t(1) << lowest_bit(rest);
      in_set = new_set;
      rep = lowest_bit(new_set);
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
    for (int64_t at = depth - 1; at >= 0 && node >= 0; --at) {
      if (at < P.D) out_nodes[at] = node;
      node = s.par[node];
    }
    P.out_accepted[b] = int32_t(depth);
    P.out_nonfinite[b] = flagged;
  }
}

}  // namespace sk
