"""Trains a character-level LSTM LM on the Python standard library's sources, prunes its
recurrent kernels gradually (Zhu & Gupta's cubic schedule) to each density of the config, and
saves one Orbax checkpoint per density.

    python examples/train_prune_lm.py --config cpu --workdir runs/pruned_lm

Stages: dense pre-training, then for every density (100% included) one stage of the same
length that starts from the pre-trained model: a pruning phase (the sparsity rises from 0 along
the cubic schedule, masks updated every ``prune_every`` steps, pruned weights never regrow)
followed by fine-tuning with the mask fixed. Every checkpoint has had the same number of
training steps, so the densities compare fairly (the 100% stage just trains on).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import charlm  # noqa: E402

from jax_sprnn import pruning  # noqa: E402


def make_train_step(model, optimizer):
    @jax.jit
    def train_step(params, opt_state, masks, tokens):
        def loss_fn(p):
            logits, _ = model.apply({"params": pruning.apply_masks(p, masks)}, tokens[:, :-1])
            return charlm.nll_bits(logits, tokens[:, 1:]) / tokens[:, 1:].size

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        updates = pruning.masked_updates(updates, masks)  # pruned weights stay zero
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    return train_step


def run(cfg: charlm.Config, workdir: str, seed: int = 0, quiet: bool = False) -> dict:
    start = time.perf_counter()
    train, val = charlm.load_corpus(cfg.train_chars, cfg.val_chars)
    print(f"[train] config {cfg.name}: {train.size:,} training / {val.size:,} validation bytes "
          f"of Python stdlib sources; LSTM {cfg.layers}x{cfg.hidden}; devices {jax.devices()}")
    model = charlm.make_model(cfg)
    rng = np.random.default_rng(seed)
    params = model.init(jax.random.key(seed),
                        jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(cfg.lr))
    opt_state = optimizer.init(params)
    train_step = make_train_step(model, optimizer)
    masks = pruning.ones_like_masks(params)
    jmasks = jax.tree_util.tree_map(jnp.asarray, masks)

    def steps(n, desc, schedule=None):
        nonlocal params, opt_state, masks, jmasks
        bar = tqdm(range(n), desc=desc, disable=quiet, mininterval=1.0, leave=True)
        loss = float("nan")
        phase_start = time.perf_counter()
        for step in bar:
            if schedule is not None and schedule.should_update(step):
                target = schedule.density(step)
                if target < 1.0 - 1e-9:
                    masks = pruning.magnitude_masks(jax.device_get(params), target,
                                                    previous=masks)
                    jmasks = jax.tree_util.tree_map(jnp.asarray, masks)
                    params = pruning.apply_masks(params, jmasks)
            params, opt_state, loss_arr = train_step(
                params, opt_state, jmasks, charlm.sample_batch(rng, train, cfg.batch,
                                                               cfg.seq_len))
            if step % 25 == 0 or step == n - 1:
                loss = float(loss_arr)
                density = np.mean(list(pruning.density_report(masks).values()))
                bar.set_postfix(bpc=f"{loss:.3f}", density=f"{density:.3f}")
        print(f"[train] {desc}: {n} steps in {time.perf_counter() - phase_start:.0f} s, "
              f"train bpc {loss:.3f}", flush=True)
        return loss

    saved = []
    steps(cfg.pretrain_steps, "dense pre-training")
    pretrained = (params, opt_state)  # immutable arrays: every stage starts from these
    for density in cfg.densities:
        params, opt_state = pretrained
        masks = pruning.ones_like_masks(params)
        jmasks = jax.tree_util.tree_map(jnp.asarray, masks)
        schedule = None
        if density < 1.0:  # pruning, then fine-tuning with the mask fixed (the schedule's
            # last update lands on step prune_steps, the first fine-tuning step)
            schedule = pruning.PolynomialSchedule(
                final_sparsity=1.0 - density, initial_sparsity=0.0, begin_step=0,
                end_step=cfg.prune_steps, frequency=cfg.prune_every)
        desc = f"prune to {density:.0%}" if density < 1.0 else "dense, same steps"
        train_bpc = steps(cfg.prune_steps + cfg.finetune_steps, desc, schedule=schedule)
        saved.append(_save(workdir, density, params, masks, train_bpc))
    summary = {"config": cfg.name, "checkpoints": saved,
               "train_seconds": round(time.perf_counter() - start, 1)}
    charlm.write_json(Path(workdir) / "train_summary.json", summary)
    print(f"[train] done in {summary['train_seconds']} s; checkpoints in "
          f"{Path(workdir).resolve() / 'checkpoints'}")
    return summary


def _save(workdir, density, params, masks, train_bpc):
    report = pruning.density_report(masks)
    actual = float(np.mean(list(report.values())))
    path = charlm.save_checkpoint(workdir, density, params, masks)
    relative = path.relative_to(Path(workdir).resolve())  # the workdir may move
    return {"density": density, "recurrent_density": round(actual, 4), "path": str(relative),
            "train_bpc": None if train_bpc is None else round(float(train_bpc), 4)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="cpu", choices=sorted(charlm.CONFIGS))
    parser.add_argument("--workdir", default="runs/pruned_lm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    run(charlm.CONFIGS[args.config], args.workdir, args.seed, args.quiet)


if __name__ == "__main__":
    main()
