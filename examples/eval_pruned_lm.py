"""Evaluates the pruned character LMs: each checkpoint runs with the dense Flax model
(``nn.RNN(nn.OptimizedLSTMCell)``) and with jax_sprnn's ``SparseLSTM`` on the same held-out
text; the two must agree. Reports bits per character and speed per density as a table
(``results.md``, ``results.json``) and a plot (``pruned_lm.png``).

    python examples/eval_pruned_lm.py --config cpu --workdir runs/pruned_lm

Evaluation reads the validation text as ``eval_batch`` parallel streams, ``eval_chunk`` steps
per call, carrying the LSTM state from chunk to chunk. Speed is the wall time of a full pass
(after a compiling warm-up call; the best of 3), as characters per second and microseconds per
timestep. Bits per character and the dense/sparse agreement come from one more pass with
float32 matmuls (on GPUs XLA's default is TF32).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import charlm  # noqa: E402

# Agreement required between the dense Flax model and the sparse layer (float32).
BPC_TOLERANCE = 1e-3
LOGIT_TOLERANCE = 1e-2


def make_eval_fn(model):
    @jax.jit
    def eval_chunk(params, carries, inputs, targets):
        logits, carries = model.apply({"params": params}, inputs, carries)
        return carries, charlm.nll_bits(logits, targets), logits

    return eval_chunk


def evaluate(cfg, model, params, val: np.ndarray, quiet: bool, desc: str, repeats: int = 3):
    """Returns (bits per char, seconds of the timed pass, per-chunk logits for comparison).

    Bits per char and logits come from a pass with float32 matmuls
    (``jax.default_matmul_precision("highest")``): on GPUs XLA's default is TF32, whose ~1e-3
    relative error in the dense model's recurrent matmul builds up over hundreds of steps and
    would hide real disagreements. The timed passes run at the default precision, as users run.
    """
    streams = cfg.eval_batch
    steps = (val.size - 1) // streams // cfg.eval_chunk * cfg.eval_chunk
    if steps == 0:
        raise ValueError("validation text too short for the evaluation shape")
    data = val[:streams * steps + 1]
    inputs = data[:-1].reshape(streams, steps).astype(np.int32)
    targets = data[1:].reshape(streams, steps).astype(np.int32)
    zero = charlm.zero_carries(cfg, streams)

    def full_pass(fn, label):
        carries, total, logits = zero, 0.0, []
        for s in tqdm(range(0, steps, cfg.eval_chunk), desc=label, disable=quiet, leave=False):
            carries, bits, out = fn(params, carries, inputs[:, s:s + cfg.eval_chunk],
                                    targets[:, s:s + cfg.eval_chunk])
            total += bits  # stays on the device; one sync at the end
            logits.append(out)
        return float(total), logits

    with jax.default_matmul_precision("highest"):
        total, logits = full_pass(make_eval_fn(model), f"{desc} (float32)")
    fn = make_eval_fn(model)
    jax.block_until_ready(fn(params, zero, inputs[:, :cfg.eval_chunk],
                             targets[:, :cfg.eval_chunk]))  # compile outside the timing
    seconds = float("inf")
    for _ in range(max(1, repeats)):  # the best of `repeats` full passes is the speed
        start = time.perf_counter()
        full_pass(fn, desc)
        seconds = min(seconds, time.perf_counter() - start)
    return total / (streams * steps), seconds, logits, streams * steps, steps


def run(cfg: charlm.Config, workdir: str, quiet: bool = False) -> list[dict]:
    summary_path = Path(workdir) / "train_summary.json"
    if not summary_path.exists():
        raise SystemExit(f"no trained checkpoints in {workdir} ({summary_path.name} is missing): "
                         f"train first, python examples/train_prune_lm.py --config {cfg.name} "
                         f"--workdir {workdir}, or run examples/pruned_lm.py (both steps)")
    summary = charlm.read_json(summary_path)
    if summary.get("config") != cfg.name:  # another config's checkpoints have other shapes
        raise SystemExit(f"the checkpoints in {workdir} were trained with --config "
                         f"{summary.get('config')}, not {cfg.name}: evaluate them with that "
                         "config, or train this one in another --workdir")
    if not summary.get("checkpoints"):
        raise SystemExit(f"{summary_path} lists no checkpoints: train again")
    paths = [charlm.listed_checkpoint(workdir, entry) for entry in summary["checkpoints"]]
    _, val = charlm.load_corpus(cfg.train_chars, cfg.val_chars)
    rows = []
    for entry, path in zip(summary["checkpoints"], paths):
        params, mask_tree = charlm.load_checkpoint(path)
        masks = charlm.layer_masks(cfg, mask_tree)
        dense = charlm.make_model(cfg)
        sparse = charlm.make_model(cfg, masks)
        label = f"{entry['density']:.0%}"
        bpc_d, sec_d, logits_d, chars, steps = evaluate(cfg, dense, params, val, quiet,
                                                        f"dense  {label}")
        bpc_s, sec_s, logits_s, _, _ = evaluate(cfg, sparse, params, val, quiet,
                                                f"sparse {label}")
        max_diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(logits_d, logits_s))
        agree = abs(bpc_d - bpc_s) <= BPC_TOLERANCE and max_diff <= LOGIT_TOLERANCE
        rows.append({
            "density": entry["density"],
            "recurrent_nnz": int(sum(m.nnz for m in masks)),
            "bpc_dense_flax": round(bpc_d, 4), "bpc_sparse": round(bpc_s, 4),
            "max_logit_diff": max_diff, "agree": bool(agree),
            "dense_chars_per_s": round(chars / sec_d), "sparse_chars_per_s": round(chars / sec_s),
            "dense_us_per_step": round(1e6 * sec_d / steps, 2),
            "sparse_us_per_step": round(1e6 * sec_s / steps, 2),
            "speedup": round(sec_d / sec_s, 3),
        })
        print(f"[eval] density {label}: bpc dense {bpc_d:.4f} sparse {bpc_s:.4f} "
              f"(max |logit diff| {max_diff:.2e}); {1e6 * sec_d / steps:.1f} vs "
              f"{1e6 * sec_s / steps:.1f} us/step")
    device = jax.devices()[0]
    kind = device.device_kind
    meta = {"config": cfg.name,
            "device": device.platform if kind == device.platform else f"{device.platform}: {kind}",
            "hidden": cfg.hidden, "layers": cfg.layers, "eval_batch": cfg.eval_batch,
            "eval_chars": chars}
    charlm.write_json(Path(workdir) / "results.json", {"meta": meta, "rows": rows})
    table = format_table(rows, meta)
    (Path(workdir) / "results.md").write_text(table)
    print(table)
    plot(rows, meta, Path(workdir) / "pruned_lm.png")
    print(f"[eval] table: {Path(workdir).resolve() / 'results.md'}; plot: "
          f"{Path(workdir).resolve() / 'pruned_lm.png'}")
    if not all(r["agree"] for r in rows):
        raise SystemExit("dense Flax model and sparse layer disagree beyond tolerance")
    return rows


def format_table(rows, meta) -> str:
    lines = [
        f"Character LM on Python stdlib sources, config `{meta['config']}` "
        f"(LSTM {meta['layers']}x{meta['hidden']}), {meta['eval_chars']:,} held-out chars, "
        f"{meta['eval_batch']} streams, {meta['device']}",
        "",
        "| density | recurrent nnz | bpc (Flax dense) | bpc (jax_sprnn sparse) | max logit diff "
        "| Flax us/step | sparse us/step | speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['density']:.0%} | {r['recurrent_nnz']:,} | {r['bpc_dense_flax']:.4f} | "
            f"{r['bpc_sparse']:.4f} | {r['max_logit_diff']:.1e} | {r['dense_us_per_step']} | "
            f"{r['sparse_us_per_step']} | {r['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(rows, meta, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    dens = [100 * r["density"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(dens, [r["bpc_dense_flax"] for r in rows], "o-", label="Flax dense model")
    ax1.plot(dens, [r["bpc_sparse"] for r in rows], "x--", label="jax_sprnn SparseLSTM")
    ax1.set_xscale("log")
    ax1.set_xlabel("recurrent weight density (%)")
    ax1.set_ylabel("bits per character (held out)")
    ax1.set_title("Quality")
    ax1.legend()
    ax2.plot(dens, [r["dense_us_per_step"] for r in rows], "o-", label="Flax nn.RNN (dense)")
    ax2.plot(dens, [r["sparse_us_per_step"] for r in rows], "x--", label="jax_sprnn SparseLSTM")
    ax2.set_xscale("log")
    ax2.set_xlabel("recurrent weight density (%)")
    ax2.set_ylabel(f"us per timestep (batch {meta['eval_batch']}, whole model)")
    ax2.set_title("Speed")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(dens)
        ax.set_xticklabels([f"{d:g}" for d in dens])
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"Pruned char LSTM {meta['layers']}x{meta['hidden']} ({meta['config']}, "
                 f"{meta['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="cpu", choices=sorted(charlm.CONFIGS))
    parser.add_argument("--workdir", default="runs/pruned_lm")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    run(charlm.CONFIGS[args.config], args.workdir, args.quiet)


if __name__ == "__main__":
    main()
