// Where the helper threads of a team run (Linux; elsewhere the scheduler decides alone).
//
// A thread started by the caller begins on the caller's CPU, and on a small, otherwise idle
// machine Linux left it there for milliseconds (the idle CPU pulls it only at a later load
// balance): measured on a 2-vCPU VM, both threads of every rnn call shared one CPU, each
// barrier waited ~150 us for the partner's time slice, and the SoloSwitch then finished the
// call on one thread (~2x slower). So each helper is restricted to the CPUs the caller may use
// other than the one it is on now; it is renewed for every call (helper_pool.h).
#pragma once

#include <optional>
#include <thread>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace sprnn::cpu {

// Allowed CPUs of the calling thread minus the one it runs on, captured once per team.
class HelperPlacement {
 public:
  HelperPlacement() {
#if defined(__linux__)
    CPU_ZERO(&set_);
    const int here = sched_getcpu();
    if (here < 0 || here >= CPU_SETSIZE ||
        pthread_getaffinity_np(pthread_self(), sizeof(set_), &set_) != 0) {
      return;
    }
    CPU_CLR(here, &set_);
    usable_ = CPU_COUNT(&set_) > 0;
#endif
  }

  // Best effort: a refusal (e.g. a cpuset changed meanwhile) leaves the thread where it is.
  void apply([[maybe_unused]] std::thread::native_handle_type t) const {
#if defined(__linux__)
    if (usable_) pthread_setaffinity_np(t, sizeof(set_), &set_);
#endif
  }

  // As apply, for a thread whose placement so far is `last` (empty: none): no system call
  // when it is unchanged (they cost 5-10 us each on the VM measured).
  void update(std::thread::native_handle_type t, std::optional<HelperPlacement>& last) const {
    if (last.has_value() && last->same_as(*this)) return;
    apply(t);
    last = *this;
  }

  bool same_as([[maybe_unused]] const HelperPlacement& o) const {
#if defined(__linux__)
    return usable_ == o.usable_ && CPU_EQUAL(&set_, &o.set_);
#else
    return true;
#endif
  }

 private:
#if defined(__linux__)
  cpu_set_t set_;
#endif
  bool usable_ = false;
};

}  // namespace sprnn::cpu
