// CPU forward and backward recurrences over the packed sparse weights (docs/INTERFACE.md).
//
// Layout inside a call: the hidden state (and every per-unit float32 buffer) is stored
// batch-contiguous, state[u * B + b], so each nonzero of a row does one B-wide multiply-add
// on h[col * B .. col * B + B). The row kernels are specialised at compile time for small B
// (1, 2, 4, 8), which lets the compiler keep the B accumulators in one vector register.
// All math is float32; S is the storage type of the float buffers (float, bf16, f16).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/cells.h"
#include "cpu/float_convert.h"

namespace sprnn::cpu {

// ---- row kernels -----------------------------------------------------------------------------

// out[b] = sum_k v[k] * h[col[k] * B + b] over one packed row of n nonzeros.
template <int kB>
void row_gemv(const float* __restrict v, const int32_t* __restrict col, int64_t n,
              const float* __restrict h, int B, float* __restrict out) {
  if constexpr (kB > 0) {
    // Four independent accumulators hide the add latency of the dependent chain.
    float a0[kB] = {}, a1[kB] = {}, a2[kB] = {}, a3[kB] = {};
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) {
      const float* h0 = h + static_cast<int64_t>(col[k]) * kB;
      const float* h1 = h + static_cast<int64_t>(col[k + 1]) * kB;
      const float* h2 = h + static_cast<int64_t>(col[k + 2]) * kB;
      const float* h3 = h + static_cast<int64_t>(col[k + 3]) * kB;
      const float v0 = v[k], v1 = v[k + 1], v2 = v[k + 2], v3 = v[k + 3];
      for (int b = 0; b < kB; ++b) {
        a0[b] += v0 * h0[b];
        a1[b] += v1 * h1[b];
        a2[b] += v2 * h2[b];
        a3[b] += v3 * h3[b];
      }
    }
    for (; k < n; ++k) {
      const float* hk = h + static_cast<int64_t>(col[k]) * kB;
      for (int b = 0; b < kB; ++b) a0[b] += v[k] * hk[b];
    }
    for (int b = 0; b < kB; ++b) out[b] = (a0[b] + a1[b]) + (a2[b] + a3[b]);
  } else {
    for (int b = 0; b < B; ++b) out[b] = 0.0f;
    for (int64_t k = 0; k < n; ++k) {
      const float* hk = h + static_cast<int64_t>(col[k]) * B;
      const float vk = v[k];
      for (int b = 0; b < B; ++b) out[b] += vk * hk[b];
    }
  }
}

// Backward of one packed row with pre-activation gradient d[0..B):
//   dh_acc[col[k] * B + b] += v[k] * d[b]                       (transposed product, scatter)
//   dv[g * nnz + k] += sum_{b in group g} d[b] * hprev[col[k] * B + b]   (weight gradient)
// dv points at the row's first nonzero in group 0; batch row b belongs to group b / (B/groups).
template <int kB>
void row_bwd(const float* __restrict v, const int32_t* __restrict col, int64_t n,
             const float* __restrict hprev, const float* __restrict d_in, int B, int groups,
             int64_t nnz, float* __restrict dh_acc, float* __restrict dv) {
  constexpr int kBuf = kB > 0 ? kB : 1;
  const int nb = kB > 0 ? kB : B;
  float d_local[kBuf];
  const float* d = d_in;
  if constexpr (kB > 0) {
    for (int b = 0; b < kB; ++b) d_local[b] = d_in[b];
    d = d_local;
  }
  if (groups == 1) {
    for (int64_t k = 0; k < n; ++k) {
      const int64_t c = static_cast<int64_t>(col[k]) * nb;
      float* __restrict da = dh_acc + c;
      const float* __restrict hp = hprev + c;
      const float vk = v[k];
      float s = 0.0f;
      for (int b = 0; b < nb; ++b) {
        da[b] += vk * d[b];
        s += d[b] * hp[b];
      }
      dv[k] += s;
    }
  } else {
    const int per_group = nb / groups;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t c = static_cast<int64_t>(col[k]) * nb;
      float* __restrict da = dh_acc + c;
      const float* __restrict hp = hprev + c;
      const float vk = v[k];
      for (int b = 0; b < nb; ++b) da[b] += vk * d[b];
      for (int g = 0; g < groups; ++g) {
        float s = 0.0f;
        for (int b = g * per_group; b < (g + 1) * per_group; ++b) s += d[b] * hp[b];
        dv[g * nnz + k] += s;
      }
    }
  }
}

struct RowKernels {
  decltype(&row_gemv<0>) gemv;
  decltype(&row_bwd<0>) bwd;
};

inline RowKernels row_kernels(int64_t B) {
  switch (B) {
    case 1: return {&row_gemv<1>, &row_bwd<1>};
    case 2: return {&row_gemv<2>, &row_bwd<2>};
    case 4: return {&row_gemv<4>, &row_bwd<4>};
    case 8: return {&row_gemv<8>, &row_bwd<8>};
    default: return {&row_gemv<0>, &row_bwd<0>};
  }
}

// ---- call description ------------------------------------------------------------------------

struct Dims {
  int64_t T = 0, B = 0, H = 0, G = 1, nnz = 0;
};

// Buffers of one call; absent ones (by cell / direction) are null.
template <typename S>
struct Io {
  // inputs
  const S* xp = nullptr;
  const int32_t* lengths = nullptr;
  const S* values = nullptr;
  const int32_t* col_idx = nullptr;
  const int32_t* row_ptr = nullptr;
  const S* c0 = nullptr;
  const S* h0 = nullptr;
  const S* b_hn = nullptr;
  // forward outputs / backward residuals
  S* ys_out = nullptr;
  S* cs_out = nullptr;
  S* hT = nullptr;
  S* cT = nullptr;
  const S* ys = nullptr;
  const S* cs = nullptr;
  // backward cotangents and gradients
  const S* dys = nullptr;
  const S* dcT = nullptr;
  const S* dhT = nullptr;
  S* dxp = nullptr;
  S* dvalues = nullptr;
  S* dc0 = nullptr;
  S* dh0 = nullptr;
  S* db_hn = nullptr;
};

namespace detail {

template <typename S>
std::vector<float> to_float_vec(const S* p, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = to_float(p[i]);
  return out;
}

// values as float32: the buffer itself for f32, a converted copy otherwise.
template <typename S>
const float* float_values(const S* p, int64_t n, std::vector<float>& storage) {
  if constexpr (std::is_same_v<S, float>) {
    return p;
  } else {
    storage = to_float_vec(p, n);
    return storage.data();
  }
}

// (B, H) storage -> [H][B] float32.
template <typename S>
void load_transposed(const S* src, int64_t B, int64_t H, float* dst) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t u = 0; u < H; ++u) dst[u * B + b] = to_float(src[b * H + u]);
}

// [H][B] float32 -> (B, H) storage.
template <typename S>
void store_transposed(const float* src, int64_t B, int64_t H, S* dst) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t u = 0; u < H; ++u) dst[b * H + u] = from_float<S>(src[u * B + b]);
}

// Zeroes out[t, b, :] (row width w) for the invalid steps t >= len[b].
template <typename S>
void zero_invalid(S* out, const std::vector<int64_t>& len, int64_t T, int64_t B, int64_t w) {
  if (out == nullptr) return;
  const S zero = from_float<S>(0.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = len[b]; t < T; ++t) std::fill(out + (t * B + b) * w, out + (t * B + b + 1) * w, zero);
}

inline std::vector<int64_t> clamped_lengths(const int32_t* lengths, int64_t B, int64_t T) {
  std::vector<int64_t> len(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) len[b] = std::clamp<int64_t>(lengths[b], 0, T);
  return len;
}

// Per step s: which batch rows run and at which time index.
struct StepPlan {
  std::vector<int64_t> len;
  std::vector<char> active;
  std::vector<int64_t> t;
  int64_t steps = 0;
  bool reverse = false;

  StepPlan(const int32_t* lengths, int64_t B, int64_t T, bool rev)
      : len(clamped_lengths(lengths, B, T)), active(B), t(B), reverse(rev) {
    for (int64_t l : len) steps = std::max(steps, l);
  }
  void at(int64_t s) {
    for (size_t b = 0; b < len.size(); ++b) {
      active[b] = s < len[b];
      t[b] = active[b] ? step_time(static_cast<int>(s), static_cast<int>(len[b]), reverse) : 0;
    }
  }
};

}  // namespace detail

// ---- forward -------------------------------------------------------------------------------

template <typename S, Cell kCell>
void run_forward(const Dims& d, const Io<S>& io, bool reverse) {
  constexpr int G = gates_of(kCell);
  const int64_t T = d.T, B = d.B, H = d.H, GH = G * H;
  const RowKernels kern = row_kernels(B);
  detail::StepPlan plan(io.lengths, B, T, reverse);

  std::vector<float> values_storage;
  const float* vals = detail::float_values(io.values, d.nnz, values_storage);
  const int32_t* col = io.col_idx;
  const int32_t* rp = io.row_ptr;

  std::vector<float> h(H * B), h_next(H * B), c, b_hn, pre(G * B);
  detail::load_transposed(io.h0, B, H, h.data());
  if constexpr (kCell == Cell::kLstm) {
    c.resize(H * B);
    detail::load_transposed(io.c0, B, H, c.data());
  }
  if constexpr (kCell == Cell::kGru) b_hn = detail::to_float_vec(io.b_hn, H);

  detail::zero_invalid(io.ys_out, plan.len, T, B, H);
  if constexpr (kCell == Cell::kLstm) detail::zero_invalid(io.cs_out, plan.len, T, B, H);

  for (int64_t s = 0; s < plan.steps; ++s) {
    plan.at(s);
    for (int64_t u = 0; u < H; ++u) {
      for (int g = 0; g < G; ++g) {
        const int64_t r = u * G + g;
        kern.gemv(vals + rp[r], col + rp[r], rp[r + 1] - rp[r], h.data(), static_cast<int>(B),
                  pre.data() + g * B);
      }
      for (int64_t b = 0; b < B; ++b) {
        const int64_t ub = u * B + b;
        if (!plan.active[b]) {
          h_next[ub] = h[ub];
          continue;
        }
        const int64_t row = plan.t[b] * B + b;  // (t, b) row of xp / ys
        const S* x = io.xp + row * GH;
        float y;
        if constexpr (kCell == Cell::kLstm) {
          float p[4];
          for (int g = 0; g < 4; ++g) p[g] = to_float(x[g * H + u]) + pre[g * B + b];
          y = lstm_step(p, c[ub]);
          io.cs_out[row * H + u] = from_float<S>(c[ub]);
        } else if constexpr (kCell == Cell::kGru) {
          float xv[3], hw[3];
          for (int g = 0; g < 3; ++g) {
            xv[g] = to_float(x[g * H + u]);
            hw[g] = pre[g * B + b];
          }
          y = gru_step(xv, hw, b_hn[u], h[ub]);
        } else {
          y = rnn_step<kCell>(to_float(x[u]), pre[b]);
        }
        h_next[ub] = y;
        io.ys_out[row * H + u] = from_float<S>(y);
      }
    }
    h.swap(h_next);
  }
  detail::store_transposed(h.data(), B, H, io.hT);
  if constexpr (kCell == Cell::kLstm) detail::store_transposed(c.data(), B, H, io.cT);
}

// ---- backward ------------------------------------------------------------------------------

template <typename S, Cell kCell>
void run_backward(const Dims& d, const Io<S>& io, bool reverse, int64_t groups) {
  constexpr int G = gates_of(kCell);
  constexpr bool kRecompute = kCell == Cell::kLstm || kCell == Cell::kGru;
  const int64_t T = d.T, B = d.B, H = d.H, GH = G * H, nnz = d.nnz;
  const int64_t per_group = B / groups;
  const RowKernels kern = row_kernels(B);
  detail::StepPlan plan(io.lengths, B, T, reverse);

  std::vector<float> values_storage;
  const float* vals = detail::float_values(io.values, nnz, values_storage);
  const int32_t* col = io.col_idx;
  const int32_t* rp = io.row_ptr;

  // dh / dc: gradient of the state after the current step (carried backwards in time).
  std::vector<float> dh(H * B), dh_acc(H * B), hprev(H * B), dc, cprev, b_hn, db_hn;
  std::vector<float> hw(G * B), dpre(G * B);
  std::vector<float> dv(static_cast<size_t>(groups * nnz), 0.0f);
  detail::load_transposed(io.dhT, B, H, dh.data());
  if constexpr (kCell == Cell::kLstm) {
    dc.resize(H * B);
    cprev.resize(H * B);
    detail::load_transposed(io.dcT, B, H, dc.data());
  }
  if constexpr (kCell == Cell::kGru) {
    b_hn = detail::to_float_vec(io.b_hn, H);
    db_hn.assign(static_cast<size_t>(groups * H), 0.0f);
  }
  detail::zero_invalid(io.dxp, plan.len, T, B, GH);

  for (int64_t s = plan.steps - 1; s >= 0; --s) {
    plan.at(s);
    // State before the step: the initial carry at the first step, else the neighbour's output.
    for (int64_t b = 0; b < B; ++b) {
      if (!plan.active[b]) {
        for (int64_t u = 0; u < H; ++u) hprev[u * B + b] = 0.0f;
        continue;
      }
      const int64_t tp = reverse ? plan.t[b] + 1 : plan.t[b] - 1;
      const S* hsrc = s == 0 ? io.h0 + b * H : io.ys + (tp * B + b) * H;
      for (int64_t u = 0; u < H; ++u) hprev[u * B + b] = to_float(hsrc[u]);
      if constexpr (kCell == Cell::kLstm) {
        const S* csrc = s == 0 ? io.c0 + b * H : io.cs + (tp * B + b) * H;
        for (int64_t u = 0; u < H; ++u) cprev[u * B + b] = to_float(csrc[u]);
      }
    }
    std::fill(dh_acc.begin(), dh_acc.end(), 0.0f);

    for (int64_t u = 0; u < H; ++u) {
      if constexpr (kRecompute) {
        for (int g = 0; g < G; ++g) {
          const int64_t r = u * G + g;
          kern.gemv(vals + rp[r], col + rp[r], rp[r + 1] - rp[r], hprev.data(),
                    static_cast<int>(B), hw.data() + g * B);
        }
      }
      for (int64_t b = 0; b < B; ++b) {
        const int64_t ub = u * B + b;
        if (!plan.active[b]) {  // no step: dh / dc pass through unchanged
          for (int g = 0; g < G; ++g) dpre[g * B + b] = 0.0f;
          continue;
        }
        const int64_t row = plan.t[b] * B + b;
        const float dht = dh[ub] + to_float(io.dys[row * H + u]);
        S* dx = io.dxp + row * GH;
        if constexpr (kCell == Cell::kLstm) {
          const S* x = io.xp + row * GH;
          float p[4], dp[4];
          for (int g = 0; g < 4; ++g) p[g] = to_float(x[g * H + u]) + hw[g * B + b];
          dc[ub] = lstm_step_grad(p, cprev[ub], dht, dc[ub], dp);
          for (int g = 0; g < 4; ++g) {
            dpre[g * B + b] = dp[g];
            dx[g * H + u] = from_float<S>(dp[g]);
          }
          dh[ub] = 0.0f;
        } else if constexpr (kCell == Cell::kGru) {
          const S* x = io.xp + row * GH;
          float xv[3], hv[3], dxv[3], dhw[3];
          for (int g = 0; g < 3; ++g) {
            xv[g] = to_float(x[g * H + u]);
            hv[g] = hw[g * B + b];
          }
          dh[ub] = gru_step_grad(xv, hv, b_hn[u], hprev[ub], dht, dxv, dhw);
          for (int g = 0; g < 3; ++g) {
            dpre[g * B + b] = dhw[g];
            dx[g * H + u] = from_float<S>(dxv[g]);
          }
          db_hn[(b / per_group) * H + u] += dhw[2];
        } else {
          const float dp = rnn_step_grad<kCell>(to_float(io.ys[row * H + u]), dht);
          dpre[b] = dp;
          dx[u] = from_float<S>(dp);
          dh[ub] = 0.0f;
        }
      }
      for (int g = 0; g < G; ++g) {
        const float* dg = dpre.data() + g * B;
        bool any = false;
        for (int64_t b = 0; b < B; ++b) any |= dg[b] != 0.0f;
        if (!any) continue;
        const int64_t r = u * G + g;
        kern.bwd(vals + rp[r], col + rp[r], rp[r + 1] - rp[r], hprev.data(), dg,
                 static_cast<int>(B), static_cast<int>(groups), nnz, dh_acc.data(),
                 dv.data() + rp[r]);
      }
    }
    // dh now holds the direct terms (or the untouched gradient of inactive rows, whose
    // dh_acc entries are zero): add the part through the recurrent weights.
    for (int64_t i = 0; i < H * B; ++i) dh[i] += dh_acc[i];
  }

  detail::store_transposed(dh.data(), B, H, io.dh0);
  if constexpr (kCell == Cell::kLstm) detail::store_transposed(dc.data(), B, H, io.dc0);
  for (int64_t i = 0; i < groups * nnz; ++i) io.dvalues[i] = from_float<S>(dv[i]);
  if constexpr (kCell == Cell::kGru)
    for (int64_t i = 0; i < groups * H; ++i) io.db_hn[i] = from_float<S>(db_hn[i]);
}

}  // namespace sprnn::cpu
