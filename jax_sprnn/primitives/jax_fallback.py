"""Pure-JAX implementations of both primitives, operand for operand.

Lowered where no compiled handler exists (the backward on GPU, the forward on GPUs without the
CUDA extension, both on platforms other than CPU and CUDA), so every platform gets correct
results.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sprnn import reference
from jax_sprnn.primitives.recurrence import CELLS
from jax_sprnn.weights import SparseWeights


def _split(cell, rest):
    n_carry = len(CELLS[cell].carry)
    carry, rest = tuple(rest[:n_carry]), rest[n_carry:]
    b_hn, rest = (rest[0], rest[1:]) if CELLS[cell].has_b_hn else (None, rest)
    return carry, b_hn, rest


def _run(cell, reverse, activation, xp, lengths, values, col_idx, row_ptr, carry, b_hn,
         cell_states=False):
    hidden = carry[0].shape[-1]
    kernel = SparseWeights(values, col_idx, row_ptr, hidden_size=hidden,
                           gates=CELLS[cell].gates).to_dense()
    return reference.recurrence(cell, xp, carry, kernel, jnp.clip(lengths, 0, xp.shape[0]),
                                b_hn, reverse=reverse, activation=activation,
                                return_cell_states=cell_states)


def forward(xp, lengths, values, col_idx, row_ptr, *rest, cell, reverse, activation, **_):
    carry, b_hn, _ = _split(cell, rest)
    if CELLS[cell].cell_states:
        ys, final, cs = _run(cell, reverse, activation, xp, lengths, values, col_idx, row_ptr,
                             carry, b_hn, cell_states=True)
        return [ys, *final, cs]
    ys, final = _run(cell, reverse, activation, xp, lengths, values, col_idx, row_ptr, carry,
                     b_hn)
    return [ys, *final]


def backward(xp, lengths, values, col_idx, row_ptr, *rest, cell, reverse, activation, groups,
             **_):
    """VJP of the reference (recomputing the forward), with per-group weight gradients."""
    spec = CELLS[cell]
    carry, b_hn, rest = _split(cell, rest)
    rest = rest[1 + spec.cell_states:]  # drop the saved ys (and cs): the reference recomputes
    dys, dcarry = rest[0], tuple(rest[1:])
    batch = xp.shape[1]

    def one_group(xp, lengths, carry, dys, dcarry):
        def f(xp, carry, values, b_hn):
            return _run(cell, reverse, activation, xp, lengths, values, col_idx, row_ptr,
                        carry, b_hn)

        _, vjp = jax.vjp(f, xp, carry, values, b_hn)
        return vjp((dys, dcarry))

    def grouped(x, axis):
        return x.reshape(x.shape[:axis] + (groups, batch // groups) + x.shape[axis + 1:])

    dxp, dcarry0, dvalues, db_hn = jax.vmap(one_group, in_axes=(1, 0, 0, 1, 0))(
        grouped(xp, 1), grouped(lengths, 0), tuple(grouped(c, 0) for c in carry),
        grouped(dys, 1), tuple(grouped(c, 0) for c in dcarry))
    dxp = jnp.moveaxis(dxp, 0, 1).reshape(xp.shape)
    dcarry0 = [c.reshape(c.shape[0] * c.shape[1], -1) for c in dcarry0]
    outs = [dxp, dvalues, *dcarry0]
    if spec.has_b_hn:
        outs.append(db_hn)
    return outs
