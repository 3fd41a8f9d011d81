# One-off: wall us/step of the chained kernel call (bench_gpu.kernel_call) for a few layers, with
# whichever jax_sprnn is first on PYTHONPATH.
import sys
import jax.numpy as jnp
import jax_sprnn
from bench_gpu import K, kernel_call, timeit

T = 256
tag = sys.argv[1]
for cell, H, B, d, dt in [("lstm", 1024, 8, 0.05, jnp.float32), ("lstm", 1024, 8, 0.10, jnp.float32),
                          ("lstm", 1024, 8, 1.0, jnp.float32), ("lstm", 1024, 4, 0.10, jnp.float16),
                          ("rnn", 2304, 4, 0.30, jnp.float16), ("lstm", 1024, 4, 0.10, jnp.float32)]:
    f, xp, c0 = kernel_call(cell, "relu" if cell == "rnn" else "tanh", H, B, T, d, dt)
    us = timeit(f, xp, c0) / (K * T) * 1e6
    print(f"{tag} {cell} H={H} B={B} d={d} {jnp.dtype(dt).name}: {us:.3f} us/step", flush=True)
