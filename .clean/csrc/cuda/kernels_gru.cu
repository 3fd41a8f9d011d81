// Instantiations of the gru kernels (persistent, cluster and per-step fallback).
#include "cuda/launch.cuh"

namespace sprnn::cuda {

SPRNN_DEFINE_CELL_ENTRY(gru, Cell::kGru)

}  // namespace sprnn::cuda
