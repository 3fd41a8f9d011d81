// L1 gather probe: does the gather take its bytes in from L2 faster through weak (L1-allocating)
// loads than through the kernel's ld.relaxed.gpu (LDG.E.128.STRONG.GPU, which bypasses L1)?
// Session 20 put the big layers' gather on ~23 bytes per clock per SM through strong loads.
// A weak load may hit a stale L1 line, so the idea needs the L1 emptied once per step
// (ld.acquire.gpu compiles to LDG.STRONG.GPU + CCTL.IVALL, the hardware's L1 invalidation) and
// every chunk still checked by its tags, stale ones polled again with strong loads; the tags
// keep it correct whatever the L1 holds. Standalone, like step_probe.cu:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/l1_gather_probe.cu -o l1_gather_probe
//   ./l1_gather_probe part blocks threads steps bytes_or_words load inval
//
// part 1: every block reads the same `bytes` (16-byte loads, each thread its items side by
//   side) from a buffer written before the launch, stores them into shared memory, then a block
//   barrier, `steps` times. No producers: the ingest alone.
// part 2: the tagged all-to-all of exchange_probe.cu (every block publishes `words` 16|16
//   tagged words per step into slot s % 2 and polls every block's), with the first poll round
//   of each step by `load` and the re-polls of stale items strong.
// load: 0 strong (ld.relaxed.gpu), 1 weak (ld.global), 2 weak without L1 allocation
//   (ld.global.L1::no_allocate), 3 the non-coherent path (ld.global.nc; part 1 only).
// inval (the L1 emptied once per step by an ld.acquire.gpu): 0 never, 1 thread 0 after the step's
//   barrier, 2 thread 0 before it, 3 lane 0 of every warp before its loads.
// Prints us/step (median and max over blocks) and, in part 2, poll rounds per batch and step.
// Measured (NOTES.md, session 40): no. Part 1 takes 46 KB in 0.915-0.918 us/step with every load
// form and L1 policy (~25 bytes per clock per SM, 66 blocks as fast as 132); part 2's weak first
// rounds need more re-polls and are 2-18% slower (the kernel's A/B: ReLU H=5760 4.01 -> 4.06).
// Each block asks for 200 KB of shared memory, as the big layers' kernel does, so the L1 has only
// what is left of the SM's 256 KB. Every wait is bounded (a stuck run prints TIMEOUT).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/memory.cuh"  // global_ns, st_relaxed, ld_acquire
#include "cuda_check.h"

using sprnn::cuda::global_ns;
using sprnn::cuda::ld_acquire;
using sprnn::cuda::st_relaxed;

constexpr long long kMaxSpins = 1ll << 22;
constexpr int kItemsPerThread = 8;  // 16-byte items in flight per thread, as the deep gather
constexpr int kSmemBytes = 200 * 1024;

// One 16-byte load of the form kLoad (the header's `load`).
template <int kLoad>
__device__ __forceinline__ uint4 load16(const uint4* p) {
  static_assert(kLoad >= 0 && kLoad < 4, "load form");
  uint4 r;
#define SPRNN_LOAD16(OP)                                                                  \
  asm volatile(OP ".v4.u32 {%0,%1,%2,%3}, [%4];"                                          \
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p) : "memory")
  if constexpr (kLoad == 0) SPRNN_LOAD16("ld.relaxed.gpu.global");
  if constexpr (kLoad == 1) SPRNN_LOAD16("ld.global");
  if constexpr (kLoad == 2) SPRNN_LOAD16("ld.global.L1::no_allocate");
  if constexpr (kLoad == 3) SPRNN_LOAD16("ld.global.nc");
#undef SPRNN_LOAD16
  return r;
}

// The L1 invalidation where `inval` puts it: `where` 1 after the barrier, 2 before it, 3 per warp.
__device__ __forceinline__ void maybe_invalidate(int inval, int where, const unsigned* dummy,
                                                 unsigned& sink) {
  if (inval != where) return;
  const bool leader = where == 3 ? (threadIdx.x & 31) == 0 : threadIdx.x == 0;
  if (leader) sink += ld_acquire(dummy);
}

// Part 1: the ingest alone.
template <int kLoad>
__global__ void __launch_bounds__(512, 1)
read_all(const uint4* buf, int nitems, int steps, int inval, const unsigned* dummy,
         unsigned long long* ns, int* abort) {
  extern __shared__ uint4 tile[];
  const int tid = threadIdx.x, nthr = blockDim.x;
  unsigned sink = 0;
  const unsigned long long t0 = global_ns();
  for (int s = 0; s < steps; ++s) {
    maybe_invalidate(inval, 1, dummy, sink);
    maybe_invalidate(inval, 3, dummy, sink);
    for (int ib = tid; ib < nitems; ib += nthr * kItemsPerThread) {
      uint4 w[kItemsPerThread];
#pragma unroll
      for (int i = 0; i < kItemsPerThread; ++i)
        if (ib + i * nthr < nitems) w[i] = load16<kLoad>(buf + ib + i * nthr);
#pragma unroll
      for (int i = 0; i < kItemsPerThread; ++i)
        if (ib + i * nthr < nitems) tile[ib + i * nthr] = w[i];
    }
    maybe_invalidate(inval, 2, dummy, sink);
    __syncthreads();
  }
  if (tid == 0) ns[blockIdx.x] = global_ns() - t0;
  if (sink == 0xdeadbeef) abort[1] = 1;  // keeps the acquire loads alive
}

// Part 2: the tagged all-to-all, first round by kLoad, re-polls strong.
template <int kLoad>
__global__ void __launch_bounds__(512, 1)
all_to_all(unsigned* words, int steps, int wpb, int inval, const unsigned* dummy,
           unsigned long long* ns, unsigned long long* rounds, int* abort) {
  extern __shared__ uint4 tile[];
  const int nb = gridDim.x, b = blockIdx.x, tid = threadIdx.x, nthr = blockDim.x;
  const int nitems = nb * wpb / 4;
  unsigned sink = 0;
  unsigned long long my_rounds = 0;
  bool ok = true;
  const unsigned long long t0 = global_ns();
  for (int s = 0; s < steps && ok; ++s) {
    const unsigned tag = static_cast<unsigned>(s % 65535 + 1);
    unsigned* slot = words + static_cast<long long>(s & 1) * nb * wpb;
    maybe_invalidate(inval, 1, dummy, sink);
    for (int i = tid; i < wpb; i += nthr) st_relaxed(slot + b * wpb + i, (tag << 16) | i);
    maybe_invalidate(inval, 3, dummy, sink);
    const uint4* s4 = reinterpret_cast<const uint4*>(slot);
    auto fresh = [tag](const uint4& w) {
      return (w.x >> 16) == tag && (w.y >> 16) == tag && (w.z >> 16) == tag && (w.w >> 16) == tag;
    };
    for (int ib = tid; ib < nitems && ok; ib += nthr * kItemsPerThread) {
      uint4 w[kItemsPerThread];
      unsigned pending = 0;
#pragma unroll
      for (int i = 0; i < kItemsPerThread; ++i)
        if (ib + i * nthr < nitems) {
          w[i] = load16<kLoad>(s4 + ib + i * nthr);
          pending |= 1u << i;
        }
      for (long long spins = 0; pending; ++spins) {
        ++my_rounds;
#pragma unroll
        for (int i = 0; i < kItemsPerThread; ++i)
          if (((pending >> i) & 1u) && fresh(w[i])) {
            tile[ib + i * nthr] = w[i];
            pending &= ~(1u << i);
          }
        if (!pending) break;
        if (spins >= kMaxSpins) {
          ok = false;
          atomicExch(abort, 1);
          break;
        }
#pragma unroll
        for (int i = 0; i < kItemsPerThread; ++i)
          if ((pending >> i) & 1u) w[i] = load16<0>(s4 + ib + i * nthr);
      }
    }
    maybe_invalidate(inval, 2, dummy, sink);
    ok = !__syncthreads_or(!ok);
  }
  if (tid == 0) ns[b] = global_ns() - t0;
  atomicAdd(rounds, my_rounds);
  if (sink == 0xdeadbeef) abort[1] = 1;
}

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s part blocks threads steps bytes_or_words load inval\n", argv[0]);
    return 2;
  }
  const int part = std::atoi(argv[1]), nb = std::atoi(argv[2]), threads = std::atoi(argv[3]);
  const int load = std::atoi(argv[6]);
  int steps = std::atoi(argv[4]), size = std::atoi(argv[5]), inval = std::atoi(argv[7]);  // kernel args
  if (part < 1 || part > 2 || load < 0 || load > (part == 1 ? 3 : 2) || inval < 0 || inval > 3 ||
      nb < 1 || threads < 32 || threads > 512 || steps < 1 || size < 4 || size % 4 != 0) {
    std::fprintf(stderr, "bad arguments (see the header)\n");
    return 2;
  }
  const long long bytes = part == 1 ? size : 4ll * size * nb;  // part 2: size = words per block
  if (bytes > kSmemBytes) {
    std::fprintf(stderr, "%lld bytes per step do not fit the %d-byte tile\n", bytes, kSmemBytes);
    return 2;
  }
  int nitems = static_cast<int>(bytes / 16);
  uint4* buf;
  unsigned* dummy;
  unsigned long long *ns, *rounds;
  int* abort;
  CHECK(cudaMalloc(&buf, 2 * bytes + 16));
  CHECK(cudaMemset(buf, 0, 2 * bytes + 16));
  CHECK(cudaMalloc(&dummy, 128));
  CHECK(cudaMemset(dummy, 0, 128));
  CHECK(cudaMalloc(&ns, nb * sizeof(unsigned long long)));
  CHECK(cudaMalloc(&rounds, sizeof(unsigned long long)));  // zeroed before each launch
  CHECK(cudaMalloc(&abort, 2 * sizeof(int)));
  CHECK(cudaMemset(abort, 0, 2 * sizeof(int)));

  const void* fn = nullptr;
  void* args1[] = {&buf, &nitems, &steps, &inval, &dummy, &ns, &abort};
  unsigned* words = reinterpret_cast<unsigned*>(buf);
  void* args2[] = {&words, &steps, &size, &inval, &dummy, &ns, &rounds, &abort};
  if (part == 1) {
    const void* fns[] = {reinterpret_cast<const void*>(read_all<0>), reinterpret_cast<const void*>(read_all<1>),
                         reinterpret_cast<const void*>(read_all<2>), reinterpret_cast<const void*>(read_all<3>)};
    fn = fns[load];
  } else {
    const void* fns[] = {reinterpret_cast<const void*>(all_to_all<0>),
                         reinterpret_cast<const void*>(all_to_all<1>),
                         reinterpret_cast<const void*>(all_to_all<2>)};
    fn = fns[load];
  }
  CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, kSmemBytes));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (per_sm * sms < nb) {
    std::fprintf(stderr, "%d blocks cannot be co-resident (%d per SM, %d SMs)\n", nb, per_sm, sms);
    return 2;
  }
  // Two launches: the first warms the clocks and the L2, the second is timed.
  for (int rep = 0; rep < 2; ++rep) {
    CHECK(cudaMemset(rounds, 0, sizeof(unsigned long long)));
    if (part == 2) CHECK(cudaMemset(buf, 0, 2 * bytes));
    CHECK(cudaLaunchCooperativeKernel(fn, dim3(nb), dim3(threads), part == 1 ? args1 : args2,
                                      kSmemBytes, nullptr));
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
  }
  int h_abort[2];
  CHECK(cudaMemcpy(h_abort, abort, sizeof(h_abort), cudaMemcpyDeviceToHost));
  std::vector<unsigned long long> h_ns(nb);
  unsigned long long h_rounds = 0;
  CHECK(cudaMemcpy(h_ns.data(), ns, nb * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&h_rounds, rounds, sizeof(h_rounds), cudaMemcpyDeviceToHost));
  std::sort(h_ns.begin(), h_ns.end());
  const double med = h_ns[nb / 2] / 1e3 / steps, mx = h_ns.back() / 1e3 / steps;
  std::printf("part %d blocks %d threads %d bytes/block/step %lld load %d inval %d: %s%.3f us/step "
              "(max %.3f)",
              part, nb, threads, bytes, load, inval, h_abort[0] ? "TIMEOUT " : "", med, mx);
  if (part == 2) {
    long long batches = 0;  // (thread, batch of kItemsPerThread items) pairs of one block and step
    for (int t = 0; t < threads; ++t)
      for (int ib = t; ib < nitems; ib += threads * kItemsPerThread) ++batches;
    std::printf(", poll rounds per batch %.3f", static_cast<double>(h_rounds) / nb / steps / batches);
  }
  std::printf("\n");
  return h_abort[0] ? 1 : 0;
}
