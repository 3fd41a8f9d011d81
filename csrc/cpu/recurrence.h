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
#include "cpu/fast_math.h"
#include "cpu/float_convert.h"

namespace sprnn::cpu {

// ---- row kernels -----------------------------------------------------------------------------

// One nonzero as the row kernels read it: the weight and the offset col * B of its hidden unit
// in a batch-contiguous state (one stream instead of two, and no index multiply per nonzero).
struct Nz {
  float v;
  int32_t off;
};

#define SPRNN_CPU_INLINE inline __attribute__((always_inline))

// B floats as one GCC/Clang vector-extension value (kB a power of two): one B-wide
// multiply-add per nonzero, without relying on the auto-vectorizer (which, left alone,
// vectorizes these loops across nonzeros with shuffles instead of across the batch).
template <int kB>
struct BatchVec {
  typedef float type __attribute__((vector_size(kB * sizeof(float))));
  static SPRNN_CPU_INLINE type load(const float* p) {
    type v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static SPRNN_CPU_INLINE void store(float* p, type v) { std::memcpy(p, &v, sizeof(v)); }
};

// out[b] = sum_k v[k] * h[col[k] * B + b] over one packed row of n nonzeros.
template <int kB>
void row_gemv(const Nz* __restrict nz, int64_t n, const float* __restrict h, int B,
              float* __restrict out) {
  if constexpr (kB > 0) {
    using V = BatchVec<kB>;
    using vec = typename V::type;
    // Four independent accumulators hide the add latency of the dependent chain.
    vec a0 = {}, a1 = {}, a2 = {}, a3 = {};
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) {
      a0 += nz[k].v * V::load(h + nz[k].off);
      a1 += nz[k + 1].v * V::load(h + nz[k + 1].off);
      a2 += nz[k + 2].v * V::load(h + nz[k + 2].off);
      a3 += nz[k + 3].v * V::load(h + nz[k + 3].off);
    }
    for (; k < n; ++k) a0 += nz[k].v * V::load(h + nz[k].off);
    V::store(out, (a0 + a1) + (a2 + a3));
  } else {
    for (int b = 0; b < B; ++b) out[b] = 0.0f;
    for (int64_t k = 0; k < n; ++k) {
      const float* hk = h + nz[k].off;
      const float vk = nz[k].v;
      for (int b = 0; b < B; ++b) out[b] += vk * hk[b];
    }
  }
}

// Backward of one packed row with pre-activation gradient d[0..B):
//   dh_acc[col[k] * B + b] += v[k] * d[b]                       (transposed product, scatter)
//   dv[g * nnz + k] += sum_{b in group g} d[b] * hprev[col[k] * B + b]   (weight gradient)
// dv points at the row's first nonzero in group 0; batch row b belongs to group b / (B/groups).
template <int kB>
void row_bwd(const Nz* __restrict nz, int64_t n, const float* __restrict hprev,
             const float* __restrict d_in, int B, int groups, int64_t nnz,
             float* __restrict dh_acc, float* __restrict dv) {
  if constexpr (kB > 0) {
    using V = BatchVec<kB>;
    using vec = typename V::type;
    const vec d = V::load(d_in);
    const int per_group = kB / groups;
    for (int64_t k = 0; k < n; ++k) {
      float* da = dh_acc + nz[k].off;
      V::store(da, V::load(da) + nz[k].v * d);
      const vec p = d * V::load(hprev + nz[k].off);
      if (groups == 1) {
        float s = 0.0f;
        for (int b = 0; b < kB; ++b) s += p[b];
        dv[k] += s;
      } else {
        for (int g = 0; g < groups; ++g) {
          float s = 0.0f;
          for (int b = g * per_group; b < (g + 1) * per_group; ++b) s += p[b];
          dv[g * nnz + k] += s;
        }
      }
    }
  } else {
    const int per_group = B / groups;
    for (int64_t k = 0; k < n; ++k) {
      float* __restrict da = dh_acc + nz[k].off;
      const float* __restrict hp = hprev + nz[k].off;
      const float vk = nz[k].v;
      for (int b = 0; b < B; ++b) da[b] += vk * d_in[b];
      for (int g = 0; g < groups; ++g) {
        float s = 0.0f;
        for (int b = g * per_group; b < (g + 1) * per_group; ++b) s += d_in[b] * hp[b];
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

// The nonzeros as (value in float32, col * B) pairs.
template <typename S>
std::vector<Nz> pack_nonzeros(const S* values, const int32_t* col, int64_t nnz, int64_t B) {
  std::vector<Nz> nz(static_cast<size_t>(nnz));
  for (int64_t k = 0; k < nnz; ++k)
    nz[k] = Nz{to_float(values[k]), static_cast<int32_t>(col[k] * B)};
  return nz;
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

// Batch row b of a time step, row[g * H + u] (n gate blocks of H), into the gate-major,
// batch-contiguous step buffer dst[g * H * B + u * B + b]; and back.
template <typename S>
void gather_row(const S* row, int64_t n, int64_t H, int64_t B, int64_t b, float* dst) {
  for (int64_t g = 0; g < n; ++g)
    for (int64_t u = 0; u < H; ++u) dst[(g * H + u) * B + b] = to_float(row[g * H + u]);
}
inline void zero_row(int64_t n, int64_t H, int64_t B, int64_t b, float* dst) {
  for (int64_t i = 0; i < n * H; ++i) dst[i * B + b] = 0.0f;
}
template <typename S>
void scatter_row(const float* src, int64_t n, int64_t H, int64_t B, int64_t b, S* row) {
  for (int64_t g = 0; g < n; ++g)
    for (int64_t u = 0; u < H; ++u) row[g * H + u] = from_float<S>(src[(g * H + u) * B + b]);
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

// ---- the cell over a whole step -------------------------------------------------------------
// Flat loops over the H*B entries of a step; the per-gate inputs are gate-major blocks of HB.
// Separate functions with restrict parameters, so that GCC vectorizes them.

namespace detail {

template <Cell kCell>
void cell_forward(int64_t HB, const float* __restrict xs, const float* __restrict ps,
                  const float* __restrict hs, const float* __restrict bias,
                  const float* __restrict cs, float* __restrict hn, float* __restrict cn) {
  if constexpr (kCell == Cell::kLstm) {
    for (int64_t i = 0; i < HB; ++i) {
      float p[4];
      for (int g = 0; g < 4; ++g) p[g] = xs[g * HB + i] + ps[g * HB + i];
      float c = cs[i];
      hn[i] = lstm_step<FastMath>(p, c);
      cn[i] = c;
    }
  } else if constexpr (kCell == Cell::kGru) {
    for (int64_t i = 0; i < HB; ++i) {
      float xv[3], hw[3];
      for (int g = 0; g < 3; ++g) {
        xv[g] = xs[g * HB + i];
        hw[g] = ps[g * HB + i];
      }
      hn[i] = gru_step<FastMath>(xv, hw, bias[i], hs[i]);
    }
  } else {
    for (int64_t i = 0; i < HB; ++i) hn[i] = rnn_step<kCell, FastMath>(xs[i], ps[i]);
  }
}

// dp: gradient of the pre-activations (what goes through the weights), dxg: of xp (gru only;
// for rnn / lstm it equals dp), dhn: the direct part of dh_prev, dcn: dc_prev (lstm).
template <Cell kCell>
void cell_backward(int64_t HB, const float* __restrict xs, const float* __restrict hws,
                   const float* __restrict hp, const float* __restrict cp,
                   const float* __restrict bias, const float* __restrict ys,
                   const float* __restrict dhs, const float* __restrict dys,
                   const float* __restrict dcs, float* __restrict dp, float* __restrict dxg,
                   float* __restrict dhn, float* __restrict dcn) {
  if constexpr (kCell == Cell::kLstm) {
    for (int64_t i = 0; i < HB; ++i) {
      float p[4], g4[4];
      for (int g = 0; g < 4; ++g) p[g] = xs[g * HB + i] + hws[g * HB + i];
      dcn[i] = lstm_step_grad<FastMath>(p, cp[i], dhs[i] + dys[i], dcs[i], g4);
      for (int g = 0; g < 4; ++g) dp[g * HB + i] = g4[g];
      dhn[i] = 0.0f;
    }
  } else if constexpr (kCell == Cell::kGru) {
    for (int64_t i = 0; i < HB; ++i) {
      float xv[3], hv[3], dxv[3], dhw[3];
      for (int g = 0; g < 3; ++g) {
        xv[g] = xs[g * HB + i];
        hv[g] = hws[g * HB + i];
      }
      dhn[i] = gru_step_grad<FastMath>(xv, hv, bias[i], hp[i], dhs[i] + dys[i], dxv, dhw);
      for (int g = 0; g < 3; ++g) {
        dp[g * HB + i] = dhw[g];
        dxg[g * HB + i] = dxv[g];
      }
    }
  } else {
    for (int64_t i = 0; i < HB; ++i) {
      dp[i] = rnn_step_grad<kCell>(ys[i], dhs[i] + dys[i]);
      dhn[i] = 0.0f;
    }
  }
}

}  // namespace detail

// ---- forward -------------------------------------------------------------------------------
//
// Per step: gather xp_t into a gate-major batch-contiguous buffer x[g][u][b], run the sparse
// rows into pre[g][u][b], then apply the cell to all H*B entries in one flat loop (which the
// compiler vectorizes: the cell math is branch-free, see fast_math.h), and finally restore the
// state of batch rows that have no step here and write ys / cs.

template <typename S, Cell kCell>
void run_forward(const Dims& d, const Io<S>& io, bool reverse) {
  constexpr int G = gates_of(kCell);
  constexpr bool kLstm = kCell == Cell::kLstm;
  constexpr bool kGru = kCell == Cell::kGru;
  const int64_t T = d.T, B = d.B, H = d.H, GH = G * H, HB = H * B;
  const RowKernels kern = row_kernels(B);
  detail::StepPlan plan(io.lengths, B, T, reverse);
  const std::vector<Nz> nz = detail::pack_nonzeros(io.values, io.col_idx, d.nnz, B);
  const int32_t* rp = io.row_ptr;

  std::vector<float> h(HB), h_next(HB), x(G * HB), pre(G * HB), c, c_next, bias;
  detail::load_transposed(io.h0, B, H, h.data());
  if constexpr (kLstm) {
    c.resize(HB);
    c_next.resize(HB);
    detail::load_transposed(io.c0, B, H, c.data());
  }
  if constexpr (kGru) {
    bias.resize(HB);
    for (int64_t i = 0; i < HB; ++i) bias[i] = to_float(io.b_hn[i / B]);
  }
  detail::zero_invalid(io.ys_out, plan.len, T, B, H);
  if constexpr (kLstm) detail::zero_invalid(io.cs_out, plan.len, T, B, H);

  for (int64_t s = 0; s < plan.steps; ++s) {
    plan.at(s);
    for (int64_t b = 0; b < B; ++b) {
      if (plan.active[b]) {
        detail::gather_row(io.xp + (plan.t[b] * B + b) * GH, G, H, B, b, x.data());
      } else {
        detail::zero_row(G, H, B, b, x.data());
      }
    }
    for (int64_t u = 0; u < H; ++u) {
      for (int g = 0; g < G; ++g) {
        const int64_t r = u * G + g;
        kern.gemv(nz.data() + rp[r], rp[r + 1] - rp[r], h.data(), static_cast<int>(B),
                  pre.data() + g * HB + u * B);
      }
    }
    detail::cell_forward<kCell>(HB, x.data(), pre.data(), h.data(), kGru ? bias.data() : nullptr,
                                kLstm ? c.data() : nullptr, h_next.data(),
                                kLstm ? c_next.data() : nullptr);
    for (int64_t b = 0; b < B; ++b) {
      if (!plan.active[b]) {  // no step for this row: the state stays
        for (int64_t u = 0; u < H; ++u) h_next[u * B + b] = h[u * B + b];
        if constexpr (kLstm)
          for (int64_t u = 0; u < H; ++u) c_next[u * B + b] = c[u * B + b];
        continue;
      }
      const int64_t row = plan.t[b] * B + b;
      detail::scatter_row(h_next.data(), 1, H, B, b, io.ys_out + row * H);
      if constexpr (kLstm) detail::scatter_row(c_next.data(), 1, H, B, b, io.cs_out + row * H);
    }
    h.swap(h_next);
    if constexpr (kLstm) c.swap(c_next);
  }
  detail::store_transposed(h.data(), B, H, io.hT);
  if constexpr (kLstm) detail::store_transposed(c.data(), B, H, io.cT);
}

// ---- backward ------------------------------------------------------------------------------
//
// Reverse-time BPTT. Per step (latest first): gather the state before the step (h0 / c0 or the
// neighbouring ys / cs), xp_t and dys_t into batch-contiguous buffers; for lstm / gru recompute
// hw = h_prev W through the sparse rows; apply the cell's derivative to all H*B entries in one
// flat loop; then, per sparse row, scatter dpre back through the weights into dh_prev and
// accumulate the weight gradient.

template <typename S, Cell kCell>
void run_backward(const Dims& d, const Io<S>& io, bool reverse, int64_t groups) {
  constexpr int G = gates_of(kCell);
  constexpr bool kLstm = kCell == Cell::kLstm;
  constexpr bool kGru = kCell == Cell::kGru;
  constexpr bool kRecompute = kLstm || kGru;
  const int64_t T = d.T, B = d.B, H = d.H, GH = G * H, HB = H * B, nnz = d.nnz;
  const int64_t per_group = B / groups;
  const RowKernels kern = row_kernels(B);
  detail::StepPlan plan(io.lengths, B, T, reverse);
  const std::vector<Nz> nz = detail::pack_nonzeros(io.values, io.col_idx, nnz, B);
  const int32_t* rp = io.row_ptr;

  // dh / dc: gradient of the state after the current step (carried backwards in time).
  std::vector<float> dh(HB), dh_new(HB), dh_acc(HB), hprev(HB), dy(HB);
  std::vector<float> x(G * HB), hw, dpre(G * HB), dx_gru, y, dc, dc_new, cprev, bias, db_hn;
  std::vector<float> dv(static_cast<size_t>(groups * nnz), 0.0f);
  detail::load_transposed(io.dhT, B, H, dh.data());
  if constexpr (kRecompute) hw.resize(G * HB);
  if constexpr (kLstm) {
    dc.resize(HB);
    dc_new.resize(HB);
    cprev.resize(HB);
    detail::load_transposed(io.dcT, B, H, dc.data());
  }
  if constexpr (kGru) {
    dx_gru.resize(G * HB);
    bias.resize(HB);
    for (int64_t i = 0; i < HB; ++i) bias[i] = to_float(io.b_hn[i / B]);
    db_hn.assign(static_cast<size_t>(groups * H), 0.0f);
  }
  if constexpr (!kRecompute) y.resize(HB);
  detail::zero_invalid(io.dxp, plan.len, T, B, GH);

  for (int64_t s = plan.steps - 1; s >= 0; --s) {
    plan.at(s);
    for (int64_t b = 0; b < B; ++b) {
      if (!plan.active[b]) {
        detail::zero_row(1, H, B, b, hprev.data());
        detail::zero_row(G, H, B, b, x.data());
        detail::zero_row(1, H, B, b, dy.data());
        if constexpr (kLstm) detail::zero_row(1, H, B, b, cprev.data());
        if constexpr (!kRecompute) detail::zero_row(1, H, B, b, y.data());
        continue;
      }
      const int64_t row = plan.t[b] * B + b;
      const int64_t prev = (reverse ? plan.t[b] + 1 : plan.t[b] - 1) * B + b;
      detail::gather_row(s == 0 ? io.h0 + b * H : io.ys + prev * H, 1, H, B, b, hprev.data());
      if constexpr (kLstm)
        detail::gather_row(s == 0 ? io.c0 + b * H : io.cs + prev * H, 1, H, B, b, cprev.data());
      detail::gather_row(io.xp + row * GH, G, H, B, b, x.data());
      detail::gather_row(io.dys + row * H, 1, H, B, b, dy.data());
      if constexpr (!kRecompute) detail::gather_row(io.ys + row * H, 1, H, B, b, y.data());
    }
    if constexpr (kRecompute) {
      for (int64_t u = 0; u < H; ++u) {
        for (int g = 0; g < G; ++g) {
          const int64_t r = u * G + g;
          kern.gemv(nz.data() + rp[r], rp[r + 1] - rp[r], hprev.data(), static_cast<int>(B),
                    hw.data() + g * HB + u * B);
        }
      }
    }
    // The cell's derivative for every (u, b); dh_new gets the direct part of dh_prev.
    detail::cell_backward<kCell>(HB, x.data(), kRecompute ? hw.data() : nullptr, hprev.data(),
                                 kLstm ? cprev.data() : nullptr, kGru ? bias.data() : nullptr,
                                 kRecompute ? nullptr : y.data(), dh.data(), dy.data(),
                                 kLstm ? dc.data() : nullptr, dpre.data(),
                                 kGru ? dx_gru.data() : nullptr, dh_new.data(),
                                 kLstm ? dc_new.data() : nullptr);
    for (int64_t b = 0; b < B; ++b) {
      if (!plan.active[b]) {  // no step: no pre-activation gradient, dh / dc pass through
        detail::zero_row(G, H, B, b, dpre.data());
        for (int64_t u = 0; u < H; ++u) dh_new[u * B + b] = dh[u * B + b];
        if constexpr (kLstm)
          for (int64_t u = 0; u < H; ++u) dc_new[u * B + b] = dc[u * B + b];
        continue;
      }
      const int64_t row = plan.t[b] * B + b;
      detail::scatter_row(kGru ? dx_gru.data() : dpre.data(), G, H, B, b, io.dxp + row * GH);
      if constexpr (kGru) {
        float* dbg = db_hn.data() + (b / per_group) * H;
        for (int64_t u = 0; u < H; ++u) dbg[u] += dpre[2 * HB + u * B + b];
      }
    }
    std::fill(dh_acc.begin(), dh_acc.end(), 0.0f);
    for (int64_t u = 0; u < H; ++u) {
      for (int g = 0; g < G; ++g) {
        const float* dg = dpre.data() + g * HB + u * B;
        bool any = false;
        for (int64_t b = 0; b < B; ++b) any |= dg[b] != 0.0f;
        if (!any) continue;
        const int64_t r = u * G + g;
        kern.bwd(nz.data() + rp[r], rp[r + 1] - rp[r], hprev.data(), dg, static_cast<int>(B),
                 static_cast<int>(groups), nnz, dh_acc.data(), dv.data() + rp[r]);
      }
    }
    for (int64_t i = 0; i < HB; ++i) dh[i] = dh_new[i] + dh_acc[i];
    if constexpr (kLstm) dc.swap(dc_new);
  }

  detail::store_transposed(dh.data(), B, H, io.dh0);
  if constexpr (kLstm) detail::store_transposed(dc.data(), B, H, io.dc0);
  for (int64_t i = 0; i < groups * nnz; ++i) io.dvalues[i] = from_float<S>(dv[i]);
  if constexpr (kGru)
    for (int64_t i = 0; i < groups * H; ++i) io.db_hn[i] = from_float<S>(db_hn[i]);
}

}  // namespace sprnn::cpu
