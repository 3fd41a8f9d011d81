"""The largest layer the CUDA kernel holds wholly on chip, per cell, dtype and density (B=4).

    python benchmarks/capacity.py [--out FILE.json]

Asks the kernel's planner (`cuda_lowering.plan`, host code: needs the CUDA extension built,
not a GPU) about a hypothetical H200 (132 SMs, 232,448 bytes of shared memory per block) and
finds, by bisection over H, the largest H whose nonzeros all fit in shared memory:
- at batch tile 4, the default plan's tile for B=4 (beyond this H the default reads the rest
  from L2 each step, except that float32 layers which tile 2 holds wholly, and which keep
  less than 7/8 of their nonzeros on chip at tile 4, run tile 2: see make_grid_plan);
- with the batch tile that holds the most (SPRNN_CUDA_BT = 1, 2 or 4; the smaller tiles run
  in turn, one exchange round each per step, so they are slower).
Prints a markdown table "tile 4 / any tile" per density; bfloat16 plans as float16.
"""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
from knobs import knobs_set

from jax_sprnn.primitives import cuda_lowering
from jax_sprnn.primitives.recurrence import GATES

DENSITIES = (0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)
H200 = dict(sms=132, smem_optin=232448, cc_major=9)


def on_chip(cell, dtype, H, density):
    nnz = int(round(density * GATES[cell] * H * H))
    p = cuda_lowering.plan(cell, dtype, H, 4, nnz, **H200)
    return p["persistent"] and p["on_chip"]


def largest(cell, dtype, density, tile):
    """The largest H held wholly on chip at a forced batch tile (the bisection assumes that a
    layer that fits at H fits at every smaller H, as it does at one tile)."""
    with knobs_set({"SPRNN_CUDA_BT": str(tile)}):
        lo, hi = 1, 65535
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if on_chip(cell, dtype, mid, density) else (lo, mid - 1)
        return lo


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="also write the table as JSON here")
    args = ap.parse_args()
    rows = {}
    print("| cell / dtype | " + " | ".join(f"{d:.0%}" for d in DENSITIES) + " |")
    print("|---|" + "---|" * len(DENSITIES))
    for cell in GATES:
        for name, dtype in (("fp16, bf16", jnp.float16), ("fp32", jnp.float32)):
            row = []
            for d in DENSITIES:
                by_tile = {t: largest(cell, dtype, d, t) for t in (1, 2, 4)}
                row.append(dict(density=d, tile_4=by_tile[4], by_tile=by_tile,
                                any_tile=max(by_tile.values())))
            rows[f"{cell} {name}"] = row
            print(f"| {cell} {name} | "
                  + " | ".join(f"{r['tile_4']} / {r['any_tile']}" for r in row) + " |", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
