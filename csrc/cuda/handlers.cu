// CUDA FFI handlers sprnn_{rnn,lstm,gru}_fwd (docs/INTERFACE.md): placement planning, the
// cooperative launch of the persistent kernel (persistent_kernel.cuh), the per-step fallback, and
// error reporting. Exposed to Python as the pybind11 module jax_sprnn._sprnn_cuda.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cuda/launch.cuh"
#include "cuda/sync_check.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace py = pybind11;

namespace sprnn::cuda {
namespace {

// ---- configuration ---------------------------------------------------------------------------

long long env_int(const char* name, long long dflt) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return dflt;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  return (end != nullptr && *end == '\0') ? x : dflt;
}

// SPRNN_CUDA_ROW_LANES (Params::row_lanes): lanes per row, 0 = the kernel's choice. Read by the
// launch and by the planner, which must map rows as the kernel will.
int row_lanes_knob() {
  return static_cast<int>(std::clamp<long long>(env_int("SPRNN_CUDA_ROW_LANES", 0), 0, 32));
}

// SPRNN_CUDA_SYNC_CHECK: whether forward waits for each call and reads its abort flag, read by
// forward and by the planner (the tensor-core rows need the wait to rerun a call).
bool sync_check_on() { return env_int("SPRNN_CUDA_SYNC_CHECK", 1) != 0; }

struct DeviceInfo {
  int sms = 0;
  int smem_optin = 0;  // bytes of shared memory one block may use
  int coop = 0;
  int cc_major = 0;
  // Largest thread block cluster to plan for (0 = none): 16 on sm_90+ (the non-portable
  // limit); the handler confirms it per kernel (cudaOccupancyMaxPotentialClusterSize).
  int max_cluster = 0;
};

constexpr int kMaxDevices = 64;

DeviceInfo device_info(int dev) {
  static DeviceInfo cache[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  if (dev < 0 || dev >= kMaxDevices) return DeviceInfo{};
  std::call_once(once[dev], [dev] {
    DeviceInfo d;
    if (cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&d.coop, cudaDevAttrCooperativeLaunch, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&d.cc_major, cudaDevAttrComputeCapabilityMajor, dev) !=
            cudaSuccess) {
      cudaGetLastError();
      d = DeviceInfo{};
    }
    d.max_cluster = d.cc_major >= 9 ? 16 : 0;
    cache[dev] = d;
  });
  return cache[dev];
}

// ---- planning ---------------------------------------------------------------------------------

enum Variant : int {
  kNaive = 0, kWideBarrier = 1, kBankAware = 2, kLamport = 3, kStepLoop = 4, kCluster = 5
};

struct Plan {
  bool persistent = false;
  bool wide = true;
  bool lamport = true;
  int variant = kLamport;
  int bt = 1, ntiles = 1, nb = 0, threads = kPersistentThreads;
  int alpha = 1, u_cap = 0;
  int cluster = 0;  // > 0: the cluster kernel with clusters of this many CTAs, one per tile
  int groups = 1;   // > 1: batch groups (Params::groups), nb / groups blocks per tile
  bool deep_gather = false;  // the tile-4 build with twice the h bytes in flight (launch.cuh)
  bool reg_weights = false;  // the tile-4 build with each lane's first weights in registers
  Words words = Words::kColumn;  // how its shared-memory nonzeros are stored (RowWord)
  bool mma = false;          // the tensor-core rows build (mma_rows.cuh, kMmaRows per block)
  long long w_cap = 0, w_need = 0, smem = 0;
  bool on_chip = false;
  std::string reason;  // why the plan is not the fast persistent one (empty if it is)
};

int s_bytes_of(int dtype) { return dtype == 0 ? 4 : 2; }
// Bytes of a nonzero in shared memory (storage.cuh RowWord).
int w_bytes_of(int dtype, Words words = Words::kColumn) {
  return dtype == 0 || words == Words::kFloat ? 8 : 4;
}
// Bytes of a tagged exchange word per value (storage.cuh XWord; the bit-tagged words of ReLU
// and float32 LSTM layers take half, and the workspace and the deep-gather rule use this upper
// bound for them).
int x_bytes_of(int dtype) { return dtype == 0 ? 8 : 4; }
long long round_up(long long x, long long m) { return (x + m - 1) / m * m; }

// Workspace (one u8 output): [abort flag | counters | exchange buffer or fallback buffers].
// Depends only on the shapes so that the lowering can size it without a device.
constexpr long long kHeaderBytes = 256;
long long counters_bytes(long long B) { return round_up(4 * std::max<long long>(B, 1), 256); }
// Batch columns the exchange buffer holds per slot: B rounded up to the batch tile. Tiles of
// 16 and 32 are only planned when B > 8 and 64 when B > 32, so that small batches keep a small
// workspace.
long long exchange_cols(long long B) {
  B = std::max<long long>(B, 1);
  return round_up(B, B > 32 ? 64 : (B > 8 ? 32 : 8));
}
long long workspace_bytes(int gates, int dtype, long long H, long long B) {
  (void)gates;
  const long long bpad = exchange_cols(B);
  const long long xbuf = 2 * bpad * exchange_units(H) * x_bytes_of(dtype);
  const long long step = 3 * std::max<long long>(B, 1) * H * 4;
  return kHeaderBytes + counters_bytes(B) + std::max(xbuf, step);
}

// Why no persistent plan can take this layer shape (nullptr: none).
const char* shape_limit(int dtype, long long H, long long B) {
  if (dtype != 0 && H > 65535)
    return "16-bit layers with H > 65535 do not fit the packed 16-bit column index";
  if (B < 1 || H < 1) return "empty batch";
  return nullptr;
}

// How the layer's units split over `parts` blocks (the kernels' unit_range): alpha, the largest
// unit count of a block (u_cap; partition.cuh unit_split) and the nonzeros one block must be
// able to hold (the average plus one unit's average, the partition granularity).
void partition_units(long long H, long long nnz, int parts, Plan& pl) {
  const UnitSplit split = unit_split(H, nnz, parts);
  pl.alpha = split.alpha;
  pl.u_cap = split.u_cap;
  pl.w_need = (nnz + parts - 1) / parts + (nnz + H - 1) / H;
}

// Sizes plan c's shared memory for batch tile bt over ntiles tiles (c.u_cap, c.w_need set):
// false when the h tile, state and row offsets leave no room for weights.
// h_units > 0: the h tile holds that many units per batch column (the mma build's).
bool fit_tile(Plan& c, int bt, int ntiles, int gates, int dtype, long long H, long long avail,
              int h_units = 0) {
  const bool lstm = gates == 4;
  const int w_bytes = w_bytes_of(dtype, c.words);
  const SmemLayout l0 = smem_layout(static_cast<int>(H), bt, ntiles * bt, gates, lstm, c.u_cap, 0,
                                    s_bytes_of(dtype), w_bytes, 1, 0, h_units);
  // The weight region must hold the row offsets of the largest possible block.
  const long long rows_bytes = align16((static_cast<long long>(c.u_cap) * gates + 1) * 4);
  if (l0.total + rows_bytes > avail) return false;
  c.bt = bt;
  c.ntiles = ntiles;
  c.w_cap = std::min<long long>((avail - l0.total) / w_bytes, 1LL << 30);
  c.on_chip = c.w_cap >= c.w_need;
  c.smem = smem_layout(static_cast<int>(H), bt, ntiles * bt, gates, lstm, c.u_cap,
                       static_cast<int>(c.w_cap), s_bytes_of(dtype), w_bytes, 1, 0, h_units).total;
  c.persistent = true;
  return true;
}

// Splits the units over nb blocks (partition_units), counting each block's row offsets, which
// the weight region also holds (4 bytes per row, at its start; persistent_kernel.cuh): those of an
// average block.
void partition_blocks(int gates, int dtype, long long H, long long nnz, int nb, Plan& pl) {
  pl.nb = nb;
  partition_units(H, nnz, nb, pl);
  const long long avg_rows = (gates * H + nb - 1) / nb + 1;
  const int w_bytes = w_bytes_of(dtype, pl.words);
  pl.w_need += (align16(avg_rows * 4) + w_bytes - 1) / w_bytes;
}

// Batch groups: `groups` tiles of the batch run at once, each on its own nb / groups blocks that
// hold the whole layer on chip, instead of all blocks running the tiles in turn (one exchange
// round per tile and step). False when the layer does not fit on that many blocks.
bool grouped_plan(const Plan& base, int groups, int gates, int dtype, long long H, long long B,
                  long long nnz, long long avail, Plan& out) {
  if (groups < 2 || groups > B || base.nb / groups < 1) return false;
  int bt = 1;  // the smallest tile that splits the batch into at most `groups` tiles
  while (bt < 64 && (B + bt - 1) / bt > groups) bt *= 2;
  const int ntiles = static_cast<int>((B + bt - 1) / bt);
  if (ntiles < 2 || round_up(B, bt) > exchange_cols(B)) return false;
  Plan c = base;
  partition_blocks(gates, dtype, H, nnz, base.nb / ntiles, c);
  if (!fit_tile(c, bt, ntiles, gates, dtype, H, avail) || !c.on_chip) return false;
  c.groups = ntiles;
  c.nb *= ntiles;
  out = c;
  return true;
}

// The grid-wide plan (variants 0-4: persistent_fwd or the per-step fallback).
// allow_mma = false: never the tensor-core rows (forward's rerun of a call they cannot run).
Plan make_grid_plan(int gates, int dtype, long long H, long long B, long long nnz, int variant,
                    const DeviceInfo& dev, bool relu, bool allow_mma = true) {
  Plan pl;
  pl.variant = variant < 0 ? kLamport : variant;
  if (pl.variant > kStepLoop) pl.variant = kLamport;
  pl.wide = pl.variant != kNaive;
  pl.lamport = pl.variant == kLamport;
  if (pl.variant == kStepLoop) {
    pl.reason = "variant 4 selects the per-step fallback";
    return pl;
  }
  if (dev.sms <= 0 || !dev.coop) {
    pl.reason = "the GPU does not support cooperative launches";
    return pl;
  }
  if (const char* why = shape_limit(dtype, H, B)) {
    pl.reason = why;
    return pl;
  }
  pl.threads = static_cast<int>(std::clamp<long long>(env_int("SPRNN_CUDA_THREADS", kPersistentThreads), 64, kPersistentThreads)) / 32 * 32;
  partition_blocks(gates, dtype, H, nnz,
                   static_cast<int>(std::clamp<long long>(env_int("SPRNN_CUDA_BLOCKS", dev.sms), 1, dev.sms)),
                   pl);
  const long long avail = static_cast<long long>(dev.smem_optin) - 256;  // static smem margin

  // Batch tiles, largest first, starting from the smallest tile that holds the whole batch
  // (B = 5..8 -> 8, 9..16 -> 16, 17..32 -> 32, > 32 -> 64): every tile is one more exchange
  // round per step (~3.3 us at ReLU H=1152, benchmarks/NOTES.md), while the padding columns of
  // a tile larger than B only add compute. So 16-bit B = 5..8 keeps BT = 8 (one round, no
  // padding); B = 64 measured 12.7 us/step as two tiles of 32 against 6.8 for B = 32 in one.
  // The largest that fits wins (below).
  // SPRNN_CUDA_BT forces one (benchmarks), if the workspace holds its padded batch.
  int cands[7];
  int nc = 0;
  const long long force_bt = env_int("SPRNN_CUDA_BT", 0);
  if (!pl.wide) {
    cands[nc++] = 4;
  } else {
    for (int bt : {64, 32, 16, 8, 4, 2, 1})
      if ((bt == 1 || 2 * B > bt) && round_up(B, bt) <= exchange_cols(B)) cands[nc++] = bt;
    for (int bt : {64, 32, 16, 8, 4, 2, 1}) {
      if (force_bt == bt && round_up(B, bt) <= exchange_cols(B)) {
        cands[0] = bt;
        nc = 1;
      }
    }
  }
  // The largest tile that fits (its h tile and per-unit state in shared memory) wins, even
  // where a smaller tile would hold more of the nonzeros: each extra tile re-reads every
  // weight and adds an exchange round per step, which costs more than reading the rest from
  // L2. Measured on the H200 (benchmarks/NOTES.md, session 24), kernel us/step by tile (share
  // of the nonzeros on chip): LSTM H=4096 10% fp16 B=4 tile 4 8.87 (92%), 2 13.31 (100%);
  // ReLU H=20000 1% fp16 B=4 tile 4 14.21 (49%), 2 18.33 (100%); LSTM H=2048 30% fp32 B=4
  // tile 4 9.41 (60%), 2 14.33 (66%), 1 27.69 (68%); ReLU H=4096 50% fp16 B=16 tile 16 37.71
  // (35%), 8 38.92 (61%), 4 56.29 (74%). The exception: a smaller tile that holds the whole
  // layer, where the largest keeps less than 7/8 (float32) or 1/4 (16-bit) of the nonzeros on
  // chip. Float32 rows read from L2 cost ~3x more per nonzero: ReLU H=12000 1% fp32 B=4 tile 4
  // 15.82 (37%), 2 10.58 (100%); ReLU H=7000 5% fp32 tile 4 10.91 (76%), 2 9.24 (100%).
  // (Until session 24 the plan took the largest tile that kept 3/4 of the nonzeros on chip,
  // else the one that kept the most: up to 2.9x slower.) These figures predate the rows read
  // from L2 in rounds (session 25), which made every partial fit faster and kept the same
  // choices the fastest or within 10% (e.g. ReLU H=12000 1% fp32 tile 4 15.79, 2 10.46).
  bool found = false, found_on_chip = false;
  Plan best, best_on_chip;
  for (int i = 0; i < nc; ++i) {
    const int bt = cands[i];
    Plan c = pl;
    if (!fit_tile(c, bt, static_cast<int>((B + bt - 1) / bt), gates, dtype, H, avail)) continue;
    if (!found) best = c;
    if (c.on_chip && !found_on_chip) best_on_chip = c;
    found = true;
    found_on_chip = found_on_chip || c.on_chip;
  }
  if (!found) {
    pl.reason = "the hidden state tile and per-unit state of this layer (H = " +
                std::to_string(H) + ", B = " + std::to_string(B) +
                ") do not fit in one block's shared memory";
    return pl;
  }
  const bool little_on_chip =
      dtype == 0 ? 8 * best.w_cap < 7 * pl.w_need : 4 * best.w_cap < pl.w_need;
  if (!best.on_chip && found_on_chip && little_on_chip) best = best_on_chip;
  // Batch groups (grouped_plan). SPRNN_CUDA_GROUPS=n forces n groups (any wide variant), 1 never
  // groups; a forced SPRNN_CUDA_BT keeps its tiles in turn. The default's choice (Lamport
  // variant): the most groups that keep tiles of at least 4 columns, at most 128 rows per block
  // (8 passes of 16 warps) and the whole layer on chip. Measured on the H200
  // (benchmarks/NOTES.md, session 6), us/step one tile -> groups: ReLU H=1152 d=10% B=16
  // 4.59 -> 2.79 (4 groups), B=64 10.99 -> 5.55 (8); LSTM H=1024 B=64 15.09 -> 10.73 (4); ReLU
  // H=2304 d=30% B=16 10.88 -> 7.43 (4). Smaller tiles or more rows per block lost.
  const long long forced_groups = env_int("SPRNN_CUDA_GROUPS", 0);
  Plan grouped;
  if (pl.wide && forced_groups > 1) {
    if (grouped_plan(pl, static_cast<int>(std::min<long long>(forced_groups, B)), gates, dtype, H,
                     B, nnz, avail, grouped))
      best = grouped;
  } else if (pl.wide && pl.lamport && forced_groups == 0 && force_bt == 0) {
    int g = 1;
    while (2 * g * 4 <= B) g *= 2;
    for (; g >= 2; g /= 2) {
      if (gates * H / std::max(1, pl.nb / g) <= 128 &&
          grouped_plan(pl, g, gates, dtype, H, B, nnz, avail, grouped)) {
        best = grouped;
        break;
      }
    }
  }
  // Threads: a warp per row of the block plus three (the gathers), 8 to 16 warps. Fewer warps
  // make cheaper block barriers (step probe, us/step: ReLU H=1152 9 rows per block 1.92 at
  // 384 threads vs 1.98 at 512; H=256 1.46 at 256 vs 1.53 at 512), more keep the rows of large
  // layers in flight (LSTM H=1024, 31 rows per block: 2.99 at 512 vs 3.34 at 384). The kernel
  // is built for kPersistentThreads (512: 128 registers, persistent_kernel.cuh); SPRNN_CUDA_THREADS
  // may ask for fewer.
  const long long rows = (gates * H + best.nb / best.groups - 1) / (best.nb / best.groups);
  if (env_int("SPRNN_CUDA_THREADS", 0) == 0) {
    best.threads = static_cast<int>(32 * std::clamp<long long>(rows + 3, 8, kPersistentThreads / 32));
  }
  best.threads = std::min(best.threads, kPersistentThreads);
  // The deep-gather build where a 16-bit layer's gather of the tile-4 h needs more than one
  // round of the default depth (memory.cuh gather_units):
  // ReLU H=5760 fp16 5.88 -> 5.56 us/step in the step probe, while the layers that need one
  // round lose 3-14% with it (benchmarks/NOTES.md, session 8). Not for float32: timed through
  // JAX at H=2304..4608 it gained nothing and at H=4608 lost 6-9% (session 9).
  // SPRNN_CUDA_DEEP_GATHER=0/1 forces it off/on (tile 4 of the Lamport variant only).
  if (best.persistent && best.wide && best.lamport && best.bt == 4) {
    const long long units = gather_units(x_bytes_of(dtype), 4, false);
    const long long knob = env_int("SPRNN_CUDA_DEEP_GATHER", -1);
    best.deep_gather = knob >= 0 ? knob != 0 : dtype != 0 && H > best.threads * units;
  }
  // The register-weights build (rows.cuh kRegWeights; 16-bit; beside the deep build
  // only for ReLU layers, whose deep gather holds no more registers than the default one of
  // the others: launch.cuh) where a lane's share of a row is more than
  // kRegLaneShare nonzeros: the rows per block and lanes per row as the kernel maps them (two
  // rows per warp when that makes one pass). Step probe, us/step: LSTM H=1024 (6.4 per lane)
  // 2.21 -> 2.09, ReLU H=2304 30% (43) 3.35 -> 3.21, LSTM H=4096 (12.8) 9.18 -> 9.13
  // (benchmarks/NOTES.md, session 13); with float words and sign-tagged ReLU words (session
  // 27), ReLU H=2304 5% (3.6) 2.00 -> 1.80 and ReLU H=1152 (3.6) 1.555 -> 1.530, while ReLU
  // H=1024 (3.2) ties and ReLU H=768 (2.4), ReLU H=1152 5% (1.8) and LSTM H=512 (1.6) lose
  // 1.5-4.5%; ReLU H=5760 (18) with the deep build 4.53 -> 4.38-4.40 (session 28).
  // SPRNN_CUDA_REG_WEIGHTS=0/1 forces it off/on.
  if (best.persistent && best.wide && best.lamport && best.bt == 4 && dtype != 0 &&
      (!best.deep_gather || relu)) {
    const long long knob = env_int("SPRNN_CUDA_REG_WEIGHTS", -1);
    const bool half =
        two_rows_per_warp(static_cast<int>(rows), best.threads / 32, row_lanes_knob());
    const double per_lane =
        static_cast<double>(nnz) / std::max<long long>(1, gates * H) / (half ? 16 : 32);
    constexpr double kRegLaneShare = 3.5;
    best.reg_weights = knob >= 0 ? knob != 0 : per_lane > kRegLaneShare;
  }
  // Float words (storage.cuh RowWord: 8 bytes per nonzero, no unpacking in the rows):
  // always for float32, and for 16-bit layers with the register build where the whole layer
  // stays on chip with them. Step probe, fp16, B=4, us/step: ReLU H=2304 30% 3.22 -> 3.12,
  // LSTM H=1024 2.08 -> 2.03; LSTM H=4096 would no longer fit (benchmarks/NOTES.md, session
  // 15). SPRNN_CUDA_FLOAT_WORDS=0 turns them off, 1 forces them on beside the register weights
  // even where nonzeros then spill to L2 (tests). Not beside the deep build (no such build).
  if (dtype == 0 && best.persistent && best.wide) best.words = Words::kFloat;  // 8 bytes either way
  if (best.reg_weights && !best.deep_gather) {
    const long long knob = env_int("SPRNN_CUDA_FLOAT_WORDS", -1);
    Plan c = best;
    c.words = Words::kFloat;
    partition_blocks(gates, dtype, H, nnz, best.nb / best.groups, c);
    if (knob != 0 && fit_tile(c, best.bt, best.ntiles, gates, dtype, H, avail) &&
        (c.on_chip || knob == 1)) {
      c.nb = best.nb;
      best = c;
    }
  }
  // Offset words (storage.cuh RowWord: a 16-bit nonzero's column as the byte offset of its
  // unit's h values, one instruction less per nonzero in the rows, same bytes) for the 16-bit
  // tile-4 builds of 4-byte words, where every offset fits 16 bits (H <= 8192). Kernel time
  // through the package, column / offset words (bench_gpu.py --words, B=4, us/step): LSTM
  // H=4096 fp16 8.78 / 8.64, ReLU H=5760 bf16 4.41 / 4.37, tanh H=5760 fp16 5.20 / 5.15, ReLU
  // H=5760 fp16 4.35 / 4.35, ReLU H=1024 fp16 1.41 / 1.41 (benchmarks/NOTES.md, session 34).
  // SPRNN_CUDA_OFFSET_WORDS=0 turns them off.
  if (best.persistent && best.wide && best.bt == 4 && dtype != 0 &&
      best.words == Words::kColumn && env_int("SPRNN_CUDA_OFFSET_WORDS", -1) != 0 &&
      offset_words_fit(H, best.bt * s_bytes_of(dtype)))
    best.words = Words::kOffset;
  // Tensor-core rows (mma_rows.cuh): a block's rows as a dense 16-bit tile whose mma.sync A
  // fragments stay in registers. A step on them costs about the same at any density (the SMs
  // drop to ~1.72 GHz while they issue mma); the sparse rows' cost grows with a block's
  // nonzeros. Step probe, fp16, B=4, us/step sparse / tensor-core: ReLU H=2304 30% (12K nonzeros
  // per block) 2.65 / 2.30, 50% 3.33 / 2.63, 20% (8K) 2.33 / 2.28, 15% 2.16 / 2.28; ReLU H=1152
  // 10% 1.53 / 1.89 (session 30); ReLU H=2048 30% (9.5K) 2.15 / 2.14, 50% 2.57 / 2.15, H=1536
  // 50% (8.9K) 2.08 / 1.97, 30% (5.4K) 1.82 / 1.96, H=1152 50% (5K) 1.80 / 1.93 (session 32;
  // benchmarks/NOTES.md). The default takes them from 8.5K nonzeros per block where blocks
  // average 12-22 rows (the measured range; the build takes up to kMmaRows). They need sm_80
  // (mma.sync), the Lamport variant, one batch tile of 4 and the sync check: a call whose h
  // turns inf or NaN, or whose block rows do not fit the build, is rerun on the sparse rows
  // (forward), so a diverging layer costs both kernels (session 31: 3.23 us/step against 2.60
  // sparse). SPRNN_CUDA_MMA=0/1 forces them off/on (where they fit).
  if (allow_mma && relu && gates == 1 && dtype != 0 && dev.cc_major >= 8 && best.persistent &&
      best.wide && best.lamport && best.bt == 4 && best.ntiles == 1 && best.groups == 1 &&
      sync_check_on() && env_int("SPRNN_CUDA_W_CAP", -1) < 0) {
    const long long knob = env_int("SPRNN_CUDA_MMA", -1);
    const long long avg_rows = (H + best.nb - 1) / best.nb;
    const bool dense = nnz >= 8500LL * best.nb && avg_rows >= 12 && avg_rows <= 22;
    if (knob == 1 || (knob < 0 && dense)) {  // wanted; then whether the build fits
      constexpr int kWarps = kPersistentThreads / 32;
      const int rows = static_cast<int>(std::min<long long>(avg_rows + 2, kMmaRows));
      Plan c = best;
      c.mma = true;
      c.deep_gather = c.reg_weights = false;
      c.words = Words::kColumn;
      c.threads = kPersistentThreads;
      const bool fits =
          mma_fits(kMmaRows, static_cast<int>(avg_rows), static_cast<int>(H), kWarps) &&
          fit_tile(c, 4, 1, gates, dtype, H, avail, mma_h_stride(static_cast<int>(H))) &&
          (c.w_cap - align16((rows + 1) * 4) / 4) * 4 >=
              mma_region_bytes(kMmaRows, rows, static_cast<int>(H), kWarps);
      if (fits) {
        c.on_chip = true;
        best = c;
      }
    }
  }
  // SPRNN_CUDA_W_CAP (tests): at most this many words of nonzeros and row offsets per block on
  // chip, so that the rows past them run from L2 in any build (rows.cuh row_dot).
  if (const long long cap = env_int("SPRNN_CUDA_W_CAP", -1); cap >= 0 && best.persistent) {
    best.w_cap = std::min(best.w_cap, cap);
    best.on_chip = best.w_cap >= best.w_need;
  }
  if (!best.on_chip && !found_on_chip) {
    // Only when no batch tile would hold the layer on chip: a chosen partial fit is a
    // measured speed choice, not a capacity problem.
    best.reason = "the layer's nonzeros do not fit on chip (" + std::to_string(nnz) +
                  " nonzeros, about " + std::to_string(best.w_cap * best.nb) +
                  " fit); the rest are read from L2 every step, which is slower (prune further to fit;"
                  " at high density a dense layer can be faster)";
  }
  return best;
}

// The cluster plan (variant 5, cluster_kernel.cuh): one cluster of `csize` CTAs per batch tile,
// each cluster holding all of the layer's nonzeros in its CTAs' shared memory plus two copies of
// the h tile per CTA. Returns persistent = false with the reason when the layer does not fit.
Plan make_cluster_plan(int gates, int dtype, long long H, long long B, long long nnz, int csize,
                       const DeviceInfo& dev) {
  Plan pl;
  pl.variant = kCluster;
  pl.lamport = false;
  if (dev.cc_major < 9 || csize < 1) {
    pl.reason = dev.cc_major < 9 ? "thread block clusters need compute capability 9.0+"
                                 : "no cluster size can be launched with this layer's blocks";
    return pl;
  }
  if (const char* why = shape_limit(dtype, H, B)) {
    pl.reason = why;
    return pl;
  }
  pl.cluster = csize;
  partition_units(H, nnz, csize, pl);
  const long long avail = static_cast<long long>(dev.smem_optin) - 256;  // static smem margin
  const bool lstm = gates == 4;
  // Tiles largest first from the smallest that holds the batch (as make_grid_plan, up to 16):
  // every tile is its own cluster, so a wider tile means fewer CTAs for the same batch.
  for (int bt : {16, 8, 4, 2, 1}) {
    if (bt != 1 && 2 * B <= bt) continue;
    // The cluster kernel keeps its two h copies in float32 (no conversion in the row loop) and
    // its rows' offsets in shared memory.
    const SmemLayout l0 = smem_layout(static_cast<int>(H), bt, bt, gates, lstm, pl.u_cap, 0, 4,
                                      w_bytes_of(dtype), 2, pl.u_cap * gates + 1);
    if (l0.total > avail) continue;
    const long long w_cap = std::min<long long>((avail - l0.total) / w_bytes_of(dtype), 1LL << 30);
    if (w_cap < pl.w_need) continue;  // all nonzeros on chip, or not this variant
    pl.bt = bt;
    pl.ntiles = static_cast<int>((B + bt - 1) / bt);
    pl.nb = pl.ntiles * csize;
    pl.w_cap = w_cap;
    pl.smem = smem_layout(static_cast<int>(H), bt, bt, gates, lstm, pl.u_cap,
                          static_cast<int>(w_cap), 4, w_bytes_of(dtype), 2,
                          pl.u_cap * gates + 1).total;
    pl.on_chip = true;
    pl.persistent = true;
    // A group of row_lanes_for() lanes per row a CTA owns (up to the tile's build limit): the
    // rows are the critical path of a step, and there is no grid-wide exchange whose cost grows
    // with the threads.
    const long long rows = static_cast<long long>(pl.u_cap) * gates;
    const long long lanes = row_lanes_for(nnz / std::max<long long>(1, H * gates), bt);
    const long long t = env_int("SPRNN_CUDA_THREADS",
                                std::clamp<long long>(round_up(lanes * rows, 32), 128, 1024));
    pl.threads = static_cast<int>(std::clamp<long long>(t, 64, max_threads_of_tile(bt))) / 32 * 32;
    return pl;
  }
  pl.persistent = false;
  pl.cluster = 0;
  pl.reason = "the layer's " + std::to_string(nnz) + " nonzeros and h tile do not fit in the "
              "shared memory of one cluster of " + std::to_string(csize) + " blocks";
  return pl;
}

// Variant 5 asks for the cluster plan and falls back to variant 3's plan with a reason. The
// default (-1) never picks it: measured on the H200 it is 1.05-4x slower than variant 3
// (benchmarks/NOTES.md). SPRNN_CUDA_CLUSTER: the largest cluster size to plan for.
// relu: an rnn layer with ReLU (its deep-gather build has a register-weights build too).
Plan make_plan(int gates, int dtype, long long H, long long B, long long nnz, int variant,
               const DeviceInfo& dev, bool relu, bool allow_mma = true) {
  if (variant == kCluster) {
    const long long knob = env_int("SPRNN_CUDA_CLUSTER", dev.max_cluster);
    const int csize = static_cast<int>(std::clamp<long long>(knob, 0, dev.max_cluster));
    Plan c = make_cluster_plan(gates, dtype, H, B, nnz, csize, dev);
    if (c.persistent) return c;
    Plan g = make_grid_plan(gates, dtype, H, B, nnz, kLamport, dev, relu, allow_mma);
    g.reason = "variant 5 (clusters) does not apply: " + c.reason + "; running variant 3" +
               (g.reason.empty() ? "" : " (" + g.reason + ")");
    return g;
  }
  return make_grid_plan(gates, dtype, H, B, nnz, variant, dev, relu, allow_mma);
}

// Raises a kernel's dynamic shared-memory limit, once per device and kernel (the largest
// request wins). Per device: the attribute belongs to the kernel as loaded on the current
// device, so a limit raised on one GPU does not hold on another.
std::mutex g_attr_mu;
cudaError_t ensure_smem(int dev, const void* fn, long long smem) {
  struct Entry { int dev; const void* fn; long long smem; };
  static Entry set[256];
  static int nset = 0;
  std::lock_guard<std::mutex> lock(g_attr_mu);
  Entry* known = nullptr;
  for (int i = 0; i < nset; ++i)
    if (set[i].dev == dev && set[i].fn == fn) known = &set[i];
  if (known && known->smem >= smem) return cudaSuccess;
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  if (known) known->smem = smem;
  else if (nset < 256) set[nset++] = {dev, fn, smem};
  return cudaSuccess;
}

// cudaOccupancyMaxActiveBlocksPerMultiprocessor, cached per (device, kernel, threads, smem): it
// costs microseconds of host time in front of every launch (benchmarks/NOTES.md, session 12).
std::mutex g_occ_mu;
cudaError_t blocks_per_sm(int dev, KernelFn fn, int threads, long long smem, int& occ) {
  struct Entry { int dev; KernelFn fn; int threads; long long smem; int occ; };
  static Entry cache[256];
  static int n = 0;
  std::lock_guard<std::mutex> lock(g_occ_mu);
  for (int i = 0; i < n; ++i)
    if (cache[i].dev == dev && cache[i].fn == fn && cache[i].threads == threads &&
        cache[i].smem == smem) {
      occ = cache[i].occ;
      return cudaSuccess;
    }
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &occ, reinterpret_cast<const void*>(fn), threads, static_cast<size_t>(smem));
  if (e == cudaSuccess && n < 256) cache[n++] = {dev, fn, threads, smem, occ};
  return e;
}

// relu: an rnn layer with ReLU, whose wide builds exchange sign-tagged words (storage.cuh
// XWord).
KernelFn pick_persistent(Cell cell, int dtype, const Plan& pl, bool relu) {
  switch (cell) {
    case Cell::kLstm:
      return pick_persistent_lstm(dtype, pl.bt, pl.wide, pl.deep_gather, pl.reg_weights, pl.words,
                                  false, false);
    case Cell::kGru:
      return pick_persistent_gru(dtype, pl.bt, pl.wide, pl.deep_gather, pl.reg_weights, pl.words,
                                 false, false);
    default:
      return pick_persistent_rnn(dtype, pl.bt, pl.wide, pl.deep_gather, pl.reg_weights, pl.words,
                                 pl.mma, relu);
  }
}

KernelFn pick_cluster(Cell cell, int dtype, int bt) {
  switch (cell) {
    case Cell::kLstm: return pick_cluster_lstm(dtype, bt);
    case Cell::kGru: return pick_cluster_gru(dtype, bt);
    default: return pick_cluster_rnn(dtype, bt);
  }
}

// Whether a cluster launch of fn with this configuration can run: the kernel was built with
// sm_90 code (else it is the stub), the cluster size is launchable (max_ok: the largest that
// is) and at least one cluster fits on the GPU. Cached per configuration: the queries cost
// microseconds. Query failures count as "cannot run" (the caller falls back).
struct ClusterFit {
  int dev = 0;
  KernelFn fn = nullptr;
  int threads = 0, cluster = 0;
  long long smem = 0;
  int max_ok = 0;
  bool ok = false;
};
std::mutex g_cluster_mu;
ClusterFit cluster_fit(int dev, KernelFn fn, const cudaLaunchConfig_t& cfg, int cluster) {
  static ClusterFit cache[64];
  static int ncache = 0;
  std::lock_guard<std::mutex> lock(g_cluster_mu);
  for (int i = 0; i < ncache; ++i) {
    const ClusterFit& c = cache[i];
    if (c.dev == dev && c.fn == fn && c.threads == static_cast<int>(cfg.blockDim.x) &&
        c.cluster == cluster && c.smem == static_cast<long long>(cfg.dynamicSmemBytes))
      return c;
  }
  ClusterFit r;
  r.dev = dev;  // the attribute set below, like the smem limit, holds per device
  r.fn = fn;
  r.threads = static_cast<int>(cfg.blockDim.x);
  r.cluster = cluster;
  r.smem = static_cast<long long>(cfg.dynamicSmemBytes);
  cudaFuncAttributes fa{};
  int active = 0;
  cudaLaunchConfig_t plain = cfg;  // the largest cluster for this block size and smem
  plain.attrs = nullptr;
  plain.numAttrs = 0;
  if (cudaFuncGetAttributes(&fa, reinterpret_cast<const void*>(fn)) == cudaSuccess &&
      fa.ptxVersion >= 90 &&
      cudaFuncSetAttribute(reinterpret_cast<const void*>(fn),
                           cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess &&
      cudaOccupancyMaxPotentialClusterSize(&r.max_ok, reinterpret_cast<const void*>(fn), &plain) ==
          cudaSuccess) {
    if (r.max_ok >= cluster &&
        cudaOccupancyMaxActiveClusters(&active, reinterpret_cast<const void*>(fn), &cfg) ==
            cudaSuccess)
      r.ok = active >= 1;
  }
  cudaGetLastError();  // a failed query is not the caller's error
  if (!r.ok && r.max_ok >= cluster) r.max_ok = cluster - 1;
  if (ncache < 64) cache[ncache++] = r;
  return r;
}

// The kernel arguments that come from the plan (the persistent and cluster kernels read them).
Params with_plan(Params p, const Plan& pl) {
  p.ntiles = pl.ntiles;
  p.groups = pl.groups;
  p.lamport = pl.lamport ? 1 : 0;
  p.alpha = pl.alpha;
  p.u_cap = pl.u_cap;
  p.w_cap = static_cast<int>(pl.w_cap);
  return p;
}

// Launches the plan's cluster kernel. launched = false (with cudaSuccess) when this
// configuration cannot run here; max_ok is then the largest cluster size worth re-planning for.
cudaError_t launch_cluster(int dev, Cell cell, int dtype, const Plan& pl, const Params& p,
                           cudaStream_t stream, bool& launched, int& max_ok) {
  launched = false;
  max_ok = 0;
  KernelFn fn = pick_cluster(cell, dtype, pl.bt);
  if (fn == nullptr) return cudaSuccess;
  if (cudaError_t e = ensure_smem(dev, reinterpret_cast<const void*>(fn), pl.smem);
      e != cudaSuccess)
    return e;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(pl.cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(pl.nb));
  cfg.blockDim = dim3(static_cast<unsigned>(pl.threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(pl.smem);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const ClusterFit fit = cluster_fit(dev, fn, cfg, pl.cluster);
  max_ok = fit.max_ok;
  if (!fit.ok) return cudaSuccess;
  if (cudaError_t e = cudaLaunchKernelEx(&cfg, fn, with_plan(p, pl)); e != cudaSuccess) return e;
  launched = true;
  return cudaSuccess;
}

// Launches of the staged per-step kernels (step_kernels.cuh step_fwd_staged, step_fwd_tasks;
// the tests read them).
std::atomic<long long> g_staged_steps{0}, g_task_steps{0};

// Where the per-step kernels run on device dev (step_kernels.cuh StepConfig).
StepConfig step_config(int dev) {
  const DeviceInfo info = device_info(dev);
  StepConfig cfg;
  cfg.sms = info.sms;
  cfg.staged = static_cast<int>(std::clamp<long long>(env_int("SPRNN_CUDA_STEP_STAGED", 1), 0, 3));
  cfg.max_bytes = std::max(kStagedDefaultBytes, info.smem_optin - kStagedStaticBytes);
  cfg.dev = dev;
  cfg.raise_smem = &ensure_smem;
  return cfg;
}

// The per-step kernels (launch.cuh run_steps). SPRNN_CUDA_STEP_STAGED: 0 keeps them off the
// staged kernels (step_kernels.cuh), 2 runs step_fwd_staged and 3 step_fwd_tasks wherever they
// fit (StepConfig).
cudaError_t run_steps(Cell cell, int dtype, const Params& p, float* hbuf, float* cbuf,
                      cudaStream_t s, bool one_step = false) {
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  const StepConfig cfg = step_config(dev);
  StepCounts counts;
  cudaError_t e;
  switch (cell) {
    case Cell::kLstm: e = run_steps_lstm(dtype, p, hbuf, cbuf, s, one_step, cfg, &counts); break;
    case Cell::kGru: e = run_steps_gru(dtype, p, hbuf, cbuf, s, one_step, cfg, &counts); break;
    default: e = run_steps_rnn(dtype, p, hbuf, cbuf, s, one_step, cfg, &counts); break;
  }
  g_staged_steps.fetch_add(counts.staged);
  g_task_steps.fetch_add(counts.tasks);
  return e;
}

// ---- the handler --------------------------------------------------------------------------------

int dtype_code(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return 0;
    case ffi::DataType::BF16: return 1;
    case ffi::DataType::F16: return 2;
    default: return -1;
  }
}

bool has_type(const ffi::AnyBuffer& b, ffi::DataType t) { return b.element_type() == t; }

// b has exactly these dimensions and the dtype of like.
bool has_shape(const ffi::AnyBuffer& b, const ffi::AnyBuffer& like,
               std::initializer_list<long long> dims) {
  auto d = b.dimensions();
  if (b.element_type() != like.element_type() || d.size() != dims.size()) return false;
  size_t i = 0;
  for (long long want : dims)
    if (d[i++] != want) return false;
  return true;
}

// Calls rerun on the sparse rows after the tensor-core rows stopped (forward; the tests read it).
std::atomic<long long> g_mma_reruns{0};
// Calls planned on the persistent kernel that ran the per-step fallback (the tests read it).
std::atomic<long long> g_step_fallbacks{0};
// Calls of one step that ran as a single per-step launch (forward; the tests read it).
std::atomic<long long> g_one_step_calls{0};

ffi::Error cuda_error(const char* target, const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string(target) + ": " + what + ": " + cudaGetErrorString(e));
}

struct Bufs {
  ffi::AnyBuffer xp, lengths, values, col_idx, row_ptr, h0;
  const ffi::AnyBuffer* c0 = nullptr;
  const ffi::AnyBuffer* b_hn = nullptr;
};

// The workspace is the extra result the CUDA lowering appends (docs/INTERFACE.md). A direct
// jax.ffi.ffi_call without it gets a clear error instead of undefined behaviour.
ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> workspace_of(const char* target,
                                                       const ffi::RemainingRets& rest) {
  // get() bounds-checks only with assert(), compiled out in release builds: check the count.
  auto ws = rest.empty() ? ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>>(
                               ffi::Unexpected(ffi::Error::InvalidArgument("no workspace")))
                         : rest.get<ffi::AnyBuffer>(0);
  if (ws.has_error())
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        std::string(target) + " on CUDA needs the u8 workspace result that jax_sprnn's CUDA "
        "lowering appends; call it through sp.rnn/lstm/gru (or the forward primitive), not a "
        "bare jax.ffi.ffi_call"));
  return ws;
}

// The FFI targets of a cell: "fwd" runs any call; "step" (step_target) runs only calls of one
// step with the default variant, which launch the same kernel every time and never sync, so XLA
// may capture them in its command buffers (CUDA graphs) with the rest of a sampling loop's body.
ffi::Error forward(const char* target, bool step_target, cudaStream_t stream, Cell cell,
                   const Bufs& in, ffi::AnyBuffer* ys, ffi::AnyBuffer* hT, ffi::AnyBuffer* cT,
                   ffi::AnyBuffer* cs, const ffi::RemainingRets& rest, bool reverse,
                   int64_t activation, int64_t variant) {
  const int G = gates_of(cell);
  const int dtype = dtype_code(in.xp.element_type());
  auto xd = in.xp.dimensions();
  auto hd = in.h0.dimensions();
  if (dtype < 0 || xd.size() != 3 || hd.size() != 2 || in.values.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(std::string(target) +
                                       ": xp must be (T, B, G*H) float32/bfloat16/float16, "
                                       "h0 (B, H), values (nnz,)");
  const long long T = xd[0], B = xd[1], H = hd[1];
  const long long nnz = in.values.dimensions()[0];
  if (hd[0] != B || xd[2] != G * H || in.lengths.element_count() != static_cast<size_t>(B) ||
      in.col_idx.element_count() != static_cast<size_t>(nnz) ||
      in.row_ptr.element_count() != static_cast<size_t>(G * H + 1) ||
      in.values.element_type() != in.xp.element_type() ||
      in.h0.element_type() != in.xp.element_type() ||
      !has_type(in.lengths, ffi::DataType::S32) || !has_type(in.col_idx, ffi::DataType::S32) ||
      !has_type(in.row_ptr, ffi::DataType::S32) ||
      (in.c0 && !has_shape(*in.c0, in.xp, {B, H})) ||
      (in.b_hn && !has_shape(*in.b_hn, in.xp, {H})) || !has_shape(*ys, in.xp, {T, B, H}) ||
      !has_shape(*hT, in.xp, {B, H}) || (cT && !has_shape(*cT, in.xp, {B, H})) ||
      (cs && !has_shape(*cs, in.xp, {T, B, H})))
    return ffi::Error::InvalidArgument(std::string(target) + ": inconsistent shapes or dtypes "
                                       "(see docs/INTERFACE.md)");
  if (T > 0x3fffffffLL || B > 0x3fffffffLL || H > 0x3fffffffLL)
    return ffi::Error::InvalidArgument(std::string(target) + ": dimensions too large");
  if (step_target && (T != 1 || variant != -1))
    return ffi::Error::InvalidArgument(std::string(target) + " runs calls of one step (T = 1) "
                                       "with the default variant only; use " +
                                       std::string(target, std::strlen(target) - 4) + "fwd");
  // The fwd target's workspace (the step target's calls need none).
  ffi::AnyBuffer* ws = nullptr;
  long long ws_need = 0;
  if (!step_target) {
    auto w = workspace_of(target, rest);
    if (w.has_error()) return w.error();
    ws = &*w.value();
    ws_need = workspace_bytes(G, dtype, H, B);
    if (static_cast<long long>(ws->size_bytes()) < ws_need)
      return ffi::Error::Internal(std::string(target) + ": workspace too small");
  }
  if (B == 0 || H == 0) return ffi::Error::Success();

  Params p{};
  p.xp = in.xp.untyped_data();
  p.lengths = static_cast<const int32_t*>(in.lengths.untyped_data());
  p.values = in.values.untyped_data();
  p.col_idx = static_cast<const int32_t*>(in.col_idx.untyped_data());
  p.row_ptr = static_cast<const int32_t*>(in.row_ptr.untyped_data());
  p.h0 = in.h0.untyped_data();
  p.c0 = in.c0 ? in.c0->untyped_data() : nullptr;
  p.b_hn = in.b_hn ? in.b_hn->untyped_data() : nullptr;
  p.ys = ys->untyped_data();
  p.hT = hT->untyped_data();
  p.cT = cT ? cT->untyped_data() : nullptr;
  p.cs = cs ? cs->untyped_data() : nullptr;
  p.T = static_cast<int>(T);
  p.B = static_cast<int>(B);
  p.H = static_cast<int>(H);
  p.activation = static_cast<int>(activation);
  p.reverse = reverse ? 1 : 0;

  // A call of one step (T = 1, the default variant), e.g. one iteration of a sampling loop:
  // the persistent kernel's prologue, workspace memset and per-call sync would cost several
  // times the step (a jitted loop of one-step calls: 42-66 us per step against 15-50 for a
  // dense step; benchmarks/decode_loop.py, benchmarks/NOTES.md session 81). One launch of the
  // per-step kernel instead: it has no wait to bound and raises no flag, so no sync either.
  // (The fwd target comes here too where the lowering did not know T, e.g. a symbolic export.)
  if (T == 1 && variant == -1) {
    if (cudaError_t e = run_steps(cell, dtype, p, nullptr, nullptr, stream, true);
        e != cudaSuccess)
      return cuda_error(target, "one-step launch", e);
    g_one_step_calls.fetch_add(1);
    return ffi::Error::Success();
  }

  // Only the fwd target gets here (the step target's calls all take the branch above).
  unsigned char* wsp = static_cast<unsigned char*>(ws->untyped_data());
  p.abort_flag = reinterpret_cast<int*>(wsp);
  p.counters = reinterpret_cast<unsigned int*>(wsp + kHeaderBytes);
  p.xbuf = wsp + kHeaderBytes + counters_bytes(B);
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess)
    return cuda_error(target, "cudaGetDevice", e);
  const DeviceInfo info = device_info(dev);
  // Not below 0: the wait compares as unsigned, so a negative bound would be no bound. Not
  // above an hour, so that the product cannot overflow into a negative one either.
  p.timeout_ns =
      std::clamp<long long>(env_int("SPRNN_CUDA_TIMEOUT_MS", 5000), 0, 3600000) * 1000000LL;
  p.spin_ns = static_cast<int>(std::clamp<long long>(env_int("SPRNN_CUDA_SPIN_NS", 0), 0, 1000));
  // Gather only the h units a block's rows read (persistent_kernel.cuh); 0 = every unit.
  p.col_filter = env_int("SPRNN_CUDA_COL_FILTER", 1) != 0 ? 1 : 0;
  p.row_lanes = row_lanes_knob();

  // Run the plan; one rerun without the tensor-core rows where they stop (flags 4 and 5).
  Plan pl = make_plan(G, dtype, H, B, nnz, static_cast<int>(variant), info, activation != 0);
  for (;;) {
    // Zero the flag, the counters and the exchange buffer (tag 0 never matches a step's tag).
    if (cudaError_t e = cudaMemsetAsync(wsp, 0, ws_need, stream); e != cudaSuccess)
      return cuda_error(target, "cudaMemsetAsync(workspace)", e);
    // SPRNN_CUDA_TEST_STALL=1 (tests only): the grid barrier's counters start far behind every
    // step's target, so each barrier wait spins until its bound runs out. A deterministic
    // timeout, to test that it reaches the caller as an error (a normal wait rarely spins
    // long enough to expire, even at SPRNN_CUDA_TIMEOUT_MS=0).
    if (!pl.lamport && env_int("SPRNN_CUDA_TEST_STALL", 0) == 1) {
      if (cudaError_t e = cudaMemsetAsync(p.counters, 0x80, counters_bytes(B), stream);
          e != cudaSuccess)
        return cuda_error(target, "cudaMemsetAsync(counters)", e);
    }

    bool launched = false;
    // The cluster plan, re-planned for a smaller cluster (or the grid plan) when this kernel
    // cannot launch the planned one here.
    for (int attempt = 0; pl.persistent && pl.cluster > 0 && !launched && attempt < 3; ++attempt) {
      int max_ok = 0;
      if (cudaError_t e = launch_cluster(dev, cell, dtype, pl, p, stream, launched, max_ok);
          e != cudaSuccess)
        return cuda_error(target, "cluster launch of the persistent kernel", e);
      if (!launched) {
        DeviceInfo d = info;
        d.max_cluster = attempt < 2 ? std::min(max_ok, pl.cluster - 1) : 0;
        pl = make_plan(G, dtype, H, B, nnz, static_cast<int>(variant), d, activation != 0);
      }
    }
    if (!launched && pl.persistent && pl.cluster == 0) {
      KernelFn fn = pick_persistent(cell, dtype, pl, p.activation != 0);
      int occ = 0;
      cudaError_t e = fn ? ensure_smem(dev, reinterpret_cast<const void*>(fn), pl.smem)
                         : cudaErrorInvalidDeviceFunction;
      if (e == cudaSuccess) e = blocks_per_sm(dev, fn, pl.threads, pl.smem, occ);
      if (e == cudaSuccess && occ >= 1) {
        p = with_plan(p, pl);
        void* args[] = {&p};
        e = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(fn), dim3(pl.nb),
                                        dim3(pl.threads), args, static_cast<size_t>(pl.smem),
                                        stream);
        if (e == cudaSuccess) {
          launched = true;
        } else if (e != cudaErrorCooperativeLaunchTooLarge && e != cudaErrorLaunchOutOfResources) {
          return cuda_error(target, "cooperative launch of the persistent kernel", e);
        }
      }
      if (!launched) cudaGetLastError();  // clear a recoverable launch error; fall back below
    }
    if (!launched && pl.persistent) {
      // Planned persistent, but the GPU would not take the launch (occupancy, a cooperative
      // launch too large, e.g. SMs shared with other work): correct but slower, so say so.
      g_step_fallbacks.fetch_add(1);
      static std::once_flag warned;
      std::call_once(warned, [] {
        std::fprintf(stderr,
                     "jax_sprnn: the persistent kernel could not launch on this GPU as planned "
                     "(its blocks would not all be resident); running the per-step fallback "
                     "kernel (correct, slower). Later such calls do so silently.\n");
      });
    }
    if (!launched) {
      float* hbuf = reinterpret_cast<float*>(p.xbuf);
      float* cbuf = hbuf + 2 * B * H;
      if (cudaError_t e = run_steps(cell, dtype, p, hbuf, cbuf, stream); e != cudaSuccess)
        return cuda_error(target, "per-step fallback launch", e);
    }

    // Turn a timed-out wait into an error for the caller (sync_check.cuh).
    if (sync_check_on()) {
      int flag = 0;
      if (cudaError_t e = sync_and_read_abort_flag(p.abort_flag, stream, flag); e != cudaSuccess)
        return cuda_error(target, "kernel execution or its abort-flag check", e);
      if ((flag == 4 || flag == 5) && pl.mma) {
        // The tensor-core rows met inf or NaN in h (flag 4) or a block with more rows than
        // their build (5): the call runs again on the sparse rows, which are exact there.
        g_mma_reruns.fetch_add(1);
        static std::once_flag warned;
        std::call_once(warned, [flag] {
          std::fprintf(stderr,
                       "jax_sprnn: a call planned on the tensor-core rows ran again on the sparse "
                       "rows (%s); later such calls do so silently. SPRNN_CUDA_MMA=0 plans the "
                       "sparse rows from the start.\n",
                       flag == 4 ? "its hidden state became inf or NaN"
                                 : "a block of its pattern has more rows than the build takes");
        });
        pl = make_plan(G, dtype, H, B, nnz, static_cast<int>(variant), info, activation != 0,
                       false);
        continue;
      }
      if (flag != 0)
        return ffi::Error::Internal(
            std::string(target) +
            (flag == 1
                 ? ": the sparse persistent kernel timed out waiting for other blocks (flag 1); "
                   "its blocks were probably not co-resident. Outputs are invalid. Set "
                   "SPRNN_CUDA_TIMEOUT_MS to change the limit or pass variant=4 for the per-step "
                   "path."
                 : ": the sparse persistent kernel aborted (flag " + std::to_string(flag) +
                       ": 2 = a block's units exceed the planned capacity, 3 = the cluster kernel "
                       "ran without sm_90 code). Outputs are invalid; pass variant=4 for the "
                       "per-step path."));
    }
    return ffi::Error::Success();
  }
}

// The target's name: sprnn_<cell>_fwd, or sprnn_<cell>_step for the one-step target.
template <bool kStep>
const char* target_name(Cell cell) {
  switch (cell) {
    case Cell::kLstm: return kStep ? "sprnn_lstm_step" : "sprnn_lstm_fwd";
    case Cell::kGru: return kStep ? "sprnn_gru_step" : "sprnn_gru_fwd";
    default: return kStep ? "sprnn_rnn_step" : "sprnn_rnn_fwd";
  }
}

template <bool kStep>
ffi::Error rnn_fwd(cudaStream_t stream, ffi::AnyBuffer xp, ffi::AnyBuffer lengths,
                   ffi::AnyBuffer values, ffi::AnyBuffer col_idx, ffi::AnyBuffer row_ptr,
                   ffi::AnyBuffer h0, ffi::Result<ffi::AnyBuffer> ys,
                   ffi::Result<ffi::AnyBuffer> hT, ffi::RemainingRets rest, bool reverse,
                   int64_t activation, int64_t variant) {
  const char* target = target_name<kStep>(Cell::kRnnTanh);
  if (activation != 0 && activation != 1)
    return ffi::Error::InvalidArgument(std::string(target) +
                                       ": activation must be 0 (tanh) or 1 (relu)");
  Bufs in{xp, lengths, values, col_idx, row_ptr, h0};
  return forward(target, kStep, stream, Cell::kRnnTanh, in, &*ys, &*hT, nullptr, nullptr, rest,
                 reverse, activation, variant);
}

template <bool kStep>
ffi::Error lstm_fwd(cudaStream_t stream, ffi::AnyBuffer xp, ffi::AnyBuffer lengths,
                    ffi::AnyBuffer values, ffi::AnyBuffer col_idx, ffi::AnyBuffer row_ptr,
                    ffi::AnyBuffer c0, ffi::AnyBuffer h0, ffi::Result<ffi::AnyBuffer> ys,
                    ffi::Result<ffi::AnyBuffer> cT, ffi::Result<ffi::AnyBuffer> hT,
                    ffi::Result<ffi::AnyBuffer> cs, ffi::RemainingRets rest, bool reverse,
                    int64_t variant) {
  Bufs in{xp, lengths, values, col_idx, row_ptr, h0};
  in.c0 = &c0;
  return forward(target_name<kStep>(Cell::kLstm), kStep, stream, Cell::kLstm, in, &*ys, &*hT,
                 &*cT, &*cs, rest, reverse, 0, variant);
}

template <bool kStep>
ffi::Error gru_fwd(cudaStream_t stream, ffi::AnyBuffer xp, ffi::AnyBuffer lengths,
                   ffi::AnyBuffer values, ffi::AnyBuffer col_idx, ffi::AnyBuffer row_ptr,
                   ffi::AnyBuffer h0, ffi::AnyBuffer b_hn, ffi::Result<ffi::AnyBuffer> ys,
                   ffi::Result<ffi::AnyBuffer> hT, ffi::RemainingRets rest, bool reverse,
                   int64_t variant) {
  Bufs in{xp, lengths, values, col_idx, row_ptr, h0};
  in.b_hn = &b_hn;
  return forward(target_name<kStep>(Cell::kGru), kStep, stream, Cell::kGru, in, &*ys, &*hT,
                 nullptr, nullptr, rest, reverse, 0, variant);
}

}  // namespace

// The stream and the operands every forward target starts with: xp, lengths, values, col_idx,
// row_ptr (docs/INTERFACE.md).
inline auto bind_prefix() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>();
}

// Each cell's operands, results and attributes; its fwd and step targets share them.
inline auto rnn_binding() {
  return bind_prefix()
      .Arg<ffi::AnyBuffer>()  // h0
      .Ret<ffi::AnyBuffer>()  // ys
      .Ret<ffi::AnyBuffer>()  // hT
      .RemainingRets()        // workspace (fwd only)
      .Attr<bool>("reverse")
      .Attr<int64_t>("activation")
      .Attr<int64_t>("variant");
}

inline auto lstm_binding() {
  return bind_prefix()
      .Arg<ffi::AnyBuffer>()  // c0
      .Arg<ffi::AnyBuffer>()  // h0
      .Ret<ffi::AnyBuffer>()  // ys
      .Ret<ffi::AnyBuffer>()  // cT
      .Ret<ffi::AnyBuffer>()  // hT
      .Ret<ffi::AnyBuffer>()  // cs
      .RemainingRets()        // workspace (fwd only)
      .Attr<bool>("reverse")
      .Attr<int64_t>("variant");
}

inline auto gru_binding() {
  return bind_prefix()
      .Arg<ffi::AnyBuffer>()  // h0
      .Arg<ffi::AnyBuffer>()  // b_hn
      .Ret<ffi::AnyBuffer>()  // ys
      .Ret<ffi::AnyBuffer>()  // hT
      .RemainingRets()        // workspace (fwd only)
      .Attr<bool>("reverse")
      .Attr<int64_t>("variant");
}

}  // namespace sprnn::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(SprnnRnnFwdCuda, sprnn::cuda::rnn_fwd<false>,
                              sprnn::cuda::rnn_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SprnnLstmFwdCuda, sprnn::cuda::lstm_fwd<false>,
                              sprnn::cuda::lstm_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SprnnGruFwdCuda, sprnn::cuda::gru_fwd<false>,
                              sprnn::cuda::gru_binding());
// The one-step targets, marked for XLA's command buffers (_ffi.py registers them so too).
XLA_FFI_DEFINE_HANDLER_SYMBOL(SprnnRnnStepCuda, sprnn::cuda::rnn_fwd<true>,
                              sprnn::cuda::rnn_binding(), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(SprnnLstmStepCuda, sprnn::cuda::lstm_fwd<true>,
                              sprnn::cuda::lstm_binding(), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(SprnnGruStepCuda, sprnn::cuda::gru_fwd<true>,
                              sprnn::cuda::gru_binding(), {ffi::Traits::kCmdBufferCompatible});

namespace {

template <typename T>
py::capsule encapsulate(T* fn) {
  return py::capsule(reinterpret_cast<void*>(fn));
}

py::dict plan_dict(int gates, int dtype, long long H, long long B, long long nnz, int variant,
                   int sms, int smem_optin, int cc_major, int max_cluster, bool relu) {
  using namespace sprnn::cuda;
  DeviceInfo d;
  if (sms > 0) {
    d.sms = sms;
    d.smem_optin = smem_optin;
    d.coop = 1;
    d.cc_major = cc_major;
    d.max_cluster = cc_major >= 9 ? (max_cluster > 0 ? max_cluster : 16) : 0;
  } else {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) cudaGetLastError();
    d = device_info(dev);
  }
  const Plan pl = make_plan(gates, dtype, H, B, nnz, variant, d, relu);
  py::dict r;
  r["persistent"] = pl.persistent;
  r["variant"] = pl.variant;
  r["wide"] = pl.wide;
  r["lamport"] = pl.lamport;
  r["batch_tile"] = pl.bt;
  r["tiles"] = pl.ntiles;
  r["groups"] = pl.groups;
  r["deep_gather"] = pl.deep_gather;
  r["reg_weights"] = pl.reg_weights;
  r["float_words"] = pl.words == Words::kFloat;
  r["offset_words"] = pl.words == Words::kOffset;
  r["mma"] = pl.mma;
  r["blocks"] = pl.nb;
  r["threads"] = pl.threads;
  r["units_cap"] = pl.u_cap;
  r["nnz_per_block_capacity"] = pl.w_cap;
  r["nnz_per_block_needed"] = pl.w_need;
  r["smem_bytes"] = pl.smem;
  r["on_chip"] = pl.on_chip;
  r["cluster"] = pl.cluster;
  r["reason"] = pl.reason;
  r["sms"] = d.sms;
  r["smem_optin"] = d.smem_optin;
  r["workspace_bytes"] = workspace_bytes(gates, dtype, H, B);
  return r;
}

}  // namespace

PYBIND11_MODULE(_sprnn_cuda, m) {
  m.doc() = "jax_sprnn CUDA FFI targets (sparse persistent forward kernels)";
  m.def("registrations", []() {
    py::dict d;
    d["sprnn_rnn_fwd"] = encapsulate(SprnnRnnFwdCuda);
    d["sprnn_lstm_fwd"] = encapsulate(SprnnLstmFwdCuda);
    d["sprnn_gru_fwd"] = encapsulate(SprnnGruFwdCuda);
    d["sprnn_rnn_step"] = encapsulate(SprnnRnnStepCuda);
    d["sprnn_lstm_step"] = encapsulate(SprnnLstmStepCuda);
    d["sprnn_gru_step"] = encapsulate(SprnnGruStepCuda);
    return d;
  });
  m.def("command_buffer_targets", []() {
    py::list names;
    for (const char* name : {"sprnn_rnn_step", "sprnn_lstm_step", "sprnn_gru_step"})
      names.append(name);
    return names;
  }, "Targets XLA may capture in its command buffers (CUDA graphs).");
  m.def("workspace_bytes", [](int gates, int dtype, long long H, long long B) {
    return sprnn::cuda::workspace_bytes(gates, dtype, H, B);
  }, py::arg("gates"), py::arg("dtype"), py::arg("hidden"), py::arg("batch"));
  m.def("mma_reruns", []() { return sprnn::cuda::g_mma_reruns.load(); },
        "Calls so far that ran again on the sparse rows after the tensor-core rows stopped "
        "(a hidden state that became inf or NaN, or a block with more rows than their build).");
  m.def("step_fallbacks", []() { return sprnn::cuda::g_step_fallbacks.load(); },
        "Calls so far that were planned on the persistent kernel but ran the per-step fallback "
        "because the GPU would not take the launch (warned once on stderr).");
  m.def("staged_steps", []() { return sprnn::cuda::g_staged_steps.load(); },
        "Launches of the staged per-step kernel by unit chunks so far (h of the step's batch "
        "columns copied into shared memory; SPRNN_CUDA_STEP_STAGED=0 turns it off, 2 runs it "
        "wherever it fits).");
  m.def("task_steps", []() { return sprnn::cuda::g_task_steps.load(); },
        "Launches of the staged per-step kernel by warp tasks so far (each warp a unit's gate "
        "rows; SPRNN_CUDA_STEP_STAGED=3 runs it wherever its copy of h fits).");
  m.def("staged_step_max_bytes", []() {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) throw std::runtime_error("no CUDA device");
    return sprnn::cuda::step_config(dev).max_bytes;
  }, "The largest copy of h_{t-1} (bytes) the staged per-step kernel takes on this device.");
  m.def("one_step_calls", []() { return sprnn::cuda::g_one_step_calls.load(); },
        "Calls of one step (T = 1, the default variant) so far, each run as a single launch of "
        "the per-step kernel instead of the persistent kernel.");
  m.def("plan", &plan_dict, py::arg("gates"), py::arg("dtype"), py::arg("hidden"),
        py::arg("batch"), py::arg("nnz"), py::arg("variant") = -1, py::arg("sms") = 0,
        py::arg("smem_optin") = 0, py::arg("cc_major") = 0, py::arg("max_cluster") = 0,
        py::arg("relu") = false,
        "The kernel's placement plan for a layer (sms/smem_optin/cc_major/max_cluster: a "
        "hypothetical GPU, max_cluster 0 = 16 when cc_major >= 9; sms 0 = the current device; "
        "relu: an rnn layer with ReLU).");
}
