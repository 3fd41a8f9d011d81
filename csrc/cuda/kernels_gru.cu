// Instantiations of the gru kernels (persistent and per-step fallback).
#include "cuda/launch.cuh"

namespace sprnn::cuda {

KernelFn pick_persistent_gru(int dtype, int bt, bool wide) {
  return persistent_kernel<Cell::kGru>(dtype, bt, wide);
}

KernelFn pick_cluster_gru(int dtype, int bt) { return cluster_kernel<Cell::kGru>(dtype, bt); }

cudaError_t run_steps_gru(int dtype, const Params& p, float* hbuf, float* cbuf,
                             cudaStream_t s) {
  return run_steps<Cell::kGru>(dtype, p, hbuf, cbuf, s);
}

}  // namespace sprnn::cuda
