// Hopper (sm_90) cluster variant of the persistent kernel (variant 5).
//
// Why: the grid-wide exchange of persistent_fwd (every block reads all of h from L2 and spins on
// tagged words) costs ~2.6 us per step whatever the layer size (benchmarks/NOTES.md). A thread
// block cluster (up to 16 CTAs, co-scheduled by the hardware) can exchange h through distributed
// shared memory (DSMEM) instead, with the arrival of the data as the only synchronisation.
//
// Layout: one cluster per batch tile of BT sequences (grid = ntiles clusters of csize CTAs).
// Each cluster holds a full copy of the layer: CTA `rank` owns the units unit_range(rank,
// csize) and keeps their nonzeros in shared memory. Clusters never communicate, so the only
// co-residency needed is within a cluster (guaranteed by the hardware); more clusters than fit
// simply run one after another. Every CTA keeps two float32 copies of the h tile (slot s % 2
// is the input of step s). Per step s, every CTA:
//   1. waits on the mbarrier of slot s % 2 until all of h_{s-1} has arrived (s > 0),
//   2. computes its rows from slot s % 2, a group of `lanes` lanes per row (row_lanes),
//   3. applies the cell to its units (update_pair, shared with persistent_fwd),
//   4. sends h_s into slot (s + 1) % 2 of every peer with st.async, each store counting its
//      bytes on the peer's mbarrier of that slot (complete_tx); its own copy is a plain store.
// No cluster barrier per step and no release fence: the mbarrier phase completes when the
// expected bytes ((H - own units) x BT x 4, armed by thread 0 with expect_tx) have landed. Two
// slots are enough: a peer sends step s into our slot (s+1) % 2 only after it has received our
// h_{s-1}, which we send after the block barrier that ends our reads of that slot (step s-1).
// Waits are bounded (%globaltimer, wait_expired); a thread whose wait expired (or that sees the
// abort flag) skips its later waits, so every CTA reaches the closing cluster barrier and no CTA
// exits while a peer may still write to it. The handler turns the flag into a Python error.
// H values are exchanged as float32 of the dtype-rounded h, exactly what persistent_fwd sends.
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
// st.async of N floats (N = 1, 2, 4: 4, 8 or 16 bytes, aligned) to a peer's shared memory,
// completing N * 4 bytes of the transaction count of the peer's mbarrier `bar`.
template <int N>
__device__ __forceinline__ void st_async(uint32_t addr, const float* v, uint32_t bar) {
  if constexpr (N == 4) {
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, "
        "[%5];" ::"r"(addr), "r"(__float_as_uint(v[0])), "r"(__float_as_uint(v[1])),
        "r"(__float_as_uint(v[2])), "r"(__float_as_uint(v[3])), "r"(bar) : "memory");
  } else if constexpr (N == 2) {
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(
            addr), "r"(__float_as_uint(v[0])), "r"(__float_as_uint(v[1])), "r"(bar) : "memory");
  } else {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                     addr), "r"(__float_as_uint(v[0])), "r"(bar) : "memory");
  }
}
__device__ __forceinline__ void mbar_init(unsigned long long* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(bar))) : "memory");
}
// The one local arrival of a phase, raising the bytes it waits for.
__device__ __forceinline__ void mbar_arrive_expect(unsigned long long* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(bar))), "r"(bytes) : "memory");
}
// Default (.acquire.cta) semantics: the st.async bytes that completed the phase are visible to
// the waiting threads. Not .acquire.cluster: that invalidates L1 in every waiting thread (SASS
// CCTL.IVALL), turning the step's cached loads into L2 round trips.
__device__ __forceinline__ bool mbar_try_wait(unsigned long long* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred P;\n"
      " mbarrier.try_wait.parity.shared::cta.b64 P, [%1], %2;\n"
      " selp.u32 %0, 1, 0, P;\n}" : "=r"(done) : "r"(static_cast<uint32_t>(
                                        __cvta_generic_to_shared(bar))), "r"(parity) : "memory");
  return done != 0;
}
// Waits for phase `parity` of bar; false when the wait expired (or another block aborted).
__device__ __forceinline__ bool mbar_wait(const Params& p, unsigned long long* bar,
                                          uint32_t parity) {
  unsigned long long start = 0;
  for (int spins = 1; !mbar_try_wait(bar, parity); ++spins)
    if ((spins & 7) == 0 && wait_expired(p, start)) return false;
  return true;
}
#endif

// BT float32 values at p (aligned to min(BT, 4) * 4 bytes) in as few vector loads as possible.
template <int BT>
__device__ __forceinline__ void load_tile(const float* p, float* out) {
  if constexpr (BT >= 4) {
#pragma unroll
    for (int i = 0; i < BT / 4; ++i) {
      const float4 v = reinterpret_cast<const float4*>(p)[i];
      out[4 * i] = v.x;
      out[4 * i + 1] = v.y;
      out[4 * i + 2] = v.z;
      out[4 * i + 3] = v.w;
    }
  } else if constexpr (BT == 2) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    out[0] = v.x;
    out[1] = v.y;
  } else {
    out[0] = *p;
  }
}

// Step 2 of the cluster kernel: rows [0, nrows) of the CTA against the float32 h tile hf, into
// acc_s[r * BT + b]. Row r's nonzeros are w_s[rows_s[r] .. rows_s[r + 1]). A group of `lanes` lanes (a power of two <= 32) per
// row, each lane taking every lanes-th nonzero with all BT columns, then a shuffle reduction
// within the group. Why not one warp per row (persistent_fwd): at 16 CTAs a CTA owns ~70-260
// rows of ~100 nonzeros, so a warp per row spends most instructions on the 5-level reduction
// and loop set-up (ncu: 200 warp instructions per row of 115 nonzeros).
template <DType D, int BT>
__device__ __forceinline__ void grouped_rows(const int* rows_s, const typename Tr<D>::W* w_s,
                                             const float* hf, int nrows, int lanes,
                                             float* acc_s) {
  using T = Tr<D>;
  using W = typename T::W;
  constexpr int kDepth = BT <= 4 ? 4 : (BT == 8 ? 2 : 1);  // nonzeros per lane in flight
  const int tid = threadIdx.x;
  const int sub = tid & (lanes - 1);
  const int ngroups = blockDim.x / lanes;
  for (int base = 0; base < nrows; base += ngroups) {  // the same trip count in every warp
    const int r = base + tid / lanes;
    float acc[BT];
#pragma unroll
    for (int i = 0; i < BT; ++i) acc[i] = 0.0f;
    if (r < nrows) {
      const int k1 = rows_s[r + 1];
      int k = rows_s[r] + sub;
      for (; k + (kDepth - 1) * lanes < k1; k += kDepth * lanes) {
        float v[kDepth], hv[kDepth][BT];
#pragma unroll
        for (int q = 0; q < kDepth; ++q) {
          int col;
          T::unpack_w(w_s[k + q * lanes], v[q], col);
          load_tile<BT>(hf + static_cast<long long>(col) * BT, hv[q]);
        }
#pragma unroll
        for (int q = 0; q < kDepth; ++q)
#pragma unroll
          for (int i = 0; i < BT; ++i) acc[i] = fmaf(v[q], hv[q][i], acc[i]);
      }
      for (; k < k1; k += lanes) {
        float v, hv[BT];
        int col;
        T::unpack_w(w_s[k], v, col);
        load_tile<BT>(hf + static_cast<long long>(col) * BT, hv);
#pragma unroll
        for (int i = 0; i < BT; ++i) acc[i] = fmaf(v, hv[i], acc[i]);
      }
    }
    for (int off = lanes >> 1; off > 0; off >>= 1)
#pragma unroll
      for (int i = 0; i < BT; ++i) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], off);
    if (r < nrows && sub == 0)
#pragma unroll
      for (int i = 0; i < BT; ++i) acc_s[r * BT + i] = acc[i];
  }
}

// Lanes per row for rows of `avg` nonzeros on average: about 64 / BT nonzeros per lane (4 to
// 16), fewer for wide tiles whose nonzeros cost BT FMAs each.
__host__ __device__ constexpr int row_lanes_for(long long avg, int bt) {
  const int per_lane = 64 / bt < 4 ? 4 : (64 / bt > 16 ? 16 : 64 / bt);
  int lanes = 1;
  while (lanes < 32 && static_cast<long long>(lanes) * per_lane < avg) lanes *= 2;
  return lanes;
}

// Threads per CTA the tile's cluster kernel is built for: that of persistent_fwd's tile.
template <Cell kCell, DType D, int BT>
__global__ void __launch_bounds__(max_threads_of_tile(BT), 1) cluster_fwd(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using T = Tr<D>;
  constexpr int G = gates_of(kCell);
  // A chunk is kV consecutive batch columns of one unit (at most 16 bytes of float32), sent to
  // a peer by one st.async; the kV lanes that computed them share it by shuffles, and then each
  // sends it to every kV-th peer.
  constexpr int kV = BT < 4 ? BT : 4;
  static_assert(BT <= 32 && 32 % BT == 0, "a unit's columns lie in one warp");

  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bar[2];  // one per h slot
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
  __shared__ int sh_lmax, sh_lanes;
  if (tid == 0) {
    int u0, u1;
    unit_range(p, G, rank, csize, u0, u1);
    const long long n = __ldg(p.row_ptr + static_cast<long long>(u1) * G) -
                        __ldg(p.row_ptr + static_cast<long long>(u0) * G);
    if (u1 - u0 > p.u_cap || n > p.w_cap) {  // cannot happen with the host's plan
      atomicExch(p.abort_flag, 2);
      u1 = u0;
    }
    sh_u[0] = u0;
    sh_u[1] = u1;
    sh_lmax = max_seq_len(p, b_lo, b_hi);
    int lanes = row_lanes_for(u1 > u0 ? n / ((u1 - u0) * G) : 0, BT);
    if (p.row_lanes > 0) {  // knob: the largest power of two <= row_lanes
      lanes = 1;
      while (lanes * 2 <= p.row_lanes) lanes *= 2;
    }
    sh_lanes = lanes;
    mbar_init(&bar[0]);
    mbar_init(&bar[1]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int u0 = sh_u[0];
  const int nu = sh_u[1] - u0;
  const int lmax = sh_lmax;  // the same in every CTA of the cluster: all take lmax steps
  const int lanes = sh_lanes;
  const SmemLayout L = smem_layout(H, BT, BT, G, kCell == Cell::kLstm, p.u_cap, p.w_cap, 4,
                                   static_cast<int>(sizeof(typename T::W)), 2, p.u_cap * G + 1);
  float* acc_s = reinterpret_cast<float*>(smem + L.acc_off);
  float* hst = reinterpret_cast<float*>(smem + L.hst_off);
  float* cst = reinterpret_cast<float*>(smem + L.cst_off);
  typename T::W* w_s = reinterpret_cast<typename T::W*>(smem + L.w_off);
  auto slot = [&](int s) { return reinterpret_cast<float*>(smem + L.h_off + (s & 1) * L.h_stride); };

  const long long kb0 = __ldg(p.row_ptr + static_cast<long long>(u0) * G);
  const long long kb1 = __ldg(p.row_ptr + static_cast<long long>(u0 + nu) * G);
  load_weights<D>(p, kb0, kb1 - kb0, w_s);
  int* rows_s = reinterpret_cast<int*>(smem + L.r_off);  // row offsets into w_s
  int* len_s = reinterpret_cast<int*>(smem + L.len_off);  // lengths of the tile's columns
  load_step_constants(p, b_lo, BT, len_s, static_cast<long long>(u0) * G, nu * G, kb0, rows_s);
  init_state<kCell, D>(p, u0, nu, b_lo, BT, hst, cst);
  {  // h_0 of the whole tile into slot 0 (every CTA its own copy)
    float* h0s = slot(0);
    for (int i = tid; i < H * BT; i += nthr) {
      const int u = i / BT, b = b_lo + i % BT;
      h0s[i] = b < B ? T::to_f(static_cast<const typename T::S*>(p.h0)[static_cast<long long>(b) * H + u]) : 0.0f;
    }
  }
  // Every CTA of the cluster has started and initialised its mbarriers (a peer's shared memory
  // may be written only then).
  cluster_arrive();
  cluster_wait();

  // Bytes of h each step brings from the peers: all units but this CTA's own.
  const uint32_t peer_bytes = static_cast<uint32_t>(H - nu) * BT * 4u;
  const int npairs = nu * BT;
  bool waiting = true;  // false once a wait expired: skip the rest, reach the final barrier
  for (int s = 0; s < lmax; ++s) {
    // The input projection of this thread's first pair, loaded while h_{s-1} arrives.
    typename T::S xr[G] = {};
    PairStep ps0{};
    if (tid < npairs) {
      const int u = u0 + tid / BT;
      ps0 = pair_step(p, s, len_s[tid % BT], b_lo + tid % BT, u);
      if (ps0.valid) load_x_pair<D, G>(p, ps0, u, xr);
    }
    const bool send = s + 1 < lmax;
    // Arm the next slot's phase (its previous phase completed before step s-1 read it).
    if (tid == 0 && send) mbar_arrive_expect(&bar[(s + 1) & 1], peer_bytes);
    // Every thread waits (measured: one waiter + a block barrier is 5-9% slower).
    if (s > 0 && waiting) waiting = mbar_wait(p, &bar[s & 1], ((s - 1) >> 1) & 1);

    grouped_rows<D, BT>(rows_s, w_s, slot(s), nu * G, lanes, acc_s);
    __syncthreads();  // acc_s complete; every read of slot s % 2 done

    // Cell update; h_s into slot (s + 1) % 2 here and in every peer. Whole warps take part in
    // every iteration (the shuffles); a chunk's kV lanes are all active or all idle (npairs and
    // nthr are multiples of BT).
    float* nxt = slot(s + 1);
    for (int base = 0; base < npairs; base += nthr) {
      const int pi = base + tid;
      const bool active = pi < npairs;
      const int ul = pi / BT, bt = pi % BT;
      float h = 0.0f;
      if (active) {
        float hw[G];
        row_sums<G, BT>(acc_s, ul, bt, hw);
        const bool first = pi == tid;
        const float hnew = update_pair<kCell, D>(
            p, first ? ps0 : pair_step(p, s, len_s[bt], b_lo + bt, u0 + ul), u0 + ul, b_lo + bt,
            pi, first, xr, hw, hst, cst);
        h = T::to_f(T::from_f(hnew));  // what the other units see: h rounded to the dtype
      }
      const int c0 = lane - bt % kV;  // first lane of this lane's chunk
      float v[kV];
#pragma unroll
      for (int i = 0; i < kV; ++i) v[i] = __shfl_sync(0xffffffffu, h, c0 + i);
      if (active && send) {
        float* own = nxt + static_cast<long long>(u0 + ul) * BT + bt;
        *own = h;
        for (int r = bt % kV; r < csize; r += kV)
          if (r != rank) st_async<kV>(map_rank(own - bt % kV, r), v, map_rank(&bar[(s + 1) & 1], r));
      }
    }
    __syncthreads();  // own h_s stores and acc_s/hst reads done before the next step
  }
  // No CTA exits while a peer may still write to it or its stores are in flight.
  cluster_arrive();
  cluster_wait();
  write_tail<kCell, D>(p, u0, nu, lmax, b_lo, b_hi, BT, hst, cst);
#else
  // Built for an architecture without clusters: never launched (handlers.cu checks).
  if (threadIdx.x == 0 && blockIdx.x == 0) atomicExch(p.abort_flag, 3);
#endif
}

}  // namespace cuda
}  // namespace sprnn
