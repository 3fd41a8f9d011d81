// Does the H200 lower its SM clock for every tensor-core instruction kind? (benchmarks/NOTES.md,
// sessions 9 and 37: the persistent kernel's mma rows run at ~1.73 GHz, the CUDA-core rows at
// 1.98.) Each variant runs 132 blocks x 512 threads for ~0.3 s: per iteration `alu` dependent
// FMAs per thread, then `mma` tensor-core instructions per warp (none in variant 0), at about the
// persistent kernel's ratio (18 HMMA per warp and ~4000 cycles). Prints the SM clock the blocks
// ran at (clock64 cycles per %globaltimer ns) per variant. Session 37 (H200): 1.98 GHz with FMAs
// only and with fp64 DMMA; 1.80-1.815 GHz with every HMMA and IMMA kind (f16 or bf16 into f32 or
// f16, tf32, s8), even one per warp and ~4000 cycles: the 16-bit and integer tensor pipe lowers
// the clock whatever its load. Session 108 added Hopper's warpgroup `wgmma` (an sm_90a build
// only), the 2:4 sparse `mma.sp`, and HMMAs in every other block only: 1.80 GHz for each, and
// the blocks without HMMAs ran at 1.80 too (the lower clock is the whole GPU's, not per SM).
// Build: nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc benchmarks/mma_clock_probe.cu -o /tmp/mma_clock_probe
// (with -arch=sm_90 the wgmma variant reports itself as not built).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda/memory.cuh"  // global_ns
#include "cuda_check.h"

using sprnn::cuda::global_ns;

constexpr int kBlocks = 132, kThreads = 512;  // one block per H200 SM, as the persistent kernel

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool kWgmmaBuilt = true;
#else
constexpr bool kWgmmaBuilt = false;
#endif

// One tensor-core instruction of kind K on registers a (4 words), b (2 words), d (4 floats or
// words); wgmma reads its B from shared memory through `b_desc`. Operands change every call
// through the accumulators, so nothing is hoisted.
template <int K>
__device__ __forceinline__ void mma_op(const uint32_t (&a)[4], const uint32_t (&b)[2], float (&d)[4],
                                       uint64_t b_desc) {
  if constexpr (K == 1) {  // fp16 inputs, fp32 accumulation, k16 (the kernel's)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else if constexpr (K == 2) {  // fp16, fp32 accumulation, k8
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(b[0]));
  } else if constexpr (K == 3) {  // bf16, fp32 accumulation, k16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else if constexpr (K == 4) {  // tf32, fp32 accumulation, k8 (an fp16 value is exact in tf32)
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else if constexpr (K == 5) {  // int8, int32 accumulation, k32
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(reinterpret_cast<int(&)[4]>(d)[0]), "+r"(reinterpret_cast<int(&)[4]>(d)[1]),
                   "+r"(reinterpret_cast<int(&)[4]>(d)[2]), "+r"(reinterpret_cast<int(&)[4]>(d)[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else if constexpr (K == 6) {  // fp16 inputs, fp16 accumulation, k16
    uint32_t* u = reinterpret_cast<uint32_t*>(d);
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3,%4,%5}, {%6,%7}, {%0,%1};"
                 : "+r"(u[0]), "+r"(u[1]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else if constexpr (K == 7) {  // fp64 (DMMA), k4
    double dd[2] = {d[0], d[1]};
    const double da = __int_as_float(a[0]), db = __int_as_float(b[0]);
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
                 : "+d"(dd[0]), "+d"(dd[1]) : "d"(da), "d"(db));
    d[0] = static_cast<float>(dd[0]);
    d[1] = static_cast<float>(dd[1]);
  } else if constexpr (K == 8) {  // wgmma m64n8k16, fp16 A in registers, B in shared memory
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "wgmma.fence.sync.aligned;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, 1, 1, 1, 0;\n"
        "wgmma.commit_group.sync.aligned;\n"
        "wgmma.wait_group.sync.aligned 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
#endif
  } else if constexpr (K == 9) {  // 2:4 sparse fp16, fp32 accumulation, m16n8k32
    const uint32_t meta = 0x44444444u;  // indices 0 and 1 of every group of 4
    asm volatile("mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%4,%5}, {%0,%1,%2,%3}, %10, 0x0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(meta));
  }
}

// Blocks whose index is a multiple of `mma_block_stride` issue the tensor instructions.
template <int K>
__global__ void __launch_bounds__(kThreads, 1) probe(int iters, int alu, int mma_per_iter, int mma_block_stride,
                                                 float seed, unsigned long long* out, float* sink) {
  __shared__ __align__(256) uint16_t b_tile[16 * 8];  // wgmma's B (k16 x n8 halves), no swizzle
  for (int i = threadIdx.x; i < 16 * 8; i += blockDim.x) b_tile[i] = 0x3c00;
  __syncthreads();
  // Matrix descriptor: start address, leading and stride byte offsets (>> 4), no swizzle.
  const uint64_t b_desc = ((static_cast<uint64_t>(__cvta_generic_to_shared(b_tile)) & 0x3ffff) >> 4) |
                          (uint64_t{128 >> 4} << 16) | (uint64_t{256 >> 4} << 32);
  const bool issues_mma = blockIdx.x % mma_block_stride == 0;
  uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = 0x3c003c00u ^ (threadIdx.x + i);  // ~1.0 halves
  for (int i = 0; i < 2; ++i) b[i] = 0x3c003c00u ^ (threadIdx.x * 7 + i);
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  float x = seed + threadIdx.x, y = 1.0000001f;
  const unsigned long long c0 = clock64(), t0 = global_ns();
  for (int it = 0; it < iters; ++it) {
    for (int j = 0; j < alu; ++j) x = fmaf(x, y, 1e-7f);
    if constexpr (K > 0)
      if (issues_mma)
        for (int j = 0; j < mma_per_iter; ++j) mma_op<K>(a, b, d, b_desc);
  }
  const unsigned long long c1 = clock64(), t1 = global_ns();
  if (threadIdx.x == 0) {
    out[blockIdx.x * 2] = c1 - c0;
    out[blockIdx.x * 2 + 1] = t1 - t0;
  }
  if (x == 12345.f || d[0] + d[1] + d[2] + d[3] == 12345.f) sink[threadIdx.x] = x + d[0];
}

__global__ void wgmma_built(int* flag) { *flag = kWgmmaBuilt; }

// Prints the median, min and max SM clock over the blocks; with a stride of 2 also the median
// of the blocks that issued no tensor instruction.
template <int K>
void run(const char* name, int iters, int alu, int mma, unsigned long long* out, float* sink,
         int mma_block_stride = 1) {
  probe<K><<<kBlocks, kThreads>>>(iters / 10, alu, mma, mma_block_stride, 1.f, out, sink);  // warm-up
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  probe<K><<<kBlocks, kThreads>>>(iters, alu, mma, mma_block_stride, 1.f, out, sink);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<unsigned long long> h(kBlocks * 2);
  CHECK(cudaMemcpy(h.data(), out, h.size() * 8, cudaMemcpyDeviceToHost));
  std::vector<double> ghz, ghz_without;
  double ms = 0;
  for (int i = 0; i < kBlocks; ++i) {
    const double g = static_cast<double>(h[2 * i]) / static_cast<double>(h[2 * i + 1]);
    ghz.push_back(g);
    if (i % mma_block_stride != 0) ghz_without.push_back(g);
    ms = std::max(ms, h[2 * i + 1] / 1e6);
  }
  std::sort(ghz.begin(), ghz.end());
  std::printf("%-34s alu %5d mma/warp %3d: SM clock %.3f GHz (min %.3f, max %.3f), %.0f ms", name,
              alu, mma, ghz[kBlocks / 2], ghz.front(), ghz.back(), ms);
  if (!ghz_without.empty()) {
    std::sort(ghz_without.begin(), ghz_without.end());
    std::printf("; blocks without: %.3f GHz", ghz_without[ghz_without.size() / 2]);
  }
  std::printf("\n");
}

int main() {
  unsigned long long* out;
  float* sink;
  CHECK(cudaMalloc(&out, kBlocks * 2 * 8));
  CHECK(cudaMalloc(&sink, kThreads * 4));
  int* flag;
  int wgmma_in_build = 0;
  CHECK(cudaMalloc(&flag, sizeof(int)));
  wgmma_built<<<1, 1>>>(flag);
  CHECK(cudaGetLastError());
  CHECK(cudaMemcpy(&wgmma_in_build, flag, sizeof(int), cudaMemcpyDeviceToHost));
  const int iters = 100000, alu = 1000;
  // ~4 FMA cycles each, 4 warps per scheduler: ~4000 cycles of FMAs per iteration and warp.
  for (int round = 0; round < 2; ++round) {
    run<0>("none (FMAs only)", iters, alu, 0, out, sink);
    run<1>("f16 -> f32, m16n8k16", iters, alu, 18, out, sink);
    run<1>("f16 -> f32, m16n8k16, 1 per iter", iters, alu, 1, out, sink);
    run<2>("f16 -> f32, m16n8k8", iters, alu, 18, out, sink);
    run<3>("bf16 -> f32, m16n8k16", iters, alu, 18, out, sink);
    run<4>("tf32 -> f32, m16n8k8", iters, alu, 18, out, sink);
    run<5>("s8 -> s32, m16n8k32", iters, alu, 18, out, sink);
    run<6>("f16 -> f16, m16n8k16", iters, alu, 18, out, sink);
    run<7>("f64, m8n8k4 (DMMA)", iters, alu, 18, out, sink);
    run<1>("f16 -> f32, m16n8k16, dense", iters, 10, 18, out, sink);
    run<9>("sparse 2:4 f16 -> f32, m16n8k32", iters, alu, 18, out, sink);
    run<1>("f16 -> f32, m16n8k16, even blocks", iters, alu, 18, out, sink, 2);
    if (wgmma_in_build) {  // 18 per warpgroup: the work of its four warps' 72 m16n8k16 above
      run<8>("wgmma f16 -> f32, m64n8k16", iters, alu, 18, out, sink);
      run<8>("wgmma m64n8k16, 1 per iter", iters, alu, 1, out, sink);
    } else {
      std::printf("wgmma: not in this build (needs -arch=sm_90a)\n");
    }
  }
  return 0;
}
