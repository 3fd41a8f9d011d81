// Helper threads kept between calls, parked while idle.
//
// Starting and joining a thread per call cost 120-200 us on the 2-vCPU VM measured (an rnn
// forward at H=1024, T=128 is ~2 ms). The pool serves one team at a time: a caller that finds
// it busy (another thread's call in flight), or a process forked from the one that started
// it, gets `false` and starts threads of its own.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <unistd.h>

#include "cpu/placement.h"

namespace sprnn::cpu {

class HelperPool {
 public:
  using Job = void (*)(void* ctx, int tid);

  // Never destroyed: parked helpers must not outlive a destroyed pool at process exit.
  static HelperPool& instance() {
    static HelperPool* pool = new HelperPool();
    return *pool;
  }

  // A hint that run() follows soon (after the caller's setup): parked helpers wake now and
  // spin up to kPrewakeNs for the job, so the wake-up (20-60 us on the VM measured) overlaps
  // the setup. Cheap when nobody is parked.
  void prewake() {
    if (getpid() != pid_) return;
    {
      std::lock_guard<std::mutex> lock(m_);
      ++hint_;
    }
    wake_.notify_all();
  }

  // Runs job(ctx, t) on helpers t = 1 .. n - 1 and job(ctx, 0) on the caller; returns after
  // all have finished. Returns false without running anything if the pool is not available.
  bool run(int n, Job job, void* ctx) {
    if (getpid() != pid_) return false;
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || !grow(n - 1)) return false;
    const HelperPlacement placement;
    for (int t = 0; t < n - 1; ++t) placement.update(helpers_[t], placed_[t]);
    {
      std::lock_guard<std::mutex> lock(m_);
      job_ = job;
      ctx_ = ctx;
      active_ = n - 1;
      pending_ = n - 1;
      left_.store(n - 1, std::memory_order_relaxed);
      ++generation_;
    }
    wake_.notify_all();
    job(ctx, 0);
    // The helpers finish about when the caller does (the team's last barrier): a short spin
    // avoids a sleep and wake-up (~20 us on the VM measured); then park.
    for (int spins = 0; spins < 2000 && left_.load(std::memory_order_acquire) > 0; ++spins)
      std::this_thread::yield();
    std::unique_lock<std::mutex> lock(m_);
    done_.wait(lock, [&] { return pending_ == 0; });
    return true;
  }

 private:
  HelperPool() : pid_(getpid()) {}

  // Makes sure there are at least `count` helpers (called with busy_ held).
  bool grow(int count) {
    try {
      while (static_cast<int>(helpers_.size()) < count) {
        const int tid = static_cast<int>(helpers_.size()) + 1;
        std::thread t([this, tid] { serve(tid); });
        helpers_.push_back(t.native_handle());
        placed_.emplace_back();
        t.detach();  // the pool lives until the process ends
      }
    } catch (...) {
      return false;
    }
    return true;
  }

  void serve(int tid) {
    uint64_t seen = 0, seen_hint = 0;
    for (;;) {
      Job job;
      void* ctx;
      {
        std::unique_lock<std::mutex> lock(m_);
        wake_.wait(lock, [&] { return generation_ != seen || hint_ != seen_hint; });
        seen_hint = hint_;
        if (generation_ == seen) {  // only a hint: spin a while for the job, then park again
          lock.unlock();
          const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(kPrewakeNs);
          while (generation_.load(std::memory_order_acquire) == seen &&
                 std::chrono::steady_clock::now() < until)
            std::this_thread::yield();
          continue;
        }
        seen = generation_;
        if (tid > active_) continue;  // this team is smaller
        job = job_;
        ctx = ctx_;
      }
      job(ctx, tid);
      std::lock_guard<std::mutex> lock(m_);
      left_.fetch_sub(1, std::memory_order_release);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  const pid_t pid_;
  std::mutex busy_;  // held by the caller whose team is running
  std::vector<std::thread::native_handle_type> helpers_;
  std::vector<std::optional<HelperPlacement>> placed_;  // what each helper got last
  std::mutex m_;
  std::condition_variable wake_, done_;
  static constexpr int64_t kPrewakeNs = 300000;
  std::atomic<uint64_t> generation_{0};  // written under m_; read unlocked while spinning
  uint64_t hint_ = 0;
  Job job_ = nullptr;
  void* ctx_ = nullptr;
  int active_ = 0, pending_ = 0;
  std::atomic<int> left_{0};  // pending_, readable without the lock
};

}  // namespace sprnn::cpu
