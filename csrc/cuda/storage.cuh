// Storage types and conversions: 16-bit and float32 values (Tr), the exchange words that carry
// h with its step tag (XWord), and the shared-memory words of the nonzeros (RowWord).
#pragma once

#include "cuda/params.cuh"

namespace sprnn {
namespace cuda {

__device__ __forceinline__ float f16_to_f32(uint32_t u) {
  unsigned short h = static_cast<unsigned short>(u);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ uint32_t f32_to_f16(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ uint32_t f32_to_bf16(float f) {
  // Round to nearest even without sm_80 instructions (sm_70 has no cvt to bf16).
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}

template <DType D>
struct Tr;

template <>
struct Tr<DType::kF32> {
  using S = float;                    // storage of xp, h, outputs
  using W = uint2;                    // shared-memory nonzero: (value bits, column)
  __device__ static float to_f(S v) { return v; }
  __device__ static S from_f(float f) { return f; }
  __device__ static float bits_to_f(uint32_t b) { return __uint_as_float(b); }
  __device__ static uint32_t f_to_bits(float f) { return __float_as_uint(f); }
  __device__ static W make_w(float v, int col) {
    return make_uint2(__float_as_uint(v), static_cast<uint32_t>(col));
  }
  __device__ static void unpack_w(W w, float& v, int& col) {
    v = __uint_as_float(w.x);
    col = static_cast<int>(w.y);
  }
};

template <DType D>
struct Tr16 {
  using S = uint16_t;
  using W = uint32_t;  // column << 16 | value bits
  __device__ static float bits_to_f(uint32_t b) {
    if constexpr (D == DType::kBF16) {
      return __uint_as_float(b << 16);
    } else {
      return f16_to_f32(b);
    }
  }
  __device__ static uint32_t f_to_bits(float f) {
    if constexpr (D == DType::kBF16) {
      return f32_to_bf16(f);
    } else {
      return f32_to_f16(f);
    }
  }
  __device__ static float to_f(S v) { return bits_to_f(v); }
  __device__ static S from_f(float f) { return static_cast<S>(f_to_bits(f)); }
  __device__ static W make_w(float v, int col) {
    return (static_cast<uint32_t>(col) << 16) | f_to_bits(v);
  }
  __device__ static void unpack_w(W w, float& v, int& col) {
    v = bits_to_f(w & 0xffffu);
    col = static_cast<int>(w >> 16);
  }
};
template <>
struct Tr<DType::kBF16> : Tr16<DType::kBF16> {};
template <>
struct Tr<DType::kF16> : Tr16<DType::kF16> {};

// Exchange words of the Lamport mode: what a block publishes per (unit, b) value (P) and what
// readers load and check (X, kVals values per word). A word is single-copy atomic, so a reader
// that sees its step's tag in it sees that step's values.
// - Tagged (tanh rnn, GRU and 16-bit LSTM layers, and tiles of 2 bytes of h): value | step tag,
//   16 | 16 bits (32 | 32 for float32, so float32 h is exchanged exactly). Tags count steps
//   modulo 65535 from 1, so the workspace's zeroes are no step's.
// - Bit-tagged (ReLU layers and float32 LSTM layers, tiles of 4 bytes of h or more): a one-bit
//   step tag in a bit of each value that the cell leaves free, so half the bytes of tagged
//   words, exact. A valid step only ever reads h that the cell made (step 0 reads h0
//   directly, and a sequence once past its end never runs again; lanes of other sequences are
//   dropped): a ReLU's h is >= 0 or NaN (common/cells.h), so its sign bit is free (publish
//   clears it: a NaN stays NaN); an LSTM's
//   h = o * tanh(c) has |h| <= 1 or is NaN, so the top bit of its exponent is free but in NaN,
//   which is published as the otherwise impossible pattern "all bits below the tag set" (|v|
//   just under 2) and read back as NaN. One bit is enough: slot s % 2 can hold only step s - 1
//   or s - 3 when a reader looks for s - 1 (a writer cannot reach s + 1 before every reader
//   published s, and the reading thread, which reads the same word every step, already saw
//   s - 3 there: coherence), so the bit alternates between the steps of a slot, and starts at
//   1 so that the workspace's zeroes are no step's.
template <bool kIf, class A, class B>
struct Pick { using type = A; };
template <class A, class B>
struct Pick<false, A, B> { using type = B; };
template <bool kIf, class A, class B>
using pick_t = typename Pick<kIf, A, B>::type;  // std::conditional_t (NVRTC has no <type_traits>)

template <Cell kCell, DType D, int BT>
struct XWord {
  using S = typename Tr<D>::S;
  static constexpr bool k32 = sizeof(S) == 4;  // float32 values
  // LSTM: float32 only. Its 16-bit layers ran no faster with them (LSTM H=1024 1.93 -> 1.94
  // us/step, H=4096 8.75 -> 9.01: the NaN code lengthens the publish), float32 2.53 -> 2.34
  // (benchmarks/NOTES.md, session 27).
  static constexpr bool kNanCode = kCell == Cell::kLstm && sizeof(S) == 4;  // the tag bit is NaN's
  static constexpr bool kBitTag = (kCell == Cell::kRnnRelu || kNanCode) && sizeof(S) * BT >= 4;
  // Tagged: one value and its tag per word. Bit-tagged: the value alone, and two 16-bit ones
  // per loaded 32-bit word.
  using P = pick_t<kBitTag, pick_t<k32, uint32_t, uint16_t>, pick_t<k32, unsigned long long, uint32_t>>;
  using X = pick_t<kBitTag, uint32_t, P>;
  static constexpr int kVals = static_cast<int>(sizeof(X) / sizeof(P));
  // The tag bit of one value (bit-tagged: the sign, or the exponent's top bit for kNanCode),
  // its copies in a word, and the lowest bit of each value.
  static constexpr uint32_t kBit = (k32 ? 0x80000000u : 0x8000u) >> (kNanCode ? 1 : 0);
  static constexpr uint32_t kOnes = k32 ? 1u : 0x00010001u;
  static constexpr X kTagMask = kBitTag ? X(kBit * kOnes) : (k32 ? X(~0ull << 32) : X(0xffff0000u));
  static constexpr uint32_t kValueMask = k32 ? ~0u : 0xffffu;
  // The tag bits of the word(s) holding step s's values.
  __device__ static X tag_word(int s) {
    if constexpr (kBitTag) {
      return ((s >> 1) + 1) & 1 ? kTagMask : X(0);
    } else {
      return static_cast<X>(static_cast<X>(s % 65535) + 1u) << (4 * sizeof(X));
    }
  }
  __device__ static bool ok(X w, X tag) { return (w & kTagMask) == tag; }
  // The word without its tags: its values' bits (NaN codes back to NaN: adding one to the bits
  // below the tag carries into the tag bit only for the code).
  __device__ static X clean(X w) {
    const X v = w & ~kTagMask;
    if constexpr (kBitTag && kNanCode) {
      return v | (((v & X((kBit - 1) * kOnes)) + X(kOnes)) & kTagMask);
    } else {
      return v;
    }
  }
  // The bits of the word's v-th value.
  __device__ static uint32_t value(X w, int v) {
    return static_cast<uint32_t>(clean(w) >> (16 * v)) & kValueMask;
  }
  __device__ static P publish(uint32_t bits, int s) {
    if constexpr (kBitTag && kNanCode) {
      if (bits & kBit) bits |= kBit - 1;  // NaN (nothing else an LSTM makes has the bit)
    }
    return static_cast<P>(static_cast<P>(bits & (kBitTag ? ~kBit : kValueMask)) | static_cast<P>(tag_word(s)));
  }
};

// A nonzero as persistent_fwd keeps it in shared memory (its kWords):
// - kColumn: Tr<D>::W, (value, column), 4 bytes for the 16-bit types.
// - kOffset (16-bit, wide tiles): the byte offset of its unit's h values in the tile in the
//   upper 16 bits, the value in the lower, 4 bytes: one LEA.HI gives the gather's address where
//   the column takes SHF + LOP3 (12 instead of 13 instructions per nonzero and lane at tile 4
//   fp16, sm_90 SASS). The offset must fit 16 bits (offset_words_fit). Step probe, fp16, B=4,
//   us/step, column / offset: ReLU H=5760 (deep + register build) 4.44-4.45 -> 4.36-4.37, LSTM
//   H=4096 8.83-8.87 -> 8.73-8.75, ReLU H=1152 (plain build) 1.53-1.54 -> 1.52
//   (benchmarks/NOTES.md, session 34).
// - kFloat (wide tiles): the value as float32 bits and the byte offset of its unit's h values,
//   8 bytes, so that row_dot spends no instruction on unpacking or addressing: 10 per nonzero
//   and lane at tile 4 fp16, for twice the shared memory per nonzero. Step probe, fp16, B=4,
//   us/step (register build, column / float words): ReLU H=2304 30% 3.22 -> 3.12, LSTM H=1024
//   2.08 -> 2.03; whole warps of short rows lose (ReLU H=1152 1.76 -> 1.79: twice the weight
//   wavefronts for no saved round), so the planner takes them for 16-bit layers with the
//   register build only, where all nonzeros fit (benchmarks/NOTES.md, session 15). Float32
//   words are 8 bytes either way: its wide builds always use them (launch.cuh).
enum class Words : int { kColumn, kOffset, kFloat };

// Whether row_dot addresses the tile by byte offsets (kOffset, kFloat) rather than columns.
__host__ __device__ constexpr bool byte_offset_words(Words w) { return w != Words::kColumn; }

// Whether every unit's byte offset in a tile of units of unit_bytes fits an offset word.
__host__ __device__ constexpr bool offset_words_fit(long long H, int unit_bytes) {
  return (H - 1) * unit_bytes <= 0xffff;
}

template <DType D, Words kWords>
struct RowWord {
  using W = typename Tr<D>::W;
  __device__ static W make(float v, int col, int /*unit_bytes*/) { return Tr<D>::make_w(v, col); }
  // The value and where its h values are: here the column, else the byte offset in the tile.
  __device__ __forceinline__ static void unpack(const W& w, float& v, int& loc) {
    Tr<D>::unpack_w(w, v, loc);
  }
};
template <DType D>
struct RowWord<D, Words::kOffset> {
  static_assert(D != DType::kF32, "offset words hold a 16-bit value");
  using W = uint32_t;
  __device__ static W make(float v, int col, int unit_bytes) {
    return static_cast<uint32_t>(col * unit_bytes) << 16 | Tr<D>::f_to_bits(v);
  }
  __device__ __forceinline__ static void unpack(const W& w, float& v, int& loc) {
    v = Tr<D>::bits_to_f(w & 0xffffu);
    loc = static_cast<int>(w >> 16);
  }
};
template <DType D>
struct RowWord<D, Words::kFloat> {
  using W = uint2;
  __device__ static W make(float v, int col, int unit_bytes) {
    return make_uint2(__float_as_uint(v), static_cast<uint32_t>(col * unit_bytes));
  }
  __device__ __forceinline__ static void unpack(const W& w, float& v, int& loc) {
    v = __uint_as_float(w.x);
    loc = static_cast<int>(w.y);
  }
};
template <DType D, Words kWords>
using RowWordT = typename RowWord<D, kWords>::W;

}  // namespace cuda
}  // namespace sprnn
