"""CPU benchmark: the C++ sparse handler vs a pure-JAX dense lax.scan on the same inputs.

    python benchmarks/cpu_benchmark.py [--hidden 1024 --batch 4 --steps 128 --density 0.1]

Prints the median time per call and per step of each (calls alternate between the two), and
the speed-up, for rnn, lstm, gru. The cells take turns over ``--rounds`` rounds of
``--repeats`` calls each; the table gives the medians over all calls and, per cell, the
speed-ups of the rounds (min / median / max): on a shared VM whole rounds can land in a slow
phase of the host, and the spread shows it.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sprnn as sp
from jax_sprnn import reference
from jax_sprnn.primitives.recurrence import GATES


def time_calls(fns, *args, repeats: int) -> list:
    """Seconds of ``repeats`` calls of each function; calls alternate so that load drifts hit
    all of them alike."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts.append(time.perf_counter() - start)
    return times


def make_cell(cell, hidden, batch, steps, density, dtype, rng):
    """(sparse, dense, args): the jitted sparse op and dense scan of one cell, compiled."""
    gates = GATES[cell]
    mask = rng.random((hidden, gates * hidden)) < density
    scale = 1.0 / np.sqrt(max(density, 1.0 / (gates * hidden)) * hidden)  # density 0: no NaN
    kernel = (rng.standard_normal(mask.shape) * scale * mask).astype(dtype)
    xp = jnp.asarray(rng.standard_normal((steps, batch, gates * hidden)), dtype)
    carry = tuple(jnp.zeros((batch, hidden), dtype) for _ in range(2 if cell == "lstm" else 1))
    b_hn = jnp.zeros((hidden,), dtype)
    lengths = jnp.full((batch,), steps, jnp.int32)
    w = sp.SparseWeights.from_dense(kernel, mask)
    dense_kernel = jnp.asarray(kernel)

    def sparse(xp, carry):
        if cell == "lstm":
            return sp.lstm(xp, carry, w)
        if cell == "gru":
            return sp.gru(xp, carry[0], w, b_hn)
        return sp.rnn(xp, carry[0], w)

    def dense(xp, carry):
        return reference.recurrence(cell, xp, carry, dense_kernel, lengths,
                                    b_hn if cell == "gru" else None)

    sparse, dense = jax.jit(sparse), jax.jit(dense)
    for fn in (sparse, dense):
        jax.block_until_ready(fn(xp, carry))  # compile and warm up
    return sparse, dense, (xp, carry)


def relative_difference(sparse, dense, args) -> float:
    ys_s = np.asarray(sparse(*args)[0], np.float32)
    ys_d = np.asarray(dense(*args)[0], np.float32)
    return float(np.linalg.norm(ys_s - ys_d) / max(np.linalg.norm(ys_d), 1e-30))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--repeats", type=int, default=21, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cells", default="rnn,lstm,gru")
    args = parser.parse_args(argv)
    cells = args.cells.split(",")
    if min(args.hidden, args.batch, args.steps, args.repeats, args.rounds) < 1:
        parser.error("--hidden, --batch, --steps, --repeats and --rounds must be at least 1")
    if not 0.0 <= args.density <= 1.0:
        parser.error(f"--density must lie in [0, 1], got {args.density}")
    if set(cells) - set(GATES):
        parser.error(f"--cells takes a comma-separated subset of {', '.join(GATES)}, "
                     f"got {args.cells!r}")
    rng = np.random.default_rng(0)
    print(f"# jax {jax.__version__}, {platform.processor() or platform.machine()}, "
          f"{jax.device_count('cpu')} cpu device(s); H={args.hidden} B={args.batch} "
          f"T={args.steps} density={args.density} {args.dtype}, {args.rounds} rounds of "
          f"{args.repeats} alternating calls")
    print(f"{'cell':5} {'sparse C++ ms':>14} {'dense scan ms':>14} {'us/step sparse':>15} "
          f"{'us/step dense':>14} {'speed-up':>9} {'rel.diff':>9}   speed-up per round min/med/max")
    setups = {c: make_cell(c, args.hidden, args.batch, args.steps, args.density,
                           jnp.dtype(args.dtype), rng) for c in cells}
    calls = {c: ([], []) for c in cells}
    ratios = {c: [] for c in cells}
    for _ in range(args.rounds):
        for c in cells:
            sparse, dense, fargs = setups[c]
            t_s, t_d = time_calls((sparse, dense), *fargs, repeats=args.repeats)
            calls[c][0].extend(t_s)
            calls[c][1].extend(t_d)
            ratios[c].append(statistics.median(t_d) / statistics.median(t_s))
    for c in cells:
        t_s, t_d = (statistics.median(ts) for ts in calls[c])
        err = relative_difference(*setups[c])
        r = sorted(ratios[c])
        print(f"{c:5} {t_s * 1e3:14.2f} {t_d * 1e3:14.2f} {t_s / args.steps * 1e6:15.1f} "
              f"{t_d / args.steps * 1e6:14.1f} {t_d / t_s:8.2f}x {err:9.1e}   "
              f"{r[0]:.2f} / {statistics.median(r):.2f} / {r[-1]:.2f}")


if __name__ == "__main__":
    main()
