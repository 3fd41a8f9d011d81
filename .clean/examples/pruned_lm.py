"""The pruned-LSTM pipeline in one command: train -> prune gradually -> evaluate.

    python examples/pruned_lm.py                  # default CPU config, < 10 minutes on 2 cores
    python examples/pruned_lm.py --config gpu     # larger model, for a GPU
    python examples/pruned_lm.py --config tiny    # seconds (what the tests run)

Trains a character-level LSTM language model on the Python standard library's own sources,
prunes its recurrent weights to each density (100%, 30%, 10%, 5%) with Zhu & Gupta's gradual
schedule, saves Orbax checkpoints, then evaluates every checkpoint with the dense Flax model and
with jax_sprnn's sparse layer, checks they agree and writes a bits-per-character / speed table
(``<workdir>/results.md``) and plot (``<workdir>/pruned_lm.png``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import charlm  # noqa: E402
import eval_pruned_lm  # noqa: E402
import train_prune_lm  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="cpu", choices=sorted(charlm.CONFIGS))
    parser.add_argument("--workdir", default="runs/pruned_lm",
                        help="checkpoints, results.md/json and pruned_lm.png go here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-training", action="store_true",
                        help="evaluate existing checkpoints in --workdir")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    cfg = charlm.CONFIGS[args.config]
    start = time.perf_counter()
    if not args.skip_training:
        train_prune_lm.run(cfg, args.workdir, args.seed, args.quiet)
    rows = eval_pruned_lm.run(cfg, args.workdir, args.quiet)
    print(f"[pruned_lm] total {time.perf_counter() - start:.0f} s")
    return rows


if __name__ == "__main__":
    main()
