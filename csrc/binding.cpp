// Torch binding of the chain-verification backend.
//
//   verify_chain(target, draft_tokens, draft, draft_mode, num_draft, temperature_t, temperature,
//                top_k_t, top_k, top_p_t, top_p, seed_t, seed, has_filter, num_chunks, threads, stream,
//                token_bitmask, logprobs, block)
//     -> [tokens [B, G+1] int64, num_accepted [B] int32, nonfinite [B] bool]
//        (+ logprobs [B, G+1] float32 with `logprobs`: return_logprobs from the row statistics)
//     token_bitmask: None, or int32 words [B, G+1, ceil(V / 32)] on the target's device
//     logprobs: 0 none, 1 return_logprobs, 2 (CPU tensors only, a test entry) return_logprobs with the
//       CUDA kernels' statistics of greedy rows (radix-select thresholds) run on the CPU
//     block: method="block" for the sampled requests (block verification, verify_block.h)
//
// Arguments are the checked ones of specdec_kernels._validation (shapes, dtypes and devices are
// not re-checked beyond what memory safety needs). Per-request tensors are cast to the canonical
// dtypes (a no-op when they already have them); `seed` is the scalar already reduced by mix_seed.
// CPU tensors run the OpenMP build of the core (verify_cpu.cpp, backend="cpu"); CUDA tensors the kernels of
// verify_cuda.cu on `stream` (the caller's current cudaStream_t as an integer), when this module
// was built with SPECDEC_WITH_CUDA. No CUDA header is included here, so this file compiles (and is
// tested) identically in the CPU-only build.
#include <torch/extension.h>

#include <memory>

#include "f32_linear.h"
#include "int4_linear.h"
#include "int8_linear.h"
#include "verify_api.h"

namespace {

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return sk::DTYPE_F32;
    case at::kHalf: return sk::DTYPE_F16;
    case at::kBFloat16: return sk::DTYPE_BF16;
    default: TORCH_CHECK(false, "specdec: unsupported logits dtype ", t.scalar_type());
  }
  return 0;
}

// A [B] parameter in its canonical dtype (kept alive in `keep`), or nullptr for "use the scalar".
template <class T>
const T* per_request(const c10::optional<at::Tensor>& t, at::ScalarType dtype, int64_t B, const at::Tensor& like,
                     std::vector<at::Tensor>& keep) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == B, "specdec: per-request parameter must have shape [B]");
  TORCH_CHECK(t->device() == like.device(), "specdec: per-request parameter on another device");
  keep.push_back(t->to(dtype).contiguous());
  return keep.back().data_ptr<T>();
}

// The sampling parameters both ops share: per-request tensors (or nullptr) and their scalar defaults.
void set_sampling(sk::ChainParams& P, int64_t B, const at::Tensor& like, std::vector<at::Tensor>& keep,
                  const c10::optional<at::Tensor>& temperature_t, double temperature,
                  const c10::optional<at::Tensor>& top_k_t, int64_t top_k, const c10::optional<at::Tensor>& top_p_t,
                  double top_p, const c10::optional<at::Tensor>& seed_t, int64_t seed) {
  P.temperature = per_request<float>(temperature_t, at::kFloat, B, like, keep);
  P.temperature_s = float(temperature);
  // top_k at full width: int64 values past INT32_MAX keep the whole row (>= V), not wrap around.
  const c10::optional<at::Tensor> top_k_32 =
      top_k_t.has_value() ? c10::optional<at::Tensor>(top_k_t->clamp_max(INT32_MAX)) : c10::nullopt;
  P.top_k = per_request<int32_t>(top_k_32, at::kInt, B, like, keep);
  P.top_k_s = int32_t(std::min<int64_t>(top_k, INT32_MAX));
  P.top_p = per_request<float>(top_p_t, at::kFloat, B, like, keep);
  P.top_p_s = float(top_p);
  P.seed = per_request<int64_t>(seed_t, at::kLong, B, like, keep);
  P.seed_s = seed;
}

// The row pass's vocabulary split of verify_chain: chunks of a multiple of 8 entries (runs of the
// row pass), at most `num_chunks` of them (num_chunks is set to the count used).
int64_t chunk_size_for(int64_t V, int64_t& num_chunks) {
  const int64_t octs = (V + 7) / 8;
  num_chunks = std::max<int64_t>(1, std::min(num_chunks, octs));
  const int64_t chunk_size = (octs + num_chunks - 1) / num_chunks * 8;
  num_chunks = (V + chunk_size - 1) / chunk_size;
  return chunk_size;
}

// The row pass's sizes and workspaces: rows B * (G + 1) of V entries in num_chunks chunks.
void set_row_pass(sk::ChainParams& P, int64_t B, int64_t G, int64_t V, int64_t num_chunks, int64_t chunk_size,
                  bool has_filter, at::Tensor& stats, at::Tensor& g_idx, at::Tensor& thr) {
  P.B = B;
  P.G = G;
  P.V = V;
  P.num_chunks = num_chunks;
  P.chunk_size = chunk_size;
  P.has_filter = has_filter;
  P.stats = stats.data_ptr<float>();
  P.g_idx = g_idx.data_ptr<int32_t>();
  P.thr = thr.data_ptr<float>();
}

// token_bitmask (None, or int32 words [*rows, ceil(V / 32)] with the target's leading shape `rows`,
// on the target's device) into P: any strides, the word dim made contiguous (a copy of the words only).
void set_mask(sk::ChainParams& P, const c10::optional<at::Tensor>& mask, at::IntArrayRef rows, int64_t V,
              const at::Tensor& like, std::vector<at::Tensor>& keep) {
  if (!mask.has_value()) return;
  TORCH_CHECK(mask->device() == like.device(), "specdec: token_bitmask must be on the target's device");
  TORCH_CHECK(mask->scalar_type() == at::kInt, "specdec: token_bitmask must hold int32 words");
  std::vector<int64_t> want(rows.begin(), rows.end());
  want.push_back((V + 31) / 32);
  TORCH_CHECK(mask->sizes() == at::IntArrayRef(want), "specdec: token_bitmask must have the target's rows and ceil(V / 32) words");
  keep.push_back(mask->stride(-1) == 1 ? *mask : mask->contiguous());
  const at::Tensor& m = keep.back();
  P.mask = m.data_ptr<int32_t>();
  P.stride_mb = m.stride(0);
  P.stride_mk = rows.size() == 3 ? m.stride(1) : 0;
  P.stride_mg = m.stride(int64_t(rows.size()) - 1);
}

// verify_chain's / verify_tree's `logprobs` argument (a Python bool is 0 or 1).
constexpr int64_t LOGPROBS_GPU_PROGRAMS = 2;

// Whether logprobs are asked for (a RuntimeError for an unknown mode, or mode 2 on a GPU).
bool check_logprobs_mode(int64_t mode, const at::Device& dev) {
  TORCH_CHECK(mode >= 0 && mode <= LOGPROBS_GPU_PROGRAMS, "specdec: logprobs must be 0, 1 or 2");
  TORCH_CHECK(mode != LOGPROBS_GPU_PROGRAMS || dev.is_cpu(), "specdec: logprobs mode 2 is a CPU test entry");
  return mode != 0;
}

std::vector<at::Tensor> verify_chain(at::Tensor target, at::Tensor draft_tokens, c10::optional<at::Tensor> draft,
                                     int64_t draft_mode, c10::optional<at::Tensor> num_draft,
                                     c10::optional<at::Tensor> temperature_t, double temperature,
                                     c10::optional<at::Tensor> top_k_t, int64_t top_k,
                                     c10::optional<at::Tensor> top_p_t, double top_p,
                                     c10::optional<at::Tensor> seed_t, int64_t seed, bool has_filter, bool by_index,
                                     int64_t num_chunks, int64_t threads, int64_t stream,
                                     c10::optional<at::Tensor> token_bitmask, int64_t logprobs_mode, bool block) {
  TORCH_CHECK(target.dim() == 3 && target.stride(2) == 1, "specdec: target_logits must be [B, G+1, V], last dim contiguous");
  const int64_t B = target.size(0), G = target.size(1) - 1, V = target.size(2);
  // Zero sizes: B = 0 returns empty outputs below; G = 0 is a bonus token per request. An empty
  // vocabulary has nothing to sample (and would make the chunk size below 0).
  TORCH_CHECK(G >= 0 && V >= 1, "specdec: target_logits must be [B, G+1, V] with G+1 >= 1 rows and V >= 1");
  TORCH_CHECK(draft_tokens.dim() == 2 && draft_tokens.size(0) == B && draft_tokens.size(1) == G,
              "specdec: draft_tokens must be [B, G]");
  TORCH_CHECK(draft_mode >= 0 && draft_mode <= 2, "specdec: draft_mode must be 0, 1 or 2");
  TORCH_CHECK(draft_mode == 0 || (draft.has_value() && draft->dim() == 3 && draft->size(0) == B &&
                                  draft->size(1) == G && draft->size(2) == V && draft->stride(2) == 1),
              "specdec: draft must be [B, G, V], last dim contiguous");
  TORCH_CHECK(V < (int64_t(1) << 31), "specdec: V must be < 2^31");
  const auto dev = target.device();
  auto opts = target.options();
  at::Tensor tokens = at::empty({B, G + 1}, opts.dtype(at::kLong));
  at::Tensor accepted = at::empty({B}, opts.dtype(at::kInt));
  at::Tensor nonfinite = at::empty({B}, opts.dtype(at::kBool));
  const bool logprobs = check_logprobs_mode(logprobs_mode, dev);
  at::Tensor lp = at::empty({logprobs ? B : 0, G + 1}, opts.dtype(at::kFloat));
  if (B == 0) return logprobs ? std::vector<at::Tensor>{tokens, accepted, nonfinite, lp}
                              : std::vector<at::Tensor>{tokens, accepted, nonfinite};

  if (has_filter && !dev.is_cpu()) num_chunks = 1;  // the GPU's radix-select thresholds need whole rows
  const int64_t chunk_size = chunk_size_for(V, num_chunks);
  const int64_t rows = B * (G + 1);

  std::vector<at::Tensor> keep;
  at::Tensor toks = draft_tokens.to(at::kLong);
  if (G == 0) toks = at::zeros({B, 1}, opts.dtype(at::kLong));
  keep.push_back(toks);
  at::Tensor stats = at::empty({rows, num_chunks, sk::NUM_STATS}, opts.dtype(at::kFloat));
  at::Tensor g_idx = at::empty({rows, num_chunks}, opts.dtype(at::kInt));
  at::Tensor thr = at::empty({has_filter ? rows : 1, 2}, opts.dtype(at::kFloat));
  // top_p_ties="by_index": the index cuts of the thresholds (found by the CPU build's selection)
  TORCH_CHECK(!by_index || target.device().is_cpu(), "specdec: top_p_ties='by_index' is implemented by the CPU build only");
  by_index = by_index && has_filter;
  at::Tensor cut = at::empty({by_index ? rows : 1, 2}, opts.dtype(at::kInt));
  at::Tensor first_reject = at::empty({B}, opts.dtype(at::kInt));
  at::Tensor direct = at::empty({B}, opts.dtype(at::kInt));
  at::Tensor flagged = at::empty({B}, opts.dtype(at::kByte));
  at::Tensor race_key = at::empty({B, num_chunks, 2}, opts.dtype(at::kFloat));
  at::Tensor race_idx = at::empty({B, num_chunks, 2}, opts.dtype(at::kInt));
  at::Tensor block_w = at::empty({block ? B : 0}, opts.dtype(at::kFloat));  // w_tau (method="block")
  at::Tensor block_ws = at::empty({block ? B : 0, G + 1}, opts.dtype(at::kDouble));  // its weights w_i

  sk::ChainParams P{};
  P.target = target.data_ptr();
  P.stride_tb = target.stride(0);
  P.stride_tk = 0;
  P.stride_tg = target.stride(1);
  const bool has_draft = draft_mode != 0;
  P.draft = has_draft ? draft->data_ptr() : nullptr;
  P.stride_db = has_draft ? draft->stride(0) : 0;
  P.stride_dk = 0;
  P.stride_dg = has_draft ? draft->stride(1) : 0;
  P.draft_mode = int(draft_mode);
  P.draft_tokens = toks.data_ptr<int64_t>();
  P.stride_xb = toks.stride(0);
  TORCH_CHECK(toks.stride(1) == 1 || G <= 1, "specdec: draft_tokens must have a contiguous last dim");
  P.num_draft = per_request<int64_t>(num_draft, at::kLong, B, target, keep);
  set_sampling(P, B, target, keep, temperature_t, temperature, top_k_t, top_k, top_p_t, top_p, seed_t, seed);
  set_row_pass(P, B, G, V, num_chunks, chunk_size, has_filter, stats, g_idx, thr);
  P.K = 1;
  P.n_max = G;
  P.placeholders_end = true;
  P.cut = by_index ? cut.data_ptr<int32_t>() : nullptr;
  P.first_reject = first_reject.data_ptr<int32_t>();
  P.direct = direct.data_ptr<int32_t>();
  P.flagged = flagged.data_ptr<uint8_t>();
  P.race_key = race_key.data_ptr<float>();
  P.race_idx = race_idx.data_ptr<int32_t>();
  P.out_tokens = tokens.data_ptr<int64_t>();
  P.stride_ob = tokens.stride(0);
  P.out_accepted = accepted.data_ptr<int32_t>();
  P.out_nonfinite = nonfinite.data_ptr<bool>();
  P.out_logprobs = logprobs ? lp.data_ptr<float>() : nullptr;
  P.stride_lb = lp.stride(0);
  P.block_w = block ? block_w.data_ptr<float>() : nullptr;
  P.block_ws = block ? block_ws.data_ptr<double>() : nullptr;
  set_mask(P, token_bitmask, target.sizes().slice(0, 2), V, target, keep);

  const int td = dtype_code(target);
  const int dd = has_draft ? dtype_code(*draft) : td;
  if (dev.is_cpu()) {
    sk::verify_chain_cpu(P, td, dd, logprobs_mode == LOGPROBS_GPU_PROGRAMS);
  } else {
#ifdef SPECDEC_WITH_CUDA
    TORCH_CHECK(dev.is_cuda(), "specdec: unsupported device ", dev);
    const char* error = sk::verify_chain_cuda(P, td, dd, int(threads), dev.index(), reinterpret_cast<void*>(stream));
    TORCH_CHECK(error == nullptr, "specdec: CUDA launch failed: ", error);
#else
    TORCH_CHECK(false, "specdec: this build of the extension has no CUDA kernels (device ", dev, ")");
#endif
  }
  if (logprobs) return {tokens, accepted, nonfinite, lp};
  return {tokens, accepted, nonfinite};
}

// verify_tree(target [B, K, G+1, V], tokens [B, K, G], parents [B, N] or None (K chains), draft
//             [B, K, G, V] or None, draft_mode, num_nodes, temperature_t, temperature, top_k_t, top_k,
//             top_p_t, top_p, seed_t, seed, has_filter, method, max_depth, threads, stream, token_bitmask
//             [B, K, G+1, W] or None, logprobs)
//   -> [tokens [B, D+1] int64, num_accepted [B] int32, accepted_nodes [B, D] int64, nonfinite [B] bool]
//      (+ logprobs [B, D+1] float32 with `logprobs` (a mode, as verify_chain's): return_logprobs of the
//      accepted path from the row statistics)
std::vector<at::Tensor> verify_tree(at::Tensor target, at::Tensor tree_tokens, c10::optional<at::Tensor> parents,
                                    c10::optional<at::Tensor> draft, int64_t draft_mode,
                                    c10::optional<at::Tensor> num_nodes, c10::optional<at::Tensor> temperature_t,
                                    double temperature, c10::optional<at::Tensor> top_k_t, int64_t top_k,
                                    c10::optional<at::Tensor> top_p_t, double top_p, c10::optional<at::Tensor> seed_t,
                                    int64_t seed, bool has_filter, bool by_index, int64_t method, int64_t max_depth,
                                    int64_t threads, int64_t stream, c10::optional<at::Tensor> token_bitmask,
                                    int64_t logprobs_mode) {
  TORCH_CHECK(target.dim() == 4 && target.stride(3) == 1, "specdec: target must be [B, K, G+1, V], last dim contiguous");
  const int64_t B = target.size(0), K = target.size(1), G = target.size(2) - 1, V = target.size(3);
  const int64_t N = K * G, D = max_depth;
  // Row [0, 0] scores the root: without it (K = 0) there is no row to draw the bonus token from.
  TORCH_CHECK(K >= 1 && G >= 0 && V >= 1,
              "specdec: target must be [B, K, G+1, V] with K >= 1, G+1 >= 1 and V >= 1 (row [0, 0] is the root)");
  TORCH_CHECK(N <= sk::MAX_TREE_NODES, "specdec: at most 64 tree nodes");
  TORCH_CHECK(tree_tokens.dim() == 3 && tree_tokens.size(0) == B && tree_tokens.size(1) == K && tree_tokens.size(2) == G,
              "specdec: tokens must be [B, K, G]");
  TORCH_CHECK(!parents.has_value() || (parents->dim() == 2 && parents->size(0) == B && parents->size(1) == N),
              "specdec: parents must be [B, N]");
  TORCH_CHECK(draft_mode >= 0 && draft_mode <= 2, "specdec: draft_mode must be 0, 1 or 2");
  TORCH_CHECK(draft_mode == 0 || (draft.has_value() && draft->dim() == 4 && draft->size(0) == B && draft->size(1) == K &&
                                  draft->size(2) == G && draft->size(3) == V && draft->stride(3) == 1),
              "specdec: draft must be [B, K, G, V], last dim contiguous");
  TORCH_CHECK(method >= 0 && method <= 2 && D >= 0, "specdec: bad method or max_depth");
  auto opts = target.options();
  at::Tensor tokens = at::empty({B, D + 1}, opts.dtype(at::kLong));
  at::Tensor accepted = at::empty({B}, opts.dtype(at::kInt));
  at::Tensor nodes = at::empty({B, D}, opts.dtype(at::kLong));
  at::Tensor nonfinite = at::empty({B}, opts.dtype(at::kBool));
  const bool logprobs = check_logprobs_mode(logprobs_mode, target.device());
  at::Tensor lp = at::empty({logprobs ? B : 0, D + 1}, opts.dtype(at::kFloat));
  at::Tensor walk_rows = at::empty({logprobs ? B : 0, D + 1}, opts.dtype(at::kLong));  // tree_logprobs' rows
  if (B == 0) return logprobs ? std::vector<at::Tensor>{tokens, accepted, nodes, nonfinite, lp}
                              : std::vector<at::Tensor>{tokens, accepted, nodes, nonfinite};

  const int64_t rows = B * K * (G + 1);
  std::vector<at::Tensor> keep;
  at::Tensor toks = G > 0 ? tree_tokens.to(at::kLong).contiguous() : at::zeros({B, K, 1}, opts.dtype(at::kLong));
  keep.push_back(toks);
  at::Tensor stats = at::empty({rows, 1, sk::NUM_STATS}, opts.dtype(at::kFloat));
  at::Tensor g_idx = at::empty({rows, 1}, opts.dtype(at::kInt));
  at::Tensor thr = at::empty({has_filter ? rows : 1, 2}, opts.dtype(at::kFloat));
  // top_p_ties="by_index": the index cuts of the thresholds (found by the CPU build's selection)
  TORCH_CHECK(!by_index || target.device().is_cpu(), "specdec: top_p_ties='by_index' is implemented by the CPU build only");
  by_index = by_index && has_filter;
  at::Tensor cut = at::empty({by_index ? rows : 1, 2}, opts.dtype(at::kInt));
  at::Tensor nodes_out = D > 0 ? nodes : at::empty({B, 1}, opts.dtype(at::kLong));

  sk::ChainParams P{};
  P.target = target.data_ptr();
  P.stride_tb = target.stride(0);
  P.stride_tk = target.stride(1);
  P.stride_tg = target.stride(2);
  const bool has_draft = draft_mode != 0;
  P.draft = has_draft ? draft->data_ptr() : nullptr;
  P.stride_db = has_draft ? draft->stride(0) : 0;
  P.stride_dk = has_draft ? draft->stride(1) : 0;
  P.stride_dg = has_draft ? draft->stride(2) : 0;
  P.draft_mode = int(draft_mode);
  P.draft_tokens = toks.data_ptr<int64_t>();
  P.stride_xb = toks.stride(0);
  P.stride_xk = toks.stride(1);
  P.num_draft = per_request<int64_t>(num_nodes, at::kLong, B, target, keep);
  set_sampling(P, B, target, keep, temperature_t, temperature, top_k_t, top_k, top_p_t, top_p, seed_t, seed);
  P.B = B;
  P.G = G;
  P.V = V;
  P.K = K;
  P.n_max = N;
  P.num_chunks = 1;
  P.chunk_size = (V + 3) / 4 * 4;
  P.has_filter = has_filter;
  P.stats = stats.data_ptr<float>();
  P.g_idx = g_idx.data_ptr<int32_t>();
  P.thr = thr.data_ptr<float>();
  P.cut = by_index ? cut.data_ptr<int32_t>() : nullptr;
  P.out_tokens = tokens.data_ptr<int64_t>();
  P.stride_ob = tokens.stride(0);
  P.out_accepted = accepted.data_ptr<int32_t>();
  P.out_nonfinite = nonfinite.data_ptr<bool>();
  if (parents.has_value()) {
    keep.push_back(parents->to(at::kLong).contiguous());
    P.parents = keep.back().data_ptr<int64_t>();
    P.stride_pb = keep.back().stride(0);
  }
  P.D = D;
  P.method = int(method);
  P.out_nodes = nodes_out.data_ptr<int64_t>();
  P.stride_nb = nodes_out.stride(0);
  P.out_logprobs = logprobs ? lp.data_ptr<float>() : nullptr;
  P.stride_lb = logprobs ? lp.stride(0) : 0;
  P.walk_rows = logprobs ? walk_rows.data_ptr<int64_t>() : nullptr;
  set_mask(P, token_bitmask, target.sizes().slice(0, 3), V, target, keep);

  const int td = dtype_code(target);
  const int dd = has_draft ? dtype_code(*draft) : td;
  const auto dev = target.device();
  if (dev.is_cpu()) {
    sk::verify_tree_cpu(P, td, dd, logprobs_mode == LOGPROBS_GPU_PROGRAMS);
  } else {
#ifdef SPECDEC_WITH_CUDA
    TORCH_CHECK(dev.is_cuda(), "specdec: unsupported device ", dev);
    const char* error = sk::verify_tree_cuda(P, td, dd, int(threads), dev.index(), reinterpret_cast<void*>(stream));
    TORCH_CHECK(error == nullptr, "specdec: CUDA launch failed: ", error);
#else
    TORCH_CHECK(false, "specdec: this build of the extension has no CUDA kernels (device ", dev, ")");
#endif
  }
  if (logprobs) return {tokens, accepted, nodes, nonfinite, lp};
  return {tokens, accepted, nodes, nonfinite};
}

// The GPU programs' top-k / top-p threshold (radix select, verify_core.h) run by one host thread on
// a 1-D CPU row: lets the tests check the CUDA kernels' threshold search without a GPU.
double filter_threshold_program(at::Tensor row, double temperature, int64_t top_k, double top_p) {
  TORCH_CHECK(row.device().is_cpu() && row.dim() == 1, "specdec: filter_threshold_program takes a 1-D CPU row");
  row = row.contiguous();
  sk::SeqReducer red;
  auto scratch = std::make_unique<sk::ThresholdScratch>();
  const float inv_t = sk::inverse_temperature(float(temperature));
  const int32_t k = int32_t(std::min<int64_t>(top_k, INT32_MAX));
  float thr = 0.0f;
  sk::dispatch_dtypes(dtype_code(row), sk::DTYPE_F32, [&](auto tt, auto) {
    using TT = decltype(tt);
    thr = sk::filter_threshold(red, *scratch, static_cast<const TT*>(row.data_ptr()), row.size(0), inv_t, k,
                               float(top_p));
  });
  return thr;
}


// K-SEQ's rho search (kseq_rho, verify_tree_core.h) run by one host thread on one tree position:
// target logits [V] (temperature 1, no filter) and draft probabilities [V], k candidates ->
// (rho, beta(rho)). Lets the tests check the core's rho >= rho* without a GPU (as the reference's).
std::vector<double> kseq_rho_program(at::Tensor target_row, at::Tensor draft_probs, int64_t k) {
  TORCH_CHECK(target_row.device().is_cpu() && target_row.dim() == 1 && draft_probs.sizes() == target_row.sizes() &&
                  draft_probs.device().is_cpu() && target_row.size(0) >= 1 && k >= 2,
              "specdec: kseq_rho_program takes 1-D CPU rows of one size V >= 1 and k >= 2");
  const at::Tensor t = target_row.to(at::kFloat).contiguous(), q = draft_probs.to(at::kFloat).contiguous();
  sk::ChainParams P{};
  P.V = t.size(0);
  P.draft_mode = sk::DRAFT_PROBS;
  sk::Position<float, float> pos{};
  pos.t_row = t.data_ptr<float>();
  pos.d_row = q.data_ptr<float>();
  pos.m_t = sk::neg_inf();
  for (int64_t x = 0; x < P.V; ++x) pos.m_t = std::max(pos.m_t, pos.t_row[x]);
  double z = 0.0;  // in double: a float sum of V = 152k terms in sequence is ~1.6e-4 low, which moves p, not rho
  for (int64_t x = 0; x < P.V; ++x) z += std::exp(double(pos.t_row[x]) - double(pos.m_t));
  pos.z_t = float(z);
  pos.thr_t = pos.thr_q = sk::neg_inf();
  pos.inv_t = 1.0f;
  sk::SeqReducer red;
  float rho = 1.0f, beta = 0.0f;
  sk::kseq_rho(P, red, pos, int(k), rho, beta);
  return {rho, beta};
}

// The CPU row pass (program 1, AVX2 or scalar as SPECDEC_CPU_SIMD selects) on target rows [R, V]
// with one temperature / top-k / top-p, its chunk statistics merged as program 2 merges them ->
// [R, 3] float64 (max m, z = sum of exp((x - m) * inv_t) over the kept entries, the threshold thr:
// x is kept iff x >= thr; inv_t = float32(1 / T); z = 0 for greedy).
// Lets the tests measure the CPU sums against a float64 softmax.
at::Tensor row_softmax_program(at::Tensor target, double temperature, int64_t top_k, double top_p,
                               int64_t num_chunks) {
  TORCH_CHECK(target.device().is_cpu() && target.dim() == 2 && target.size(1) >= 1 && num_chunks >= 1,
              "specdec: row_softmax_program takes CPU rows [R, V >= 1] and num_chunks >= 1");
  target = target.contiguous();
  const int64_t R = target.size(0), V = target.size(1);
  int64_t C = num_chunks;
  const int64_t chunk_size = chunk_size_for(V, C);
  const bool has_filter = top_k > 0 || top_p < 1.0;
  auto opts = target.options();
  at::Tensor stats = at::empty({R, C, sk::NUM_STATS}, opts.dtype(at::kFloat));
  at::Tensor g_idx = at::empty({R, C}, opts.dtype(at::kInt));
  at::Tensor thr = at::empty({has_filter ? R : 1, 2}, opts.dtype(at::kFloat));
  at::Tensor toks = at::zeros({R, 1}, opts.dtype(at::kLong));
  sk::ChainParams P{};
  P.target = target.data_ptr();
  P.stride_tb = V;
  P.draft_mode = sk::DRAFT_NONE;
  P.draft_tokens = toks.data_ptr<int64_t>();
  P.stride_xb = 1;
  std::vector<at::Tensor> keep;
  set_sampling(P, R, target, keep, c10::nullopt, temperature, c10::nullopt, top_k, c10::nullopt, top_p,
               c10::nullopt, 0);
  set_row_pass(P, R, 0, V, C, chunk_size, has_filter, stats, g_idx, thr);
  const int td = dtype_code(target);
  sk::row_pass_cpu(P, td, td);
  at::Tensor out = at::empty({R, 3}, opts.dtype(at::kDouble));
  for (int64_t r = 0; r < R; ++r) {
    const sk::RowStats s = sk::combine_row(P, r, sk::load_request(P, r));
    out[r][0] = double(s.t.m);
    out[r][1] = double(s.t.z);
    out[r][2] = double(s.thr_t);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "specdec_kernels csrc backend: exact chain verification (CPU build of the core, CUDA kernels)";
  m.def("verify_chain", &verify_chain, "Chain verification (see csrc/binding.cpp)");
  m.def("verify_tree", &verify_tree, "Tree / multi-draft verification (see csrc/binding.cpp)");
  m.def("cpu_threads", &sk::cpu_threads, "OpenMP threads of the CPU programs");
  m.def("filter_threshold_program", &filter_threshold_program, "The GPU programs' top-k/top-p threshold, on the CPU");
  m.def("kseq_rho_program", &kseq_rho_program, "The core's K-SEQ rho search on one position, on the CPU");
  m.def("row_softmax_program", &row_softmax_program, "The CPU row pass's merged (max, z) of rows [R, V]");
  m.def("f32_linear", &f32_linear, "fp32 linear of CPU models in packed panels (csrc/f32_linear.cpp)");
  m.def("f32_linear_fast_path", &f32_linear_fast_path, "Whether f32_linear runs a SIMD path here (AVX-512 or AVX2)");
  m.def("f32_linear_path", [] { return std::string(f32_linear_path()); }, "The path f32_linear runs here");
  m.def("w4a8_linear", &w4a8_linear, "Int4-weight linear of CPU draft models (csrc/int4_linear.cpp)");
  m.def("w4a8_fast_path", &w4a8_fast_path, "Whether w4a8_linear runs its AVX-512 VNNI path here");
  m.def("w8a8_linear", &w8a8_linear, "Int8-weight linear of CPU draft models (csrc/int8_linear.cpp)");
  m.def("w8a8_fast_path", &w8a8_fast_path, "Whether w8a8_linear runs a SIMD path here (AVX-512 VNNI or AVX2)");
  m.def("w8a8_path", [] { return std::string(w8a8_path()); }, "The path w8a8_linear runs here");
#ifdef SPECDEC_WITH_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
}
