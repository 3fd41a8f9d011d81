// Dense tensor-core rows for 16-bit layers that fit on chip as dense tiles (the planner's `mma`
// plans, sm_80+; included by kernel_core.cuh, whose persistent_fwd<..., kMma = true> uses it).
//
// Why dense: a small layer's sparse rows are bound by latency and instruction issue (weight
// load, unpack, gather, four conversions and FMAs per nonzero and lane; benchmarks/NOTES.md),
// while one mma.sync m16n8k16 does 16 rows x 16 units x 8 batch columns with float32
// accumulation. At 10% density and above, a block's rows as a dense 16-bit tile are a few
// times the bytes of its packed nonzeros and still fit in shared memory for the layers whose
// step the rows dominate (ReLU H=1152..2304, LSTM H=1024). Pruned entries are zeros in the
// tile, so the sums are those of the sparse rows (up to float32 summation order), except that
// an infinite h then gives NaN in every row, as a dense matmul does.
//
// Layouts (16-bit elements):
// - h tile, batch-major: h_t[b * mma_h_stride(H) + u], units [H, stride) zero. The stride is
//   64 bytes mod 128, so a B-fragment load (4 or 8 batch rows x 64 bytes) takes the fewest
//   shared-memory wavefronts.
// - weights, fragment-major: the block's rows in tiles of 16 (mt) and its units in pairs of
//   k-tiles of 32 units (kp), plus one zero pair per row tile (kp = kpairs, where warps past
//   the end read, so that no load or mma needs a predicate). Per (mt, kp, k-tile t) 32 lanes x
//   the four A registers of mma.m16n8k16 (16 bytes: one conflict-free load). The k order
//   inside a k-tile is permuted: the mma's k = 2c, 2c + 1, 2c + 8, 2c + 9 of k-tile t are units
//   32 kp + 8c + 4t + 0..3, so lane (g, c) = (lane / 4, lane % 4) of the h tile's batch row g
//   finds the B registers of both k-tiles in 16 contiguous bytes (units 32 kp + 8c + 0..7).
#pragma once

namespace sprnn {
namespace cuda {

// Row tiles of 16 a block may have (accumulator registers: 4 floats each).
constexpr int kMmaMaxRowTiles = 4;
// Warps that split a block's k-tile pairs (each keeps one partial sum per row and column).
constexpr int kMmaMaxSplits = kPersistentThreads / 32;

__host__ __device__ constexpr int mma_kpairs(int H) { return (H + 31) / 32; }
__host__ __device__ constexpr int mma_row_tiles(int rows) { return (rows + 15) / 16; }
__host__ __device__ constexpr int mma_h_stride(int H) {
  return (mma_kpairs(H) * 32 + 63) / 64 * 64 + 32;
}
__host__ __device__ constexpr long long mma_h_bytes(int H, int BT) {
  return static_cast<long long>(BT) * mma_h_stride(H) * 2;
}
// Bytes of the dense weight tiles of `rows` rows.
// Bytes of the dense weight tiles of `rows` rows (with the zero pair of every row tile).
__host__ __device__ constexpr long long mma_a_bytes(int rows, int H) {
  return static_cast<long long>(mma_row_tiles(rows)) * (mma_kpairs(H) + 1) * 1024;
}
// Row results: the sums (16 * row tiles x BT floats, read by the cell update as acc_s) and the
// splits' partials (kMmaMaxSplits times as many).
__host__ __device__ constexpr long long mma_acc_bytes(int rows_cap, int BT) {
  return static_cast<long long>(kMmaMaxSplits + 1) * mma_row_tiles(rows_cap) * 16 * BT * 4;
}
// 4-byte words of the weight region: the row offsets (as persistent_fwd keeps them) + tiles.
__host__ __device__ constexpr long long mma_weight_words(int rows_cap, int H) {
  return (align16((static_cast<long long>(rows_cap) + 1) * 4) + mma_a_bytes(rows_cap, H)) / 4;
}
// The unit partition's per-unit cost (Params::alpha) for mma plans: every unit costs a dense
// row whatever its nonzeros, so blocks get equal unit counts (a row has at most 4 * 65535
// nonzeros, far below this).
constexpr int kMmaAlpha = 1 << 20;

__host__ __device__ inline SmemLayout mma_smem_layout(int H, int BT, int bpad, int G, bool lstm,
                                                      int u_cap) {
  return smem_layout(H, BT, bpad, G, lstm, u_cap,
                     static_cast<int>(mma_weight_words(u_cap * G, H)), 2, 4, 1, 0,
                     mma_h_bytes(H, BT), mma_acc_bytes(u_cap * G, BT));
}

// Element offset of (block row r, unit u) in the fragment-major tiles (header comment).
__device__ __forceinline__ long long mma_a_offset(int r, int u, int kpairs) {
  const int rr = r & 15, v = u & 31;
  const int lane = (rr & 7) * 4 + (v >> 3), t = (v >> 2) & 1;
  const int reg = (v & 2) + (rr >> 3);  // a0: row g, k 0-1; a1: row g + 8; a2, a3: k 2-3
  return (((((static_cast<long long>(r >> 4) * (kpairs + 1) + (u >> 5)) * 2 + t) * 32 + lane) * 4 +
           reg) << 1) + (v & 1);
}

// The block's rows [0, nrows) (row r's nonzeros [rows_s[r], rows_s[r + 1]) from kb0) into the
// dense tiles a_s, which the caller zeroed (and synchronised) first. Entries are added (a
// 32-bit compare-and-swap per element), so a pattern that lists an entry twice sums it.
template <DType D>
__device__ __forceinline__ void mma_load_weights(const Params& p, long long kb0, const int* rows_s,
                                                 int nrows, uint16_t* a_s) {
  using T = Tr<D>;
  const typename T::S* vals = static_cast<const typename T::S*>(p.values) + kb0;
  const int32_t* cols = p.col_idx + kb0;
  const int kp = mma_kpairs(p.H);
  for (int r = threadIdx.x >> 5; r < nrows; r += blockDim.x >> 5) {
    for (int k = rows_s[r] + (threadIdx.x & 31); k < rows_s[r + 1]; k += 32) {
      const long long o = mma_a_offset(r, __ldg(cols + k), kp);
      uint32_t* w = reinterpret_cast<uint32_t*>(a_s) + (o >> 1);
      const int sh = static_cast<int>(o & 1) * 16;
      const float v = T::to_f(vals[k]);
      uint32_t old = *w, seen;
      do {
        seen = old;
        const uint32_t sum = T::f_to_bits(T::bits_to_f((seen >> sh) & 0xffffu) + v) & 0xffffu;
        old = atomicCAS(w, seen, (seen & ~(0xffffu << sh)) | (sum << sh));
      } while (old != seen);
    }
  }
}

// d += a * b on the tensor cores (m16n8k16, float32 accumulation).
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
  // Never launched below sm_80 (the planner needs compute capability 8.0 for mma plans).
  __trap();
#endif
}

// Warp roles: warp w < splits (splits a multiple of the block's row tiles) takes row tile
// w % mtiles and k-tile pairs w / mtiles, + nsplit, + 2 nsplit, ... (nsplit = splits / mtiles).
// Its first kMmaRegPairs pairs' A fragments stay in registers for the whole kernel (loaded once
// by mma_load_registers): the step then reads only h from shared memory for them. A dense tile
// is several times the bytes of the packed nonzeros at 10% density, and reading it every step
// made the rows shared-memory bound (step probe: LSTM H=1024 rows 0.65 us sparse, 0.77-1.16
// dense from shared memory).
constexpr int kMmaRegPairs = 4;
struct MmaWarp {
  int mt, first, nsplit;  // row tile, first pair, stride between its pairs
  bool on;                // warp < splits
};
__device__ __forceinline__ MmaWarp mma_warp(int nrows, int splits) {
  const int mtiles = mma_row_tiles(nrows) > 0 ? mma_row_tiles(nrows) : 1;
  const int warp = threadIdx.x >> 5;
  const int nsplit = splits / mtiles;
  return {warp % mtiles, warp / mtiles, nsplit > 0 ? nsplit : 1, warp < nsplit * mtiles};
}

// The splits for `warps` warps: a multiple of the row tiles, at most one warp per (tile, pair).
__device__ __forceinline__ int mma_splits_for(int nrows, int kpairs, int warps, int requested) {
  const int mtiles = mma_row_tiles(nrows) > 0 ? mma_row_tiles(nrows) : 1;
  int per_tile = warps / mtiles;
  if (requested > 0 && requested / mtiles < per_tile) per_tile = requested / mtiles;
  if (per_tile > kpairs) per_tile = kpairs;
  return (per_tile > 0 ? per_tile : 1) * mtiles;
}

// The A fragments of the warp's register pairs (zeros past the last pair). After the tiles are
// complete (a barrier after mma_load_weights).
__device__ __forceinline__ void mma_load_registers(const uint16_t* a_s, int H, const MmaWarp& w,
                                                   uint4 (&areg)[kMmaRegPairs][2]) {
  const int kpairs = mma_kpairs(H), lane = threadIdx.x & 31;
  const uint4* tiles = reinterpret_cast<const uint4*>(a_s) + static_cast<long long>(w.mt) * (kpairs + 1) * 64 + lane;
#pragma unroll
  for (int i = 0; i < kMmaRegPairs; ++i) {
    const int kp = w.first + i * w.nsplit;
    const bool live = w.on && kp < kpairs;
    areg[i][0] = live ? tiles[kp * 64] : make_uint4(0u, 0u, 0u, 0u);
    areg[i][1] = live ? tiles[kp * 64 + 32] : make_uint4(0u, 0u, 0u, 0u);
  }
}

// The B fragments of pair kp for this lane: batch row g of the h tile (rows g >= BT feed
// output columns nobody reads; they keep zeros and cost no wavefronts).
template <int BT>
__device__ __forceinline__ uint4 mma_h_frag(const uint16_t* h_t, int hs, int kp) {
  const int lane = threadIdx.x & 31, g = lane >> 2;
  return g < BT ? *reinterpret_cast<const uint4*>(h_t + g * hs + kp * 32 + (lane & 3) * 8)
                : make_uint4(0u, 0u, 0u, 0u);
}

template <DType D>
__device__ __forceinline__ void mma_pair(float (&acc0)[4], float (&acc1)[4], const uint4& a0,
                                         const uint4& a1, const uint4& b) {
  mma_16816<D>(acc0, a0.x, a0.y, a0.z, a0.w, b.x, b.y);
  mma_16816<D>(acc1, a1.x, a1.y, a1.z, a1.w, b.z, b.w);
}

// Step 2 with the tensor cores, called by every thread: each warp (mma_warp) sums its pairs of
// its row tile into its partials, then the block sums the partials into acc_s[r * BT + b]
// (rows_cap16 = 16 * row tiles of the largest block; the caller barriers after). Pairs past
// the register ones come from shared memory in rounds of kMmaRound, all loads first (pairs
// past the end read the zero pair: no predicates). Four independent accumulators.
constexpr int kMmaRound = 2;
template <DType D, int BT>
__device__ __forceinline__ void mma_compute_rows(const uint16_t* a_s, const uint16_t* h_t, int H,
                                                 int nrows, const MmaWarp& w,
                                                 const uint4 (&areg)[kMmaRegPairs][2],
                                                 int rows_cap16, float* acc_s) {
  static_assert(BT <= 8, "one mma n-tile of batch columns");
  const int lane = threadIdx.x & 31;
  const int kpairs = mma_kpairs(H), hs = mma_h_stride(H);
  float* part_s = acc_s + rows_cap16 * BT;
  if (w.on) {
    float acc[4][4] = {};
#pragma unroll
    for (int i = 0; i < kMmaRegPairs; ++i) {
      const int kp = w.first + i * w.nsplit;
      if (kp < kpairs)  // warp-uniform
        mma_pair<D>(acc[(i & 1) * 2], acc[(i & 1) * 2 + 1], areg[i][0], areg[i][1],
                    mma_h_frag<BT>(h_t, hs, kp));
    }
    const uint4* tiles = reinterpret_cast<const uint4*>(a_s) + static_cast<long long>(w.mt) * (kpairs + 1) * 64 + lane;
    for (int kp0 = w.first + kMmaRegPairs * w.nsplit; kp0 < kpairs; kp0 += kMmaRound * w.nsplit) {
      uint4 b[kMmaRound], a0[kMmaRound], a1[kMmaRound];
#pragma unroll
      for (int u = 0; u < kMmaRound; ++u) {
        const int kp = min(kp0 + u * w.nsplit, kpairs);  // kpairs: the zero pair
        b[u] = mma_h_frag<BT>(h_t, hs, kp);
        a0[u] = tiles[kp * 64];
        a1[u] = tiles[kp * 64 + 32];
      }
#pragma unroll
      for (int u = 0; u < kMmaRound; ++u)
        mma_pair<D>(acc[(u & 1) * 2], acc[(u & 1) * 2 + 1], a0[u], a1[u], b[u]);
    }
    // Accumulator (row g or g + 8, batch columns 2c, 2c + 1) into this warp's partials.
    const int g = lane >> 2, c = lane & 3;
    if (2 * c < BT) {
      float r[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) r[i] = (acc[0][i] + acc[1][i]) + (acc[2][i] + acc[3][i]);
      float* q = part_s + (static_cast<long long>(w.first) * rows_cap16 + w.mt * 16 + g) * BT + 2 * c;
      *reinterpret_cast<float2*>(q) = make_float2(r[0], r[1]);
      *reinterpret_cast<float2*>(q + 8 * BT) = make_float2(r[2], r[3]);
    }
  }
  __syncthreads();
  // The sums over the nsplit partials, all of a thread's loads issued at once.
  static_assert(kMmaMaxSplits == 16, "the sum below");
  for (int i = threadIdx.x; i < nrows * BT; i += blockDim.x) {
    float v[16];
#pragma unroll
    for (int s = 0; s < 16; ++s) v[s] = s < w.nsplit ? part_s[s * rows_cap16 * BT + i] : 0.0f;
#pragma unroll
    for (int s = 0; s < 8; ++s) v[s] += v[s + 8];
#pragma unroll
    for (int s = 0; s < 4; ++s) v[s] += v[s + 4];
    acc_s[i] = (v[0] + v[2]) + (v[1] + v[3]);
  }
}

}  // namespace cuda
}  // namespace sprnn
