// The persistent kernel (persistent_fwd): one cooperative launch runs every step, each block
// gathering h, computing its rows and publishing its units (kernel_core.cuh has the design).
#pragma once

#include "cuda/cell_update.cuh"
#include "cuda/mma_rows.cuh"

namespace sprnn {
namespace cuda {

// One gathered chunk of N values into the h tile: store_h, or the mma build's batch-major tile
// of hs units per batch column (store_h_t).
template <DType D, int BT, int N, bool kWide, bool kBatchMajor>
__device__ __forceinline__ void store_tile(typename Tr<D>::S* h_s, int H, int hs, int item,
                                           const uint32_t* bits) {
  if constexpr (kBatchMajor)
    store_h_t<D, BT, N>(reinterpret_cast<uint16_t*>(h_s), hs, item, bits);
  else
    store_h<typename Tr<D>::S, BT, N, kWide>(h_s, H, item, bits);
}

// Threads per CTA the cluster kernel (cluster_kernel.cuh) is built for: tiles of 16 run 512
// threads with up to 128 registers, smaller tiles 1024.
__host__ __device__ constexpr int max_threads_of_tile(int bt) { return bt >= 16 ? 512 : 1024; }

// kCell: kRnnTanh stands for rnn (activation at run time), kLstm, kGru. kDeepGather, kRegW and
// kWords select the builds of gather_words, kRegWeights and RowWord.
template <Cell kCell, DType D, int BT, bool kWide, bool kDeepGather = false, int kRegW = 0,
          Words kWords = Words::kColumn, int kMma = 0>
__global__ void __launch_bounds__(kPersistentThreads, 1) persistent_fwd(Params p) {
  using T = Tr<D>;
  using S = typename T::S;
  using XW = XWord<kCell, D, BT>;
  using X = typename XW::X;  // loaded by the gather
  using P = typename XW::P;  // published per value
  using W = RowWordT<D, kWords>;
  constexpr int G = gates_of(kCell);
  constexpr bool kLstmCell = kCell == Cell::kLstm;
  // Gathers move h in chunks of at most 32 bytes per thread: kCW exchange words (Lamport: kXU
  // words per unit, kCV values per chunk) or kRW raw values (barrier mode, h0); a unit is kCPU
  // (kRPU) consecutive chunks. Tiles up to 8 (16-bit) / 4 (float32) are one chunk per unit.
  // Units under 16 bytes travel kUPC to a chunk (chunk_units).
  constexpr int kXU = BT / XW::kVals;
  constexpr int kUPC = kWide ? chunk_units(static_cast<int>(sizeof(X)) * kXU) : 1;
  constexpr int kCW = kXU * kUPC <= 32 / static_cast<int>(sizeof(X)) ? kXU * kUPC : 32 / static_cast<int>(sizeof(X));
  constexpr int kCV = kCW * XW::kVals;
  constexpr int kCPU = kXU / kCW > 1 ? kXU / kCW : 1;
  constexpr int kRW = static_cast<int>(sizeof(S)) * BT <= 32 ? BT : 32 / static_cast<int>(sizeof(S));
  constexpr int kRPU = BT / kRW;
  // Chunks in flight per thread: up to 128 bytes, or 256 in the deep-gather build.
  constexpr int K = gather_units(static_cast<int>(sizeof(P)), BT, kDeepGather) / kUPC;
  static_assert(K >= 1, "a round holds at least one chunk");
  // Row mapping (RowMap): tiles up to 8 (16-bit) / 4 (float32) have kLPN = 1, every lane its
  // own nonzeros with the whole tile (the original mapping). Larger tiles ("batch lanes"): the
  // kLPN lanes of a slice read one weight (a shared-memory broadcast) and contiguous h
  // (h_s[col * BT + b0 .. + kNV]); registers stay those of BT = 8.
  constexpr int kNV = RowMap<D, BT, kWide>::kNV;
  constexpr int kLPN = RowMap<D, BT, kWide>::kLPN;
  // The needed-column filter (p.col_filter) is built into the large-tile kernels only: that is
  // where the h gathers dominate (H * BT words per block and round). For tiles up to 8 its
  // per-item check cost more than the loads it saved (step probe: 2.40 vs 2.01 us/step at
  // ReLU H=1152, B=4; again in session 6: 2.25 vs 1.82).
  constexpr bool kFilter = BT >= 16;
  static_assert(BT % XW::kVals == 0 && (kUPC > 1 || kXU % kCW == 0) && BT % kRW == 0 && BT % kNV == 0 && kLPN <= 32, "tile");
  static_assert(kWide || (kCPU == 1 && kRPU == 1 && kLPN == 1), "naive layout: whole units");
  static_assert(!kFilter || kUPC == 1, "the column filter skips whole chunks of one unit");

  extern __shared__ __align__(16) unsigned char smem[];
  SPRNN_PROBE_INIT;
  const int tid = threadIdx.x;
  const int nthr = blockDim.x;
  const int H = p.H, B = p.B;
  const int bpad = p.ntiles * BT;
  // Batch groups (p.groups > 1, one tile each): this block is block `jb` of the nb blocks that
  // run tile `grp`; the tiles' exchanges never meet. Otherwise nb = the grid, running every tile.
  const int groups = p.groups > 1 ? p.groups : 1;
  const int nb = gridDim.x / groups;
  const int grp = blockIdx.x / nb, jb = blockIdx.x % nb;
  if (grp >= groups) return;  // the host launches groups * nb blocks; never read past the plan
  const int j_lo = groups > 1 ? grp : 0, j_hi = groups > 1 ? grp + 1 : p.ntiles;
  const int b_lo = j_lo * BT, b_hi = j_hi * BT < B ? j_hi * BT : B;

  __shared__ int sh_u[2];
  __shared__ int sh_lmax;
  if (tid == 0) {
    int u0, u1;
    unit_range(p, G, jb, nb, u0, u1);
    sh_u[0] = u0;
    sh_u[1] = u1;
    sh_lmax = max_seq_len(p, b_lo, b_hi);
  }
  __syncthreads();
  const int u0 = sh_u[0];
  const int nu = sh_u[1] - u0;
  const int lmax = sh_lmax;
  if (nu > p.u_cap) {  // cannot happen with the host's bound; never corrupt shared memory
    if (tid == 0) atomicExch(p.abort_flag, 2);
    return;
  }
  static_assert(kMma == 0 || (D != DType::kF32 && kWide && BT % 2 == 0 && kRegW == 0), "mma build");
  const int hs = kMma > 0 ? mma_h_stride(H) : H;  // the mma build's batch-major h tile
  const SmemLayout L = smem_layout(H, BT, bpad, G, kLstmCell, p.u_cap, p.w_cap,
                                   static_cast<int>(sizeof(S)), static_cast<int>(sizeof(W)), 1, 0,
                                   kMma > 0 ? hs : 0);
  S* h_s = reinterpret_cast<S*>(smem + L.h_off);
  uint32_t* cmask = reinterpret_cast<uint32_t*>(smem + L.m_off);
  float* acc_s = reinterpret_cast<float*>(smem + L.acc_off);
  float* hst = reinterpret_cast<float*>(smem + L.hst_off);
  float* cst = reinterpret_cast<float*>(smem + L.cst_off);
  int* len_s = reinterpret_cast<int*>(smem + L.len_off);  // clamped lengths of the bpad columns
  // The weight region (w_cap words) holds this block's row offsets (from kb0), then as many of
  // its nonzeros as fit: sized by the block's own rows, not the worst case u_cap.
  const long long rows_bytes = align16(static_cast<long long>(nu * G + 1) * 4);
  int* rows_s = reinterpret_cast<int*>(smem + L.w_off);
  W* w_s = reinterpret_cast<W*>(smem + L.w_off + rows_bytes);
  const long long w_room = p.w_cap - rows_bytes / static_cast<long long>(sizeof(W));

  const int32_t* row_ptr = p.row_ptr;
  const long long kb0 = __ldg(row_ptr + static_cast<long long>(u0) * G);
  const long long kb1 = __ldg(row_ptr + static_cast<long long>(u0 + nu) * G);
  const long long n_in = (kb1 - kb0) < w_room ? (kb1 - kb0) : (w_room > 0 ? w_room : 0);

  // Load this block's nonzeros (as many as fit) and its initial state, and mark the h units
  // its rows read (col_filter): the gathers skip the others (fewer L2 reads per step, most
  // with many blocks and low density). Lamport's two-slot rule needs every block to read at
  // least one unit of every non-empty block each step (a block that overwrote slot s-1 with
  // step s+1 must have seen every reader publish step s, i.e. finish its reads of step s-1),
  // so each block's first unit is marked too. A block without units reads nothing (nobody
  // waits for it and it needs no h).
  if constexpr (kMma == 0) load_weights<D, kWords>(p, kb0, n_in, w_s, BT * static_cast<int>(sizeof(S)));
  load_step_constants(p, 0, bpad, len_s, static_cast<long long>(u0) * G, nu * G, kb0, rows_s);
  const bool filter = kFilter && p.col_filter != 0;
  if (filter)
    for (int i = tid; i < (H + 31) >> 5; i += nthr) cmask[i] = 0u;
  init_state<kCell, D>(p, u0, nu, 0, bpad, hst, cst);
  __syncthreads();
  // (cmask is first read after step 0's gather barrier.)
  if (filter && nu > 0) mark_columns(p, G, kb0, kb1, nb, cmask);

  // The mma build's A fragments, from a dense tile in the weight region (which then holds the
  // warps' partial sums); its h tile is zeroed once (the units past H stay zero).
  MmaRegs<kMma> areg;
  float* mma_part = reinterpret_cast<float*>(w_s);
  if constexpr (kMma > 0) {
    if (!mma_fits(kMma, nu * G, H, nthr >> 5) ||
        w_room * static_cast<long long>(sizeof(W)) < mma_region_bytes(kMma, nu * G, H, nthr >> 5)) {
      if (tid == 0) atomicExch(p.abort_flag, 5);  // the host reruns the call (handlers.cu)
      return;
    }
    for (int i = tid; i < BT * hs / 2; i += nthr) reinterpret_cast<uint32_t*>(h_s)[i] = 0u;
    mma_load_regs<D, kMma>(p, kb0, rows_s, nu * G, reinterpret_cast<uint16_t*>(w_s), areg);
  }
  MmaStep mma{};
  if constexpr (kMma > 0) mma = mma_step<kMma>(reinterpret_cast<const uint16_t*>(h_s), H, nu * G, BT, mma_part);

  const int npairs = nu * BT;
  constexpr bool kFirstPairEarly = kDeepGather && kRegW == 0;  // see first_pair below
  const bool half_warps = two_rows_per_warp(nu * G, nthr >> 5, p.row_lanes);
  // Register weights (kRegW): the nonzeros of this lane's first row that row_dot's register
  // round takes (the same lane, row and order as there; rows wholly on chip only).
  static_assert(kRegW == 0 || D != DType::kF32, "register weights: 16-bit weights only");
  W wreg[reg_slots(kRegW)] = {};
  if constexpr (kRegW > 0) {
    const int group = half_warps ? 16 : 32;
    const int r = lane_first_row(tid, group);
    const int sl = lane_row_slice(tid & 31, group, kLPN), ns = group / kLPN;
    if (r < nu * G && rows_s[r + 1] <= n_in) {
#pragma unroll
      for (int q = 0; q < kRegW; ++q) {
        const int k = rows_s[r] + sl + ns * q;
        wreg[q] = k < rows_s[r + 1] ? w_s[k] : W{};
      }
    }
  }
  // Units per tile in the exchange buffer: the chunked gathers need 16-byte aligned tiles; the
  // other builds keep H (their code, registers and all, as before the chunks).
  const int Hx = kUPC > 1 ? static_cast<int>(exchange_units(H)) : H;
  // The block of the last unit (not an empty block after it, which nobody waits for) publishes
  // the units past H of the gather's last chunk.
  const int pad_pairs =
      kUPC > 1 && p.lamport && nu > 0 && u0 + nu == H ? ((H + kUPC - 1) / kUPC * kUPC - H) * BT : 0;
  X* xtag = static_cast<X*>(p.xbuf);
  S* xraw = static_cast<S*>(p.xbuf);

  // The mma build: whether this thread stored or made an inf or NaN h (nonfinite_bits). The
  // call then runs to its end and raises flag 4 there, for the host's rerun: a flag per step
  // lengthened the step (session 32).
  bool saw_nonfinite = false;
  for (int s = 0; s < lmax; ++s) {
    for (int j = j_lo; j < j_hi; ++j) {
      const long long tile_off = (static_cast<long long>((s & 1) * p.ntiles + j) * Hx) * BT;
      const long long prev_off = (static_cast<long long>(((s + 1) & 1) * p.ntiles + j) * Hx) * BT;

      // This thread's first (unit, b) pair: its step, publish offset and input projection, loaded
      // after the gather, in flight while the rows run. Before the gather (until session 36)
      // these shared, constant and global loads queued behind the other warps' polls and
      // delayed this warp's own polls (step probe, us/step: ReLU H=5760 4.35 -> 4.24, LSTM H=1024
      // 2.01 -> 1.90, LSTM H=4096 8.80 -> 8.57; benchmarks/NOTES.md, session 36). The deep-gather
      // builds without register weights keep them before the gather: after it, the x registers
      // live across the rows and those builds spill.
      S xr[G] = {};
      PairStep ps0{};
      long long xo0 = 0;
      auto first_pair = [&] {
        if (tid < npairs) {
          const int b = j * BT + tid % BT, u = u0 + tid / BT;
          ps0 = pair_step(p, s, len_s[b], b, u);
          xo0 = tile_off + static_cast<long long>(u) * BT + tid % BT;
          if (ps0.valid) load_x_pair<D, G>(p, ps0, u, xr);
        }
      };
      if constexpr (kFirstPairEarly) first_pair();

      // 1. h_{s-1} of this tile into shared memory.
      SPRNN_PROBE_STAMP(s, 0);
      bool aborted = false;
      if (s == 0) {
        for (int it = tid; it < H * kRPU; it += nthr) {
          const int u = it / kRPU, c0 = (it % kRPU) * kRW;
          uint32_t bits[kRW];
#pragma unroll
          for (int i = 0; i < kRW; ++i) {
            const int b = j * BT + c0 + i;
            bits[i] = b < B ? T::f_to_bits(T::to_f(static_cast<const S*>(p.h0)[static_cast<long long>(b) * H + u])) : 0u;
            if constexpr (kMma > 0) saw_nonfinite = saw_nonfinite || nonfinite_bits<D>(bits[i]);
          }
          store_tile<D, BT, kRW, kWide, (kMma > 0)>(h_s, H, hs, it, bits);
        }
      } else if (!p.lamport) {
        if (tid == 0) {
          const unsigned int target = static_cast<unsigned int>(s) * static_cast<unsigned int>(nb);
          unsigned long long start = 0;
          int it = 0;
          while (static_cast<int>(ld_acquire(p.counters + j) - target) < 0) {
            if (p.spin_ns) __nanosleep(p.spin_ns);
            if ((++it & 63) == 0 && wait_expired(p, start)) { aborted = true; break; }
          }
          __threadfence();
        }
        if (__syncthreads_or(aborted)) return;
        const S* src = xraw + prev_off;
        for (int it = tid; it < H * kRPU; it += nthr) {
          if (filter && !((cmask[(it / kRPU) >> 5] >> ((it / kRPU) & 31)) & 1u)) continue;
          uint32_t bits[kRW];
          if constexpr (sizeof(S) * kRW >= 16) {
#pragma unroll
            for (int i = 0; i < static_cast<int>(sizeof(S)) * kRW / 16; ++i) {
              const uint4 v = __ldcg(reinterpret_cast<const uint4*>(src + static_cast<long long>(it) * kRW) + i);
              const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
              for (int q = 0; q < 4; ++q) {
                if constexpr (sizeof(S) == 4) {
                  bits[i * 4 + q] = w[q];
                } else {
                  bits[i * 8 + 2 * q] = w[q] & 0xffffu;
                  bits[i * 8 + 2 * q + 1] = w[q] >> 16;
                }
              }
            }
          } else {
#pragma unroll
            for (int i = 0; i < kRW; ++i) {
              if constexpr (sizeof(S) == 4) {
                bits[i] = __float_as_uint(__ldcg(reinterpret_cast<const float*>(src) + static_cast<long long>(it) * kRW + i));
              } else {
                bits[i] = __ldcg(reinterpret_cast<const unsigned short*>(src) + static_cast<long long>(it) * kRW + i);
              }
            }
          }
          store_tile<D, BT, kRW, kWide, (kMma > 0)>(h_s, H, hs, it, bits);
        }
      } else {
        const X tag = XW::tag_word(s - 1);
        const int nitems = (H * kCPU + kUPC - 1) / kUPC;  // chunks
        const X* src = xtag + prev_off / XW::kVals;
        unsigned long long start = 0;
        // Rounds of up to K chunks per thread (items ib, ib + nthr, ...): all loads of a round
        // are issued before any tag is checked, and only the pending ones are polled again.
        // Branch-free on the common path (predicated loads): this loop's instructions were
        // most of a small layer's step (step probe profile, benchmarks/NOTES.md).
        for (int ib = tid; ib < nitems && !aborted; ib += nthr * K) {
          const int left = ib + (K - 1) * nthr < nitems ? K : (nitems - ib + nthr - 1) / nthr;
          unsigned int pending = left >= K ? (1u << K) - 1u : (1u << left) - 1u;
          if (filter) {
#pragma unroll
            for (int i = 0; i < K; ++i) {
              const int u = (ib + i * nthr) / kCPU;
              if ((pending >> i) & 1u) pending &= ~(((~cmask[u >> 5] >> (u & 31)) & 1u) << i);
            }
          }
          int spins = 0;
          while (pending) {
            X w[K][kCW] = {};
#pragma unroll
            for (int i = 0; i < K; ++i)
              load_x<X, kCW>(src + static_cast<long long>(ib + i * nthr) * kCW, w[i], (pending >> i) & 1u);
#pragma unroll
            for (int i = 0; i < K; ++i) {
              if (i >= left) break;  // items past the end: none in this round
              bool ok = (pending >> i) & 1u;
#pragma unroll
              for (int q = 0; q < kCW; ++q) ok = ok && (XW::ok(w[i][q], tag) || SPRNN_PROBE_MODE == 2);
              if (ok) {
                uint32_t bits[kCV];
#pragma unroll
                for (int q = 0; q < kCV; ++q) bits[q] = XW::value(w[i][q / XW::kVals], q % XW::kVals);
                store_tile<D, BT, kCV, kWide, (kMma > 0)>(h_s, H, hs, ib + i * nthr, bits);
                pending &= ~(1u << i);
              }
            }
            if (pending) {
              if (p.spin_ns) __nanosleep(p.spin_ns);
              if ((++spins & 31) == 0 && wait_expired(p, start)) { aborted = true; break; }
            }
          }
        }
      }
      if (__syncthreads_or(aborted)) return;
      if constexpr (!kFirstPairEarly) first_pair();
      SPRNN_PROBE_STAMP(s, 1);

      // 2. Rows (compute_rows above).
      if constexpr (kMma > 0) {
        if (SPRNN_PROBE_MODE != 1)
          mma_rows<D, BT, kMma>(mma, nu * G, areg, mma_part, acc_s);
      } else if (SPRNN_PROBE_MODE != 1) {
        if (half_warps)
          compute_rows<D, BT, kWide, kWords, 16, kRegW>(p, w_s, kb0, n_in, h_s, rows_s,
                                                        nu * G, wreg, acc_s);
        else
          compute_rows<D, BT, kWide, kWords, 32, kRegW>(p, w_s, kb0, n_in, h_s, rows_s,
                                                        nu * G, wreg, acc_s);
      }
      __syncthreads();
      SPRNN_PROBE_STAMP(s, 2);

      // 3. Cell update and publish.
      for (int pi = tid; pi < npairs; pi += nthr) {
        const int ul = pi / BT, bt = pi % BT;
        const int b = j * BT + bt;
        const bool first = pi == tid;
        float hw[G];
        row_sums<G, BT>(acc_s, ul, bt, hw);
        const float hnew =
            update_pair<kCell, D>(p, first ? ps0 : pair_step(p, s, len_s[b], b, u0 + ul), u0 + ul,
                                  b, ul * bpad + b, first, xr, hw, hst, cst);
        // h_s of this tile and step (Lamport: value + tag word; barrier mode: raw value).
        const long long xo = first ? xo0 : tile_off + static_cast<long long>(u0 + ul) * BT + bt;
        if (p.lamport) {
          const uint32_t bits = T::f_to_bits(hnew);
          st_relaxed(static_cast<P*>(p.xbuf) + xo, XW::publish(bits, s));
          if constexpr (kMma > 0) saw_nonfinite = saw_nonfinite || nonfinite_bits<D>(bits);
        } else if constexpr (sizeof(S) == 4) {
          __stcg(reinterpret_cast<float*>(xraw) + xo, hnew);
        } else {
          __stcg(reinterpret_cast<unsigned short*>(xraw) + xo, static_cast<unsigned short>(T::f_to_bits(hnew)));
        }
      }
      if constexpr (kUPC > 1) {
        if (tid < pad_pairs)  // the last chunk's units past H: zeros
          st_relaxed(static_cast<P*>(p.xbuf) + tile_off + static_cast<long long>(H) * BT + tid,
                     XW::publish(0u, s));
      }
      SPRNN_PROBE_STAMP(s, 3);
      if (!p.lamport) {
        __syncthreads();
        if (tid == 0) {
          __threadfence();
          atomicAdd(p.counters + j, 1u);
        }
      } else if (SPRNN_PROBE_MODE == 3) {
        __syncthreads();
      }
    }
  }

  // Flag 4: the mma build met inf or NaN in h; the host reruns the call (handlers.cu).
  if constexpr (kMma > 0)
    if (saw_nonfinite) atomicCAS(p.abort_flag, 0, 4);
  // Padding steps after the longest sequence, and the final carry of this block's columns
  // (hst/cst were written by the cell-update threads: barrier first).
  __syncthreads();
  write_tail<kCell, D>(p, u0, nu, lmax, b_lo, b_hi, bpad, hst + b_lo, cst + b_lo);
}

}  // namespace cuda
}  // namespace sprnn
