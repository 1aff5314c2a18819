// Chain verification on the CPU: the programs of verify_core.h run one after another, each by a
// single "thread" (every reduction is the identity). Same code as the CUDA kernels; used to test
// them token for token against the Triton kernels on machines without a GPU.
#include "verify_api.h"

namespace sk {
namespace {

struct SeqReducer {
  int64_t rank() const { return 0; }
  int64_t size() const { return 1; }
  float sum(float v) const { return v; }
  int sum(int v) const { return v; }
  float max(float v) const { return v; }
  void argmax(float&, int32_t&) const {}
};

}  // namespace

void verify_chain_cpu(const ChainParams& P, int target_dtype, int draft_dtype) {
  dispatch_dtypes(target_dtype, draft_dtype, [&](auto tt, auto td) {
    using TT = decltype(tt);
    using TD = decltype(td);
    SeqReducer red;
    const int64_t rows = P.B * (P.G + 1);
    for (int64_t row = 0; row < rows; ++row)
      for (int64_t c = 0; c < P.num_chunks; ++c) row_stats_program<SeqReducer, TT, TD>(P, row, c, red);
    for (int64_t b = 0; b < P.B; ++b)
      for (int64_t c = 0; c < P.num_chunks; ++c) accept_program<SeqReducer, TT, TD>(P, b, c, red);
    if (P.num_chunks > 1)
      for (int64_t b = 0; b < P.B; ++b) finalize_request(P, b);
  });
}

void verify_tree_cpu(const ChainParams& P, int target_dtype, int draft_dtype) {
  dispatch_dtypes(target_dtype, draft_dtype, [&](auto tt, auto td) {
    using TT = decltype(tt);
    using TD = decltype(td);
    SeqReducer red;
    const int64_t rows = P.B * P.K * (P.G + 1);
    for (int64_t row = 0; row < rows; ++row) row_stats_program<SeqReducer, TT, TD>(P, row, 0, red);
    for (int64_t b = 0; b < P.B; ++b) tree_walk_program<SeqReducer, TT, TD>(P, b, red);
  });
}

}  // namespace sk
