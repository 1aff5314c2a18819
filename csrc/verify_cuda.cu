// Chain verification on the GPU: the programs of verify_core.h, one thread block per program.
//
//   1. row stats   grid (B*(G+1), C)  target/draft row statistics per vocab chunk (thresholds first)
//   1b. block      grid (B)           method="block": tau and w_tau per request (verify_block.h)
//   2. accept      grid (B, C)        accept tests, first rejection, race over this chunk of row j
//                                     (with C == 1 it also writes the outputs)
//   3. finalize    grid (B / 128)     merge the chunk races, write tokens (only when C > 1)
//   4. logprobs    grid (B)           return_logprobs of the emitted tokens (only when asked for)
//
// Trees and verify_multi: row stats, then one walk program per request (and 4 with logprobs).
// token_bitmask: every program reads the mask words itself (ChainParams::mask).
//
// No host synchronisation and no allocation: CUDA-graph capturable. No torch headers here.
#include <cuda_runtime.h>

#include "verify_api.h"

namespace sk {
namespace {

// A thread block as the Reducer of verify_core.h. blockDim.x must be a multiple of 32 (<= 1024).
// Each reduction starts with a barrier so that the scratch of the previous one is free; the
// result is read by every thread in the same (fixed) order, so it is deterministic.
struct BlockReducer {
  using Wide = float;  // each thread adds V / blockDim.x terms, then the block adds in a tree: float suffices
  float* f;              // [32] shared
  int32_t* i;            // [32] shared
  double* d = nullptr;   // [32] shared, for sum(double) (block verification's residual mass)

  __device__ int64_t rank() const { return threadIdx.x; }
  __device__ int64_t size() const { return blockDim.x; }
  __device__ int warps() const { return (blockDim.x + 31) >> 5; }
  __device__ void sync() const { __syncthreads(); }

  // Sum over the block: warp shuffles, then each warp's sum through `scratch` added in warp order.
  template <class T>
  __device__ T block_sum(T v, T* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    T t = T(0);
    for (int w = 0; w < warps(); ++w) t += scratch[w];
    return t;
  }

  __device__ float sum(float v) { return block_sum(v, f); }
  __device__ int sum(int v) { return block_sum(v, i); }
  __device__ double sum(double v) { return block_sum(v, d); }

  __device__ float max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) f[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = f[0];
    for (int w = 1; w < warps(); ++w) t = fmaxf(t, f[w]);
    return t;
  }

  __device__ static void better(float& key, int32_t& idx, float k2, int32_t i2) {
    if (k2 > key || (k2 == key && i2 < idx)) {
      key = k2;
      idx = i2;
    }
  }

  __device__ void argmax(float& key, int32_t& idx) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float k2 = __shfl_xor_sync(0xffffffffu, key, o);
      const int32_t i2 = __shfl_xor_sync(0xffffffffu, idx, o);
      better(key, idx, k2, i2);
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) {
      f[threadIdx.x >> 5] = key;
      i[threadIdx.x >> 5] = idx;
    }
    __syncthreads();
    key = f[0];
    idx = i[0];
    for (int w = 1; w < warps(); ++w) better(key, idx, f[w], i[w]);
  }
};

// THRESHOLDS: the program finds its rows' top-k / top-p thresholds first (one chunk per row), in a
// shared-memory scratch that only this instantiation carries (unfiltered launches keep their
// occupancy).
template <class TT, class TD, bool THRESHOLDS>
__global__ void row_stats_kernel(const ChainParams P) {
  __shared__ float f[32];
  __shared__ int32_t i[32];
  BlockReducer red{f, i};
  if constexpr (THRESHOLDS) {
    __shared__ ThresholdScratch scratch;
    row_stats_program<BlockReducer, TT, TD>(P, blockIdx.x, blockIdx.y, red, &scratch);
  } else {
    row_stats_program<BlockReducer, TT, TD>(P, blockIdx.x, blockIdx.y, red);
  }
}

// Row statistics of `rows` rows over P.num_chunks chunks.
template <class TT, class TD>
void launch_row_stats(const ChainParams& P, int64_t rows, int threads, cudaStream_t stream) {
  if (rows <= 0 || P.num_chunks <= 0) return;  // an empty grid is a launch error, not a no-op
  const dim3 grid(unsigned(rows), unsigned(P.num_chunks));
  if (P.has_filter && !P.thresholds_given)
    row_stats_kernel<TT, TD, true><<<grid, threads, 0, stream>>>(P);
  else
    row_stats_kernel<TT, TD, false><<<grid, threads, 0, stream>>>(P);
}

template <class TT, class TD>
__global__ void accept_kernel(const ChainParams P) {
  __shared__ float f[32];
  __shared__ int32_t i[32];
  BlockReducer red{f, i};
  accept_program<BlockReducer, TT, TD>(P, blockIdx.x, blockIdx.y, red);
}

template <class TT, class TD>
__global__ void tree_walk_kernel(const ChainParams P) {
  __shared__ float f[32];
  __shared__ int32_t i[32];
  __shared__ TreeWalkScratch scratch;  // per-request walk state: shared, not a per-thread stack
  BlockReducer red{f, i};
  tree_walk_program<BlockReducer, TT, TD>(P, blockIdx.x, red, scratch);
}

// method="block": block verification's tau and w_tau of each sampled request (verify_block.h),
// between the row statistics and the accept programs (which then race row tau).
template <class TT, class TD>
__global__ void block_decide_kernel(const ChainParams P) {
  __shared__ float f[32];
  __shared__ int32_t i[32];
  __shared__ double d[32];
  BlockReducer red{f, i, d};
  const auto residual = [&](const Request& rq, int64_t b, int64_t row_i, const RowStats& s, int64_t tok, double w) {
    return residual_mass_program<BlockReducer, TT, TD>(P, rq, b, row_i, s, tok, w, red);
  };
  block_decide_program<BlockReducer, TT, TD>(P, blockIdx.x, red, residual);
}

// return_logprobs (verify_logprobs.h), one program per request after its tokens are written; a
// greedy row's statistics by the program itself (greedy_normaliser_program). THRESHOLDS: with a
// top-k / top-p filter (greedy rows then need their threshold at temperature 1), the scratch of
// the radix select.
template <class TT, class TD, bool THRESHOLDS>
__global__ void logprobs_kernel(const ChainParams P, bool tree) {
  __shared__ float f[32];
  __shared__ int32_t i[32];
  BlockReducer red{f, i};
  ThresholdScratch* scratch = nullptr;
  if constexpr (THRESHOLDS) {
    __shared__ ThresholdScratch threshold_scratch;
    scratch = &threshold_scratch;
  }
  const auto norm = [&](const Request& rq, const TT* t_row, const int32_t* mask, float m, float& thr, int32_t& cut) {
    return greedy_normaliser_program(P, rq, red, scratch, t_row, mask, m, thr, cut);
  };
  if (tree)
    tree_logprobs_program<BlockReducer, TT>(P, blockIdx.x, red, norm);
  else
    chain_logprobs_program<BlockReducer, TT, TD>(P, blockIdx.x, red, norm);
}

template <class TT, class TD>
void launch_logprobs(const ChainParams& P, bool tree, int threads, cudaStream_t stream) {
  if (P.out_logprobs == nullptr || P.B <= 0) return;
  if (P.has_filter)
    logprobs_kernel<TT, TD, true><<<unsigned(P.B), threads, 0, stream>>>(P, tree);
  else
    logprobs_kernel<TT, TD, false><<<unsigned(P.B), threads, 0, stream>>>(P, tree);
}

__global__ void finalize_kernel(const ChainParams P) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < P.B) finalize_request(P, b);
}

}  // namespace

const char* verify_chain_cuda(const ChainParams& P, int target_dtype, int draft_dtype, int threads, int device,
                              void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  int previous = -1;
  cudaGetDevice(&previous);
  if (device >= 0 && device != previous) cudaSetDevice(device);
  threads = threads < 32 ? 32 : (threads > 1024 ? 1024 : (threads + 31) / 32 * 32);
  dispatch_dtypes(target_dtype, draft_dtype, [&](auto tt, auto td) {
    using TT = decltype(tt);
    using TD = decltype(td);
    launch_row_stats<TT, TD>(P, P.B * (P.G + 1), threads, stream);
    if (P.B > 0 && P.block_w != nullptr) block_decide_kernel<TT, TD><<<unsigned(P.B), threads, 0, stream>>>(P);
    if (P.B > 0 && P.num_chunks > 0)
      accept_kernel<TT, TD><<<dim3(unsigned(P.B), unsigned(P.num_chunks)), threads, 0, stream>>>(P);
    if (P.B > 0 && P.num_chunks > 1) finalize_kernel<<<unsigned((P.B + 127) / 128), 128, 0, stream>>>(P);
    launch_logprobs<TT, TD>(P, false, threads, stream);
  });
  const cudaError_t err = cudaGetLastError();
  if (device >= 0 && device != previous && previous >= 0) cudaSetDevice(previous);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

const char* verify_tree_cuda(const ChainParams& P, int target_dtype, int draft_dtype, int threads, int device,
                             void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  int previous = -1;
  cudaGetDevice(&previous);
  if (device >= 0 && device != previous) cudaSetDevice(device);
  threads = threads < 32 ? 32 : (threads > 1024 ? 1024 : (threads + 31) / 32 * 32);
  dispatch_dtypes(target_dtype, draft_dtype, [&](auto tt, auto td) {
    using TT = decltype(tt);
    using TD = decltype(td);
    launch_row_stats<TT, TD>(P, P.B * P.K * (P.G + 1), threads, stream);  // P.num_chunks == 1
    if (P.B > 0) tree_walk_kernel<TT, TD><<<unsigned(P.B), threads, 0, stream>>>(P);
    launch_logprobs<TT, TD>(P, true, threads, stream);
  });
  const cudaError_t err = cudaGetLastError();
  if (device >= 0 && device != previous && previous >= 0) cudaSetDevice(previous);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace sk
