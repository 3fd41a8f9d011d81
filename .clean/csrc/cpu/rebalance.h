// Unit ranges of a forward team that follow the threads' measured speeds.
//
// The two vCPUs of the shared VM measured often ran at different speeds for a whole call (one
// thread 15-16 us per rnn step, the other 19-20 on the same amount of work), so with an equal
// split the fast one waited ~4 us at every barrier. Every kWindow steps each thread publishes
// its working time of the window; after the barrier closing the window every thread computes
// the same new split from the same numbers (each thread keeps its own copy of this object), so
// the threads need no further agreement.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/team.h"

namespace sprnn::cpu {

class Rebalancer {
 public:
  static constexpr int64_t kWindow = 8;

  // window_ns: one slot per thread, shared by the team. A slot is written before the barrier
  // closing a window and read after it; the next write is a whole window later, after the
  // reader's next barrier, so one slot per thread is enough (kWindow >= 2).
  Rebalancer(const int32_t* row_ptr, int64_t G, int64_t H, int n, int64_t* window_ns)
      : rp_(row_ptr), G_(G), H_(H), n_(n), shared_(window_ns), share_(n, 1.0),
        bounds_(split_units(row_ptr, G, H, n)) {}

  int64_t begin(int t) const { return bounds_[t]; }
  int64_t end(int t) const { return bounds_[t + 1]; }

  // Thread tid, after its work of step s (work_ns of it), before the barrier.
  void record(int tid, int64_t s, int64_t work_ns) {
    acc_ += work_ns;
    if (s % kWindow == kWindow - 1) {
      shared_[tid] = acc_;
      acc_ = 0;
    }
  }

  // After the barrier closing step s; true if the ranges changed.
  bool after_barrier(int64_t s) {
    if (n_ < 2 || s % kWindow != kWindow - 1) return false;
    // Speed of each thread in cost units per ns; the shares follow it, half-way per window
    // (a single slow window, e.g. a preempted thread, moves the split only part of the way).
    std::vector<double> speed(n_, 0.0);
    double sum = 0.0;
    for (int t = 0; t < n_; ++t) {
      const double cost = static_cast<double>(unit_cost(bounds_[t + 1]) - unit_cost(bounds_[t]));
      speed[t] = shared_[t] > 0 && cost > 0 ? cost / static_cast<double>(shared_[t]) : 0.0;
      sum += speed[t];
    }
    if (sum <= 0.0) return false;
    for (int t = 0; t < n_; ++t) {
      const double target = speed[t] > 0.0 ? speed[t] / sum * n_ : share_[t];
      share_[t] = std::clamp(0.5 * (share_[t] + target), 0.25, 4.0);
    }
    std::vector<int64_t> next = split_units(rp_, G_, H_, n_, share_.data());
    if (next == bounds_) return false;
    bounds_.swap(next);
    return true;
  }

 private:
  int64_t unit_cost(int64_t u) const { return split_cost(rp_, G_, u); }

  const int32_t* rp_;
  int64_t G_, H_;
  int n_;
  int64_t* shared_;
  std::vector<double> share_;
  std::vector<int64_t> bounds_;
  int64_t acc_ = 0;
};

}  // namespace sprnn::cpu
