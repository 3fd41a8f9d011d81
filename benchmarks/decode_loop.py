"""Step-at-a-time use on the GPU: a jitted `lax.fori_loop` of N one-step calls (T = 1), the way
a model samples one token after another, against the same loop over a dense step, and against
one call over all N steps. us per step, medians of interleaved rounds.

    python benchmarks/decode_loop.py [--steps 256] [--batch 4] [--rounds 5] [--out DIR]

Ours runs in five forms: the default (since session 81 a one-step call is one launch of the
per-step kernel, with no sync; since session 82 through a target XLA may record in a command
buffer, which it does for the whole loop where XLA_FLAGS enables WHILE command buffers: run
with --label to name such settings); the persistent kernel (variant "lamport", the default
before, chosen when the call is lowered) with the per-call sync check that turns a timed-out
wait into an error and without it (SPRNN_CUDA_SYNC_CHECK=0, read at each call); the per-step
kernel as variant "step_loop" (workspace, init and final kernels, the sync check); and the
pure-JAX reference (`implementation="reference"`: a dense step from the weights' dense form).
With --device-time each row also gives, per step, the device's busy time and our kernels' time
from a profiler trace (device_time.py): what the loop's wall time spends beyond the step's work.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_gpu import dense_step, initial_carry, problem
from device_time import device_times
from knobs import knobs_set

import jax_sprnn as sp
from jax_sprnn.primitives import cuda_lowering

LAYERS = [("lstm", None, 1024, 0.1, jnp.float16), ("lstm", None, 1024, 0.1, jnp.float32),
          ("rnn", "relu", 1152, 0.1, jnp.float16), ("lstm", None, 4096, 0.1, jnp.float16),
          ("rnn", "relu", 5760, 0.1, jnp.float16)]
CHECK_OFF = {"SPRNN_CUDA_SYNC_CHECK": "0"}


def sparse_call(cell, act, w, implementation="auto"):
    def call(xp, carry):
        if cell == "lstm":
            return sp.lstm(xp, carry, w, implementation=implementation)
        ys, h = sp.rnn(xp, carry[0], w, act, implementation=implementation)
        return ys, (h,)
    return call


def step_loop(step, xp, carry0):
    """A jitted loop of one-step calls (the carry feeds the next step); returns the outputs."""
    steps = xp.shape[0]

    def body(t, state):
        carry, ys = state
        y, carry = step(jax.lax.dynamic_slice_in_dim(xp, t, 1), carry)
        return carry, ys.at[t].set(y[0])

    ys0 = jnp.zeros(xp.shape[:2] + carry0[-1].shape[-1:], carry0[-1].dtype)
    return jax.jit(lambda: jax.lax.fori_loop(0, steps, body, (carry0, ys0))[1])


def lowered_with_variant(variant, call, xp, carry0):
    """step_loop() of the call, lowered (so compiled) while SPRNN_CUDA_VARIANT names a variant."""
    with knobs_set({"SPRNN_CUDA_VARIANT": str(cuda_lowering.VARIANTS[variant])}):
        f = step_loop(call, xp, carry0)
        jax.block_until_ready(f())
    return f


def dense_one_step(cell, act, kernel):
    cell_step = dense_step(cell, act)

    def step(x, carry):
        carry = cell_step(carry, x[0], kernel)
        return carry[-1][None], carry
    return step


def seconds(f, rounds_out, knobs):
    with knobs:
        t0 = time.perf_counter()
        jax.block_until_ready(f())
        rounds_out.append(time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None,
                    help="also write the rows as JSON to DIR/decode_loop_b<batch>[_label].json")
    ap.add_argument("--layers", default=None,
                    help="comma-separated indices into LAYERS to run (default: all)")
    ap.add_argument("--label", default="",
                    help="a name for this run's settings (e.g. XLA_FLAGS), in the JSON's name")
    ap.add_argument("--device-time", action="store_true",
                    help="add the device's busy time and our kernels' time per step (a trace)")
    args = ap.parse_args()
    print(f"device: {jax.devices()[0].device_kind}; B={args.batch}, {args.steps} steps, "
          f"medians of {args.rounds} rounds, us per step; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    rows = []
    picked = (LAYERS if args.layers is None
              else [LAYERS[int(i)] for i in args.layers.split(",")])
    for cell, act, H, density, dtype in picked:
        kernel, mask, xp, h0 = problem(cell, H, args.batch, args.steps, density, dtype)
        carry = initial_carry(cell, h0)
        w = sp.SparseWeights.from_dense(kernel, mask)
        ours = step_loop(sparse_call(cell, act, w), xp, carry)
        persistent, step_kernel = (lowered_with_variant(name, sparse_call(cell, act, w), xp, carry)
                                   for name in ("lamport", "step_loop"))
        reference = step_loop(sparse_call(cell, act, w, "reference"), xp, carry)
        whole = jax.jit(lambda: sparse_call(cell, act, w)(xp, carry)[0])
        dense = step_loop(dense_one_step(cell, act, kernel), xp, carry)
        forms = {"ours, default": (ours, {}),
                 "ours, persistent, check on": (persistent, {}),
                 "ours, persistent, check off": (persistent, CHECK_OFF),
                 "ours, step_loop variant, check on": (step_kernel, {}),
                 "ours, reference (pure JAX) loop": (reference, {}),
                 "dense step loop (XLA)": (dense, {}),
                 "ours, one call of all steps": (whole, {})}
        times = {name: [] for name in forms}
        for name, (f, kn) in forms.items():  # compile and warm up
            seconds(f, [], knobs_set(kn))
        for _ in range(args.rounds):
            for name, (f, kn) in forms.items():
                seconds(f, times[name], knobs_set(kn))
        label = f"{cell} H={H} {density:.0%} {jnp.dtype(dtype).name} B={args.batch}"
        ref = np.asarray(whole(), np.float32)
        for name, (f, kn) in forms.items():
            with knobs_set(kn):
                ys = np.asarray(f(), np.float32)
            us = 1e6 * float(np.median(times[name])) / args.steps
            err = float(np.max(np.abs(ys - ref)))
            row = dict(layer=label, form=name, us_per_step=us, max_diff_vs_one_call=err)
            line = f"{label:28s} {name:34s} {us:8.2f}   max |ys - one call| {err:.1e}"
            if args.device_time:
                with knobs_set(kn):
                    dt = device_times(f, (), calls=2)
                row.update(busy_us_per_step=dt["busy"] / args.steps,
                           kernel_us_per_step=dt["kernel"] / args.steps)
                line += (f"   busy {row['busy_us_per_step']:6.2f}"
                         f"   kernel {row['kernel_us_per_step']:6.2f}")
            rows.append(row)
            print(line, flush=True)
    if args.out:
        name = f"decode_loop_b{args.batch}" + (f"_{args.label}" if args.label else "")
        with open(os.path.join(args.out, f"{name}.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
