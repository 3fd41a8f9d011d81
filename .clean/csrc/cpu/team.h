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
#include <type_traits>
#include <vector>

#include "cpu/helper_pool.h"
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
    // Once per process: it reads /sys (35-55 us per call on the VM measured).
    static const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    n = static_cast<int>(std::min<int64_t>({hw, 8, std::max<int64_t>(1, work / kMinWorkPerThread)}));
  }
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n, units)));
}

// The cost of the units before u: row_ptr[u * G] nonzeros plus a per-row overhead.
inline int64_t split_cost(const int32_t* row_ptr, int64_t G, int64_t u) {
  return static_cast<int64_t>(row_ptr[u * G]) + 8 * G * u;
}

// Unit ranges [bounds[t], bounds[t+1]) with costs in proportion to share[t] (null: equal).
inline std::vector<int64_t> split_units(const int32_t* row_ptr, int64_t G, int64_t H, int n,
                                        const double* share = nullptr) {
  std::vector<int64_t> bounds(n + 1, H);
  bounds[0] = 0;
  const int64_t total = split_cost(row_ptr, G, H);
  double share_sum = 0.0;
  for (int t = 0; t < n; ++t) share_sum += share ? share[t] : 1.0;
  double before = 0.0;
  int64_t u = 0;
  for (int t = 1; t < n; ++t) {
    before += share ? share[t - 1] : 1.0;
    const int64_t target = share ? static_cast<int64_t>(total * (before / share_sum))
                                 : total * t / n;
    int64_t lo = u, hi = H;  // first unit with cost >= target
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (split_cost(row_ptr, G, mid) < target) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    bounds[t] = u = lo;
  }
  return bounds;
}

// The start of a team: the caller waits (bounded) until every helper has checked in, then
// decides for all of them. A helper can start milliseconds late (its CPU busy with another
// process: 2.5-4 ms measured on the shared 2-vCPU VM, while a whole rnn call takes ~2.5 ms);
// then the caller runs the call alone and the helpers, whenever they start, leave.
class Roster {
 public:
  static constexpr int64_t kWaitNs = 1000000;

  explicit Roster(int helpers) : helpers_(helpers) {}

  // Helper: true if the team runs with it.
  bool check_in() {
    arrived_.fetch_add(1, std::memory_order_acq_rel);
    int d;
    for (int spins = 0; (d = decision_.load(std::memory_order_acquire)) == kPending; ++spins)
      spins < 100 ? cpu_relax() : std::this_thread::yield();
    return d == kGo;
  }

  // Caller: true if every helper checked in within kWaitNs (`possible` false: some could not
  // be started, decide at once).
  bool await_all(bool possible) {
    if (possible) {
      const int64_t deadline = SoloSwitch::now_ns() + kWaitNs;
      for (int spins = 0; arrived_.load(std::memory_order_acquire) < helpers_; ++spins) {
        if (spins < 100) {
          cpu_relax();
        } else {
          if (SoloSwitch::now_ns() > deadline) break;
          std::this_thread::yield();
        }
      }
    }
    const bool all = possible && arrived_.load(std::memory_order_acquire) == helpers_;
    decision_.store(all ? kGo : kLeave, std::memory_order_release);
    return all;
  }

 private:
  static constexpr int kPending = 0, kGo = 1, kLeave = 2;
  const int helpers_;
  std::atomic<int> arrived_{0};
  std::atomic<int> decision_{kPending};
};

// Runs fn(tid, nthreads, barrier) on `want` threads (the caller is tid 0) and returns when all
// are done: on the pool's helpers, else on threads started for this call. If not every helper
// starts in time (Roster), or the system refuses to start one, the caller runs everything alone
// (nthreads = 1). early() runs on the caller before fn, while the helpers wake up (20-60 us on
// the VM measured): work tid 0 needs however the team turns out.
struct NoEarlyWork {
  void operator()() const {}
};

template <class F, class E = NoEarlyWork>
void run_team(int want, F&& fn, E&& early = E()) {
  if (want <= 1) {
    SpinBarrier barrier(1);
    early();
    fn(0, 1, barrier);
    return;
  }
  SpinBarrier barrier(want);
  Roster roster(want - 1);
  struct Ctx {
    F* fn;
    std::remove_reference_t<E>* early;
    int want;
    SpinBarrier* barrier;
    Roster* roster;
    bool possible;
  } ctx{&fn, &early, want, &barrier, &roster, true};
  auto job = [](void* p, int tid) {
    Ctx& c = *static_cast<Ctx*>(p);
    if (tid > 0) {
      if (c.roster->check_in()) (*c.fn)(tid, c.want, *c.barrier);
      return;
    }
    (*c.early)();
    if (c.roster->await_all(c.possible)) {
      (*c.fn)(0, c.want, *c.barrier);
    } else {
      SpinBarrier single(1);
      (*c.fn)(0, 1, single);
    }
  };
  if (HelperPool::instance().run(want, job, &ctx)) return;
  std::vector<std::thread> threads;
  threads.reserve(want - 1);
  const HelperPlacement placement;
  try {
    for (int t = 1; t < want; ++t) {
      threads.emplace_back(job, &ctx, t);
      placement.apply(threads.back().native_handle());
    }
  } catch (...) {
    ctx.possible = false;
  }
  job(&ctx, 0);
  for (std::thread& t : threads) t.join();
}

}  // namespace sprnn::cpu
