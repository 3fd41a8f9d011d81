"""Quickstart: a magnitude-pruned LSTM layer through jax_sprnn vs the dense lax.scan reference.

    python examples/quickstart.py [--hidden 512 --batch 4 --steps 128 --density 0.1]

Prints how closely the sparse op agrees with the dense computation and how long each takes.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sprnn as sp


def median_ms(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--density", type=float, default=0.1)
    args = parser.parse_args(argv)
    hidden, batch, steps = args.hidden, args.batch, args.steps
    if min(hidden, batch, steps) < 1:
        parser.error("--hidden, --batch and --steps must be at least 1")
    if not 0.0 <= args.density <= 1.0:
        parser.error(f"--density must lie in [0, 1], got {args.density}")

    key_kernel, key_x = jax.random.split(jax.random.key(0))
    # A trained LSTM's recurrent kernel (H, 4H), magnitude-pruned to the target density.
    kernel = jax.random.normal(key_kernel, (hidden, 4 * hidden)) / np.sqrt(hidden)
    threshold = jnp.quantile(jnp.abs(kernel), 1.0 - args.density)
    mask = np.asarray(jnp.abs(kernel) >= threshold)
    pruned = kernel * mask
    weights = sp.SparseWeights.from_dense(pruned, mask)
    print(f"backend: {jax.default_backend()}, {weights}")

    xp = jax.random.normal(key_x, (steps, batch, 4 * hidden))  # x_t @ W_x + b, all steps
    carry = (jnp.zeros((batch, hidden)), jnp.zeros((batch, hidden)))
    lengths = jnp.array([max(steps - 3 * i, 0) for i in range(batch)], jnp.int32)  # ragged

    sparse = jax.jit(lambda xp, c: sp.lstm(xp, c, weights, seq_lengths=lengths))
    dense = jax.jit(lambda xp, c: sp.lstm(xp, c, weights, seq_lengths=lengths,
                                          implementation="reference"))
    ys_sparse, (c_sparse, h_sparse) = sparse(xp, carry)
    ys_dense, (c_dense, h_dense) = dense(xp, carry)
    max_diff = float(jnp.max(jnp.abs(ys_sparse - ys_dense)))
    print(f"agreement: max |ys_sparse - ys_dense| = {max_diff:.2e}, "
          f"max |h_T diff| = {float(jnp.max(jnp.abs(h_sparse - h_dense))):.2e}")

    t_sparse = median_ms(sparse, xp, carry)
    t_dense = median_ms(dense, xp, carry)
    print(f"time per call (T={steps}, B={batch}, H={hidden}): sparse {t_sparse:.2f} ms, "
          f"dense lax.scan {t_dense:.2f} ms ({t_dense / t_sparse:.2f}x)")
    if max_diff > 1e-4:
        raise SystemExit("sparse and dense results disagree")


if __name__ == "__main__":
    main()
