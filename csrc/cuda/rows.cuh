// Step 2 of the persistent kernel on the CUDA cores: the dot products of a block's rows with h,
// in rounds of nonzeros per lane (from shared memory, registers or L2), reduced across lanes.
#pragma once

#include "cuda/step_inputs.cuh"

namespace sprnn {
namespace cuda {

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
template <DType D, int BT, bool kWide, Words kWords, int kDepth>
__device__ __forceinline__ void dot_words(const RowWordT<D, kWords> (&wq)[kDepth],
                                          const bool (&on)[kDepth], const typename Tr<D>::S* h_s,
                                          int H, int b0,
                                          float (&acc)[RowMap<D, BT, kWide>::kNV]) {
  float v[kDepth];
  int loc[kDepth];
#pragma unroll
  for (int q = 0; q < kDepth; ++q) RowWord<D, kWords>::unpack(wq[q], v[q], loc[q]);
  dot_located<D, BT, kWide, byte_offset_words(kWords), kDepth>(v, loc, on, h_s, H, b0, acc);
}

// One round of row_dot from shared memory: this lane's nonzeros k, k + kNS, ...,
// k + (kDepth - 1) * kNS (with kPredicated, only those below k1), all weight loads first, then
// dot_words.
template <DType D, int BT, bool kWide, Words kWords, int kNS, int kDepth, bool kPredicated>
__device__ __forceinline__ void dot_round(const RowWordT<D, kWords>* w_s,
                                          const typename Tr<D>::S* h_s, int H, int k, int k1,
                                          int b0, float (&acc)[RowMap<D, BT, kWide>::kNV]) {
  using W = RowWordT<D, kWords>;
  W wq[kDepth];
  bool on[kDepth];
#pragma unroll
  for (int q = 0; q < kDepth; ++q) {
    on[q] = !kPredicated || k + kNS * q < k1;
    wq[q] = on[q] ? w_s[k + kNS * q] : W{};
  }
  dot_words<D, BT, kWide, kWords, kDepth>(wq, on, h_s, H, b0, acc);
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
template <DType D, int BT, bool kWide, Words kWords, int kGroup, int kRegW>
__device__ __forceinline__ void row_dot(const Params& p, const RowWordT<D, kWords>* w_s,
                                        long long kb0, long long n_in,
                                        const typename Tr<D>::S* h_s, int k0, int k1,
                                        const RowWordT<D, kWords> (&wreg)[reg_slots(kRegW)],
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
        dot_words<D, BT, kWide, kWords, kRegW>(wreg, on, h_s, H, b0, acc);
        kr = k0 + kRegW * kNS;
      }
    }
    row_rounds<kNS>(kr, k1, [&](auto shape, int k) {
      using R = decltype(shape);
      dot_round<D, BT, kWide, kWords, kNS, R::depth, R::predicated>(w_s, h_s, H, k + sl, k1, b0, acc);
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
template <DType D, int BT, bool kWide, Words kWords, int kGroup, int kRegW>
__device__ __forceinline__ void compute_rows(const Params& p, const RowWordT<D, kWords>* w_s,
                                             long long kb0, long long n_in,
                                             const typename Tr<D>::S* h_s, const int* rows_s,
                                             int nrows,
                                             const RowWordT<D, kWords> (&wreg)[reg_slots(kRegW)],
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
    row_dot<D, BT, kWide, kWords, kGroup, kRegW>(p, w_s, kb0, n_in, h_s,
                                                 has_row ? rows_s[r] : 0,
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

}  // namespace cuda
}  // namespace sprnn
