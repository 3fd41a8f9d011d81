// Sparse persistent RNN forward kernel: the device code (header-only, NVRTC-compilable).
//
// One launch runs every timestep. The grid is `nb` co-resident blocks (cooperative launch, one
// block per SM). Block j owns a contiguous range of hidden units [u0, u1), chosen on device by a
// binary search over the unit-major row pointer so that the cost nnz + alpha * units is
// balanced across blocks. Its nonzeros (value, column) are copied once into shared memory (as
// many as fit; rows that do not fit are read from global memory/L2 every step). Per step and per
// batch tile of BT sequences, every block:
//   1. gathers h_{s-1} (H x BT) from the exchange buffer in global memory into shared memory
//      (rounds of loads held in registers; the deep-gather build of tile 4 holds twice as many,
//      for layers whose gather needs more than one round),
//   2. computes its rows' dot products (one warp per packed row, or half a warp; lanes split
//      the nonzeros in rounds of 8 per lane, then one of 8 or 4;
//      float32 accumulation, warp-shuffle reduction; for tiles wider than 16 bytes of h per
//      lane, i.e. BT = 16, 32, 64 and float32 8, BT / kNV lanes share each nonzero, each with kNV
//      batch columns: the "batch lanes" mapping, same code with other constants),
//   3. applies the cell to its units and publishes h_s to the exchange buffer.
// Batch groups (p.groups > 1): the grid splits into one group of nb / groups blocks per batch
// tile, each group holding the whole layer and running its tile alone; the tiles' exchanges
// never meet (benchmarks/NOTES.md, session 6: B=64 at ReLU H=1152 11.0 -> 5.5 us/step).
// Exchange (two slots, s % 2):
//   barrier mode: raw values, then a grid-wide barrier (one counter per batch tile, bounded spin);
//   Lamport mode: each (unit, b) word carries value + step tag (16-bit value | 16-bit tag for the
//   16-bit dtypes, 32-bit value | 32-bit tag for float32, so float32 h is exchanged exactly;
//   ReLU and float32 LSTM layers put a one-bit tag in a bit of each value that the cell leaves
//   free instead: XWord); readers spin on their words. A block publishes step s only after a
//   block-wide barrier that follows all of its reads of step s-1 (the two-slot pitfall in
//   DESIGN.md).
// Every wait is bounded by a %globaltimer deadline; on timeout (or when another block has
// aborted) the block sets the abort flag in the workspace and exits; the host turns the flag
// into an error.
// Layouts (template kWide): naive h_s[b][H] with BT scalar loads per nonzero (variant a), or
// wide h_s[H][BT] with one vector load per nonzero (variants b-d).
// Every tile is built for 512 threads (128 registers, no spills). Tiles of 16 to 64 gather
// only the h units their rows read plus one unit per block (p.col_filter, see the prologue of
// persistent_fwd). Per-step constants (row offsets, lengths) live in shared memory.
#pragma once

#if defined(__CUDACC_RTC__)
typedef unsigned int uint32_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
#else
#include <cstdint>
#endif

#include "common/cells.h"

namespace sprnn {
namespace cuda {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Kernel arguments (plain data, identical for all instantiations).
struct Params {
  const void* xp;         // (T, B, G*H)
  const int32_t* lengths; // (B,)
  const void* values;     // (nnz,)
  const int32_t* col_idx; // (nnz,)
  const int32_t* row_ptr; // (G*H + 1,)
  const void* h0;         // (B, H)
  const void* c0;         // (B, H) lstm
  const void* b_hn;       // (H,) gru
  void* ys;               // (T, B, H)
  void* hT;               // (B, H)
  void* cT;               // (B, H) lstm
  void* cs;               // (T, B, H) lstm
  void* xbuf;             // exchange: 2 slots x ntiles x exchange_units(H) x BT words
  unsigned int* counters; // barrier mode: one per batch tile
  int* abort_flag;        // 0 = ok; 1 = a wait timed out; 2-5: handlers.cu forward
  int T, B, H, ntiles;
  int activation;         // rnn: 0 tanh, 1 relu
  int reverse;
  int lamport;            // 1 = tagged exchange, 0 = grid barrier
  int alpha;              // per-unit cost in the block partition
  int u_cap;              // max units per block (smem sized for it)
  int w_cap;              // nonzeros per block kept in shared memory
  long long timeout_ns;   // per wait
  int spin_ns;            // back-off after a poll that found nothing new (0 = none)
  int col_filter;         // 1 = a block gathers only the h units its rows read (+ one per block)
  int row_lanes;          // lanes per row. cluster kernel: 0 = row_lanes_for; persistent_fwd:
                          // 16 = two rows per warp, 32 = one, 0 = two where that saves a
                          // pass over the rows
  int groups;             // persistent_fwd: > 1 = batch groups, tile j on blocks
                          // [j * nb / groups, (j + 1) * nb / groups), all tiles at once
                          // (groups == ntiles); 0 or 1 = every block runs every tile in turn
};

// ---- storage types and conversions ----------------------------------------------------------

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

// A nonzero as persistent_fwd keeps it in shared memory. Default: Tr<D>::W, (value, column),
// 4 bytes for the 16-bit types. Float words (kFloatWords, wide tiles): the value as float32 bits
// and the byte offset of its unit's h values in the tile, 8 bytes, so that row_dot spends no
// instruction on unpacking or addressing: 10 instead of 13 per nonzero and lane at tile 4 fp16
// (sm_90 SASS), for twice the shared memory per nonzero. Step probe, fp16, B=4, us/step
// (register build, 4-byte / float words): ReLU H=2304 30% 3.22 -> 3.12, LSTM H=1024 2.08 ->
// 2.03; whole warps of short rows lose (ReLU H=1152 1.76 -> 1.79: twice the weight wavefronts
// for no saved round), so the planner takes them for 16-bit layers with the register build
// only, where all nonzeros fit (benchmarks/NOTES.md, session 15). Float32 words are 8 bytes
// either way: its wide builds always use them (launch.cuh).
template <DType D, bool kFloatWords>
struct RowWord {
  using W = typename Tr<D>::W;
  __device__ static W make(float v, int col, int /*unit_bytes*/) { return Tr<D>::make_w(v, col); }
};
template <DType D>
struct RowWord<D, true> {
  using W = uint2;
  __device__ static W make(float v, int col, int unit_bytes) {
    return make_uint2(__float_as_uint(v), static_cast<uint32_t>(col * unit_bytes));
  }
};
template <DType D, bool kFloatWords>
using RowWordT = typename RowWord<D, kFloatWords>::W;

// ---- memory helpers -------------------------------------------------------------------------

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint32_t ld_relaxed(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long ld_relaxed(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// Predicated relaxed loads for the gathers: with pred == 0 nothing is read and r keeps its
// value. The predicate is inside the asm, so the compiler needs no branch around it (an
// `if` around an asm volatile load cost a branch per item; step probe profile).
#define SPRNN_LD_RELAXED_IF(VEC, TYPE, OUTS, ...)                                         \
  asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %" #VEC ", 0;\n\t"                   \
               "@q ld.relaxed.gpu.global" TYPE " " OUTS ";\n}" __VA_ARGS__ : "memory")
__device__ __forceinline__ void ld_relaxed_if(const uint32_t* p, uint32_t* r, uint32_t pred) {
  SPRNN_LD_RELAXED_IF(2, ".u32", "%0, [%1]", : "+r"(r[0]) : "l"(p), "r"(pred));
}
__device__ __forceinline__ void ld_relaxed_if(const unsigned long long* p, unsigned long long* r,
                                              uint32_t pred) {
  SPRNN_LD_RELAXED_IF(2, ".u64", "%0, [%1]", : "+l"(r[0]) : "l"(p), "r"(pred));
}
__device__ __forceinline__ void ld_relaxed_v4_if(const uint32_t* p, uint32_t* r, uint32_t pred) {
  SPRNN_LD_RELAXED_IF(5, ".v4.u32", "{%0,%1,%2,%3}, [%4]",
                      : "+r"(r[0]), "+r"(r[1]), "+r"(r[2]), "+r"(r[3]) : "l"(p), "r"(pred));
}
__device__ __forceinline__ void ld_relaxed_v2_if(const uint32_t* p, uint32_t* r, uint32_t pred) {
  SPRNN_LD_RELAXED_IF(3, ".v2.u32", "{%0,%1}, [%2]", : "+r"(r[0]), "+r"(r[1]) : "l"(p), "r"(pred));
}
__device__ __forceinline__ void ld_relaxed_v2_if(const unsigned long long* p,
                                                 unsigned long long* r, uint32_t pred) {
  SPRNN_LD_RELAXED_IF(3, ".v2.u64", "{%0,%1}, [%2]", : "+l"(r[0]), "+l"(r[1]) : "l"(p), "r"(pred));
}
#undef SPRNN_LD_RELAXED_IF
__device__ __forceinline__ void st_relaxed(uint16_t* p, uint16_t v) {
  asm volatile("st.relaxed.gpu.global.u16 [%0], %1;" ::"l"(p), "h"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire(const unsigned int* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Loads N exchange words (contiguous, aligned to their size) when pred != 0 (else w keeps its
// values): 16-byte vector loads, then an 8-byte one for the rest of 32-bit words. Each element
// is loaded single-copy atomically (u32 or u64 elements of vector loads).
template <class X, int N>
__device__ __forceinline__ void load_x(const X* p, X* w, uint32_t pred) {
  constexpr int kVec = sizeof(X) == 4 ? 4 : 2;  // elements per 16-byte vector load
  constexpr int kFull = N / kVec * kVec;
  constexpr int kPair = sizeof(X) == 4 && N - kFull >= 2 ? 2 : 0;  // 32-bit words for an 8-byte load
#pragma unroll
  for (int i = 0; i < kFull; i += kVec) {
    if constexpr (sizeof(X) == 4) {
      ld_relaxed_v4_if(p + i, w + i, pred);
    } else {
      ld_relaxed_v2_if(p + i, w + i, pred);
    }
  }
  if constexpr (kPair > 0) ld_relaxed_v2_if(p + kFull, w + kFull, pred);
#pragma unroll
  for (int i = kFull + kPair; i < N; ++i) ld_relaxed_if(p + i, w + i, pred);
}

// h_s element access. Wide: h_s[u * BT + b] (the BT values of a unit are contiguous, so one
// vector load of sizeof(S) * BT bytes fetches them). Naive: h_s[b * H + u].
// store_h writes one chunk of N values: wide, chunk `item` = elements [item * N, item * N + N)
// (a unit is BT / N consecutive chunks); naive, N == BT and item is the unit.
template <class S, int BT, int N, bool kWide>
__device__ __forceinline__ void store_h(S* h_s, int H, int item, const uint32_t* bits) {
  static_assert(kWide || N == BT, "the naive layout stores whole units");
  if constexpr (kWide) {
    const int e = item * N;
    if constexpr (sizeof(S) == 4) {
      if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 4)
          *reinterpret_cast<uint4*>(h_s + e + i) = make_uint4(bits[i], bits[i + 1], bits[i + 2], bits[i + 3]);
      } else {
#pragma unroll
        for (int i = 0; i < N; ++i) reinterpret_cast<uint32_t*>(h_s)[e + i] = bits[i];
      }
    } else {
      if constexpr (N % 8 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 8)
          *reinterpret_cast<uint4*>(h_s + e + i) =
              make_uint4((bits[i] & 0xffffu) | (bits[i + 1] << 16), (bits[i + 2] & 0xffffu) | (bits[i + 3] << 16),
                         (bits[i + 4] & 0xffffu) | (bits[i + 5] << 16), (bits[i + 6] & 0xffffu) | (bits[i + 7] << 16));
      } else if constexpr (N % 2 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 2)
          reinterpret_cast<uint32_t*>(h_s)[(e + i) / 2] = (bits[i] & 0xffffu) | (bits[i + 1] << 16);
      } else {
#pragma unroll
        for (int i = 0; i < N; ++i) h_s[e + i] = static_cast<S>(bits[i]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < BT; ++i) {
      if constexpr (sizeof(S) == 4) {
        reinterpret_cast<uint32_t*>(h_s)[i * H + item] = bits[i];
      } else {
        h_s[i * H + item] = static_cast<S>(bits[i]);
      }
    }
  }
}

// Loads N contiguous h values at p (aligned to N * sizeof(S) bytes, or 16) as float32.
template <DType D, int N>
__device__ __forceinline__ void load_vals(const typename Tr<D>::S* p, float* out) {
  using S = typename Tr<D>::S;
  constexpr int kBytes = static_cast<int>(sizeof(S)) * N;
  if constexpr (kBytes >= 16) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if constexpr (sizeof(S) == 4) {
          out[i * 4 + j] = __uint_as_float(w[j]);
        } else {
          out[i * 8 + 2 * j] = Tr<D>::bits_to_f(w[j] & 0xffffu);
          out[i * 8 + 2 * j + 1] = Tr<D>::bits_to_f(w[j] >> 16);
        }
      }
    }
  } else if constexpr (kBytes == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    if constexpr (sizeof(S) == 4) {
      out[0] = __uint_as_float(v.x);
      out[1] = __uint_as_float(v.y);
    } else {
      out[0] = Tr<D>::bits_to_f(v.x & 0xffffu);
      out[1] = Tr<D>::bits_to_f(v.x >> 16);
      out[2] = Tr<D>::bits_to_f(v.y & 0xffffu);
      out[3] = Tr<D>::bits_to_f(v.y >> 16);
    }
  } else if constexpr (kBytes == 4) {
    const uint32_t v = *reinterpret_cast<const uint32_t*>(p);
    if constexpr (sizeof(S) == 4) {
      out[0] = __uint_as_float(v);
    } else {
      out[0] = Tr<D>::bits_to_f(v & 0xffffu);
      out[1] = Tr<D>::bits_to_f(v >> 16);
    }
  } else {
    out[0] = Tr<D>::to_f(p[0]);
  }
}

// Loads the N h values of column `col` that this lane accumulates (batch columns [b0, b0 + N)
// of the tile) as float32. Naive: N == BT, b0 == 0.
template <DType D, int BT, int N, bool kWide>
__device__ __forceinline__ void gather_h(const typename Tr<D>::S* h_s, int H, int col, int b0,
                                         float* out) {
  if constexpr (kWide) {
    load_vals<D, N>(h_s + col * BT + b0, out);
  } else {
    static_assert(N == BT, "the naive layout gathers whole units");
#pragma unroll
    for (int i = 0; i < BT; ++i) out[i] = Tr<D>::to_f(h_s[i * H + col]);
  }
}

// ---- block partition --------------------------------------------------------------------------

// The partition's parameters for `parts` blocks, set on the host (the planner, handlers.cu, and
// the step probe) into Params::alpha / u_cap. A unit costs alpha = its average nonzeros on top
// of its own, so a block gets at most about twice the average units whatever its rows; u_cap
// bounds them, and the per-unit shared memory is sized for it. With half the average (until
// session 16) u_cap was three times the average units, and the room for them held LSTM H=4096
// 10% fp16 off chip at batch tile 2; the step probe's times did not move (benchmarks/NOTES.md).
struct UnitSplit {
  int alpha, u_cap;
};
__host__ __device__ inline UnitSplit unit_split(long long H, long long nnz, int parts) {
  const long long alpha = nnz / H > 1 ? nnz / H : 1;
  const long long u_cap = ((nnz + alpha * H) / parts + 1) / alpha + 2;
  return {static_cast<int>(alpha), static_cast<int>(u_cap < H ? u_cap : H)};
}

// First unit u in [0, H] with cost(u) = row_ptr[u*G] + alpha*u >= target (cost is increasing).
__device__ __forceinline__ int partition_unit(const int32_t* row_ptr, int G, int H, int alpha,
                                              long long target) {
  int lo = 0, hi = H;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    const long long c = static_cast<long long>(__ldg(row_ptr + static_cast<long long>(mid) * G)) +
                        static_cast<long long>(alpha) * mid;
    if (c >= target) hi = mid; else lo = mid + 1;
  }
  return lo;
}

__device__ __forceinline__ void unit_range(const Params& p, int G, int j, int nb, int& u0, int& u1) {
  const long long total = static_cast<long long>(__ldg(p.row_ptr + static_cast<long long>(p.H) * G)) +
                          static_cast<long long>(p.alpha) * p.H;
  const long long t0 = (total * j + nb - 1) / nb;
  const long long t1 = (total * (j + 1) + nb - 1) / nb;
  u0 = j == 0 ? 0 : partition_unit(p.row_ptr, G, p.H, p.alpha, t0);
  u1 = j == nb - 1 ? p.H : partition_unit(p.row_ptr, G, p.H, p.alpha, t1);
}

// Sets the bits of the h units a block reads (kernel_core's col_filter): the columns of its
// nonzeros [kb0, kb1) and the first unit of every non-empty block of its nb-block partition.
__device__ __forceinline__ void mark_columns(const Params& p, int G, long long kb0, long long kb1,
                                          int nb, uint32_t* cmask) {
#pragma unroll 1
  for (long long k = kb0 + threadIdx.x; k < kb1; k += blockDim.x) {
    const int col = __ldg(p.col_idx + k);
    atomicOr(cmask + (col >> 5), 1u << (col & 31));
  }
  // Block jb's first unit is partition_unit(t0(jb)) (as in unit_range); for an empty block
  // that is the next block's first unit (or H), which does no harm.
  const long long total = static_cast<long long>(__ldg(p.row_ptr + static_cast<long long>(p.H) * G)) +
                          static_cast<long long>(p.alpha) * p.H;
#pragma unroll 1
  for (int jb = threadIdx.x; jb < nb; jb += blockDim.x) {
    const int v0 = jb == 0 ? 0 : partition_unit(p.row_ptr, G, p.H, p.alpha, (total * jb + nb - 1) / nb);
    if (v0 < p.H) atomicOr(cmask + (v0 >> 5), 1u << (v0 & 31));
  }
}

// Units per gather chunk of the wide layout, for units of unit_bytes exchange bytes: where a
// unit is under 16 bytes (sign-tagged 16-bit tiles of 4, tiles of 1 and 2) a chunk takes
// 16 / unit_bytes consecutive units, one 16-byte load and store instead of one per unit. Step
// probe, us/step, one unit / two units per chunk: ReLU H=1152 1.504-1.509 / 1.478-1.486, ReLU
// H=2304 30% 2.738-2.741 / 2.640-2.646 (benchmarks/NOTES.md, session 28).
__host__ __device__ constexpr int chunk_units(int unit_bytes) {
  return unit_bytes < 16 ? 16 / unit_bytes : 1;
}

// The exchange buffer holds exchange_units(H) units per tile and slot, H rounded up to 8, so that
// every tile starts 16-byte aligned for the chunks' loads. The units past H are only ever read as
// the rest of the last chunk (persistent_fwd publishes them).
constexpr int kXUnitAlign = 8;
__host__ __device__ constexpr long long exchange_units(long long H) {
  return (H + kXUnitAlign - 1) / kXUnitAlign * kXUnitAlign;
}

// ---- shared memory carve-up (host computes the same sizes, see handlers.cu) -------------------

__host__ __device__ __forceinline__ long long align16(long long x) { return (x + 15) & ~15LL; }

// h tile (h_slots copies, h_stride bytes apart: the cluster kernel double-buffers it) | row
// results | h state | c state (lstm) | needed-column bitmap | row offsets (row_words ints: the
// cluster kernel; persistent_fwd keeps its rows' offsets at the start of the weight region) |
// sequence lengths (bpad ints) | nonzeros. Row offsets and lengths are read every step: from
// shared memory they cost no L1 miss (the x and ys streams evict them from the small L1 left
// beside 227 KB of shared memory; benchmarks/NOTES.md, step probe).
struct SmemLayout {
  long long h_off, h_stride, acc_off, hst_off, cst_off, m_off, r_off, len_off, w_off, total;
};

__host__ __device__ inline SmemLayout smem_layout(int H, int BT, int bpad, int G, bool lstm,
                                                  int u_cap, int w_cap, int s_bytes, int w_bytes,
                                                  int h_slots = 1, int row_words = 0,
                                                  int h_units = 0) {
  SmemLayout l;
  l.h_off = 0;
  // (The gather's last chunk of several units stays inside: its values take at most 16 bytes,
  // a power of two, so it ends by the 16-byte alignment; chunk_units. h_units > 0: the h tile
  // holds that many units per batch column, the mma build's padded rows.)
  l.h_stride = align16(static_cast<long long>(h_units > 0 ? h_units : H) * BT * s_bytes);
  l.acc_off = h_slots * l.h_stride;
  l.hst_off = l.acc_off + align16(static_cast<long long>(u_cap) * G * BT * 4);
  l.cst_off = l.hst_off + align16(static_cast<long long>(u_cap) * bpad * 4);
  l.m_off = l.cst_off + (lstm ? align16(static_cast<long long>(u_cap) * bpad * 4) : 0);
  l.r_off = l.m_off + align16((static_cast<long long>(H) + 31) / 32 * 4);
  l.len_off = l.r_off + align16(static_cast<long long>(row_words) * 4);
  l.w_off = l.len_off + align16(static_cast<long long>(bpad) * 4);
  l.total = l.w_off + align16(static_cast<long long>(w_cap) * w_bytes);
  return l;
}

// ---- waits ------------------------------------------------------------------------------------

// Returns true when the wait must be abandoned (deadline passed or another block aborted).
// `start` is read lazily at the first check (0 = not yet), so a wait that succeeds at once
// never reads the timer.
__device__ __forceinline__ bool wait_expired(const Params& p, unsigned long long& start) {
  if (ld_relaxed(reinterpret_cast<const uint32_t*>(p.abort_flag)) != 0u) return true;
  const unsigned long long now = global_ns();
  if (start == 0) start = now;
  if (now - start > static_cast<unsigned long long>(p.timeout_ns)) {
    atomicExch(p.abort_flag, 1);
    return true;
  }
  return false;
}

// ---- step probe (benchmarks/step_probe.cu only) ------------------------------------------------
// With SPRNN_STEP_PROBE defined, thread 0 of every block stamps clock64 and %globaltimer at the
// phase boundaries of each step (g_probe_trace[(s * nb + block) * 8 + k]: k = 0..3 clocks,
// 4..7 timers), and g_probe_mode can switch parts off or add some: 1 = skip the rows (exchange
// only), 2 = do not wait for the tags (no synchronization: the local work's floor), 3 = a block
// barrier after the cell update (no polling while a block publishes). Not built otherwise.
// A runtime mode changes the code around it (the gather's tag check compiled to a branch per
// pair of words instead of one predicate per item: benchmarks/NOTES.md session 26), so a build
// with SPRNN_PROBE_FIXED_MODE=m has the mode as a constant, as the package has 0.
#if defined(SPRNN_STEP_PROBE)
__device__ unsigned long long* g_probe_trace;
__device__ int g_probe_mode;
// Read once per kernel (a global load in every phase would itself miss the L1).
#define SPRNN_PROBE_INIT                                  \
  unsigned long long* const probe_trace = g_probe_trace; \
  const int probe_mode = g_probe_mode;                    \
  (void)probe_mode
#define SPRNN_PROBE_STAMP(s, k)                                                                  \
  do {                                                                                           \
    if (threadIdx.x == 0 && probe_trace != nullptr) {                                            \
      unsigned long long* q = probe_trace + (static_cast<long long>(s) * gridDim.x + blockIdx.x) * 8; \
      q[k] = clock64();                                                                          \
      q[4 + (k)] = global_ns();                                                                  \
    }                                                                                            \
  } while (0)
#if defined(SPRNN_PROBE_FIXED_MODE)
#define SPRNN_PROBE_MODE (SPRNN_PROBE_FIXED_MODE)
#else
#define SPRNN_PROBE_MODE probe_mode
#endif
#else
#define SPRNN_PROBE_INIT static_assert(true, "")
#define SPRNN_PROBE_STAMP(s, k) \
  do {                          \
  } while (0)
#define SPRNN_PROBE_MODE 0
#endif

// ---- per-step pieces shared by persistent_fwd and cluster_fwd (cluster_kernel.cuh) -------------

// Length of sequence b clamped to [0, T]; 0 for padding columns (b >= B).
__device__ __forceinline__ int seq_len(const Params& p, int b) {
  if (b >= p.B) return 0;
  const int len = __ldg(p.lengths + b);
  return len < 0 ? 0 : (len > p.T ? p.T : len);
}

// The longest clamped length of sequences [b_lo, b_hi): the steps a block runs.
__device__ __forceinline__ int max_seq_len(const Params& p, int b_lo, int b_hi) {
  int lmax = 0;
  for (int b = b_lo; b < b_hi; ++b) {
    const int len = seq_len(p, b);
    lmax = len > lmax ? len : lmax;
  }
  return lmax;
}

// The block's per-step constants into shared memory: len_s[i] = seq_len(b_lo + i) for i < n,
// rows_s[i] = row_ptr[r0 + i] - base for i <= nrows.
__device__ __forceinline__ void load_step_constants(const Params& p, int b_lo, int n, int* len_s,
                                                    long long r0, int nrows, long long base,
                                                    int* rows_s) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) len_s[i] = seq_len(p, b_lo + i);
  for (int i = threadIdx.x; i <= nrows; i += blockDim.x)
    rows_s[i] = static_cast<int>(__ldg(p.row_ptr + r0 + i) - base);
}

// Where pair (unit u, sequence b of length len) stands at step s: whether the step is in the
// sequence, and the ys/cs offset it writes (time step_time(s) then; padding positions s >= len
// get zeros at time s). Threads compute it for their first pair at the top of the round, off
// the update's critical path (the update is a short dependent chain in one or two warps that
// every block waits for).
struct PairStep {
  bool valid;
  long long o;
};
__device__ __forceinline__ PairStep pair_step(const Params& p, int s, int len, int b, int u) {
  const bool valid = s < len;
  const int t = valid ? step_time(s, len, p.reverse != 0) : s;
  return {valid, (static_cast<long long>(t) * p.B + b) * p.H + u};
}

// The G input projections of a valid pair step (unit u; xp row t * B + b holds G * H values),
// in the storage type: callers that prefetch convert at the use, so that the loads stay in
// flight until then (a conversion right after the load waits for it).
template <DType D, int G>
__device__ __forceinline__ void load_x_pair(const Params& p, const PairStep& ps, int u,
                                            typename Tr<D>::S* x) {
  using S = typename Tr<D>::S;
  const S* xq = static_cast<const S*>(p.xp) + (ps.o - u) * G + u;
#pragma unroll
  for (int g = 0; g < G; ++g) x[g] = xq[static_cast<long long>(g) * p.H];
}

// Copies nonzeros [kb0, kb0 + n_in) into shared memory as RowWord words (unit_bytes: the bytes
// of one unit's h values in the tile, for float words).
template <DType D, bool kFloatWords = false>
__device__ __forceinline__ void load_weights(const Params& p, long long kb0, long long n_in,
                                             RowWordT<D, kFloatWords>* w_s,
                                             int unit_bytes = 0) {
  using T = Tr<D>;
  const typename T::S* vals = static_cast<const typename T::S*>(p.values);
  for (long long k = threadIdx.x; k < n_in; k += blockDim.x)
    w_s[k] = RowWord<D, kFloatWords>::make(T::to_f(vals[kb0 + k]), __ldg(p.col_idx + kb0 + k),
                                           unit_bytes);
}

// The float32 state of the block's units for batch columns [b_lo, b_lo + bpad) (zeros for
// padding columns b >= B): hst/cst[ul * bpad + b - b_lo] from h0/c0.
template <Cell kCell, DType D>
__device__ __forceinline__ void init_state(const Params& p, int u0, int nu, int b_lo, int bpad,
                                           float* hst, float* cst) {
  using T = Tr<D>;
  using S = typename T::S;
  for (int i = threadIdx.x; i < nu * bpad; i += blockDim.x) {
    const int ul = i / bpad, b = b_lo + i % bpad;
    const long long g = static_cast<long long>(b) * p.H + u0 + ul;
    hst[i] = b < p.B ? T::to_f(static_cast<const S*>(p.h0)[g]) : 0.0f;
    if constexpr (kCell == Cell::kLstm)
      cst[i] = b < p.B ? T::to_f(static_cast<const S*>(p.c0)[g]) : 0.0f;
  }
}

// Nonzeros per lane in flight in row_dot's full rounds and in its last, shorter round (macros
// only so that the step probe can compare).
#ifndef SPRNN_ROW_DEPTH
#define SPRNN_ROW_DEPTH 8
#endif
#ifndef SPRNN_ROW_TAIL_DEPTH
#define SPRNN_ROW_TAIL_DEPTH 4
#endif
constexpr int kRowDepth = SPRNN_ROW_DEPTH, kRowTailDepth = SPRNN_ROW_TAIL_DEPTH;
static_assert(kRowTailDepth <= kRowDepth, "the tail round is the shorter one");

// Register weights (persistent_fwd's kRegW > 0): each lane keeps the weight words of its first
// kRegW nonzeros of the first row it sums in registers, loaded once, so that round of row_dot
// reads no weights from shared memory (a third of its shared-memory wavefronts, and one
// dependent load less before the gathers). 16-bit weights only (the float32 kernel, whose
// gathers are twice as wide, has no registers to spare); 4-byte or float words (RowWord). Step
// probe, fp16, B=4, us/step without / with 8 (benchmarks/NOTES.md, session 13): LSTM H=1024
// 2.21 -> 2.09, ReLU H=2304 30% 3.35 -> 3.21; lanes with at most kRowTailDepth nonzeros per
// row gain nothing (ReLU H=1152 1.83 -> 1.82) or lose (ReLU H=1024 1.68 -> 1.73: the round
// gathers 8 words for 3-4), so the planner picks the build per layer (handlers.cu).
constexpr int kRegWeights = 8;
__host__ __device__ constexpr int reg_slots(int reg_w) { return reg_w > 0 ? reg_w : 1; }

// persistent_fwd's row mapping for a block of `rows` rows and `warps` warps (Params::row_lanes:
// 16 / 32 forces half / whole warps, 0 = this rule): half a warp per row where that turns two
// passes over the rows into one (step probe, us/step whole vs half: LSTM H=1024 2.71 -> 2.54,
// ReLU H=2304 30% 3.77 -> 3.63); with more rows (ReLU H=5760: 6.71 -> 7.29, LSTM H=4096: 11.75
// -> 12.06) or fewer, whole warps. The planner uses it too (the register-weights rule).
__host__ __device__ constexpr bool two_rows_per_warp(int rows, int warps, int row_lanes) {
  return row_lanes == 16 || (row_lanes == 0 && rows > warps && rows <= 2 * warps);
}

// A lane's place in that mapping, with `group` lanes per row: its row in its warp's first pass
// over the block's rows (compute_rows' first r) and its slice of a row (row_dot: nonzeros
// slice, slice + group / lpn, ...; lpn lanes share a nonzero). The register-weights prologue
// uses both to load what row_dot will read.
__device__ __forceinline__ int lane_first_row(int tid, int group) {
  return (tid >> 5) * (32 / group) + (tid & 31) / group;
}
__device__ __forceinline__ int lane_row_slice(int lane, int group, int lpn) {
  return (lane % group) / lpn;
}

// 32-bit words of h each thread has in flight in the gather: 32 (128 bytes), or twice that in
// the deep-gather build of a tile (persistent_fwd's kDeepGather). A big layer's gather is bound
// by these bytes in flight: 64 words (up to 128 registers, no spills) cut ReLU H=5760's gather
// from 2.43 to 1.97 us/step, but built into every kernel they slowed every other layer by 3-14%
// (benchmarks/NOTES.md, session 8); the planner picks the deep build per layer (handlers.cu).
constexpr int kGatherWords = 32;
__host__ __device__ constexpr int gather_words(bool deep) { return deep ? 2 * kGatherWords : kGatherWords; }

// Units (or 32-byte pieces of one) each thread has in flight per gather round, for x_bytes of
// exchange word per value (XWord::P) and tile bt: at most gather_words(deep) words and
// gather_words / 4 loads. The planner's deep-gather rule uses it too. Chunks of chunk_units
// units keep those rounds' bytes (persistent_fwd's K = this / units per chunk): twice the words
// in flight, 32 per thread, ran ReLU H=1152 and H=2304 30% 0.03-0.06 us/step slower
// (registers; benchmarks/NOTES.md, session 28).
__host__ __device__ constexpr int gather_units(int x_bytes, int bt, bool deep) {
  const int chunk_words = (x_bytes * bt <= 32 ? x_bytes * bt : 32) / 4;
  const int flight = gather_words(deep) / chunk_words;
  return flight < 1 ? 1 : (flight > gather_words(deep) / 4 ? gather_words(deep) / 4 : flight);
}

// The row mapping of persistent_fwd for tile BT: each lane accumulates kNV batch columns (at
// most 16 bytes of h: one vector load per nonzero), and kLPN = BT / kNV lanes share a nonzero.
template <DType D, int BT, bool kWide>
struct RowMap {
  static constexpr int kS = static_cast<int>(sizeof(typename Tr<D>::S));
  static constexpr int kNV = kWide ? (kS * BT <= 16 ? BT : 16 / kS) : BT;
  static constexpr int kLPN = BT / kNV;
};

// The FMAs of kDepth nonzeros of this lane (only those with on[q]: 0 * inf would be NaN), each
// given by its value v[q] and where its unit's h values are in the tile (loc[q]: the byte offset
// with kByteOffset, else the column): all gathers first, then the FMAs into acc.
template <DType D, int BT, bool kWide, bool kByteOffset, int kDepth>
__device__ __forceinline__ void dot_located(const float (&v)[kDepth], const int (&loc)[kDepth],
                                            const bool (&on)[kDepth],
                                            const typename Tr<D>::S* h_s, int H, int b0,
                                            float (&acc)[RowMap<D, BT, kWide>::kNV]) {
  using S = typename Tr<D>::S;
  constexpr int kNV = RowMap<D, BT, kWide>::kNV;
  float hv[kDepth][kNV];
#pragma unroll
  for (int q = 0; q < kDepth; ++q) {
    if constexpr (kByteOffset) {
      static_assert(kWide, "byte offsets address the wide tile");
      load_vals<D, kNV>(reinterpret_cast<const S*>(reinterpret_cast<const char*>(h_s) + loc[q]) + b0,
                        hv[q]);
    } else {
      gather_h<D, BT, kNV, kWide>(h_s, H, loc[q], b0, hv[q]);
    }
  }
#pragma unroll
  for (int q = 0; q < kDepth; ++q)
#pragma unroll
    for (int i = 0; i < kNV; ++i) acc[i] = on[q] ? fmaf(v[q], hv[q][i], acc[i]) : acc[i];
}

// dot_located for kDepth shared-memory words wq (RowWord).
template <DType D, int BT, bool kWide, bool kFW, int kDepth>
__device__ __forceinline__ void dot_words(const RowWordT<D, kFW> (&wq)[kDepth],
                                          const bool (&on)[kDepth], const typename Tr<D>::S* h_s,
                                          int H, int b0,
                                          float (&acc)[RowMap<D, BT, kWide>::kNV]) {
  float v[kDepth];
  int loc[kDepth];
#pragma unroll
  for (int q = 0; q < kDepth; ++q) {
    if constexpr (kFW) {
      v[q] = __uint_as_float(wq[q].x);
      loc[q] = static_cast<int>(wq[q].y);
    } else {
      Tr<D>::unpack_w(wq[q], v[q], loc[q]);
    }
  }
  dot_located<D, BT, kWide, kFW, kDepth>(v, loc, on, h_s, H, b0, acc);
}

// One round of row_dot from shared memory: this lane's nonzeros k, k + kNS, ...,
// k + (kDepth - 1) * kNS (with kPredicated, only those below k1), all weight loads first, then
// dot_words.
template <DType D, int BT, bool kWide, bool kFW, int kNS, int kDepth, bool kPredicated>
__device__ __forceinline__ void dot_round(const RowWordT<D, kFW>* w_s,
                                          const typename Tr<D>::S* h_s, int H, int k, int k1,
                                          int b0, float (&acc)[RowMap<D, BT, kWide>::kNV]) {
  using W = RowWordT<D, kFW>;
  W wq[kDepth];
  bool on[kDepth];
#pragma unroll
  for (int q = 0; q < kDepth; ++q) {
    on[q] = !kPredicated || k + kNS * q < k1;
    wq[q] = on[q] ? w_s[k + kNS * q] : W{};
  }
  dot_words<D, BT, kWide, kFW, kDepth>(wq, on, h_s, H, b0, acc);
}

// The same round for a row not held on chip: values and columns from global memory (L2), all
// loads of the round in flight before the first gather, as in the shared-memory rounds.
template <DType D, int BT, bool kWide, int kNS, int kDepth, bool kPredicated>
__device__ __forceinline__ void dot_round_global(const typename Tr<D>::S* vals,
                                                 const int32_t* col_idx,
                                                 const typename Tr<D>::S* h_s, int H, int k,
                                                 int k1, int b0,
                                                 float (&acc)[RowMap<D, BT, kWide>::kNV]) {
  float v[kDepth];
  int col[kDepth];
  bool on[kDepth];
#pragma unroll
  for (int q = 0; q < kDepth; ++q) {
    on[q] = !kPredicated || k + kNS * q < k1;
    v[q] = on[q] ? Tr<D>::to_f(__ldg(vals + k + kNS * q)) : 0.0f;
    col[q] = on[q] ? __ldg(col_idx + k + kNS * q) : 0;
  }
  dot_located<D, BT, kWide, false, kDepth>(v, col, on, h_s, H, b0, acc);
}

// A compile-time round shape for row_rounds' callback.
template <int kDepth, bool kPredicated>
struct RoundShape {
  static constexpr int depth = kDepth;
  static constexpr bool predicated = kPredicated;
};

// A row's rounds from position kr to k1 (kNS lanes' slices striding it): rounds of kRowDepth
// nonzeros per lane in flight while the row has that many left, then one predicated round of
// kRowDepth or kRowTailDepth by what is left: long rows pay fewer dependent latencies, short
// ones (ReLU H=1152, 10%: 3.6 nonzeros per lane) no more slots than they need. The choices
// depend on the group's position kr only, not on the lane's slice, so a group never diverges
// (lanes of one row differ by one nonzero at most). round(RoundShape, kr) runs one round.
template <int kNS, class Round>
__device__ __forceinline__ void row_rounds(int kr, int k1, Round&& round) {
  for (; kr + kRowDepth * kNS <= k1; kr += kRowDepth * kNS) round(RoundShape<kRowDepth, false>{}, kr);
  if (k1 - kr > kRowTailDepth * kNS) {
    round(RoundShape<kRowDepth, true>{}, kr);
  } else if (kr < k1) {
    round(RoundShape<kRowTailDepth, true>{}, kr);
  }
}

// Step 2 for one row, by a group of kGroup lanes (a whole warp, or half of one: see
// compute_rows): the dot products of the row's nonzeros [k0, k1) (offsets
// from the block's first nonzero; those below n_in are in w_s, the rest are read from global
// memory at kb0 + k) with the h tile h_s. Slice `sl` of the group (kLPN lanes; the group's
// kNS = kGroup / kLPN slices stride the row) takes nonzeros
// k0 + sl, k0 + sl + kNS, ...; each lane accumulates its kNV batch columns [b0, b0 + kNV) in
// float32: acc holds this lane's partial sums (compute_rows sums the slices). A group without a
// row passes k0 = k1 = 0. With kLPN = 1 and whole warps a row's k-th nonzero goes to lane
// k % 32, which is what the bank-aware packing order assumes.
template <DType D, int BT, bool kWide, bool kFW, int kGroup, int kRegW>
__device__ __forceinline__ void row_dot(const Params& p, const RowWordT<D, kFW>* w_s,
                                        long long kb0, long long n_in,
                                        const typename Tr<D>::S* h_s, int k0, int k1,
                                        const RowWordT<D, kFW> (&wreg)[reg_slots(kRegW)],
                                        bool use_reg,
                                        float (&acc)[RowMap<D, BT, kWide>::kNV]) {
  using T = Tr<D>;
  using S = typename T::S;
  using M = RowMap<D, BT, kWide>;
  constexpr int kNV = M::kNV, kLPN = M::kLPN, kNS = kGroup / kLPN;
  static_assert(kGroup == 32 || kGroup == 16, "whole or half warps");
  const int H = p.H;
  const int lane = threadIdx.x & 31;
  const int sl = lane_row_slice(lane, kGroup, kLPN);
  const int b0 = (lane % kLPN) * kNV;
#pragma unroll
  for (int i = 0; i < kNV; ++i) acc[i] = 0.0f;
  if (k1 <= n_in) {
    int kr = k0;
    if constexpr (kRegW > 0) {
      if (use_reg) {  // this lane's first kRegW nonzeros of the row, held in wreg
        bool on[kRegW];
#pragma unroll
        for (int q = 0; q < kRegW; ++q) on[q] = k0 + sl + kNS * q < k1;
        dot_words<D, BT, kWide, kFW, kRegW>(wreg, on, h_s, H, b0, acc);
        kr = k0 + kRegW * kNS;
      }
    }
    row_rounds<kNS>(kr, k1, [&](auto shape, int k) {
      using R = decltype(shape);
      dot_round<D, BT, kWide, kFW, kNS, R::depth, R::predicated>(w_s, h_s, H, k + sl, k1, b0, acc);
    });
  } else {
    // Not on chip: the same rounds, from L2. Step probe, fp16, B=4, us/step, against the loop
    // before (4 nonzeros per lane in flight): ReLU H=4096 50% 14.76 -> 11.95, ReLU H=2304 30%
    // with 3/4 on chip 4.01 -> 3.84, LSTM H=4096 9.10 -> 8.98; rounds of 16 lost (LSTM H=4096
    // 11.46: the register-weights build runs out of registers; benchmarks/NOTES.md, session 25).
    const S* vals = static_cast<const S*>(p.values) + kb0;
    const int32_t* col_idx = p.col_idx + kb0;
    row_rounds<kNS>(k0, k1, [&](auto shape, int k) {
      using R = decltype(shape);
      dot_round_global<D, BT, kWide, kNS, R::depth, R::predicated>(vals, col_idx, h_s, H, k + sl,
                                                                   k1, b0, acc);
    });
  }
}

// The sums over a group's slices (lanes g, g + kLPN, ...) of each lane's kNV partial sums:
// afterwards every lane holds the sums of its columns. Every lane of the warp calls it.
template <int kNV, int kGroup, int kLPN>
__device__ __forceinline__ void sum_slices(float (&acc)[kNV]) {
#pragma unroll
  for (int off = kGroup / 2; off >= kLPN; off >>= 1) {
#pragma unroll
    for (int i = 0; i < kNV; ++i) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], off);
  }
}

// The same for kLPN = 1, transposing as it sums: at each of the first log2(kNV) levels a lane
// keeps half of its values (the upper half where the level's lane bit is set) and receives its
// partner's sums of that half, so the levels move kNV / 2, kNV / 4, ..., 1 values instead of
// kNV each (BT=4 fp16: 6 shuffles instead of 20; the block's warps share one shuffle unit).
// Step probe: LSTM H=4096 11.12 -> 10.82 us/step, the small layers unchanged. Returns the
// lane's sum, of column `col`; lanes g % (kGroup / kNV) == 0 hold each column once.
template <int kNV, int kGroup>
__device__ __forceinline__ float sum_slices_transposed(float (&acc)[kNV], int lane, int& col) {
  static_assert(kNV >= 2 && kNV <= kGroup, "one column per lane subgroup");
  int c = 0, off = kGroup / 2;
#pragma unroll
  for (int m = kNV; m > 1; m >>= 1, off >>= 1) {
    const bool upper = (lane & off) != 0;
#pragma unroll
    for (int i = 0; i < m / 2; ++i) {
      const float send = upper ? acc[i] : acc[i + m / 2];
      const float keep = upper ? acc[i + m / 2] : acc[i];
      acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
    }
    c = 2 * c + (upper ? 1 : 0);
  }
#pragma unroll
  for (; off >= 1; off >>= 1) acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], off);
  col = c;
  return acc[0];
}

// Step 2, the rows: rows [0, nrows) of the block (row r's nonzeros [rows_s[r], rows_s[r + 1]))
// into acc_s[r * BT + b], a group of kGroup lanes per row (row_dot): one warp per row, or two
// rows per warp at a time (kGroup = 16).
template <DType D, int BT, bool kWide, bool kFW, int kGroup, int kRegW>
__device__ __forceinline__ void compute_rows(const Params& p, const RowWordT<D, kFW>* w_s,
                                             long long kb0, long long n_in,
                                             const typename Tr<D>::S* h_s, const int* rows_s,
                                             int nrows,
                                             const RowWordT<D, kFW> (&wreg)[reg_slots(kRegW)],
                                             float* acc_s) {
  using M = RowMap<D, BT, kWide>;
  constexpr int kRowsPerWarp = 32 / kGroup;
  const int lane = threadIdx.x & 31;
  const int g = lane % kGroup;
  for (int base = (threadIdx.x >> 5) * kRowsPerWarp; base < nrows;
       base += (blockDim.x >> 5) * kRowsPerWarp) {  // the same trip count in the whole warp
    const int r = base + lane / kGroup;  // lane_first_row in the first pass
    const bool has_row = r < nrows;
    float acc[M::kNV];
    const bool first_pass = base < (blockDim.x >> 5) * kRowsPerWarp;  // wreg's row
    row_dot<D, BT, kWide, kFW, kGroup, kRegW>(p, w_s, kb0, n_in, h_s, has_row ? rows_s[r] : 0,
                                              has_row ? rows_s[r + 1] : 0, wreg, first_pass,
                                              acc);
    if constexpr (M::kLPN == 1 && M::kNV >= 2 && M::kNV <= 8) {
      int col;
      const float sum = sum_slices_transposed<M::kNV, kGroup>(acc, lane, col);
      if (has_row && g % (kGroup / M::kNV) == 0) acc_s[r * BT + col] = sum;
    } else {
      sum_slices<M::kNV, kGroup, M::kLPN>(acc);
      if (has_row && g < M::kLPN) {  // slice 0 holds the sums of batch columns [b0, b0 + kNV)
#pragma unroll
        for (int i = 0; i < M::kNV; ++i) acc_s[r * BT + g * M::kNV + i] = acc[i];
      }
    }
  }
}

// The G row results of pair (unit ul, tile column bt) from acc_s.
template <int G, int BT>
__device__ __forceinline__ void row_sums(const float* acc_s, int ul, int bt, float* hw) {
#pragma unroll
  for (int g = 0; g < G; ++g) hw[g] = acc_s[(ul * G + g) * BT + bt];
}

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

// ---- the persistent kernel ----------------------------------------------------------------------

// Threads per block persistent_fwd is built for (register budget: 65536 / threads): 512, so
// 128 registers. At 1024 threads (64 registers) every tile spilled (the step probe found the
// spill loads on the cell-update path, and local memory misses the small L1 beside 227 KB of
// shared memory). The planner never launches more. (A macro only so that the step probe can
// build the 1024-thread kernel for comparison.)
#ifndef SPRNN_PERSISTENT_THREADS
#define SPRNN_PERSISTENT_THREADS 512
#endif
constexpr int kPersistentThreads = SPRNN_PERSISTENT_THREADS;

}  // namespace cuda
}  // namespace sprnn
#include "cuda/mma_rows.cuh"  // (needs Params, Tr and kPersistentThreads above)
namespace sprnn {
namespace cuda {

// One gathered chunk of N values into the h tile: store_h, or the mma build's batch-major tile
// of hs units per batch column (store_h_t).
template <DType D, int BT, int N, bool kWide, bool kBatchMajor>
__device__ __forceinline__ void store_tile(typename Tr<D>::S* h_s, int H, int hs, int item,
                                           const uint32_t* bits) {
  if constexpr (kBatchMajor)
    store_h_t<D, BT, N>(reinterpret_cast<uint16_t*>(h_s), hs, item, bits);
  else
    store_h<typename Tr<D>::S, BT, N, kWide>(h_s, H, item, bits);
}

// Threads per CTA the cluster kernel (cluster_kernel.cuh) is built for: tiles of 16 run 512
// threads with up to 128 registers, smaller tiles 1024.
__host__ __device__ constexpr int max_threads_of_tile(int bt) { return bt >= 16 ? 512 : 1024; }

// kCell: kRnnTanh stands for rnn (activation at run time), kLstm, kGru. kDeepGather, kRegW and
// kFloatWords select the builds of gather_words, kRegWeights and RowWord.
template <Cell kCell, DType D, int BT, bool kWide, bool kDeepGather = false, int kRegW = 0,
          bool kFloatWords = false, int kMma = 0>
__global__ void __launch_bounds__(kPersistentThreads, 1) persistent_fwd(Params p) {
  using T = Tr<D>;
  using S = typename T::S;
  using XW = XWord<kCell, D, BT>;
  using X = typename XW::X;  // loaded by the gather
  using P = typename XW::P;  // published per value
  using W = RowWordT<D, kFloatWords>;
  constexpr int G = gates_of(kCell);
  constexpr bool kLstmCell = kCell == Cell::kLstm;
  // Gathers move h in chunks of at most 32 bytes per thread: kCW exchange words (Lamport: kXU
  // words per unit, kCV values per chunk) or kRW raw values (barrier mode, h0); a unit is kCPU
  // (kRPU) consecutive chunks. Tiles up to 8 (16-bit) / 4 (float32) are one chunk per unit.
  // Units under 16 bytes travel kUPC to a chunk (chunk_units).
  constexpr int kXU = BT / XW::kVals;
  constexpr int kUPC = kWide ? chunk_units(static_cast<int>(sizeof(X)) * kXU) : 1;
  constexpr int kCW = kXU * kUPC <= 32 / static_cast<int>(sizeof(X)) ? kXU * kUPC : 32 / static_cast<int>(sizeof(X));
  constexpr int kCV = kCW * XW::kVals;
  constexpr int kCPU = kXU / kCW > 1 ? kXU / kCW : 1;
  constexpr int kRW = static_cast<int>(sizeof(S)) * BT <= 32 ? BT : 32 / static_cast<int>(sizeof(S));
  constexpr int kRPU = BT / kRW;
  // Chunks in flight per thread: up to 128 bytes, or 256 in the deep-gather build.
  constexpr int K = gather_units(static_cast<int>(sizeof(P)), BT, kDeepGather) / kUPC;
  static_assert(K >= 1, "a round holds at least one chunk");
  // Row mapping (RowMap): tiles up to 8 (16-bit) / 4 (float32) have kLPN = 1, every lane its
  // own nonzeros with the whole tile (the original mapping). Larger tiles ("batch lanes"): the
  // kLPN lanes of a slice read one weight (a shared-memory broadcast) and contiguous h
  // (h_s[col * BT + b0 .. + kNV]); registers stay those of BT = 8.
  constexpr int kNV = RowMap<D, BT, kWide>::kNV;
  constexpr int kLPN = RowMap<D, BT, kWide>::kLPN;
  // The needed-column filter (p.col_filter) is built into the large-tile kernels only: that is
  // where the h gathers dominate (H * BT words per block and round). For tiles up to 8 its
  // per-item check cost more than the loads it saved (step probe: 2.40 vs 2.01 us/step at
  // ReLU H=1152, B=4; again in session 6: 2.25 vs 1.82).
  constexpr bool kFilter = BT >= 16;
  static_assert(BT % XW::kVals == 0 && (kUPC > 1 || kXU % kCW == 0) && BT % kRW == 0 && BT % kNV == 0 && kLPN <= 32, "tile");
  static_assert(kWide || (kCPU == 1 && kRPU == 1 && kLPN == 1), "naive layout: whole units");
  static_assert(!kFilter || kUPC == 1, "the column filter skips whole chunks of one unit");

  extern __shared__ __align__(16) unsigned char smem[];
  SPRNN_PROBE_INIT;
  const int tid = threadIdx.x;
  const int nthr = blockDim.x;
  const int H = p.H, B = p.B;
  const int bpad = p.ntiles * BT;
  // Batch groups (p.groups > 1, one tile each): this block is block `jb` of the nb blocks that
  // run tile `grp`; the tiles' exchanges never meet. Otherwise nb = the grid, running every tile.
  const int groups = p.groups > 1 ? p.groups : 1;
  const int nb = gridDim.x / groups;
  const int grp = blockIdx.x / nb, jb = blockIdx.x % nb;
  if (grp >= groups) return;  // the host launches groups * nb blocks; never read past the plan
  const int j_lo = groups > 1 ? grp : 0, j_hi = groups > 1 ? grp + 1 : p.ntiles;
  const int b_lo = j_lo * BT, b_hi = j_hi * BT < B ? j_hi * BT : B;

  __shared__ int sh_u[2];
  __shared__ int sh_lmax;
  if (tid == 0) {
    int u0, u1;
    unit_range(p, G, jb, nb, u0, u1);
    sh_u[0] = u0;
    sh_u[1] = u1;
    sh_lmax = max_seq_len(p, b_lo, b_hi);
  }
  __syncthreads();
  const int u0 = sh_u[0];
  const int nu = sh_u[1] - u0;
  const int lmax = sh_lmax;
  if (nu > p.u_cap) {  // cannot happen with the host's bound; never corrupt shared memory
    if (tid == 0) atomicExch(p.abort_flag, 2);
    return;
  }
  static_assert(kMma == 0 || (D != DType::kF32 && kWide && BT % 2 == 0 && kRegW == 0), "mma build");
  const int hs = kMma > 0 ? mma_h_stride(H) : H;  // the mma build's batch-major h tile
  const SmemLayout L = smem_layout(H, BT, bpad, G, kLstmCell, p.u_cap, p.w_cap,
                                   static_cast<int>(sizeof(S)), static_cast<int>(sizeof(W)), 1, 0,
                                   kMma > 0 ? hs : 0);
  S* h_s = reinterpret_cast<S*>(smem + L.h_off);
  uint32_t* cmask = reinterpret_cast<uint32_t*>(smem + L.m_off);
  float* acc_s = reinterpret_cast<float*>(smem + L.acc_off);
  float* hst = reinterpret_cast<float*>(smem + L.hst_off);
  float* cst = reinterpret_cast<float*>(smem + L.cst_off);
  int* len_s = reinterpret_cast<int*>(smem + L.len_off);  // clamped lengths of the bpad columns
  // The weight region (w_cap words) holds this block's row offsets (from kb0), then as many of
  // its nonzeros as fit: sized by the block's own rows, not the worst case u_cap.
  const long long rows_bytes = align16(static_cast<long long>(nu * G + 1) * 4);
  int* rows_s = reinterpret_cast<int*>(smem + L.w_off);
  W* w_s = reinterpret_cast<W*>(smem + L.w_off + rows_bytes);
  const long long w_room = p.w_cap - rows_bytes / static_cast<long long>(sizeof(W));

  const int32_t* row_ptr = p.row_ptr;
  const long long kb0 = __ldg(row_ptr + static_cast<long long>(u0) * G);
  const long long kb1 = __ldg(row_ptr + static_cast<long long>(u0 + nu) * G);
  const long long n_in = (kb1 - kb0) < w_room ? (kb1 - kb0) : (w_room > 0 ? w_room : 0);

  // Load this block's nonzeros (as many as fit) and its initial state, and mark the h units
  // its rows read (col_filter): the gathers skip the others (fewer L2 reads per step, most
  // with many blocks and low density). Lamport's two-slot rule needs every block to read at
  // least one unit of every non-empty block each step (a block that overwrote slot s-1 with
  // step s+1 must have seen every reader publish step s, i.e. finish its reads of step s-1),
  // so each block's first unit is marked too. A block without units reads nothing (nobody
  // waits for it and it needs no h).
  if constexpr (kMma == 0) load_weights<D, kFloatWords>(p, kb0, n_in, w_s, BT * static_cast<int>(sizeof(S)));
  load_step_constants(p, 0, bpad, len_s, static_cast<long long>(u0) * G, nu * G, kb0, rows_s);
  const bool filter = kFilter && p.col_filter != 0;
  if (filter)
    for (int i = tid; i < (H + 31) >> 5; i += nthr) cmask[i] = 0u;
  init_state<kCell, D>(p, u0, nu, 0, bpad, hst, cst);
  __syncthreads();
  // (cmask is first read after step 0's gather barrier.)
  if (filter && nu > 0) mark_columns(p, G, kb0, kb1, nb, cmask);

  // The mma build's A fragments, from a dense tile in the weight region (which then holds the
  // warps' partial sums); its h tile is zeroed once (the units past H stay zero).
  MmaRegs<kMma> areg;
  float* mma_part = reinterpret_cast<float*>(w_s);
  if constexpr (kMma > 0) {
    if (!mma_fits(kMma, nu * G, H, nthr >> 5) ||
        w_room * static_cast<long long>(sizeof(W)) < mma_region_bytes(kMma, nu * G, H, nthr >> 5)) {
      if (tid == 0) atomicExch(p.abort_flag, 5);  // the host reruns the call (handlers.cu)
      return;
    }
    for (int i = tid; i < BT * hs / 2; i += nthr) reinterpret_cast<uint32_t*>(h_s)[i] = 0u;
    mma_load_regs<D, kMma>(p, kb0, rows_s, nu * G, reinterpret_cast<uint16_t*>(w_s), areg);
  }
  MmaStep mma{};
  if constexpr (kMma > 0) mma = mma_step<kMma>(reinterpret_cast<const uint16_t*>(h_s), H, nu * G, BT, mma_part);

  const int npairs = nu * BT;
  const bool half_warps = two_rows_per_warp(nu * G, nthr >> 5, p.row_lanes);
  // Register weights (kRegW): the nonzeros of this lane's first row that row_dot's register
  // round takes (the same lane, row and order as there; rows wholly on chip only).
  static_assert(kRegW == 0 || D != DType::kF32, "register weights: 16-bit weights only");
  W wreg[reg_slots(kRegW)] = {};
  if constexpr (kRegW > 0) {
    const int group = half_warps ? 16 : 32;
    const int r = lane_first_row(tid, group);
    const int sl = lane_row_slice(tid & 31, group, kLPN), ns = group / kLPN;
    if (r < nu * G && rows_s[r + 1] <= n_in) {
#pragma unroll
      for (int q = 0; q < kRegW; ++q) {
        const int k = rows_s[r] + sl + ns * q;
        wreg[q] = k < rows_s[r + 1] ? w_s[k] : W{};
      }
    }
  }
  // Units per tile in the exchange buffer: the chunked gathers need 16-byte aligned tiles; the
  // other builds keep H (their code, registers and all, as before the chunks).
  const int Hx = kUPC > 1 ? static_cast<int>(exchange_units(H)) : H;
  // The block of the last unit (not an empty block after it, which nobody waits for) publishes
  // the units past H of the gather's last chunk.
  const int pad_pairs =
      kUPC > 1 && p.lamport && nu > 0 && u0 + nu == H ? ((H + kUPC - 1) / kUPC * kUPC - H) * BT : 0;
  X* xtag = static_cast<X*>(p.xbuf);
  S* xraw = static_cast<S*>(p.xbuf);

  // The mma build: whether this thread stored or made an inf or NaN h (nonfinite_bits). The
  // call then runs to its end and raises flag 4 there, for the host's rerun: a flag per step
  // lengthened the step (session 32).
  bool saw_nonfinite = false;
  for (int s = 0; s < lmax; ++s) {
    for (int j = j_lo; j < j_hi; ++j) {
      const long long tile_off = (static_cast<long long>((s & 1) * p.ntiles + j) * Hx) * BT;
      const long long prev_off = (static_cast<long long>(((s + 1) & 1) * p.ntiles + j) * Hx) * BT;

      // This thread's first (unit, b) pair: its step, publish offset and input projection
      // (the loads in flight while the block waits for h), ready for the update.
      S xr[G] = {};
      PairStep ps0{};
      long long xo0 = 0;
      if (tid < npairs) {
        const int b = j * BT + tid % BT, u = u0 + tid / BT;
        ps0 = pair_step(p, s, len_s[b], b, u);
        xo0 = tile_off + static_cast<long long>(u) * BT + tid % BT;
        if (ps0.valid) load_x_pair<D, G>(p, ps0, u, xr);
      }

      // 1. h_{s-1} of this tile into shared memory.
      SPRNN_PROBE_STAMP(s, 0);
      bool aborted = false;
      if (s == 0) {
        for (int it = tid; it < H * kRPU; it += nthr) {
          const int u = it / kRPU, c0 = (it % kRPU) * kRW;
          uint32_t bits[kRW];
#pragma unroll
          for (int i = 0; i < kRW; ++i) {
            const int b = j * BT + c0 + i;
            bits[i] = b < B ? T::f_to_bits(T::to_f(static_cast<const S*>(p.h0)[static_cast<long long>(b) * H + u])) : 0u;
            if constexpr (kMma > 0) saw_nonfinite = saw_nonfinite || nonfinite_bits<D>(bits[i]);
          }
          store_tile<D, BT, kRW, kWide, (kMma > 0)>(h_s, H, hs, it, bits);
        }
      } else if (!p.lamport) {
        if (tid == 0) {
          const unsigned int target = static_cast<unsigned int>(s) * static_cast<unsigned int>(nb);
          unsigned long long start = 0;
          int it = 0;
          while (static_cast<int>(ld_acquire(p.counters + j) - target) < 0) {
            if (p.spin_ns) __nanosleep(p.spin_ns);
            if ((++it & 63) == 0 && wait_expired(p, start)) { aborted = true; break; }
          }
          __threadfence();
        }
        if (__syncthreads_or(aborted)) return;
        const S* src = xraw + prev_off;
        for (int it = tid; it < H * kRPU; it += nthr) {
          if (filter && !((cmask[(it / kRPU) >> 5] >> ((it / kRPU) & 31)) & 1u)) continue;
          uint32_t bits[kRW];
          if constexpr (sizeof(S) * kRW >= 16) {
#pragma unroll
            for (int i = 0; i < static_cast<int>(sizeof(S)) * kRW / 16; ++i) {
              const uint4 v = __ldcg(reinterpret_cast<const uint4*>(src + static_cast<long long>(it) * kRW) + i);
              const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
              for (int q = 0; q < 4; ++q) {
                if constexpr (sizeof(S) == 4) {
                  bits[i * 4 + q] = w[q];
                } else {
                  bits[i * 8 + 2 * q] = w[q] & 0xffffu;
                  bits[i * 8 + 2 * q + 1] = w[q] >> 16;
                }
              }
            }
          } else {
#pragma unroll
            for (int i = 0; i < kRW; ++i) {
              if constexpr (sizeof(S) == 4) {
                bits[i] = __float_as_uint(__ldcg(reinterpret_cast<const float*>(src) + static_cast<long long>(it) * kRW + i));
              } else {
                bits[i] = __ldcg(reinterpret_cast<const unsigned short*>(src) + static_cast<long long>(it) * kRW + i);
              }
            }
          }
          store_tile<D, BT, kRW, kWide, (kMma > 0)>(h_s, H, hs, it, bits);
        }
      } else {
        const X tag = XW::tag_word(s - 1);
        const int nitems = (H * kCPU + kUPC - 1) / kUPC;  // chunks
        const X* src = xtag + prev_off / XW::kVals;
        unsigned long long start = 0;
        // Rounds of up to K chunks per thread (items ib, ib + nthr, ...): all loads of a round
        // are issued before any tag is checked, and only the pending ones are polled again.
        // Branch-free on the common path (predicated loads): this loop's instructions were
        // most of a small layer's step (step probe profile, benchmarks/NOTES.md).
        for (int ib = tid; ib < nitems && !aborted; ib += nthr * K) {
          const int left = ib + (K - 1) * nthr < nitems ? K : (nitems - ib + nthr - 1) / nthr;
          unsigned int pending = left >= K ? (1u << K) - 1u : (1u << left) - 1u;
          if (filter) {
#pragma unroll
            for (int i = 0; i < K; ++i) {
              const int u = (ib + i * nthr) / kCPU;
              if ((pending >> i) & 1u) pending &= ~(((~cmask[u >> 5] >> (u & 31)) & 1u) << i);
            }
          }
          int spins = 0;
          while (pending) {
            X w[K][kCW] = {};
#pragma unroll
            for (int i = 0; i < K; ++i)
              load_x<X, kCW>(src + static_cast<long long>(ib + i * nthr) * kCW, w[i], (pending >> i) & 1u);
#pragma unroll
            for (int i = 0; i < K; ++i) {
              if (i >= left) break;  // items past the end: none in this round
              bool ok = (pending >> i) & 1u;
#pragma unroll
              for (int q = 0; q < kCW; ++q) ok = ok && (XW::ok(w[i][q], tag) || SPRNN_PROBE_MODE == 2);
              if (ok) {
                uint32_t bits[kCV];
#pragma unroll
                for (int q = 0; q < kCV; ++q) bits[q] = XW::value(w[i][q / XW::kVals], q % XW::kVals);
                store_tile<D, BT, kCV, kWide, (kMma > 0)>(h_s, H, hs, ib + i * nthr, bits);
                pending &= ~(1u << i);
              }
            }
            if (pending) {
              if (p.spin_ns) __nanosleep(p.spin_ns);
              if ((++spins & 31) == 0 && wait_expired(p, start)) { aborted = true; break; }
            }
          }
        }
      }
      if (__syncthreads_or(aborted)) return;
      SPRNN_PROBE_STAMP(s, 1);

      // 2. Rows (compute_rows above).
      if constexpr (kMma > 0) {
        if (SPRNN_PROBE_MODE != 1)
          mma_rows<D, BT, kMma>(mma, nu * G, areg, mma_part, acc_s);
      } else if (SPRNN_PROBE_MODE != 1) {
        if (half_warps)
          compute_rows<D, BT, kWide, kFloatWords, 16, kRegW>(p, w_s, kb0, n_in, h_s, rows_s,
                                                             nu * G, wreg, acc_s);
        else
          compute_rows<D, BT, kWide, kFloatWords, 32, kRegW>(p, w_s, kb0, n_in, h_s, rows_s,
                                                             nu * G, wreg, acc_s);
      }
      __syncthreads();
      SPRNN_PROBE_STAMP(s, 2);

      // 3. Cell update and publish.
      for (int pi = tid; pi < npairs; pi += nthr) {
        const int ul = pi / BT, bt = pi % BT;
        const int b = j * BT + bt;
        const bool first = pi == tid;
        float hw[G];
        row_sums<G, BT>(acc_s, ul, bt, hw);
        const float hnew =
            update_pair<kCell, D>(p, first ? ps0 : pair_step(p, s, len_s[b], b, u0 + ul), u0 + ul,
                                  b, ul * bpad + b, first, xr, hw, hst, cst);
        // h_s of this tile and step (Lamport: value + tag word; barrier mode: raw value).
        const long long xo = first ? xo0 : tile_off + static_cast<long long>(u0 + ul) * BT + bt;
        if (p.lamport) {
          const uint32_t bits = T::f_to_bits(hnew);
          st_relaxed(static_cast<P*>(p.xbuf) + xo, XW::publish(bits, s));
          if constexpr (kMma > 0) saw_nonfinite = saw_nonfinite || nonfinite_bits<D>(bits);
        } else if constexpr (sizeof(S) == 4) {
          __stcg(reinterpret_cast<float*>(xraw) + xo, hnew);
        } else {
          __stcg(reinterpret_cast<unsigned short*>(xraw) + xo, static_cast<unsigned short>(T::f_to_bits(hnew)));
        }
      }
      if constexpr (kUPC > 1) {
        if (tid < pad_pairs)  // the last chunk's units past H: zeros
          st_relaxed(static_cast<P*>(p.xbuf) + tile_off + static_cast<long long>(H) * BT + tid,
                     XW::publish(0u, s));
      }
      SPRNN_PROBE_STAMP(s, 3);
      if (!p.lamport) {
        __syncthreads();
        if (tid == 0) {
          __threadfence();
          atomicAdd(p.counters + j, 1u);
        }
      } else if (SPRNN_PROBE_MODE == 3) {
        __syncthreads();
      }
    }
  }

  // Flag 4: the mma build met inf or NaN in h; the host reruns the call (handlers.cu).
  if constexpr (kMma > 0)
    if (saw_nonfinite) atomicCAS(p.abort_flag, 0, 4);
  // Padding steps after the longest sequence, and the final carry of this block's columns
  // (hst/cst were written by the cell-update threads: barrier first).
  __syncthreads();
  write_tail<kCell, D>(p, u0, nu, lmax, b_lo, b_hi, bpad, hst + b_lo, cst + b_lo);
}

// ---- fallback: one non-persistent launch per step ------------------------------------------
//
// For layers whose h tile and state do not fit in shared memory, or GPUs that cannot run the
// cooperative grid. One warp per (unit, b); h is double-buffered in float32 in the workspace.
// hbuf: 2 x B x H floats, cbuf: B x H floats (lstm), both initialised by step_init.
template <Cell kCell, DType D>
__global__ void step_init(Params p, float* hbuf, float* cbuf) {
  using T = Tr<D>;
  using S = typename T::S;
  const long long n = static_cast<long long>(p.B) * p.H;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    hbuf[i] = T::to_f(static_cast<const S*>(p.h0)[i]);
    if constexpr (kCell == Cell::kLstm) cbuf[i] = T::to_f(static_cast<const S*>(p.c0)[i]);
  }
}

template <Cell kCell, DType D>
__global__ void step_fwd(Params p, int s, float* hbuf, float* cbuf) {
  using T = Tr<D>;
  using S = typename T::S;
  constexpr int G = gates_of(kCell);
  const int lane = threadIdx.x & 31;
  const long long wid = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) >> 5;
  const int H = p.H, B = p.B;
  if (wid >= static_cast<long long>(H) * B) return;
  const int u = static_cast<int>(wid % H);
  const int b = static_cast<int>(wid / H);
  const float* hin = hbuf + (s & 1) * static_cast<long long>(B) * H;
  float* hout = hbuf + ((s + 1) & 1) * static_cast<long long>(B) * H;
  const int len = seq_len(p, b);
  const long long bi = static_cast<long long>(b) * H + u;
  const float hprev = hin[bi];
  if (s >= len) {
    if (lane == 0) {
      hout[bi] = hprev;
      const long long o = (static_cast<long long>(s) * B + b) * H + u;
      static_cast<S*>(p.ys)[o] = T::from_f(0.0f);
      if constexpr (kCell == Cell::kLstm) static_cast<S*>(p.cs)[o] = T::from_f(0.0f);
    }
    return;
  }
  const S* vals = static_cast<const S*>(p.values);
  float hw[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const long long r = static_cast<long long>(u) * G + g;
    const int k0 = __ldg(p.row_ptr + r), k1 = __ldg(p.row_ptr + r + 1);
    float a = 0.0f;
    for (int k = k0 + lane; k < k1; k += 32)
      a = fmaf(T::to_f(vals[k]), hin[static_cast<long long>(b) * H + __ldg(p.col_idx + k)], a);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
    hw[g] = a;
  }
  if (lane != 0) return;
  const int t = step_time(s, len, p.reverse != 0);
  const S* xq = static_cast<const S*>(p.xp) + (static_cast<long long>(t) * B + b) * G * static_cast<long long>(H) + u;
  float x[G];
#pragma unroll
  for (int g = 0; g < G; ++g) x[g] = T::to_f(xq[static_cast<long long>(g) * H]);
  const long long o = (static_cast<long long>(t) * B + b) * H + u;
  float hnew;
  if constexpr (kCell == Cell::kLstm) {
    float pre[4];
#pragma unroll
    for (int g = 0; g < 4; ++g) pre[g] = x[g] + hw[g];
    float c = cbuf[bi];
    hnew = lstm_step(pre, c);
    cbuf[bi] = c;
    static_cast<S*>(p.cs)[o] = T::from_f(c);
  } else if constexpr (kCell == Cell::kGru) {
    hnew = gru_step(x, hw, T::to_f(static_cast<const S*>(p.b_hn)[u]), hprev);
  } else {
    hnew = p.activation ? rnn_step<Cell::kRnnRelu>(x[0], hw[0]) : rnn_step<Cell::kRnnTanh>(x[0], hw[0]);
  }
  hout[bi] = hnew;
  static_cast<S*>(p.ys)[o] = T::from_f(hnew);
}

template <Cell kCell, DType D>
__global__ void step_final(Params p, const float* hfin, const float* cbuf) {
  using T = Tr<D>;
  using S = typename T::S;
  const long long n = static_cast<long long>(p.B) * p.H;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    static_cast<S*>(p.hT)[i] = T::from_f(hfin[i]);
    if constexpr (kCell == Cell::kLstm) static_cast<S*>(p.cT)[i] = T::from_f(cbuf[i]);
  }
}

}  // namespace cuda
}  // namespace sprnn
