// Step probe: times the persistent kernel (csrc/cuda/persistent_kernel.cuh) without JAX and
// splits a step into its phases, to find where the time goes. Standalone on purpose: no XLA, no
// Python, one process per GPU call. Built with SPRNN_STEP_PROBE, which turns on the kernel's phase
// stamps (thread 0 of every block: clock64 + %globaltimer at gather start, gather done, rows
// done, update done) and the probe modes (1 = skip the rows, 2 = do not wait for the tags).
// Built with -DSPRNN_PROBE_FIXED_MODE=0 as well, the mode is a constant and the kernel's code
// is the package's but for the stamps (a runtime mode changes the gather's code: NOTES.md,
// session 26); such a build runs configs of that mode only.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -DSPRNN_STEP_PROBE -Icsrc benchmarks/step_probe.cu -o step_probe
//   ./step_probe rnn:1152:0.1:512:132:0 lstm:1024:0.1:512:132:0 ...
// Each argument:
//   cell:H:density:threads:blocks:mode[:filter[:spin_ns[:row_lanes[:xbuf_kb[:bank[:wcap_pct[:deep[:regw[:fw[:mma]]]]]]]]]],
// cell: rnn (ReLU, its own build: sign-tagged words), rnn-tagged (ReLU in the tanh/relu build,
// tagged words) or lstm. B = 4 (one tile), T = 256, fp16, filter = Params::col_filter
// (default 0; only tiles of 16+ are built with it), row_lanes = Params::row_lanes (0 = the
// kernel's choice), xbuf_kb = where the exchange buffer starts past its allocation (does its
// L2 placement matter?), bank = 1
// (default) packs each row in the package's bank-aware order, 2 in the round-robin deal the
// package used before session 7, 0 in column order (the probe's order before session 7);
// wcap_pct > 0 sizes shared memory for that % of a block's average nonzeros (the rest from L2)
// and the carve-out to match, leaving the SM's other memory to L1; deep = 1 runs the deep-gather
// build (memory.cuh gather_words), regw = 1 the register-weights build (kRegWeights; with
// deep = 1 the deep one, which the package builds for ReLU only), fw the words of the
// nonzeros (storage.cuh RowWord): 0 the package's 4-byte words (offset words where they fit;
// column words before session 34), 1 float words beside regw, 2 column words; mma = 24 or 32
// the tensor-core rows build for that many rows per block (mma_rows.cuh).
// Prints the median us/step
// (kernel only, cudaEvent, 15 runs), the phase medians (p50/p90; "top" p10/p50/p90 is thread 0's
// time from its update done to its next gather start), and for mode 0 the largest error of ys against a
// float64 host recurrence (a sanity check while trying kernel changes; tests/ is the real one).
// A second line splits the traced run by position: step periods in windows of the call, and
// the launch + prologue + tail around the steps; a third gives the spread of the steps' real
// periods and the slowest steps, a fourth their mean and slow share by step mod 4 (parity is
// the exchange slot a step reads) with the buffer's offset in its 2 MB page, a fifth the SM
// clock of the slowest steps against the rest, a sixth the blocks that most often published last.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/launch.cuh"  // persistent_fwd and its 4-byte-word builds
#include "cuda_check.h"

using namespace sprnn;
using namespace sprnn::cuda;


constexpr int kBT = 4, kB = 4, kT = 256;

struct Config {
  std::string cell;
  int H = 1152, threads = 512, blocks = 132, mode = 0, filter = 0, spin_ns = 0, row_lanes = 0, xbuf_kb = 0,
      bank = 1, wcap_pct = 0, deep = 0, regw = 0, fw = 0, mma = 0;
  double density = 0.1;
};

Config parse(const char* s) {
  Config c;
  char cell[16];
  if (std::sscanf(s, "%15[^:]:%d:%lf:%d:%d:%d:%d:%d:%d:%d:%d:%d:%d:%d:%d:%d", cell, &c.H, &c.density,
                  &c.threads, &c.blocks, &c.mode, &c.filter, &c.spin_ns, &c.row_lanes, &c.xbuf_kb,
                  &c.bank, &c.wcap_pct, &c.deep, &c.regw, &c.fw, &c.mma) < 6) {
    std::fprintf(stderr, "bad config %s (cell:H:density:threads:blocks:mode)\n", s);
    std::exit(2);
  }
  c.cell = cell;
  return c;
}

// The package's bank-aware order (jax_sprnn/packing.py bank_aware_order, period 16) for the
// row starting at `from` (the last row of cols / vals), so that the probe's shared-memory
// conflicts are the ones the package's layers see. Same construction, one row at a time:
// single groups (one of every residue), double groups (the rest, dealt round-robin), the
// partial group from the largest classes; the plain round-robin deal where that cannot work.
template <class S>
void bank_aware_row(std::vector<int32_t>& cols, std::vector<S>& vals, size_t from, bool deal_only) {
  constexpr int kP = 16;
  const int n = static_cast<int>(cols.size() - from);
  if (n <= 1) return;
  std::vector<int> by_res(n);
  for (int i = 0; i < n; ++i) by_res[i] = i;
  std::stable_sort(by_res.begin(), by_res.end(), [&](int a, int b) {
    return cols[from + a] % kP < cols[from + b] % kP;  // columns ascend within a residue
  });
  int count[kP] = {}, start[kP] = {};
  for (int i = 0; i < n; ++i) ++count[cols[from + i] % kP];
  for (int c = 1; c < kP; ++c) start[c] = start[c - 1] + count[c - 1];
  const int full = n / kP, part = n - kP * full;
  int by_size[kP];
  for (int c = 0; c < kP; ++c) by_size[c] = c;
  std::stable_sort(by_size, by_size + kP, [&](int a, int b) { return count[a] > count[b]; });
  bool chosen[kP] = {};
  int nchosen = 0;
  for (int i = 0; i < part; ++i)
    if (count[by_size[i]] > 0) chosen[by_size[i]] = true, ++nchosen;
  int doubles = 0;
  for (int c = 0; c < kP; ++c) doubles = std::max(doubles, std::abs(count[c] - chosen[c] - full));
  doubles = std::min(doubles, full);
  const int singles = full - doubles;
  bool fallback = deal_only || nchosen < part;
  int dstart[kP], cstart[kP], acc_d = 0, acc_c = 0;
  for (int c = 0; c < kP; ++c) {
    const int to_doubles = count[c] - chosen[c] - singles;
    fallback = fallback || to_doubles > 2 * doubles;
    dstart[c] = acc_d;
    acc_d += to_doubles;
    cstart[c] = acc_c;
    acc_c += chosen[c];
  }
  const int m = (n + kP - 1) / kP, r = n - kP * (m - 1), m1 = std::max(m - 1, 1);
  std::vector<std::pair<int, int>> pos(n);  // (position, index in the row)
  for (int q = 0; q < n; ++q) {
    const int c = cols[from + by_res[q]] % kP, j = q - start[c];
    int position;
    if (fallback) {
      const bool first = q < r * m;
      const int q2 = q - r * m;
      position = first ? (q % m) * kP + q / m : (q2 % m1) * kP + r + q2 / m1;
    } else if (chosen[c] && j == count[c] - 1) {
      position = kP * full + cstart[c];
    } else if (j < singles) {
      position = kP * (doubles + j) + c;
    } else {
      const int t = dstart[c] + j - singles, d = std::max(doubles, 1);
      position = kP * (t % d) + t / d;
    }
    pos[q] = {position, by_res[q]};
  }
  std::sort(pos.begin(), pos.end());
  std::vector<int32_t> c2(n);
  std::vector<S> v2(n);
  for (int i = 0; i < n; ++i) {
    c2[i] = cols[from + pos[i].second];
    v2[i] = vals[from + pos[i].second];
  }
  std::copy(c2.begin(), c2.end(), cols.begin() + from);
  std::copy(v2.begin(), v2.end(), vals.begin() + from);
}

template <class V>
double pct(V v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return static_cast<double>(v[static_cast<size_t>(q * (v.size() - 1))]);
}

template <Cell kCell>
void run(const Config& c, double clock_ghz, int sms, int smem_optin) {
  constexpr int G = gates_of(kCell);
  using S = uint16_t;
  const int H = c.H, nb = std::min(c.blocks, sms);
  const int threads = std::min(c.threads, kPersistentThreads);
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::bernoulli_distribution keep(c.density);
  std::vector<int32_t> row_ptr(1, 0), col_idx;
  std::vector<S> vals;
  auto h16 = [](float f) {  // float -> fp16 bits on the host, via the CUDA header's converter
    return static_cast<S>(__half_as_ushort(__float2half(f)));
  };
  const float scale = 1.0f / std::sqrt(std::max(1.0, c.density * H));
  for (int r = 0; r < G * H; ++r) {
    for (int col = 0; col < H; ++col)
      if (keep(rng)) {
        col_idx.push_back(col);
        vals.push_back(h16(uni(rng) * scale));
      }
    if (c.bank) bank_aware_row(col_idx, vals, row_ptr.back(), c.bank == 2);
    row_ptr.push_back(static_cast<int32_t>(col_idx.size()));
  }
  const long long nnz = static_cast<long long>(col_idx.size());
  std::vector<S> x(static_cast<size_t>(kT) * kB * G * H), h0(static_cast<size_t>(kB) * H);
  for (auto& v : x) v = h16(uni(rng));
  for (auto& v : h0) v = h16(uni(rng));
  std::vector<int32_t> lengths(kB, kT);

  // The plan, as handlers.cu make_grid_plan computes it for one tile.
  Params p{};
  p.T = kT; p.B = kB; p.H = H; p.ntiles = 1; p.activation = 1; p.reverse = 0; p.lamport = 1;
  const UnitSplit split = unit_split(H, nnz, nb);
  p.alpha = split.alpha;
  p.u_cap = split.u_cap;
  const long long avail = smem_optin - 256;
  // fw = 0: the 4-byte words the package picks for the layer (offset words where they fit,
  // handlers.cu); 1: float words (beside regw); 2: column words.
  const bool offset_fits = offset_words_fit(H, kBT * static_cast<int>(sizeof(S)));
  const Words words = c.regw && c.fw == 1      ? Words::kFloat
                      : c.fw != 2 && offset_fits ? Words::kOffset
                                                 : Words::kColumn;
  const int w_bytes = words == Words::kFloat ? 8 : 4;
  const int h_units = c.mma ? mma_h_stride(H) : 0;
  const SmemLayout l0 = smem_layout(H, kBT, kBT, G, kCell == Cell::kLstm, p.u_cap, 0, 2, w_bytes, 1, 0, h_units);
  p.w_cap = static_cast<int>(std::min<long long>((avail - l0.total) / w_bytes, 1LL << 30));
  // wcap_pct > 0: room for that percentage of a block's average nonzeros only, and the shared
  // memory carve-out no larger than needed, so the rest of the SM's 256 KB is L1 (where the
  // 1024-thread build's register spills can stay).
  if (c.wcap_pct > 0) p.w_cap = static_cast<int>(std::min<long long>(p.w_cap, nnz / nb * c.wcap_pct / 100));
  const long long smem = smem_layout(H, kBT, kBT, G, kCell == Cell::kLstm, p.u_cap, p.w_cap, 2, w_bytes, 1, 0, h_units).total;
  p.timeout_ns = 5000000000LL;
  p.col_filter = c.filter;
  p.spin_ns = c.spin_ns;
  p.row_lanes = c.row_lanes;

  auto upload = [](const auto& v) {
    void* d = nullptr;
    CHECK(cudaMalloc(&d, std::max<size_t>(1, v.size() * sizeof(v[0]))));
    CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(v[0]), cudaMemcpyHostToDevice));
    return d;
  };
  auto zeros = [](size_t bytes) {
    void* d = nullptr;
    CHECK(cudaMalloc(&d, bytes));
    CHECK(cudaMemset(d, 0, bytes));
    return d;
  };
  p.xp = upload(x);
  p.lengths = static_cast<int32_t*>(upload(lengths));
  p.values = upload(vals);
  p.col_idx = static_cast<int32_t*>(upload(col_idx));
  p.row_ptr = static_cast<int32_t*>(upload(row_ptr));
  p.h0 = upload(h0);
  p.c0 = upload(h0);
  p.b_hn = upload(std::vector<S>(H, 0));
  const size_t out_bytes = static_cast<size_t>(kT) * kB * H * sizeof(S);
  p.ys = zeros(out_bytes);
  p.cs = zeros(out_bytes);
  p.hT = zeros(kB * H * sizeof(S));
  p.cT = zeros(kB * H * sizeof(S));
  const size_t ws_bytes = 256 + 256 + 1024ull * c.xbuf_kb + 2ull * exchange_units(H) * kBT * 4;
  unsigned char* ws = static_cast<unsigned char*>(zeros(ws_bytes));
  p.abort_flag = reinterpret_cast<int*>(ws);
  p.counters = reinterpret_cast<unsigned int*>(ws + 256);
  p.xbuf = ws + 512 + 1024ull * c.xbuf_kb;

  constexpr DType kD = DType::kF16;
  const KernelFn fn = c.mma == 24   ? &persistent_fwd<kCell, kD, kBT, true, false, 0, Words::kColumn, 24>
                      : c.mma == 32 ? &persistent_fwd<kCell, kD, kBT, true, false, 0, Words::kColumn, 32>
                      : c.deep && c.regw ? four_byte_words<kCell, kD, true, kRegWeights>(words)
                      : c.deep           ? four_byte_words<kCell, kD, true, 0>(words)
                      : words == Words::kFloat
                          ? &persistent_fwd<kCell, kD, kBT, true, false, kRegWeights, Words::kFloat>
                      : c.regw ? four_byte_words<kCell, kD, false, kRegWeights>(words)
                               : four_byte_words<kCell, kD, false, 0>(words);
  CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  if (c.wcap_pct > 0) {
    int smem_sm = 0;
    CHECK(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
    const int carveout = static_cast<int>(std::min<long long>(100, (smem + 1024) * 100 / smem_sm + 1));
    CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, carveout));
  }
  unsigned long long* trace = static_cast<unsigned long long*>(zeros(static_cast<size_t>(kT) * nb * 8 * 8));
#if defined(SPRNN_PROBE_FIXED_MODE)
  if (c.mode != SPRNN_PROBE_FIXED_MODE) {
    std::fprintf(stderr, "mode %d: this build runs mode %d only (SPRNN_PROBE_FIXED_MODE)\n", c.mode,
                 SPRNN_PROBE_FIXED_MODE);
    return;
  }
#endif
  CHECK(cudaMemcpyToSymbol(g_probe_mode, &c.mode, sizeof(int)));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  float traced_ms = 0;  // the traced run's whole kernel (cudaEvent), for the step-position line
  for (int rep = 0; rep < 18; ++rep) {
    unsigned long long* tp = rep == 17 ? trace : nullptr;  // the last run is traced
    CHECK(cudaMemcpyToSymbol(g_probe_trace, &tp, sizeof(tp)));
    CHECK(cudaMemset(ws, 0, ws_bytes));
    void* args[] = {&p};
    CHECK(cudaEventRecord(e0));
    CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(fn), dim3(nb), dim3(threads),
                                      args, static_cast<size_t>(smem), nullptr));
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    int flag = 0;
    CHECK(cudaMemcpy(&flag, ws, sizeof(int), cudaMemcpyDeviceToHost));
    if (flag != 0) {
      std::printf("%s: kernel aborted (flag %d)\n", c.cell.c_str(), flag);
      return;
    }
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (rep >= 2 && rep < 17) ms.push_back(t);
    if (rep == 17) traced_ms = t;
  }
  const double us_step = pct(ms, 0.5) * 1000.0 / kT;

  std::vector<unsigned long long> tr(static_cast<size_t>(kT) * nb * 8);
  CHECK(cudaMemcpy(tr.data(), trace, tr.size() * 8, cudaMemcpyDeviceToHost));
  auto at = [&](int s, int b, int k) { return tr[(static_cast<size_t>(s) * nb + b) * 8 + k]; };
  // Step s's period on block b, from its gather start to the next: clock64 cycles, %globaltimer ns.
  auto step_cycles = [&](int s, int b) { return static_cast<double>(at(s + 1, b, 0) - at(s, b, 0)); };
  auto step_ns = [&](int s, int b) { return static_cast<double>(at(s + 1, b, 4) - at(s, b, 4)); };
  std::vector<double> gather, rows, update, top, period, spread1, lag, wait_last;
  for (int s = 2; s + 1 < kT; ++s) {
    unsigned long long t3max = 0, t1min = ~0ull, t1max = 0;
    for (int b = 0; b < nb; ++b) {
      gather.push_back((at(s, b, 1) - at(s, b, 0)) / clock_ghz / 1000.0);
      rows.push_back((at(s, b, 2) - at(s, b, 1)) / clock_ghz / 1000.0);
      update.push_back((at(s, b, 3) - at(s, b, 2)) / clock_ghz / 1000.0);
      top.push_back((at(s + 1, b, 0) - at(s, b, 3)) / clock_ghz / 1000.0);  // the next step's start
      period.push_back(step_cycles(s, b) / clock_ghz / 1000.0);
      t3max = std::max(t3max, at(s, b, 7));
      t1min = std::min(t1min, at(s + 1, b, 5));
      t1max = std::max(t1max, at(s + 1, b, 5));
    }
    spread1.push_back((t1max - t1min) / 1000.0);
    lag.push_back((static_cast<double>(t1min) - static_cast<double>(t3max)) / 1000.0);
    wait_last.push_back((static_cast<double>(t1max) - static_cast<double>(t3max)) / 1000.0);
  }
  // The SM clock the traced run actually ran at (clock64 cycles per %globaltimer ns over the
  // traced steps, median over blocks): the phases above assume clock_ghz. (A kernel with
  // tensor-core instructions ran at 1.69-1.75 GHz instead of 1.98: benchmarks/NOTES.md, session 9.)
  std::vector<double> ghz;
  for (int b = 0; b < nb; ++b)
    ghz.push_back(static_cast<double>(at(kT - 1, b, 0) - at(2, b, 0)) /
                  static_cast<double>(at(kT - 1, b, 4) - at(2, b, 4)));
  const double sm_ghz = pct(ghz, 0.5);
  // ys of the last run against a float64 recurrence on the fp16 inputs (mode 0 only).
  double err = -1.0, ref_max = 0.0;
  if (c.mode == 0) {
    std::vector<S> ys(static_cast<size_t>(kT) * kB * H);
    CHECK(cudaMemcpy(ys.data(), p.ys, out_bytes, cudaMemcpyDeviceToHost));
    auto f = [](S v) { return static_cast<double>(__half2float(__ushort_as_half(v))); };
    std::vector<double> h(static_cast<size_t>(kB) * H), cst(h.size()), hn(h.size());
    for (size_t i = 0; i < h.size(); ++i) h[i] = cst[i] = f(h0[i]);
    err = 0.0;
    for (int t = 0; t < kT; ++t) {
      for (int b = 0; b < kB; ++b)
        for (int u = 0; u < H; ++u) {
          float pre[4];
          for (int g = 0; g < G; ++g) {
            const int r = u * G + g;
            double a = f(x[(static_cast<size_t>(t) * kB + b) * G * H + static_cast<size_t>(g) * H + u]);
            for (int k = row_ptr[r]; k < row_ptr[r + 1]; ++k) a += f(vals[k]) * h[static_cast<size_t>(b) * H + col_idx[k]];
            pre[g] = static_cast<float>(a);
          }
          const size_t i = static_cast<size_t>(b) * H + u;
          if constexpr (kCell == Cell::kLstm) {
            float cc = static_cast<float>(cst[i]);
            hn[i] = lstm_step(pre, cc);
            cst[i] = cc;
          } else {
            hn[i] = rnn_step<Cell::kRnnRelu>(pre[0], 0.0f);
          }
          const double y = f(ys[static_cast<size_t>(t) * kB * H + i]);
          err = std::max(err, std::abs(y - hn[i]));
          ref_max = std::max(ref_max, std::abs(hn[i]));
        }
      h.swap(hn);
    }
  }
  std::printf("%-4s H=%-5d d=%.2f thr=%-4d nb=%-3d mode=%d filter=%d spin=%d lanes=%d xbuf_kb=%d bank=%d wcap_pct=%d deep=%d regw=%d fw=%d mma=%d nnz=%lld smem=%lld | %.3f us/step | "
              "phase us (p50/p90): gather %.3f/%.3f rows %.3f/%.3f update %.3f/%.3f top %.3f/%.3f/%.3f period %.3f | "
              "timer: last publish -> first/last gather done %.3f/%.3f, gather-done spread %.3f | sm %.2f GHz | "
              "ys max abs err %.2e (max |ref| %.2f)%s\n",
              c.cell.c_str(), H, c.density, threads, nb, c.mode, c.filter, c.spin_ns, c.row_lanes, c.xbuf_kb, c.bank, c.wcap_pct, c.deep, c.regw, c.fw, c.mma, nnz, smem, us_step,
              pct(gather, 0.5), pct(gather, 0.9), pct(rows, 0.5), pct(rows, 0.9), pct(update, 0.5),
              pct(update, 0.9), pct(top, 0.1), pct(top, 0.5), pct(top, 0.9), pct(period, 0.5), pct(lag, 0.5), pct(wait_last, 0.5),
              pct(spread1, 0.5), sm_ghz, err, ref_max, err > 1e-2 * std::max(1.0, ref_max) ? " FAIL" : "");
  // Where in the call the time goes (traced run): median period (us, from clock64) of the steps
  // in each window, and the launch + prologue + tail = the whole kernel minus the span of the
  // step-0 .. step-(T-1) gather starts (median over blocks, %globaltimer). Do the first steps of
  // a call run slower than the rest (benchmarks/NOTES.md, session 10)?
  {
    const int win[] = {0, 2, 8, 32, 128, kT - 1};
    std::printf("     step position: period p50 us");
    for (size_t w = 0; w + 1 < std::size(win); ++w) {
      std::vector<double> v;
      for (int st = win[w]; st < win[w + 1]; ++st)
        for (int b = 0; b < nb; ++b) v.push_back(step_cycles(st, b) / clock_ghz / 1000.0);
      std::printf(" | steps %d-%d %.3f", win[w], win[w + 1] - 1, pct(v, 0.5));
    }
    std::vector<double> span;
    for (int b = 0; b < nb; ++b) span.push_back((at(kT - 1, b, 4) - at(0, b, 4)) / 1000.0);
    std::printf(" | whole kernel %.1f us, step 0 .. %d %.1f us, launch + prologue + last step + tail %.1f us\n",
                traced_ms * 1000.0, kT - 1, pct(span, 0.5), traced_ms * 1000.0 - pct(span, 0.5));
    // How the steps' real periods spread (median over blocks of each step's period, steps
    // 2 .. T-2, clock64 at the measured SM clock): is the mean above the median through a few
    // slow steps or many?
    std::vector<std::pair<double, int>> steps;
    for (int st = 2; st + 1 < kT; ++st) {
      std::vector<double> v;
      for (int b = 0; b < nb; ++b) v.push_back(step_cycles(st, b) / sm_ghz / 1000.0);
      steps.push_back({pct(v, 0.5), st});
    }
    std::sort(steps.begin(), steps.end());
    std::vector<double> per;
    for (const auto& e : steps) per.push_back(e.first);
    const double p50 = pct(per, 0.5);
    std::printf("     real step periods (us): mean %.3f p10 %.3f p50 %.3f p90 %.3f p99 %.3f max %.3f | slowest:",
                std::accumulate(per.begin(), per.end(), 0.0) / per.size(), pct(per, 0.1), p50,
                pct(per, 0.9), pct(per, 0.99), per.back());
    for (auto e = steps.rbegin(); e != steps.rend() && e - steps.rbegin() < 8; ++e)
      std::printf(" %d:%.2f", e->second, e->first);
    // By the exchange slot a step gathers from (step s reads slot (s - 1) & 1, so parity is
    // the slot) and by s mod 4 (the sign-tag value the gather expects): is the tail one slot's
    // placement in L2 or the tag? Slow = more than 0.15 us above the median.
    {
      std::printf("\n     by step mod 4 (mean us, slow share):");
      for (int m = 0; m < 4; ++m) {
        double sum = 0;
        int n = 0, slow = 0;
        for (const auto& e : steps)
          if (e.second % 4 == m) sum += e.first, ++n, slow += e.first > p50 + 0.15;
        std::printf(" %d: %.3f %d/%d", m, n ? sum / n : 0.0, slow, n);
      }
      const unsigned long long xa = reinterpret_cast<unsigned long long>(p.xbuf);
      std::printf(" | xbuf %% 2 MB: %llu KB", (xa & ((1ull << 21) - 1)) >> 10);
    }
    // Which block published last the h that a step gathers (%globaltimer at its update done of
    // the step before), over all steps and over the slowest tenth: one late block every time
    // would point at its share of the work.
    auto last_publishers = [&](size_t from) {
      std::vector<int> count(nb, 0);
      for (size_t i = from; i < steps.size(); ++i) {
        const int st = steps[i].second;
        int arg = 0;
        for (int b = 1; b < nb; ++b) arg = at(st - 1, b, 7) > at(st - 1, arg, 7) ? b : arg;
        ++count[arg];
      }
      std::vector<std::pair<int, int>> top;
      for (int b = 0; b < nb; ++b) top.push_back({count[b], b});
      std::sort(top.rbegin(), top.rend());
      for (int i = 0; i < 5 && i < nb; ++i) std::printf(" %d:%d", top[i].second, top[i].first);
    };
    // The SM clock within each step (clock64 cycles per %globaltimer ns over the step, median
    // over blocks), the slowest tenth against the rest: do the slow steps run at a lower clock
    // (power management), or at the same clock and wait longer?
    auto step_clocks = [&](size_t from, size_t to) {
      std::vector<double> v;
      for (size_t i = from; i < to; ++i) {
        const int st = steps[i].second;
        std::vector<double> per_block;
        for (int b = 0; b < nb; ++b) per_block.push_back(step_cycles(st, b) / step_ns(st, b));
        v.push_back(pct(per_block, 0.5));
      }
      return v;
    };
    const size_t slowest = steps.size() / 10, slowest_from = steps.size() - slowest;
    std::vector<double> rest_ghz = step_clocks(0, slowest_from), slow_ghz = step_clocks(slowest_from, steps.size());
    std::printf("\n     step clock (GHz, p10/p50/p90 over steps): slowest %zu %.3f/%.3f/%.3f, the rest %.3f/%.3f/%.3f",
                slowest, pct(slow_ghz, 0.1), pct(slow_ghz, 0.5), pct(slow_ghz, 0.9),
                pct(rest_ghz, 0.1), pct(rest_ghz, 0.5), pct(rest_ghz, 0.9));
    std::printf("\n     last publisher (block:steps), all %zu steps:", steps.size());
    last_publishers(0);
    std::printf(" | slowest %zu:", slowest);
    last_publishers(slowest_from);
    std::printf("\n");
  }
  std::fflush(stdout);
  for (void* d : {const_cast<void*>(p.xp), const_cast<void*>(static_cast<const void*>(p.lengths)),
                  const_cast<void*>(p.values), const_cast<void*>(static_cast<const void*>(p.col_idx)),
                  const_cast<void*>(static_cast<const void*>(p.row_ptr)), const_cast<void*>(p.h0),
                  const_cast<void*>(p.c0), const_cast<void*>(p.b_hn), p.ys, p.cs, p.hT, p.cT,
                  static_cast<void*>(ws), static_cast<void*>(trace)})
    CHECK(cudaFree(d));
}

int main(int argc, char** argv) {
  int dev = 0, sms = 0, smem_optin = 0, clock_khz = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  const double ghz = clock_khz / 1e6;
  std::printf("SMs %d, smem/block %d, clock %.3f GHz (phases converted from clock64 at this rate)\n",
              sms, smem_optin, ghz);
  for (int i = 1; i < argc; ++i) {
    const Config c = parse(argv[i]);
    if (c.cell == "lstm") {
      run<Cell::kLstm>(c, ghz, sms, smem_optin);
    } else if (c.cell == "rnn") {  // ReLU's own build (sign-tagged exchange words), as the package
      run<Cell::kRnnRelu>(c, ghz, sms, smem_optin);
    } else if (c.cell == "rnn-tagged") {  // ReLU in the rnn build (tagged words), for A/B
      run<Cell::kRnnTanh>(c, ghz, sms, smem_optin);
    } else {  // (no GRU here: its update needs b_hn)
      std::fprintf(stderr, "cell %s: the probe runs rnn, rnn-tagged (relu) and lstm only\n", c.cell.c_str());
      return 2;
    }
  }
  return 0;
}
