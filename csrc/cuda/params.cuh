// The persistent kernel's arguments (Params) and storage dtypes (DType): plain data shared by
// every kernel instantiation and by the host code that fills them (handlers.cu).
#pragma once

#if defined(__CUDACC_RTC__)
typedef unsigned int uint32_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
#else
#include <cstdint>
#endif

#include "common/cells.h"

namespace sprnn {
namespace cuda {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Kernel arguments (plain data, identical for all instantiations).
struct Params {
  const void* xp;         // (T, B, G*H)
  const int32_t* lengths; // (B,)
  const void* values;     // (nnz,)
  const int32_t* col_idx; // (nnz,)
  const int32_t* row_ptr; // (G*H + 1,)
  const void* h0;         // (B, H)
  const void* c0;         // (B, H) lstm
  const void* b_hn;       // (H,) gru
  void* ys;               // (T, B, H)
  void* hT;               // (B, H)
  void* cT;               // (B, H) lstm
  void* cs;               // (T, B, H) lstm
  void* xbuf;             // exchange: 2 slots x ntiles x exchange_units(H) x BT words
  unsigned int* counters; // barrier mode: one per batch tile
  int* abort_flag;        // 0 = ok; 1 = a wait timed out; 2-5: handlers.cu forward
  int T, B, H, ntiles;
  int activation;         // rnn: 0 tanh, 1 relu
  int reverse;
  int lamport;            // 1 = tagged exchange, 0 = grid barrier
  int alpha;              // per-unit cost in the block partition
  int u_cap;              // max units per block (smem sized for it)
  int w_cap;              // nonzeros per block kept in shared memory
  long long timeout_ns;   // per wait
  int spin_ns;            // back-off after a poll that found nothing new (0 = none)
  int col_filter;         // 1 = a block gathers only the h units its rows read (+ one per block)
  int row_lanes;          // lanes per row. cluster kernel: 0 = row_lanes_for; persistent_fwd:
                          // 16 = two rows per warp, 32 = one, 0 = two where that saves a
                          // pass over the rows
  int groups;             // persistent_fwd: > 1 = batch groups, tile j on blocks
                          // [j * nb / groups, (j + 1) * nb / groups), all tiles at once
                          // (groups == ntiles); 0 or 1 = every block runs every tile in turn
};

}  // namespace cuda
}  // namespace sprnn
