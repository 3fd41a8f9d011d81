// Does a kernel's raised dynamic shared-memory limit (cudaFuncSetAttribute) hold on every GPU of
// the process, or only on the device current when it was set? The handler's ensure_smem keys
// its cache by device on this answer (benchmarks/NOTES.md, session 80). Needs two GPUs.
//
//   benchmarks/gpu_check.sh func-attr     (on a machine with two GPUs, e.g. nvidia-h200-x2)
#include <cstdio>

#include "cuda_check.h"

constexpr int kSmem = 100 * 1024;  // past the 48 KB a kernel gets without raising its limit

__global__ void uses_smem(int* out) {
  extern __shared__ int s[];
  s[threadIdx.x] = threadIdx.x;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = s[1];
}

// The limit as the current device sees it, its occupancy at kSmem, and both launches' errors.
void report(int dev, const char* when) {
  CHECK(cudaSetDevice(dev));
  cudaFuncAttributes fa{};
  CHECK(cudaFuncGetAttributes(&fa, uses_smem));
  int occ = -1;
  const cudaError_t occ_e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, uses_smem, 128,
                                                                          kSmem);
  int* out = nullptr;
  CHECK(cudaMalloc(&out, 4 * sizeof(int)));
  uses_smem<<<4, 128, kSmem>>>(out);
  const cudaError_t launch_e = cudaGetLastError();
  void* args[] = {&out};
  const cudaError_t coop_e = cudaLaunchCooperativeKernel(reinterpret_cast<void*>(uses_smem),
                                                         dim3(4), dim3(128), args, kSmem, 0);
  cudaGetLastError();
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaFree(out));
  std::printf("device %d, %s: max dynamic smem %d, occupancy at %d B %d (%s), launch %s, "
              "cooperative launch %s\n",
              dev, when, fa.maxDynamicSharedSizeBytes, kSmem, occ, cudaGetErrorName(occ_e),
              cudaGetErrorName(launch_e), cudaGetErrorName(coop_e));
}

int main() {
  int n = 0;
  CHECK(cudaGetDeviceCount(&n));
  if (n < 2) {
    std::printf("needs two GPUs, found %d\n", n);
    return 1;
  }
  CHECK(cudaSetDevice(0));
  CHECK(cudaFuncSetAttribute(uses_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  report(0, "after raising the limit on device 0");
  report(1, "after raising the limit on device 0 only");
  CHECK(cudaSetDevice(1));
  CHECK(cudaFuncSetAttribute(uses_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  report(1, "after raising it on device 1 too");
  return 0;
}
