// The per-call sync check: turns the persistent kernel's abort flag (a timed-out wait, units
// over the planned capacity) into an error returned by the same call, so that a timeout reaches
// the Python caller instead of leaving invalid outputs behind.
#pragma once
#include <cuda_runtime.h>

namespace sprnn::cuda {

// Copies the abort flag into pinned host memory mapped into the device's address space. A
// one-thread kernel instead of cudaMemcpyAsync: after the persistent kernel the copy engine
// started a 4-byte D2H copy ~8 us late, this kernel ~1 us after it (benchmarks/NOTES.md,
// session 14).
static __global__ void copy_abort_flag(const int* flag, int* host_flag) {
  *reinterpret_cast<volatile int*>(host_flag) = *reinterpret_cast<const volatile int*>(flag);
}

// Waits for the stream and returns the kernel's abort code in `code` (0 = it completed).
inline cudaError_t sync_and_read_abort_flag(const int* flag, cudaStream_t stream, int& code) {
  // One flag per host thread: XLA runs a stream's thunks on one thread, and the sync below
  // is done with the flag before that thread's next call. Portable: valid on every device.
  thread_local int* host_flag = nullptr;
  thread_local int* device_view = nullptr;  // the same address under unified addressing
  if (host_flag == nullptr) {
    int* h = nullptr;
    if (cudaError_t e = cudaHostAlloc(&h, sizeof(int),
                                      cudaHostAllocMapped | cudaHostAllocPortable);
        e != cudaSuccess)
      return e;
    if (cudaError_t e = cudaHostGetDevicePointer(&device_view, h, 0); e != cudaSuccess) {
      cudaFreeHost(h);
      return e;
    }
    host_flag = h;
  }
  constexpr int kNotWritten = -1;
  volatile int* f = host_flag;
  *f = kNotWritten;
  copy_abort_flag<<<1, 1, 0, stream>>>(flag, device_view);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) return e;
  code = *f;
  // The stream completed but the copy left no trace: an error, never a stale "0 = ok".
  return code == kNotWritten ? cudaErrorUnknown : cudaSuccess;
}

}  // namespace sprnn::cuda
