// Step 3 of the persistent kernel: the cell update of each (unit, sequence) pair from its row
// sums and input projection, and the outputs written after the last step.
#pragma once

#include "cuda/rows.cuh"

namespace sprnn {
namespace cuda {

// The cell math's exp, tanh and sigmoid (the `M` policy of common/cells.h) per storage type.
// The cell update is one warp's dependent chain on every step's critical path (every block's
// publish waits for it), so its activations' latency counts. For the 16-bit types:
// tanh.approx.f32 (one MUFU.TANH, sm_75+; relative error about 2^-11, at a 16-bit result's
// rounding) and sigmoid(x) = (1 + tanh(x / 2)) / 2, instead of exp-and-divide forms with two
// MUFU ops each: LSTM H=1024 2.31 -> 2.21 us/step, update 0.41 -> 0.33 us (step probe,
// benchmarks/NOTES.md, session 12). sm_70 has no tanh.approx and keeps the exp2 and reciprocal
// forms (about 1e-7 absolute error). float32: AccurateCellMath below.
struct FastCellMath {
  static __device__ __forceinline__ float exp(float x) { return __expf(x); }
  static __device__ __forceinline__ float tanh(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return __fdividef(2.0f, 1.0f + __expf(-2.0f * x)) - 1.0f;  // saturates to -1 / 1
#endif
  }
  static __device__ __forceinline__ float sigmoid(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    return fmaf(0.5f, tanh(0.5f * x), 0.5f);
#else
    return __fdividef(1.0f, 1.0f + __expf(-x));  // 0 once exp(-x) > 2^126
#endif
  }
};
// float32: CUDA's accurate expf / tanhf, and a sigmoid without the division's slow-path call
// (nvcc compiles 1.0f / y to MUFU.RCP plus a branch to a subroutine for denormal or huge y,
// which serialises the LSTM's three sigmoids). Here y = 1 + exp(-x) >= 1, clamped below 1e30
// (by a comparison, not fminf, which would turn NaN into 1e30), so the approximate reciprocal
// plus one Newton step is within about 1 ulp and never needs it.
struct AccurateCellMath {
  static __device__ __forceinline__ float exp(float x) { return expf(x); }
  static __device__ __forceinline__ float tanh(float x) { return tanhf(x); }
  static __device__ __forceinline__ float sigmoid(float x) {
    const float e = 1.0f + expf(-x);
    const float y = e > 1e30f ? 1e30f : e;
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
    return fmaf(r, fmaf(-y, r, 1.0f), r);
  }
};
template <DType D>
struct CellMathOf { using type = FastCellMath; };
template <>
struct CellMathOf<DType::kF32> { using type = AccurateCellMath; };
template <DType D>
using CellMath = typename CellMathOf<D>::type;

// Step 3 for one pair (unit u, sequence b, state index si) at step s (ps = pair_step): the cell
// from the row results hw[G] and the input projection (xr when have_x, as load_x_pair stored
// it, else loaded here), the ys/cs writes and the float32 state hst/cst[si]. Returns the new h
// (the previous one past the sequence's end).
template <Cell kCell, DType D>
__device__ __forceinline__ float update_pair(const Params& p, const PairStep& ps, int u, int b,
                                             int si, bool have_x, const typename Tr<D>::S* xr,
                                             const float* hw, float* hst, float* cst) {
  using T = Tr<D>;
  using S = typename T::S;
  constexpr int G = gates_of(kCell);
  S xs[G] = {};
  if (have_x) {
#pragma unroll
    for (int g = 0; g < G; ++g) xs[g] = xr[g];
  } else if (ps.valid) {
    load_x_pair<D, G>(p, ps, u, xs);
  }
  float x[G];
#pragma unroll
  for (int g = 0; g < G; ++g) x[g] = T::to_f(xs[g]);
  const float hprev = hst[si];
  float hnew = hprev;
  S* ys = static_cast<S*>(p.ys);
  S* cs = static_cast<S*>(p.cs);
  if (ps.valid) {
    if constexpr (kCell == Cell::kLstm) {
      float pre[4];
#pragma unroll
      for (int g = 0; g < 4; ++g) pre[g] = x[g] + hw[g];
      float c = cst[si];
      hnew = lstm_step<CellMath<D>>(pre, c);
      cst[si] = c;
      cs[ps.o] = T::from_f(c);
    } else if constexpr (kCell == Cell::kGru) {
      const float bh = T::to_f(static_cast<const S*>(p.b_hn)[u]);
      hnew = gru_step<CellMath<D>>(x, hw, bh, hprev);
    } else {
      // kRnnTanh builds take the activation at run time; kRnnRelu is ReLU's own build.
      hnew = kCell == Cell::kRnnRelu || p.activation ? rnn_step<Cell::kRnnRelu, CellMath<D>>(x[0], hw[0])
                                                     : rnn_step<Cell::kRnnTanh, CellMath<D>>(x[0], hw[0]);
    }
    hst[si] = hnew;
    ys[ps.o] = T::from_f(hnew);
  } else if (b < p.B) {  // padding position (padding columns b >= B write nothing)
    ys[ps.o] = T::from_f(0.0f);
    if constexpr (kCell == Cell::kLstm) cs[ps.o] = T::from_f(0.0f);
  }
  return hnew;
}

// After the step loop (callers barrier first: hst/cst were written by other threads): zero ys
// (and cs) at steps [lmax, T) of sequences [b_lo, b_hi) for the block's units, and write their
// final carry from the state (index ul * bpad + b - b_lo).
template <Cell kCell, DType D>
__device__ __forceinline__ void write_tail(const Params& p, int u0, int nu, int lmax, int b_lo,
                                           int b_hi, int bpad, const float* hst, const float* cst) {
  using T = Tr<D>;
  using S = typename T::S;
  const int B = p.B, H = p.H;
  const int nbs = b_hi - b_lo;
  S* ys = static_cast<S*>(p.ys);
  S* cs = static_cast<S*>(p.cs);
  const long long pad_n = static_cast<long long>(p.T - lmax) * nbs * nu;
  for (long long i = threadIdx.x; i < pad_n; i += blockDim.x) {
    const int ul = static_cast<int>(i % nu);
    const long long sb = i / nu;  // (s - lmax) * nbs + (b - b_lo)
    const long long s = lmax + sb / nbs;
    const int b = b_lo + static_cast<int>(sb % nbs);
    const long long o = (s * B + b) * H + u0 + ul;
    ys[o] = T::from_f(0.0f);
    if constexpr (kCell == Cell::kLstm) cs[o] = T::from_f(0.0f);
  }
  for (int i = threadIdx.x; i < nu * nbs; i += blockDim.x) {
    const int ul = i % nu, bl = i / nu;
    const long long o = static_cast<long long>(b_lo + bl) * H + u0 + ul;
    static_cast<S*>(p.hT)[o] = T::from_f(hst[ul * bpad + bl]);
    if constexpr (kCell == Cell::kLstm) static_cast<S*>(p.cT)[o] = T::from_f(cst[ul * bpad + bl]);
  }
}

}  // namespace cuda
}  // namespace sprnn
