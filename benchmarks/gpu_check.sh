#!/usr/bin/env bash
# One GPU run: build, then the GPU kernel tests (verify), the benchmark (its ablation with ncu's
# bank-conflict counts: bench_gpu.py --ablation --ncu) or
# the pruned-LM pipeline's GPU configuration. Everything goes under $OUT (default
# benchmarks/results/run). Each mode fits one 10-minute device call; `all` does not. Usage:
#   benchmarks/gpu_check.sh [build|bench|lm|quick|batch|cluster|profile|verify|timing|probe|
#                            probe-profile|exchange|l1-gather|cluster-reg|mma-clock|diag-mma|
#                            func-attr|step-kernel|step-profile|multi-gpu|trace|decode|
#                            cpu-suite|all]
#                                                                       (default all)
# build: the package only (then run what you need, e.g. pytest on chosen test files).
# all: the whole benchmark (targets, ablation with ncu, batch, sweeps; no tests).
# bench: a smoke subset of the GPU tests, then the same benchmark.
# batch: the batch sweep, then the large-batch-tile kernel tests.
# profile: ncu --set full of one call of variants 3 and 5 (details + per-SASS-line stalls).
# verify: the GPU kernel tests and the command-buffer test (TEST_WORKERS=14 pytest-xdist
#   workers), then bench_gpu.py
#   $BENCH_ARGS (--targets; none = tests only). Exits non-zero when a test fails or the tests are
#   cut by TEST_TIMEOUT (default 470 s). The whole file needs ~660 s (session 93: halves of 351
#   and 304 s), more than a 600-s call leaves after the build (90-140 s): TEST_SHARD=1/2, then
#   2/2 in a second call (on a warm machine: the build is kept).
# timing: bench_gpu.py $BENCH_ARGS only, e.g. BENCH_ARGS="--targets --tune --quick", cut after
#   BENCH_TIMEOUT (default 400) s; a benchmark cut by its limit ends its log with "CUT by".
# decode: benchmarks/decode_loop.py at B=4 and B=1 (DECODE_BATCHES; one-step calls in a jitted
#   loop, as a model samples, against a dense step loop), then at B=4 with XLA's command
#   buffers on for loops (COMMAND_BUFFER_FLAGS). DECODE_ARGS: more arguments for each run, e.g.
#   "--layers 0,3 --device-time".
# trace: benchmarks/trace_calls.py $TRACE_ARGS (the GPU timeline of chained calls: memset,
#   kernel, gaps) for the two small target layers.
# probe-profile: ncu --set full + per-SASS-line stalls of the step probe for PROBE_CONFIGS
#   (PROBE_FLAGS: extra nvcc flags of that build, comma-separated).
# step-profile: the same for benchmarks/step_kernel_probe.cu, STEP_PROFILE_CONFIGS of
#   cell:H:B:setting (the setting's index in the probe's list; its 4th launch is profiled).
# exchange: benchmarks/exchange_probe.cu (ping-pong and all-to-all latency through L2).
# probe: benchmarks/step_probe.cu (no JAX, no package build): us/step and the per-phase split of
#   a step for the configurations in PROBE_CONFIGS (see the file's header).
# l1-gather: benchmarks/l1_gather_probe.cu (the gather's bytes through weak loads after an L1
#   invalidation against the kernel's strong loads) for L1_GATHER_CONFIGS.
# mma-clock: benchmarks/mma_clock_probe.cu (the SM clock while each tensor-core instruction kind
#   runs; built for sm_90a, for its wgmma variant).
# diag-mma: benchmarks/diag_mma_probe.cu (the rows phase alone: CUDA-core rows against sparse rows
#   as a diagonal mma on the tensor cores, session 69; the cost of a block's last, partial pass
#   over its rows and of warps that start the rows together, session 71).
# func-attr: benchmarks/func_attr_probe.cu (whether a kernel's raised shared-memory limit holds on
#   a second GPU; needs two).
# step-kernel: benchmarks/step_kernel_probe.cu (the per-step kernel's row loads on one-step calls:
#   nonzeros per load, loads in flight, blocks per SM; loop steps; step_fwd against the staged
#   kernel, h in shared memory).
# cpu-suite: a CPU-only build (SPRNN_CUDA=OFF), then the whole test suite with
#   JAX_PLATFORMS=cpu on TEST_WORKERS workers: CI's tests on this machine's (newer) JAX.
# multi-gpu: tests/test_multi_gpu.py after the build (each GPU runs the persistent kernel; a
#   batch sharded over all of them); needs two or more GPUs, e.g. the kind nvidia-h200-x2.
# cluster-reg: benchmarks/cluster_reg_probe.cu (one cluster of 16 CTAs, nonzeros in registers)
#   for the configurations in CLUSTER_REG_CONFIGS (H:density:T:csize:lanes:mode:order).
# cluster: the sm_90 cluster variant's tests (variant 5, plans, default-path smoke), then
#   variant 3 vs 5 on the targets (bench_gpu.py --cluster). Fits one 8-minute call.
set -uo pipefail
MODE="${1:-all}"
# A mistyped mode would otherwise build and stop without a word.
case "$MODE" in
  build|bench|lm|quick|batch|cluster|profile|verify|timing|probe|probe-profile|exchange|\
  l1-gather|cluster-reg|mma-clock|diag-mma|func-attr|step-kernel|step-profile|multi-gpu|trace|\
  decode|cpu-suite|all) ;;
  *) echo "unknown mode '$MODE'; see the usage at the top of $0" >&2; exit 2 ;;
esac
OUT="${OUT:-benchmarks/results/run}"
# The tree sent to the GPU machine has no .git: take the commit from the caller if given.
export SPRNN_COMMIT="${SPRNN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# The H200 needs only sm_90; the default 5-arch build is for wheels/CI (see BUILD_NOTES.md).
export SPRNN_CUDA_ARCHS="${SPRNN_CUDA_ARCHS:-90}"
PY=python3
# XLA's default command buffer kinds plus loops and conditionals (decode mode).
COMMAND_BUFFER_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,\
WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
{
  echo "date: $(date -Iseconds)"; nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
  echo "commit: $SPRNN_COMMIT"
  # The toolchain that builds the kernels decides their SASS: record it beside the figures.
  echo "nvcc: $(nvcc --version 2>/dev/null | grep -o 'release [^,]*, V[0-9.]*' || echo none)"
  $PY -c 'import sys; print("python:", sys.version.split()[0])
try: import jax, jaxlib; print("jax:", jax.__version__, "jaxlib:", jaxlib.__version__)
except ImportError: print("jax: none")'
} | tee "$OUT/env.txt"

# The standalone probes (benchmarks/*_probe.cu) build with these flags; tests/test_probes_build.py
# builds them the same way in CI.
PROBE_NVCC=(nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc)

if [ "$MODE" = probe ]; then
  # PROBE_BUILDS: space-separated name=flags (flags joined by commas), one probe binary each.
  # The builds run side by side (one nvcc each), then the probes one at a time. The default
  # build has probe mode 0 as a constant: the package's code but for the stamps (0.05-0.09
  # us/step above the package's kernel; a runtime mode changed the gather's code and added
  # 0.12-0.39, NOTES.md session 26). Configs of modes 1-3 need a build without it ("rt=").
  PROBE_BUILDS="${PROBE_BUILDS:-base=-DSPRNN_PROBE_FIXED_MODE=0}"
  for build in $PROBE_BUILDS; do
    name="${build%%=*}"; flags="${build#*=}"
    "${PROBE_NVCC[@]}" -DSPRNN_STEP_PROBE ${flags//,/ } benchmarks/step_probe.cu \
      -o "/tmp/step_probe_$name" > "/tmp/step_probe_$name.log" 2>&1 &
  done
  wait
  # PROBE_ROUNDS: how many times the builds run in turn (interleaved A/B against clock drift).
  for round in $(seq "${PROBE_ROUNDS:-1}"); do
    for build in $PROBE_BUILDS; do
      name="${build%%=*}"; flags="${build#*=}"
      echo "== build $name: ${flags//,/ } (round $round)" | tee -a "$OUT/probe.txt"
      [ -x "/tmp/step_probe_$name" ] || { cat "/tmp/step_probe_$name.log"; exit 1; }
      timeout "${PROBE_TIMEOUT:-300}" "/tmp/step_probe_$name" ${PROBE_CONFIGS:-rnn:1152:0.1:512:132:0} 2>&1 | tee -a "$OUT/probe.txt"
    done
  done
  exit 0
fi
if [ "$MODE" = exchange ]; then  # benchmarks/exchange_probe.cu: the L2 exchange alone
  "${PROBE_NVCC[@]}" benchmarks/exchange_probe.cu -o /tmp/exchange_probe || exit 1
  for cfg in ${EXCHANGE_CONFIGS:-132:384:2000:4 132:384:2000:16 132:384:2000:20 132:384:2000:36 132:384:2000:72 132:384:2000:20:1 66:384:2000:72}; do  # blocks:threads:steps:words:flagged
    timeout 120 /tmp/exchange_probe ${cfg//:/ } 2>&1 | tee -a "$OUT/exchange.txt" | grep -v "partner block"
  done
  exit 0
fi
if [ "$MODE" = l1-gather ]; then  # benchmarks/l1_gather_probe.cu: weak loads after an L1 invalidation
  "${PROBE_NVCC[@]}" benchmarks/l1_gather_probe.cu -o /tmp/l1_gather_probe || exit 1
  # part:blocks:threads:steps:bytes_or_words:load:inval (see the probe's header)
  for cfg in ${L1_GATHER_CONFIGS:-1:132:512:2000:46080:0:0 1:132:512:2000:46080:1:1 2:132:512:2000:88:0:0 2:132:512:2000:88:1:1}; do
    timeout 60 /tmp/l1_gather_probe ${cfg//:/ } 2>&1 | tee -a "$OUT/l1_gather.txt"
  done
  exit 0
fi
if [ "$MODE" = mma-clock ] || [ "$MODE" = diag-mma ] || [ "$MODE" = func-attr ] ||
   [ "$MODE" = step-kernel ]; then
  # probes without arguments: benchmarks/mma_clock_probe.cu, diag_mma_probe.cu,
  # func_attr_probe.cu, step_kernel_probe.cu
  probe="${MODE//-/_}"
  nvcc_cmd=("${PROBE_NVCC[@]}")
  # mma-clock's wgmma variant needs the arch-specific target (the others stay on plain sm_90).
  [ "$MODE" = mma-clock ] && nvcc_cmd=("${PROBE_NVCC[@]/#-arch=sm_90/-arch=sm_90a}")
  "${nvcc_cmd[@]}" "benchmarks/${probe}_probe.cu" -o "/tmp/${probe}_probe" || exit 1
  timeout 120 "/tmp/${probe}_probe" 2>&1 | tee -a "$OUT/$probe.txt"
  exit 0
fi
if [ "$MODE" = cluster-reg ]; then  # benchmarks/cluster_reg_probe.cu
  "${PROBE_NVCC[@]}" benchmarks/cluster_reg_probe.cu -o /tmp/cluster_reg_probe || exit 1
  timeout "${PROBE_TIMEOUT:-300}" /tmp/cluster_reg_probe ${CLUSTER_REG_CONFIGS:-1152:0.1:2000:16:8:0:1 1152:0.1:2000:16:8:1:1} 2>&1 | tee -a "$OUT/cluster_reg.txt"
  exit 0
fi
# ncu --set full of one launch of kernels matching $2 in the command after them, as report $1:
# the details page, the per-SASS-line stalls (ncu_sass_top.py) and a summary line set.
profile_launch() {
  local i="$1" kernels="$2"; shift 2
  echo "== $*" | tee -a "$OUT/profile_summary.txt"
  timeout 150 ncu --clock-control none --set full --import-source yes -k "regex:$kernels" \
    --cache-control "${NCU_CACHE_CONTROL:-all}" ${NCU_SKIP:+-s $NCU_SKIP} -c 1 \
    -f -o "/tmp/probe_prof$i" "$@" > "/tmp/probe_prof$i.log" 2>&1
  ncu -i "/tmp/probe_prof$i.ncu-rep" --page details > "$OUT/details_$i.txt" 2>&1
  ncu -i "/tmp/probe_prof$i.ncu-rep" --page source --csv --print-source sass \
    > "/tmp/sass_$i.csv" 2>&1
  python3 benchmarks/ncu_sass_top.py "/tmp/sass_$i.csv" 160 > "$OUT/sass_top_$i.txt" 2>&1
  # every line, for reading the SASS around a hot spot
  gzip -c "/tmp/sass_$i.csv" > "$OUT/sass_$i.csv.gz"
  head -3 "$OUT/sass_top_$i.txt" | tee -a "$OUT/profile_summary.txt"
  grep -E "Duration|Warp Cycles Per Issued|Issue Slots Busy|L2 Hit|Mem Busy|Max Bandwidth" \
    "$OUT/details_$i.txt" | tee -a "$OUT/profile_summary.txt"
}
if [ "$MODE" = probe-profile ]; then  # ncu --set full of the probe's first launch per config
  # PROBE_FLAGS: extra nvcc flags for the profiled build (comma-separated, as in PROBE_BUILDS;
  # default: probe mode 0 as a constant, as the probe mode's default build).
  flags="${PROBE_FLAGS:--DSPRNN_PROBE_FIXED_MODE=0}"
  "${PROBE_NVCC[@]}" -lineinfo -DSPRNN_STEP_PROBE ${flags//,/ } benchmarks/step_probe.cu \
    -o /tmp/step_probe_prof || exit 1
  i=0
  for cfg in ${PROBE_CONFIGS:-rnn:1152:0.1:512:132:0}; do
    profile_launch "$i" persistent_fwd /tmp/step_probe_prof "$cfg"
    i=$((i + 1))
  done
  exit 0
fi
if [ "$MODE" = step-profile ]; then  # ncu of step_kernel_probe.cu settings (the 4th launch)
  "${PROBE_NVCC[@]}" -lineinfo benchmarks/step_kernel_probe.cu -o /tmp/step_kernel_prof || exit 1
  i=0
  for cfg in ${STEP_PROFILE_CONFIGS:-lstm:4096:8:7 lstm:4096:4:7 lstm:4096:1:2}; do
    read -r cell hidden batch setting <<< "${cfg//:/ }"
    # Caches kept as after the launches before (ncu flushes them by default): back to back,
    # a layer's nonzeros may stay in L2 (50 MB), as in a sampling loop.
    NCU_SKIP=3 NCU_CACHE_CONTROL=none profile_launch "$i" step_fwd /tmp/step_kernel_prof \
      "$cell" "$hidden" "$batch" 4 "$setting"
    i=$((i + 1))
  done
  exit 0
fi

# Runs benchmarks/$1 (further arguments after the next three) under a limit of $2 s, its output
# in $OUT/$3 and its last $4 lines here. A run cut by the limit says so: the tables it saved
# until then are partial (session 78's targets run lost its B=64 row without a word).
run_bench() {
  local script="$1" limit="$2" log="$3" lines="$4"; shift 4
  timeout "$limit" $PY "benchmarks/$script" --out "$OUT" "$@" 2>&1 | tee "$OUT/$log" \
    | tail -n "$lines"
  if [ "${PIPESTATUS[0]}" -eq 124 ]; then
    printf '\nCUT by its %s-s time limit: the tables are partial\n' "$limit" | tee -a "$OUT/$log"
  fi
}

# Runs pytest (further arguments after the first two) from /tmp, so that the installed package
# is imported, not ./jax_sprnn, with its log in $OUT/$1, cut after $2 s; then prints the
# failures and counts (also in $OUT/summary_tests.txt) and returns pytest's status.
# no:benchmark: the image's pytest-benchmark warns once per xdist worker (it does not time here).
run_tests() {
  local log="$1" limit="$2"; shift 2
  (cd /tmp && timeout "$limit" $PY -m pytest -q -p no:cacheprovider -p no:benchmark "$@" \
     > "$OUT/$log" 2>&1)
  local rc=$?
  # A run cut by the limit says so (pytest's own last line would be a row of dots).
  [ $rc -eq 124 ] && printf '\nCUT by its %s-s limit (TEST_TIMEOUT)\n' "$limit" >> "$OUT/$log"
  grep -E "^(FAILED|ERROR)|passed|failed|skipped|crashed|CUT by" "$OUT/$log" | tail -n 40 \
    | tee "$OUT/summary_tests.txt"
  return $rc
}

t0=$(date +%s)
[ "$MODE" = cpu-suite ] && export SPRNN_CUDA=OFF
$PY -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1
rc=$?; echo "build rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/env.txt"
if [ $rc -ne 0 ]; then tail -50 "$OUT/build.log"; exit $rc; fi
cd /tmp && $PY -c "import jax_sprnn._ffi as f; print(sorted(f.CUDA_TARGETS))" && cd - >/dev/null

if [ "$MODE" = verify ]; then
  # The whole GPU kernel test file on TEST_WORKERS pytest-xdist workers (the GPU image has it):
  # one log and no list of parts to keep in step with the tests. It is no faster than the fixed
  # parts it replaced (430-500 s of host time, mostly JAX compiling, session 46), so
  # TEST_SHARD=k/n (the k-th of n shards, tests/conftest.py) spreads a run over several calls.
  # Then the targets table (BENCH_ARGS=none: tests only).
  REPO="$(pwd)"
  if ! $PY -c "import xdist" 2>/dev/null; then echo "verify needs pytest-xdist"; exit 1; fi
  SPRNN_TEST_SHARD="${TEST_SHARD:-}" run_tests test_gpu.log "${TEST_TIMEOUT:-470}" \
    -n "${TEST_WORKERS:-14}" "$REPO/tests/test_gpu_kernel.py" \
    "$REPO/tests/test_gpu_command_buffers.py"
  tests_rc=$?
  if [ "${BENCH_ARGS:-}" != none ]; then
    run_bench bench_gpu.py "${BENCH_TIMEOUT:-200}" bench.log 30 ${BENCH_ARGS:---targets}
    cat "$OUT/summary_tests.txt"
  fi
  exit $tests_rc
fi
if [ "$MODE" = cpu-suite ]; then  # CI's tests on this machine's JAX, CPU only
  JAX_PLATFORMS=cpu run_tests test_cpu_suite.log "${TEST_TIMEOUT:-450}" \
    -n "${TEST_WORKERS:-14}" --dist worksteal "$(pwd)/tests"
  exit $?
fi
if [ "$MODE" = multi-gpu ]; then  # every GPU of the machine in one process (needs two or more)
  REPO="$(pwd)"
  (cd /tmp && timeout "${TEST_TIMEOUT:-400}" $PY -m pytest -q -p no:cacheprovider -p no:benchmark \
     -rs "$REPO/tests/test_multi_gpu.py" > "$OUT/test_multi_gpu.log" 2>&1)
  tests_rc=$?
  tail -n 20 "$OUT/test_multi_gpu.log"
  exit $tests_rc
fi
if [ "$MODE" = timing ]; then  # bench_gpu.py $BENCH_ARGS only (no tests)
  # 400 s: the README's figures (--targets --device-time --batch --quick) took over 300 once.
  run_bench bench_gpu.py "${BENCH_TIMEOUT:-400}" bench.log 40 ${BENCH_ARGS:---targets}
fi
if [ "$MODE" = trace ]; then  # the device timeline of chained calls (benchmarks/trace_calls.py)
  run_bench trace_calls.py "${BENCH_TIMEOUT:-300}" trace.log 40 ${TRACE_ARGS:-}
fi
if [ "$MODE" = decode ]; then  # one-step calls in a jitted loop (benchmarks/decode_loop.py)
  for b in ${DECODE_BATCHES:-4 1}; do
    run_bench decode_loop.py "${BENCH_TIMEOUT:-200}" "decode_loop_b$b.txt" 40 --batch "$b" \
      ${DECODE_ARGS:-}
  done
  # The same at B=4 with XLA's command buffers on for loops too (CUDA graphs of the whole loop;
  # tests/test_gpu_command_buffers.py): our one-step target may be recorded with the rest.
  (export XLA_FLAGS="$COMMAND_BUFFER_FLAGS"
   run_bench decode_loop.py "${BENCH_TIMEOUT:-200}" decode_loop_b4_graphs.txt 40 --batch 4 \
     --label graphs ${DECODE_ARGS:-})
fi
if [ "$MODE" = bench ]; then  # a smoke subset of the GPU tests before timing
  REPO="$(pwd)"
  (cd /tmp && timeout 200 $PY -m pytest -q -p no:cacheprovider "$REPO/tests/test_gpu_kernel.py" \
     -k "float16-3 or bidirectional or vmap or timeout" 2>&1) | tee "$OUT/test_smoke.log" | tail -3
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ] || [ "$MODE" = quick ]; then
  if [ "$MODE" = quick ]; then
    run_bench bench_gpu.py 300 bench.log 30 --tune --targets --ablation
  else
    run_bench bench_gpu.py 480 bench.log 45 --targets --ablation --ncu --batch --sweeps --quick
  fi
fi
if [ "$MODE" = batch ]; then  # the batch sweep first, then the large-tile kernel tests
  REPO="$(pwd)"
  run_bench bench_gpu.py 70 bench.log 30 --batch --quick
  (cd /tmp && timeout 100 $PY -m pytest -q -x -p no:cacheprovider "$REPO/tests/test_gpu_kernel.py" \
     -k "large_batch or forced or block_local or bidirectional" 2>&1) | tee "$OUT/test_batch.log" | tail -15
fi
if [ "$MODE" = cluster ]; then
  REPO="$(pwd)"
  (cd /tmp && timeout 240 $PY -m pytest -q -x -p no:cacheprovider "$REPO/tests/test_gpu_kernel.py" \
     -k "cluster or bidirectional or public_api or vmap or tile_plans or float16-3" 2>&1) | tee "$OUT/test_cluster.log" | tail -15
  run_bench bench_gpu.py 130 bench.log 25 --cluster
fi
if [ "$MODE" = profile ]; then  # ncu full sections + per-SASS-line stalls, variants 3 and 5
  for v in ${PROFILE_VARIANTS:-3 5}; do
    timeout 150 ncu --clock-control none --set full --import-source yes -c 1 \
      -k regex:"persistent_fwd|cluster_fwd" -f -o "$OUT/variant$v" \
      $PY benchmarks/bench_gpu.py --ncu-one $v > "$OUT/ncu_run$v.log" 2>&1
    ncu -i "$OUT/variant$v.ncu-rep" --page details > "$OUT/details_variant$v.txt" 2>&1
    ncu -i "$OUT/variant$v.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/sass_variant$v.csv" 2>&1
    $PY benchmarks/ncu_sass_top.py "$OUT/sass_variant$v.csv" 60 > "$OUT/sass_top_variant$v.txt" 2>&1
    gzip -f "$OUT/sass_variant$v.csv"; rm -f "$OUT/variant$v.ncu-rep"
    grep -E "Duration|Warp Cycles Per Issued|Issue Slots Busy|Registers Per|Achieved Occ" \
      "$OUT/details_variant$v.txt" | sed "s/^/variant $v: /"
  done
fi
if [ "$MODE" = lm ]; then
  REPO="$(pwd)"
  (cd /tmp && timeout 520 $PY "$REPO/examples/pruned_lm.py" --config gpu --workdir /tmp/pruned_lm_gpu --quiet 2>&1) | tee "$OUT/pruned_lm_gpu.log" | tail -20
  cp /tmp/pruned_lm_gpu/results.md /tmp/pruned_lm_gpu/results.json /tmp/pruned_lm_gpu/pruned_lm.png "$OUT/" 2>/dev/null
fi
