// A few threads working through the time steps together, with a barrier between phases.
//
// The recurrences split the hidden units into contiguous ranges (balanced by nonzeros), one per
// thread; each step every thread reads the whole state and writes only its own units, so one
// barrier per step (two in the backward pass) is all the synchronization there is. Threads are
// started per call (tens of microseconds, against milliseconds of work) and only when a step
// has enough work to pay for the barriers; SPRNN_CPU_THREADS=n overrides the choice (1 = off).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <thread>
#include <vector>

#include "cpu/placement.h"

namespace sprnn::cpu {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Generation-counting barrier: spins briefly (steps are tens of microseconds), then yields,
// so that a thread whose partner was descheduled does not burn the core it needs.
class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}

  void wait() {
    if (n_ <= 1) return;
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.store(gen + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; gen_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins < 2000) {
        cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  const int n_;
  std::atomic<int> count_{0};
  std::atomic<int> gen_{0};
};

// On a shared machine one thread of a team can be descheduled for milliseconds, and then the
// others wait at every barrier (a step is ~10 us). Each thread keeps its own totals of working
// and waiting time; once a thread has waited more than twice as long as it worked (so the team
// is clearly slower than that thread would be alone; at 1x, short hiccups of a virtual CPU
// already tipped long-step calls into running alone), it asks to finish the call alone. The request names a step:
// every thread reads it after that step's barrier (it was written before the request's owner
// arrived there), so all agree from which step on the owner runs every unit and the others
// leave. At most one request succeeds per call.
class SoloSwitch {
 public:
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // SPRNN_CPU_SOLO_TEST=1 (tests only): the last thread takes over after step 1.
  explicit SoloSwitch(int nthreads) {
    if (const char* env = std::getenv("SPRNN_CPU_SOLO_TEST"); env != nullptr && env[0] == '1')
      forced_tid_ = nthreads - 1;
  }

  // Called by thread `tid` after its work of step s, before the barrier closing it.
  void maybe_request(int64_t step, int tid, int64_t worked_ns, int64_t waited_ns) {
    constexpr int64_t kMinWaitNs = 200000;
    const bool forced = forced_tid_ == tid && step == 1;
    if (forced || (forced_tid_ < 0 && waited_ns > 2 * worked_ns && waited_ns > kMinWaitNs)) {
      int64_t expected = kNone;
      at_.compare_exchange_strong(expected, (step << 8) | tid, std::memory_order_acq_rel);
    }
  }

  // After the barrier closing step s: the thread that runs alone from step s + 1, or -1.
  int owner_after(int64_t step) const {
    const int64_t v = at_.load(std::memory_order_acquire);
    return v != kNone && (v >> 8) <= step ? static_cast<int>(v & 255) : -1;
  }

 private:
  static constexpr int64_t kNone = INT64_MAX;
  std::atomic<int64_t> at_{kNone};
  int forced_tid_ = -1;
};

// Threads for a call whose steps each do about `work` multiply-adds (nnz * B).
inline int choose_threads(int64_t work, int64_t units) {
  int n;
  if (const char* env = std::getenv("SPRNN_CPU_THREADS"); env != nullptr && std::atoi(env) > 0) {
    n = std::atoi(env);
  } else {
    constexpr int64_t kMinWorkPerThread = 1 << 16;  // below this the barriers cost too much
    const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    n = static_cast<int>(std::min<int64_t>({hw, 8, std::max<int64_t>(1, work / kMinWorkPerThread)}));
  }
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n, units)));
}

// Unit ranges [bounds[t], bounds[t+1]) with about equal cost; the cost of the units before u
// is row_ptr[u * G] nonzeros plus a per-row overhead.
inline std::vector<int64_t> split_units(const int32_t* row_ptr, int64_t G, int64_t H, int n) {
  auto cost = [&](int64_t u) { return static_cast<int64_t>(row_ptr[u * G]) + 8 * G * u; };
  std::vector<int64_t> bounds(n + 1, H);
  bounds[0] = 0;
  const int64_t total = cost(H);
  int64_t u = 0;
  for (int t = 1; t < n; ++t) {
    const int64_t target = total * t / n;
    int64_t lo = u, hi = H;  // first unit with cost >= target
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (cost(mid) < target) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    bounds[t] = u = lo;
  }
  return bounds;
}

// Runs fn(tid, nthreads, barrier) on `want` threads (the caller is tid 0) and joins them. If
// the system refuses to start a thread, runs everything on the caller instead.
template <class F>
void run_team(int want, F&& fn) {
  if (want <= 1) {
    SpinBarrier barrier(1);
    fn(0, 1, barrier);
    return;
  }
  SpinBarrier barrier(want);
  std::atomic<int> state{0};  // 0: wait, 1: go, 2: abandoned
  std::vector<std::thread> threads;
  threads.reserve(want - 1);
  bool started = true;
  const HelperPlacement placement;
  try {
    for (int t = 1; t < want; ++t) {
      threads.emplace_back([&, t] {
        int s;
        while ((s = state.load(std::memory_order_acquire)) == 0) std::this_thread::yield();
        if (s == 1) fn(t, want, barrier);
      });
      placement.apply(threads.back());
    }
  } catch (...) {
    started = false;
  }
  state.store(started ? 1 : 2, std::memory_order_release);
  if (started) fn(0, want, barrier);
  for (std::thread& t : threads) t.join();
  if (!started) {
    SpinBarrier single(1);
    fn(0, 1, single);
  }
}

}  // namespace sprnn::cpu
