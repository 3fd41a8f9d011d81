"""Reverse-mode autodiff of the recurrence: a custom VJP pairing the two primitives.

Forward-mode (jvp) is not defined: the backward handlers implement the VJP directly, so the
primitives themselves get a jvp rule that only explains this (JAX's default names no fix).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from jax_sprnn.primitives import lowering  # noqa: F401 (registers the lowerings)
from jax_sprnn.primitives import manual_axes
from jax_sprnn.primitives.explicit_sharding import like, share_batch
from jax_sprnn.primitives.recurrence import CELLS, backward_p, forward_p

DEFAULT_VARIANT = -1


def _forward(cell, reverse, activation, xp, lengths, values, col_idx, row_ptr, carry, b_hn):
    extras = (b_hn,) if CELLS[cell].has_b_hn else ()
    return forward_p.bind(xp, lengths, values, col_idx, row_ptr, *carry, *extras, cell=cell,
                          reverse=reverse, activation=activation, variant=DEFAULT_VARIANT,
                          local=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _recurrence(cell, reverse, activation, xp, lengths, values, col_idx, row_ptr, carry, b_hn):
    outs = _forward(cell, reverse, activation, xp, lengths, values, col_idx, row_ptr, carry,
                    b_hn)
    n_carry = len(CELLS[cell].carry)
    return outs[0], tuple(outs[1:1 + n_carry])


def _recurrence_fwd(cell, reverse, activation, xp, lengths, values, col_idx, row_ptr, carry,
                    b_hn):
    outs = _forward(cell, reverse, activation, xp, lengths, values, col_idx, row_ptr, carry,
                    b_hn)
    n_carry = len(CELLS[cell].carry)
    ys, final, cell_states = outs[0], tuple(outs[1:1 + n_carry]), tuple(outs[1 + n_carry:])
    residuals = (xp, lengths, values, col_idx, row_ptr, carry, b_hn, ys, cell_states)
    return (ys, final), residuals


def _recurrence_bwd(cell, reverse, activation, residuals, cotangents):
    xp, lengths, values, col_idx, row_ptr, carry, b_hn, ys, cell_states = residuals
    dys, dcarry = cotangents
    extras = (b_hn,) if CELLS[cell].has_b_hn else ()
    grads = backward_p.bind(xp, lengths, values, col_idx, row_ptr, *carry, *extras, ys,
                            *cell_states, dys, *dcarry, cell=cell, reverse=reverse,
                            activation=activation, groups=1, local=False)
    n_carry = len(carry)
    # Under an explicit mesh each gradient must be typed as its primal (a replicated carry's
    # gradient comes out batch-sharded, like xp's).
    dxp, dvalues = like(grads[0], xp), like(grads[1][0], values)
    dcarry0 = tuple(like(g, c) for g, c in zip(grads[2:2 + n_carry], carry))
    db_hn = like(grads[2 + n_carry][0], b_hn) if extras else None
    return dxp, None, dvalues, None, None, dcarry0, db_hn


_recurrence.defvjp(_recurrence_fwd, _recurrence_bwd)


def _only_first_order_reverse(*_, **__):
    raise NotImplementedError(
        "jax_sprnn's recurrence is differentiable once, in reverse mode (jax.grad, vjp, "
        "jacrev); forward mode (jvp, jacfwd) and derivatives of derivatives (hessian, grad of "
        "grad) are not supported: use implementation='reference' for those")


for _primitive in (forward_p, backward_p):  # reached by hessian and grad of grad
    ad.primitive_jvps[_primitive] = _only_first_order_reverse


def sparse_recurrence(cell, xp, carry, w, lengths, b_hn=None, *, reverse=False, activation=0):
    """Runs the validated recurrence through the primitives. Returns (ys, carry_T)."""
    # The handlers take int32 patterns; hand-built weights may hold int64 (x64) or other ints.
    col_idx, row_ptr = (jnp.asarray(a, jnp.int32) for a in (w.col_idx, w.row_ptr))
    # Inside shard_map: results are typed by xp's manual axes, so every float operand must vary
    # over them too (outside the custom VJP, so replicated weights' gradients get their psum).
    xp, values, b_hn, *carry = manual_axes.vary_together(xp, w.values, b_hn, *carry)
    xp, lengths, *carry = share_batch(xp, lengths, *carry)
    return _recurrence(cell, bool(reverse), int(activation), xp, lengths, values, col_idx,
                       row_ptr, tuple(carry), b_hn)
