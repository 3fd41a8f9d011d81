// The per-step fallback kernels: one launch per step, for layers that do not fit on chip and
// GPUs that cannot run the cooperative grid.
#pragma once

#if !defined(__CUDACC_RTC__)
#include <algorithm>
#include <type_traits>
#endif

#include "cuda/cell_update.cuh"

namespace sprnn {
namespace cuda {

// ---- fallback: one non-persistent launch per step ------------------------------------------
//
// For layers whose h tile and state do not fit in shared memory, or GPUs that cannot run the
// cooperative grid. A warp per gate row and block of batch columns (below); h is
// double-buffered in float32 in the workspace.
// hbuf: 2 x B x H floats, cbuf: B x H floats (lstm), both initialised by step_init.
template <Cell kCell, DType D>
__global__ void step_init(Params p, float* hbuf, float* cbuf) {
  using T = Tr<D>;
  using S = typename T::S;
  const long long n = static_cast<long long>(p.B) * p.H;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    hbuf[i] = T::to_f(static_cast<const S*>(p.h0)[i]);
    if constexpr (kCell == Cell::kLstm) cbuf[i] = T::to_f(static_cast<const S*>(p.c0)[i]);
  }
}

// The per-step kernel's work split: a block takes kStepUnits units and kCols batch columns, a
// warp per gate row of its units. Each warp reads its row's values and columns once for all the
// columns, where a warp per (unit, column) read every row once per column; a warp per gate row,
// not per unit, keeps four times as many rows in flight for LSTM layers. In a jitted loop of
// one-step calls (B=4, fp16) LSTM H=1024 went from 24.0 to 16.2 us per step, H=4096 from 56.2 to
// 52.1 (benchmarks/NOTES.md, session 82).
// kCols is a template argument (1, 4 or 8, the least that covers B, step_cols): the rows issue
// every column's gather even where it is predicated off, and at LSTM H=4096 the kernel is bound by
// issue, not memory (ncu: 0.76 warp instructions per scheduler and cycle; B=1 took 41.5 us and
// B=4 44.8 with 8 column slots each; session 83).
template <Cell kCell>
constexpr int kStepUnits = gates_of(kCell) == 1 ? 8 : 2;  // 8 warps (6 for the GRU)

// Threads of a block of kUnits units, a warp per gate row (step_fwd's and step_fwd_staged's).
template <Cell kCell, int kUnits>
constexpr int unit_threads() { return 32 * gates_of(kCell) * kUnits; }

// Chunks of kUnits units that cover the layer's H.
template <int kUnits>
__host__ __device__ inline long long unit_chunks(const Params& p) {
  return (p.H + kUnits - 1) / kUnits;
}

template <Cell kCell>
constexpr int step_threads() { return unit_threads<kCell, kStepUnits<kCell>>(); }

__host__ __device__ constexpr int step_cols(int B) { return B <= 1 ? 1 : B <= 4 ? 4 : 8; }

// Blocks of a step of blocks of `cols` batch columns (step_cols(p.B) in the package).
template <Cell kCell>
__host__ __device__ inline long long step_blocks(const Params& p, int cols) {
  return unit_chunks<kStepUnits<kCell>>(p) * ((p.B + cols - 1) / cols);
}

// How a lane reads its row: kVec consecutive nonzeros per load (one vector load of values and
// one of columns where all kVec are in the row and the arrays aligned), kUnroll such loads
// issued before the first gather. One-step calls, fp16, us per launch (the probe
// benchmarks/step_kernel_probe.cu, session 83): at B=4 LSTM H=4096 36.0 with one nonzero per
// load and four loads in flight, 33.2 with four and one, ReLU H=5760 20.3 and 18.5 (at B=1
// 25.5 / 19.1 and 13.9 / 10.2); more in flight, or eight per load, was slower.
constexpr int kStepVec = 4;  // a power of two
constexpr int kStepUnroll = 1;
template <Cell kCell>
constexpr int kStepMinBlocks = gates_of(kCell) == 3 ? 6 : 5;
// Blocks of at most this many columns gather h_{t-1} by select (step_fwd); wider ones predicate.
constexpr int kStepSelectCols = 4;

// Lane's nonzeros k .. k + kVec - 1 of the row [k0, k1): values as float32 and columns, -1 for
// those outside the row.
template <DType D, int kVec>
__device__ __forceinline__ void load_nonzeros(const typename Tr<D>::S* vals, const int32_t* cols,
                                              bool aligned, int k, int k0, int k1,
                                              float (&w)[kVec], int (&c)[kVec]) {
  if (aligned && k >= k0 && k + kVec <= k1) {
    float cf[kVec];
    load_vals<D, kVec>(vals + k, w);
    load_vals<DType::kF32, kVec>(reinterpret_cast<const float*>(cols + k), cf);
#pragma unroll
    for (int v = 0; v < kVec; ++v) c[v] = __float_as_int(cf[v]);
  } else {
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const bool in = k + v >= k0 && k + v < k1;
      w[v] = in ? Tr<D>::to_f(vals[k + v]) : 0.0f;
      c[v] = in ? __ldg(cols + k + v) : -1;
    }
  }
}

// Whether both arrays allow load_nonzeros' vector loads at every multiple of kVec.
template <DType D, int kVec>
__device__ __forceinline__ bool nonzeros_aligned(const void* vals, const int32_t* cols) {
  constexpr unsigned kValBytes = sizeof(typename Tr<D>::S) * kVec, kColBytes = 4 * kVec;
  const auto at = [](const void* q) { return reinterpret_cast<unsigned long long>(q); };
  return at(vals) % (kValBytes < 16 ? kValBytes : 16) == 0 &&
         at(cols) % (kColBytes < 16 ? kColBytes : 16) == 0;
}

// The sums of one row's nonzeros [k0, k1) for kCols batch columns, by the kLanes lanes of an
// aligned group of a warp (lane: this lane's index in it): accumulate(w, col, in, a) adds one
// nonzero (in: inside the row) to the column sums a; the first ncols sums end on every lane of
// the group. All 32 lanes of the warp must call it (the sums are added by shuffles).
template <DType D, int kCols, int kVec, int kUnroll, int kLanes, class Accumulate>
__device__ __forceinline__ void row_dot(const typename Tr<D>::S* vals, const int32_t* cols,
                                        bool aligned, int k0, int k1, int lane, int ncols,
                                        float (&a)[kCols], Accumulate accumulate) {
  static_assert(kVec > 0 && (kVec & (kVec - 1)) == 0, "the rows round k0 down to a multiple");
  static_assert(kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "lanes of aligned groups");
#pragma unroll
  for (int j = 0; j < kCols; ++j) a[j] = 0.0f;
  constexpr int kPass = kLanes * kVec;
  for (int k = (k0 & -kVec) + lane * kVec; k < k1; k += kPass * kUnroll) {
    float w[kUnroll][kVec];
    int c[kUnroll][kVec];
#pragma unroll
    for (int q = 0; q < kUnroll; ++q)
      load_nonzeros<D, kVec>(vals, cols, aligned, k + q * kPass, k0, k1, w[q], c[q]);
#pragma unroll
    for (int q = 0; q < kUnroll; ++q) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        // A nonzero outside the row reads column 0; accumulate drops its sum by a select or a
        // predicate, not by 0 * h (h may be inf).
        const bool in = c[q][v] >= 0;
        accumulate(w[q][v], in ? c[q][v] : 0, in, a);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    if (j < ncols) {
#pragma unroll
      for (int off = kLanes / 2; off > 0; off >>= 1)
        a[j] += __shfl_xor_sync(0xffffffffu, a[j], off);
    }
  }
}

// Warp `warp`'s row sums for kCols batch columns: the row is gate warp % G of unit u0 + warp / G,
// accumulate as in row_dot, and lane 0 stores the warp's sums into sums[warp / G][warp % G][j]
// for the block's ncols columns.
template <Cell kCell, DType D, int kCols, int kVec, int kUnroll, class Accumulate>
__device__ __forceinline__ void row_sums(const Params& p, int u0, int ncols, float* sums,
                                         Accumulate accumulate) {
  constexpr int G = gates_of(kCell);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int u = u0 + warp / G;
  if (u >= p.H) return;
  float a[kCols];
  const auto* vals = static_cast<const typename Tr<D>::S*>(p.values);
  const bool aligned = nonzeros_aligned<D, kVec>(vals, p.col_idx);
  const long long r = static_cast<long long>(u) * G + warp % G;
  const int k0 = __ldg(p.row_ptr + r), k1 = __ldg(p.row_ptr + r + 1);
  row_dot<D, kCols, kVec, kUnroll, 32>(vals, p.col_idx, aligned, k0, k1, lane, ncols, a,
                                       accumulate);
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < kCols; ++j)
      if (j < ncols) sums[((warp / G) * G + warp % G) * kCols + j] = a[j];
  }
}

// The update of unit u, column b at step s from its gate sums hw (row_sums'), for a call of one
// step (kOneStep: h_{-1} and c from h0 and c0, the new state to hT and cT) or a loop step (h
// double-buffered in hin / hout, c in cbuf, in float32). Where s >= the column's length, hw is
// not read (the block may have skipped its rows).
template <Cell kCell, DType D, bool kOneStep>
__device__ __forceinline__ void update_unit(const Params& p, int s, int b, int u, const float* hw,
                                            const float* hin, float* hout, float* cbuf) {
  using T = Tr<D>;
  using S = typename T::S;
  constexpr int G = gates_of(kCell);
  const int H = p.H, B = p.B;
  const int len = seq_len(p, b);
  const long long bi = static_cast<long long>(b) * H + u;
  if (s >= len) {  // (its sums were not computed where no column of the block runs)
    if constexpr (kOneStep) {  // a sequence of length 0 keeps its initial state, bit for bit
      static_cast<S*>(p.hT)[bi] = static_cast<const S*>(p.h0)[bi];
      if constexpr (kCell == Cell::kLstm)
        static_cast<S*>(p.cT)[bi] = static_cast<const S*>(p.c0)[bi];
    } else {
      hout[bi] = hin[bi];
    }
    const long long o = (static_cast<long long>(s) * B + b) * H + u;
    static_cast<S*>(p.ys)[o] = T::from_f(0.0f);
    if constexpr (kCell == Cell::kLstm) static_cast<S*>(p.cs)[o] = T::from_f(0.0f);
    return;
  }
  const int t = step_time(s, len, p.reverse != 0);
  const S* xq = static_cast<const S*>(p.xp) + (static_cast<long long>(t) * B + b) * G * static_cast<long long>(H) + u;
  float x[G];
#pragma unroll
  for (int g = 0; g < G; ++g) x[g] = T::to_f(xq[static_cast<long long>(g) * H]);
  const long long o = (static_cast<long long>(t) * B + b) * H + u;
  float hnew;
  if constexpr (kCell == Cell::kLstm) {
    float pre[4];
#pragma unroll
    for (int g = 0; g < 4; ++g) pre[g] = x[g] + hw[g];
    float c = kOneStep ? T::to_f(static_cast<const S*>(p.c0)[bi]) : cbuf[bi];
    hnew = lstm_step(pre, c);
    if constexpr (kOneStep) static_cast<S*>(p.cT)[bi] = T::from_f(c);
    else cbuf[bi] = c;
    static_cast<S*>(p.cs)[o] = T::from_f(c);
  } else if constexpr (kCell == Cell::kGru) {
    const float hprev = kOneStep ? T::to_f(static_cast<const S*>(p.h0)[bi]) : hin[bi];
    hnew = gru_step(x, hw, T::to_f(static_cast<const S*>(p.b_hn)[u]), hprev);
  } else {
    hnew = p.activation ? rnn_step<Cell::kRnnRelu>(x[0], hw[0]) : rnn_step<Cell::kRnnTanh>(x[0], hw[0]);
  }
  if constexpr (kOneStep) static_cast<S*>(p.hT)[bi] = T::from_f(hnew);
  else hout[bi] = hnew;
  static_cast<S*>(p.ys)[o] = T::from_f(hnew);
}

// The type of h_{t-1} as the step reads it: the call's (h0, kOneStep) or float32 (the workspace).
template <DType D, bool kOneStep>
constexpr DType kStepHType = kOneStep ? D : DType::kF32;

// A loop step's half `half` (s: h_{t-1}, read; s + 1: h_t, written) of the workspace's
// double-buffered h; none for a one-step call.
template <bool kOneStep>
__device__ __forceinline__ float* workspace_h(const Params& p, float* hbuf, int half) {
  return kOneStep ? nullptr : hbuf + (half & 1) * static_cast<long long>(p.B) * p.H;
}

// h_{t-1} of every column: the call's h0 or the workspace's half `hin`.
template <DType D, bool kOneStep>
__device__ __forceinline__ const typename Tr<kStepHType<D, kOneStep>>::S* step_hprev(
    const Params& p, const float* hin) {
  using HIn = typename Tr<kStepHType<D, kOneStep>>::S;
  return static_cast<const HIn*>(kOneStep ? p.h0 : static_cast<const void*>(hin));
}

// The updates of a block's units u0 .. u0 + U - 1 and columns b0 .. b0 + ncols - 1: a thread per
// (unit, column), after row_sums filled sums[U][G][kCols] (and a barrier).
template <Cell kCell, DType D, bool kOneStep, int U, int kCols>
__device__ __forceinline__ void update_block(const Params& p, int s, int u0, int b0, int ncols,
                                             const float* sums, const float* hin, float* hout,
                                             float* cbuf) {
  constexpr int G = gates_of(kCell);
  if (threadIdx.x >= U * kCols) return;
  const int j = threadIdx.x % kCols, u = u0 + threadIdx.x / kCols;
  if (j >= ncols || u >= p.H) return;
  float hw[G];
#pragma unroll
  for (int g = 0; g < G; ++g) hw[g] = sums[((u - u0) * G + g) * kCols + j];
  update_unit<kCell, D, kOneStep>(p, s, b0 + j, u, hw, hin, hout, cbuf);
}

// kOneStep: a call of one step (T = 1) as this single launch (handlers.cu): h_{-1} and c are
// read from the call's h0 and c0 and the new state is written to hT and cT, so it needs no
// workspace, no step_init / step_final and, having no wait, no sync check.
// (kMinBlocks keeps at least 36 warps per SM: the rows wait on global loads, and without it a
// warp's 8 column sums took 66 registers, 3 blocks of 8 warps per SM. sm_90, kStepVec 4: at
// most 48 registers for 5 blocks of 8 warps, 56 for the GRU's 6 blocks of 6, no spills.)
template <Cell kCell, DType D, bool kOneStep, int kCols, int kVec = kStepVec,
          int kUnroll = kStepUnroll, int kMinBlocks = kStepMinBlocks<kCell>,
          int kSelectCols = kStepSelectCols>
__global__ void __launch_bounds__(step_threads<kCell>(), kMinBlocks)
    step_fwd(Params p, int s, float* hbuf, float* cbuf) {
  using TH = Tr<kStepHType<D, kOneStep>>;
  using HIn = typename TH::S;
  constexpr int G = gates_of(kCell);
  constexpr int U = kStepUnits<kCell>;
  __shared__ float sums[U * G * kCols];
  const int H = p.H, B = p.B;
  const long long chunks = unit_chunks<U>(p);
  const int u0 = static_cast<int>(blockIdx.x % chunks) * U;
  const int b0 = static_cast<int>(blockIdx.x / chunks) * kCols;
  const int ncols = min(kCols, B - b0);
  const float* hin = workspace_h<kOneStep>(p, hbuf, s);
  float* hout = workspace_h<kOneStep>(p, hbuf, s + 1);
  // (a base of b0's row made the LSTM one-step build spill 32 bytes, sm_90)
  const HIn* hprev = step_hprev<D, kOneStep>(p, hin);
  // Blocks of up to 4 columns gather without branches: each column's h by its own base
  // pointer, one wide multiply-add from the nonzero's column where (b0 + j) * H + column took
  // five instructions and reloads of H and h0, and a select instead of a predicate: ~12 SASS
  // instructions per gather became 7. One-step fp16 us per launch (session 84, step_kernel_probe
  // calls 1 and 6): B=1 LSTM H=4096 19.2 -> 16.6, ReLU H=5760 10.3 -> 8.2; B=4 about even (32.6
  // -> 32.4 and 33.7 -> 33.4; 17.2 -> 17.9 and 19.8 -> 18.1); loop steps (session 85, call 2)
  // B=4 ReLU H=5760 28.5 -> 23.9, LSTM H=4096 44.7 -> 44.1, B=1 10.5 -> 9.6 and 20.4 -> 19.0.
  // With 8 columns the 8 pointers spill or cost occupancy (B=8 53.7 -> 55.6, B=16 95.2 ->
  // 105.1) and the loop steps were no faster, so those keep the predicated gathers.
  constexpr bool kSelect = kCols <= kSelectCols;
  const HIn* hcol[kCols];  // the select's h_{t-1} of each column
  if constexpr (kSelect) {
#pragma unroll
    for (int j = 0; j < kCols; ++j)
      hcol[j] = hprev + static_cast<long long>(b0 + min(j, ncols - 1)) * H;
  }
  if (s < max_seq_len(p, b0, b0 + ncols)) {  // any column of the block runs step s
    row_sums<kCell, D, kCols, kVec, kUnroll>(
        p, u0, ncols, sums, [&](float w, int col, bool in, float (&a)[kCols]) {
#pragma unroll
          for (int j = 0; j < kCols; ++j) {
            if constexpr (kSelect) {
              const float sum = fmaf(w, TH::to_f(hcol[j][col]), a[j]);
              a[j] = in ? sum : a[j];
            } else if (j < ncols && in) {
              a[j] = fmaf(w, TH::to_f(hprev[static_cast<long long>(b0 + j) * H + col]), a[j]);
            }
          }
        });
  }
  __syncthreads();
  update_block<kCell, D, kOneStep, U, kCols>(p, s, u0, b0, ncols, sums, hin, hout, cbuf);
}

// ---- the staged per-step kernel: h_{t-1} on chip --------------------------------------------
//
// step_fwd gathers h_{t-1} from global memory (L1 hits, each column its own load): at B = 4
// most of its issue slots and memory pipes go to those gathers (ncu, session 83).
// step_fwd_staged copies the h_{t-1} of its kCols columns into shared memory once, interleaved
// (h[col][j]), so a nonzero takes one load of all its columns' values, and then loops over unit
// chunks: blocks of 32 warps, one per SM (grid of staged_grid blocks), so that the copy is
// made once per SM, not once per 8 units. Where it runs: step_launch.
template <Cell kCell>
constexpr int kStagedUnits = 32 / gates_of(kCell);  // 32 warps (30 for the GRU)

template <Cell kCell>
constexpr int staged_threads() { return unit_threads<kCell, kStagedUnits<kCell>>(); }

// A block's static shared memory (its `sums`) is at most kStagedStaticBytes, so a copy of up to
// kStagedDefaultBytes launches without raising the kernel's limit (static and dynamic together
// 48 KB) and a larger one up to the device's opt-in limit less kStagedStaticBytes (StepConfig).
constexpr long long kStagedStaticBytes = 1024;
constexpr long long kStagedDefaultBytes = 48 * 1024 - kStagedStaticBytes;

// Bytes of h_{t-1} per hidden unit for a block of `cols` columns: the call's dtype on one-step
// calls, else the float32 workspace's (kStepHType). step_fwd gathers them once per nonzero.
template <DType D>
__host__ __device__ constexpr long long step_h_bytes(int cols, bool one_step) {
  return cols * (one_step ? static_cast<long long>(sizeof(typename Tr<D>::S)) : 4);
}

template <DType D>
__host__ __device__ inline long long step_staged_bytes(const Params& p, int cols, bool one_step) {
  return static_cast<long long>(p.H) * step_h_bytes<D>(cols, one_step);
}

// Values of h_{t-1} a thread of step_fwd_staged loads before it stores them, in its copy: the
// loads come through a generic pointer, which may alias h_s, so the compiler keeps each load
// after the store before it, and a thread's copy waits out one L2 round trip per value (ncu,
// session 86: a quarter of the stall samples of LSTM H=4096 B=8, 32 values per thread).
// step_kernel_probe, session 87 call 1, copy batch 1 -> 8 (16), us per launch: one-step LSTM
// H=4096 B=8 36.1 -> 33.0 (32.0), ReLU H=5760 B=8 29.6 -> 26.1 (25.7), B=4 18.9 -> 17.2 (18.1);
// 16 spills in some builds.
constexpr int kStagedCopyBatch = 8;

// Vectors of 16 bytes of h_{t-1} a thread of step_fwd_staged loads before it stores them, in
// stage_h's vector copy (rows of h of whole vectors); 0 = the copy by values only. One-step
// ReLU H=5760 B=8, us per launch: 21.6 with 4, 22.4 with 8 (fewer rounds, more registers),
// LSTM H=4096 B=4 21.1 and 21.9 (step_kernel_probe, session 88 call 5).
constexpr int kStagedCopyVectors = 4;

// Stores vector c of column j of h_{t-1} (units V * c .. V * c + V - 1, V values of type HIn in
// v) into h_s ([H][kCols]). A warp's lanes hold consecutive (c, j) pairs, j fastest, so stored
// in unit order their stores would hit the same banks (one-step ReLU H=5760 B=8, us per launch:
// 28.0 with the copy by values, 40.2 by vectors in unit order, step_kernel_probe session 88
// call 2); each lane instead starts at unit c mod V of its vector (the values rotated by
// selects, not by a dynamic index, which would put them in local memory), so that the lanes of
// different c hit different banks: 21.8 (call 3).
template <int kCols, class HIn>
__device__ __forceinline__ void store_h_vector(HIn* h_s, const uint4& v, int j, int c) {
  constexpr int V = 16 / static_cast<int>(sizeof(HIn));
  if constexpr (kCols == 1) {
    reinterpret_cast<uint4*>(h_s)[c] = v;  // [H][1]: the row itself
  } else {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t e[V];  // the values' bits
#pragma unroll
    for (int t = 0; t < V; ++t) e[t] = V == 4 ? w[t % 4] : (w[t / 2] >> (16 * (t % 2))) & 0xffffu;
    const int r = c % V;
#pragma unroll
    for (int bit = 1; bit < V; bit <<= 1) {  // rotate left by r, one bit of r at a time
      uint32_t rot[V];
#pragma unroll
      for (int t = 0; t < V; ++t) rot[t] = (r & bit) ? e[(t + bit) % V] : e[t];
#pragma unroll
      for (int t = 0; t < V; ++t) e[t] = rot[t];
    }
#pragma unroll
    for (int t = 0; t < V; ++t) {
      const long long u = static_cast<long long>(V) * c + (t + r) % V;
      if constexpr (V == 4) h_s[u * kCols + j] = __uint_as_float(e[t]);
      else h_s[u * kCols + j] = static_cast<HIn>(e[t]);
    }
  }
}

// step_fwd_staged's copy of columns b0 .. b0 + ncols - 1 of hprev ([B][H]) into h_s ([H][kCols],
// coalesced reads of each column's row); columns past ncols are zero (never summed). Where each
// column's row is whole 16-byte vectors, kVectors of them per thread at a time (predicated,
// loaded before any is stored; store_h_vector); else values: whole batches of kBatch values
// first, then the rest one at a time, so that a small copy (fewer than kBatch values per thread)
// costs no more than without batches.
template <int kCols, int kBatch, int kVectors, class HIn>
__device__ __forceinline__ void stage_h(const HIn* hprev, HIn* h_s, int H, int b0, int ncols) {
  const int stride = static_cast<int>(blockDim.x);
  constexpr int V = 16 / static_cast<int>(sizeof(HIn));  // values per vector
  if constexpr (kVectors > 0) {
    if (H % V == 0 && reinterpret_cast<unsigned long long>(hprev) % 16 == 0) {
      const int n = kCols * (H / V);  // vectors in the copy: vector i is column i % kCols's
      for (int i = static_cast<int>(threadIdx.x); i < n; i += kVectors * stride) {
        uint4 v[kVectors];
#pragma unroll
        for (int q = 0; q < kVectors; ++q) {
          const int iq = i + q * stride, j = iq % kCols;
          v[q] = iq < n && j < ncols
                     ? __ldcg(reinterpret_cast<const uint4*>(
                                  hprev + static_cast<long long>(b0 + j) * H) + iq / kCols)
                     : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int q = 0; q < kVectors; ++q) {
          const int iq = i + q * stride;
          if (iq < n) store_h_vector<kCols>(h_s, v[q], iq % kCols, iq / kCols);
        }
      }
      return;
    }
  }
  const int n = kCols * H;  // (< 2^31: the copy fits on chip)
  const auto load = [&](int i) {
    const int j = i / H;
    return j < ncols ? hprev[static_cast<long long>(b0 + j) * H + i % H] : HIn{};
  };
  const auto store = [&](int i, HIn v) { h_s[static_cast<long long>(i % H) * kCols + i / H] = v; };
  int i = static_cast<int>(threadIdx.x);
  for (; i + (kBatch - 1) * stride < n; i += kBatch * stride) {
    HIn v[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) v[q] = load(i + q * stride);
#pragma unroll
    for (int q = 0; q < kBatch; ++q) store(i + q * stride, v[q]);
  }
  for (; i < n; i += stride) store(i, load(i));
}

// A staged kernel's block: blocks per column group (the grid splits evenly between them), and
// the block's batch columns b0 .. b0 + ncols - 1.
struct StagedBlock {
  int per_group, b0, ncols;
};

template <int kCols>
__device__ __forceinline__ StagedBlock staged_block(const Params& p) {
  const int groups = (p.B + kCols - 1) / kCols;
  const int per_group = static_cast<int>(gridDim.x) / groups;
  const int b0 = static_cast<int>(blockIdx.x) / per_group * kCols;
  return {per_group, b0, min(kCols, p.B - b0)};
}

// The staged kernels' accumulate (row_dot's): one load of the nonzero's column of h_{t-1} for
// all kCols columns from h_s ([H][kCols]).
template <DType kHType, int kCols>
__device__ __forceinline__ auto staged_accumulate(const typename Tr<kHType>::S* h_s) {
  return [h_s](float w, int col, bool in, float (&a)[kCols]) {
    float h[kCols];
    load_vals<kHType, kCols>(h_s + static_cast<long long>(col) * kCols, h);
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const float sum = fmaf(w, h[j], a[j]);
      a[j] = in ? sum : a[j];
    }
  };
}

template <Cell kCell, DType D, bool kOneStep, int kCols, int kVec = kStepVec,
          int kCopyBatch = kStagedCopyBatch, int kCopyVectors = kStagedCopyVectors>
__global__ void __launch_bounds__(staged_threads<kCell>(), 1)
    step_fwd_staged(Params p, int s, float* hbuf, float* cbuf) {
  constexpr DType kHType = kStepHType<D, kOneStep>;
  using HIn = typename Tr<kHType>::S;
  constexpr int G = gates_of(kCell);
  constexpr int U = kStagedUnits<kCell>;
  extern __shared__ __align__(16) unsigned char step_staged_smem[];
  HIn* h_s = reinterpret_cast<HIn*>(step_staged_smem);  // [H][kCols]
  __shared__ float sums[U * G * kCols];
  static_assert(sizeof(sums) <= kStagedStaticBytes, "the copy's limits leave 1 KB");
  const int H = p.H;
  const auto [per_group, b0, ncols] = staged_block<kCols>(p);
  const float* hin = workspace_h<kOneStep>(p, hbuf, s);
  float* hout = workspace_h<kOneStep>(p, hbuf, s + 1);
  const HIn* hprev = step_hprev<D, kOneStep>(p, hin);
  stage_h<kCols, kCopyBatch, kCopyVectors>(hprev, h_s, H, b0, ncols);
  __syncthreads();
  const bool running = s < max_seq_len(p, b0, b0 + ncols);
  const long long chunks = unit_chunks<U>(p);
  for (long long chunk = blockIdx.x % per_group; chunk < chunks; chunk += per_group) {
    const int u0 = static_cast<int>(chunk) * U;
    if (running) {
      row_sums<kCell, D, kCols, kVec, 1>(p, u0, ncols, sums,
                                         staged_accumulate<kHType, kCols>(h_s));
    }
    __syncthreads();
    update_block<kCell, D, kOneStep, U, kCols>(p, s, u0, b0, ncols, sums, hin, hout, cbuf);
    __syncthreads();  // sums are rewritten by the next chunk
  }
}

// ---- the staged kernel by warp tasks: no barrier after the copy ---------------------------
//
// step_fwd_staged's chunks end in two block barriers each: its warps wait for the chunk's
// slowest row and for the update (ncu, session 89: 19% of the stall samples of one-step LSTM
// H=4096 B=8, 11% at ReLU H=5760 B=8). step_fwd_tasks gives each warp whole units instead (a
// task: kLanes lanes per gate row, the warp's 32 / kLanes row slots holding task_units units'
// gate rows; the GRU's 3 leave a slot of 4 idle), adds the gate sums by shuffles and updates
// the units from the same warp, so that after the copy of h_{t-1} its warps never wait on each
// other. Tasks go round-robin over every warp of the column group's blocks (tasks_launch). A
// task's rows take more passes than one row per warp, so on small layers it loses (step_launch).
// Fp16 us per launch, step_fwd_staged -> step_fwd_tasks (step_kernel_probe, session 89 call 3,
// a block per 32 tasks; call 6 spread them over every SM, faster still): one-step LSTM H=4096
// B=8 30.3 -> 24.1, B=4 21.7 -> 16.3, B=1 16.1 -> 12.1; ReLU H=5760 B=8 21.8 -> 19.5, B=4 14.5
// -> 12.8; loop steps LSTM H=4096 B=8 46.9 -> 42.5, ReLU H=5760 B=8 34.1 -> 28.5. Asking the
// first passes into L1 during the copy, or two loads in flight per lane, gained nothing (call 3).
template <Cell kCell, int kLanes>
__host__ __device__ constexpr int task_units() {
  static_assert(32 / kLanes >= gates_of(kCell), "a unit's gate rows fit in one warp");
  return 32 / kLanes / gates_of(kCell);
}

// Lanes per gate row of step_fwd_tasks: 8 for the LSTM and GRU (a unit's gates in one warp), 16
// for an RNN. With the tasks spread over every SM, 16 lanes beat 32 on the loop steps of 8
// columns too (float32 h, 32 bytes a nonzero), which took 32 before: ReLU us per launch, 16 / 32
// lanes (step_kernel_probe, session 90 call 1), H=5760 26.5 / 28.7, H=4224 18.6 / 19.8, H=2880
// 13.1 / 13.7; one-step B=8 H=5760 17.1 / 20.4, B=1 7.8 / 9.1.
template <Cell kCell>
constexpr int kTaskLanes = gates_of(kCell) > 1 ? 8 : 16;

constexpr int kTaskThreads = 1024;  // 32 warps per block, one block per SM

template <Cell kCell, DType D, bool kOneStep, int kCols,
          int kLanes = kTaskLanes<kCell>>
__global__ void __launch_bounds__(kTaskThreads, 1)
    step_fwd_tasks(Params p, int s, float* hbuf, float* cbuf) {
  constexpr DType kHType = kStepHType<D, kOneStep>;
  using HIn = typename Tr<kHType>::S;
  constexpr int G = gates_of(kCell);
  constexpr int KU = task_units<kCell, kLanes>();
  static_assert(KU * kCols <= 32, "a lane per (unit, column) of a task's update");
  extern __shared__ __align__(16) unsigned char step_staged_smem[];
  HIn* h_s = reinterpret_cast<HIn*>(step_staged_smem);  // [H][kCols]
  const int H = p.H;
  const auto [per_group, b0, ncols] = staged_block<kCols>(p);
  const float* hin = workspace_h<kOneStep>(p, hbuf, s);
  float* hout = workspace_h<kOneStep>(p, hbuf, s + 1);
  const HIn* hprev = step_hprev<D, kOneStep>(p, hin);
  const bool running = s < max_seq_len(p, b0, b0 + ncols);
  const auto* vals = static_cast<const typename Tr<D>::S*>(p.values);
  const bool aligned = nonzeros_aligned<D, kStepVec>(vals, p.col_idx);
  const int lane = threadIdx.x & 31, slot = lane / kLanes;
  const int row_unit = slot / G, gate = slot % G;  // this lane's row: gate `gate` of unit row_unit
  const int upd_unit = lane / kCols, upd_col = lane % kCols;  // this lane's update
  const long long tasks = (H + KU - 1) / KU;  // (unit_chunks<KU>'s value in int arithmetic)
  const long long stride = static_cast<long long>(blockDim.x / 32) * per_group;
  long long t = static_cast<long long>(threadIdx.x / 32) * per_group + blockIdx.x % per_group;
  // This lane's row [k0, k1) of task t (empty for an idle slot or past the tasks); the first
  // task's offsets load during the copy.
  int k0 = 0, k1 = 0;
  const auto row_range = [&](long long task) {
    const int u = static_cast<int>(task) * KU + row_unit;
    k0 = k1 = 0;
    if (running && task < tasks && row_unit < KU && u < H) {
      const long long r = static_cast<long long>(u) * G + gate;
      k0 = __ldg(p.row_ptr + r);
      k1 = __ldg(p.row_ptr + r + 1);
    }
  };
  row_range(t);
  stage_h<kCols, kStagedCopyBatch, kStagedCopyVectors>(hprev, h_s, H, b0, ncols);
  __syncthreads();
  for (; t < tasks; t += stride) {
    const int u0 = static_cast<int>(t) * KU;
    float a[kCols];
    row_dot<D, kCols, kStepVec, 1, kLanes>(vals, p.col_idx, aligned, k0, k1, lane % kLanes,
                                           ncols, a, staged_accumulate<kHType, kCols>(h_s));
    row_range(t + stride);  // (its loads overlap the update's)
    // Gate g of unit upd_unit, column upd_col: from the first lane of that row's slot.
    float hw[G];
    const int src = upd_unit < KU ? upd_unit * G * kLanes : 0;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      hw[g] = 0.0f;
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const float v = __shfl_sync(0xffffffffu, a[j], src + g * kLanes);
        hw[g] = upd_col == j ? v : hw[g];
      }
    }
    if (upd_unit < KU && upd_col < ncols && u0 + upd_unit < H)
      update_unit<kCell, D, kOneStep>(p, s, b0 + upd_col, u0 + upd_unit, hw, hin, hout, cbuf);
  }
}

#if !defined(__CUDACC_RTC__)
// step_fwd for a block of `cols` batch columns (1, 4 or 8; step_cols(B) for a call of B).
template <Cell C, DType D, bool kOneStep, int kVec = kStepVec, int kUnroll = kStepUnroll,
          int kMinBlocks = kStepMinBlocks<C>, int kSelectCols = kStepSelectCols>
auto step_kernel(int cols) {
  switch (cols) {
    case 1: return &step_fwd<C, D, kOneStep, 1, kVec, kUnroll, kMinBlocks, kSelectCols>;
    case 4: return &step_fwd<C, D, kOneStep, 4, kVec, kUnroll, kMinBlocks, kSelectCols>;
    default: return &step_fwd<C, D, kOneStep, 8, kVec, kUnroll, kMinBlocks, kSelectCols>;
  }
}

// step_fwd_staged for a block of `cols` batch columns.
template <Cell C, DType D, bool kOneStep, int kVec = kStepVec, int kCopyBatch = kStagedCopyBatch,
          int kCopyVectors = kStagedCopyVectors>
auto step_staged_kernel(int cols) {
  switch (cols) {
    case 1: return &step_fwd_staged<C, D, kOneStep, 1, kVec, kCopyBatch, kCopyVectors>;
    case 4: return &step_fwd_staged<C, D, kOneStep, 4, kVec, kCopyBatch, kCopyVectors>;
    default: return &step_fwd_staged<C, D, kOneStep, 8, kVec, kCopyBatch, kCopyVectors>;
  }
}

// Blocks of a staged kernel for a step of blocks of `cols` columns: per column group as many as
// `sms` allows, at least one and at most one per work item (unit chunks or tasks), each looping
// over its share of the items.
inline long long staged_grid(const Params& p, int cols, long long items, int sms) {
  const long long groups = (p.B + cols - 1) / cols;
  return groups * std::max(1LL, std::min(items, sms / groups));
}

// Where the per-step kernels run (run_steps): the GPU's SM count (the staged kernels' grids);
// staged = 0 for step_fwd only, 1 (the default) for the kernel that wins (step_launch), 2 for
// step_fwd_staged and 3 for step_fwd_tasks wherever their copy of h_{t-1} fits (the tests); the
// largest copy (the device's opt-in shared memory less kStagedStaticBytes), and how to raise a
// kernel's limit for copies above kStagedDefaultBytes (handlers.cu ensure_smem; without it they
// do not fit).
struct StepConfig {
  int sms = 0;
  int staged = 1;
  long long max_bytes = kStagedDefaultBytes;
  int dev = 0;
  cudaError_t (*raise_smem)(int dev, const void* kernel, long long smem) = nullptr;
};

// The per-step kernels: step_fwd, step_fwd_staged, step_fwd_tasks.
enum class StepKind { kRows, kStaged, kTasks };

// How a step launches.
struct StepLaunch {
  void (*kernel)(Params, int, float*, float*);
  long long blocks;
  int threads;
  long long smem;
  StepKind kind;
};

// step_fwd_staged's launch for p's columns (whatever its copy's size).
template <Cell C, DType D, bool kOneStep, int kCopyBatch = kStagedCopyBatch,
          int kCopyVectors = kStagedCopyVectors>
StepLaunch staged_launch(const Params& p, int sms) {
  const int cols = step_cols(p.B);
  return {step_staged_kernel<C, D, kOneStep, kStepVec, kCopyBatch, kCopyVectors>(cols),
          staged_grid(p, cols, unit_chunks<kStagedUnits<C>>(p), sms), staged_threads<C>(),
          step_staged_bytes<D>(p, cols, kOneStep), StepKind::kStaged};
}

// step_fwd_tasks' launch for p's columns, with kLanes lanes per row (0: kTaskLanes'): per
// column group as many blocks as `sms` allows (at most one per task), so that the tasks spread
// over every SM rather than fill 32 warps of as few. Us per launch, a block per 32 tasks ->
// every SM (step_kernel_probe, session 89 call 6):
// one-step ReLU H=5760 (16 lanes: 2880 tasks, 90 blocks) B=8 19.7 -> 17.1, B=4 12.8 -> 11.3,
// B=1 8.2 -> 7.7; loop steps B=4 15.9 -> 13.5; LSTM H=4096 (4096 tasks, 128 blocks) B=8 24.5 ->
// 23.9; LSTM H=2048 B=8 15.8 -> 12.4, loop 25.7 -> 18.0 (step_fwd_staged 13.9 and 18.6).
template <Cell C, DType D, bool kOneStep, int kLanes = 0>
StepLaunch tasks_launch(const Params& p, int sms) {
  const int cols = step_cols(p.B);
  const auto pick = [&](auto c) {
    constexpr int kCols = decltype(c)::value;
    constexpr int L = kLanes > 0 ? kLanes : kTaskLanes<C>;
    return StepLaunch{&step_fwd_tasks<C, D, kOneStep, kCols, L>,
                      staged_grid(p, kCols, unit_chunks<task_units<C, L>()>(p), sms),
                      kTaskThreads, step_staged_bytes<D>(p, kCols, kOneStep), StepKind::kTasks};
  };
  return cols == 1   ? pick(std::integral_constant<int, 1>{})
         : cols == 4 ? pick(std::integral_constant<int, 4>{})
                     : pick(std::integral_constant<int, 8>{});
}

// Raises a staged kernel's shared-memory limit for a copy above the default, before l runs.
inline cudaError_t prepare_step(const StepLaunch& l, const StepConfig& cfg) {
  if (l.kind == StepKind::kRows || l.smem <= kStagedDefaultBytes) return cudaSuccess;
  return cfg.raise_smem(cfg.dev, reinterpret_cast<const void*>(l.kernel), l.smem);
}

// Units per SM from which step_fwd_tasks beats step_fwd and step_fwd_staged, by cell and
// columns per block. Fp16 us per launch, one-step, the faster of the other two -> tasks (loop
// steps agree), by units per SM on 132 SMs (step_kernel_probe, session 90 call 1, session 91
// calls 1 and 3, `..._session91_054efcc/call{1,3}_probe*.txt`):
// - LSTM, 1 column, 12: H=1536 (11.6) 6.0 -> 6.3, H=1664 (12.6) 7.6 -> 6.5. 4 columns, 9: H=1152
//   (8.7) 6.9 -> 7.4, H=1280 (9.7) 7.9 -> 7.6. 8 columns, 8: H=1024 (7.8) 8.2 -> 8.8, H=1152
//   11.4 -> 9.5.
// - GRU (a slot of 4 idle in every task at B=1), 1 column, 17: H=2048 (15.5) 6.1 -> 6.8, H=2304
//   (17.5) 7.7 -> 7.1. 4 and 8 columns, 10: H=1280 (9.7) B=4 6.8 -> 7.3, B=8 8.7 -> 9.3; H=1536
//   (11.6) 8.2 -> 7.9, 12.7 -> 10.0.
// - RNN, 1 column, 40: H=4608 (34.9) 6.8 -> 7.0, H=5280 (40) 7.6 -> 7.4. 4 columns, 18: H=2304
//   (17.5) 7.25 -> 7.27, H=2432 (18.4) 7.4 -> 7.2 (loop steps 8.0 -> 7.6). 8 columns, 5: H=640
//   (4.8) 6.57 -> 6.60, H=768 (5.8) 6.9 -> 6.9 (loop steps 7.6 -> 7.4), H=960 (7.3) loop steps
//   8.4 -> 7.8.
template <Cell C>
constexpr int tasks_edge(int cols) {
  if (C == Cell::kLstm) return cols >= 8 ? 8 : cols >= 4 ? 9 : 12;
  if (C == Cell::kGru) return cols == 1 ? 17 : 10;
  return cols >= 8 ? 5 : cols >= 4 ? 18 : 40;
}

// A staged kernel where its copy fits and (by default) where it wins:
// - step_fwd_tasks from tasks_edge units per SM (before session 90 28 for every cell and B);
// - else step_fwd_staged where it has at least two unit chunks per SM, or, with blocks of 4 or
//   8 columns, 7/8 to one chunk per SM (above one some SMs take two: LSTM H=1152 B=4, 144
//   chunks of 8 units on 132 SMs, staged 9.2, step_fwd 6.9; session 91). Fp16 us per launch
//   with stage_h's vector copy (step_kernel_probe, session 88 call 3), step_fwd -> staged:
//   one-step B=1 LSTM H=4096 (512 chunks) 16.4 -> 15.5, ReLU H=5760 (180) 8.1 -> 9.8, LSTM
//   H=1024 (128) 4.8 -> 5.0; B=4 LSTM H=4096 34.1 -> 21.3, ReLU H=5760 18.0 -> 14.4, LSTM
//   H=1024 6.5 -> 6.4, ReLU H=1152 (36 chunks: 36 SMs busy) 5.2 -> 6.1; B=8 ReLU H=5760 38.5 ->
//   21.8, LSTM H=1024 9.2 -> 8.1, ReLU H=1152 8.4 -> 8.0; loop steps B=1 LSTM H=4096 18.7 ->
//   17.1, ReLU H=5760 9.3 -> 10.3; B=4 LSTM H=1024 7.2 -> 7.0, ReLU H=1152 5.8 -> 6.6; B=8 LSTM
//   H=1024 11.5 -> 9.8.
template <Cell C, DType D, bool kOneStep>
StepLaunch step_launch(const Params& p, const StepConfig& cfg) {
  const int cols = step_cols(p.B);
  const long long bytes = step_staged_bytes<D>(p, cols, kOneStep);
  const bool fits = bytes <= kStagedDefaultBytes || (bytes <= cfg.max_bytes && cfg.raise_smem);
  const long long chunks = unit_chunks<kStagedUnits<C>>(p);
  if (cfg.sms > 0 && fits) {
    const bool tasks_win = p.H >= static_cast<long long>(tasks_edge<C>(cols)) * cfg.sms;
    const bool staged_wins =
        chunks >= 2LL * cfg.sms || (cols >= 4 && 8 * chunks >= 7LL * cfg.sms && chunks <= cfg.sms);
    if (cfg.staged == 3 || (cfg.staged == 1 && tasks_win))
      return tasks_launch<C, D, kOneStep>(p, cfg.sms);
    if (cfg.staged == 2 || (cfg.staged == 1 && staged_wins))
      return staged_launch<C, D, kOneStep>(p, cfg.sms);
  }
  return {step_kernel<C, D, kOneStep>(cols), step_blocks<C>(p, cols), step_threads<C>(), 0,
          StepKind::kRows};
}
#endif

template <Cell kCell, DType D>
__global__ void step_final(Params p, const float* hfin, const float* cbuf) {
  using T = Tr<D>;
  using S = typename T::S;
  const long long n = static_cast<long long>(p.B) * p.H;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    static_cast<S*>(p.hT)[i] = T::from_f(hfin[i]);
    if constexpr (kCell == Cell::kLstm) static_cast<S*>(p.cT)[i] = T::from_f(cbuf[i]);
  }
}

}  // namespace cuda
}  // namespace sprnn
