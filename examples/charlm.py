"""Shared pieces of the pruned character-level LSTM language model example.

- Data: the Python standard library's own ``.py`` sources (every Python install has them,
  offline), read as bytes (vocabulary 256; bits per character = bits per byte, and the
  sources are almost all ASCII). Files are split by name into train and validation sets.
- Model: ``Embed -> nn.RNN(nn.OptimizedLSTMCell) x layers -> Dense``. The sparse variant puts
  ``jax_sprnn.flax.SparseLSTM`` in place of each ``nn.RNN`` with the same parameter tree, so one
  checkpoint feeds both.
- Checkpoints: Orbax, ``{'params': ..., 'masks': ...}`` per density plus a JSON summary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sysconfig
import zlib
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_sprnn.flax import SparseLSTM, StaticMask

VOCAB = 256


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    hidden: int
    embed: int
    layers: int
    seq_len: int
    batch: int
    lr: float
    pretrain_steps: int  # dense training before pruning
    prune_steps: int  # per density stage: steps over which the cubic schedule runs
    finetune_steps: int  # per density stage: steps with the final mask fixed
    prune_every: int  # mask update frequency during a stage
    densities: tuple  # first is 1.0 (the dense model)
    train_chars: int
    val_chars: int
    eval_batch: int  # parallel streams in evaluation
    eval_chunk: int  # timesteps per evaluation call (carry passed between chunks)


CONFIGS = {
    # Runs in the test suite: seconds.
    "tiny": Config("tiny", hidden=32, embed=16, layers=1, seq_len=32, batch=8, lr=3e-3,
                   pretrain_steps=20, prune_steps=10, finetune_steps=5, prune_every=5,
                   densities=(1.0, 0.3, 0.1), train_chars=200_000, val_chars=4_096,
                   eval_batch=4, eval_chunk=64),
    # The default: the whole pipeline in well under 10 minutes on a 2-core CPU.
    "cpu": Config("cpu", hidden=256, embed=64, layers=1, seq_len=64, batch=32, lr=3e-3,
                  pretrain_steps=1000, prune_steps=200, finetune_steps=100, prune_every=10,
                  densities=(1.0, 0.3, 0.1, 0.05), train_chars=3_000_000, val_chars=65_536,
                  eval_batch=16, eval_chunk=256),
    # For a GPU: a 2-layer H=1024 model.
    "gpu": Config("gpu", hidden=1024, embed=128, layers=2, seq_len=128, batch=64, lr=2e-3,
                  pretrain_steps=2000, prune_steps=600, finetune_steps=300, prune_every=30,
                  densities=(1.0, 0.3, 0.1, 0.05), train_chars=20_000_000, val_chars=262_144,
                  eval_batch=8, eval_chunk=512),
}


# -- data -----------------------------------------------------------------------------------------
def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "test" not in p.parts
                   and "tests" not in p.parts)
    if not files:
        raise FileNotFoundError(f"no Python sources found under {root}")
    return files


def load_corpus(train_chars: int, val_chars: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) uint8 arrays of Python source bytes; 1 file in 10 goes to validation."""
    train, val = [], []
    n_train = n_val = 0
    for path in stdlib_files():
        is_val = zlib.crc32(path.name.encode()) % 10 == 0
        if (n_val >= val_chars) if is_val else (n_train >= train_chars):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        (val if is_val else train).append(data)
        if is_val:
            n_val += len(data)
        else:
            n_train += len(data)
        if n_train >= train_chars and n_val >= val_chars:
            break
    train_arr = np.frombuffer(b"".join(train), np.uint8)[:train_chars]
    val_arr = np.frombuffer(b"".join(val), np.uint8)[:val_chars]
    if val_arr.size < val_chars // 2 or train_arr.size < 10 * 1024:
        raise RuntimeError("not enough standard-library source text found")
    return train_arr, val_arr


def sample_batch(rng: np.random.Generator, data: np.ndarray, batch: int, seq_len: int):
    starts = rng.integers(0, data.size - seq_len - 1, size=batch)
    return np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)


# -- model ----------------------------------------------------------------------------------------
class CharLM(nn.Module):
    """Character LM. With ``masks`` (one ``(H, 4H)`` StaticMask per layer) the LSTM layers are
    jax_sprnn's SparseLSTM; without, Flax's ``nn.RNN(nn.OptimizedLSTMCell)``. Same params."""

    hidden: int
    embed: int
    layers: int
    masks: tuple | None = None

    @nn.compact
    def __call__(self, tokens, carries=None):
        x = nn.Embed(VOCAB, self.embed, name="embed")(tokens)
        new_carries = []
        for layer in range(self.layers):
            name = f"rnn_{layer}"
            if self.masks is None:
                # parent=None: the cell belongs to the RNN (params rnn_l/cell/...), not to
                # this module, so the tree matches SparseLSTM's.
                rnn = nn.RNN(nn.OptimizedLSTMCell(self.hidden, parent=None), return_carry=True,
                             name=name)
            else:
                rnn = SparseLSTM(self.hidden, mask=self.masks[layer], return_carry=True,
                                 name=name)
            carry, x = rnn(x, initial_carry=None if carries is None else carries[layer])
            new_carries.append(carry)
        return nn.Dense(VOCAB, name="out")(x), tuple(new_carries)


def make_model(cfg: Config, masks: tuple | None = None) -> CharLM:
    return CharLM(cfg.hidden, cfg.embed, cfg.layers, masks)


def layer_masks(cfg: Config, mask_tree) -> tuple:
    """Per-layer (H, 4H) StaticMasks (gate order i, f, g, o) from a pruning mask tree."""
    out = []
    for layer in range(cfg.layers):
        cell = mask_tree[f"rnn_{layer}"]["cell"]
        out.append(StaticMask(np.concatenate(
            [np.asarray(cell[n]["kernel"], bool) for n in ("hi", "hf", "hg", "ho")], axis=-1)))
    return tuple(out)


def zero_carries(cfg: Config, batch: int):
    z = jnp.zeros((batch, cfg.hidden), jnp.float32)
    return tuple((z, z) for _ in range(cfg.layers))


def nll_bits(logits, targets):
    """Total negative log-likelihood in bits."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll) / jnp.log(2.0)


# -- checkpoints ------------------------------------------------------------------------------
def checkpoint_dir(workdir: str | os.PathLike, density: float) -> Path:
    return Path(workdir).resolve() / "checkpoints" / f"density_{density:.3f}"


def save_checkpoint(workdir, density: float, params, masks) -> Path:
    import orbax.checkpoint as ocp  # noqa: PLC0415

    path = checkpoint_dir(workdir, density)
    tree = {"params": jax.device_get(params),
            "masks": jax.tree_util.tree_map(lambda m: np.asarray(m, np.uint8), masks)}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, tree, force=True)
    return path


def listed_checkpoint(workdir, entry) -> Path:
    """The checkpoint a ``train_summary.json`` entry names. Its path is relative to the workdir
    (absolute in summaries written before 2026-12-01), so a workdir can be moved or copied to
    another machine, e.g. trained on a CPU and evaluated on a GPU."""
    path = Path(workdir) / entry["path"]
    if not path.exists():
        raise SystemExit(f"checkpoint {path} (density {entry['density']:.0%}, listed in "
                         f"{Path(workdir) / 'train_summary.json'}) is missing: train again")
    return path


def load_checkpoint(path):
    """Returns ``(params, masks)`` (masks as NumPy bool arrays)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.restore(Path(path).resolve())
    masks = jax.tree_util.tree_map(lambda m: np.asarray(m).astype(bool), tree["masks"])
    params = jax.tree_util.tree_map(jnp.asarray, tree["params"])
    return params, masks


def write_json(path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path):
    return json.loads(Path(path).read_text())
