"""Pure-JAX reference of the recurrences (lax.scan over a dense kernel).

The in-project oracle for the kernels and the fallback where no kernel runs. Internally
float32 (the state stays float32 between steps); outputs are cast to the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

ACTIVATIONS = {"tanh": 0, "relu": 1}


def cell_step(cell: str, activation: int, carry, x, hw, b_hn):
    """One step of the cell in float32: carry (tuple), x = xp_t, hw = h @ W. Returns new carry."""
    if cell == "rnn":
        a = x + hw
        return (jnp.tanh(a) if activation == 0 else jax.nn.relu(a),)
    if cell == "lstm":
        c, _ = carry
        i, f, g, o = jnp.split(x + hw, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        return (c, jax.nn.sigmoid(o) * jnp.tanh(c))
    if cell == "gru":
        (h,) = carry
        xr, xz, xn = jnp.split(x, 3, axis=-1)
        hr, hz, hn = jnp.split(hw, 3, axis=-1)
        r = jax.nn.sigmoid(xr + hr)
        z = jax.nn.sigmoid(xz + hz)
        n = jnp.tanh(xn + r * (hn + jnp.broadcast_to(b_hn, hn.shape)))
        return ((1.0 - z) * n + z * h,)
    raise ValueError(f"unknown cell {cell!r}")


def recurrence(cell: str, xp, carry: tuple, kernel, lengths, b_hn=None, *, reverse=False,
               activation: int = 0, return_cell_states: bool = False):
    """Runs the cell over time. carry is (h,) or, for lstm, (c, h). Returns (ys, carry_T).

    With return_cell_states (lstm), also returns every step's cell state (0 at invalid steps).
    """
    dtype = xp.dtype
    f32 = jnp.float32
    steps = xp.shape[0]
    w = kernel.astype(f32)
    b = None if b_hn is None else b_hn.astype(f32)
    lengths = lengths.astype(jnp.int32)

    def step(state, inputs):
        x, t = inputs
        hw = jnp.dot(state[-1], w, precision=lax.Precision.HIGHEST)
        new = cell_step(cell, activation, state, x.astype(f32), hw, b)
        valid = (t < lengths)[:, None]
        state = tuple(jnp.where(valid, n, o) for n, o in zip(new, state))
        return state, tuple(jnp.where(valid, n, 0.0) for n in new)

    state0 = tuple(c.astype(f32) for c in carry)
    final, seqs = lax.scan(step, state0, (xp, jnp.arange(steps)), reverse=reverse)
    ys = seqs[-1].astype(dtype)
    final = tuple(c.astype(dtype) for c in final)
    if return_cell_states:
        return ys, final, seqs[0].astype(dtype)
    return ys, final
