// Hopper (sm_90) cluster variant of the persistent kernel (variant 5).
//
// Why: the grid-wide exchange of persistent_fwd (every block reads all of h from L2 and spins on
// tagged words) costs ~2.6 us per step whatever the layer size (benchmarks/NOTES.md). A thread
// block cluster (up to 16 CTAs, co-scheduled by the hardware) can exchange h through distributed
// shared memory and synchronise with one hardware barrier instead.
//
// Layout: one cluster per batch tile of BT sequences (grid = ntiles clusters of csize CTAs).
// Each cluster holds a full copy of the layer: CTA `rank` owns the units unit_range(rank,
// csize) and keeps their nonzeros in shared memory. Clusters never communicate, so the only
// co-residency needed is within a cluster (guaranteed by the hardware); more clusters than fit
// simply run one after another. Per step s, every CTA:
//   1. computes its rows from its own copy of h_{s-1} (slot s % 2 of its shared memory),
//   2. applies the cell to its units (update_pair, shared with persistent_fwd),
//   3. stores h_s straight into slot (s + 1) % 2 of every CTA of the cluster (st.shared::cluster),
//   4. arrives at the cluster barrier (release); it waits (acquire) before reading slot (s+1) % 2.
// One barrier per step suffices with two slots: a CTA writes slot (s+1) % 2 of a peer only after
// the barrier of step s-1, which the peer reached after its last reads of that slot (step s-1).
// Every CTA runs the same number of steps and reaches every barrier (no early exits, no spins,
// nothing to time out); a CTA whose unit range would overflow shared memory sets the abort flag
// and does no work, but still takes part in every barrier.
//
// Everything that needs sm_90 is under __CUDA_ARCH__ >= 900: for older targets (the sm_70 NVRTC
// check, sm_75..89 builds) the kernel compiles to a stub that sets the abort flag, and the host
// never launches it there (handlers.cu checks the compute capability and the kernel's PTX arch).
#pragma once

#include "cuda/kernel_core.cuh"

namespace sprnn {
namespace cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_size() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
}
// Split cluster barrier: arrive releases this thread's prior writes (local and remote shared
// memory) to the cluster; wait acquires every other thread's. All threads of every CTA take part.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The shared::cluster address of `p` (a shared variable of this CTA) in CTA `rank`.
__device__ __forceinline__ uint32_t map_rank(const void* p, uint32_t rank) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
// Stores N 32-bit words (N = 1, 2, 4: 4, 8 or 16 bytes, aligned) or one 16-bit value (N = 0).
template <int N>
__device__ __forceinline__ void st_cluster(uint32_t addr, const uint32_t* v) {
  if constexpr (N == 4) {
    asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v[0]),
                 "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
  } else if constexpr (N == 2) {
    asm volatile("st.shared::cluster.v2.u32 [%0], {%1, %2};" ::"r"(addr), "r"(v[0]), "r"(v[1])
                 : "memory");
  } else if constexpr (N == 1) {
    asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(addr), "r"(v[0]) : "memory");
  } else {
    const unsigned short h = static_cast<unsigned short>(v[0]);
    asm volatile("st.shared::cluster.u16 [%0], %1;" ::"r"(addr), "h"(h) : "memory");
  }
}
#endif

// Threads per CTA the tile's cluster kernel is built for: that of persistent_fwd's tile.
template <Cell kCell, DType D, int BT>
__global__ void __launch_bounds__(max_threads_of_tile(BT), 1) cluster_fwd(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using T = Tr<D>;
  using S = typename T::S;
  using W = typename T::W;
  constexpr int G = gates_of(kCell);
  // A chunk is kV consecutive batch columns of one unit (at most 16 bytes), stored to a peer in
  // one instruction; the kV lanes that computed them share it by shuffles, and then each sends
  // it to every kV-th peer.
  constexpr int kV = static_cast<int>(sizeof(S)) * BT <= 16 ? BT : 16 / static_cast<int>(sizeof(S));
  constexpr int kWords = static_cast<int>(sizeof(S)) * kV / 4;  // 0: one 16-bit value
  static_assert(BT <= 32 && 32 % BT == 0, "a unit's columns lie in one warp");

  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x;
  const int nthr = blockDim.x;
  const int lane = tid & 31;
  const int rank = static_cast<int>(cluster_rank());
  const int csize = static_cast<int>(cluster_size());
  const int j = blockIdx.x / csize;  // batch tile
  const int H = p.H, B = p.B;
  const int b_lo = j * BT;
  const int b_hi = b_lo + BT < B ? b_lo + BT : B;

  __shared__ int sh_u[2];
  __shared__ int sh_lmax;
  if (tid == 0) {
    int u0, u1;
    unit_range(p, G, rank, csize, u0, u1);
    if (u1 - u0 > p.u_cap) {  // cannot happen with the host's bound; never corrupt shared memory
      atomicExch(p.abort_flag, 2);
      u1 = u0;
    }
    sh_u[0] = u0;
    sh_u[1] = u1;
    int lmax = 0;
    for (int b = b_lo; b < b_hi; ++b) lmax = seq_len(p, b) > lmax ? seq_len(p, b) : lmax;
    sh_lmax = lmax;
  }
  __syncthreads();
  const int u0 = sh_u[0];
  const int nu = sh_u[1] - u0;
  const int lmax = sh_lmax;  // the same in every CTA of the cluster: all take lmax steps
  const SmemLayout L = smem_layout(H, BT, BT, G, kCell == Cell::kLstm, p.u_cap, p.w_cap,
                                   static_cast<int>(sizeof(S)), static_cast<int>(sizeof(W)), 2);
  float* acc_s = reinterpret_cast<float*>(smem + L.acc_off);
  float* hst = reinterpret_cast<float*>(smem + L.hst_off);
  float* cst = reinterpret_cast<float*>(smem + L.cst_off);
  W* w_s = reinterpret_cast<W*>(smem + L.w_off);
  auto slot = [&](int s) { return reinterpret_cast<S*>(smem + L.h_off + (s & 1) * L.h_stride); };

  const long long kb0 = __ldg(p.row_ptr + static_cast<long long>(u0) * G);
  const long long kb1 = __ldg(p.row_ptr + static_cast<long long>(u0 + nu) * G);
  const long long n_in = (kb1 - kb0) < p.w_cap ? (kb1 - kb0) : p.w_cap;
  load_weights<D>(p, kb0, n_in, w_s);
  init_state<kCell, D>(p, u0, nu, b_lo, BT, hst, cst);
  {  // h_0 of the whole tile into slot 0 (every CTA its own copy)
    S* h0s = slot(0);
    for (int i = tid; i < H * BT; i += nthr) {
      const int u = i / BT, b = b_lo + i % BT;
      h0s[i] = b < B ? static_cast<const S*>(p.h0)[static_cast<long long>(b) * H + u] : S(0);
    }
  }
  // Every CTA of the cluster has started (a peer's shared memory may be written only then) and
  // has finished its set-up.
  cluster_arrive();
  cluster_wait();

  const int npairs = nu * BT;
  for (int s = 0; s < lmax; ++s) {
    // The input projection of this thread's first pair, loaded while the barrier completes.
    float xr[G];
#pragma unroll
    for (int g = 0; g < G; ++g) xr[g] = 0.0f;
    if (tid < npairs) {
      const int b = b_lo + tid % BT;
      const int len = seq_len(p, b);
      if (s < len) load_x_pair<D, G>(p, s, len, b, u0 + tid / BT, xr);
    }
    if (s > 0) cluster_wait();  // h_{s-1} is complete in slot s % 2

    compute_rows<kCell, D, BT, true>(p, w_s, kb0, n_in, slot(s), u0, nu, acc_s);
    __syncthreads();

    // Cell update; h_s into slot (s + 1) % 2 of every CTA. Whole warps take part in every
    // iteration (the shuffles); a chunk's kV lanes are all active or all idle (npairs and nthr
    // are multiples of BT).
    S* nxt = slot(s + 1);
    for (int base = 0; base < npairs; base += nthr) {
      const int pi = base + tid;
      const bool active = pi < npairs;
      const int ul = pi / BT, bt = pi % BT;
      float hnew = 0.0f;
      if (active)
        hnew = update_pair<kCell, D, BT>(p, s, ul, u0 + ul, bt, b_lo + bt, pi, pi == tid, xr,
                                         acc_s, hst, cst);
      const uint32_t bits = T::f_to_bits(hnew);
      const int c0 = lane - bt % kV;  // first lane of this lane's chunk
      uint32_t v[kWords > 0 ? kWords : 1];
      if constexpr (kWords == 0) {
        v[0] = bits;
      } else if constexpr (sizeof(S) == 4) {
#pragma unroll
        for (int i = 0; i < kWords; ++i) v[i] = __shfl_sync(0xffffffffu, bits, c0 + i);
      } else {
#pragma unroll
        for (int i = 0; i < kWords; ++i) {
          const uint32_t lo = __shfl_sync(0xffffffffu, bits, c0 + 2 * i);
          const uint32_t hi = __shfl_sync(0xffffffffu, bits, c0 + 2 * i + 1);
          v[i] = (lo & 0xffffu) | (hi << 16);
        }
      }
      if (active) {
        const S* dst = nxt + static_cast<long long>(u0 + ul) * BT + (bt - bt % kV);
        for (int r = bt % kV; r < csize; r += kV) st_cluster<kWords>(map_rank(dst, r), v);
      }
    }
    cluster_arrive();
  }
  if (lmax > 0) cluster_wait();  // no CTA exits while a peer may still write to it

  __syncthreads();  // the final carry is read from hst/cst by other threads than wrote it
  write_tail<kCell, D>(p, u0, nu, lmax, b_lo, b_hi, BT, hst, cst);
#else
  // Built for an architecture without clusters: never launched (handlers.cu checks).
  if (threadIdx.x == 0 && blockIdx.x == 0) atomicExch(p.abort_flag, 3);
#endif
}

}  // namespace cuda
}  // namespace sprnn
