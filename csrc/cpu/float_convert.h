// Storage types of the CPU handlers and their conversion to and from float32.
//
// Plain C++17 has no bfloat16 or half type (std::bfloat16_t / std::float16_t are C++23, and
// _Float16 is a compiler extension whose availability depends on the target flags), and the
// XLA FFI headers only name the dtypes without giving arithmetic. So the handlers keep bf16 and
// f16 as raw 16-bit words and convert with the small bit-level helpers below: exact widening,
// and narrowing with round-to-nearest-even, NaN kept NaN, overflow to infinity, and f16
// subnormals handled. All math happens in float32.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SPRNN_CPU_HAVE_F16C 1
#endif

namespace sprnn::cpu {

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2 && sizeof(f16) == 2, "16-bit storage types");

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// ---- bfloat16: the top half of a float32 --------------------------------------------------
inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep the sign, force a quiet NaN
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  // Round to nearest even on the 16 dropped bits; a carry into the exponent is correct
  // (rounds up to the next binade, or to infinity at the top).
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

// ---- IEEE half ------------------------------------------------------------------------------
inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;  // exponent and mantissa
  if (em >= 0x7c00u) {              // inf / NaN
    return bits_float(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
  }
  if (em >= 0x0400u) {  // normal: rebias the exponent from 15 to 127
    return bits_float(sign | ((em << 13) + ((127u - 15u) << 23)));
  }
  // zero or subnormal: em * 2^-24 is exact in float32
  return bits_float(sign | float_bits(static_cast<float>(em) * 5.9604644775390625e-8f));
}

inline uint16_t float_to_f16(float f) {
  uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) {  // inf or NaN (NaN stays a quiet NaN)
    return sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u);
  }
  if (u >= 0x477ff000u) {  // >= 65520 rounds to infinity
    return sign | 0x7c00u;
  }
  if (u < 0x38800000u) {  // below 2^-14: subnormal or zero
    // Adding 0.5 puts the value in a binade whose ulp is 2^-24, the half subnormal step, so
    // the FPU's own round-to-nearest-even does the rounding; the low bits are the result.
    const float shifted = bits_float(u) + 0.5f;
    return sign | static_cast<uint16_t>(float_bits(shifted) - 0x3f000000u);
  }
  // Normal: rebias 127 -> 15 and round to nearest even on the 13 dropped mantissa bits.
  const uint32_t odd = (u >> 13) & 1u;
  u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd;
  return sign | static_cast<uint16_t>(u >> 13);
}

// ---- uniform load / store ------------------------------------------------------------------
inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return bf16_to_float(x.bits); }
inline float to_float(f16 x) { return f16_to_float(x.bits); }

#if defined(SPRNN_CPU_HAVE_F16C)
// vcvtph2ps, 8 halves at a time: exact like f16_to_float (a signalling NaN comes out quiet).
__attribute__((target("avx,f16c"))) inline void f16_to_float_f16c(const f16* in, float* out,
                                                                  int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + k));
    _mm256_storeu_ps(out + k, _mm256_cvtph_ps(h));
  }
  for (; k < n; ++k) out[k] = f16_to_float(in[k].bits);
}
#endif

// out[k] = to_float(in[k]) for k < n. f16c: the caller's run-time choice of F16C (every AVX2
// CPU has it). The scalar half conversion costs ~2 ns per value, a third of a float16 call of
// one step at LSTM H=1024 (its 420K weights; benchmarks/NOTES.md, session 81).
template <typename S>
inline void to_float_span(const S* in, float* out, int64_t n, bool f16c) {
#if defined(SPRNN_CPU_HAVE_F16C)
  if constexpr (std::is_same_v<S, f16>) {
    if (f16c) return f16_to_float_f16c(in, out, n);
  }
#endif
  (void)f16c;
  for (int64_t k = 0; k < n; ++k) out[k] = to_float(in[k]);
}

template <typename S>
inline S from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
template <>
inline bf16 from_float<bf16>(float x) {
  return bf16{float_to_bf16(x)};
}
template <>
inline f16 from_float<f16>(float x) {
  return f16{float_to_f16(x)};
}

}  // namespace sprnn::cpu
