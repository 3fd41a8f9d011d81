"""TEMPORARY (session 14): the handler's host phases and the wall time per call, with the
abort flag copied by the copy engine (memcpy) or by a one-thread kernel, sync check off for
reference. us per recurrence; medians over interleaved rounds."""
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu as bg  # noqa: E402
from jax_sprnn import _sprnn_cuda as m  # noqa: E402

SETS = [("memcpy", {"SPRNN_CUDA_FLAG_COPY": "0"}), ("kernel", {"SPRNN_CUDA_FLAG_COPY": "1"}),
        ("off", {"SPRNN_CUDA_SYNC_CHECK": "0"})]
for cell, act, H, d in bg.SMALL_LAYERS:
    for T in (1, 16, 256):
        f, xp, c0 = bg.kernel_call(cell, act, H, 4, T, d, bg.jnp.float16)
        walls = {k: [] for k, _ in SETS}
        phases = {k: [] for k, _ in SETS}
        for _ in range(3):
            for label, kn in SETS:
                with bg.knobs_set(kn):
                    walls[label].append(bg.timeit(f, xp, c0, reps=30) / bg.K * 1e6)
                    m.host_timings()
                    with bg.knobs_set({"SPRNN_CUDA_HOST_TIMING": "1"}):
                        for _ in range(10):
                            jax.block_until_ready(f(xp, c0))
                    phases[label] += m.host_timings()
        for label, _ in SETS:
            t = np.array(phases[label])
            # consecutive recurrences of one call: previous end -> this entry
            between = [t[i, 0] - t[i - 1, 5] for i in range(1, len(t)) if i % bg.K]
            print(f"{bg.config_name(cell, H, d, bg.jnp.float16)} T={T} {label}: wall/recurrence "
                  f"{' '.join(f'{w:.1f}' for w in walls[label])} (median {np.median(walls[label]):.1f}); "
                  f"host us: entry->memset {np.median(t[:, 1] - t[:, 0]):.2f}, memset "
                  f"{np.median(t[:, 2] - t[:, 1]):.2f}, launch {np.median(t[:, 3] - t[:, 2]):.2f}, "
                  f"check+sync {np.median(t[:, 5] - t[:, 3]):.2f}, prev end->entry "
                  f"{np.median(between):.2f}", flush=True)
