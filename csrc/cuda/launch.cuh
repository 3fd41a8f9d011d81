// Kernel table and per-step fallback driver, shared by the per-cell translation units
// kernels_{rnn,lstm,gru}.cu (split so that the instantiations compile in parallel).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "cuda/cluster_kernel.cuh"
#include "cuda/kernel_core.cuh"

namespace sprnn::cuda {

using KernelFn = void (*)(Params);

// Calls f(std::integral_constant<DType, D>{}) for the storage type code (0 float32, 1 bfloat16,
// 2 float16): one switch for every per-dtype kernel table below.
template <class F>
auto by_dtype(int dtype, F&& f) {
  switch (dtype) {
    case 0: return f(std::integral_constant<DType, DType::kF32>{});
    case 1: return f(std::integral_constant<DType, DType::kBF16>{});
    default: return f(std::integral_constant<DType, DType::kF16>{});
  }
}

// The 16-bit tile-4 builds of 4-byte words: column or offset words (storage.cuh RowWord).
template <Cell C, DType D, bool kDeep, int kRegW>
KernelFn four_byte_words(Words words) {
  if (words == Words::kOffset) return &persistent_fwd<C, D, 4, true, kDeep, kRegW, Words::kOffset>;
  return &persistent_fwd<C, D, 4, true, kDeep, kRegW, Words::kColumn>;
}

// Batch tiles of the wide layout: 1..8 keep one lane per nonzero with the whole tile; 16 to 64
// (and 8 for float32) share a nonzero between BT / (16 / sizeof(value)) lanes ("batch lanes",
// rows.cuh RowMap). The naive layout (variant 0) is built for BT = 4 only. The planner
// (handlers.cu, make_plan) must only pick tiles listed here. The deep-gather build (twice the
// h bytes in flight per thread) and the register-weights build (kRegWeights, 16-bit types)
// exist for the wide tile 4 only: `deep` and `reg` elsewhere are ignored (deep wins, but for
// 16-bit ReLU layers, whose deep gather holds no more registers than the others' default one:
// two units per chunk, partition.cuh chunk_units). `words` (RowWord) picks among the builds of
// the 16-bit tile 4: column or offset words for each, float words beside the register weights
// only; the other 16-bit tiles have column words and float32 wide builds float words, whatever
// `words` says (the plan says the same). The tensor-core rows build (mma_rows.cuh, kMmaRows per
// block) exists for 16-bit ReLU layers at tile 4 only (the tanh build spilled 36 bytes with it,
// ptxas sm_90); `mma` elsewhere is ignored.
template <Cell C, DType D>
KernelFn persistent_kernel(int bt, bool wide, bool deep, bool reg, Words words, bool mma) {
  if (!wide) return bt == 4 ? &persistent_fwd<C, D, 4, false> : nullptr;
  constexpr Words kW = D == DType::kF32 ? Words::kFloat : Words::kColumn;
  switch (bt) {
    case 1: return &persistent_fwd<C, D, 1, true, false, 0, kW>;
    case 2: return &persistent_fwd<C, D, 2, true, false, 0, kW>;
    case 4:
      if constexpr (D == DType::kF32) {
        if (deep) return &persistent_fwd<C, D, 4, true, true, 0, kW>;
        return &persistent_fwd<C, D, 4, true, false, 0, kW>;
      } else {
        if constexpr (C == Cell::kRnnRelu) {
          if (mma) return &persistent_fwd<C, D, 4, true, false, 0, Words::kColumn, kMmaRows>;
          if (deep && reg) return four_byte_words<C, D, true, kRegWeights>(words);
        }
        if (deep) return four_byte_words<C, D, true, 0>(words);
        if (reg && words == Words::kFloat)
          return &persistent_fwd<C, D, 4, true, false, kRegWeights, Words::kFloat>;
        if (reg) return four_byte_words<C, D, false, kRegWeights>(words);
        return four_byte_words<C, D, false, 0>(words);
      }
    case 8: return &persistent_fwd<C, D, 8, true, false, 0, kW>;
    case 16: return &persistent_fwd<C, D, 16, true, false, 0, kW>;
    case 32: return &persistent_fwd<C, D, 32, true, false, 0, kW>;
    case 64: return &persistent_fwd<C, D, 64, true, false, 0, kW>;
    default: return nullptr;
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

// Launches of the staged per-step kernels (run_steps).
struct StepCounts {
  int staged = 0;  // step_fwd_staged
  int tasks = 0;   // step_fwd_tasks
};

// One step as one launch of step_launch's choice, counted in *counts.
inline cudaError_t launch_step(const StepLaunch& l, const Params& p, int s, float* hbuf,
                               float* cbuf, cudaStream_t stream, StepCounts* counts) {
  if (l.blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  l.kernel<<<static_cast<unsigned>(l.blocks), l.threads, static_cast<size_t>(l.smem), stream>>>(
      p, s, hbuf, cbuf);
  counts->staged += l.kind == StepKind::kStaged ? 1 : 0;
  counts->tasks += l.kind == StepKind::kTasks ? 1 : 0;
  return cudaGetLastError();
}

template <Cell C, DType D>
cudaError_t run_steps(const Params& p, float* hbuf, float* cbuf, cudaStream_t stream,
                      bool one_step, const StepConfig& cfg, StepCounts* counts) {
  const StepLaunch step =
      one_step ? step_launch<C, D, true>(p, cfg) : step_launch<C, D, false>(p, cfg);
  if (cudaError_t e = prepare_step(step, cfg); e != cudaSuccess) return e;
  if (one_step)  // T = 1: h0 / c0 in, hT / cT out, in one launch (step_kernels.cuh)
    return launch_step(step, p, 0, nullptr, nullptr, stream, counts);
  const long long n = static_cast<long long>(p.B) * p.H;
  const int init_blocks = static_cast<int>(std::min<long long>((n + 255) / 256, 65535));
  step_init<C, D><<<init_blocks, 256, 0, stream>>>(p, hbuf, cbuf);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  for (int s = 0; s < p.T; ++s)
    if (cudaError_t e = launch_step(step, p, s, hbuf, cbuf, stream, counts); e != cudaSuccess)
      return e;
  step_final<C, D><<<init_blocks, 256, 0, stream>>>(p, hbuf + (p.T & 1) * n, cbuf);
  return cudaGetLastError();
}

// Per-cell entry points (one translation unit each: SPRNN_DEFINE_CELL_ENTRY there).
// relu: an rnn layer with ReLU (its wide builds are kRnnRelu's: sign-tagged exchange words,
// storage.cuh XWord); the other cells ignore it.
#define SPRNN_CELL_ENTRY(name)                                                            \
  KernelFn pick_persistent_##name(int dtype, int bt, bool wide, bool deep, bool reg,      \
                                  Words words, bool mma, bool relu);                      \
  KernelFn pick_cluster_##name(int dtype, int bt);                                        \
  cudaError_t run_steps_##name(int dtype, const Params& p, float* hbuf, float* cbuf,       \
                               cudaStream_t s, bool one_step, const StepConfig& cfg,       \
                               StepCounts* counts);
SPRNN_CELL_ENTRY(rnn)
SPRNN_CELL_ENTRY(lstm)
SPRNN_CELL_ENTRY(gru)
#undef SPRNN_CELL_ENTRY

// The definitions, in kernels_<name>.cu: the tables above for cell C, dispatched on dtype.
#define SPRNN_DEFINE_CELL_ENTRY(name, C)                                                 \
  KernelFn pick_persistent_##name(int dtype, int bt, bool wide, bool deep, bool reg,    \
                                  Words words, bool mma, bool relu) {                    \
    return by_dtype(dtype, [&](auto d) {                                                 \
      if constexpr (C == Cell::kRnnTanh) {                                               \
        if (relu && wide)                                                                \
          return persistent_kernel<Cell::kRnnRelu, decltype(d)::value>(bt, wide, deep, reg, words, mma); \
      }                                                                                  \
      return persistent_kernel<C, decltype(d)::value>(bt, wide, deep, reg, words, mma);  \
    });                                                                                  \
  }                                                                                      \
  KernelFn pick_cluster_##name(int dtype, int bt) {                                      \
    return by_dtype(dtype, [&](auto d) { return cluster_kernel<C, decltype(d)::value>(bt); }); \
  }                                                                                      \
  cudaError_t run_steps_##name(int dtype, const Params& p, float* hbuf, float* cbuf,      \
                               cudaStream_t s, bool one_step, const StepConfig& cfg,     \
                               StepCounts* counts) {                                     \
    return by_dtype(dtype, [&](auto d) {                                                 \
      return run_steps<C, decltype(d)::value>(p, hbuf, cbuf, s, one_step, cfg, counts);  \
    });                                                                                  \
  }

}  // namespace sprnn::cuda
