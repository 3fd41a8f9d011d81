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

  static inline float sigmoid(float x) { return 1.0f / (1.0f + exp(-x)); }

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

  // Rational minimax form (Eigen's float tanh, as XLA's CPU backend uses): one division and
  // no exp, about half the work of 1 - 2 / (exp(2|x|) + 1) plus a small-|x| polynomial
  // evaluated side by side (the rnn cell pass: ~12% of a step). Max error over all floats
  // 6 ulp, 3.7e-7 absolute (near |x| = 5.8; float64 sweep).
  static inline float tanh(float x) {
    const bool is_nan = x != x;
    const bool is_tiny = __builtin_fabsf(x) < 0.0004f;  // tanh(x) = x in float32
    const float xc = select(x > 9.0f, 9.0f, select(x < -9.0f, -9.0f, x));  // |tanh| rounds to 1
    const float x2 = xc * xc;
    float p = -2.76076847742355e-16f;
    p = p * x2 + 2.00018790482477e-13f;
    p = p * x2 - 8.60467152213735e-11f;
    p = p * x2 + 5.12229709037114e-08f;
    p = p * x2 + 1.48572235717979e-05f;
    p = p * x2 + 6.37261928875436e-04f;
    p = p * x2 + 4.89352455891786e-03f;
    float q = 1.19825839466702e-06f;
    q = q * x2 + 1.18534705686654e-04f;
    q = q * x2 + 2.26843463243900e-03f;
    q = q * x2 + 4.89352518554385e-03f;
    return select(is_nan, x, select(is_tiny, x, xc * p / q));
  }
};

}  // namespace sprnn::cpu
