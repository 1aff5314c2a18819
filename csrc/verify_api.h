// Host entry points of the chain-verification backend (no torch headers: binding.cpp owns those).
#pragma once

#include "verify_block.h"
#include "verify_core.h"
#include "verify_logprobs.h"
#include "verify_tree_core.h"

namespace sk {

// Calls f(TT{}, TD{}) with the storage types of the target and draft dtypes (DTYPE_*).
template <class F>
void dispatch_dtypes(int target_dtype, int draft_dtype, F&& f) {
  auto with_draft = [&](auto tt) {
    switch (draft_dtype) {
      case DTYPE_F16: f(tt, f16{}); break;
      case DTYPE_BF16: f(tt, bf16{}); break;
      default: f(tt, float{}); break;
    }
  };
  switch (target_dtype) {
    case DTYPE_F16: with_draft(f16{}); break;
    case DTYPE_BF16: with_draft(bf16{}); break;
    default: with_draft(float{}); break;
  }
}

// A program of one host thread (the CPU build, and the binding's test entry points): every
// reduction is the identity.
struct SeqReducer {
  // One thread adds all V terms of a vocabulary sum in sequence: float32 loses ~1.5e-4 of K-SEQ's
  // g = sum_x min(rho q, p) at V = 152k (small terms rounded against a partial sum near 1).
  using Wide = double;
  int64_t rank() const { return 0; }
  int64_t size() const { return 1; }
  float sum(float v) const { return v; }
  double sum(double v) const { return v; }
  int sum(int v) const { return v; }
  float max(float v) const { return v; }
  void argmax(float&, int32_t&) const {}
  void sync() const {}
};

// CPU run of the three programs, spread over OpenMP threads (backend="cpu"). With has_filter the
// thresholds are found by selection first, so any num_chunks works. gpu_logprobs (a test entry):
// return_logprobs scores greedy rows with the CUDA kernels' statistics (greedy_normaliser_program)
// instead of the CPU build's selection.
void verify_chain_cpu(const ChainParams& P, int target_dtype, int draft_dtype, bool gpu_logprobs = false);
int cpu_threads();  // OpenMP threads the CPU programs use (torch.set_num_threads sets them)
// Program 1 alone (thresholds, then the row statistics into P.stats) over P.B * (P.G + 1) rows, as
// verify_chain_cpu runs it: the binding's row_softmax_program test entry.
void row_pass_cpu(const ChainParams& P, int target_dtype, int draft_dtype);

// CUDA launches on `stream` (a cudaStream_t) of device `device`: 3 kernels, or 2 when
// num_chunks == 1. Returns nullptr, or the CUDA error string of a failed launch.
const char* verify_chain_cuda(const ChainParams& P, int target_dtype, int draft_dtype, int threads, int device,
                              void* stream);

// Tree / multi-draft verification (P.K chains of P.G slots, one chunk): row statistics, then the walk.
void verify_tree_cpu(const ChainParams& P, int target_dtype, int draft_dtype, bool gpu_logprobs = false);
const char* verify_tree_cuda(const ChainParams& P, int target_dtype, int draft_dtype, int threads, int device,
                             void* stream);

}  // namespace sk
