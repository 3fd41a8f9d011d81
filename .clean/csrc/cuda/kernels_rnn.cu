// Instantiations of the rnn kernels (persistent, cluster and per-step fallback).
#include "cuda/launch.cuh"

namespace sprnn::cuda {

SPRNN_DEFINE_CELL_ENTRY(rnn, Cell::kRnnTanh)

}  // namespace sprnn::cuda
