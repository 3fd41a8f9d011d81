"""Magnitude pruning of Flax parameter trees: one-shot and gradual (Zhu & Gupta 2017).

Why here: the JAX pruning library (google-research/jaxpruner) does not run on current JAX
(0.10+); this module covers what a sparse RNN needs, on plain parameter trees (linen
``variables['params']``, or ``nnx.to_pure_dict(nnx.state(model, nnx.Param))`` for nnx; masks
apply by leaf path, so they also fit the ``nnx.State`` updates of an ``nnx.Optimizer``).

- A *mask tree* has the structure of the parameter tree, one boolean array per leaf (True =
  kept). Leaves that are not pruned get an all-True mask.
- By default only recurrent kernels are pruned: leaves named ``kernel`` under a Flax cell's
  recurrent dense (``hi hf hg ho`` / ``hr hz hn`` / ``h`` in linen cells and our linen layers,
  ``dense_h`` in nnx cells and our nnx layers). Pass ``select=`` to choose others.
- Masks are fixed during fine-tuning with :func:`keep_pattern` (an optax transformation that
  zeroes updates of pruned entries) and :func:`apply_masks`.

Typical gradual pruning loop::

    schedule = pruning.PolynomialSchedule(final_sparsity=0.9, begin_step=0, end_step=2000,
                                          frequency=100)
    masks = pruning.ones_like_masks(params)
    for step in range(...):
        params, opt_state = train_step(params, opt_state, batch, masks)   # uses keep_pattern
        if schedule.should_update(step):
            masks = pruning.magnitude_masks(params, 1 - schedule(step), previous=masks)
            params = pruning.apply_masks(params, masks)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_sprnn.validation import as_fraction, as_int, is_real_number

RECURRENT_DENSE_NAMES = frozenset({"hi", "hf", "hg", "ho", "hr", "hz", "hn", "h", "dense_h"})

PyTree = Any


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_names(path) -> tuple[str, ...]:
    """Names along a ``jax.tree_util`` key path (nnx ``value`` wrappers dropped)."""
    names = tuple(_key_name(k) for k in path)
    while names and names[-1] in ("value", "raw_value"):
        names = names[:-1]
    return names


def is_recurrent_kernel(path, leaf=None) -> bool:
    """Default selection: the recurrent kernels of Flax cells and of the sparse layers."""
    names = path_names(path)
    return len(names) >= 2 and names[-1] == "kernel" and names[-2] in RECURRENT_DENSE_NAMES \
        and (leaf is None or np.ndim(leaf) == 2)


def selected_paths(params: PyTree, select: Callable = is_recurrent_kernel) -> list[str]:
    """'/'-joined paths of the leaves ``select`` picks (for reports)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return ["/".join(path_names(p)) for p, leaf in leaves if select(p, leaf)]


def ones_like_masks(params: PyTree) -> PyTree:
    """An all-kept mask tree."""
    return jax.tree_util.tree_map(lambda x: np.ones(np.shape(x), np.bool_), params)


def masks_from_zeros(params: PyTree, select: Callable = is_recurrent_kernel) -> PyTree:
    """Mask tree of a pruned checkpoint stored as dense arrays with exact zeros."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: (np.asarray(x) != 0) if select(p, x) else np.ones(np.shape(x), np.bool_),
        params)


def _keep_top(scores: np.ndarray, keep: int) -> np.ndarray:
    """Boolean mask keeping the ``keep`` largest scores (ties: lower flat index first; NaN
    scores last). A partition finds the threshold in linear time, then only the ties at it are
    taken by index: the same mask as a stable sort, which took ~20 s on an H=4096 LSTM kernel."""
    flat = scores.reshape(-1)
    if keep <= 0:
        return np.zeros(scores.shape, np.bool_)
    descending = -flat  # NaN stays NaN: last, as in a sort
    threshold = np.partition(descending, keep - 1)[keep - 1]
    if np.isnan(threshold):  # fewer than `keep` scores are numbers: all of them, then NaNs
        mask = ~np.isnan(flat)
        ties = np.flatnonzero(~mask)
    else:
        mask = descending < threshold
        ties = np.flatnonzero(descending == threshold)
    mask[ties[:keep - int(mask.sum())]] = True
    return mask.reshape(scores.shape)


def _previous_masks(previous, leaves) -> list:
    """``previous``'s masks leaf by leaf, checked against the parameter tree's paths and shapes."""
    if previous is None:
        return [None] * len(leaves)
    prev = jax.tree_util.tree_flatten_with_path(previous)[0]
    if len(prev) != len(leaves):
        raise ValueError(f"previous masks have {len(prev)} leaves, the parameter tree "
                         f"{len(leaves)}")
    for (path, leaf), (prev_path, mask) in zip(leaves, prev):
        if np.asarray(mask).dtype != np.bool_:  # as the layers' masks: 0.3 is not "kept"
            raise TypeError(f"previous masks must be boolean, got dtype {np.asarray(mask).dtype} "
                            f"at {'/'.join(path_names(prev_path))}")
        if path_names(path) != path_names(prev_path) or np.shape(mask) != np.shape(leaf):
            raise ValueError(
                "previous masks do not match the parameter tree: "
                f"{'/'.join(path_names(prev_path))} {np.shape(mask)} against "
                f"{'/'.join(path_names(path))} {np.shape(leaf)}")
    return [mask for _, mask in prev]


def _check_no_regrowth(density: float, size: int, kept_before: int, what: str) -> None:
    keep = int(round(density * size))
    if keep > kept_before:
        raise ValueError(f"density {density} keeps {keep} entries of {what}, but the previous "
                         f"masks keep only {kept_before}: pruning never regrows weights "
                         "(lower the density, or drop previous to prune from scratch)")


def magnitude_masks(params: PyTree, density: float, *, select: Callable = is_recurrent_kernel,
                    previous: PyTree | None = None, scope: str = "layer") -> PyTree:
    """Masks keeping the largest-magnitude fraction ``density`` of each selected leaf.

    Args:
      params: parameter tree (concrete arrays).
      density: fraction kept, in [0, 1] (sparsity = 1 - density). Exactly
        ``round(density * size)`` entries are kept per leaf (``scope="layer"``) or over all
        selected leaves together (``scope="global"``, one magnitude threshold).
      select: ``(path, leaf) -> bool``; default :func:`is_recurrent_kernel`.
      previous: masks of an earlier pruning step, a tree of the same paths and shapes:
        entries pruned there stay pruned, so gradual pruning never regrows weights. A
        ``density`` that would keep more entries than ``previous`` does is an error.
      scope: "layer" or "global".

    Returns the mask tree (unselected leaves all True).
    """
    density = as_fraction("density", density, not_a_number=ValueError)
    if scope not in ("layer", "global"):
        raise ValueError(f"scope must be 'layer' or 'global', got {scope!r}")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    prev = _previous_masks(previous, leaves)
    scores, chosen, kept_before = [], [], 0
    for (path, leaf), p in zip(leaves, prev):
        if not select(path, leaf):
            scores.append(None)
            continue
        s = np.abs(np.asarray(leaf, dtype=np.float32))
        kept = s.size
        if p is not None:
            p = np.asarray(p, bool)
            s = np.where(p, s, -np.inf)
            kept = int(p.sum())
        if scope == "layer":
            _check_no_regrowth(density, s.size, kept, "/".join(path_names(path)))
        scores.append(s)
        chosen.append(s)
        kept_before += kept
    if not chosen:
        raise ValueError("no parameter was selected for pruning (select matched no leaf)")
    out = []
    if scope == "global":
        flat = np.concatenate([s.reshape(-1) for s in chosen])
        _check_no_regrowth(density, flat.size, kept_before, "the selected leaves")
        kept = _keep_top(flat, int(round(density * flat.size)))
        offset = 0
        for (_, leaf), s in zip(leaves, scores):
            if s is None:
                out.append(np.ones(np.shape(leaf), np.bool_))
            else:
                out.append(kept[offset:offset + s.size].reshape(s.shape))
                offset += s.size
    else:
        for (_, leaf), s in zip(leaves, scores):
            out.append(np.ones(np.shape(leaf), np.bool_) if s is None
                       else _keep_top(s, int(round(density * s.size))))
    return jax.tree_util.tree_unflatten(treedef, out)


def apply_masks(params: PyTree, masks: PyTree) -> PyTree:
    """Zeroes the pruned entries (works on traced params; masks may be NumPy or JAX).

    Leaves are matched by path, so the two trees may be of different containers with the same
    names: an ``nnx.State`` (what ``nnx.Optimizer`` passes as updates) and its
    ``nnx.to_pure_dict``. Every leaf of ``params`` needs a mask of its shape.
    """
    by_path = {path_names(p): m for p, m in jax.tree_util.tree_flatten_with_path(masks)[0]}

    def masked(path, x):
        names = path_names(path)
        if names not in by_path:
            raise ValueError(f"no mask for the parameter {'/'.join(names)}: the mask tree's "
                             "paths must match the parameter tree's")
        mask = by_path[names]
        if np.shape(mask) != np.shape(x):  # jnp.where would broadcast, silently
            raise ValueError(f"the mask of {'/'.join(names)} has shape {np.shape(mask)}, "
                             f"the parameter {np.shape(x)}")
        return jnp.where(mask, x, jnp.zeros((), jnp.result_type(x)))

    return jax.tree_util.tree_map_with_path(masked, params)


def prune(params: PyTree, density: float, **kwargs) -> tuple[PyTree, PyTree]:
    """One-shot magnitude pruning: returns ``(pruned_params, masks)``."""
    masks = magnitude_masks(params, density, **kwargs)
    return apply_masks(params, masks), masks


def density_report(params_or_masks: PyTree, select: Callable = is_recurrent_kernel
                   ) -> dict[str, float]:
    """``{path: fraction of nonzeros}`` over the selected leaves (params or mask trees)."""
    leaves = jax.tree_util.tree_flatten_with_path(params_or_masks)[0]
    return {"/".join(path_names(p)): float(np.mean(np.asarray(x) != 0))
            for p, x in leaves if select(p, x)}


def keep_pattern(masks: PyTree):
    """optax transformation zeroing the updates of pruned entries (chain it last).

    With it, no optimizer (momentum, weight decay, ...) can move a pruned weight, so the
    pattern stays fixed during fine-tuning. The masks are closed over: when they change
    (gradual pruning), either build a new transformation or call :func:`masked_updates` in a
    training step that takes the masks as an argument.
    """
    import optax  # noqa: PLC0415 (optional dependency)

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        return masked_updates(updates, masks), state

    return optax.GradientTransformation(init_fn, update_fn)


def masked_updates(updates: PyTree, masks: PyTree) -> PyTree:
    """Updates with pruned entries zeroed (for training steps taking masks as an argument)."""
    return apply_masks(updates, masks)


# -- gradual pruning schedule ---------------------------------------------------------------------
def _check_schedule(final_sparsity, initial_sparsity, begin_step, end_step, power) -> None:
    """Sparsities in [0, 1], integer steps in order, a positive power (0 would never prune)."""
    as_fraction("final_sparsity", final_sparsity, not_a_number=ValueError)
    as_fraction("initial_sparsity", initial_sparsity, not_a_number=ValueError)
    as_int("begin_step", begin_step)
    as_int("end_step", end_step)
    if end_step <= begin_step:
        raise ValueError(f"end_step ({end_step}) must exceed begin_step ({begin_step})")
    if not is_real_number(power) or not float(power) > 0:
        raise ValueError(f"power must be a positive number, got {power!r}")


def polynomial_sparsity(step, *, final_sparsity: float, begin_step: int, end_step: int,
                        initial_sparsity: float = 0.0, power: int = 3):
    """Zhu & Gupta (2017) schedule: ``s_t = s_f + (s_i - s_f) (1 - (t - t_0) / (t_n - t_0))^3``.

    Before ``begin_step`` the sparsity is ``initial_sparsity``; from ``end_step`` on it is
    ``final_sparsity``. Works on Python numbers and JAX arrays.
    """
    _check_schedule(final_sparsity, initial_sparsity, begin_step, end_step, power)
    frac = (step - begin_step) / float(end_step - begin_step)
    frac = jnp.clip(frac, 0.0, 1.0) if isinstance(step, jax.Array) else min(max(frac, 0.0), 1.0)
    return final_sparsity + (initial_sparsity - final_sparsity) * (1.0 - frac) ** power


@dataclasses.dataclass(frozen=True)
class PolynomialSchedule:
    """Gradual pruning schedule (Zhu & Gupta's cubic one by default), updated every
    ``frequency`` steps between ``begin_step`` and ``end_step`` (both included)."""

    final_sparsity: float
    begin_step: int
    end_step: int
    frequency: int = 100
    initial_sparsity: float = 0.0
    power: int = 3

    def __post_init__(self):
        _check_schedule(self.final_sparsity, self.initial_sparsity, self.begin_step,
                        self.end_step, self.power)
        if self.initial_sparsity > self.final_sparsity:
            raise ValueError(f"initial_sparsity ({self.initial_sparsity}) must not exceed "
                             f"final_sparsity ({self.final_sparsity}): pruning never regrows")
        as_int("frequency", self.frequency, minimum=1)

    def __call__(self, step) -> float:
        return polynomial_sparsity(step, final_sparsity=self.final_sparsity,
                                   begin_step=self.begin_step, end_step=self.end_step,
                                   initial_sparsity=self.initial_sparsity, power=self.power)

    def should_update(self, step: int) -> bool:
        """True on the steps where masks are recomputed."""
        if step < self.begin_step or step > self.end_step:
            return False
        return (step - self.begin_step) % self.frequency == 0 or step == self.end_step

    def density(self, step) -> float:
        return 1.0 - self(step)
