"""Shared pieces of the linen and nnx layers: the static sparsity mask and the layer call.

Both front ends (``linen.py``, ``nnx.py``) hold parameters in Flax's own layout and call
:func:`run_layer` with plain arrays; everything about time axes, reversal, padding, dtypes and
packing the recurrent kernel lives here, once.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jax_sprnn as sp
from jax_sprnn import packing
from jax_sprnn.primitives import recurrence
from jax_sprnn.validation import as_fraction, as_int, check_flag

CELLS = ("lstm", "gru", "rnn")
GATES = recurrence.GATES  # gate blocks per cell, from the primitive's table
ACTIVATIONS = ("tanh", "relu")


class StaticMask:
    """A fixed boolean sparsity pattern of a recurrent kernel ``(H, G*H)``.

    Hashable and compared by value, so it can sit in a linen module's attributes or in an nnx
    module's static graph: it never becomes a traced value and never reaches an optimizer. The
    kept entries are ``True``; pruned entries of the kernel are ignored by the layer and get
    zero gradient.
    """

    __slots__ = ("_array", "_hash", "_packed", "__weakref__")

    def __init__(self, mask):
        if isinstance(mask, StaticMask):
            mask = mask.array
        if isinstance(mask, jax.core.Tracer):
            raise TypeError("a sparsity mask must be concrete (NumPy), not a traced value")
        if isinstance(mask, Mapping):  # e.g. a jax_sprnn.pruning mask tree
            raise TypeError(
                "a layer's sparsity mask is one boolean array (H, G*H) over the concatenated "
                "recurrent kernel, got a mapping; for a jax_sprnn.pruning mask tree, "
                "concatenate the recurrent gates' kernel masks in gate order (np.concatenate("
                "[tree['cell'][n]['kernel'] for n in ('hi', 'hf', 'hg', 'ho')], -1) for an "
                "LSTM), or convert the Flax model with from_flax_rnn / from_nnx_rnn, which take "
                "mask trees")
        array = np.array(mask)  # a private copy
        if array.dtype != np.bool_:
            raise TypeError(f"a sparsity mask must be boolean, got dtype {array.dtype}")
        if array.ndim != 2:
            raise ValueError(f"a sparsity mask must be 2-D (H, G*H), got shape {array.shape}")
        array.setflags(write=False)
        self._array = array
        digest = hashlib.blake2b(np.packbits(array).tobytes(), digest_size=8).digest()
        self._hash = hash((array.shape, digest))
        self._packed = None

    @property
    def array(self) -> np.ndarray:
        """The read-only NumPy boolean array."""
        return self._array

    @property
    def shape(self):
        return self._array.shape

    @property
    def density(self) -> float:
        return float(self._array.mean()) if self._array.size else 1.0

    @property
    def nnz(self) -> int:
        return int(self._array.sum())

    def packed(self):
        """``packing.pack_mask`` of this mask (default bank order), packed on first use and
        kept: a layer's every trace and eager call reuse it (an H=4096 LSTM mask takes seconds to
        pack; what is kept, 8 bytes per nonzero, is the mask's own size at 12.5% density)."""
        if self._packed is None:
            hidden, columns = self._array.shape
            self._packed = packing.pack_mask(self._array, columns // hidden)
        return self._packed

    def __array__(self, dtype=None, copy=None):
        return self._array if dtype is None else self._array.astype(dtype)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if self is other:
            return True
        if not isinstance(other, StaticMask):
            return NotImplemented
        return self._hash == other._hash and np.array_equal(self._array, other._array)

    def __repr__(self):
        return f"StaticMask(shape={self.shape}, density={self.density:.4f})"

    def __reduce__(self):
        return (StaticMask, (self._array,))


def as_static_mask(mask, hidden: int, gates: int) -> StaticMask | None:
    """Normalizes a user mask (None, NumPy/JAX bool array or StaticMask) and checks its shape."""
    if mask is None:
        return None
    mask = mask if isinstance(mask, StaticMask) else StaticMask(mask)
    if mask.shape != (hidden, gates * hidden):
        raise ValueError(f"the recurrent mask must have shape ({hidden}, {gates * hidden}) "
                         f"(H, G*H), got {mask.shape}")
    return mask


def _check_hidden(hidden) -> None:
    if isinstance(hidden, (bool, np.bool_)) or not isinstance(hidden, (int, np.integer)) \
            or hidden < 1:
        raise ValueError(f"the hidden size must be a positive integer, got {hidden!r}")


def random_mask(hidden: int, gates: int, density: float, seed: int = 0) -> StaticMask:
    """A random pattern keeping ``round(density * size)`` entries of an ``(H, G*H)`` kernel (at
    least one when ``density > 0``)."""
    _check_hidden(hidden)
    if gates not in GATES.values():
        raise ValueError(f"gates must be 1 (rnn), 4 (lstm) or 3 (gru), got {gates!r}")
    # Plain Python keys for the cache: a JAX scalar is unhashable.
    return _cached_random_mask(int(hidden), int(gates), as_fraction("density", density),
                               as_int("mask_seed", seed, minimum=0))


@functools.lru_cache(maxsize=64)  # a re-trace of a layer draws no new permutation
def _cached_random_mask(hidden: int, gates: int, density: float, seed: int) -> StaticMask:
    size = hidden * gates * hidden
    keep = int(round(density * size))
    if density > 0:
        keep = max(keep, 1)  # a tiny density still keeps one entry
    flat = np.zeros(size, np.bool_)
    flat[np.random.default_rng(seed).permutation(size)[:keep]] = True
    return StaticMask(flat.reshape(hidden, gates * hidden))


def layer_mask(mask, density, seed, hidden: int, gates: int) -> StaticMask:
    """The pattern a layer runs with: the given mask, a random one at ``density``, or dense."""
    _check_hidden(hidden)
    if mask is not None and density is not None:
        raise ValueError("give either mask or density, not both")
    if mask is not None:
        return as_static_mask(mask, hidden, gates)
    if density is not None:
        return random_mask(hidden, gates, density, seed)
    return _dense_mask(int(hidden), int(gates))


# The cached masks below keep their packing (StaticMask.packed): a new StaticMask per call would
# re-pack the pattern at every eager call and trace (seconds at H=4096).
@functools.lru_cache(maxsize=8)  # a dense LSTM H=4096 mask packs into ~0.5 GB
def _dense_mask(hidden: int, gates: int) -> StaticMask:
    return StaticMask(np.ones((hidden, gates * hidden), np.bool_))


@functools.lru_cache(maxsize=64)
def _with_diagonal(mask: StaticMask) -> StaticMask:
    return StaticMask(mask.array | np.eye(mask.shape[0], dtype=np.bool_))


def residual_kernel(kernel_h, mask: StaticMask):
    """A residual simple cell's ``h W + h`` as one kernel: the identity folded into the kept
    entries, the diagonal into the pattern. Returns ``(kernel, mask)``."""
    kept = jnp.where(mask.array, kernel_h, jnp.zeros((), kernel_h.dtype))
    return kept + jnp.eye(mask.shape[0], dtype=kernel_h.dtype), _with_diagonal(mask)


def check_cell(cell: str, activation: str = "tanh") -> None:
    if cell not in CELLS:
        raise ValueError(f"cell must be one of {CELLS}, got {cell!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


# -- time axis helpers (Flax's conventions) ---------------------------------------------------
def flip_sequences(x, seq_lengths, time_axis: int):
    """Reverses each sequence's first ``L_b`` steps along ``time_axis``; padding stays at the end.

    Same result as ``flax.linen.recurrent.flip_sequences`` for one batch axis next to time.
    """
    if x.ndim < 2 or time_axis % x.ndim not in (0, 1):
        raise ValueError(f"time_axis must be 0 or 1 (time and one batch axis lead), got "
                         f"{time_axis} for shape {x.shape}")
    time_axis %= x.ndim
    steps = x.shape[time_axis]
    if seq_lengths is None:
        return jnp.flip(x, axis=time_axis)
    seq_lengths = jnp.asarray(seq_lengths)
    if seq_lengths.shape != (x.shape[1 - time_axis],):
        raise ValueError(f"seq_lengths must have shape ({x.shape[1 - time_axis]},) for inputs "
                         f"of shape {x.shape} with time on axis {time_axis}, got "
                         f"{seq_lengths.shape}")
    idx = jnp.arange(steps - 1, -1, -1)[None, :] + seq_lengths[:, None]
    idx = idx % steps  # (B, T)
    if time_axis == 0:
        idx = idx.T
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=time_axis)


class Layout(NamedTuple):
    """How a layer call maps the user's input onto the functional API's (T, B, F)."""

    time_major: bool
    batch_shape: tuple  # the user's batch dimensions (flattened into one for the kernel)
    steps: int


def step_shape(inputs, time_major: bool):
    """Shape of one timestep's input (time axis removed), as Flax's initialize_carry takes it."""
    return inputs.shape[1:] if time_major else inputs.shape[:-2] + inputs.shape[-1:]


def to_time_major(inputs, time_major: bool):
    """(*batch, T, F) or (T, *batch, F) -> ((T, B, F), Layout)."""
    if inputs.ndim < 2:
        raise ValueError(f"inputs must have at least (time, features) axes, got {inputs.shape}")
    # The batch size is spelled out, not -1: reshape cannot infer it when T = 0 (size 0).
    if time_major:
        steps, batch_shape = inputs.shape[0], inputs.shape[1:-1]
        x = inputs.reshape((steps, math.prod(batch_shape), inputs.shape[-1]))
    else:
        steps, batch_shape = inputs.shape[-2], inputs.shape[:-2]
        x = jnp.swapaxes(inputs.reshape((math.prod(batch_shape), steps, inputs.shape[-1])), 0, 1)
    return x, Layout(time_major, tuple(batch_shape), steps)


def from_time_major(ys, layout: Layout):
    """(T, B, H) -> the user's layout."""
    if layout.time_major:
        return ys.reshape((layout.steps,) + layout.batch_shape + ys.shape[-1:])
    return jnp.swapaxes(ys, 0, 1).reshape(layout.batch_shape + (layout.steps,) + ys.shape[-1:])


def _flat_batch(x, layout: Layout):
    return x.reshape((-1,) + x.shape[len(layout.batch_shape):])


def _unflat_batch(x, layout: Layout):
    return x.reshape(layout.batch_shape + x.shape[1:])


def compute_dtype(dtype, *arrays):
    """Flax's rule: the module's ``dtype`` if set, else the promoted dtype of inputs and params."""
    if dtype is not None:
        return jnp.dtype(dtype)
    return jnp.dtype(jnp.result_type(*arrays))


def zero_carry(cell: str, batch_shape, hidden: int, dtype):
    """The default initial carry: zeros, ``(c, h)`` for the LSTM."""
    h = jnp.zeros(tuple(batch_shape) + (hidden,), dtype)
    return (h, h) if cell == "lstm" else h


def input_projection(x_tm, kernel_i, bias, dtype):
    """One matmul over all timesteps: (T, B, I) @ (I, G*H) + b -> (T, B, G*H) in ``dtype``."""
    xp = jnp.dot(x_tm.astype(dtype), kernel_i.astype(dtype))
    if bias is not None:  # broadcast explicitly: rank promotion may be set to "raise"
        xp = xp + jnp.reshape(bias.astype(dtype), (1,) * (xp.ndim - 1) + (-1,))
    return xp


def run_layer(cell: str, inputs, kernel_i, bias_i, kernel_h, mask: StaticMask, *, b_hn=None,
              activation: str = "tanh", dtype=None, initial_carry=None, seq_lengths=None,
              time_major: bool = False, reverse: bool = False, keep_order: bool = False,
              implementation: str = "auto"):
    """Runs a sparse recurrent layer the way ``flax.linen.RNN`` runs a cell.

    inputs: ``(*batch, T, I)`` (or ``(T, *batch, I)`` when ``time_major``). kernel_i ``(I, G*H)``
    and bias_i ``(G*H,)`` (or None) form the input projection, done as one matmul over all
    steps; kernel_h ``(H, G*H)`` is packed with ``mask`` (gradients reach its kept entries).

    Returns ``(carry, outputs)``: outputs in the compute dtype, the carry in the dtype of
    ``initial_carry`` (so a loop over calls keeps one carry type, as with Flax's LSTM and GRU
    cells), else in the compute dtype. Differences from ``nn.RNN``: outputs at padding positions
    (``t >= seq_lengths[b]``) are zeros, and a sequence of length 0 returns its initial carry.
    """
    check_cell(cell, activation)
    gates = GATES[cell]
    hidden = kernel_h.shape[0]
    if kernel_h.shape != (hidden, gates * hidden):
        raise ValueError(f"recurrent kernel must have shape (H, {gates}*H), got {kernel_h.shape}")
    if kernel_i.shape[-1] != gates * hidden:
        raise ValueError(f"input kernel must have {gates * hidden} columns, got {kernel_i.shape}")
    if inputs.shape[-1] != kernel_i.shape[0]:
        raise ValueError(f"inputs have {inputs.shape[-1]} features but the layer was built for "
                         f"{kernel_i.shape[0]}")
    dtype = compute_dtype(dtype, inputs, kernel_i, kernel_h)
    x_tm, layout = to_time_major(inputs, time_major)
    xp = input_projection(x_tm, kernel_i, bias_i, dtype)
    batch = xp.shape[1]

    if initial_carry is None:
        carry = zero_carry(cell, (batch,), hidden, dtype)
        carry_dtypes = jax.tree_util.tree_map(lambda c: c.dtype, carry)
    else:
        carry_dtypes = jax.tree_util.tree_map(lambda c: jnp.asarray(c).dtype, initial_carry)
        carry = jax.tree_util.tree_map(
            lambda c: _flat_batch(jnp.asarray(c), layout).astype(dtype), initial_carry)
    lengths = None
    if seq_lengths is not None:
        lengths = jnp.asarray(seq_lengths)
        if lengths.shape not in (layout.batch_shape, (batch,)):
            raise ValueError(f"seq_lengths must have the inputs' batch shape "
                             f"{layout.batch_shape}, got {lengths.shape}")
        lengths = lengths.reshape((batch,))

    if mask.shape != kernel_h.shape:  # then the mask's own packing fits the kernel
        raise ValueError(f"the layer's mask has shape {mask.shape}, its recurrent kernel "
                         f"{kernel_h.shape}: variables of another layer size?")
    w = sp.SparseWeights._from_packing(kernel_h.astype(dtype), mask.packed())
    kwargs = dict(seq_lengths=lengths, reverse=reverse, implementation=implementation)
    if cell == "lstm":
        ys, carry = sp.lstm(xp, carry, w, **kwargs)
    elif cell == "gru":
        if b_hn is None:
            b_hn = jnp.zeros((hidden,), dtype)
        ys, carry = sp.gru(xp, carry, w, jnp.asarray(b_hn).astype(dtype), **kwargs)
    else:
        ys, carry = sp.rnn(xp, carry, w, activation=activation, **kwargs)

    if reverse and not keep_order:  # Flax returns a reversed pass in processing order
        ys = flip_sequences(ys, lengths, time_axis=0)
    carry = jax.tree_util.tree_map(lambda c, d: _unflat_batch(c, layout).astype(d), carry,
                                   carry_dtypes)
    return carry, from_time_major(ys, layout)


CALL_OPTIONS = ("return_carry", "time_major", "reverse", "keep_order")


def call_options(layer, **given) -> dict:
    """A layer call's options: those given to the call, else the layer's attributes (as nn.RNN).

    Each must be a bool: Flax's truthiness would run ``reverse="False"`` reversed.
    """
    return {k: check_flag(k, getattr(layer, k) if given.get(k) is None else given[k])
            for k in CALL_OPTIONS}


def run_module(layer, inputs, params, options: dict, initial_carry, seq_lengths):
    """Runs a linen or nnx sparse layer: ``params`` = (kernel_i, bias_i, kernel_h, b_hn, mask)."""
    kernel_i, bias_i, kernel_h, b_hn, mask = params
    carry, outputs = run_layer(
        layer.cell_type, inputs, kernel_i, bias_i, kernel_h, mask, b_hn=b_hn,
        activation=layer._activation(), dtype=layer.dtype, initial_carry=initial_carry,
        seq_lengths=seq_lengths, time_major=options["time_major"], reverse=options["reverse"],
        keep_order=options["keep_order"], implementation=layer.implementation)
    return (carry, outputs) if options["return_carry"] else outputs
