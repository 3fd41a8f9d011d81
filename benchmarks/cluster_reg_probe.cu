// Cluster register probe: can one thread block cluster of 16 CTAs (one GPC) run a small layer's
// step faster than the default kernel's 132 blocks, if every nonzero sits in a register?
//
// Why: the default kernel's step at ReLU H=1152 (1.60 us) is almost all exchange: 132 blocks
// spread over 8 GPCs exchange h through L2 in ~1.5 us/step by themselves, while blocks on one
// GPC exchange in ~0.6 (exchange_probe.cu, NOTES session 19). The cluster variant (variant 5)
// put the layer on 16 CTAs but lost on the rows (~2 us/step: ~19K warp instructions per CTA per
// step, weights and indices loaded from shared memory, one warp per row). Here each lane holds
// its NPL nonzeros as (float weight, byte offset of h[col]) in registers, L lanes per row, so a
// nonzero costs one 8-byte shared load of the 4 batch values, 4 conversions and 4 FMAs.
// Result (benchmarks/NOTES.md, session 21): no. ReLU H=1152 ran at 1.97 us/step (L2 mode) and
// 1.63 with no nonzeros at all: the 16 CTAs' exchange alone costs more than the default's step.
//
// Standalone like step_probe.cu: ReLU RNN, B = 4, fp16 h and xp, float32 accumulation. Modes:
//   0: the exchange through distributed shared memory: each row group stores its unit's 4
//      tagged 32-bit words (16-bit value | 16-bit step tag, the kernel's Lamport words) into
//      every CTA's receive slot (st.relaxed.cluster); readers poll their own shared memory.
//   1: the same cluster (one GPC), the exchange through L2 (tagged words, as the kernel).
//   2: 16 CTAs without a cluster (spread over GPCs, cooperative launch), through L2.
// Every step: poll the 4 words of up to 4 units per thread, unpack them into the fp16 tile
// (double-buffered), one block barrier, rows, shuffle reduction, ReLU, ys, publish.
// Prints us/step (CTA 0's %globaltimer over the steps; median of 5 launches) and the largest
// error of ys against a float64 host recurrence that rounds h to fp16 each step, as the device.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/cluster_reg_probe.cu -o cluster_reg_probe
//   ./cluster_reg_probe H:density:T:csize:lanes:mode:order ...  (order 1: bank-aware greedy)
// Every wait is bounded (2 s); a stuck run prints TIMEOUT instead of hanging.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda/cluster_kernel.cuh"  // global_ns, ld_relaxed_v4_if, map_rank, cluster barrier
#include "cuda_check.h"

using sprnn::cuda::global_ns;

constexpr int kB = 4;
constexpr int kMaxItems = 4;  // units polled per thread and step
constexpr unsigned long long kTimeoutNs = 2000000000ull;

struct Args {
  const __half* xp;     // (T, B, H)
  __half* ys;           // (T, B, H)
  const float* wt;      // [cta][k][thread]
  const uint32_t* off;  // [cta][k][thread]: byte offset of h[col] in the tile (col * 8)
  uint32_t* gwords;     // modes 1, 2: 2 slots x H x 4 tagged words in global memory
  int* abort;
  unsigned long long* ns;  // CTA 0's time over the steps, then thread 0's clocks per phase
  int H, T, mode, csize;
};

__device__ __forceinline__ uint32_t tagged(uint32_t tag, __half v) {
  return (tag << 16) | __half_as_ushort(v);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void st_cluster_v4(uint32_t addr, const uint32_t* w) {
  asm volatile("st.relaxed.cluster.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
}
__device__ __forceinline__ void ld_cluster_v4(const uint32_t* p, uint32_t* w) {
  asm volatile("ld.relaxed.cluster.shared::cta.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))) : "memory");
}
#endif
__device__ __forceinline__ void st_gpu_v4(uint32_t* p, const uint32_t* w) {
  asm volatile("st.relaxed.gpu.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]),
               "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
}

template <int NPL, int L>
__global__ void __launch_bounds__(L == 4 ? 384 : 640, 1) cluster_reg_rnn(Args a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  const int H = a.H, tid = threadIdx.x, nthr = blockDim.x, rank = blockIdx.x;
  const bool dsmem = a.mode == 0, clustered = a.mode != 2;
  uint32_t* recv = reinterpret_cast<uint32_t*>(smem);        // 2 slots x H x 4 tagged words
  uint2* tile = reinterpret_cast<uint2*>(recv + 2 * H * kB);  // 2 slots x H x 4 fp16
  const int upc = (H + a.csize - 1) / a.csize;
  const int unit = rank * upc + tid / L, lane = tid % L;
  const bool has = tid / L < upc && unit < H;
  float w[NPL];
  uint32_t off[NPL];
#pragma unroll
  for (int k = 0; k < NPL; ++k) {
    w[k] = a.wt[(static_cast<long long>(rank) * NPL + k) * nthr + tid];
    off[k] = a.off[(static_cast<long long>(rank) * NPL + k) * nthr + tid];
  }
  for (int i = tid; i < 2 * H * kB; i += nthr) recv[i] = 0;
  __syncthreads();
  if (clustered) {  // every CTA's slots are zero before any peer stores into them
    sprnn::cuda::cluster_arrive();
    sprnn::cuda::cluster_wait();
  }
  // A row group's 4 values of its unit, tagged, into slot `slot` of every CTA (mode 0: lane l
  // stores to ranks l, l + L, ...) or of the global words (lane 0).
  auto publish = [&](int slot, uint32_t tag, const __half* h) {
    if (!has) return;
    uint32_t v[kB];
#pragma unroll
    for (int b = 0; b < kB; ++b) v[b] = tagged(tag, h[b]);
    if (dsmem) {
      for (int r = lane; r < a.csize; r += L)
        st_cluster_v4(sprnn::cuda::map_rank(recv + (slot * H + unit) * kB, r), v);
    } else if (lane == 0) {
      st_gpu_v4(a.gwords + (static_cast<long long>(slot) * H + unit) * kB, v);
    }
  };
  {
    const __half z[kB] = {__float2half(0.f), __float2half(0.f), __float2half(0.f), __float2half(0.f)};
    publish(0, 1u, z);
  }
  bool failed = false;
  long long phase[3] = {0, 0, 0};  // CTA 0, thread 0: clocks in poll, rows + reduction, update
  const unsigned long long t0 = global_ns();
  for (int s = 0; s < a.T; ++s) {
    const int slot = s & 1;
    const uint32_t tag = static_cast<uint32_t>(s % 65535 + 1);
    const long long c0 = clock64();
    // Step s's xp, loaded now and used after the rows, so the load hides behind the poll.
    // (Loading two steps ahead through register moves was slower: NOTES sessions 21 and 22.)
    __half x[kB];
#pragma unroll
    for (int b = 0; b < kB; ++b)
      x[b] = has ? a.xp[(static_cast<long long>(s) * kB + b) * H + unit] : __float2half(0.f);
    // Poll this thread's units until their 4 words carry the step's tag, then unpack.
    unsigned pending = 0;
#pragma unroll
    for (int i = 0; i < kMaxItems; ++i) pending |= (tid + i * nthr < H ? 1u : 0u) << i;
    const uint32_t* src = dsmem ? recv + slot * H * kB : a.gwords + static_cast<long long>(slot) * H * kB;
    unsigned long long start = 0;
    for (int spins = 0; pending && !failed; ++spins) {
      uint32_t v[kMaxItems][kB];
#pragma unroll
      for (int i = 0; i < kMaxItems; ++i) {
        if (!((pending >> i) & 1u)) continue;
        const uint32_t* p = src + (tid + i * nthr) * kB;
        if (dsmem) {
          ld_cluster_v4(p, v[i]);
        } else {
          sprnn::cuda::ld_relaxed_v4_if(p, v[i], 1u);  // the kernel's gather load
        }
      }
#pragma unroll
      for (int i = 0; i < kMaxItems; ++i) {
        if (!((pending >> i) & 1u)) continue;
        if ((v[i][0] >> 16) == tag && (v[i][1] >> 16) == tag && (v[i][2] >> 16) == tag &&
            (v[i][3] >> 16) == tag) {
          tile[slot * H + tid + i * nthr] = make_uint2((v[i][0] & 0xffffu) | (v[i][1] << 16),
                                                       (v[i][2] & 0xffffu) | (v[i][3] << 16));
          pending &= ~(1u << i);
        }
      }
      if (pending && (spins & 63) == 63) {
        const unsigned long long now = global_ns();
        if (start == 0) start = now;
        if (now - start > kTimeoutNs || *reinterpret_cast<volatile int*>(a.abort) != 0) {
          atomicExch(a.abort, 1);
          failed = true;
        }
      }
    }
    if (__syncthreads_or(failed)) {
      failed = true;
      break;
    }
    const long long c1 = clock64();
    // Rows: NPL nonzeros per lane from registers, the h values from the fp16 tile.
    const unsigned char* tb = reinterpret_cast<const unsigned char*>(tile + slot * H);
    float acc[kB] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int k = 0; k < NPL; ++k) {
      const uint2 hv = *reinterpret_cast<const uint2*>(tb + off[k]);
      const float2 h01 = __half22float2(*reinterpret_cast<const __half2*>(&hv.x));
      const float2 h23 = __half22float2(*reinterpret_cast<const __half2*>(&hv.y));
      acc[0] = fmaf(w[k], h01.x, acc[0]);
      acc[1] = fmaf(w[k], h01.y, acc[1]);
      acc[2] = fmaf(w[k], h23.x, acc[2]);
      acc[3] = fmaf(w[k], h23.y, acc[3]);
    }
#pragma unroll
    for (int m = L / 2; m > 0; m >>= 1)
#pragma unroll
      for (int b = 0; b < kB; ++b) acc[b] += __shfl_xor_sync(0xffffffffu, acc[b], m);
    const long long c2 = clock64();
    __half h[kB];
#pragma unroll
    for (int b = 0; b < kB; ++b) h[b] = __float2half_rn(fmaxf(acc[b] + __half2float(x[b]), 0.f));
    if (has && lane < kB) {
      __half mine = h[0];
#pragma unroll
      for (int b = 1; b < kB; ++b) mine = lane == b ? h[b] : mine;
      a.ys[(static_cast<long long>(s) * kB + lane) * H + unit] = mine;
    }
    publish(slot ^ 1, static_cast<uint32_t>((s + 1) % 65535 + 1), h);
    const long long c3 = clock64();
    phase[0] += c1 - c0;
    phase[1] += c2 - c1;
    phase[2] += c3 - c2;
  }
  if (rank == 0 && tid == 0) {
    a.ns[0] = global_ns() - t0;
    for (int i = 0; i < 3; ++i) a.ns[1 + i] = static_cast<unsigned long long>(phase[i]);
  }
  if (clustered) {  // no CTA exits while a peer may still store into it
    sprnn::cuda::cluster_arrive();
    sprnn::cuda::cluster_wait();
  }
#else
  if (threadIdx.x == 0) atomicExch(a.abort, 3);
#endif
}

struct Config {
  int H = 1152, T = 1000, csize = 16, L = 8, mode = 0, order = 1;
  double density = 0.1;
};

using KernelFn = void (*)(Args);
// The instantiations: (NPL, L); the smallest NPL that holds the longest row is used.
template <int L>
KernelFn pick(int npl, int* chosen) {
  constexpr int kSizes[] = {8, 12, 16, 20, 24, 32, 40, 48};
  for (int n : kSizes) {
    if (n < npl) continue;
    *chosen = n;
    switch (n) {
      case 8: return cluster_reg_rnn<8, L>;
      case 12: return cluster_reg_rnn<12, L>;
      case 16: return cluster_reg_rnn<16, L>;
      case 20: return cluster_reg_rnn<20, L>;
      case 24: return cluster_reg_rnn<24, L>;
      case 32: return cluster_reg_rnn<32, L>;
      case 40: return cluster_reg_rnn<40, L>;
      case 48: return cluster_reg_rnn<48, L>;
    }
  }
  return nullptr;
}

int run(const Config& c) {
  const int H = c.H, T = c.T, cs = c.csize, L = c.L;
  const int upc = (H + cs - 1) / cs;
  const int threads = (upc * L + 31) / 32 * 32;
  if (threads > (L == 4 ? 384 : 640) || H > kMaxItems * threads || (L != 4 && L != 8 && L != 16)) {
    std::printf("H=%d csize=%d lanes=%d: %d threads per CTA (max 640, lanes 4/8/16, H <= %d x "
                "threads): skipped\n", H, cs, L, threads, kMaxItems);
    return 0;
  }
  std::mt19937_64 rng(12345);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  std::normal_distribution<double> normal(0.0, 1.0);
  // rows[j]: (column, weight) of output unit j; weights ~ N(0, (0.9 / sqrt(nnz per row))^2),
  // so the ReLU recurrence stays bounded.
  const double scale = 0.9 / std::sqrt(std::max(1.0, c.density * H));
  std::vector<std::vector<std::pair<int, float>>> rows(H);
  size_t nnz = 0, longest = 0;
  for (int j = 0; j < H; ++j) {
    for (int i = 0; i < H; ++i)
      if (u01(rng) < c.density) rows[j].push_back({i, static_cast<float>(normal(rng) * scale)});
    nnz += rows[j].size();
    longest = std::max(longest, rows[j].size());
  }
  int npl = 0;
  const int need = static_cast<int>((longest + L - 1) / L);
  KernelFn fn = L == 4 ? pick<4>(need, &npl) : L == 8 ? pick<8>(need, &npl) : pick<16>(need, &npl);
  if (!fn) {
    std::printf("H=%d: the longest row (%zu) needs %d nonzeros per lane (max 48): skipped\n", H,
                longest, need);
    return 0;
  }
  // Deal each row's nonzeros to its L lanes, NPL rounds. order 1: in each round, every lane of
  // a half warp takes a nonzero whose 8-byte bank pair (col % 16) no other lane of the half
  // warp has taken in that round, where its row has one (the 8-byte loads of a half warp are
  // one shared-memory wavefront when their bank pairs differ). order 0: round robin.
  std::vector<float> wt(static_cast<size_t>(cs) * npl * threads, 0.f);
  std::vector<uint32_t> off(wt.size(), 0u);
  for (int r = 0; r < cs; ++r) {
    std::vector<std::vector<std::pair<int, float>>> pool(upc);
    for (int q = 0; q < upc; ++q)
      if (r * upc + q < H) pool[q] = rows[r * upc + q];
    for (int hw = 0; hw < threads / 16; ++hw) {
      for (int k = 0; k < npl; ++k) {
        unsigned used = 0;
        for (int t = hw * 16; t < hw * 16 + 16; ++t) {
          const int q = t / L;
          if (q >= upc || pool[q].empty()) continue;
          auto& p = pool[q];
          size_t pick_at = 0;
          if (c.order == 1) {
            for (size_t i = 0; i < p.size(); ++i)
              if (!((used >> (p[i].first % 16)) & 1u)) { pick_at = i; break; }
          }
          const auto nz = p[pick_at];
          p.erase(p.begin() + static_cast<long>(pick_at));
          used |= 1u << (nz.first % 16);
          const size_t at = (static_cast<size_t>(r) * npl + k) * threads + t;
          wt[at] = nz.second;
          off[at] = static_cast<uint32_t>(nz.first) * 8u;
        }
      }
    }
    for (int q = 0; q < upc; ++q)
      if (!pool[q].empty()) { std::fprintf(stderr, "internal: row left over\n"); return 1; }
  }
  std::vector<__half> xp(static_cast<size_t>(T) * kB * H);
  for (auto& v : xp) v = __float2half(static_cast<float>(u01(rng) * 2.0 - 1.0));

  __half *d_xp, *d_ys;
  float* d_wt;
  uint32_t *d_off, *d_words;
  int* d_abort;
  unsigned long long* d_ns;
  CHECK(cudaMalloc(&d_xp, xp.size() * sizeof(__half)));
  CHECK(cudaMalloc(&d_ys, xp.size() * sizeof(__half)));
  CHECK(cudaMalloc(&d_wt, wt.size() * sizeof(float)));
  CHECK(cudaMalloc(&d_off, off.size() * sizeof(uint32_t)));
  CHECK(cudaMalloc(&d_words, 2 * static_cast<size_t>(H) * kB * sizeof(uint32_t)));
  CHECK(cudaMalloc(&d_abort, sizeof(int)));
  CHECK(cudaMalloc(&d_ns, 4 * sizeof(unsigned long long)));
  CHECK(cudaMemcpy(d_xp, xp.data(), xp.size() * sizeof(__half), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_wt, wt.data(), wt.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_off, off.data(), off.size() * sizeof(uint32_t), cudaMemcpyHostToDevice));

  const size_t smem = static_cast<size_t>(H) * kB * 4 * 2 + static_cast<size_t>(H) * 8 * 2;
  const void* f = reinterpret_cast<const void*>(fn);
  CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaFuncAttributes fa;
  CHECK(cudaFuncGetAttributes(&fa, f));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(cs);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = c.mode == 2 ? cudaLaunchAttributeCooperative : cudaLaunchAttributeClusterDimension;
  if (c.mode == 2) {
    attr[0].val.cooperative = 1;
  } else {
    attr[0].val.clusterDim.x = cs;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  if (c.mode != 2) {
    int active = 0;
    CHECK(cudaOccupancyMaxActiveClusters(&active, f, &cfg));
    if (active < 1) {
      std::printf("H=%d csize=%d: a cluster of %d CTAs x %d threads x %zu B cannot be resident: "
                  "skipped\n", H, cs, cs, threads, smem);
      return 0;
    }
  }
  Args a{d_xp, d_ys, d_wt, d_off, d_words, d_abort, d_ns, H, T, c.mode, cs};
  std::vector<double> per_step;
  double phase_us[3] = {0, 0, 0};  // of the last launch
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const double clock_ghz = clock_khz / 1e6;
  int flag = 0;
  for (int rep = 0; rep < 6 && !flag; ++rep) {
    CHECK(cudaMemset(d_words, 0, 2 * static_cast<size_t>(H) * kB * sizeof(uint32_t)));
    CHECK(cudaMemset(d_abort, 0, sizeof(int)));
    CHECK(cudaMemset(d_ys, 0, xp.size() * sizeof(__half)));
    CHECK(cudaLaunchKernelEx(&cfg, fn, a));
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(&flag, d_abort, sizeof(int), cudaMemcpyDeviceToHost));
    unsigned long long ns[4] = {0, 0, 0, 0};
    CHECK(cudaMemcpy(ns, d_ns, sizeof(ns), cudaMemcpyDeviceToHost));
    if (rep > 0) per_step.push_back(ns[0] / 1000.0 / T);
    for (int i = 0; i < 3; ++i) phase_us[i] = ns[1 + i] / clock_ghz / 1000.0 / T;
  }
  const char* names[] = {"dsmem", "L2 in cluster", "L2 no cluster"};
  if (flag) {
    std::printf("H=%d d=%.2f csize=%d lanes=%d mode %s: TIMEOUT (flag %d)\n", H, c.density, cs, L,
                names[c.mode], flag);
    return 0;
  }
  std::sort(per_step.begin(), per_step.end());
  // float64 reference; h rounded to fp16 each step, as the device exchanges it
  std::vector<__half> ys(xp.size());
  CHECK(cudaMemcpy(ys.data(), d_ys, ys.size() * sizeof(__half), cudaMemcpyDeviceToHost));
  std::vector<double> hprev(static_cast<size_t>(kB) * H, 0.0), hnext(hprev.size());
  double err = 0.0, peak = 0.0;
  for (int s = 0; s < T; ++s) {
    for (int b = 0; b < kB; ++b)
      for (int j = 0; j < H; ++j) {
        double acc = __half2float(xp[(static_cast<size_t>(s) * kB + b) * H + j]);
        for (const auto& nz : rows[j]) acc += static_cast<double>(nz.second) * hprev[b * H + nz.first];
        const double hn = __half2float(__float2half_rn(static_cast<float>(std::max(acc, 0.0))));
        hnext[b * H + j] = hn;
        const double got = __half2float(ys[(static_cast<size_t>(s) * kB + b) * H + j]);
        err = std::max(err, std::fabs(got - hn));
        peak = std::max(peak, std::fabs(hn));
      }
    hprev.swap(hnext);
  }
  std::printf("H=%d d=%.2f nnz=%zu csize=%d lanes=%d NPL=%d threads=%d regs=%d local=%zu B "
              "order=%d mode %s: %.3f us/step (min %.3f, max %.3f; CTA 0 thread 0: poll %.3f "
              "rows %.3f update %.3f), max err %.2e (peak %.2f)\n",
              H, c.density, nnz, cs, L, npl, threads, fa.numRegs, fa.localSizeBytes, c.order,
              names[c.mode], per_step[per_step.size() / 2], per_step.front(), per_step.back(),
              phase_us[0], phase_us[1], phase_us[2], err, peak);
  CHECK(cudaFree(d_xp));
  CHECK(cudaFree(d_ys));
  CHECK(cudaFree(d_wt));
  CHECK(cudaFree(d_off));
  CHECK(cudaFree(d_words));
  CHECK(cudaFree(d_abort));
  CHECK(cudaFree(d_ns));
  return 0;
}

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    Config c;
    if (std::sscanf(argv[i], "%d:%lf:%d:%d:%d:%d:%d", &c.H, &c.density, &c.T, &c.csize, &c.L,
                    &c.mode, &c.order) < 2 || c.mode < 0 || c.mode > 2 || c.csize < 1 ||
        c.csize > 16 || c.T < 1) {
      std::fprintf(stderr, "bad config %s (H:density:T:csize:lanes:mode:order)\n", argv[i]);
      return 2;
    }
    if (int rc = run(c)) return rc;
  }
  return 0;
}
