// The per-step fallback kernels: one launch per step, for layers that do not fit on chip and
// GPUs that cannot run the cooperative grid.
#pragma once

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

template <Cell kCell>
constexpr int step_threads() { return 32 * gates_of(kCell) * kStepUnits<kCell>; }

__host__ __device__ constexpr int step_cols(int B) { return B <= 1 ? 1 : B <= 4 ? 4 : 8; }

template <Cell kCell>
__host__ __device__ inline long long step_unit_chunks(const Params& p) {
  return (p.H + kStepUnits<kCell> - 1) / kStepUnits<kCell>;
}

// Blocks of a step of blocks of `cols` batch columns (step_cols(p.B) in the package).
template <Cell kCell>
__host__ __device__ inline long long step_blocks(const Params& p, int cols) {
  return step_unit_chunks<kCell>(p) * ((p.B + cols - 1) / cols);
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
  using T = Tr<D>;
  using S = typename T::S;
  constexpr int G = gates_of(kCell);
  constexpr int U = kStepUnits<kCell>;
  static_assert(kVec > 0 && (kVec & (kVec - 1)) == 0, "the rows round k0 down to a multiple");
  __shared__ float sums[U][G][kCols];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int H = p.H, B = p.B;
  const long long chunks = step_unit_chunks<kCell>(p);
  const int u0 = static_cast<int>(blockIdx.x % chunks) * U;
  const int b0 = static_cast<int>(blockIdx.x / chunks) * kCols;
  const int ncols = min(kCols, B - b0);
  const float* hin = kOneStep ? nullptr : hbuf + (s & 1) * static_cast<long long>(B) * H;
  float* hout = kOneStep ? nullptr : hbuf + ((s + 1) & 1) * static_cast<long long>(B) * H;
  auto h_at = [&](long long i) {
    if constexpr (kOneStep) return T::to_f(static_cast<const S*>(p.h0)[i]);
    else return hin[i];
  };
  const bool running = s < max_seq_len(p, b0, b0 + ncols);  // any column of the block
  // One-step calls of up to 4 columns gather without branches: each column's h by its own base
  // pointer, one wide multiply-add from the nonzero's column where (b0 + j) * H + column took
  // five instructions and reloads of H and h0, and a select instead of a predicate: ~12 SASS
  // instructions per gather became 7. One-step fp16 us per launch (session 84, step_kernel_probe
  // calls 1 and 6): B=1 LSTM H=4096 19.2 -> 16.6, ReLU H=5760 10.3 -> 8.2; B=4 about even (32.6
  // -> 32.4 and 33.7 -> 33.4; 17.2 -> 17.9 and 19.8 -> 18.1). With 8 columns the 8 pointers
  // spill or cost occupancy (B=8 53.7 -> 55.6, B=16 95.2 -> 105.1) and the loop steps were no
  // faster, so those keep the predicated gathers.
  constexpr bool kSelect = kCols <= kSelectCols;
  using HIn = pick_t<kOneStep, S, float>;  // h_{t-1}: the call's h0 or the workspace
  const HIn* hcol[kCols];  // the select's h_{t-1} of each column
  if constexpr (kSelect) {
    const HIn* hbase;
    if constexpr (kOneStep) hbase = static_cast<const S*>(p.h0);
    else hbase = hin;
#pragma unroll
    for (int j = 0; j < kCols; ++j)
      hcol[j] = hbase + static_cast<long long>(b0 + min(j, ncols - 1)) * H;
  }
  auto to_f = [](HIn v) {
    if constexpr (kOneStep) return T::to_f(v);
    else return v;
  };

  // Rows: warp w sums gate w % G of unit u0 + w / G for every column.
  if (const int u = u0 + warp / G; running && u < H) {
    float a[kCols];
#pragma unroll
    for (int j = 0; j < kCols; ++j) a[j] = 0.0f;
    const S* vals = static_cast<const S*>(p.values);
    const bool aligned = nonzeros_aligned<D, kVec>(vals, p.col_idx);
    const long long r = static_cast<long long>(u) * G + warp % G;
    const int k0 = __ldg(p.row_ptr + r), k1 = __ldg(p.row_ptr + r + 1);
    constexpr int kPass = 32 * kVec;
    for (int k = (k0 & -kVec) + lane * kVec; k < k1; k += kPass * kUnroll) {
      float w[kUnroll][kVec];
      int c[kUnroll][kVec];
#pragma unroll
      for (int q = 0; q < kUnroll; ++q)
        load_nonzeros<D, kVec>(vals, p.col_idx, aligned, k + q * kPass, k0, k1, w[q], c[q]);
#pragma unroll
      for (int q = 0; q < kUnroll; ++q) {
#pragma unroll
        for (int v = 0; v < kVec; ++v) {
          // A nonzero outside the row gathers column 0 and its sum is dropped by the select, not
          // by 0 * h (h may be inf). Columns past ncols repeat the last one, unused.
          const bool in = c[q][v] >= 0;
          const int col = in ? c[q][v] : 0;
#pragma unroll
          for (int j = 0; j < kCols; ++j) {
            if constexpr (kSelect) {
              const float sum = fmaf(w[q][v], to_f(hcol[j][col]), a[j]);
              a[j] = in ? sum : a[j];
            } else if (j < ncols && in) {
              a[j] = fmaf(w[q][v], h_at(static_cast<long long>(b0 + j) * H + col), a[j]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      if (j < ncols) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) a[j] += __shfl_xor_sync(0xffffffffu, a[j], off);
        if (lane == 0) sums[warp / G][warp % G][j] = a[j];
      }
    }
  }
  __syncthreads();

  // Updates: a thread per (unit, column).
  if (threadIdx.x >= U * kCols) return;
  const int j = threadIdx.x % kCols, u = u0 + threadIdx.x / kCols;
  if (j >= ncols || u >= H) return;
  const int b = b0 + j;
  float hw[G];
#pragma unroll
  for (int g = 0; g < G; ++g) hw[g] = sums[u - u0][g][j];
  const int len = seq_len(p, b);
  const long long bi = static_cast<long long>(b) * H + u;
  const float hprev = h_at(bi);
  if (s >= len) {  // (its sums were not computed where no column of the block runs)
    if constexpr (kOneStep) {  // a sequence of length 0 keeps its initial state, bit for bit
      static_cast<S*>(p.hT)[bi] = static_cast<const S*>(p.h0)[bi];
      if constexpr (kCell == Cell::kLstm)
        static_cast<S*>(p.cT)[bi] = static_cast<const S*>(p.c0)[bi];
    } else {
      hout[bi] = hprev;
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
    hnew = gru_step(x, hw, T::to_f(static_cast<const S*>(p.b_hn)[u]), hprev);
  } else {
    hnew = p.activation ? rnn_step<Cell::kRnnRelu>(x[0], hw[0]) : rnn_step<Cell::kRnnTanh>(x[0], hw[0]);
  }
  if constexpr (kOneStep) static_cast<S*>(p.hT)[bi] = T::from_f(hnew);
  else hout[bi] = hnew;
  static_cast<S*>(p.ys)[o] = T::from_f(hnew);
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
