// Kernel table and per-step fallback driver, shared by the per-cell translation units
// kernels_{rnn,lstm,gru}.cu (split so that the instantiations compile in parallel).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/cluster_kernel.cuh"
#include "cuda/kernel_core.cuh"

namespace sprnn::cuda {

using KernelFn = void (*)(Params);

// Batch tiles of the wide layout: 1..8 keep one lane per nonzero with the whole tile; 16 to 64
// (and 8 for float32) share a nonzero between BT / (16 / sizeof(value)) lanes ("batch lanes",
// kernel_core.cuh). The naive layout (variant 0) is built for BT = 4 only. The planner
// (handlers.cu, make_plan) must only pick tiles listed here.
template <Cell C, DType D>
KernelFn persistent_kernel(int bt, bool wide) {
  if (!wide) return bt == 4 ? &persistent_fwd<C, D, 4, false> : nullptr;
  switch (bt) {
    case 1: return &persistent_fwd<C, D, 1, true>;
    case 2: return &persistent_fwd<C, D, 2, true>;
    case 4: return &persistent_fwd<C, D, 4, true>;
    case 8: return &persistent_fwd<C, D, 8, true>;
    case 16: return &persistent_fwd<C, D, 16, true>;
    case 32: return &persistent_fwd<C, D, 32, true>;
    case 64: return &persistent_fwd<C, D, 64, true>;
    default: return nullptr;
  }
}

template <Cell C>
KernelFn persistent_kernel(int dtype, int bt, bool wide) {
  switch (dtype) {
    case 0: return persistent_kernel<C, DType::kF32>(bt, wide);
    case 1: return persistent_kernel<C, DType::kBF16>(bt, wide);
    default: return persistent_kernel<C, DType::kF16>(bt, wide);
  }
}

// Batch tiles of the cluster variant (cluster_kernel.cuh: a unit's columns lie in one warp).
template <Cell C, DType D>
KernelFn cluster_kernel(int bt) {
  switch (bt) {
    case 1: return &cluster_fwd<C, D, 1>;
    case 2: return &cluster_fwd<C, D, 2>;
    case 4: return &cluster_fwd<C, D, 4>;
    case 8: return &cluster_fwd<C, D, 8>;
    case 16: return &cluster_fwd<C, D, 16>;
    default: return nullptr;
  }
}

template <Cell C>
KernelFn cluster_kernel(int dtype, int bt) {
  switch (dtype) {
    case 0: return cluster_kernel<C, DType::kF32>(bt);
    case 1: return cluster_kernel<C, DType::kBF16>(bt);
    default: return cluster_kernel<C, DType::kF16>(bt);
  }
}

template <Cell C, DType D>
cudaError_t run_steps(const Params& p, float* hbuf, float* cbuf, cudaStream_t stream) {
  const long long n = static_cast<long long>(p.B) * p.H;
  const int init_blocks = static_cast<int>(std::min<long long>((n + 255) / 256, 65535));
  step_init<C, D><<<init_blocks, 256, 0, stream>>>(p, hbuf, cbuf);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const long long warps = n;
  const long long blocks = (warps * 32 + 255) / 256;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  for (int s = 0; s < p.T; ++s) {
    step_fwd<C, D><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p, s, hbuf, cbuf);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  step_final<C, D><<<init_blocks, 256, 0, stream>>>(p, hbuf + (p.T & 1) * n, cbuf);
  return cudaGetLastError();
}

template <Cell C>
cudaError_t run_steps(int dtype, const Params& p, float* hbuf, float* cbuf, cudaStream_t s) {
  switch (dtype) {
    case 0: return run_steps<C, DType::kF32>(p, hbuf, cbuf, s);
    case 1: return run_steps<C, DType::kBF16>(p, hbuf, cbuf, s);
    default: return run_steps<C, DType::kF16>(p, hbuf, cbuf, s);
  }
}


// Per-cell entry points (one translation unit each).
#define SPRNN_CELL_ENTRY(name)                                                            \
  KernelFn pick_persistent_##name(int dtype, int bt, bool wide);                          \
  KernelFn pick_cluster_##name(int dtype, int bt);                                        \
  cudaError_t run_steps_##name(int dtype, const Params& p, float* hbuf, float* cbuf,       \
                               cudaStream_t s);
SPRNN_CELL_ENTRY(rnn)
SPRNN_CELL_ENTRY(lstm)
SPRNN_CELL_ENTRY(gru)
#undef SPRNN_CELL_ENTRY

}  // namespace sprnn::cuda
