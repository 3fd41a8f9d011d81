// The nonzeros as the row kernels read them (recurrence.h), and the buffers that hold them.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/float_convert.h"

namespace sprnn::cpu {

// Two streams: the weights in float32 and the offsets col * B of their hidden units in a
// batch-contiguous state (no index multiply per nonzero; two adjacent offsets come in one
// 64-bit load). Narrow calls (every offset fits 16 bits) may keep the offsets in off16
// instead: four per 64-bit load, one load fewer per 4 nonzeros in the B = 4 kernel.
struct NzStreams {
  std::vector<float> v;
  std::vector<int32_t> off;
  std::vector<uint16_t> off16;
};

// The streams of one call. Fresh pages cost ~1.4 us each to fault in on the VM measured (an
// rnn call's 0.8 MB at H=1024: ~0.5 ms of a ~2 ms call), so the calling thread keeps its
// buffers for its next call, up to kKeepBytes; larger calls use buffers of their own.
class NzBuffers {
 public:
  static constexpr int64_t kKeepBytes = int64_t{64} << 20;
  // Entries after the last nonzero: the B = 4 kernel reads whole groups of 8 offsets (and
  // masks off those past the row end).
  static constexpr int64_t kSlack = 8;

  // narrow: the offsets go to off16 (col * B must fit 16 bits).
  NzBuffers(int64_t nnz, bool narrow)
      : narrow_(narrow),
        s_(nnz * static_cast<int64_t>(sizeof(float) + sizeof(int32_t)) <= kKeepBytes ? kept()
                                                                                    : own_) {
    s_.v.resize(static_cast<size_t>(nnz + kSlack));
    if (narrow) {
      s_.off16.resize(static_cast<size_t>(nnz + kSlack));
    } else {
      s_.off.resize(static_cast<size_t>(nnz + kSlack));
    }
  }
  NzBuffers(const NzBuffers&) = delete;
  NzBuffers& operator=(const NzBuffers&) = delete;

  // Nonzeros [k0, k1). Each thread of a team packs those of its own rows, so that they start
  // out in its cache and the packing is split too. f16c: convert halves with F16C.
  template <typename S>
  void pack(const S* values, const int32_t* col, int64_t k0, int64_t k1, int64_t B, bool f16c) {
    to_float_span(values + k0, s_.v.data() + k0, k1 - k0, f16c);
    if (narrow_) {
      for (int64_t k = k0; k < k1; ++k) s_.off16[k] = static_cast<uint16_t>(col[k] * B);
    } else {
      for (int64_t k = k0; k < k1; ++k) s_.off[k] = static_cast<int32_t>(col[k] * B);
    }
  }

  const float* v() const { return s_.v.data(); }
  const int32_t* off() const { return s_.off.data(); }
  const uint16_t* off16() const { return s_.off16.data(); }

 private:
  static NzStreams& kept() {
    thread_local NzStreams s;
    return s;
  }

  const bool narrow_;
  NzStreams own_;
  NzStreams& s_;
};

}  // namespace sprnn::cpu
