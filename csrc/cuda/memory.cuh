// Memory helpers of the persistent kernels: timers, relaxed/acquire loads and stores of the
// exchange, the h tile in shared memory, and how many exchange words a gather keeps in flight.
#pragma once

#include "cuda/storage.cuh"

namespace sprnn {
namespace cuda {

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

}  // namespace cuda
}  // namespace sprnn
