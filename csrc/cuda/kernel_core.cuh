// Sparse persistent RNN forward kernel: the device code (header-only, NVRTC-compilable).
//
// One launch runs every timestep. The grid is `nb` co-resident blocks (cooperative launch, one
// block per SM). Block j owns a contiguous range of hidden units [u0, u1), chosen on device by a
// binary search over the unit-major row pointer so that the cost nnz + alpha * units is
// balanced across blocks. Its nonzeros (value, column) are copied once into shared memory (as
// many as fit; rows that do not fit are read from global memory/L2 every step). Per step and per
// batch tile of BT sequences, every block:
//   1. gathers h_{s-1} (H x BT) from the exchange buffer in global memory into shared memory
//      (rounds of loads held in registers; the deep-gather build of tile 4 holds twice as many,
//      for layers whose gather needs more than one round),
//   2. computes its rows' dot products (one warp per packed row, or half a warp; lanes split
//      the nonzeros in rounds of 8 per lane, then one of 8 or 4;
//      float32 accumulation, warp-shuffle reduction; for tiles wider than 16 bytes of h per
//      lane, i.e. BT = 16, 32, 64 and float32 8, BT / kNV lanes share each nonzero, each with kNV
//      batch columns: the "batch lanes" mapping, same code with other constants),
//   3. applies the cell to its units and publishes h_s to the exchange buffer.
// Batch groups (p.groups > 1): the grid splits into one group of nb / groups blocks per batch
// tile, each group holding the whole layer and running its tile alone; the tiles' exchanges
// never meet (benchmarks/NOTES.md, session 6: B=64 at ReLU H=1152 11.0 -> 5.5 us/step).
// Exchange (two slots, s % 2):
//   barrier mode: raw values, then a grid-wide barrier (one counter per batch tile, bounded spin);
//   Lamport mode: each (unit, b) word carries value + step tag (16-bit value | 16-bit tag for the
//   16-bit dtypes, 32-bit value | 32-bit tag for float32, so float32 h is exchanged exactly;
//   ReLU and float32 LSTM layers put a one-bit tag in a bit of each value that the cell leaves
//   free instead: XWord); readers spin on their words. A block publishes step s only after a
//   block-wide barrier that follows all of its reads of step s-1 (the two-slot pitfall in
//   DESIGN.md).
// Every wait is bounded by a %globaltimer deadline; on timeout (or when another block has
// aborted) the block sets the abort flag in the workspace and exits; the host turns the flag
// into an error.
// Layouts (template kWide): naive h_s[b][H] with BT scalar loads per nonzero (variant a), or
// wide h_s[H][BT] with one vector load per nonzero (variants b-d).
// Every tile is built for 512 threads (128 registers, no spills). Tiles of 16 to 64 gather
// only the h units their rows read plus one unit per block (p.col_filter, see the prologue of
// persistent_fwd). Per-step constants (row offsets, lengths) live in shared memory.
#pragma once

// The pieces, each including the one before it:
// params -> storage -> memory -> partition -> waits -> step_inputs -> rows -> cell_update,
// then the two kernels on top (persistent_kernel.cuh also includes mma_rows.cuh).
#include "cuda/persistent_kernel.cuh"
#include "cuda/step_kernels.cuh"
