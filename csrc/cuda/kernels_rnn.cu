// Instantiations of the rnn kernels (persistent and per-step fallback).
#include "cuda/launch.cuh"

namespace sprnn::cuda {

KernelFn pick_persistent_rnn(int dtype, int bt, bool wide) {
  return persistent_kernel<Cell::kRnnTanh>(dtype, bt, wide);
}

KernelFn pick_cluster_rnn(int dtype, int bt) { return cluster_kernel<Cell::kRnnTanh>(dtype, bt); }

cudaError_t run_steps_rnn(int dtype, const Params& p, float* hbuf, float* cbuf,
                             cudaStream_t s) {
  return run_steps<Cell::kRnnTanh>(dtype, p, hbuf, cbuf, s);
}

}  // namespace sprnn::cuda
