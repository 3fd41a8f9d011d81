"""Batch-parallel partitioning: under a mesh, every device runs the recurrence on its batch shard.

custom_partitioning with a Shardy rule where only the batch factor may be sharded; time,
hidden and weight axes stay replicated. Weight gradients are summed over the batch shards.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_sprnn.primitives.explicit_sharding import typed_explicitly
from jax_sprnn.primitives.recurrence import (BATCH, GROUPED, TIME, backward_p, backward_roles,
                                             forward_roles)


def _roles(primitive, cell):
    return (backward_roles if primitive is backward_p else forward_roles)(cell)


def _spec(role, ndim, batch_axes):
    if role == TIME:
        return PartitionSpec(None, batch_axes, *([None] * (ndim - 2)))
    if role == BATCH:
        return PartitionSpec(batch_axes, *([None] * (ndim - 1)))
    return PartitionSpec()


def _rule(in_roles, out_roles, in_ndims, out_ndims):
    """Einsum-like Shardy rule: 'b' is the batch factor, every other axis its own factor."""
    names = iter(f"f{i}" for i in range(1000))
    others = []

    def dims(role, ndim):
        out = []
        for axis in range(ndim):
            if (role == TIME and axis == 1) or (role == BATCH and axis == 0):
                out.append("b")
            else:
                others.append(next(names))
                out.append(others[-1])
        return " ".join(out)

    lhs = ", ".join(dims(r, n) for r, n in zip(in_roles, in_ndims))
    rhs = ", ".join(dims(r, n) for r, n in zip(out_roles, out_ndims))
    return f"{lhs} -> {rhs}", tuple(others)


def _sum_over_shards(x, axes, explicit):
    """The sum of x over the shards of mesh axes ``axes``. Under an explicit mesh, jax 0.11
    lowers psum's reduction with sharding annotations that XLA's CPU all-reduce rejects
    ("Unsupported reduction computation"), so there the shards' values are gathered and added."""
    if explicit:
        return jax.lax.all_gather(x, axes).sum(0)
    return jax.lax.psum(x, axes)


@functools.lru_cache(maxsize=None)
def _partitioned_function(primitive, params_items, in_ndims, out_ndims, explicit):
    params = dict(params_items)
    in_roles, out_roles = _roles(primitive, params["cell"])

    def local_call(*operands):
        return primitive.bind(*operands, local=True, **params)

    def partition(mesh, arg_shapes, result_shape):
        # xp / (T, B, ...): take its batch axis. A sharding without a spec (a GSPMDSharding,
        # e.g. inside a partially manual shard_map) keeps the batch whole.
        spec = getattr(arg_shapes[0].sharding, "spec", ())
        batch_axes = spec[1] if len(spec) > 1 else None
        if params.get("groups", 1) > 1:
            batch_axes = None  # per-instance weight gradients: keep the batch whole
        arg_shardings = tuple(NamedSharding(mesh, _spec(r, a.ndim, batch_axes))
                              for r, a in zip(in_roles, arg_shapes))
        result_shardings = [NamedSharding(mesh, _spec(r, s.ndim, batch_axes))
                            for r, s in zip(out_roles, result_shape)]

        def lower_fn(*operands):
            outs = local_call(*operands)
            if batch_axes is None:
                return outs
            # Weight gradients of each shard are partial sums over its batch rows.
            return [_sum_over_shards(o, batch_axes, explicit) if r == GROUPED else o
                    for o, r in zip(outs, out_roles)]

        return mesh, lower_fn, result_shardings, arg_shardings

    function = custom_partitioning(local_call)
    rule, replicated = _rule(in_roles, out_roles, in_ndims, out_ndims)
    function.def_partition(partition=partition, sharding_rule=rule,
                           need_replication_factors=replicated)
    return function


def partitioned(primitive, params, *operands):
    """Calls ``primitive`` (local=True) through custom partitioning over the batch axis."""
    _, out_roles = _roles(primitive, params["cell"])
    out_ndims = tuple(3 if r == TIME else 2 for r in out_roles)  # (T,B,H) or (B|groups, .)
    # The partition callback sees only Auto meshes, so the caller's typing is read here.
    function = _partitioned_function(primitive, tuple(sorted(params.items())),
                                     tuple(o.ndim for o in operands), out_ndims,
                                     typed_explicitly(operands[0]))
    return function(*operands)
