// Instantiations of the lstm kernels (persistent, cluster and per-step fallback).
#include "cuda/launch.cuh"

namespace sprnn::cuda {

SPRNN_DEFINE_CELL_ENTRY(lstm, Cell::kLstm)

}  // namespace sprnn::cuda
