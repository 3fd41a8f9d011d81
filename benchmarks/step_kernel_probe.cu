// The per-step kernel's row loads (step_kernels.cuh: kVec nonzeros per load, kUnroll loads in
// flight, kMinBlocks blocks per SM in the launch bounds), timed on one-step calls (T = 1,
// fp16, B = 4, 1 and 8) without JAX, and as loop steps (variant 4 and layers off chip: h from
// the float32 workspace), step_fwd against step_fwd_staged (h_{t-1} copied on chip, by values
// or by 16-byte vectors; above 47 KB by raising the kernel's limit) and step_fwd_tasks (the
// same copy, each warp whole units, no barrier after the copy): us per launch over
// back-to-back launches, medians of 5 rounds, and each setting's largest difference in ys / cs
// from the first (session 82's kernel: 8 column slots, one nonzero per load), of one launch
// from the same state.
//
//   benchmarks/gpu_check.sh step-kernel
//   step_kernel_probe CELL H B LAUNCHES SETTING   (one layer, one setting, e.g. under ncu:
//                                                  CELL lstm, gru or relu, SETTING an index
//                                                  below)
//   step_kernel_probe CELL:H:B ...                 (these layers, every setting)
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <cstdlib>
#include <initializer_list>
#include <vector>

#include "cuda/step_kernels.cuh"
#include "cuda_check.h"

using sprnn::Cell;
using sprnn::cuda::DType;
using sprnn::cuda::Params;
using sprnn::cuda::StepLaunch;

struct Setting {
  const char* name;
  StepLaunch launch;
  bool one_step;  // else a loop step: h and c in the workspace
};

// The setting's step_fwd for p's B columns (kCols = step_cols(B), as launch.cuh picks it;
// kCols 8 for every B is session 82's kernel).
template <Cell C, int kVec, int kUnroll, int kMinBlocks, bool kEight = false, bool kOne = true,
          int kSelectCols = sprnn::cuda::kStepSelectCols>
Setting setting(const char* name, const Params& p) {
  const int cols = kEight ? 8 : sprnn::cuda::step_cols(p.B);
  const auto kernel =
      sprnn::cuda::step_kernel<C, DType::kF16, kOne, kVec, kUnroll, kMinBlocks, kSelectCols>(cols);
  return {name, {kernel, sprnn::cuda::step_blocks<C>(p, cols), sprnn::cuda::step_threads<C>(), 0,
                 sprnn::cuda::StepKind::kRows}, kOne};
}

int g_sms = 0;  // the GPU's SMs (the staged kernel's grid)

// prepare_step's hook: the package raises a limit once per device (handlers.cu ensure_smem),
// the probe each time.
cudaError_t raise_smem(int, const void* kernel, long long smem) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem));
}

template <Cell C, bool kOne, int kCopyBatch, int kCopyVectors>
Setting staged(const char* name, const Params& p) {
  return {name,
          sprnn::cuda::staged_launch<C, DType::kF16, kOne, kCopyBatch, kCopyVectors>(p, g_sms),
          kOne};
}

// step_fwd_tasks with kLanes lanes per row (0: the package's, kTaskLanes).
template <Cell C, bool kOne, int kLanes = 0>
Setting tasks(const char* name, const Params& p) {
  return {name, sprnn::cuda::tasks_launch<C, DType::kF16, kOne, kLanes>(p, g_sms), kOne};
}

template <Cell C>
std::vector<Setting> settings(const Params& p) {
  constexpr int m = sprnn::cuda::kStepMinBlocks<C>;
  constexpr int v = sprnn::cuda::kStepVec, x = sprnn::cuda::kStepUnroll;
  std::vector<Setting> all = {
      setting<C, 1, 4, m, true>("8 columns, vec 1 x4, 5 (session 82)", p),
      setting<C, 1, 4, m>("vec 1 x4, min blocks 5", p),
      setting<C, 4, 1, m>("vec 4 x1, 5 (step_fwd)", p),
      setting<C, 4, 2, m>("vec 4 x2, 5", p),
      setting<C, 8, 1, m>("vec 8 x1, 5", p),
      staged<C, true, 1, 0>("staged, copy batch 1", p),
      staged<C, true, 8, 0>("staged, copy batch 8 (session 87)", p),
      staged<C, true, 8, 4>("staged, vector copy 4", p),
      staged<C, true, 8, 8>("staged, vector copy 8", p),
      setting<C, v, x, m, false, false>("loop step, step_fwd", p),
      setting<C, v, x, m, false, false, 0>("loop step, predicated (session 84)", p),
      staged<C, false, 8, 0>("loop step, staged, copy batch 8", p),
      staged<C, false, 8, 4>("loop step, staged, vector copy 4", p),
      staged<C, false, 8, 8>("loop step, staged, vector copy 8", p),
      tasks<C, true>("tasks", p),
      tasks<C, false>("loop step, tasks", p)};
  if constexpr (sprnn::gates_of(C) == 1) {  // the RNN's other lanes per row (kTaskLanes)
    all.push_back(tasks<C, true, 32>("tasks, 32 lanes", p));
    all.push_back(tasks<C, false, 32>("loop step, tasks, 32 lanes", p));
  }
  return all;
}

uint16_t f16(float f) { return __half_as_ushort(__float2half(f)); }
float from_f16(uint16_t b) { return __half2float(__ushort_as_half(b)); }

template <typename V>
V* upload(const std::vector<V>& host) {
  V* dev = nullptr;
  CHECK(cudaMalloc(&dev, std::max<size_t>(1, host.size()) * sizeof(V)));
  CHECK(cudaMemcpy(dev, host.data(), host.size() * sizeof(V), cudaMemcpyHostToDevice));
  return dev;
}

int g_launches = 200, g_only = -1;  // launches per round; the one setting to run (-1: all)

template <Cell C>
void run(const char* label, int H, int B, double density, std::mt19937& rng) {
  constexpr int G = sprnn::gates_of(C);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::bernoulli_distribution keep(density);
  std::vector<int32_t> row_ptr{0}, cols;
  std::vector<uint16_t> vals;
  for (long long r = 0; r < static_cast<long long>(G) * H; ++r) {
    for (int c = 0; c < H; ++c) {
      if (keep(rng)) {
        cols.push_back(c);
        vals.push_back(f16(uni(rng) / std::sqrt(density * H)));
      }
    }
    row_ptr.push_back(static_cast<int32_t>(cols.size()));
  }
  auto randoms = [&](size_t n) {
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = f16(uni(rng));
    return v;
  };
  const size_t bh = static_cast<size_t>(B) * H;
  Params p{};
  p.xp = upload(randoms(bh * G));
  p.lengths = upload(std::vector<int32_t>(B, 1));
  p.values = upload(vals);
  p.col_idx = upload(cols);
  p.row_ptr = upload(row_ptr);
  const std::vector<uint16_t> h0 = randoms(bh), c0 = randoms(bh);
  p.h0 = upload(h0);
  p.c0 = upload(c0);
  // The loop step's workspace (launch.cuh run_steps): h twice (read one, write the other), then
  // c, from h0 and c0. Its launches update c in place, so it is reset before the checked launch.
  std::vector<float> workspace(3 * bh);
  std::transform(h0.begin(), h0.end(), workspace.begin(), from_f16);
  std::transform(c0.begin(), c0.end(), workspace.begin() + 2 * bh, from_f16);
  float* hbuf = upload(workspace);
  float* cbuf = hbuf + 2 * bh;
  p.b_hn = upload(randoms(H));
  for (void** out : {&p.ys, &p.hT, &p.cT, &p.cs}) {
    CHECK(cudaMalloc(out, bh * 2));
    CHECK(cudaMemset(*out, 0, bh * 2));
  }
  p.T = 1;
  p.B = B;
  p.H = H;
  p.activation = 1;
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> first;
  const std::vector<Setting> all = settings<C>(p);
  for (int si = 0; si < static_cast<int>(all.size()); ++si) {
    if (g_only >= 0 && si != g_only) continue;
    const Setting& st = all[si];
    const int kLaunches = g_launches;
    const StepLaunch& l = st.launch;
    sprnn::cuda::StepConfig cfg;
    cfg.raise_smem = &raise_smem;
    CHECK(sprnn::cuda::prepare_step(l, cfg));
    const auto blocks = static_cast<unsigned>(l.blocks);
    float* h_ws = st.one_step ? nullptr : hbuf;
    float* c_ws = st.one_step ? nullptr : cbuf;
    std::vector<float> rounds;
    for (int round = 0; round < 6; ++round) {  // round 0 warms up
      CHECK(cudaEventRecord(e0));
      for (int i = 0; i < kLaunches; ++i) l.kernel<<<blocks, l.threads, l.smem>>>(p, 0, h_ws, c_ws);
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (round > 0) rounds.push_back(1e3f * ms / kLaunches);
    }
    std::sort(rounds.begin(), rounds.end());
    CHECK(cudaMemcpy(hbuf, workspace.data(), workspace.size() * 4, cudaMemcpyHostToDevice));
    l.kernel<<<blocks, l.threads, l.smem>>>(p, 0, h_ws, c_ws);
    CHECK(cudaGetLastError());
    std::vector<uint16_t> out(2 * bh);  // ys and cs: both kinds of step write them
    CHECK(cudaMemcpy(out.data(), p.ys, bh * 2, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(out.data() + bh, p.cs, bh * 2, cudaMemcpyDeviceToHost));
    std::vector<float> got(out.size());
    std::transform(out.begin(), out.end(), got.begin(), from_f16);
    if (first.empty()) first = got;
    float diff = 0;
    for (size_t i = 0; i < got.size(); ++i) diff = std::max(diff, std::abs(got[i] - first[i]));
    std::printf("%-10s H=%-5d B=%d %-36s %8.2f us   max |diff| %.1e\n", label, H, B, st.name,
                rounds[rounds.size() / 2], diff);
  }
  for (const void* q : std::initializer_list<const void*>{
           p.xp, p.lengths, p.values, p.col_idx, p.row_ptr, p.h0, p.c0, p.b_hn, p.ys, p.hT, p.cT,
           p.cs, hbuf})
    CHECK(cudaFree(const_cast<void*>(q)));
}

int main(int argc, char** argv) {
  std::mt19937 rng(0);
  CHECK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
  auto run_cell = [&rng](const std::string& cell, int H, int B) {
    if (cell == "lstm") run<Cell::kLstm>("lstm 10%", H, B, 0.1, rng);
    else if (cell == "gru") run<Cell::kGru>("gru 10%", H, B, 0.1, rng);
    else if (cell == "relu") run<Cell::kRnnTanh>("relu 10%", H, B, 0.1, rng);
    else {
      std::fprintf(stderr, "unknown cell '%s' (lstm, gru or relu)\n", cell.c_str());
      std::exit(2);
    }
  };
  if (argc == 6) {
    g_launches = std::atoi(argv[4]);
    g_only = std::atoi(argv[5]);
    run_cell(argv[1], std::atoi(argv[2]), std::atoi(argv[3]));
    return 0;
  }
  if (argc > 1) {
    for (int i = 1; i < argc; ++i) {
      char cell[16];
      int H = 0, B = 0;
      if (std::sscanf(argv[i], "%15[a-z]:%d:%d", cell, &H, &B) != 3 || H < 1 || B < 1) {
        std::fprintf(stderr, "'%s': expected CELL:H:B, e.g. lstm:1536:4\n", argv[i]);
        return 2;
      }
      run_cell(cell, H, B);
    }
    return 0;
  }
  for (int B : {4, 1, 8}) {
    run<Cell::kLstm>("lstm 10%", 1024, B, 0.1, rng);
    run<Cell::kLstm>("lstm 10%", 2048, B, 0.1, rng);
    run<Cell::kLstm>("lstm 10%", 3072, B, 0.1, rng);
    run<Cell::kLstm>("lstm 10%", 4096, B, 0.1, rng);
    run<Cell::kRnnTanh>("relu 10%", 1152, B, 0.1, rng);
    run<Cell::kRnnTanh>("relu 10%", 2304, B, 0.1, rng);
    run<Cell::kRnnTanh>("relu 10%", 2880, B, 0.1, rng);
    run<Cell::kRnnTanh>("relu 10%", 4224, B, 0.1, rng);
    run<Cell::kRnnTanh>("relu 10%", 5760, B, 0.1, rng);
    run<Cell::kGru>("gru 10%", 2048, B, 0.1, rng);
    run<Cell::kGru>("gru 10%", 4096, B, 0.1, rng);
  }
  return 0;
}
