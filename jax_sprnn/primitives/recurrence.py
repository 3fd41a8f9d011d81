"""The two primitives (forward and backward recurrence): operand layout, shapes, batching.

Operands follow the FFI targets in docs/INTERFACE.md exactly, so lowering is a plain call.
Each operand and result has a *role* that says how vmap folds it into the batch axis:
  time:    (T, B, ...)    batch axis 1
  batch:   (B, ...)       batch axis 0
  shared:  weights, b_hn  one copy for all instances (when vmap maps them too, an ensemble,
                          the instances run one after another)
  grouped: (groups, ...)  per-instance weight gradients; vmap multiplies the groups
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.interpreters import batching, xla

from jax_sprnn.primitives.explicit_sharding import (axes_of, axis_sharding, replicate_axis,
                                                     reshard_axes, result_sharding)
from jax_sprnn.primitives.manual_axes import result_aval

TIME, BATCH, SHARED, GROUPED = "time", "batch", "shared", "grouped"
WEIGHTS = (SHARED, SHARED, SHARED)  # values, col_idx, row_ptr


@dataclasses.dataclass(frozen=True)
class CellSpec:
    gates: int
    carry: tuple  # names of the carry arrays, in API order
    has_b_hn: bool = False
    cell_states: bool = False  # forward also returns every step's cell state (lstm)


CELLS = {
    "rnn": CellSpec(1, ("h",)),
    "lstm": CellSpec(4, ("c", "h"), cell_states=True),
    "gru": CellSpec(3, ("h",), has_b_hn=True),
}
GATES = {name: spec.gates for name, spec in CELLS.items()}  # gate blocks per cell


def forward_roles(cell: str):
    spec = CELLS[cell]
    ins = (TIME, BATCH, *WEIGHTS) + (BATCH,) * len(spec.carry) + (SHARED,) * spec.has_b_hn
    outs = (TIME,) + (BATCH,) * len(spec.carry) + (TIME,) * spec.cell_states
    return ins, outs


def backward_roles(cell: str):
    spec = CELLS[cell]
    n_carry = len(spec.carry)
    ins = ((TIME, BATCH, *WEIGHTS) + (BATCH,) * n_carry + (SHARED,) * spec.has_b_hn
           + (TIME,) + (TIME,) * spec.cell_states      # ys, cs
           + (TIME,) + (BATCH,) * n_carry)             # dys, dcarry_T
    outs = (TIME, GROUPED) + (BATCH,) * n_carry + (GROUPED,) * spec.has_b_hn
    return ins, outs


def _result(xp, shape, dtype, batch_axis):
    """A result's abstract value, typed as the call runs: varying over xp's manual axes inside
    shard_map, sharded like xp's batch axis on its ``batch_axis`` under an explicit mesh."""
    aval = result_aval(xp, shape, dtype)
    sharding = result_sharding(xp, len(shape), batch_axis)
    return aval if sharding is None else aval.update(sharding=sharding)


# ---- forward ----------------------------------------------------------------------------------
forward_p = core.Primitive("sprnn_forward")
forward_p.multiple_results = True


def _forward_abstract_eval(xp, lengths, values, col_idx, row_ptr, *rest, cell, **_):
    steps, batch, _ = xp.shape
    hidden = rest[0].shape[-1]
    n_carry = len(CELLS[cell].carry)
    seq = _result(xp, (steps, batch, hidden), xp.dtype, 1)
    state = _result(xp, (batch, hidden), xp.dtype, 0)
    return [seq] + [state] * n_carry + [seq] * CELLS[cell].cell_states


forward_p.def_abstract_eval(_forward_abstract_eval)
forward_p.def_impl(functools.partial(xla.apply_primitive, forward_p))


# ---- backward ---------------------------------------------------------------------------------
backward_p = core.Primitive("sprnn_backward")
backward_p.multiple_results = True


def _backward_abstract_eval(xp, lengths, values, col_idx, row_ptr, *rest, cell, groups, **_):
    spec = CELLS[cell]
    carry = rest[:len(spec.carry)]
    outs = [_result(xp, xp.shape, xp.dtype, 1),
            _result(xp, (groups, values.shape[0]), values.dtype, None)]
    outs += [_result(xp, c.shape, c.dtype, 0) for c in carry]
    if spec.has_b_hn:
        b_hn = rest[len(spec.carry)]
        outs.append(_result(xp, (groups, b_hn.shape[0]), b_hn.dtype, None))
    return outs


backward_p.def_abstract_eval(_backward_abstract_eval)
backward_p.def_impl(functools.partial(xla.apply_primitive, backward_p))


# ---- vmap: fold the mapped axis into the batch axis -----------------------------------------
def _batch_axis(role):
    return 1 if role == TIME else 0


def _fold(x, dim, role, size, minor, inst):
    """Moves the vmapped axis next to the batch axis (after it when ``minor``) and merges the
    two. An unmapped operand is broadcast, its new axis sharded as the mapped ones (``inst``)
    under an explicit mesh."""
    if role == SHARED:
        return x
    axis = _batch_axis(role)
    at = axis + 1 if minor else axis
    if dim is None:
        x = jnp.broadcast_to(jnp.expand_dims(x, at), x.shape[:at] + (size,) + x.shape[at:])
        x = reshard_axes(x, {**axes_of(x), at: inst})
    else:
        x = jnp.moveaxis(x, dim, at)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _unfold(y, role, size, minor):
    axis = _batch_axis(role)
    if minor:
        return y.reshape(y.shape[:axis] + (-1, size) + y.shape[axis + 1:]), axis + 1
    return y.reshape(y.shape[:axis] + (size, -1) + y.shape[axis + 1:]), axis


def _unmapped_axis(dim, axis):
    """Where axis ``axis`` of the unbatched operand sits in the batched one (mapped at dim)."""
    return axis if dim is None or dim > axis else axis + 1


def _per_instance(primitive, args, dims, params):
    """One call per instance, in sequence: for weights that differ between instances.

    The recurrence cannot share one launch between different weights (each is held on chip), so
    lax.map runs the instances in turn; operands vmap does not map are passed to every call.
    """
    mapped = [i for i, d in enumerate(dims) if d is not None]

    def one(operands):
        full = list(args)
        for i, operand in zip(mapped, operands):
            full[i] = operand
        return primitive.bind(*full, **params)

    outs = jax.lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in mapped])
    return outs, [0] * len(outs)


def _make_batching_rule(primitive, roles_of):
    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        in_roles, out_roles = roles_of(params["cell"])
        if any(d is not None for d, r in zip(dims, in_roles) if r == SHARED):
            return _per_instance(primitive, args, dims, params)
        # Under an explicit mesh (explicit_sharding.py): the instances fold in after the batch
        # when only the batch axis is sharded (the merge JAX can type), except in the backward,
        # whose per-instance weight gradients need each instance's sequences together: there
        # the batch axis is replicated first. The results are then typed like xp.
        inst = None if dims[0] is None else axis_sharding(args[0], dims[0])
        batch = axis_sharding(args[0], _unmapped_axis(dims[0], 1))
        minor = batch is not None and inst is None and "groups" not in params
        if "groups" in params:
            params = dict(params, groups=params["groups"] * size)
            args = [a if r == SHARED else replicate_axis(a, _unmapped_axis(d, _batch_axis(r)))
                    for a, d, r in zip(args, dims, in_roles)]
        folded = [_fold(a, d, r, size, minor, inst) for a, d, r in zip(args, dims, in_roles)]
        outs = primitive.bind(*folded, **params)
        unfolded = [_unfold(y, r, size, minor) for y, r in zip(outs, out_roles)]
        return ([reshard_axes(y, {d: inst} if r == GROUPED else
                              {d: inst, d - 1 if minor else d + 1: batch})
                 for (y, d), r in zip(unfolded, out_roles)],
                [d for _, d in unfolded])

    return rule


batching.primitive_batchers[forward_p] = _make_batching_rule(forward_p, forward_roles)
batching.primitive_batchers[backward_p] = _make_batching_rule(backward_p, backward_roles)
