// The per-step fallback kernels: one launch per step, for layers that do not fit on chip and
// GPUs that cannot run the cooperative grid.
#pragma once

#include "cuda/cell_update.cuh"

namespace sprnn {
namespace cuda {

// ---- fallback: one non-persistent launch per step ------------------------------------------
//
// For layers whose h tile and state do not fit in shared memory, or GPUs that cannot run the
// cooperative grid. One warp per (unit, b); h is double-buffered in float32 in the workspace.
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

// kOneStep: a call of one step (T = 1) as this single launch (handlers.cu): h_{-1} and c are
// read from the call's h0 and c0 and the new state is written to hT and cT, so it needs no
// workspace, no step_init / step_final and, having no wait, no sync check.
template <Cell kCell, DType D, bool kOneStep = false>
__global__ void step_fwd(Params p, int s, float* hbuf, float* cbuf) {
  using T = Tr<D>;
  using S = typename T::S;
  constexpr int G = gates_of(kCell);
  const int lane = threadIdx.x & 31;
  const long long wid = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) >> 5;
  const int H = p.H, B = p.B;
  if (wid >= static_cast<long long>(H) * B) return;
  const int u = static_cast<int>(wid % H);
  const int b = static_cast<int>(wid / H);
  const float* hin = kOneStep ? nullptr : hbuf + (s & 1) * static_cast<long long>(B) * H;
  float* hout = kOneStep ? nullptr : hbuf + ((s + 1) & 1) * static_cast<long long>(B) * H;
  auto h_at = [&](long long i) {
    if constexpr (kOneStep) return T::to_f(static_cast<const S*>(p.h0)[i]);
    else return hin[i];
  };
  const int len = seq_len(p, b);
  const long long bi = static_cast<long long>(b) * H + u;
  const float hprev = h_at(bi);
  if (s >= len) {
    if (lane == 0) {
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
    }
    return;
  }
  const S* vals = static_cast<const S*>(p.values);
  float hw[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const long long r = static_cast<long long>(u) * G + g;
    const int k0 = __ldg(p.row_ptr + r), k1 = __ldg(p.row_ptr + r + 1);
    float a = 0.0f;
    // Unrolled so that each lane has several column and h loads in flight: one at a time, a
    // long row waits a global round trip per nonzero (LSTM H=4096: ~13 per lane and gate).
#pragma unroll 4
    for (int k = k0 + lane; k < k1; k += 32)
      a = fmaf(T::to_f(vals[k]), h_at(static_cast<long long>(b) * H + __ldg(p.col_idx + k)), a);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
    hw[g] = a;
  }
  if (lane != 0) return;
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
