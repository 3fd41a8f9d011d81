// Bounded waits (every spin has a %globaltimer deadline and turns into the abort flag) and the
// step probe's phase stamps (benchmarks/step_probe.cu; empty in the package).
#pragma once

#include "cuda/partition.cuh"

namespace sprnn {
namespace cuda {

// ---- waits ------------------------------------------------------------------------------------

// Returns true when the wait must be abandoned (deadline passed or another block aborted).
// `start` is read lazily at the first check (0 = not yet), so a wait that succeeds at once
// never reads the timer.
__device__ __forceinline__ bool wait_expired(const Params& p, unsigned long long& start) {
  if (ld_relaxed(reinterpret_cast<const uint32_t*>(p.abort_flag)) != 0u) return true;
  const unsigned long long now = global_ns();
  if (start == 0) start = now;
  if (now - start > static_cast<unsigned long long>(p.timeout_ns)) {
    atomicExch(p.abort_flag, 1);
    return true;
  }
  return false;
}

// ---- step probe (benchmarks/step_probe.cu only) ------------------------------------------------
// With SPRNN_STEP_PROBE defined, thread 0 of every block stamps clock64 and %globaltimer at the
// phase boundaries of each step (g_probe_trace[(s * nb + block) * 8 + k]: k = 0..3 clocks,
// 4..7 timers), and g_probe_mode can switch parts off or add some: 1 = skip the rows (exchange
// only), 2 = do not wait for the tags (no synchronization: the local work's floor), 3 = a block
// barrier after the cell update (no polling while a block publishes). Not built otherwise.
// A runtime mode changes the code around it (the gather's tag check compiled to a branch per
// pair of words instead of one predicate per item: benchmarks/NOTES.md session 26), so a build
// with SPRNN_PROBE_FIXED_MODE=m has the mode as a constant, as the package has 0.
#if defined(SPRNN_STEP_PROBE)
// SPRNN_PROBE_NO_TIMER=1: clock64 stamps only, to check that the %globaltimer reads do not shape
// the phases (they did not: benchmarks/NOTES.md, session 36); the probe's timer figures and SM
// clock are then meaningless.
#ifndef SPRNN_PROBE_NO_TIMER
#define SPRNN_PROBE_NO_TIMER 0
#endif
__device__ unsigned long long* g_probe_trace;
__device__ int g_probe_mode;
// Read once per kernel (a global load in every phase would itself miss the L1).
#define SPRNN_PROBE_INIT                                  \
  unsigned long long* const probe_trace = g_probe_trace; \
  const int probe_mode = g_probe_mode;                    \
  (void)probe_mode
#define SPRNN_PROBE_STAMP(s, k)                                                                  \
  do {                                                                                           \
    if (threadIdx.x == 0 && probe_trace != nullptr) {                                            \
      unsigned long long* q = probe_trace + (static_cast<long long>(s) * gridDim.x + blockIdx.x) * 8; \
      q[k] = clock64();                                                                          \
      if (!SPRNN_PROBE_NO_TIMER) q[4 + (k)] = global_ns();                                       \
    }                                                                                            \
  } while (0)
#if defined(SPRNN_PROBE_FIXED_MODE)
#define SPRNN_PROBE_MODE (SPRNN_PROBE_FIXED_MODE)
#else
#define SPRNN_PROBE_MODE probe_mode
#endif
#else
#define SPRNN_PROBE_INIT static_assert(true, "")
#define SPRNN_PROBE_STAMP(s, k) \
  do {                          \
  } while (0)
#define SPRNN_PROBE_MODE 0
#endif

}  // namespace cuda
}  // namespace sprnn
