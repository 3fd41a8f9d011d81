// The block partition (which hidden units each block owns, balanced on device), the
// shared-memory carve-up of a block and its thread count; the host computes the same sizes
// (handlers.cu).
#pragma once

#include "cuda/memory.cuh"

namespace sprnn {
namespace cuda {

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

// Sets the bits of the h units a block reads (Params::col_filter): the columns of its
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
