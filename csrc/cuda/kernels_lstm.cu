// Instantiations of the lstm kernels (persistent and per-step fallback).
#include "cuda/launch.cuh"

namespace sprnn::cuda {

KernelFn pick_persistent_lstm(int dtype, int bt, bool wide) {
  return persistent_kernel<Cell::kLstm>(dtype, bt, wide);
}

KernelFn pick_cluster_lstm(int dtype, int bt) { return cluster_kernel<Cell::kLstm>(dtype, bt); }

cudaError_t run_steps_lstm(int dtype, const Params& p, float* hbuf, float* cbuf,
                             cudaStream_t s) {
  return run_steps<Cell::kLstm>(dtype, p, hbuf, cbuf, s);
}

}  // namespace sprnn::cuda
