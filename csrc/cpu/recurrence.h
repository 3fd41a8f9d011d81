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
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common/cells.h"
#include "cpu/fast_math.h"
#include "cpu/float_convert.h"
#include "cpu/nz_streams.h"
#include "cpu/rebalance.h"
#include "cpu/team.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

namespace sprnn::cpu {

// ---- row kernels -----------------------------------------------------------------------------

#define SPRNN_CPU_INLINE inline __attribute__((always_inline))

// (A B=8 vector is 32 bytes: without AVX, GCC warns that passing it by value would use a
// different ABI. These helpers are always inlined, so no ABI is involved.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

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
  static SPRNN_CPU_INLINE void store(float* p, const type& v) { std::memcpy(p, &v, sizeof(v)); }
};

// out[b * bs] = sum_k v[k] * h[off[k] + b], b < kC, over one packed row of n nonzeros: one
// kC-wide multiply-add per nonzero.
template <int kC>
SPRNN_CPU_INLINE void row_gemv_chunk(const float* __restrict v, const int32_t* __restrict off,
                                     int64_t n, const float* __restrict h,
                                     float* __restrict out, int64_t bs) {
  using V = BatchVec<kC>;
  using vec = typename V::type;
  // Four independent accumulators hide the add latency of the dependent chain.
  vec a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    a0 += v[k] * V::load(h + off[k]);
    a1 += v[k + 1] * V::load(h + off[k + 1]);
    a2 += v[k + 2] * V::load(h + off[k + 2]);
    a3 += v[k + 3] * V::load(h + off[k + 3]);
  }
  for (; k < n; ++k) a0 += v[k] * V::load(h + off[k]);
  const vec a = (a0 + a1) + (a2 + a3);
  if (bs == 1) {
    V::store(out, a);
  } else {
    for (int b = 0; b < kC; ++b) out[b * bs] = a[b];
  }
}

// out[b * bs] = sum_k v[k] * h[off[k] + b] over one packed row of n nonzeros. kB > 0: the batch
// is exactly kB; kB = 0: any B, in vector chunks of 8 and 4 columns plus a scalar tail.
template <int kB>
SPRNN_CPU_INLINE void row_gemv_body(const float* __restrict v, const int32_t* __restrict off,
                                    int64_t n, const float* __restrict h, int B,
                                    float* __restrict out, int64_t bs) {
  if constexpr (kB > 0) {
    row_gemv_chunk<kB>(v, off, n, h, out, bs);
  } else {
    int b0 = 0;
    for (; b0 + 8 <= B; b0 += 8) row_gemv_chunk<8>(v, off, n, h + b0, out + b0 * bs, bs);
    for (; b0 + 4 <= B; b0 += 4) row_gemv_chunk<4>(v, off, n, h + b0, out + b0 * bs, bs);
    for (int b = b0; b < B; ++b) out[b * bs] = 0.0f;
    for (int64_t k = 0; k < n && b0 < B; ++k) {
      const float* hk = h + off[k];
      const float vk = v[k];
      for (int b = b0; b < B; ++b) out[b * bs] += vk * hk[b];
    }
  }
}

// Backward of one packed row with pre-activation gradient d[0..B):
//   dh_acc[off[k] + b] += v[k] * d[b]                       (transposed product, scatter)
//   dv[g * nnz + k] += sum_{b in group g} d[b] * hprev[off[k] + b]   (weight gradient)
// dv points at the row's first nonzero in group 0; batch row b belongs to group b / (B/groups).
template <int kB>
SPRNN_CPU_INLINE void row_bwd_body(const float* __restrict v, const int32_t* __restrict off,
                                   int64_t n, const float* __restrict hprev,
                                   const float* __restrict d_in, int B, int groups, int64_t nnz,
                                   float* __restrict dh_acc, float* __restrict dv) {
  if constexpr (kB > 0) {
    using V = BatchVec<kB>;
    using vec = typename V::type;
    const vec d = V::load(d_in);
    const int per_group = kB / groups;
    for (int64_t k = 0; k < n; ++k) {
      float* da = dh_acc + off[k];
      V::store(da, V::load(da) + v[k] * d);
      const vec p = d * V::load(hprev + off[k]);
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
      float* __restrict da = dh_acc + off[k];
      const float* __restrict hp = hprev + off[k];
      const float vk = v[k];
      for (int b = 0; b < B; ++b) da[b] += vk * d_in[b];
      for (int g = 0; g < groups; ++g) {
        float s = 0.0f;
        for (int b = g * per_group; b < (g + 1) * per_group; ++b) s += d_in[b] * hp[b];
        dv[g * nnz + k] += s;
      }
    }
  }
}

// The rows of units [u0, u1): packed row r = u * G + g, batch row b goes to
// pre[g * o.gs + u * o.us + b * o.bs]. One call per thread and step (the row loop is inlined
// into the kernel it calls).
struct OutLayout {
  int64_t gs, us, bs;
};
// (G = 1 has a loop of its own: fewer live registers around the row kernel, ~5% faster.)
#define SPRNN_ROWS_LOOP(ROW)                                                                  \
  if (G == 1) {                                                                             \
    for (int64_t u = u0; u < u1; ++u)                                                       \
      ROW(v + rp[u], off + rp[u], rp[u + 1] - rp[u], h, B, pre + u * o.us, o.bs);           \
  } else {                                                                                  \
    for (int64_t u = u0; u < u1; ++u) {                                                     \
      for (int g = 0; g < G; ++g) {                                                         \
        const int64_t r = u * G + g;                                                        \
        const int32_t k0 = rp[r];                                                           \
        ROW(v + k0, off + k0, rp[r + 1] - k0, h, B, pre + g * o.gs + u * o.us, o.bs);       \
      }                                                                                     \
    }                                                                                       \
  }

// The row kernels as called: a baseline build (SSE2 on x86-64) and, on x86-64 with GCC or
// Clang, an AVX2+FMA build of the same code, picked at run time (broadcast-from-memory and
// fused multiply-add halve the instructions per nonzero). The package itself is compiled for
// the baseline, so it still runs on any x86-64.
#define SPRNN_ROW_KERNELS(SUFFIX, ATTR)                                                       \
  template <int kB>                                                                          \
  ATTR void rows_gemv##SUFFIX(const float* __restrict v, const int32_t* __restrict off,     \
                              const int32_t* __restrict rp, int64_t u0, int64_t u1, int G,  \
                              OutLayout o, const float* __restrict h, int B,                \
                              float* __restrict pre) {                                       \
    SPRNN_ROWS_LOOP(row_gemv_body<kB>)                                                       \
  }                                                                                          \
  template <int kB>                                                                          \
  ATTR void row_bwd##SUFFIX(const float* __restrict v, const int32_t* __restrict off,       \
                            int64_t n, const float* __restrict hprev,                        \
                            const float* __restrict d_in, int B, int groups, int64_t nnz,    \
                            float* __restrict dh_acc, float* __restrict dv) {                \
    row_bwd_body<kB>(v, off, n, hprev, d_in, B, groups, nnz, dh_acc, dv);                   \
  }

SPRNN_ROW_KERNELS(_base, )
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SPRNN_CPU_HAVE_AVX2_KERNELS 1
SPRNN_ROW_KERNELS(_avx2, __attribute__((target("avx2,fma"))))
#endif
#undef SPRNN_ROW_KERNELS

#if defined(SPRNN_CPU_HAVE_AVX2_KERNELS)
// B = 4 (one nonzero = 16 bytes of state), 8 nonzeros per step in four 256-bit multiply-adds.
// The lanes are [nonzero k: b0..b3 | nonzero k+1: b0..b3]: the two 16-byte state rows are one
// load and one insert-from-memory; the 8 weights are one load, spread by lane-crossing
// permutes into [v_k x4 | v_k+1 x4]; the offsets come two (int32) or four (uint16) per
// 64-bit load. Per 8 nonzeros: 8 state, 1 weight and 4 or 2 offset loads (Zen 4 does 3 loads
// per cycle; the front end ~6 instructions). The last, partial group of a row loads its
// weights masked (zeros past the row end) and masks the offsets to 0: those lanes add 0 * h[0].
// The streams have NzBuffers::kSlack entries after the last nonzero for the offset loads.
#define SPRNN_AVX2_BMI __attribute__((target("avx2,fma,bmi")))

// Keep-masks: kKeep<Off> + 8 - r has r all-ones entries, then zeros.
template <class Off>
alignas(32) inline const Off kKeep[16] = {Off(-1), Off(-1), Off(-1), Off(-1), Off(-1),
                                              Off(-1), Off(-1), Off(-1)};

SPRNN_AVX2_BMI SPRNN_CPU_INLINE uint64_t load_u64(const void* p) {
  uint64_t x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

SPRNN_AVX2_BMI SPRNN_CPU_INLINE __m256 pair_rows4(const float* h, uint64_t a, uint64_t b) {
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(h + a)), _mm_loadu_ps(h + b), 1);
}

// acc[i] += [v_2i x4 | v_2i+1 x4] * [h row of nonzero 2i | of 2i+1], i < 4 (spread[i] picks
// the weights). keep: null, or the offset keep-mask of a partial group.
template <class Off>
SPRNN_AVX2_BMI SPRNN_CPU_INLINE void step8_rows4(__m256 v, const float* h, const Off* o,
                                                  const Off* keep, const __m256i spread[4],
                                                  __m256 acc[4]) {
  uint64_t x[4];  // offsets of nonzeros 2i, 2i + 1
  uint64_t y[4];
  if constexpr (sizeof(Off) == 2) {
    for (int j = 0; j < 2; ++j) {
      uint64_t w = load_u64(o + 4 * j);
      if (keep != nullptr) w &= load_u64(keep + 4 * j);
      x[2 * j] = static_cast<uint16_t>(w);
      y[2 * j] = _bextr_u64(w, 16, 16);
      x[2 * j + 1] = _bextr_u64(w, 32, 16);
      y[2 * j + 1] = w >> 48;
    }
  } else {
    for (int i = 0; i < 4; ++i) {
      uint64_t w = load_u64(o + 2 * i);
      if (keep != nullptr) w &= load_u64(keep + 2 * i);
      x[i] = static_cast<uint32_t>(w);
      y[i] = w >> 32;
    }
  }
  for (int i = 0; i < 4; ++i)
    acc[i] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(v, spread[i]), pair_rows4(h, x[i], y[i]),
                             acc[i]);
}

template <class Off>
SPRNN_AVX2_BMI SPRNN_CPU_INLINE void row_gemv4_avx2(const float* __restrict v,
                                                     const Off* __restrict off, int64_t n,
                                                     const float* __restrict h, int,
                                                     float* __restrict out, int64_t bs) {
  const __m256i spread[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
                             _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                             _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5),
                             _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    step8_rows4<Off>(_mm256_loadu_ps(v + k), h, off + k, nullptr, spread, acc);
  if (k < n) {
    const int64_t r = 8 - (n - k);
    const __m256 m = _mm256_loadu_ps(reinterpret_cast<const float*>(kKeep<int32_t> + r));
    step8_rows4<Off>(_mm256_and_ps(_mm256_loadu_ps(v + k), m), h, off + k, kKeep<Off> + r,
                     spread, acc);
  }
  const __m256 s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  if (bs == 1) {
    _mm_storeu_ps(out, sum);
  } else {
    alignas(16) float t[4];
    _mm_store_ps(t, sum);
    for (int b = 0; b < 4; ++b) out[b * bs] = t[b];
  }
}

template <class Off>
SPRNN_AVX2_BMI void rows_gemv4_avx2(const float* __restrict v, const Off* __restrict off,
                                    const int32_t* __restrict rp, int64_t u0, int64_t u1, int G,
                                    OutLayout o, const float* __restrict h, int B,
                                    float* __restrict pre) {
  SPRNN_ROWS_LOOP(row_gemv4_avx2<Off>)
}
#undef SPRNN_AVX2_BMI

#endif
#undef SPRNN_ROWS_LOOP

// Instruction sets of the run-time dispatch. SPRNN_CPU_ISA=base forces the baseline build
// (read per call: the tests compare the builds in one process).
enum class Isa : int { kBase = 0, kAvx2 = 1 };

inline Isa cpu_isa() {
  if (const char* env = std::getenv("SPRNN_CPU_ISA"); env != nullptr && std::string_view(env) == "base")
    return Isa::kBase;
#if defined(SPRNN_CPU_HAVE_AVX2_KERNELS)
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("bmi");
  if (has) return Isa::kAvx2;
#endif
  return Isa::kBase;
}

// rows16: the same product over 16-bit offsets (NzBuffers narrow), where there is a kernel
// for them (B = 4, AVX2), else null.
template <class Off>
using RowsFn = void (*)(const float*, const Off*, const int32_t*, int64_t, int64_t, int,
                        OutLayout, const float*, int, float*);
struct RowKernels {
  RowsFn<int32_t> rows;
  decltype(&row_bwd_base<0>) bwd;
  Isa isa = Isa::kBase;
  RowsFn<uint16_t> rows16 = nullptr;
  // Whether to widen float16 weights with F16C (float_convert.h): every AVX2 CPU has it.
  bool f16c() const { return isa == Isa::kAvx2; }
};

template <int kB>
RowKernels row_kernels_for(Isa isa) {
#if defined(SPRNN_CPU_HAVE_AVX2_KERNELS)
  if constexpr (kB == 4) {
    if (isa == Isa::kAvx2)
      return {&rows_gemv4_avx2<int32_t>, &row_bwd_avx2<kB>, isa, &rows_gemv4_avx2<uint16_t>};
  }
  if (isa >= Isa::kAvx2) return {&rows_gemv_avx2<kB>, &row_bwd_avx2<kB>, isa};
#endif
  return {&rows_gemv_base<kB>, &row_bwd_base<kB>, isa};
}

inline RowKernels row_kernels(int64_t B) {
  const Isa isa = cpu_isa();
  switch (B) {
    case 1: return row_kernels_for<1>(isa);
    case 2: return row_kernels_for<2>(isa);
    case 4: return row_kernels_for<4>(isa);
    case 8: return row_kernels_for<8>(isa);
    default: return row_kernels_for<0>(isa);
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

// Units [u0, u1) of batch row b of a time step, row[g * H + u] (n gate blocks of H), into the
// gate-major, batch-contiguous step buffer dst[(g * H + u) * B + b]; and back.
template <typename S>
void gather_row(const S* row, int64_t n, int64_t H, int64_t B, int64_t b, int64_t u0,
                int64_t u1, float* dst) {
  for (int64_t g = 0; g < n; ++g)
    for (int64_t u = u0; u < u1; ++u) dst[(g * H + u) * B + b] = to_float(row[g * H + u]);
}
inline void zero_row(int64_t n, int64_t H, int64_t B, int64_t b, int64_t u0, int64_t u1,
                     float* dst) {
  for (int64_t g = 0; g < n; ++g)
    for (int64_t u = u0; u < u1; ++u) dst[(g * H + u) * B + b] = 0.0f;
}
template <typename S>
void scatter_row(const float* src, int64_t n, int64_t H, int64_t B, int64_t b, int64_t u0,
                 int64_t u1, S* row) {
  for (int64_t g = 0; g < n; ++g)
    for (int64_t u = u0; u < u1; ++u) row[g * H + u] = from_float<S>(src[(g * H + u) * B + b]);
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
// Flat loops over n entries (u, b) of a step; the per-gate inputs are gate-major blocks, HB
// floats apart.
// Separate functions with restrict parameters, so that GCC vectorizes them.

namespace detail {

template <Cell kCell>
SPRNN_CPU_INLINE void cell_forward_body(int64_t n, int64_t xst, int64_t pst, const float* __restrict xs, const float* __restrict ps,
                  const float* __restrict hs, const float* __restrict bias,
                  const float* __restrict cs, float* __restrict hn, float* __restrict cn) {
  if constexpr (kCell == Cell::kLstm) {
    for (int64_t i = 0; i < n; ++i) {
      float p[4];
      for (int g = 0; g < 4; ++g) p[g] = xs[g * xst + i] + ps[g * pst + i];
      float c = cs[i];
      hn[i] = lstm_step<FastMath>(p, c);
      cn[i] = c;
    }
  } else if constexpr (kCell == Cell::kGru) {
    for (int64_t i = 0; i < n; ++i) {
      float xv[3], hw[3];
      for (int g = 0; g < 3; ++g) {
        xv[g] = xs[g * xst + i];
        hw[g] = ps[g * pst + i];
      }
      hn[i] = gru_step<FastMath>(xv, hw, bias[i], hs[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) hn[i] = rnn_step<kCell, FastMath>(xs[i], ps[i]);
  }
}

// dp: gradient of the pre-activations (what goes through the weights), dxg: of xp (gru only;
// for rnn / lstm it equals dp), dhn: the direct part of dh_prev, dcn: dc_prev (lstm).
template <Cell kCell>
SPRNN_CPU_INLINE void cell_backward_body(int64_t n, int64_t HB, const float* __restrict xs, const float* __restrict hws,
                   const float* __restrict hp, const float* __restrict cp,
                   const float* __restrict bias, const float* __restrict ys,
                   const float* __restrict dhs, const float* __restrict dys,
                   const float* __restrict dcs, float* __restrict dp, float* __restrict dxg,
                   float* __restrict dhn, float* __restrict dcn) {
  if constexpr (kCell == Cell::kLstm) {
    for (int64_t i = 0; i < n; ++i) {
      float p[4], g4[4];
      for (int g = 0; g < 4; ++g) p[g] = xs[g * HB + i] + hws[g * HB + i];
      dcn[i] = lstm_step_grad<FastMath>(p, cp[i], dhs[i] + dys[i], dcs[i], g4);
      for (int g = 0; g < 4; ++g) dp[g * HB + i] = g4[g];
      dhn[i] = 0.0f;
    }
  } else if constexpr (kCell == Cell::kGru) {
    for (int64_t i = 0; i < n; ++i) {
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
    for (int64_t i = 0; i < n; ++i) {
      dp[i] = rnn_step_grad<kCell>(ys[i], dhs[i] + dys[i]);
      dhn[i] = 0.0f;
    }
  }
}

// As the row kernels: a baseline and an AVX2+FMA build (8 lanes for the exp / tanh
// polynomials), picked at run time.
#define SPRNN_CELL_PASSES(SUFFIX, ATTR)                                                        \
  template <Cell kCell, class... A>                                                           \
  ATTR void cell_forward##SUFFIX(A... a) {                                                    \
    cell_forward_body<kCell>(a...);                                                           \
  }                                                                                           \
  template <Cell kCell, class... A>                                                           \
  ATTR void cell_backward##SUFFIX(A... a) {                                                   \
    cell_backward_body<kCell>(a...);                                                          \
  }
SPRNN_CELL_PASSES(_base, )
#if defined(SPRNN_CPU_HAVE_AVX2_KERNELS)
SPRNN_CELL_PASSES(_avx2, __attribute__((target("avx2,fma"))))
#endif
#undef SPRNN_CELL_PASSES

template <Cell kCell, class... A>
void cell_forward([[maybe_unused]] Isa isa, A... a) {
#if defined(SPRNN_CPU_HAVE_AVX2_KERNELS)
  if (isa >= Isa::kAvx2) return cell_forward_avx2<kCell>(a...);
#endif
  cell_forward_base<kCell>(a...);
}

template <Cell kCell, class... A>
void cell_backward([[maybe_unused]] Isa isa, A... a) {
#if defined(SPRNN_CPU_HAVE_AVX2_KERNELS)
  if (isa >= Isa::kAvx2) return cell_backward_avx2<kCell>(a...);
#endif
  cell_backward_base<kCell>(a...);
}

}  // namespace detail

// ---- forward -------------------------------------------------------------------------------
//
// Per step and thread (units [u0, u1)): the sparse rows read the whole unit-major state
// h[u * B + b] and write their pre-activations batch-major, pre[(g * B + b) * H + u] (the row
// kernel stores its B results with a stride). The cell then runs per batch row on contiguous
// spans: xp_t straight from the input (no gather), the old c (and h for gru) and the new
// state batch-major, hb[b * H + u], which is also the layout of ys / cs / hT / cT (no scatter);
// float32 outputs are written by a plain conversion loop. Last, the new state is transposed
// into the unit-major h of the next step (4x4 blocks for B = 4). Batch rows with no step here
// keep their state. The next step needs all units (barrier).

namespace detail {

// src[b * H + u] -> dst[u * B + b] for u in [u0, u1).
inline void to_unit_major(const float* __restrict src, int64_t B, int64_t H, int64_t u0,
                          int64_t u1, float* __restrict dst) {
  int64_t u = u0;
#if defined(__SSE2__)
  if (B == 4) {
    for (; u + 4 <= u1; u += 4) {
      __m128 r0 = _mm_loadu_ps(src + u), r1 = _mm_loadu_ps(src + H + u);
      __m128 r2 = _mm_loadu_ps(src + 2 * H + u), r3 = _mm_loadu_ps(src + 3 * H + u);
      _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
      _mm_storeu_ps(dst + u * 4, r0);
      _mm_storeu_ps(dst + u * 4 + 4, r1);
      _mm_storeu_ps(dst + u * 4 + 8, r2);
      _mm_storeu_ps(dst + u * 4 + 12, r3);
    }
  }
#endif
  for (; u < u1; ++u)
    for (int64_t b = 0; b < B; ++b) dst[u * B + b] = src[b * H + u];
}

// Prefetches the cache lines of p[0 .. n) (kWrite: for writing).
template <int kWrite, typename S>
void prefetch_span(const S* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(S));
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, kWrite);
}

template <typename S>
void store_span(const float* __restrict src, int64_t n, S* __restrict dst) {
  if constexpr (std::is_same_v<S, float>) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = from_float<S>(src[i]);
  }
}

}  // namespace detail

template <typename S, Cell kCell>
void run_forward(const Dims& d, const Io<S>& io, bool reverse) {
  constexpr int G = gates_of(kCell);
  constexpr bool kLstm = kCell == Cell::kLstm;
  constexpr bool kGru = kCell == Cell::kGru;
  constexpr bool kF32 = std::is_same_v<S, float>;
  const int64_t T = d.T, B = d.B, H = d.H, GH = G * H, HB = H * B;
  const RowKernels kern = row_kernels(B);
  const detail::StepPlan plan0(io.lengths, B, T, reverse);
  const int want = plan0.steps > 0 ? choose_threads(d.nnz * B, H) : 1;
  if (want > 1) HelperPool::instance().prewake();  // they wake while we set up
  const bool narrow = kern.rows16 != nullptr && HB <= 65536;  // every col * B fits 16 bits
  NzBuffers nz(d.nnz, narrow);
  const int32_t* rp = io.row_ptr;

  // h: unit-major state for the rows, double-buffered (step s reads h[s % 2], writes the
  // other). hb: the new state batch-major (gru: double-buffered, its cell reads the old one).
  // c (lstm): batch-major, double-buffered. xf: xp_t in float32 (narrow dtypes only).
  std::vector<float> h[2] = {std::vector<float>(HB), std::vector<float>(HB)};
  std::vector<float> hb[2], c[2], pre(G * HB), xf, bias;
  detail::load_transposed(io.h0, B, H, h[0].data());
  hb[0] = detail::to_float_vec(io.h0, HB);
  if constexpr (kGru) {
    hb[1].resize(HB);
    bias = detail::to_float_vec(io.b_hn, H);
  }
  if constexpr (kLstm) {
    c[0] = detail::to_float_vec(io.c0, HB);
    c[1].resize(HB);
  }
  if constexpr (!kF32) xf.resize(G * HB);
  detail::zero_invalid(io.ys_out, plan0.len, T, B, H);
  if constexpr (kLstm) detail::zero_invalid(io.cs_out, plan0.len, T, B, H);

  SoloSwitch solo(want);
  std::vector<int64_t> window_ns(want, 0);
  // The caller packs the nonzeros of its first unit range while the helpers wake up; each
  // thread packs the rest of its own range (alone: everything else) before the first barrier,
  // so ahead of any SoloSwitch takeover.
  const int64_t k_early = want > 1 ? rp[split_units(rp, G, H, want)[1] * G] : 0;
  auto pack_early = [&] { nz.pack(io.values, io.col_idx, 0, k_early, B, kern.f16c()); };
  run_team(want, [&](int tid, int nthreads, SpinBarrier& barrier) {
    Rebalancer split(rp, G, H, nthreads, window_ns.data());
    int64_t u0 = split.begin(tid), u1 = split.end(tid), n = u1 - u0;
    nz.pack(io.values, io.col_idx, tid == 0 ? k_early : rp[u0 * G], rp[u1 * G], B, kern.f16c());
    bool alone = nthreads == 1;
    int64_t worked = 0, waited = 0, t0 = alone ? 0 : SoloSwitch::now_ns();
    detail::StepPlan plan = plan0;
    for (int64_t s = 0; s < plan.steps; ++s) {
      plan.at(s);
      const int cur = static_cast<int>(s % 2), nxt = 1 - cur;
      const float* hc = h[cur].data();
      float* hn = h[nxt].data();
      float* hbn = hb[kGru ? nxt : 0].data();
      // The cell below reads xp_t and writes ys_t (and cs_t), fresh lines from L3 or memory
      // each step: start fetching them now, behind the rows.
      for (int64_t b = 0; b < B; ++b) {
        if (!plan.active[b]) continue;
        const int64_t row = plan.t[b] * B + b;
        for (int g = 0; g < G; ++g) detail::prefetch_span<0>(io.xp + row * GH + g * H + u0, n);
        detail::prefetch_span<1>(io.ys_out + row * H + u0, n);
        if constexpr (kLstm) detail::prefetch_span<1>(io.cs_out + row * H + u0, n);
      }
      const OutLayout lay{B * H, 1, H};
      if (narrow) {
        kern.rows16(nz.v(), nz.off16(), rp, u0, u1, G, lay, hc, static_cast<int>(B), pre.data());
      } else {
        kern.rows(nz.v(), nz.off(), rp, u0, u1, G, lay, hc, static_cast<int>(B), pre.data());
      }
      for (int64_t b = 0; b < B; ++b) {
        float* hnb = hbn + b * H;
        float* cnb = kLstm ? c[nxt].data() + b * H : nullptr;
        const float* ccb = kLstm ? c[cur].data() + b * H : nullptr;
        if (!plan.active[b]) {  // no step for this row: the state stays
          for (int64_t u = u0; u < u1; ++u) hnb[u] = hc[u * B + b];
          if constexpr (kLstm) std::copy(ccb + u0, ccb + u1, cnb + u0);
          continue;
        }
        const int64_t row = plan.t[b] * B + b;
        const float* xs;
        if constexpr (kF32) {
          xs = io.xp + row * GH;
        } else {
          float* xb = xf.data() + b * GH;
          for (int g = 0; g < G; ++g)
            for (int64_t u = u0; u < u1; ++u) xb[g * H + u] = to_float(io.xp[row * GH + g * H + u]);
          xs = xb;
        }
        detail::cell_forward<kCell>(kern.isa, n, H, B * H, xs + u0, pre.data() + b * H + u0,
                                    kGru ? hb[cur].data() + b * H + u0 : nullptr,
                                    kGru ? bias.data() + u0 : nullptr,
                                    kLstm ? ccb + u0 : nullptr, hnb + u0,
                                    kLstm ? cnb + u0 : nullptr);
        detail::store_span(hnb + u0, n, io.ys_out + row * H + u0);
        if constexpr (kLstm) detail::store_span(cnb + u0, n, io.cs_out + row * H + u0);
      }
      detail::to_unit_major(hbn, B, H, u0, u1, hn);
      if (alone) continue;
      const int64_t t1 = SoloSwitch::now_ns();
      worked += t1 - t0;
      split.record(tid, s, t1 - t0);
      solo.maybe_request(s, tid, worked, waited);
      barrier.wait();
      t0 = SoloSwitch::now_ns();
      if (s > 0) waited += t0 - t1;  // the first wait includes the threads' start-up
      if (split.after_barrier(s)) {
        u0 = split.begin(tid);
        u1 = split.end(tid);
        n = u1 - u0;
      }
      if (const int owner = solo.owner_after(s); owner >= 0) {
        if (owner != tid) return;
        alone = true;
        u0 = 0;
        u1 = H;
        n = H;
      }
    }
  }, pack_early);
  const int last = static_cast<int>(plan0.steps % 2);
  detail::store_span(hb[kGru ? last : 0].data(), HB, io.hT);
  if constexpr (kLstm) detail::store_span(c[last].data(), HB, io.cT);
}

// ---- backward ------------------------------------------------------------------------------
//
// Reverse-time BPTT. Per step (latest first): gather the state before the step (h0 / c0 or the
// neighbouring ys / cs), xp_t and dys_t into batch-contiguous buffers; for lstm / gru recompute
// hw = h_prev W through the sparse rows; apply the cell's derivative in one flat loop; then,
// per sparse row, scatter dpre back through the weights into dh_prev and accumulate the weight
// gradient. Threads own unit ranges (and so the rows, weight gradients and db_hn entries of
// those units); each scatters into its own dh accumulator, summed after a barrier.

template <typename S, Cell kCell>
void run_backward(const Dims& d, const Io<S>& io, bool reverse, int64_t groups) {
  constexpr int G = gates_of(kCell);
  constexpr bool kLstm = kCell == Cell::kLstm;
  constexpr bool kGru = kCell == Cell::kGru;
  constexpr bool kRecompute = kLstm || kGru;
  const int64_t T = d.T, B = d.B, H = d.H, GH = G * H, HB = H * B, nnz = d.nnz;
  const int64_t per_group = B / groups;
  const RowKernels kern = row_kernels(B);
  const detail::StepPlan plan0(io.lengths, B, T, reverse);
  NzBuffers nz(nnz, false);
  const int32_t* rp = io.row_ptr;

  // dh / dc: gradient of the state after the current step (carried backwards in time).
  std::vector<float> dh(HB), dh_new(HB), hprev(HB), dy(HB);
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
  detail::zero_invalid(io.dxp, plan0.len, T, B, GH);

  const int want = plan0.steps > 0 ? choose_threads(nnz * B, H) : 1;
  std::vector<std::vector<float>> dh_acc(want, std::vector<float>(HB));
  run_team(want, [&](int tid, int nthreads, SpinBarrier& barrier) {
    const std::vector<int64_t> split = split_units(rp, G, H, nthreads);
    const int64_t u0 = split[tid], u1 = split[tid + 1];
    const int64_t i0 = u0 * B, i1 = u1 * B, n = i1 - i0;
    nz.pack(io.values, io.col_idx, rp[u0 * G], rp[u1 * G], B, kern.f16c());  // these units' rows
    float* acc = dh_acc[tid].data();
    detail::StepPlan plan = plan0;
    for (int64_t s = plan.steps - 1; s >= 0; --s) {
      plan.at(s);
      for (int64_t b = 0; b < B; ++b) {
        if (!plan.active[b]) {
          detail::zero_row(1, H, B, b, u0, u1, hprev.data());
          detail::zero_row(G, H, B, b, u0, u1, x.data());
          detail::zero_row(1, H, B, b, u0, u1, dy.data());
          if constexpr (kLstm) detail::zero_row(1, H, B, b, u0, u1, cprev.data());
          if constexpr (!kRecompute) detail::zero_row(1, H, B, b, u0, u1, y.data());
          continue;
        }
        const int64_t row = plan.t[b] * B + b;
        const int64_t prev = (reverse ? plan.t[b] + 1 : plan.t[b] - 1) * B + b;
        detail::gather_row(s == 0 ? io.h0 + b * H : io.ys + prev * H, 1, H, B, b, u0, u1,
                           hprev.data());
        if constexpr (kLstm)
          detail::gather_row(s == 0 ? io.c0 + b * H : io.cs + prev * H, 1, H, B, b, u0, u1,
                             cprev.data());
        detail::gather_row(io.xp + row * GH, G, H, B, b, u0, u1, x.data());
        detail::gather_row(io.dys + row * H, 1, H, B, b, u0, u1, dy.data());
        if constexpr (!kRecompute)
          detail::gather_row(io.ys + row * H, 1, H, B, b, u0, u1, y.data());
      }
      barrier.wait();  // hprev complete: the rows below read all of it
      if constexpr (kRecompute) {
        kern.rows(nz.v(), nz.off(), rp, u0, u1, G, OutLayout{HB, B, 1}, hprev.data(),
                  static_cast<int>(B), hw.data());
      }
      // The cell's derivative; dh_new gets the direct part of dh_prev.
      detail::cell_backward<kCell>(
          kern.isa, n, HB, x.data() + i0, kRecompute ? hw.data() + i0 : nullptr, hprev.data() + i0,
          kLstm ? cprev.data() + i0 : nullptr, kGru ? bias.data() + i0 : nullptr,
          kRecompute ? nullptr : y.data() + i0, dh.data() + i0, dy.data() + i0,
          kLstm ? dc.data() + i0 : nullptr, dpre.data() + i0, kGru ? dx_gru.data() + i0 : nullptr,
          dh_new.data() + i0, kLstm ? dc_new.data() + i0 : nullptr);
      for (int64_t b = 0; b < B; ++b) {
        if (!plan.active[b]) {  // no step: no pre-activation gradient, dh / dc pass through
          detail::zero_row(G, H, B, b, u0, u1, dpre.data());
          for (int64_t u = u0; u < u1; ++u) dh_new[u * B + b] = dh[u * B + b];
          if constexpr (kLstm)
            for (int64_t u = u0; u < u1; ++u) dc_new[u * B + b] = dc[u * B + b];
          continue;
        }
        const int64_t row = plan.t[b] * B + b;
        detail::scatter_row(kGru ? dx_gru.data() : dpre.data(), G, H, B, b, u0, u1,
                            io.dxp + row * GH);
        if constexpr (kGru) {
          float* dbg = db_hn.data() + (b / per_group) * H;
          for (int64_t u = u0; u < u1; ++u) dbg[u] += dpre[2 * HB + u * B + b];
        }
      }
      if constexpr (kLstm) std::copy(dc_new.begin() + i0, dc_new.begin() + i1, dc.begin() + i0);
      std::fill(acc, acc + HB, 0.0f);
      for (int64_t u = u0; u < u1; ++u) {
        for (int g = 0; g < G; ++g) {
          const float* dg = dpre.data() + g * HB + u * B;
          bool any = false;
          for (int64_t b = 0; b < B; ++b) any |= dg[b] != 0.0f;
          if (!any) continue;
          const int64_t r = u * G + g;
          kern.bwd(nz.v() + rp[r], nz.off() + rp[r], rp[r + 1] - rp[r],
                   hprev.data(), dg, static_cast<int>(B), static_cast<int>(groups), nnz, acc,
                   dv.data() + rp[r]);
        }
      }
      barrier.wait();  // all accumulators complete
      for (int64_t i = i0; i < i1; ++i) {
        float sum = dh_new[i];
        for (int t = 0; t < nthreads; ++t) sum += dh_acc[t][i];
        dh[i] = sum;
      }
    }
  });

  detail::store_transposed(dh.data(), B, H, io.dh0);
  if constexpr (kLstm) detail::store_transposed(dc.data(), B, H, io.dc0);
  for (int64_t i = 0; i < groups * nnz; ++i) io.dvalues[i] = from_float<S>(dv[i]);
  if constexpr (kGru)
    for (int64_t i = 0; i < groups * H; ++i) io.db_hn[i] = from_float<S>(db_hn[i]);
}

}  // namespace sprnn::cpu
