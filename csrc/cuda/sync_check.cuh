// The per-call sync check: turns the persistent kernel's abort flag (a timed-out wait, units
// over the planned capacity) into an error returned by the same call, so that a timeout reaches
// the Python caller instead of leaving invalid outputs behind.
#pragma once
#include <cuda_runtime.h>

namespace sprnn::cuda {

// Copies the abort flag into pinned host memory mapped into the device's address space. A
// one-thread kernel instead of cudaMemcpyAsync: after the persistent kernel the copy engine
// started a 4-byte D2H copy ~8 us late, a kernel starts ~1 us after (benchmarks/NOTES.md,
// session 14).
__global__ void copy_abort_flag(const int* flag, int* host_flag) {
  *reinterpret_cast<volatile int*>(host_flag) = *reinterpret_cast<const volatile int*>(flag);
}

// Waits for the stream and returns the kernel's abort code in `code` (0 = it completed).
// `by_kernel` false: the copy engine path (cudaMemcpyAsync), kept for the A/B measurement.
inline cudaError_t sync_and_read_abort_flag(const int* flag, cudaStream_t stream, bool by_kernel,
                                            int& code) {
  // One flag per host thread: XLA runs a stream's thunks on one thread, and the sync below
  // finishes with it before the next call can reuse it.
  thread_local int* host_flag = nullptr;
  if (host_flag == nullptr) {
    if (cudaError_t e = cudaHostAlloc(&host_flag, sizeof(int),
                                      cudaHostAllocMapped | cudaHostAllocPortable);
        e != cudaSuccess) {
      host_flag = nullptr;
      return e;
    }
  }
  constexpr int kNotWritten = -1;
  *reinterpret_cast<volatile int*>(host_flag) = kNotWritten;
  if (by_kernel) {
    int* dev_view = nullptr;  // the same address under unified addressing; asked, not assumed
    if (cudaError_t e = cudaHostGetDevicePointer(&dev_view, host_flag, 0); e != cudaSuccess)
      return e;
    copy_abort_flag<<<1, 1, 0, stream>>>(flag, dev_view);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  } else if (cudaError_t e = cudaMemcpyAsync(host_flag, flag, sizeof(int),
                                             cudaMemcpyDeviceToHost, stream);
             e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) return e;
  code = *reinterpret_cast<volatile int*>(host_flag);
  // Not written although the stream completed: report it rather than read a stale flag.
  return code == kNotWritten ? cudaErrorUnknown : cudaSuccess;
}

}  // namespace sprnn::cuda
