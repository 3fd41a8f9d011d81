// Exchange probe: the latency of the grid-wide h exchange alone, without the RNN, to tell how
// much of a small layer's ~0.8 us gather (step_probe.cu) is the L2 itself. Standalone, like
// step_probe.cu. Results: benchmarks/NOTES.md, sessions 6, 7, 19, 20, 22 (threads per block:
// 256 is the fastest, 1024 the slowest) and 24 (the TMA gathers no faster than the threads).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/exchange_probe.cu -o exchange_probe
//   ./exchange_probe [blocks] [threads] [steps] [words per block] [flagged 0-4] [depth] [gap]
//                    [share] [smem KB] [bulk] [group]
//
// 1. Ping-pong: block 0 and block k (k = 1 .. blocks-1, one at a time) bounce a tagged word
//    through global memory (st.relaxed.gpu / ld.relaxed.gpu, as the kernel's Lamport exchange)
//    200 times; prints the median round trip per partner with both SM ids. Two clusters of
//    values would be the near and far halves of the L2.
// 2. All-to-all steps: every block publishes wpb tagged words per step and waits until it has
//    seen every block's words of that step (its threads poll them side by side, 16-byte loads),
//    then a block barrier, `steps` times; prints us/step: the floor of the kernel's gather
//    phase. ReLU H=1152 at B=4 fp16 reads 18 KB per block and step: 132 blocks x 36 words. With
//    `flagged` 1 the words are raw and each block raises one release flag after them (half the
//    bytes of 16-bit data, one more L2 round trip). `depth` poll rounds in flight, issued `gap`
//    clock cycles apart (poll_items); prints the poll rounds each thread consumed per batch.
// 3. With `share` C >= 1 (sm_90): the all-to-all of 2., but the blocks run in thread block
//    clusters of C, each block polls only a C-th of the items from L2 and hands their values (the
//    8 bytes of an item without tags) to its C-1 peers with st.async, counted on their
//    mbarriers (the cluster variant's helpers, cluster_kernel.cuh). Question: is the big layers'
//    gather (ReLU H=5760: 92 KB per block and step, 1.8 us) bound by the L2's aggregate
//    bandwidth, so that C blocks sharing one read of each item would gather faster? C = 1 is the
//    same kernel without peers (its baseline, tile writes included). Each block asks for `smem
//    KB` of shared memory (default 200), so that one block fits per SM, as in the real kernel;
//    the probe prints how many clusters of C such blocks can be co-resident.
// 4. With `bulk` 1 or 2 (sm_90): the all-to-all of 2., but the bytes come in by the TMA
//    (cp.async.bulk), one copy per `group` producer blocks' words (default 1) into shared
//    memory, each with its own mbarrier; a warp checks a landed chunk's tags in shared memory
//    and copies it again while any is stale. bulk 2 also unpacks each item's 4 values (tags dropped) into an h tile, the
//    work the kernel's gather would add. Question: the threads' loads take in ~23 bytes per
//    clock per SM from L2 (session 20), which bounds ReLU H=5760's gather (92 KB per block and
//    step, ~2 us); does the TMA take them in faster?
//    No: 2.85 us/step at best (copies of 12 blocks' words) against the threads' 2.73.
// 5. With `flagged` 2, 3 or 4: the all-to-all of 2. with sentinel words (session 26): raw 16-bit
//    values in four slots, reset to 0xffff once every block has moved on (the paper's Lamport
//    buffers), half the bytes of tagged words. Correct only with a fence per thread and step
//    between the reset and the next publish; 3 leaves it out to price it. Measured: the fence
//    costs what the bytes save (2.29 against tagged 2.32 us/step at 176 tagged words' worth of
//    data; 1.89 without the fence), and at the small layers' sizes sentinel words are slower
//    than tagged ones even without it (ReLU H=1152's data: 1.38 against 1.27; H=2304's: 1.49
//    against 1.40).
// Every wait is bounded (a stuck run prints TIMEOUT instead of hanging).
// The tagged all-to-all's time depends on the poll loop's code shape by up to 16% (session 26:
// the same loop from two source shapes, 2.73 against 2.31 us/step at 176 words): compare
// settings within one build, never against figures of an older build.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/cluster_kernel.cuh"  // ld_relaxed, st_relaxed, global_ns, the mbarrier helpers
#include "cuda_check.h"

using sprnn::cuda::global_ns;
using sprnn::cuda::ld_relaxed;
using sprnn::cuda::st_relaxed;

constexpr int kRounds = 200;
constexpr long long kMaxSpins = 1ll << 24;

__device__ __forceinline__ unsigned smid() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
// Spins until *p == want; false after kMaxSpins polls (and raises *abort).
__device__ bool wait_for(const unsigned* p, unsigned want, int* abort) {
  for (long long i = 0; i < kMaxSpins; ++i) {
    if (ld_relaxed(p) == want) return true;
    if ((i & 1023) == 0 && ld_relaxed(reinterpret_cast<const unsigned*>(abort)) != 0) return false;
  }
  atomicExch(abort, 1);
  return false;
}

// words: [0, nb) ping flags, [nb, 2 nb) pong flags; rtt[k]: median round trip with block k.
__global__ void ping_pong(unsigned* words, unsigned* sm_of, unsigned long long* rtt, int* abort) {
  const int nb = gridDim.x, b = blockIdx.x;
  if (threadIdx.x != 0) return;
  sm_of[b] = smid();
  unsigned* ping = words;
  unsigned* pong = words + nb;
  if (b == 0) {
    unsigned long long t[kRounds];
    for (int k = 1; k < nb; ++k) {
      for (int r = 0; r < kRounds; ++r) {
        const unsigned tag = static_cast<unsigned>(r + 1);
        const unsigned long long t0 = global_ns();
        st_relaxed(ping + k, tag);
        if (!wait_for(pong + k, tag, abort)) return;
        t[r] = global_ns() - t0;
      }
      // median by partial selection sort (kRounds is small)
      for (int i = 0; i <= kRounds / 2; ++i)
        for (int j = i + 1; j < kRounds; ++j)
          if (t[j] < t[i]) { const unsigned long long x = t[i]; t[i] = t[j]; t[j] = x; }
      rtt[k] = t[kRounds / 2];
    }
  } else {
    for (int r = 0; r < kRounds; ++r) {
      const unsigned tag = static_cast<unsigned>(r + 1);
      if (!wait_for(ping + b, tag, abort)) return;
      st_relaxed(pong + b, tag);
    }
  }
}

// Item checks for poll_items: all 4 words carry the step's tag (Lamport words), or no 16-bit
// half is the sentinel 0xffff (sentinel words: raw values, reset after use).
__device__ __forceinline__ auto tagged_fresh(unsigned tag) {
  return [tag](const uint4& w) {
    return (w.x >> 16) == tag && (w.y >> 16) == tag && (w.z >> 16) == tag && (w.w >> 16) == tag;
  };
}
__device__ __forceinline__ bool no_sentinel(const uint4& w) {
  return (__vcmpeq2(w.x, 0xffffffffu) | __vcmpeq2(w.y, 0xffffffffu) | __vcmpeq2(w.z, 0xffffffffu) |
          __vcmpeq2(w.w, 0xffffffffu)) == 0u;
}

// Rounds of pipelined polling for one thread's items (ib, ib + nthr, ... up to N): D rounds
// of loads in flight, issued `gap` clock cycles apart, each consumed in turn and re-issued for
// the still-pending items. D = 1 is the kernel's gather (a stale item costs a whole L2 round
// trip); D = 2 or 3 were meant to cut that wait to about a round trip / D, at D times the poll
// traffic. Measured (NOTES.md, session 7): they do not; the extra polls slow every block.
// Each item that fresh(its 16 bytes) accepts goes to accept(item index, its 16 bytes) once. Counts
// consumed rounds in `rounds`. false on a timeout.
template <int D, int N, class Fresh, class Accept>
__device__ __forceinline__ bool poll_items(const uint4* slot, int ib, int nthr, int nitems, Fresh&& fresh,
                            long long gap, Accept&& accept, unsigned long long& rounds) {
  unsigned pending = 0;
  for (int i = 0; i < N; ++i) pending |= (ib + i * nthr < nitems ? 1u : 0u) << i;
  uint4 w[D][N];
  auto issue = [&](uint4 (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if ((pending >> i) & 1u)
        asm volatile("ld.relaxed.gpu.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[i].x), "=r"(r[i].y), "=r"(r[i].z), "=r"(r[i].w)
                     : "l"(slot + ib + i * nthr) : "memory");
  };
#pragma unroll
  for (int d = 0; d < D; ++d) {
    if (d > 0) {
      const long long t = clock64();
      while (clock64() - t < gap) {}
    }
    issue(w[d]);
  }
  for (long long spins = 0; spins < kMaxSpins; ++spins) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
#pragma unroll
      for (int i = 0; i < N; ++i)
        if (((pending >> i) & 1u) && fresh(w[d][i])) {
          accept(ib + i * nthr, w[d][i]);
          pending &= ~(1u << i);
        }
      ++rounds;
      if (!pending) return true;
      issue(w[d]);
    }
  }
  return false;
}

// All-to-all steps with a payload of wpb 32-bit words per block (wpb % 4 == 0), two slots
// (four for sentinel words).
// Tagged (flagged == 0): every word carries the step's tag in its high half (the kernel's 16-bit
// Lamport words); each reader polls all nb * wpb words with 16-byte loads, up to 8 per thread
// and round, `depth` rounds in flight (poll_items). Flagged: raw words, then one release flag
// per block; a reader's threads poll the nb flags (acquire), barrier, then read the words once.
// Both end with a block barrier, like the kernel's gather. rounds: poll rounds consumed.
// Sentinel (flagged 2, 3, 4): raw 16-bit values in four slots, polled until no half is 0xffff,
// then reset for the step after next (the paper's Lamport buffers): half the bytes of tagged
// words, plus one fence per thread and step (2: fence.acq_rel.gpu, 4: fence.sc.gpu; 3: none,
// unsafe, to price the fence).
// N = 8 items per thread and batch at D = 1, else 4 (registers). kMaxThreads 1024 (D = 1
// only) is the thread count of DESIGN.md's exchange floor; it caps the registers at 64.
template <int D, int kMaxThreads = 512>
__global__ void __launch_bounds__(kMaxThreads, 1)
all_to_all(unsigned* words, unsigned* flags, int steps, int wpb, int flagged, long long gap,
           unsigned long long* ns,
                           unsigned long long* rounds, int* abort) {
  const int nb = gridDim.x, b = blockIdx.x, tid = threadIdx.x, nthr = blockDim.x;
  const int nitems = nb * wpb / 4;
  unsigned sink = 0;
  unsigned long long my_rounds = 0;
  const unsigned long long t0 = global_ns();
  const bool sentinel = flagged >= 2;
  const int nslots = sentinel ? 4 : 2;
  for (int s = 0; s < steps; ++s) {
    const unsigned tag = static_cast<unsigned>(s % 65535 + 1);
    unsigned* slot = words + static_cast<long long>(s % nslots) * nb * wpb;
    for (int i = tid; i < wpb; i += nthr)
      st_relaxed(slot + b * wpb + i, flagged ? static_cast<unsigned>(i) : (tag << 16) | i);
    bool ok = true;
    if (sentinel) {
      // Raw 16-bit values; a half of 0xffff means "not yet written". Every block has seen step
      // s, published after its reads of step s - 1, so this block's words of slot s - 1 can be
      // reset for step s + 3. The fence after the poll orders this step's observations before
      // the next polls and the previous reset before the next publish (release/acquire).
      const uint4* s4 = reinterpret_cast<const uint4*>(slot);
      for (int ib = tid; ib < nitems && ok; ib += nthr * 8) {
        ok = poll_items<1, 8>(s4, ib, nthr, nitems, no_sentinel, 0,
                              [&](int, const uint4& w) { sink += w.x ^ w.w; }, my_rounds);
        if (!ok) atomicExch(abort, 1);
      }
      if (flagged == 2) asm volatile("fence.acq_rel.gpu;" ::: "memory");
      if (flagged == 4) asm volatile("fence.sc.gpu;" ::: "memory");
      if (__syncthreads_or(!ok)) return;
      unsigned* old = words + static_cast<long long>((s + 3) % nslots) * nb * wpb;
      for (int i = tid; i < wpb; i += nthr) st_relaxed(old + b * wpb + i, 0xffffffffu);
      continue;
    }
    if (flagged) {
      __syncthreads();
      if (tid == 0) {
        __threadfence();
        asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flags + (s & 1) * nb + b), "r"(tag) : "memory");
      }
      for (int k = tid; k < nb && ok; k += nthr) {
        long long i = 0;
        unsigned v;
        do {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flags + (s & 1) * nb + k) : "memory");
        } while (v != tag && ++i < kMaxSpins);
        if (v != tag) { atomicExch(abort, 1); ok = false; }
      }
      if (__syncthreads_or(!ok)) return;
      for (int it = tid; it < nitems; it += nthr) {
        const uint4 w = __ldcg(reinterpret_cast<const uint4*>(slot) + it);
        sink += w.x ^ w.y ^ w.z ^ w.w;
      }
    } else {
      const uint4* s4 = reinterpret_cast<const uint4*>(slot);
      constexpr int N = D == 1 ? 8 : 4;
      for (int ib = tid; ib < nitems && ok; ib += nthr * N) {
        ok = poll_items<D, N>(s4, ib, nthr, nitems, tagged_fresh(tag), gap,
                               [&](int, const uint4& w) { sink += w.x ^ w.w; }, my_rounds);
        if (!ok) atomicExch(abort, 1);
      }
    }
    if (__syncthreads_or(!ok)) return;
  }
  if (tid == 0) ns[b] = global_ns() - t0;
  if (tid < nitems) atomicAdd(rounds, my_rounds);
  if (sink == 0xdeadbeef) abort[1] = 1;  // keeps the reads alive
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
using sprnn::cuda::cluster_arrive;
using sprnn::cuda::cluster_rank;
using sprnn::cuda::cluster_wait;
using sprnn::cuda::map_rank;
using sprnn::cuda::mbar_arrive_expect;
using sprnn::cuda::mbar_init;
using sprnn::cuda::mbar_try_wait;
using sprnn::cuda::st_async;
#endif

// 3. The cluster-shared all-to-all (see the header). The block of rank r polls the r-th of C
// contiguous ranges of the items (16 bytes each: 4 tagged words; contiguous, so that no 32-byte
// sector is read by two blocks of a cluster); an item's 4 values (8 bytes) go to slot s % 2 of
// the tile of every block of the cluster. Two slots and two mbarriers: a peer writes step s + 2
// into our slot s % 2 only after it has seen our step s + 2 words, which we publish after our
// barrier of step s.
__global__ void __launch_bounds__(512, 1)
all_to_all_shared(unsigned* words, int steps, int wpb, int csize, unsigned long long* ns,
                  unsigned long long* rounds, int* abort) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bar[2];
  const int nb = gridDim.x, b = blockIdx.x, tid = threadIdx.x, nthr = blockDim.x;
  const int nitems = nb * wpb / 4;
  const int rank = static_cast<int>(cluster_rank());
  const int lo = static_cast<int>(static_cast<long long>(nitems) * rank / csize);
  const int mine = static_cast<int>(static_cast<long long>(nitems) * (rank + 1) / csize) - lo;
  const uint32_t peer_bytes = static_cast<uint32_t>(nitems - mine) * 8u;
  uint2* tile = reinterpret_cast<uint2*>(smem);
  if (tid == 0) {
    mbar_init(&bar[0]);
    mbar_init(&bar[1]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  cluster_arrive();
  cluster_wait();
  unsigned long long my_rounds = 0;
  bool ok = true;
  const unsigned long long t0 = global_ns();
  for (int s = 0; s < steps; ++s) {
    const unsigned tag = static_cast<unsigned>(s % 65535 + 1);
    unsigned* slot = words + static_cast<long long>(s & 1) * nb * wpb;
    uint2* mine_tile = tile + static_cast<long long>(s & 1) * nitems;
    if (tid == 0) mbar_arrive_expect(&bar[s & 1], peer_bytes);
    for (int i = tid; i < wpb; i += nthr) st_relaxed(slot + b * wpb + i, (tag << 16) | i);
    const uint4* s4 = reinterpret_cast<const uint4*>(slot);
    // This block's items, 8 per thread and round in flight, as the kernel's gather: each one's
    // values into this block's tile and, by st.async, into every peer's.
    auto accept = [&](int k, const uint4& w) {
      const int item = lo + k;
      const uint32_t v01 = (w.x & 0xffffu) | (w.y << 16);  // the values, tags dropped
      const uint32_t v23 = (w.z & 0xffffu) | (w.w << 16);
      mine_tile[item] = make_uint2(v01, v23);
      const float v[2] = {__uint_as_float(v01), __uint_as_float(v23)};  // bits, not values
      for (int r = 1; r < csize; ++r) {
        const int peer = (rank + r) % csize;
        st_async<2>(map_rank(mine_tile + item, peer), v, map_rank(&bar[s & 1], peer));
      }
    };
    constexpr int N = 8;
    for (int k0 = tid; k0 < mine && ok; k0 += nthr * N)
      ok = poll_items<1, N>(s4 + lo, k0, nthr, mine, tagged_fresh(tag), 0, accept, my_rounds);
    // Every thread waits for the peers' bytes of this step (phase s / 2 of slot s % 2).
    for (long long i = 0; ok && !mbar_try_wait(&bar[s & 1], (s >> 1) & 1); )
      if (++i > kMaxSpins) ok = false;
    if (!ok) atomicExch(abort, 1);
    if (__syncthreads_or(!ok)) break;
  }
  if (tid == 0) ns[b] = global_ns() - t0;
  atomicAdd(rounds, my_rounds);
  // No block exits while a peer's stores to it may be in flight.
  cluster_arrive();
  cluster_wait();
  if (tile[tid % (2 * nitems)].x == 0xdeadbeefu) abort[1] = 1;  // keeps the tile alive
#else
  if (threadIdx.x == 0) atomicExch(abort, 3);
#endif
}

// 4. The TMA all-to-all (see the header). Shared memory: nb mbarriers, then the nb * wpb words
// of the step in chunks of `group` blocks' words (chunk k: blocks k * group ...), then (bulk 2)
// the h tile, 8 bytes per item.
// Warp w owns chunks w, w + nwarps, ...; lane i issues the warp's i-th chunk, then the warp
// takes its chunks in turn: waits for the copy, checks every word's tag, and issues the copy
// again when any is stale (after a proxy fence: the generic reads of the chunk are done).
__global__ void __launch_bounds__(512, 1)
all_to_all_bulk(const unsigned* words_in, int steps, int wpb, int unpack, int group, unsigned long long* ns,
                unsigned long long* rounds, int* abort) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned* words = const_cast<unsigned*>(words_in);
  const int nb = gridDim.x, b = blockIdx.x, tid = threadIdx.x, nthr = blockDim.x;
  const int warp = tid >> 5, lane = tid & 31, nwarps = nthr >> 5;
  const int nchunks = (nb + group - 1) / group;
  const int nmine = warp < nchunks ? (nchunks - warp + nwarps - 1) / nwarps : 0;  // <= 32 (host)
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem);
  unsigned* stage = reinterpret_cast<unsigned*>(smem + ((nb * 8 + 127) / 128) * 128);
  uint2* tile = reinterpret_cast<uint2*>(stage + static_cast<long long>(nb) * wpb);
  const int cw = wpb * group;  // words per chunk (the last one may be shorter)
  auto chunk_words = [&](int k) { return (k + 1) * group <= nb ? cw : (nb - k * group) * wpb; };
  for (int k = tid; k < nchunks; k += nthr) mbar_init(&bars[k]);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  auto issue = [&](int k, const unsigned* slot) {
    const uint32_t bytes = static_cast<uint32_t>(chunk_words(k)) * 4u;
    mbar_arrive_expect(&bars[k], bytes);
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(stage + static_cast<long long>(k) * cw))),
        "l"(slot + static_cast<long long>(k) * cw), "r"(bytes),
        "r"(static_cast<uint32_t>(__cvta_generic_to_shared(&bars[k]))) : "memory");
  };
  uint32_t parity = 0;  // bit i: the phase the warp's i-th chunk completes next
  unsigned long long my_rounds = 0;
  unsigned sink = 0;
  bool ok = true;
  const unsigned long long t0 = global_ns();
  for (int s = 0; s < steps && ok; ++s) {
    const unsigned tag = static_cast<unsigned>(s % 65535 + 1);
    unsigned* slot = words + static_cast<long long>(s & 1) * nb * wpb;
    for (int i = tid; i < wpb; i += nthr) st_relaxed(slot + b * wpb + i, (tag << 16) | i);
    // The chunks were last read by generic loads (step s - 1, before the block barrier).
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (lane < nmine) issue(warp + lane * nwarps, slot);
    uint32_t pending = nmine >= 32 ? 0xffffffffu : (1u << nmine) - 1u;
    for (long long spins = 0; pending && ok; ++spins) {
      if (spins > kMaxSpins) { ok = false; break; }
      for (int i = 0; i < nmine; ++i) {
        if (!((pending >> i) & 1u)) continue;
        const int k = warp + i * nwarps;
        const uint32_t ph = (parity >> i) & 1u;
        for (long long t = 0; !mbar_try_wait(&bars[k], ph); )
          if (++t > kMaxSpins) { ok = false; break; }
        if (!ok) break;
        parity ^= 1u << i;
        const uint4* c4 = reinterpret_cast<const uint4*>(stage + static_cast<long long>(k) * cw);
        const int n4 = chunk_words(k) / 4;
        bool fresh = true;
        for (int q = lane; q < n4; q += 32) {
          const uint4 w = c4[q];
          fresh = fresh && (w.x >> 16) == tag && (w.y >> 16) == tag && (w.z >> 16) == tag &&
                  (w.w >> 16) == tag;
        }
        ++my_rounds;
        if (__all_sync(0xffffffffu, fresh)) {
          pending &= ~(1u << i);
          for (int q = lane; q < n4; q += 32) {
            const uint4 w = c4[q];
            if (unpack)
              tile[static_cast<long long>(k) * (cw / 4) + q] =
                  make_uint2((w.x & 0xffffu) | (w.y << 16), (w.z & 0xffffu) | (w.w << 16));
            else
              sink += w.x ^ w.w;
          }
        } else if (lane == 0) {
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          issue(k, slot);
        }
      }
    }
    if (!ok) atomicExch(abort, 1);
    if (__syncthreads_or(!ok)) break;
  }
  if (tid == 0) ns[b] = global_ns() - t0;
  if (lane == 0) atomicAdd(rounds, my_rounds);
  if (sink == 0xdeadbeef || (unpack && tile[tid % (nb * wpb / 4)].x == 0xdeadbeefu)) abort[1] = 1;
#else
  if (threadIdx.x == 0) atomicExch(abort, 3);
#endif
}

// After an all-to-all launch: waits for it and reads its abort flag (0 = every block finished;
// otherwise prints "<name>: TIMEOUT"), the slowest block's time in us per step and the poll
// rounds counted over all threads.
struct AllToAllResult {
  int flag = 0;
  double us_per_step = 0;
  unsigned long long rounds = 0;
};
AllToAllResult finish_all_to_all(const char* name, const int* abort, const unsigned long long* ns,
                                 const unsigned long long* rounds, int nb, int steps) {
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  AllToAllResult r;
  CHECK(cudaMemcpy(&r.flag, abort, sizeof(int), cudaMemcpyDeviceToHost));
  if (r.flag) std::printf("%s: TIMEOUT (flag %d)\n", name, r.flag);
  std::vector<unsigned long long> t(nb);
  CHECK(cudaMemcpy(t.data(), ns, nb * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&r.rounds, rounds, sizeof(r.rounds), cudaMemcpyDeviceToHost));
  r.us_per_step = *std::max_element(t.begin(), t.end()) / 1000.0 / steps;
  return r;
}

// The zeroed buffers of one all-to-all launch (parts 3 and 4): two slots of nb * wpb words,
// each block's time, the poll-round count and the abort flags.
struct AllToAllBuffers {
  unsigned* words = nullptr;
  unsigned long long *ns = nullptr, *rounds = nullptr;
  int* abort = nullptr;
  AllToAllBuffers(int nb, int wpb) {
    const size_t word_bytes = 2 * static_cast<size_t>(nb) * wpb * sizeof(unsigned);
    CHECK(cudaMalloc(&words, word_bytes));
    CHECK(cudaMalloc(&ns, nb * sizeof(unsigned long long)));
    CHECK(cudaMalloc(&rounds, sizeof(unsigned long long)));
    CHECK(cudaMalloc(&abort, 2 * sizeof(int)));
    CHECK(cudaMemset(words, 0, word_bytes));
    CHECK(cudaMemset(rounds, 0, sizeof(unsigned long long)));
    CHECK(cudaMemset(abort, 0, 2 * sizeof(int)));
  }
  ~AllToAllBuffers() {
    CHECK(cudaFree(words));
    CHECK(cudaFree(ns));
    CHECK(cudaFree(rounds));
    CHECK(cudaFree(abort));
  }
};

// Part 3 alone (share >= 1): launch the cluster-shared all-to-all and print us/step.
int shared_all_to_all(int nb, int threads, int steps, int wpb, int csize, int smem_kb) {
  const int nitems = nb * wpb / 4;
  const size_t tile_bytes = 2 * static_cast<size_t>(nitems) * 8;
  const size_t smem = std::max(tile_bytes, static_cast<size_t>(smem_kb) * 1024);
  if (nb % csize || wpb % 4 || threads > 512) {
    std::fprintf(stderr, "share: blocks must be a multiple of the cluster size, wpb of 4, threads <= 512\n");
    return 2;
  }
  const void* fn = reinterpret_cast<const void*>(all_to_all_shared);
  CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)));
  CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(nb);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = csize;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeCooperative;
  attr[1].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int active = 0;
  CHECK(cudaOccupancyMaxActiveClusters(&active, fn, &cfg));
  std::printf("share %d: %zu bytes of shared memory per block, at most %d clusters (%d blocks) "
              "co-resident\n", csize, smem, active, active * csize);
  if (active * csize < nb) {
    std::printf("all-to-all shared: %d blocks cannot be co-resident: skipped\n", nb);
    return 0;
  }
  AllToAllBuffers buf(nb, wpb);
  unsigned* words = buf.words;
  unsigned long long *ns = buf.ns, *rounds = buf.rounds;
  int* abort = buf.abort;
  cfg.numAttrs = 2;  // cooperative as well, where the driver takes it with clusters
  cudaError_t e =
      cudaLaunchKernelEx(&cfg, all_to_all_shared, words, steps, wpb, csize, ns, rounds, abort);
  const bool coop = e == cudaSuccess;
  if (!coop) {
    (void)cudaGetLastError();
    cfg.numAttrs = 1;  // co-residency from the occupancy check above
    CHECK(cudaLaunchKernelEx(&cfg, all_to_all_shared, words, steps, wpb, csize, ns, rounds, abort));
  }
  const AllToAllResult res = finish_all_to_all("all-to-all shared", abort, ns, rounds, nb, steps);
  if (!res.flag) {
    std::printf("all-to-all shared %d (%s launch): %d blocks x %d threads, %d words per block, "
                "%d bytes from L2 per block per step, %d steps: %.3f us/step, %.2f poll rounds "
                "per thread and step\n", csize, coop ? "cooperative" : "plain", nb, threads, wpb,
                nitems / csize * 16, steps, res.us_per_step,
                static_cast<double>(res.rounds) / (static_cast<double>(nb) * threads * steps));
  }
  return 0;
}

// Part 4 alone (bulk 1 or 2): launch the TMA all-to-all and print us/step.
int bulk_all_to_all(int nb, int threads, int steps, int wpb, int unpack, int group, int smem_kb) {
  const int nwarps = threads / 32;
  const int nchunks = (nb + group - 1) / group;
  const size_t need = ((nb * 8 + 127) / 128) * 128 + static_cast<size_t>(nb) * wpb * 4 +
                      (unpack ? static_cast<size_t>(nb) * wpb * 2 : 0);
  const size_t smem = std::max(need, static_cast<size_t>(smem_kb) * 1024);
  if (wpb % 4 || threads % 32 || threads > 512 || group < 1 || (nchunks + nwarps - 1) / nwarps > 32 || smem > 227 * 1024) {
    std::fprintf(stderr, "bulk: wpb a multiple of 4, threads a multiple of 32 up to 512, at most "
                         "32 chunks per warp, shared memory up to 227 KB (needs %zu)\n", need);
    return 2;
  }
  const void* fn = reinterpret_cast<const void*>(all_to_all_bulk);
  CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  AllToAllBuffers buf(nb, wpb);
  unsigned* words = buf.words;
  unsigned long long *ns = buf.ns, *rounds = buf.rounds;
  int* abort = buf.abort;
  int st = steps, w = wpb, u = unpack, g = group;
  void* args[] = {&words, &st, &w, &u, &g, &ns, &rounds, &abort};
  CHECK(cudaLaunchCooperativeKernel(fn, dim3(nb), dim3(threads), args, smem, nullptr));
  const AllToAllResult res = finish_all_to_all("all-to-all bulk", abort, ns, rounds, nb, steps);
  if (!res.flag) {
    std::printf("all-to-all bulk%s: %d blocks x %d threads, %d words (%d bytes by TMA) per block "
                "per step, %d chunks of %d blocks' words, %d steps: %.3f us/step, %.2f copies per "
                "chunk and step\n", unpack ? " + unpack" : "", nb, threads, wpb, nb * wpb * 4,
                nchunks, group, steps, res.us_per_step,
                static_cast<double>(res.rounds) / (static_cast<double>(nb) * nchunks * steps));
  }
  return 0;
}

// The all-to-all's word kinds, by the `flagged` argument.
constexpr const char* kWordKinds[] = {"tagged", "flagged", "sentinel+fence.acq_rel",
                                      "sentinel, no fence", "sentinel+fence.sc"};

int main(int argc, char** argv) {
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int nb = argc > 1 ? std::atoi(argv[1]) : sms;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 128;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 2000;
  const int wpb = argc > 4 ? std::atoi(argv[4]) : 4;
  const int flagged = argc > 5 ? std::atoi(argv[5]) : 0;
  const int depth = argc > 6 ? std::atoi(argv[6]) : 1;
  const long long gap = argc > 7 ? std::atoll(argv[7]) : 0;
  const int share = argc > 8 ? std::atoi(argv[8]) : 0;
  const int smem_kb = argc > 9 ? std::atoi(argv[9]) : 200;
  const int bulk = argc > 10 ? std::atoi(argv[10]) : 0;
  const int group = argc > 11 ? std::atoi(argv[11]) : 1;
  if (bulk > 0) return bulk_all_to_all(nb, threads, steps, wpb, bulk == 2, group, smem_kb);
  if (share > 0) return shared_all_to_all(nb, threads, steps, wpb, share, smem_kb);
  if (nb < 2 || nb > sms || threads < 32 || threads > (depth == 1 ? 1024 : 512) || steps < 1 ||
      wpb < 4 || wpb % 4 || depth < 1 || depth > 3 || gap < 0 || flagged < 0 || flagged > 4 ||
      (flagged >= 2 && depth != 1)) {
    std::fprintf(stderr,
                 "usage: exchange_probe [blocks 2..%d] [threads 32..512, or ..1024 at depth 1] "
                 "[steps] [words per block, multiple of 4] [flagged 0..4] [poll depth 1..3] "
                 "[gap cycles]\n", sms);
    return 2;
  }
  unsigned *words, *flags, *sm_of;
  unsigned long long *rtt, *ns, *rounds;
  int* abort;
  const size_t nwords = 4 * static_cast<size_t>(nb) * wpb;  // ping-pong uses the first 2 nb
  CHECK(cudaMalloc(&words, nwords * sizeof(unsigned)));
  CHECK(cudaMalloc(&flags, 2 * nb * sizeof(unsigned)));
  CHECK(cudaMalloc(&sm_of, nb * sizeof(unsigned)));
  CHECK(cudaMalloc(&rtt, nb * sizeof(unsigned long long)));
  CHECK(cudaMalloc(&ns, nb * sizeof(unsigned long long)));
  CHECK(cudaMalloc(&rounds, sizeof(unsigned long long)));
  CHECK(cudaMalloc(&abort, 2 * sizeof(int)));

  // 1. ping-pong (one warp per block; cooperative launch: every block co-resident)
  CHECK(cudaMemset(words, 0, 2 * nb * sizeof(unsigned)));
  CHECK(cudaMemset(rtt, 0, nb * sizeof(unsigned long long)));
  CHECK(cudaMemset(abort, 0, sizeof(int)));
  {
    void* args[] = {&words, &sm_of, &rtt, &abort};
    CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(ping_pong), dim3(nb), dim3(32),
                                      args, 0, nullptr));
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
  }
  int flag = 0;
  CHECK(cudaMemcpy(&flag, abort, sizeof(int), cudaMemcpyDeviceToHost));
  std::vector<unsigned> sm(nb);
  std::vector<unsigned long long> r(nb);
  CHECK(cudaMemcpy(sm.data(), sm_of, nb * sizeof(unsigned), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(r.data(), rtt, nb * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  if (flag) {
    std::printf("ping-pong: TIMEOUT\n");
  } else {
    std::vector<unsigned long long> v(r.begin() + 1, r.end());
    std::sort(v.begin(), v.end());
    std::printf("ping-pong round trip ns (block 0 on SM %u, %d partners): min %llu p25 %llu "
                "median %llu p75 %llu max %llu\n", sm[0], nb - 1, v.front(), v[v.size() / 4],
                v[v.size() / 2], v[3 * v.size() / 4], v.back());
    for (int k = 1; k < nb; ++k) std::printf("  partner block %3d SM %3u: %llu ns\n", k, sm[k], r[k]);
  }

  // 2. all-to-all steps (sentinel words start as "not yet written")
  CHECK(cudaMemset(words, flagged >= 2 ? 0xff : 0, nwords * sizeof(unsigned)));
  CHECK(cudaMemset(flags, 0, 2 * nb * sizeof(unsigned)));
  CHECK(cudaMemset(abort, 0, 2 * sizeof(int)));
  CHECK(cudaMemset(rounds, 0, sizeof(unsigned long long)));
  {
    int st = steps, w = wpb, f = flagged;
    long long g = gap;
    void* args[] = {&words, &flags, &st, &w, &f, &g, &ns, &rounds, &abort};
    const void* fn = depth >= 3   ? reinterpret_cast<const void*>(all_to_all<3>)
                     : depth == 2 ? reinterpret_cast<const void*>(all_to_all<2>)
                     : threads > 512 ? reinterpret_cast<const void*>(all_to_all<1, 1024>)
                                  : reinterpret_cast<const void*>(all_to_all<1>);
    CHECK(cudaLaunchCooperativeKernel(fn, dim3(nb),
                                      dim3(threads), args, 0, nullptr));
  }
  const AllToAllResult res = finish_all_to_all("all-to-all", abort, ns, rounds, nb, steps);
  if (!res.flag) {
    // polling threads per block: min(threads, items); each takes its items in batches of 8 (depth 1) or 4
    const int items = nb * wpb / 4, pollers = std::min(threads, items), per = depth == 1 ? 8 : 4;
    const int batches = (items + pollers * per - 1) / (pollers * per);
    std::printf("all-to-all %s: %d blocks x %d threads, %d words (%d bytes read) per block per step, "
                "%d steps, poll depth %d gap %lld cycles: %.3f us/step, %.2f poll rounds per "
                "thread batch\n", kWordKinds[flagged], nb, threads, wpb, nb * wpb * 4,
                steps, depth, gap, res.us_per_step,
                flagged == 1 ? 0.0 : static_cast<double>(res.rounds) / (static_cast<double>(nb) * pollers * batches * steps));
  }
  return 0;
}
