// Tensor-core rows (persistent_fwd's kMma build, 16-bit weights, sm_80+): a block's rows as a
// dense tile whose mma.sync A fragments stay in registers for the whole kernel, so a step
// reads only h from shared memory. Included by persistent_kernel.cuh.
//
// Why: at high density the sparse rows are bound by shared-memory bytes and issue (~10-13
// instructions and ~14-18 bytes per nonzero and lane: ReLU H=2304 30% spends 1.35 us of its
// 2.4 us step there), while a block's 17-18 rows of H=2304 as dense 16-bit tiles are 110 KB of
// fragments, 60 registers per thread at 512 threads. One mma.sync m16n8k16 (float32
// accumulation) does 16 rows x 16 units x 8 batch columns. The cost found in session 9
// (benchmarks/NOTES.md): the SM clock drops from 1.98 to ~1.72 GHz while tensor cores run.
//
// Layouts (16-bit elements):
// - h tile, batch-major: h_t[b * mma_h_stride(H) + u]; units [H, stride) zero (an mma
//   multiplies every unit). The stride is 64 bytes mod 128 so that the 16-byte B loads of
//   batch rows 0-3 take the fewest wavefronts.
// - the warp's units: pairs of k-tiles, 32 units each; warp w takes pairs w, w + warps, ...
//   The k order inside a pair is permuted: mma k = 2c, 2c + 1, 2c + 8, 2c + 9 of k-tile t are
//   units 32 kp + 8c + 4t + 0..3, so lane (g, c) = (lane / 4, lane % 4) finds the B registers
//   of both k-tiles in 16 contiguous bytes of h row g.
#pragma once

#include "cuda/partition.cuh"  // Params, Tr, kPersistentThreads
#include "cuda/step_inputs.cuh"  // copy_nonzeros

namespace sprnn {
namespace cuda {

// Rows per block of the package's tensor-core build (launch.cuh; the step probe builds 32 too).
constexpr int kMmaRows = 24;

__host__ __device__ constexpr int mma_kpairs(int H) { return (H + 31) / 32; }
__host__ __device__ constexpr int mma_h_stride(int H) { return (mma_kpairs(H) * 32 + 63) / 64 * 64 + 32; }

// Pairs per warp (H <= 3072 at 512 threads) and how many of them stay in registers.
__host__ __device__ constexpr int mma_pairs_per_warp() { return 6; }
__host__ __device__ constexpr int mma_reg_pairs(int kRows) { return kRows > 24 ? 2 : 3; }
// 32-bit A words per lane, pair and k-tile of the rows past 16 (rows 16-23 or 16-31), and per
// lane and pair in all.
__host__ __device__ constexpr int mma_t1_words(int kRows) { return kRows > 24 ? 4 : 2; }
__host__ __device__ constexpr int mma_words(int kRows) { return 8 + 2 * mma_t1_words(kRows); }

// Registers of the kMma build for at most kRows rows per block (24 or 32): per pair and k-tile,
// tile 0's four A registers and tile 1's two (rows 16-23) or four (rows 16-31). Pairs per warp
// in registers: as many as fit beside the kernel's other registers without spills in the rows
// (ptxas, sm_90: 4 or 5 pairs at 24 rows, 3 at 32 spilled 24-176 bytes); the warp's other pairs
// are read from shared memory every step, in the same fragment order.
template <int kRows>
struct MmaRegs {
  static constexpr int kPairs = mma_reg_pairs(kRows);
  static constexpr int kExtra = mma_pairs_per_warp() - kPairs;
  static constexpr int kT1 = mma_t1_words(kRows);
  static constexpr int kWords = mma_words(kRows);
  uint32_t t0[kPairs][2][4];
  uint32_t t1[kPairs][2][kT1];
  // Pair i's words in fragment order (t0 of k-tiles 0, 1, then t1 of k-tiles 0, 1), the order
  // of the pairs kept in shared memory. (i is a compile-time index of an unrolled loop; the
  // clamp keeps the pairs past kPairs, which take the other branch, in range.)
  __device__ __forceinline__ void put(int i, const uint32_t (&w)[kWords]) {
    const int k = i < kPairs ? i : 0;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int q = 0; q < 4; ++q) t0[k][t][q] = w[4 * t + q];
#pragma unroll
      for (int q = 0; q < kT1; ++q) t1[k][t][q] = w[8 + kT1 * t + q];
    }
  }
  __device__ __forceinline__ void get(int i, uint32_t (&w)[kWords]) const {
    const int k = i < kPairs ? i : 0;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int q = 0; q < 4; ++q) w[4 * t + q] = t0[k][t][q];
#pragma unroll
      for (int q = 0; q < kT1; ++q) w[8 + kT1 * t + q] = t1[k][t][q];
    }
  }
};
template <>
struct MmaRegs<0> {};

// Whether a block of `rows` rows and `warps` warps fits the kMma build of kRows (the planner
// and the kernel's guard).
__host__ __device__ constexpr bool mma_fits(int kRows, int rows, int H, int warps) {
  return kRows > 0 && rows <= kRows && mma_kpairs(H) <= warps * mma_pairs_per_warp();
}

// The kMma build's weight region for a block of `rows` rows: the prologue's dense tile (rows x
// kpairs * 32 halves), whose bytes then hold the warps' partial sums (warps x 32 rows x up to 8
// batch columns of floats), then the fragments of the pairs past the registers (warps x extra
// pairs x 32 lanes x mma_words).
__host__ __device__ constexpr long long mma_tile_bytes(int rows, int H, int warps) {
  return static_cast<long long>(rows) * mma_kpairs(H) * 64 > static_cast<long long>(warps) * 32 * 8 * 4
             ? static_cast<long long>(rows) * mma_kpairs(H) * 64
             : static_cast<long long>(warps) * 32 * 8 * 4;
}
// Pairs per warp read from shared memory (past the registers') for H at `warps` warps.
__host__ __device__ constexpr int mma_extra_pairs(int kRows, int H, int warps) {
  return (mma_kpairs(H) + warps - 1) / warps > mma_reg_pairs(kRows)
             ? (mma_kpairs(H) + warps - 1) / warps - mma_reg_pairs(kRows)
             : 0;
}
__host__ __device__ constexpr long long mma_region_bytes(int kRows, int rows, int H, int warps) {
  return mma_tile_bytes(rows, H, warps) +
         static_cast<long long>(warps) * mma_extra_pairs(kRows, H, warps) * 32 * mma_words(kRows) * 4;
}

// Whether a 16-bit value's bits are inf or NaN (exponent all ones). A dense tile would multiply
// such an h by the zeros of pruned weights (0 * inf = NaN where the sparse rows skip them), so
// the mma build raises abort flag 4 at its end where it read one (h0) or made one (the update),
// and the host reruns the call on the sparse rows (persistent_fwd, handlers.cu). Checked where h
// is made, not where it is gathered: a check per gathered word cost the gather ~0.07 us/step
// (ReLU H=2304 30%, step probe, session 32).
template <DType D>
__device__ __forceinline__ bool nonfinite_bits(uint32_t bits) {
  constexpr uint32_t kExp = D == DType::kBF16 ? 0x7f80u : 0x7c00u;
  return (bits & kExp) == kExp;
}

// Stores chunk `item` (N values, elements item * N + q of the unit-major order) into the
// batch-major tile; two units at a time where the chunk holds whole pairs of units.
template <DType D, int BT, int N>
__device__ __forceinline__ void store_h_t(uint16_t* h_t, int hs, int item, const uint32_t* bits) {
  const int e = item * N;
  if constexpr (N % (2 * BT) == 0) {
#pragma unroll
    for (int q = 0; q < N; q += 2 * BT)
#pragma unroll
      for (int b = 0; b < BT; ++b)
        *reinterpret_cast<uint32_t*>(h_t + b * hs + (e + q) / BT) =
            (bits[q + b] & 0xffffu) | (bits[q + BT + b] << 16);
  } else {
#pragma unroll
    for (int q = 0; q < N; ++q)
      h_t[((e + q) % BT) * hs + (e + q) / BT] = static_cast<uint16_t>(bits[q]);
  }
}

// The prologue: this block's `nrows` rows (row r's nonzeros [rows_s[r], rows_s[r + 1]) from
// kb0) as a dense tile in `tile` (rows x kpairs * 32 halves, zeroed here), then each warp's A
// fragments into registers. Entries of a pattern listed twice keep one value (SparseWeights
// never lists one twice).
template <DType D, int kRows>
__device__ __forceinline__ void mma_load_regs(const Params& p, long long kb0, const int* rows_s,
                                              int nrows, uint16_t* tile, MmaRegs<kRows>& a) {
  using T = Tr<D>;
  const int kp = mma_kpairs(p.H), hp = kp * 32;
  for (int i = threadIdx.x; i < nrows * hp / 2; i += blockDim.x) reinterpret_cast<uint32_t*>(tile)[i] = 0u;
  __syncthreads();
  for (int r = threadIdx.x >> 5; r < nrows; r += blockDim.x >> 5)
    copy_nonzeros<D>(p, kb0, rows_s[r] + (threadIdx.x & 31), rows_s[r + 1], 32,
                     [&](long long, const Nonzero<D>& nz) {
                       tile[r * hp + nz.col] = static_cast<uint16_t>(T::f_to_bits(T::to_f(nz.value)));
                     });
  __syncthreads();
  using R = MmaRegs<kRows>;
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  uint32_t* extra = reinterpret_cast<uint32_t*>(reinterpret_cast<unsigned char*>(tile) +
                                                mma_tile_bytes(nrows, p.H, warps));
#pragma unroll
  for (int i = 0; i < R::kPairs + R::kExtra; ++i) {
    const int pair = warp + i * warps;
    uint32_t w[R::kWords];  // t0 of k-tiles 0, 1, then t1 of k-tiles 0, 1
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int u = pair * 32 + 8 * c + 4 * t;
      auto frag = [&](int row) {  // (k 2c, 2c+1), (k 2c+8, 2c+9) of row
        return pair < kp && row < nrows ? *reinterpret_cast<const uint2*>(tile + row * hp + u) : make_uint2(0u, 0u);
      };
      const uint2 r0 = frag(g), r1 = frag(g + 8), r2 = frag(g + 16);
      w[4 * t + 0] = r0.x;
      w[4 * t + 1] = r1.x;
      w[4 * t + 2] = r0.y;
      w[4 * t + 3] = r1.y;
      if constexpr (R::kT1 == 4) {
        const uint2 r3 = frag(g + 24);
        w[8 + 4 * t + 0] = r2.x;
        w[8 + 4 * t + 1] = r3.x;
        w[8 + 4 * t + 2] = r2.y;
        w[8 + 4 * t + 3] = r3.y;
      } else {
        w[8 + 2 * t + 0] = r2.x;
        w[8 + 2 * t + 1] = r2.y;
      }
    }
    if (i < R::kPairs) {
      a.put(i, w);
    } else if (i - R::kPairs < mma_extra_pairs(kRows, p.H, warps)) {
      uint32_t* e = extra + ((warp * mma_extra_pairs(kRows, p.H, warps) + i - R::kPairs) * R::kWords) * 32 + lane * 4;
#pragma unroll
      for (int q = 0; q < R::kWords; q += 4) *reinterpret_cast<uint4*>(e + q * 32) = make_uint4(w[q], w[q + 1], w[q + 2], w[q + 3]);
    }
  }
  __syncthreads();  // the tile's memory is the partial sums' afterwards
}

// d += a * b (m16n8k16, float32 accumulation).
template <DType D>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (D == DType::kBF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#else
  __trap();  // never launched below sm_80 (the planner's rule)
#endif
}

// Row result i (= r * BT + b) from the warps' partial sums, every load issued at once.
__device__ __forceinline__ float mma_row_sum(const float* part, int i, int warps, int BT) {
  constexpr int kMaxWarps = kPersistentThreads / 32;
  float v[kMaxWarps];
#pragma unroll
  for (int w = 0; w < kMaxWarps; ++w) v[w] = w < warps ? part[w * 32 * BT + i] : 0.0f;
  float sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kMaxWarps; ++w) sum += v[w];
  return sum;
}

// Per-block constants of mma_rows, computed once before the steps (no divisions per step).
struct MmaStep {
  int mine;      // pairs of this warp
  int ne;        // pairs per warp read from shared memory
  int bstep;     // halves between a lane's B loads of consecutive pairs (warps * 32)
  const uint16_t* b0;    // this lane's B fragments of its first pair
  const uint32_t* e0;    // this lane's first A words in shared memory
};
template <int kRows>
__device__ __forceinline__ MmaStep mma_step(const uint16_t* h_t, int H, int nrows, int BT, const float* part) {
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5, lane = threadIdx.x & 31;
  const int kp = mma_kpairs(H), ne = mma_extra_pairs(kRows, H, warps);
  // Lanes of batch rows g >= BT load batch row g % BT: B column g only feeds output column g,
  // which nobody reads, so no predicate is needed.
  const int g = (lane >> 2) % BT, c = lane & 3;
  return {warp < kp ? (kp - warp + warps - 1) / warps : 0, ne, warps * 32,
          h_t + g * mma_h_stride(H) + warp * 32 + 8 * c,
          reinterpret_cast<const uint32_t*>(reinterpret_cast<const unsigned char*>(part) + mma_tile_bytes(nrows, H, warps)) +
              warp * ne * MmaRegs<kRows>::kWords * 32 + lane * 4};
}

// Step 2 on the tensor cores, by every thread: each warp sums its pairs into partial sums
// (part: warps x 32 rows x BT floats), then the block adds them into acc_s[r * BT + b]. The
// caller barriers after. Few instructions per pair: every warp runs this once per step, and
// the first version (predicated pairs up to the maximum, divisions per step) issued ~290
// instructions per warp and step where the work needs ~40 (ncu, benchmarks/NOTES.md).
template <DType D, int BT, int kRows>
__device__ __forceinline__ void mma_rows(const MmaStep& m, int nrows, const MmaRegs<kRows>& a, float* part,
                                         float* acc_s) {
  static_assert(BT <= 8 && BT % 2 == 0, "one n-tile of batch columns, pairs of them per lane");
  using R = MmaRegs<kRows>;
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  const bool tile1 = nrows > 16;
  float d0[2][4] = {}, d1[2][4] = {};
#pragma unroll
  for (int i = 0; i < R::kPairs + R::kExtra; ++i) {
    if (i >= m.mine) break;  // warp-uniform
    uint32_t w[R::kWords];
    if (i < R::kPairs) {
      a.get(i, w);
    } else {
      const uint32_t* e = m.e0 + (i - R::kPairs) * R::kWords * 32;
#pragma unroll
      for (int q = 0; q < R::kWords; q += 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(e + q * 32);
        w[q] = v.x, w[q + 1] = v.y, w[q + 2] = v.z, w[q + 3] = v.w;
      }
    }
    const uint4 b = *reinterpret_cast<const uint4*>(m.b0 + i * m.bstep);
    const uint32_t bx[2][2] = {{b.x, b.y}, {b.z, b.w}};
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      mma_16816<D>(d0[t], w[4 * t], w[4 * t + 1], w[4 * t + 2], w[4 * t + 3], bx[t][0], bx[t][1]);
      if (tile1) {
        if constexpr (R::kT1 == 4)
          mma_16816<D>(d1[t], w[8 + 4 * t], w[9 + 4 * t], w[10 + 4 * t], w[11 + 4 * t], bx[t][0], bx[t][1]);
        else
          mma_16816<D>(d1[t], w[8 + 2 * t], 0u, w[9 + 2 * t], 0u, bx[t][0], bx[t][1]);
      }
    }
  }
  // Accumulator element q: row g + 8 (q / 2), batch column 2c + q % 2.
  if (2 * c < BT) {
    float* w = part + static_cast<long long>(warp) * 32 * BT;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int q = 2 * h;
      *reinterpret_cast<float2*>(w + (g + 8 * h) * BT + 2 * c) = make_float2(d0[0][q] + d0[1][q], d0[0][q + 1] + d0[1][q + 1]);
      if (tile1)
        *reinterpret_cast<float2*>(w + (g + 16 + 8 * h) * BT + 2 * c) = make_float2(d1[0][q] + d1[1][q], d1[0][q + 1] + d1[1][q + 1]);
    }
  }
  __syncthreads();
  // The warps' partials summed, every load issued at once.
  if (threadIdx.x < nrows * BT) acc_s[threadIdx.x] = mma_row_sum(part, threadIdx.x, warps, BT);
}

}  // namespace cuda
}  // namespace sprnn
