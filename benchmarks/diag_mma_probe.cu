// Diagonal-mma probe: can sparse rows run on the tensor cores? (benchmarks/NOTES.md, session 69.)
// Times the rows phase alone (h tile and weight words already in shared memory, no exchange) at
// ReLU H=5760 10% fp16, B=4: 132 blocks x 512 threads, 44 rows of 576 nonzeros per block, the
// step's rows repeated `iters` times per launch. Variants, in one process:
//   0 = the package's CUDA-core rows (rows.cuh compute_rows: whole warps, offset words, no
//       register weights), the row's k-th nonzero on lane k % 32;
//   1 = diagonal mma, 4 rows per mma.sync m16n8k16: m = batch * 4 + row, n = row (4 of 8 used),
//       k = the rows' next 16 nonzeros, each row its own columns; the sums are D[(b, r), r];
//   2 = diagonal mma, 8 rows per pair of mma (one per batch pair): m = (row, batch 2p or 2p+1),
//       n = row; 5 groups of 8 rows and 1 group of 4 (variant 1's code) make the block's 44;
//   3 = variant 2's code on 48 rows (6 groups of 8), for its rate alone;
//   4, 5 = variant 0 on 32 and 48 rows (two and three whole passes of the 16 warps), against
//       which variant 0's third pass of 12 rows on 16 warps is priced (session 71);
//   6, 7 = variant 0 on 32 rows, then the other 12 (16) rows' nonzeros in equal contiguous
//       ranges per warp (balanced_tail_rows);
//   8-12 = variant 0 with the warps of each scheduler started apart (rows_kernel's stagger).
// Masks are bank-balanced (every row holds 36 columns of each residue mod 16) and each variant
// orders a row's nonzeros so that every 16-lane group of an 8-byte h load reads 16 distinct bank
// pairs: the conflict-free bound (session 62: 4.04 us/step at this layer, 4.19 on random masks).
// Prints per variant the median over blocks of ns and clock cycles per step, the SM clock, and
// the largest error against a float64 host sum. Session 69's result (NOTES.md): variant 2 takes
// 11-13% fewer cycles than variant 0 but runs at 1.80 GHz instead of 1.98, so the rows are only
// 2-5% shorter in time. Variants 0-3 are that session's call 1 (the kernel's row count is now an
// argument); its calls 2-4 ran other versions of the file (rounds of chunks, 2a31503; a
// work-weighted split and 768 or 1024 threads, ba8b419), which all lost. Session 71 (calls 1-3):
// the third pass's 4 idle warps cost 145-165 cycles of variant 0's 5,256-5,513 (2.7-3.0%: 12
// rows take 1,364-1,424 cycles against 0.75 x the 16-row pass's 1,625-1,679), the most any
// balancing could recover; variants 6 and 7 lose 1,378 and 664 cycles (call 2). Started apart,
// the warps end when they would have (-0.6% to +0.9%, call 3): the rows are bound by the SM's
// throughput, not by warps in lockstep. Session 73: with each warp's range found once per launch
// (it was searched every step) variants 6 and 7 still lose 836 and 103 cycles. Session 74: with
// the delay computed once and no clock read at zero delay, warps started apart save 0.8-3.1%.
// Hand-written because no library times a block's shared-memory rows phase.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/diag_mma_probe.cu -o /tmp/diag_mma_probe
//   /tmp/diag_mma_probe [iters]
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda/memory.cuh"    // global_ns
#include "cuda/mma_rows.cuh"  // mma_16816
#include "cuda/rows.cuh"      // compute_rows
#include "cuda_check.h"

using namespace sprnn;
using namespace sprnn::cuda;

constexpr int kH = 5760, kB = 4, kLen = 576, kRes = 16, kBlocks = 132, kThreads = 512;
constexpr int kChunks = kLen / 16;  // 16 nonzeros of each row of a group per mma
constexpr int kMaxRows = 48;
using OffsetWord = RowWordT<DType::kF16, Words::kOffset>;

// The residue a diagonal-mma lane (row q of its group, k-th nonzero of chunk c) must read so that
// the 16 lanes of a half warp (4 rows x t = 0..3) hit 16 distinct bank pairs: row q takes the
// residues 4 * ((q + c) % 4) + t, each four times a chunk; over four chunks, all 16.
int diag_residue(int q, int c, int k) { return 4 * ((q % 4 + c) % 4) + ((k & 7) >> 1); }

// Thread (g, t)'s 4 nonzeros of a chunk: k = 2t, 2t + 1, 2t + 8, 2t + 9 (its A and B fragments).
int diag_k(int t, int i) { return 2 * t + (i & 1) + 8 * (i >> 1); }

__device__ __forceinline__ uint2 h_at(const char* h_base, uint32_t word) {
  return *reinterpret_cast<const uint2*>(h_base + (word >> 16));
}

// One chunk of a 4-row group: 16 lanes' words (lanes g and g + 4 share a row's); m = b * 4 + r.
__device__ __forceinline__ void chunk4(const uint4* w, const char* h_base, int g, int t,
                                       float (&d)[4]) {
  const uint4 wd = w[(g & 3) * 4 + t];
  const uint2 h0 = h_at(h_base, wd.x), h1 = h_at(h_base, wd.y), h2 = h_at(h_base, wd.z),
              h3 = h_at(h_base, wd.w);
  const uint32_t sel = (g >> 2) ? 0x7632u : 0x5410u;  // batch g >> 2 (and + 2): high or low half
  const uint32_t keep = g < 4 ? 0xffffffffu : 0u;     // n = 4..7 hold no row
  mma_16816<DType::kF16>(d, __byte_perm(h0.x, h1.x, sel), __byte_perm(h0.y, h1.y, sel),
                         __byte_perm(h2.x, h3.x, sel), __byte_perm(h2.y, h3.y, sel),
                         __byte_perm(wd.x, wd.y, 0x5410) & keep,
                         __byte_perm(wd.z, wd.w, 0x5410) & keep);
}

// One chunk of an 8-row group: m = (row g, batch 2p) and (row g, batch 2p + 1), n = row.
__device__ __forceinline__ void chunk8(const uint4* w, const char* h_base, int lane,
                                       float (&d0)[4], float (&d1)[4]) {
  const uint4 wd = w[lane];
  const uint2 h0 = h_at(h_base, wd.x), h1 = h_at(h_base, wd.y), h2 = h_at(h_base, wd.z),
              h3 = h_at(h_base, wd.w);
  const uint32_t b0 = __byte_perm(wd.x, wd.y, 0x5410), b1 = __byte_perm(wd.z, wd.w, 0x5410);
  mma_16816<DType::kF16>(d0, __byte_perm(h0.x, h1.x, 0x5410), __byte_perm(h0.x, h1.x, 0x7632),
                         __byte_perm(h2.x, h3.x, 0x5410), __byte_perm(h2.x, h3.x, 0x7632), b0, b1);
  mma_16816<DType::kF16>(d1, __byte_perm(h0.y, h1.y, 0x5410), __byte_perm(h0.y, h1.y, 0x7632),
                         __byte_perm(h2.y, h3.y, 0x5410), __byte_perm(h2.y, h3.y, 0x7632), b0, b1);
}

// The diagonal rows of a block: the groups' chunks dealt to the warps in contiguous ranges; a warp
// adds its partial sums of a group into acc_s when it leaves the group.
__device__ void diag_rows(const uint4* w_s, const char* h_base, const int* kind_s,
                          const int* wofs_s, const int* row0_s, int ngroups, float* acc_s) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5,
            warps = blockDim.x >> 5, items = ngroups * kChunks;
  int it = warp * items / warps;
  const int it1 = (warp + 1) * items / warps;
  while (it < it1) {
    const int grp = it / kChunks, end = min(it1, (grp + 1) * kChunks), row0 = row0_s[grp];
    float d0[4] = {}, d1[4] = {};
    if (kind_s[grp] == 8) {
      const uint4* w = w_s + wofs_s[grp] + (it - grp * kChunks) * 32;
#pragma unroll 4
      for (; it < end; ++it, w += 32) chunk8(w, h_base, lane, d0, d1);
      if (t == g >> 1) {  // D[g][g] and D[g + 8][g]: row g, batches 2p and 2p + 1
        const int e = g & 1;
        float* a = acc_s + (row0 + g) * kB;
        atomicAdd(a + 0, d0[e]);
        atomicAdd(a + 1, d0[2 + e]);
        atomicAdd(a + 2, d1[e]);
        atomicAdd(a + 3, d1[2 + e]);
      }
    } else {
      const uint4* w = w_s + wofs_s[grp] + (it - grp * kChunks) * 16;
#pragma unroll 4
      for (; it < end; ++it, w += 16) chunk4(w, h_base, g, t, d0);
      const int r = g & 3;
      if (t == r >> 1) {  // D[b * 4 + r][r] for b = g >> 2 and b + 2
        const int e = r & 1;
        float* a = acc_s + (row0 + r) * kB + (g >> 2);
        atomicAdd(a, d0[e]);
        atomicAdd(a + 2, d0[2 + e]);
      }
    }
  }
}

// Variants 6 and 7's last pass: rows [full, rows) by the warps in equal contiguous ranges of their
// nonzeros (multiples of 16 from a row start, so the bank-aware 16-lane groups stay whole), each
// warp adding its partial sum of each row piece it holds into acc_s (zeroed by the step). With
// 44 rows on 16 warps, whole-row passes leave 4 warps idle in the third pass (18 nonzeros per
// lane in it): here every warp takes 13.5.
// A warp's range: nonzeros [k0, k_end), the first of them in row r0. Found once per launch, as a
// kernel would in its prologue, so that the timed steps carry only the pass itself.
struct TailRange {
  int k0, k_end, r0;
};

__device__ TailRange tail_range(const int* rows_s, int full, int rows) {
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int n0 = rows_s[full], n = rows_s[rows] - n0;
  const int per = (n / warps + 15) & ~15;
  const int k0 = n0 + min(n, warp * per);
  int lo = full, hi = rows;  // the row holding nonzero k0: the last r with rows_s[r] <= k0
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (rows_s[mid] <= k0) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return {k0, n0 + min(n, (warp + 1) * per), lo};
}

__device__ void balanced_tail_rows(const Params& p, const OffsetWord* w_s, const uint16_t* h_s,
                                   const int* rows_s, TailRange t, const OffsetWord (&wreg)[1],
                                   float* acc_s) {
  const int lane = threadIdx.x & 31;
  for (int k = t.k0, r = t.r0; k < t.k_end; ++r) {  // warp-uniform
    const int e = min(t.k_end, rows_s[r + 1]);
    float acc[kB];
    row_dot<DType::kF16, kB, true, Words::kOffset, 32, 0>(
        p, w_s, 0, 1LL << 40, h_s, k, e, wreg, false, acc);
    int col;
    const float sum = sum_slices_transposed<kB, 32>(acc, lane, col);
    if (lane % (32 / kB) == 0) atomicAdd(acc_s + r * kB + col, sum);
    k = e;
  }
}

struct Stamp {
  unsigned long long cycles, ns;
};

// `iters` steps of one variant's rows; every step zeroes the sums first and writes them out after.
// Dynamic shared memory: h tile, acc_s, the words, per-group tables (diagonal variants) or row
// starts (CUDA-core variants).
// CUDA-core variants (ngroups == 0): compute_rows on rows [0, full), then balanced_tail_rows on
// [full, rows); warp w first spins (w / 4 % phases) * stagger cycles, which puts warps of
// one scheduler (w % 4) out of step with each other.
__global__ void rows_kernel(int iters, const uint16_t* h, const uint32_t* words,
                            const long long* block_word0, int nwords, const int* kinds,
                            int ngroups, int rows, int full, int phases, int stagger,
                            float* out, Stamp* stamps) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* h_s = reinterpret_cast<uint16_t*>(smem);
  float* acc_s = reinterpret_cast<float*>(smem + kH * kB * 2);
  uint32_t* w_s = reinterpret_cast<uint32_t*>(acc_s + kMaxRows * kB);
  int* tab_s = reinterpret_cast<int*>(w_s + nwords);  // kinds, word offsets, first rows
  for (int i = threadIdx.x; i < kH * kB; i += blockDim.x) h_s[i] = h[i];
  const uint32_t* wg = words + block_word0[blockIdx.x];
  for (int i = threadIdx.x; i < nwords; i += blockDim.x) w_s[i] = wg[i];
  if (ngroups == 0) {
    for (int i = threadIdx.x; i <= rows; i += blockDim.x) tab_s[i] = i * kLen;
  } else if (threadIdx.x == 0) {
    int wofs = 0, row0 = 0;
    for (int q = 0; q < ngroups; ++q) {
      tab_s[q] = kinds[q];
      tab_s[ngroups + q] = wofs / 4;  // in uint4
      tab_s[2 * ngroups + q] = row0;
      wofs += kChunks * kinds[q] * 16;  // 8-row: 32 lanes x 4 words; 4-row: 16 x 4
      row0 += kinds[q];
    }
  }
  __syncthreads();
  Params p{};
  p.H = kH;
  const OffsetWord wreg[1] = {};
  const TailRange tail = ngroups == 0 && full < rows ? tail_range(tab_s, full, rows)
                                                     : TailRange{0, 0, full};
  // This warp's start delay (variants 8-12), the same every step; the others never read the clock.
  const long long delay = static_cast<long long>((threadIdx.x >> 7) % phases) * stagger;
  unsigned long long c0 = 0, n0 = 0;
  for (int s = 0; s < iters; ++s) {
    if (s == 1 && threadIdx.x == 0) c0 = clock64(), n0 = global_ns();  // step 0 warms up
    for (int i = threadIdx.x; i < rows * kB; i += blockDim.x) acc_s[i] = 0.0f;
    __syncthreads();
    if (ngroups == 0) {
      if (delay > 0) {
        for (const long long t0 = clock64(); clock64() - t0 < delay;) {
        }
      }
      compute_rows<DType::kF16, kB, true, Words::kOffset, 32, 0>(
          p, w_s, 0, 1LL << 40, h_s, tab_s, full, wreg, acc_s);
      if (full < rows) balanced_tail_rows(p, w_s, h_s, tab_s, tail, wreg, acc_s);
    } else {
      diag_rows(reinterpret_cast<const uint4*>(w_s), reinterpret_cast<const char*>(h_s), tab_s,
                tab_s + ngroups, tab_s + 2 * ngroups, ngroups, acc_s);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * kB; i += blockDim.x)
      out[blockIdx.x * kMaxRows * kB + i] = acc_s[i];
  }
  if (threadIdx.x == 0) stamps[blockIdx.x] = {clock64() - c0, global_ns() - n0};
}

// A block's rows: columns and fp16 value bits, kLen each, bank-balanced.
struct Rows {
  std::vector<std::vector<int>> cols;
  std::vector<std::vector<uint16_t>> vals;
};

Rows make_rows(int n, std::mt19937& rng) {
  Rows r;
  std::uniform_real_distribution<float> val(-0.5f, 0.5f);
  std::vector<int> pick(kH / kRes);
  for (int i = 0; i < n; ++i) {
    std::vector<int> c;
    for (int res = 0; res < kRes; ++res) {
      for (int j = 0; j < kH / kRes; ++j) pick[j] = res + kRes * j;
      std::shuffle(pick.begin(), pick.end(), rng);
      c.insert(c.end(), pick.begin(), pick.begin() + kLen / kRes);
    }
    std::shuffle(c.begin(), c.end(), rng);
    std::vector<uint16_t> v(kLen);
    for (auto& x : v) x = __half_as_ushort(__float2half(val(rng)));
    r.cols.push_back(c);
    r.vals.push_back(v);
  }
  return r;
}

uint32_t offset_word(int col, uint16_t val) {
  return static_cast<uint32_t>(col * kB * 2) << 16 | val;
}

// Takes from row i's nonzeros one of residue `res` (the row has exactly kLen / kRes of each).
struct ResiduePools {
  std::vector<std::vector<std::vector<int>>> pool;  // [row][residue] -> nonzero indices
  explicit ResiduePools(const Rows& r) : pool(r.cols.size(), std::vector<std::vector<int>>(kRes)) {
    for (size_t i = 0; i < r.cols.size(); ++i)
      for (int k = 0; k < kLen; ++k) pool[i][r.cols[i][k] % kRes].push_back(k);
  }
  int take(int row, int res) {
    const int k = pool[row][res].back();
    pool[row][res].pop_back();
    return k;
  }
};

// The CUDA-core variants' words: row-major, the row's k-th nonzero of residue k % 16 (lane k % 32).
std::vector<uint32_t> words_rows(const Rows& r) {
  ResiduePools pools(r);
  std::vector<uint32_t> w;
  for (size_t i = 0; i < r.cols.size(); ++i)
    for (int k = 0; k < kLen; ++k) {
      const int j = pools.take(static_cast<int>(i), k % kRes);
      w.push_back(offset_word(r.cols[i][j], r.vals[i][j]));
    }
  return w;
}

// The diagonal variants' words: per group, per chunk, per lane slot (g, t) its 4 nonzeros.
std::vector<uint32_t> words_diag(const Rows& r, const std::vector<int>& kinds) {
  ResiduePools pools(r);
  std::vector<uint32_t> w;
  int row0 = 0;
  for (int kind : kinds) {
    for (int c = 0; c < kChunks; ++c)
      for (int slot = 0; slot < kind * 4; ++slot) {
        const int q = slot / 4, t = slot % 4, row = row0 + q;
        for (int i = 0; i < 4; ++i) {
          const int j = pools.take(row, diag_residue(q, c, diag_k(t, i)));
          w.push_back(offset_word(r.cols[row][j], r.vals[row][j]));
        }
      }
    row0 += kind;
  }
  return w;
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 2000;
  if (iters < 2) {  // step 0 only warms up, so the timed steps are 1 .. iters - 1
    std::fprintf(stderr, "iters must be at least 2, got %s\n", argv[1]);
    return 2;
  }
  std::mt19937 rng(69);
  std::vector<uint16_t> h(kH * kB);
  std::uniform_real_distribution<float> hv(-1.0f, 1.0f);
  for (auto& x : h) x = __half_as_ushort(__float2half(hv(rng)));
  std::vector<Rows> blocks;
  for (int b = 0; b < kBlocks; ++b) blocks.push_back(make_rows(kMaxRows, rng));
  // The float64 sums of every block's rows, once for all variants: [block][row][batch column].
  std::vector<double> ref(kBlocks * kMaxRows * kB, 0.0);
  for (int b = 0; b < kBlocks; ++b)
    for (int i = 0; i < kMaxRows; ++i)
      for (int bt = 0; bt < kB; ++bt)
        for (int k = 0; k < kLen; ++k)
          ref[(b * kMaxRows + i) * kB + bt] +=
              double(__half2float(__ushort_as_half(blocks[b].vals[i][k]))) *
              double(__half2float(__ushort_as_half(h[blocks[b].cols[i][k] * kB + bt])));

  struct Variant {
    const char* name;
    int rows;
    std::vector<int> kinds;
    int full;  // CUDA-core variants: rows in whole-row passes (the rest: balanced_tail_rows)
    int phases = 1, stagger = 0;  // CUDA-core variants: warps started out of step (rows_kernel)
  };
  const std::vector<Variant> variants = {
      {"0 CUDA-core rows (package), 44 rows", 44, {}, 44},
      {"1 diagonal mma, 4-row groups, 44 rows", 44, std::vector<int>(11, 4), 0},
      {"2 diagonal mma, 5 x 8 + 1 x 4 rows", 44, {8, 8, 8, 8, 8, 4}, 0},
      {"3 diagonal mma, 6 x 8 rows (48)", 48, std::vector<int>(6, 8), 0},
      {"4 CUDA-core rows (package), 32 rows", 32, {}, 32},
      {"5 CUDA-core rows (package), 48 rows", 48, {}, 48},
      {"6 CUDA-core, 32 rows + 12 balanced", 44, {}, 32},
      {"7 CUDA-core, 32 rows + 16 balanced (48)", 48, {}, 32},
      {"8 CUDA-core, 44 rows, 2 phases x 200 cycles", 44, {}, 44, 2, 200},
      {"9 CUDA-core, 44 rows, 2 phases x 400 cycles", 44, {}, 44, 2, 400},
      {"10 CUDA-core, 44 rows, 4 phases x 100 cycles", 44, {}, 44, 4, 100},
      {"11 CUDA-core, 44 rows, 4 phases x 200 cycles", 44, {}, 44, 4, 200},
      {"12 CUDA-core, 48 rows, 2 phases x 200 cycles", 48, {}, 48, 2, 200}};

  uint16_t* d_h;
  CHECK(cudaMalloc(&d_h, h.size() * 2));
  CHECK(cudaMemcpy(d_h, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  float* d_out;
  CHECK(cudaMalloc(&d_out, kBlocks * kMaxRows * kB * sizeof(float)));
  Stamp* d_st;
  CHECK(cudaMalloc(&d_st, kBlocks * sizeof(Stamp)));
  for (int v = 0; v < static_cast<int>(variants.size()); ++v) {
    const Variant& var = variants[v];
    std::vector<uint32_t> all;
    std::vector<long long> word0;
    int nwords = 0;
    for (int b = 0; b < kBlocks; ++b) {
      Rows r = blocks[b];
      r.cols.resize(var.rows);
      r.vals.resize(var.rows);
      const std::vector<uint32_t> w = var.kinds.empty() ? words_rows(r) : words_diag(r, var.kinds);
      word0.push_back(static_cast<long long>(all.size()));
      all.insert(all.end(), w.begin(), w.end());
      nwords = static_cast<int>(w.size());
    }
    uint32_t* d_w;
    long long* d_w0;
    int* d_kinds;
    const int ngroups = static_cast<int>(var.kinds.size());
    CHECK(cudaMalloc(&d_w, all.size() * 4));
    CHECK(cudaMalloc(&d_w0, word0.size() * 8));
    CHECK(cudaMalloc(&d_kinds, std::max(ngroups, 1) * 4));
    CHECK(cudaMemcpy(d_w, all.data(), all.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_w0, word0.data(), word0.size() * 8, cudaMemcpyHostToDevice));
    if (ngroups) CHECK(cudaMemcpy(d_kinds, var.kinds.data(), ngroups * 4, cudaMemcpyHostToDevice));
    const size_t smem = kH * kB * 2 + kMaxRows * kB * 4 + nwords * 4 + (3 * 16 + kMaxRows + 1) * 4;
    CHECK(cudaFuncSetAttribute(rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    std::vector<double> ns_runs, cyc_runs;
    std::vector<Stamp> st(kBlocks);
    for (int run = 0; run < 5; ++run) {
      rows_kernel<<<kBlocks, kThreads, smem>>>(iters, d_h, d_w, d_w0, nwords, d_kinds, ngroups,
                                               var.rows, var.full, var.phases, var.stagger,
                                               d_out, d_st);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaMemcpy(st.data(), d_st, kBlocks * sizeof(Stamp), cudaMemcpyDeviceToHost));
      std::vector<double> ns, cyc;
      for (const Stamp& s : st) {
        ns.push_back(double(s.ns) / (iters - 1));
        cyc.push_back(double(s.cycles) / (iters - 1));
      }
      std::nth_element(ns.begin(), ns.begin() + kBlocks / 2, ns.end());
      std::nth_element(cyc.begin(), cyc.begin() + kBlocks / 2, cyc.end());
      if (run > 0) ns_runs.push_back(ns[kBlocks / 2]), cyc_runs.push_back(cyc[kBlocks / 2]);
    }
    std::sort(ns_runs.begin(), ns_runs.end());
    std::sort(cyc_runs.begin(), cyc_runs.end());
    // Error of the last step's sums against a float64 host sum, every block and row.
    std::vector<float> out(kBlocks * kMaxRows * kB);
    CHECK(cudaMemcpy(out.data(), d_out, out.size() * 4, cudaMemcpyDeviceToHost));
    double err = 0.0, scale = 0.0;
    for (int b = 0; b < kBlocks; ++b)
      for (int i = 0; i < var.rows; ++i)
        for (int bt = 0; bt < kB; ++bt) {
          const int at = (b * kMaxRows + i) * kB + bt;
          err = std::max(err, std::fabs(ref[at] - out[at]));
          scale = std::max(scale, std::fabs(ref[at]));
        }
    const double ns = ns_runs[ns_runs.size() / 2], cyc = cyc_runs[cyc_runs.size() / 2];
    std::printf("%-46s %7.1f ns/step %7.0f cycles/step  %.3f GHz  %.1f cycles per 64 pairs  "
                "max err %.2e (|ref| <= %.1f)\n",
                var.name, ns, cyc, cyc / ns, cyc / (var.rows * kLen / 64.0), err, scale);
    CHECK(cudaFree(d_w));
    CHECK(cudaFree(d_w0));
    CHECK(cudaFree(d_kinds));
  }
  CHECK(cudaFree(d_h));
  CHECK(cudaFree(d_out));
  CHECK(cudaFree(d_st));
  return 0;
}
