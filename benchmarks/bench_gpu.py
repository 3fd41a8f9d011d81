"""Times the sparse persistent kernel against dense JAX peers on the same inputs, in one run.

    python benchmarks/bench_gpu.py --out DIR [--targets] [--ablation [--ncu]] [--sweeps] [--quick]
                                   [--batch] [--tune] [--groups] [--cluster] [--deep]
                                   [--spread] [--dtype-spread] [--overhead] [--device-time]
                                   [--reg] [--threads] [--on-chip] [--wait]

--ablation: the paper's variants (a)-(d) of the kernel side by side with the dense peers; with
--ncu also each variant's shared-memory bank conflicts, wavefronts and load instructions
(Nsight Compute, benchmarks/ncu_counts.py), with --device-time their kernel time.
--cluster: variant 3 (grid-wide Lamport exchange) vs 5 (sm_90 thread block clusters) on the
target configurations, the batch sweep's B=1/16/64 and smaller clusters (SPRNN_CUDA_CLUSTER).
--spread: one plan timed 8 times in turn, with and without the per-call sync check
(SPRNN_CUDA_SYNC_CHECK), to see how far single timings of the same kernel scatter.
--dtype-spread: fp16 / bf16 / fp32 timed in interleaved rounds, wall against device span.
--overhead: the per-call cost through JAX: us per recurrence at T = 1, 16, 256, 1024 with the
sync check on / off (interleaved rounds), the per-step cost from T=256 to 1024 and the fixed
cost per recurrence, beside a trivial jitted call (the dispatch floor).
--wait: per call, the time until it returns to Python, until block_until_ready returns and
until a spinning Array.is_ready() loop sees the outputs: ours with the sync check on / off, the
best dense peer and a trivial jitted call.
--device-time: with --targets, each method's device time as well (benchmarks/device_time.py):
the span of a call's device operations and our kernel's own duration, per step.
--deep: the deep-gather build off / on (SPRNN_CUDA_DEEP_GATHER) around its threshold, float32
and float16 (the planner turns it on for 16-bit H > 4096 at 512 threads; for float32 only when
forced, since session 9).
--reg: the register-weights build off / on with 4-byte words / on with float words where they
fit (SPRNN_CUDA_REG_WEIGHTS, SPRNN_CUDA_FLOAT_WORDS), wall and kernel time, on layers whose
lanes have more or fewer than 4 nonzeros per row.
--threads: threads per block 384 / 448 / 480 / 512 (SPRNN_CUDA_THREADS), wall and kernel time,
on layers whose rows run as half warps (ReLU H=1152 at B=8, ReLU H=2304 30%, LSTM / GRU H=1024)
and two that do not.
--on-chip: layers whose nonzeros do not all fit on chip at the default batch tile (LSTM H=4096
10% fp16 B=4: tile 4 holds ~92%, the rest is read from L2 each step; LSTM H=1024 100% fp32 B=8,
the pruned-LM pipeline's unpruned layer; LSTM H=2048 30% and 100% fp32, ReLU H=4096 50% fp16,
at B=4 and one larger B; three low-density layers of large H whose h tile leaves little room
at tile 4): the default plan against forced tiles 16, 8, 4, 2 and 1
(SPRNN_CUDA_BT), the smaller of which hold more of them (a tile that does not apply to the
batch leaves the default plan).

Per-step time = median wall time of one jitted call of K back-to-back recurrences (chained
through the carry, so nothing is elided) / (K * T). Every method gets the same inputs, the same
dtype and the same K. Peers: JAX dense lax.scan, the same with unroll=8, the best dense loop
(lax.scan unroll=16 with the kernel kept in registers-friendly fp16 and f32 accumulation, or a
fully unrolled Python loop, whichever is faster), jax.experimental.rnn (cuDNN LSTM, LSTM rows).
Writes results.json, results.md and sweeps.png under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import jax_sprnn as sp  # noqa: E402
from jax_sprnn.primitives import cuda_lowering  # noqa: E402
from jax_sprnn.primitives.recurrence import GATES  # noqa: E402
from knobs import knobs_set  # noqa: E402

K = 4          # recurrences per timed call
REPS = 15
KNOB_ROUNDS = 3  # rounds of every knob set in turn (time_knobs)
# The per-call sync check on and off (the knob that turns it off): --spread and --overhead.
SYNC_CHECK_ON_OFF = [("on", {}), ("off", {"SPRNN_CUDA_SYNC_CHECK": "0"})]


def timeit(f, *args, reps=REPS, warm_s=0.3):
    jax.block_until_ready(f(*args))
    # Keep the GPU busy for warm_s first, so that the clocks have ramped up after a compile.
    # (It did not remove the ~10% spread between timings of one kernel in one run;
    # benchmarks/NOTES.md, session 5.)
    t_end = time.perf_counter() + warm_s
    while time.perf_counter() < t_end:
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def time_wait_modes(f, *args, reps=REPS):
    """Median seconds per call, three ways in interleaved rounds: until the call returns to
    Python (JAX dispatches asynchronously unless something in the call blocks the host), until
    jax.block_until_ready returns (what `timeit` and every table report), and until the outputs
    report ready while Python spins on Array.is_ready() (a waiter that never sleeps)."""
    timeit(f, *args, reps=1)  # compile and warm up
    ret, block, spin = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = f(*args)
        ret.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
        block.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        leaves = jax.tree_util.tree_leaves(f(*args))
        while not all(x.is_ready() for x in leaves):
            pass
        spin.append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in (("return", ret), ("block", block), ("spin", spin))}


def trivial_call():
    """A jitted `x + 1` on 4 x 1024 fp16 and its argument: the floor of any call's dispatch and
    completion (--overhead, --wait)."""
    return jax.jit(lambda x: x + 1), (jnp.zeros((4, 1024), jnp.float16),)


def problem(cell, H, B, T, density, dtype, seed=0):
    rng = np.random.default_rng(seed)
    G = GATES[cell]
    mask = rng.random((H, G * H)) < density
    # Nonzeros of std 1 / sqrt(nonzeros per row): a random matrix of spectral radius about 1,
    # the scale of a trained (stable) layer. At 1.5 the ReLU H=2304 30% state overflowed fp16
    # after a few hundred steps of the chained calls and the layer ran on inf (session 32).
    scale = 1.0 / np.sqrt(max(1.0, density * H))
    kernel = (rng.standard_normal((H, G * H)) * scale * mask).astype(np.float32)
    xp = rng.standard_normal((T, B, G * H)).astype(np.float32)
    h0 = (rng.standard_normal((B, H)) * 0.5).astype(np.float32)
    return (jnp.asarray(kernel, dtype), mask, jnp.asarray(xp, dtype), jnp.asarray(h0, dtype))


def initial_carry(cell, h0):
    """The recurrence's carry from h0: (h0,), or (c0 = 0, h0) for the LSTM."""
    return (h0 * 0, h0) if cell == "lstm" else (h0,)


def dense_step(cell, act):
    def step(carry, x, w):
        h = carry[-1]
        hw = jnp.dot(h, w, preferred_element_type=jnp.float32)
        a = x.astype(jnp.float32) + hw
        if cell == "rnn":
            hn = jax.nn.relu(a) if act == "relu" else jnp.tanh(a)
            return (hn.astype(h.dtype),)
        i, f, g, o = jnp.split(a, 4, axis=-1)
        c = jax.nn.sigmoid(f) * carry[0].astype(jnp.float32) + jax.nn.sigmoid(i) * jnp.tanh(g)
        hn = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (c.astype(h.dtype), hn.astype(h.dtype))
    return step


def chain(run_once, carry0):
    def f(xp, carry):
        out = None
        for _ in range(K):
            out, carry = run_once(xp, carry)
        return out, carry
    return jax.jit(f), carry0


def method_kernel(cell, act, w, xp, carry, variant=None):
    def once(xp, carry):
        if cell == "rnn":
            ys, h = sp.rnn(xp, carry[0], w, act, implementation="kernel")
            return ys, (h,)
        if cell == "gru":  # (a zero hidden-side bias of n: the same work as any other)
            ys, h = sp.gru(xp, carry[0], w, jnp.zeros(w.hidden_size, xp.dtype),
                           implementation="kernel")
            return ys, (h,)
        ys, (c, h) = sp.lstm(xp, carry, w, implementation="kernel")
        return ys, (c, h)
    f, c0 = chain(once, carry)
    with knobs_set({} if variant is None else {"SPRNN_CUDA_VARIANT": str(variant)}):
        jax.block_until_ready(f(xp, c0))  # lowers now, while the variant is set
    return f, c0


def kernel_call(cell, act, H, B, T, density, dtype, variant=None):
    """The chained kernel call on a fresh problem (for the knob sweeps): (f, xp, c0)."""
    kernel, mask, xp, h0 = problem(cell, H, B, T, density, dtype)
    carry = initial_carry(cell, h0)
    f, c0 = method_kernel(cell, act, sp.SparseWeights.from_dense(kernel, mask), xp, carry,
                          variant)
    return f, xp, c0


def layer_plan(cell, act, H, B, density, dtype, **kw):
    """The kernel's plan on this GPU for problem()'s layer (its expected nonzero count)."""
    return cuda_lowering.plan(cell, dtype, H, B, int(round(density * GATES[cell] * H * H)),
                              activation=act or "tanh", **kw)


def config_name(cell, H, density, dtype):
    return f"{'ReLU' if cell == 'rnn' else 'LSTM'} H={H} d={density:.0%} {jnp.dtype(dtype).name}"


def method_scan(cell, act, kernel, xp, carry, unroll=1):
    step = dense_step(cell, act)

    def once(xp, carry):
        def body(c, x):
            c = step(c, x, kernel)
            return c, c[-1]
        carry, ys = lax.scan(body, carry, xp, unroll=unroll)
        return ys, carry
    return chain(once, carry)


def method_cudnn_lstm(kernel, xp, carry):
    from jax.experimental import rnn  # noqa: PLC0415

    T, B, GH = xp.shape
    H = GH // 4
    dtype = xp.dtype
    weights = rnn.init_lstm_weight(jax.random.PRNGKey(0), H, H, 1, False).astype(dtype)
    x = jnp.transpose(xp[..., :H], (1, 0, 2))  # (B, T, H) input of size H
    lengths = jnp.full((B,), T, jnp.int32)

    def once(x, carry):
        c, h = carry
        y, h1, c1 = rnn.lstm(x, h[None], c[None], weights, lengths, H, H, 1, 0.0, False)
        return y, (c1[0], h1[0])
    return chain(once, carry)[0], x


PEERS = ("jax_scan", "jax_scan_unroll8", "jax_scan_unroll32", "cudnn_lstm")
DEVICE_TIME = False  # --device-time: also the profiler's device time of each method


def time_method(row, key, f, args, steps):
    """row[key] = wall us/step; with DEVICE_TIME also the device span (first operation's start
    to the last one's end, per call) and busy time (the operations' durations summed) per step,
    and for our kernel its own duration per step (benchmarks/device_time.py)."""
    row[key] = timeit(f, *args) / steps * 1e6
    if DEVICE_TIME:
        from device_time import device_times  # noqa: PLC0415

        d = device_times(f, args)
        row[key + "_span"] = d["span"] / steps
        row[key + "_busy"] = d["busy"] / steps
        if not key.startswith(PEERS):
            row[key + "_kernel"] = d["kernel"] / steps


def variant_weights(kernel, mask, variant):
    """The packed weights a kernel variant runs on: variants (a) and (b) in plain column order
    (the ablation's steps before the bank-aware order), every other one in the default order."""
    bank = {"bank_period": 0} if variant in (0, 1) else {}
    return sp.SparseWeights.from_dense(kernel, mask, **bank)


def bench_config(cell, act, H, B, T, density, dtype, peers=True, variants=(None,)):
    kernel, mask, xp, h0 = problem(cell, H, B, T, density, dtype)
    carry = initial_carry(cell, h0)
    row = dict(cell=cell, act=act, H=H, B=B, T=T, density=density, dtype=jnp.dtype(dtype).name)
    steps = K * T
    for v in variants:
        f, c0 = method_kernel(cell, act, variant_weights(kernel, mask, v), xp, carry, v)
        key = "sparse_persistent" if v is None else f"variant_{v}"
        time_method(row, key, f, (xp, c0), steps)
        if v is None:  # a timing of a layer that ran on inf or NaN says so
            row["finite"] = all(bool(jnp.isfinite(x).all())
                                for x in jax.tree_util.tree_leaves(f(xp, c0)))
    if peers:
        for key, unroll in (("jax_scan", 1), ("jax_scan_unroll8", 8), ("jax_scan_unroll32", 32)):
            f, c0 = method_scan(cell, act, kernel, xp, carry, unroll=unroll)
            time_method(row, key, f, (xp, c0), steps)
        if cell == "lstm":
            try:
                f, x = method_cudnn_lstm(kernel, xp, carry)
                time_method(row, "cudnn_lstm", f, (x, carry), steps)
            except Exception as err:  # noqa: BLE001
                row["cudnn_lstm_error"] = str(err).splitlines()[0][:200]
        row["best_peer"] = min(row[k] for k in PEERS if k in row)
        if DEVICE_TIME:
            row["best_peer_span"] = min(row[k + "_span"] for k in PEERS if k in row)
    print(json.dumps(row), flush=True)
    return row


TARGETS = [  # (cell, act, H, density, dtype, target us/step or None)
    ("rnn", "relu", 1152, 0.1, jnp.float16, 1.6),
    ("rnn", "relu", 2304, 0.3, jnp.float16, 2.0),
    ("rnn", "relu", 5760, 0.1, jnp.float16, 4.0),
    ("lstm", None, 1024, 0.1, jnp.float16, 2.0),
    ("lstm", None, 4096, 0.1, jnp.float16, None),
    ("rnn", "relu", 1152, 0.1, jnp.float32, None),
    ("rnn", "relu", 1152, 0.1, jnp.bfloat16, None),
    ("lstm", None, 1024, 0.1, jnp.float32, None),
    ("lstm", None, 1024, 0.1, jnp.bfloat16, None),
]
# (cell, activation, H, density) of the fp16 targets (--tune), and the two small ones with a
# latency target that --spread and --overhead time (ReLU H=1152, LSTM H=1024).
FP16_LAYERS = [(c, a, H, d) for c, a, H, d, dt, _ in TARGETS if dt == jnp.float16]
SMALL_LAYERS = [FP16_LAYERS[0], FP16_LAYERS[3]]


def fmt(x):
    return "—" if x is None else f"{x:.2f}"


def time_knobs(f, xp, c0, knobs, row, T):
    """us/step of f under each set of run-time knobs, into row[json of the knobs]: the median of
    KNOB_ROUNDS rounds that each time every set in turn, so that the order does not favour a set
    (timed one after another once each, two identical plans differed by 4%: NOTES.md, session 49)."""
    keys = [json.dumps(kn) for kn in knobs]
    times = {key: [] for key in keys}
    for _ in range(KNOB_ROUNDS):
        for kn, key in zip(knobs, keys):
            with knobs_set(kn):
                times[key].append(timeit(f, xp, c0) / (K * T) * 1e6)
    row.update({key: float(np.median(ts)) for key, ts in times.items()})


def knob_table(res, lines, save, key, title, settings, configs, plan_of, T):
    """A table of wall / kernel us/step, one row per config (cell, act, H, B, density, dtype),
    one column per named set of run-time knobs; `plan` = plan_of(the default plan)."""
    lines += ["", title, "", "| layer | B | plan | " + " | ".join(settings) + " |",
              "|---|---|---|" + "---|" * len(settings)]
    for cell, act, H, B, d, dt in configs:
        f, xp, c0 = kernel_call(cell, act, H, B, T, d, dt)
        info = layer_plan(cell, act, H, B, d, dt)
        row = dict(cell=cell, H=H, B=B, density=d, dtype=jnp.dtype(dt).name, sweep=key,
                   plan=plan_of(info))
        for name, knobs in settings.items():
            with knobs_set(knobs):
                time_method(row, f"{key}_{name}", f, (xp, c0), K * T)
        print(json.dumps(row), flush=True)
        res.setdefault(key, []).append(row)
        lines.append(f"| {cell} H={H} d={d:.0%} {row['dtype']} | {B} | {row['plan']} | "
                     + " | ".join(f"{fmt(row[f'{key}_{n}'])} / {fmt(row[f'{key}_{n}_kernel'])}"
                                  for n in settings) + " |")
        save()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--targets", action="store_true")
    ap.add_argument("--ablation", action="store_true")
    ap.add_argument("--ncu", action="store_true",
                    help="--ablation: also each variant's shared-memory bank conflicts, "
                    "wavefronts and load instructions, counted by ncu (benchmarks/ncu_counts.py)")
    ap.add_argument("--sweeps", action="store_true")
    ap.add_argument("--batch", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune", action="store_true", help="time run-time knobs (env) of the kernel")
    ap.add_argument("--groups", action="store_true",
                    help="batch groups (SPRNN_CUDA_GROUPS) vs the default plan, B = 8 to 64")
    ap.add_argument("--cluster", action="store_true",
                    help="variant 3 vs 5 (sm_90 clusters) on the targets and a batch sweep")
    ap.add_argument("--spread", action="store_true",
                    help="one plan timed 8 times in turn, sync check on / off (B=4, fp16)")
    ap.add_argument("--dtype-spread", action="store_true",
                    help="fp16 / bf16 / fp32 timed in interleaved rounds, wall against the "
                    "device span (B=4): is the host's share of a call dtype-dependent?")
    ap.add_argument("--overhead", action="store_true",
                    help="fixed us per recurrence and us per step, T = 1 .. 1024 (B=4, fp16)")
    ap.add_argument("--wait", action="store_true",
                    help="how long a call takes to return to Python, to block_until_ready and "
                    "to a spinning is_ready() wait: ours (sync check on / off), the best dense "
                    "peer and a trivial call (B=4, fp16)")
    ap.add_argument("--deep", action="store_true",
                    help="the deep-gather build off / on around its threshold (B=4, ReLU 10%%)")
    ap.add_argument("--reg", action="store_true",
                    help="the register-weights build off / on / on with float words (B=4, "
                    "16-bit), wall and kernel time")
    ap.add_argument("--words", action="store_true",
                    help="column against offset words of the 16-bit tile-4 builds")
    ap.add_argument("--on-chip", action="store_true",
                    help="layers that do not fit on chip at the default tile: the default "
                    "plan vs batch tiles 16, 8, 4, 2 and 1, wall and kernel time")
    ap.add_argument("--threads", action="store_true",
                    help="threads per block 384 / 448 / 480 / 512 at the half-warp layers "
                    "(B=4 and 8), wall and kernel time")
    ap.add_argument("--cluster-knobs", action="store_true",
                    help="variant 5's run-time knobs on ReLU H=1152 and LSTM H=1024 (B=4, fp16)")
    ap.add_argument("--device-time", action="store_true",
                    help="--targets: also each method's device time from a profiler trace")
    ap.add_argument("--ncu-one", type=int, default=None,
                    help="run one call of this variant (ReLU H=1152 d=10%% fp16 B=4 T=32) for ncu")
    args = ap.parse_args()
    global DEVICE_TIME
    DEVICE_TIME = args.device_time or args.reg or args.threads or args.on_chip or args.words
    if args.ncu_one is not None:
        kernel, mask, xp, h0 = problem("rnn", 1152, 4, 32, 0.1, jnp.float16)
        w = variant_weights(kernel, mask, args.ncu_one)
        os.environ["SPRNN_CUDA_VARIANT"] = str(args.ncu_one)
        jax.block_until_ready(sp.rnn(xp, h0, w, "relu", implementation="kernel"))
        return 0
    os.makedirs(args.out, exist_ok=True)
    T = 256
    # gpu_check.sh passes the commit: the tree copied to a GPU machine may carry a stale .git.
    commit = os.environ.get("SPRNN_COMMIT")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"],
                                             text=True).strip()
        except Exception:  # noqa: BLE001
            commit = "unknown"
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                gpu=jax.devices()[0].device_kind, commit=commit, jax=jax.__version__,
                K=K, reps=REPS, T=T)
    print(json.dumps(meta), flush=True)
    res = dict(meta=meta, targets=[], ablation=[], batch=[], sweeps=[], cluster=[])
    lines = [f"# jax_sprnn GPU benchmark — {meta['date']}, {meta['gpu']}, commit {commit}",
             "", f"us/step, median of {REPS} calls of {K} chained recurrences, T={T}.", ""]

    def save():
        with open(os.path.join(args.out, "results.json"), "w") as fh:
            json.dump(res, fh, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as fh:
            fh.write("\n".join(lines) + "\n")

    if args.tune:
        lines += ["## Run-time knobs (us/step)", ""]
        knobs = [{}, {"SPRNN_CUDA_ROW_LANES": "16"}, {"SPRNN_CUDA_ROW_LANES": "32"},
                 {"SPRNN_CUDA_THREADS": "384"}, {"SPRNN_CUDA_THREADS": "512"},
                 {"SPRNN_CUDA_SPIN_NS": "50"}, {"SPRNN_CUDA_BLOCKS": "66"},
                 {"SPRNN_CUDA_BT": "2"}, {"SPRNN_CUDA_SYNC_CHECK": "0"}]
        for cell, act, H, d in FP16_LAYERS:
            f, xp, c0 = kernel_call(cell, act, H, 4, T, d, jnp.float16)
            row = dict(cell=cell, H=H, density=d)
            time_knobs(f, xp, c0, knobs, row, T)
            print(json.dumps(row), flush=True)
            res.setdefault("tune", []).append(row)
            lines.append("- " + json.dumps(row))
            save()
    if args.cluster_knobs:
        lines += ["## Variant 5 run-time knobs (B=4, fp16, us/step)", ""]
        knobs = [{}, {"SPRNN_CUDA_ROW_LANES": "4"},
                 {"SPRNN_CUDA_ROW_LANES": "16"}, {"SPRNN_CUDA_ROW_LANES": "32"},
                 {"SPRNN_CUDA_THREADS": "512"}, {"SPRNN_CUDA_THREADS": "256"},
                 {"SPRNN_CUDA_CLUSTER": "8"}]
        for cell, act, H in [("rnn", "relu", 1152), ("lstm", None, 1024)]:
            f, xp, c0 = kernel_call(cell, act, H, 4, T, 0.1, jnp.float16, variant=5)
            row = dict(cell=cell, H=H, density=0.1, variant=5)
            time_knobs(f, xp, c0, knobs, row, T)
            print(json.dumps(row), flush=True)
            res.setdefault("cluster_knobs", []).append(row)
            lines.append("- " + json.dumps(row))
            save()
    if args.targets:
        lines += ["## Targets (B=4)", "",
                  "| config | ours | target | JAX scan | scan unroll 8 | scan unroll 32 | cuDNN LSTM |"
                  " best peer | speed-up vs best |", "|---|---|---|---|---|---|---|---|---|"]
        for cell, act, H, d, dt, tgt in TARGETS:
            r = bench_config(cell, act, H, 4, T, d, dt)
            r["target"] = tgt
            res["targets"].append(r)
            name = config_name(cell, H, d, dt) + ("" if r["finite"] else " (output inf/NaN)")
            lines.append(f"| {name} | {fmt(r['sparse_persistent'])} | {fmt(tgt)} | "
                         f"{fmt(r['jax_scan'])} | {fmt(r['jax_scan_unroll8'])} | "
                         f"{fmt(r['jax_scan_unroll32'])} | {fmt(r.get('cudnn_lstm'))} | "
                         f"{fmt(r['best_peer'])} | {r['best_peer'] / r['sparse_persistent']:.2f}x |")
            save()
        if DEVICE_TIME:
            lines += ["", "### Device time of the same calls (profiler trace, us/step)", "",
                      "Span: the first device operation's start to the last one's end, per call "
                      "(gaps between operations included, host dispatch before and the wait "
                      "after excluded). Kernel: our persistent kernel's own duration.", "",
                      "| config | ours: kernel | ours: span | target | JAX scan: span | "
                      "best peer: span | speed-up (span) |", "|---|---|---|---|---|---|---|"]
            for r in res["targets"]:
                lines.append(
                    f"| {config_name(r['cell'], r['H'], r['density'], r['dtype'])} | "
                    f"{fmt(r['sparse_persistent_kernel'])} | {fmt(r['sparse_persistent_span'])} | "
                    f"{fmt(r['target'])} | {fmt(r['jax_scan_span'])} | {fmt(r['best_peer_span'])} | "
                    f"{r['best_peer_span'] / r['sparse_persistent_span']:.2f}x |")
            save()
    if args.cluster:
        lines += ["", "## Variant 3 (grid, Lamport) vs 5 (clusters), T=256, us/step", "",
                  "| config | B | knob | variant 3 | variant 5 | 5 vs 3 | target | plan of 5 |",
                  "|---|---|---|---|---|---|---|---|"]
        configs = [(c, a, H, d, dt, 4, tgt, {}) for c, a, H, d, dt, tgt in TARGETS]
        configs += [("rnn", "relu", 1152, 0.1, jnp.float16, B, None, {}) for B in (1, 16, 64)]
        configs += [("rnn", "relu", 1152, 0.1, jnp.float16, 4, 1.6, {"SPRNN_CUDA_CLUSTER": n})
                    for n in ("8", "4")]
        configs += [("lstm", None, 1024, 0.1, jnp.float16, 4, 2.0, {"SPRNN_CUDA_CLUSTER": "8"})]
        for cell, act, H, d, dt, B, tgt, kn in configs:
            with knobs_set(kn):
                pl = layer_plan(cell, act, H, B, d, dt, variant=5)
                if not pl["cluster"]:  # too large for one cluster: variant 5 would run 3
                    print(json.dumps(dict(cell=cell, H=H, density=d, B=B, skipped=pl["reason"])))
                    continue
                r = bench_config(cell, act, H, B, T, d, dt, peers=False, variants=(3, 5))
            r.update(target=tgt, knob=kn, plan5={k: pl[k] for k in (
                "variant", "cluster", "batch_tile", "tiles", "blocks", "threads", "reason")})
            res["cluster"].append(r)
            how = (f"{pl['cluster']} CTAs x {pl['tiles']} tiles of {pl['batch_tile']}, "
                   f"{pl['threads']} thr")
            knob = json.dumps(kn) if kn else ""
            lines.append(f"| {config_name(cell, H, d, dt)} | {B} | {knob} | {r['variant_3']:.2f} | "
                         f"{r['variant_5']:.2f} | {r['variant_3'] / r['variant_5']:.2f}x | "
                         f"{fmt(tgt)} | {how} |")
            save()
    if args.ablation:
        from ncu_counts import shared_counts  # noqa: PLC0415

        names = {0: "(a) naive persistent + grid barrier", 1: "(b) + wide loads",
                 2: "(c) + bank-aware order", 3: "(d) + Lamport exchange"}
        lines += ["", "## Ablation (ReLU H=1152, d=10%, fp16, B=4, T=256)", ""]
        if args.ncu:
            lines += ["Shared-memory loads counted by ncu on one T=32 call (first kernel): bank "
                      "conflicts / wavefronts / load instructions.", ""]
        cols = ["us/step", "speed-up vs JAX dense scan", "vs best dense peer"]
        cols += ["kernel us/step"] if DEVICE_TIME else []
        cols += ["bank conflicts", "wavefronts", "shared loads"] if args.ncu else []
        lines += ["| variant | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        r = bench_config("rnn", "relu", 1152, 4, T, 0.1, jnp.float16, variants=(0, 1, 2, 3))
        res["ablation"].append(r)
        for v in range(4):
            t = r[f"variant_{v}"]
            cells = [f"{t:.2f}", f"{r['jax_scan'] / t:.2f}x", f"{r['best_peer'] / t:.2f}x"]
            if DEVICE_TIME:
                cells.append(fmt(r[f"variant_{v}_kernel"]))
            if args.ncu:
                counts = r[f"variant_{v}_ncu"] = shared_counts(v)
                print(json.dumps(dict(variant=v, ncu=counts)), flush=True)
                cells += ([f"{counts[k]:,}" for k in ("bank_conflicts", "wavefronts",
                                                      "shared_loads")]
                          if "error" not in counts else [counts["error"], "", ""])
            lines.append(f"| {names[v]} | " + " | ".join(cells) + " |")
        lines.append(f"| dense JAX scan | {r['jax_scan']:.2f} | 1.00x | |" + " |" * (len(cols) - 3))
        save()
    if args.batch:
        lines += ["", "## Batch sweep (ReLU H=1152, d=10%, fp16)", "",
                  "| B | ours | JAX scan | scan unroll 8 | scan unroll 32 | best peer |",
                  "|---|---|---|---|---|---|"]
        for B in ([1, 4, 8, 16, 32, 64] if args.quick else [1, 2, 4, 8, 16, 17, 32, 33, 64]):
            r = bench_config("rnn", "relu", 1152, B, T, 0.1, jnp.float16)
            res["batch"].append(r)
            lines.append(f"| {B} | {r['sparse_persistent']:.2f} | {r['jax_scan']:.2f} | "
                         f"{r['jax_scan_unroll8']:.2f} | {r['jax_scan_unroll32']:.2f} | "
                         f"{r['best_peer']:.2f} |")
            save()
        # B=64: blocks (L2 reads of h per step scale with them), the needed-column filter and
        # forced tiles (in turn, no batch groups), all read by the handler at each call. The
        # filter exists in tiles >= 16 only, so it is timed off beside plans with such tiles
        # (66 blocks: 4 groups of 16; forced tiles), not beside the default's tiles of 8.
        f, xp, c0 = kernel_call("rnn", "relu", 1152, 64, T, 0.1, jnp.float16)
        row = dict(cell="rnn", H=1152, B=64, density=0.1, sweep="b64_knobs")
        knobs = [{}, {"SPRNN_CUDA_BLOCKS": "66"}, {"SPRNN_CUDA_BLOCKS": "33"},
                 {"SPRNN_CUDA_BLOCKS": "66", "SPRNN_CUDA_COL_FILTER": "0"},
                 {"SPRNN_CUDA_BT": "32"}, {"SPRNN_CUDA_BT": "32", "SPRNN_CUDA_COL_FILTER": "0"},
                 {"SPRNN_CUDA_BT": "16"}]
        time_knobs(f, xp, c0, knobs, row, T)
        print(json.dumps(row), flush=True)
        res["batch_knobs"] = row
        info = layer_plan("rnn", "relu", 1152, 64, 0.1, jnp.float16)
        lines += ["", f"B=64 knobs (us/step, median of {KNOB_ROUNDS} rounds; {{}} = the default plan, "
                  f"{info['groups']} batch groups of {info['batch_tile']} on "
                  f"{info['blocks'] // info['groups']} blocks each):", ""]
        lines += [f"- {k}: {v:.2f}" for k, v in row.items() if k.startswith("{")]
        save()
    if args.spread:
        lines += ["", "## Spread of single timings (B=4, fp16, us/step, 8 timings in turn)", ""]
        for cell, act, H, d in SMALL_LAYERS:
            f, xp, c0 = kernel_call(cell, act, H, 4, T, d, jnp.float16)
            row = dict(cell=cell, H=H, density=d, sweep="spread", on=[], off=[])
            for _ in range(8):
                for key, kn in SYNC_CHECK_ON_OFF:
                    with knobs_set(kn):
                        row[key].append(timeit(f, xp, c0) / (K * T) * 1e6)
            print(json.dumps(row), flush=True)
            res.setdefault("spread", []).append(row)
            lines += [f"- {config_name(cell, H, d, jnp.float16)}, sync check {key}: "
                      + " ".join(f"{v:.2f}" for v in row[key]) for key in ("on", "off")]
            save()
    if args.dtype_spread:
        # The targets table times the dtypes one after another; here the rounds interleave them,
        # so that a difference in wall minus span between dtypes is not the table's order.
        from device_time import device_times  # noqa: PLC0415
        dts = (jnp.float16, jnp.bfloat16, jnp.float32)
        lines += ["", "## Wall against device span by dtype (B=4, us/step; 8 interleaved rounds "
                  "of the wall median, then the span and kernel of 4 traced calls)", "",
                  "| layer | wall (median of rounds, min-max) | span | kernel | wall - span |",
                  "|---|---|---|---|---|"]
        for cell, act, H, d in SMALL_LAYERS:
            calls = {dt: kernel_call(cell, act, H, 4, T, d, dt) for dt in dts}
            walls = {dt: [] for dt in dts}
            for _ in range(8):
                for dt in dts:
                    f, xp, c0 = calls[dt]
                    walls[dt].append(timeit(f, xp, c0) / (K * T) * 1e6)
            for dt in dts:
                f, xp, c0 = calls[dt]
                dev = device_times(f, (xp, c0))  # us per call
                span, kern = (dev[k] / (K * T) for k in ("span", "kernel"))
                w = float(np.median(walls[dt]))
                row = dict(cell=cell, H=H, density=d, dtype=jnp.dtype(dt).name,
                           sweep="dtype_spread", walls=walls[dt], span=span, kernel=kern)
                print(json.dumps(row), flush=True)
                res.setdefault("dtype_spread", []).append(row)
                lines.append(f"| {config_name(cell, H, d, dt)} | {w:.2f} "
                             f"({min(walls[dt]):.2f}-{max(walls[dt]):.2f}) | {span:.2f} | "
                             f"{kern:.2f} | {w - span:.2f} |")
            save()
    if args.overhead:
        # Interleaved rounds (clock drift hits every T alike); per_step from T=256 -> 1024, the
        # fixed cost per recurrence = T=1 minus one step (it includes the dispatch floor / K).
        lines += ["", "## Per-call cost (B=4, fp16): us per recurrence (median of rounds)", ""]
        floor_f, floor_args = trivial_call()
        floor_us = timeit(floor_f, *floor_args, reps=40) * 1e6
        lines.append(f"- a trivial jitted call (dispatch + sync floor): {floor_us:.1f} us per call, "
                     f"{floor_us / K:.1f} per recurrence")
        Ts = (1, 16, 256, 1024)
        for cell, act, H, d in SMALL_LAYERS:
            calls = {t: kernel_call(cell, act, H, 4, t, d, jnp.float16) for t in Ts}
            for key, kn in SYNC_CHECK_ON_OFF:
                rounds = {t: [] for t in Ts}
                with knobs_set(kn):
                    for _ in range(3):
                        for t in Ts:
                            rounds[t].append(timeit(*calls[t], reps=30) / K * 1e6)
                per_rec = {t: float(np.median(v)) for t, v in rounds.items()}
                per_step = (per_rec[1024] - per_rec[256]) / 768
                fixed = per_rec[1] - per_step
                row = dict(cell=cell, H=H, density=d, sweep="overhead", sync_check=key,
                           floor_us=floor_us, us_per_recurrence=per_rec, rounds=rounds,
                           us_per_step=per_step, us_fixed_per_recurrence=fixed,
                           us_per_step_at_256=per_rec[256] / 256)
                print(json.dumps(row), flush=True)
                res.setdefault("overhead", []).append(row)
                lines.append(f"- {config_name(cell, H, d, jnp.float16)}, sync check {key}: "
                             + ", ".join(f"T={t} {v:.1f}" for t, v in per_rec.items())
                             + f" us; {per_step:.3f} us/step (T=256 -> 1024) + {fixed:.1f} us "
                             f"fixed; at T=256 {per_rec[256] / 256:.3f} us/step")
                save()
    if args.wait:
        # Is the host's share of the wall time (wall minus device span) the waiter's wake-up?
        # And does the per-call sync check keep the call from returning before the GPU is done?
        lines += ["", "## Waiting for a call (B=4, fp16; us per call of K recurrences: returned "
                  "/ block_until_ready / spinning is_ready)", ""]
        calls = [("trivial jitted call", *trivial_call(), {})]
        for cell, act, H, d in SMALL_LAYERS:
            kernel, mask, xp, h0 = problem(cell, H, 4, T, d, jnp.float16)
            carry = initial_carry(cell, h0)
            name = config_name(cell, H, d, jnp.float16)
            f, c0 = method_kernel(cell, act, sp.SparseWeights.from_dense(kernel, mask), xp, carry)
            calls += [(f"{name}, ours, sync check {key}", f, (xp, c0), kn)
                      for key, kn in SYNC_CHECK_ON_OFF]
            f, c0 = method_scan(cell, act, kernel, xp, carry, unroll=32)
            calls.append((f"{name}, scan unroll 32", f, (xp, c0), {}))
        for name, f, a, kn in calls:
            with knobs_set(kn):
                us = {k: v * 1e6 for k, v in time_wait_modes(f, *a, reps=40).items()}
            row = dict(sweep="wait", call=name, **us)
            print(json.dumps(row), flush=True)
            res.setdefault("wait", []).append(row)
            lines.append(f"- {name}: {us['return']:.1f} / {us['block']:.1f} / {us['spin']:.1f}")
            save()
    if args.deep:
        lines += ["", "## Deep gather off / on (B=4, ReLU d=10%, us/step; {} = default plan)", ""]
        for dt, Hs in [(jnp.float32, [1536, 2048, 2304, 3072, 4608]),
                       (jnp.float16, [4096, 4608])]:
            for H in Hs:
                f, xp, c0 = kernel_call("rnn", "relu", H, 4, T, 0.1, dt)
                row = dict(cell="rnn", H=H, density=0.1, dtype=jnp.dtype(dt).name, sweep="deep",
                           plan_deep=layer_plan("rnn", "relu", H, 4, 0.1, dt)["deep_gather"])
                knobs = [{}, {"SPRNN_CUDA_DEEP_GATHER": "0"}, {"SPRNN_CUDA_DEEP_GATHER": "1"}]
                time_knobs(f, xp, c0, knobs, row, T)
                print(json.dumps(row), flush=True)
                res.setdefault("deep", []).append(row)
                lines.append("- " + json.dumps(row))
                save()
    if args.reg:
        knob_table(res, lines, save, "reg",
                   "## Register weights off / on / on with float words where they fit (B=4; "
                   "us/step wall, then kernel only; `plan` = the default's choice)",
                   {"off": {"SPRNN_CUDA_REG_WEIGHTS": "0"},
                    "on": {"SPRNN_CUDA_REG_WEIGHTS": "1", "SPRNN_CUDA_FLOAT_WORDS": "0"},
                    "float": {"SPRNN_CUDA_REG_WEIGHTS": "1"}},
                   [("rnn", "relu", 1152, 4, 0.1, jnp.float16),
                    ("rnn", "relu", 1024, 4, 0.1, jnp.float16),
                    ("rnn", "relu", 2304, 4, 0.3, jnp.float16),
                    ("lstm", None, 1024, 4, 0.1, jnp.float16),
                    ("lstm", None, 1024, 4, 0.1, jnp.bfloat16),
                    ("gru", None, 1024, 4, 0.1, jnp.float16),
                    ("lstm", None, 4096, 4, 0.1, jnp.float16)],
                   lambda info: (("float" if info["float_words"] else "on")
                                 if info["reg_weights"] else "off"), T)
    if args.words:
        knob_table(res, lines, save, "words",
                   "## Column / offset words of the 16-bit tile-4 builds (B=4; us/step wall, then "
                   "kernel only; `plan` = the default's choice)",
                   {"column": {"SPRNN_CUDA_OFFSET_WORDS": "0"}, "offset": {}},
                   [("rnn", "relu", 5760, 4, 0.1, jnp.float16),
                    ("rnn", "relu", 5760, 4, 0.1, jnp.bfloat16),
                    ("rnn", "tanh", 5760, 4, 0.1, jnp.float16),
                    ("lstm", None, 4096, 4, 0.1, jnp.float16),
                    ("gru", None, 2048, 4, 0.1, jnp.float16),
                    ("rnn", "relu", 1024, 4, 0.1, jnp.float16)],
                   lambda info: "offset" if info["offset_words"] else "column", T)
    if args.on_chip:
        knob_table(res, lines, save, "on_chip",
                   "## Layers that do not fit on chip at the default tile (us/step wall, then "
                   "kernel only; the plan streams the nonzeros that do not fit from L2, "
                   "SPRNN_CUDA_BT=n runs B / n tiles in turn, each holding more of them)",
                   {"default": {}, **{f"tile {n}": {"SPRNN_CUDA_BT": str(n)} for n in (16, 8, 4, 2, 1)}},
                   [("lstm", None, 4096, 4, 0.1, jnp.float16),
                    ("lstm", None, 1024, 8, 1.0, jnp.float32),
                    ("lstm", None, 2048, 4, 0.3, jnp.float32),
                    ("lstm", None, 2048, 8, 0.3, jnp.float32),
                    ("lstm", None, 2048, 4, 1.0, jnp.float32),
                    ("rnn", "relu", 4096, 4, 0.5, jnp.float16),
                    ("rnn", "relu", 4096, 16, 0.5, jnp.float16),
                    # low density, large H: the h tile leaves little room at tile 4, while
                    # tile 2 holds the whole layer
                    ("rnn", "relu", 20000, 4, 0.01, jnp.float16),
                    ("rnn", "relu", 12000, 4, 0.01, jnp.float32),
                    ("rnn", "relu", 7000, 4, 0.05, jnp.float32)],
                   lambda info: (f"tile {info['batch_tile']}, "
                                 f"{min(1.0, info['nnz_per_block_capacity'] / info['nnz_per_block_needed']):.0%}"
                                 " of a block's nonzeros on chip"), T)
    if args.threads:
        knob_table(res, lines, save, "threads",
                   "## Threads per block (SPRNN_CUDA_THREADS; us/step wall, then kernel only; "
                   "`plan` = the default's threads, and blocks per batch group)",
                   {n: {"SPRNN_CUDA_THREADS": n} for n in ("384", "448", "480", "512")},
                   [("rnn", "relu", 1152, B, 0.1, jnp.float16) for B in (4, 8)]
                   + [("rnn", "relu", 2304, 4, 0.3, jnp.float16)]
                   + [("lstm", None, 1024, B, 0.1, jnp.float16) for B in (4, 8)]
                   + [("gru", None, 1024, 4, 0.1, dt) for dt in (jnp.float16, jnp.bfloat16)]
                   + [("gru", None, 1024, 8, 0.1, jnp.float16)],
                   lambda info: f"{info['threads']} thr, {info['blocks'] // info['groups']} blocks", T)
    if args.groups:
        # Batch groups (SPRNN_CUDA_GROUPS=n: n tiles of about B / n run at once, each on its own
        # blocks) against the default plan, per layer and batch.
        lines += ["", "## Batch groups (us/step; {} = default plan)", ""]
        for cell, act, H, d in [("rnn", "relu", 1152, 0.1), ("lstm", None, 1024, 0.1),
                                ("rnn", "relu", 2304, 0.3)]:
            for B in [8, 16, 32, 64]:
                f, xp, c0 = kernel_call(cell, act, H, B, T, d, jnp.float16)
                row = dict(cell=cell, H=H, B=B, density=d, sweep="groups")
                knobs = [{}] + [{"SPRNN_CUDA_GROUPS": str(n)} for n in (2, 4, 8, 16) if n <= B]
                time_knobs(f, xp, c0, knobs, row, T)
                print(json.dumps(row), flush=True)
                res.setdefault("groups", []).append(row)
                lines.append("- " + json.dumps(row))
                save()
    if args.sweeps:
        for d in [0.01, 0.05, 0.1, 0.3, 0.5]:
            r = bench_config("rnn", "relu", 1152, 4, T, d, jnp.float16)
            r["sweep"] = "density"
            res["sweeps"].append(r)
            save()
        for H in [256, 1152, 2304, 5760]:
            r = bench_config("rnn", "relu", H, 4, T, 0.1, jnp.float16)
            r["sweep"] = "hidden"
            res["sweeps"].append(r)
            save()
        plot(res, args.out)
    save()
    print("\n".join(lines))


def plot(res, out):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    sweeps = res.get("sweeps", [])
    panels = [("density", "density", [r for r in sweeps if r.get("sweep") == "density"]),
              ("hidden", "H", [r for r in sweeps if r.get("sweep") == "hidden"]),
              ("batch", "B", res.get("batch", []))]
    panels = [pn for pn in panels if pn[2]]  # only the sweeps this run measured
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    axes = axes[0]
    for ax, (name, key, rows) in zip(axes, panels):
        xs = [r[key] for r in rows]
        for m, label in [("sparse_persistent", "sparse persistent (ours)"),
                         ("jax_scan", "JAX dense scan"), ("jax_scan_unroll8", "scan unroll 8"),
                         ("best_peer", "best dense peer")]:
            ax.plot(xs, [r[m] for r in rows], marker="o", label=label)
        ax.set_xlabel(key)
        ax.set_ylabel("us / step")
        ax.set_title(f"ReLU fp16, sweep over {name}")
        if name != "density":
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "sweeps.png"), dpi=120)


if __name__ == "__main__":
    sys.exit(main())
