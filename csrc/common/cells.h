// Cell equations shared by the CPU handlers and the CUDA kernels (Flax's cells exactly).
// Everything here is float32: callers load their storage dtype, compute, and store back.
#pragma once

#include <cmath>
#include <cstdint>

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

SPRNN_HD float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// rnn: h' = act(x + hw)
template <Cell kCell>
SPRNN_HD float rnn_step(float x, float hw) {
  const float a = x + hw;
  if constexpr (kCell == Cell::kRnnRelu) {
    return a > 0.0f ? a : 0.0f;
  } else {
    return tanhf(a);
  }
}

// lstm: gate pre-activations (x + hw) in the order i, f, g, o; updates c and returns h'.
SPRNN_HD float lstm_step(const float pre[4], float& c) {
  const float i = sigmoid(pre[0]);
  const float f = sigmoid(pre[1]);
  const float g = tanhf(pre[2]);
  const float o = sigmoid(pre[3]);
  c = f * c + i * g;
  return o * tanhf(c);
}

// gru: x and hw in the order r, z, n; returns h'.
SPRNN_HD float gru_step(const float x[3], const float hw[3], float b_hn, float h) {
  const float r = sigmoid(x[0] + hw[0]);
  const float z = sigmoid(x[1] + hw[1]);
  const float n = tanhf(x[2] + r * (hw[2] + b_hn));
  return (1.0f - z) * n + z * h;
}

// Time index of the s-th step of a sequence of length len (s < len).
SPRNN_HD int step_time(int s, int len, bool reverse) { return reverse ? len - 1 - s : s; }

}  // namespace sprnn
