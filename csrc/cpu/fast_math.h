// exp and tanh for the CPU cell math (the `M` policy of csrc/common/cells.h).
//
// The C library's expf / tanhf are out-of-line calls with branches; with several of them per
// hidden unit and batch row they cost more than the sparse product itself at 10% density.
// These are branch-free, inline float32 versions (Cephes' polynomials; about 1-2 ulp, the
// same order as XLA's own CPU approximations used by the reference), which the compiler can
// also vectorize. NaN propagates; large arguments saturate.
#pragma once

#include <cstdint>
#include <cstring>

namespace sprnn::cpu {

struct FastMath {
  // c ? a : b on the bit patterns. Every comparison is evaluated up front and only these
  // selects follow: with plain ?: GCC sinks the work of an unused arm into a branch, and under
  // the default -ftrapping-math it then will not if-convert (vectorize) the loop.
  static inline float select(bool c, float a, float b) {
    uint32_t ua, ub;
    std::memcpy(&ua, &a, sizeof(ua));
    std::memcpy(&ub, &b, sizeof(ub));
    const uint32_t m = 0u - static_cast<uint32_t>(c);
    const uint32_t r = (ua & m) | (ub & ~m);
    float f;
    std::memcpy(&f, &r, sizeof(f));
    return f;
  }

  static inline float exp(float x) {
    // exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln(2) / 2.
    const bool is_nan = x != x;
    const bool too_low = x < -87.3f;
    const bool too_high = x > 88.3f;  // keeps 2^n a normal number
    const float xc = select(too_high, 88.3f, select(too_low, -87.3f, x));
    constexpr float kShift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    const float t = xc * 1.44269504088896341f + kShift;
    const float n = t - kShift;
    const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 in two parts
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t tb;
    std::memcpy(&tb, &t, sizeof(tb));
    // The low bits of t hold n (two's complement around the shift); 2^n as float bits.
    const uint32_t scale_bits = (tb - 0x4B400000u + 127u) << 23;
    float scale;
    std::memcpy(&scale, &scale_bits, sizeof(scale));
    const float y = p * scale;
    return select(is_nan, x, y);
  }

  static inline float tanh(float x) {
    const bool is_nan = x != x;
    const bool negative = x < 0.0f;
    const float ax = select(negative, -x, x);
    const bool is_small = ax < 0.625f;
    // Small |x|: odd polynomial (no cancellation); otherwise 1 - 2 / (exp(2|x|) + 1).
    const float z = x * x;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const float small = p * z * x + x;
    const float big_abs = 1.0f - 2.0f / (exp(2.0f * ax) + 1.0f);
    const float big = select(negative, -big_abs, big_abs);
    return select(is_nan, x, select(is_small, small, big));
  }
};

}  // namespace sprnn::cpu
