// What a block reads before and during its steps: sequence lengths, each (unit, sequence)
// pair's step and input projection, its nonzeros into shared memory, and its initial state.
// This file, rows.cuh and cell_update.cuh are shared by persistent_fwd and cluster_fwd
// (cluster_kernel.cuh).
#pragma once

#include "cuda/waits.cuh"

namespace sprnn {
namespace cuda {

// Length of sequence b clamped to [0, T]; 0 for padding columns (b >= B).
__device__ __forceinline__ int seq_len(const Params& p, int b) {
  if (b >= p.B) return 0;
  const int len = __ldg(p.lengths + b);
  return len < 0 ? 0 : (len > p.T ? p.T : len);
}

// The longest clamped length of sequences [b_lo, b_hi): the steps a block runs.
__device__ __forceinline__ int max_seq_len(const Params& p, int b_lo, int b_hi) {
  int lmax = 0;
  for (int b = b_lo; b < b_hi; ++b) {
    const int len = seq_len(p, b);
    lmax = len > lmax ? len : lmax;
  }
  return lmax;
}

// The block's per-step constants into shared memory: len_s[i] = seq_len(b_lo + i) for i < n,
// rows_s[i] = row_ptr[r0 + i] - base for i <= nrows.
__device__ __forceinline__ void load_step_constants(const Params& p, int b_lo, int n, int* len_s,
                                                    long long r0, int nrows, long long base,
                                                    int* rows_s) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) len_s[i] = seq_len(p, b_lo + i);
  for (int i = threadIdx.x; i <= nrows; i += blockDim.x)
    rows_s[i] = static_cast<int>(__ldg(p.row_ptr + r0 + i) - base);
}

// Where pair (unit u, sequence b of length len) stands at step s: whether the step is in the
// sequence, and the ys/cs offset it writes (time step_time(s) then; padding positions s >= len
// get zeros at time s). Threads compute it for their first pair before the rows, off the
// update's critical path (the update is a short dependent chain in one or two warps that every
// block waits for).
struct PairStep {
  bool valid;
  long long o;
};
__device__ __forceinline__ PairStep pair_step(const Params& p, int s, int len, int b, int u) {
  const bool valid = s < len;
  const int t = valid ? step_time(s, len, p.reverse != 0) : s;
  return {valid, (static_cast<long long>(t) * p.B + b) * p.H + u};
}

// The G input projections of a valid pair step (unit u; xp row t * B + b holds G * H values),
// in the storage type: callers that prefetch convert at the use, so that the loads stay in
// flight until then (a conversion right after the load waits for it).
template <DType D, int G>
__device__ __forceinline__ void load_x_pair(const Params& p, const PairStep& ps, int u,
                                            typename Tr<D>::S* x) {
  using S = typename Tr<D>::S;
  const S* xq = static_cast<const S*>(p.xp) + (ps.o - u) * G + u;
#pragma unroll
  for (int g = 0; g < G; ++g) x[g] = xq[static_cast<long long>(g) * p.H];
}

// One stored nonzero as the prologue reads it from global memory.
template <DType D>
struct Nonzero {
  typename Tr<D>::S value;
  int32_t col;
};

// The prologue's copies: store(k, nonzero kb0 + k) for k = first, first + stride, ... below
// end, with kNonzeroBatch nonzeros' loads in flight per thread. One at a time, each store
// waited for its own loads (a whole memory latency per nonzero: ~25 us of a call at ReLU
// H=5760's 25K nonzeros per block; benchmarks/NOTES.md, session 36).
constexpr int kNonzeroBatch = 8;
template <DType D, class Store>
__device__ __forceinline__ void copy_nonzeros(const Params& p, long long kb0, long long first,
                                              long long end, long long stride, Store&& store) {
  const typename Tr<D>::S* vals = static_cast<const typename Tr<D>::S*>(p.values) + kb0;
  const int32_t* cols = p.col_idx + kb0;
  for (long long k0 = first; k0 < end; k0 += stride * kNonzeroBatch) {
    Nonzero<D> nz[kNonzeroBatch];
#pragma unroll
    for (int i = 0; i < kNonzeroBatch; ++i) {
      const long long k = k0 + i * stride;
      if (k < end) nz[i] = {vals[k], __ldg(cols + k)};
    }
#pragma unroll
    for (int i = 0; i < kNonzeroBatch; ++i)
      if (k0 + i * stride < end) store(k0 + i * stride, nz[i]);
  }
}

// Copies nonzeros [kb0, kb0 + n_in) into shared memory as RowWord words (unit_bytes: the bytes
// of one unit's h values in the tile, for the byte offsets of offset and float words).
template <DType D, Words kWords = Words::kColumn>
__device__ __forceinline__ void load_weights(const Params& p, long long kb0, long long n_in,
                                             RowWordT<D, kWords>* w_s, int unit_bytes = 0) {
  copy_nonzeros<D>(p, kb0, threadIdx.x, n_in, blockDim.x, [&](long long k, const Nonzero<D>& nz) {
    w_s[k] = RowWord<D, kWords>::make(Tr<D>::to_f(nz.value), nz.col, unit_bytes);
  });
}

// The float32 state of the block's units for batch columns [b_lo, b_lo + bpad) (zeros for
// padding columns b >= B): hst/cst[ul * bpad + b - b_lo] from h0/c0.
template <Cell kCell, DType D>
__device__ __forceinline__ void init_state(const Params& p, int u0, int nu, int b_lo, int bpad,
                                           float* hst, float* cst) {
  using T = Tr<D>;
  using S = typename T::S;
  for (int i = threadIdx.x; i < nu * bpad; i += blockDim.x) {
    const int ul = i / bpad, b = b_lo + i % bpad;
    const long long g = static_cast<long long>(b) * p.H + u0 + ul;
    hst[i] = b < p.B ? T::to_f(static_cast<const S*>(p.h0)[g]) : 0.0f;
    if constexpr (kCell == Cell::kLstm)
      cst[i] = b < p.B ? T::to_f(static_cast<const S*>(p.c0)[g]) : 0.0f;
  }
}

}  // namespace cuda
}  // namespace sprnn
