// Cell equations shared by the CPU handlers and the CUDA kernels (Flax's cells exactly).
// Everything here is float32: callers load their storage dtype, compute, and store back.
#pragma once

#if !defined(__CUDACC_RTC__)  // NVRTC (the sm_70 check) has expf/tanhf built in, no <cmath>
#include <cmath>
#include <cstdint>
#endif

#if defined(__CUDACC__)
#define SPRNN_HD __host__ __device__ __forceinline__
#else
#define SPRNN_HD inline
#endif

namespace sprnn {

enum class Cell : int { kRnnTanh = 0, kRnnRelu = 1, kLstm = 2, kGru = 3 };

// Gates per hidden unit (G in the packed layout).
SPRNN_HD constexpr int gates_of(Cell cell) {
  return cell == Cell::kLstm ? 4 : (cell == Cell::kGru ? 3 : 1);
}

// The elementary functions of the cell math (exp, tanh, sigmoid). The default is the C library's (CUDA's own on
// the device); the CPU handlers pass a branch-free polynomial version that vectorizes.
struct LibmMath {
  static SPRNN_HD float exp(float x) { return expf(x); }
  static SPRNN_HD float tanh(float x) { return tanhf(x); }
  static SPRNN_HD float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
};

template <class M = LibmMath>
SPRNN_HD float sigmoid(float x) { return M::sigmoid(x); }

// rnn: h' = act(x + hw)
template <Cell kCell, class M = LibmMath>
SPRNN_HD float rnn_step(float x, float hw) {
  const float a = x + hw;
  if constexpr (kCell == Cell::kRnnRelu) {
    return !(a <= 0.0f) ? a : 0.0f;  // NaN stays NaN, as jax.nn.relu (and -0 becomes +0)
  } else {
    return M::tanh(a);
  }
}

// lstm: gate pre-activations (x + hw) in the order i, f, g, o; updates c and returns h'.
template <class M = LibmMath>
SPRNN_HD float lstm_step(const float pre[4], float& c) {
  const float i = sigmoid<M>(pre[0]);
  const float f = sigmoid<M>(pre[1]);
  const float g = M::tanh(pre[2]);
  const float o = sigmoid<M>(pre[3]);
  c = f * c + i * g;
  return o * M::tanh(c);
}

// gru: x and hw in the order r, z, n; returns h'.
template <class M = LibmMath>
SPRNN_HD float gru_step(const float x[3], const float hw[3], float b_hn, float h) {
  const float r = sigmoid<M>(x[0] + hw[0]);
  const float z = sigmoid<M>(x[1] + hw[1]);
  const float n = M::tanh(x[2] + r * (hw[2] + b_hn));
  return (1.0f - z) * n + z * h;
}

// ---- backward (derivatives of the steps above, float32) -------------------------------------

// rnn: gradient w.r.t. the pre-activation (x + hw) from the step's output y = act(x + hw) and
// the gradient dy of y. (relu'(0) = 0, as jax.nn.relu.)
template <Cell kCell>
SPRNN_HD float rnn_step_grad(float y, float dy) {
  if constexpr (kCell == Cell::kRnnRelu) {
    return y > 0.0f ? dy : 0.0f;
  } else {
    return dy * (1.0f - y * y);
  }
}

// lstm: pre = gate pre-activations (i, f, g, o) of the step, c = cell state before it,
// dh / dc = gradients of the step's outputs h' / c'. Writes the gradients of the four
// pre-activations to dpre and returns the gradient of c (the h input gets its gradient
// through the recurrent weights only: pre = x + h W).
template <class M = LibmMath>
SPRNN_HD float lstm_step_grad(const float pre[4], float c, float dh, float dc, float dpre[4]) {
  const float i = sigmoid<M>(pre[0]);
  const float f = sigmoid<M>(pre[1]);
  const float g = M::tanh(pre[2]);
  const float o = sigmoid<M>(pre[3]);
  const float c_new = f * c + i * g;
  const float tc = M::tanh(c_new);
  const float dc_total = dc + dh * o * (1.0f - tc * tc);
  dpre[0] = dc_total * g * i * (1.0f - i);
  dpre[1] = dc_total * c * f * (1.0f - f);
  dpre[2] = dc_total * i * (1.0f - g * g);
  dpre[3] = dh * tc * o * (1.0f - o);
  return dc_total * f;
}

// gru: x, hw (r, z, n), b_hn and h = state before the step; dh = gradient of h'. Writes the
// gradients of x (dx) and of hw (dhw; dhw[2] is also the gradient of b_hn) and returns the
// direct gradient of h (through z * h; the part through hw is added by the caller).
template <class M = LibmMath>
SPRNN_HD float gru_step_grad(const float x[3], const float hw[3], float b_hn, float h, float dh,
                             float dx[3], float dhw[3]) {
  const float r = sigmoid<M>(x[0] + hw[0]);
  const float z = sigmoid<M>(x[1] + hw[1]);
  const float hn = hw[2] + b_hn;
  const float n = M::tanh(x[2] + r * hn);
  const float dn = dh * (1.0f - z) * (1.0f - n * n);  // gradient of n's pre-activation
  const float dz = dh * (h - n) * z * (1.0f - z);
  const float dr = dn * hn * r * (1.0f - r);
  dx[0] = dr;
  dx[1] = dz;
  dx[2] = dn;
  dhw[0] = dr;
  dhw[1] = dz;
  dhw[2] = dn * r;
  return dh * z;
}

// Time index of the s-th step of a sequence of length len (s < len).
SPRNN_HD int step_time(int s, int len, bool reverse) { return reverse ? len - 1 - s : s; }

}  // namespace sprnn
