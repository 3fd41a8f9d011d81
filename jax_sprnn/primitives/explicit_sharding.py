"""Types under a mesh in explicit sharding mode (``AxisType.Explicit``).

There JAX types every value with its sharding and checks it. The call runs shard by shard over
xp's batch axis (sharding.py), so a result's batch axis has xp's batch sharding and every other
axis is replicated; the abstract evals say so through ``result_sharding``, after
``share_batch`` has given xp, lengths and carry one batch sharding. Under any other mesh (or
none) nothing changes and the results carry the default type.

vmap folds its axis into the batch axis (recurrence.py): when only the batch axis is sharded, the
instances go minor to it (a reshape JAX can type); the backward, whose weight gradients are per
contiguous group of instances, first replicates the batch axis (``replicate_axis``).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec


def _aval(x):
    return x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)


def _explicit_mesh(aval):
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    return mesh if mesh is not None and getattr(mesh, "explicit_axes", ()) else None


def typed_explicitly(x) -> bool:
    """Whether ``x`` (a value or an abstract value) is typed by an explicit mesh."""
    return _explicit_mesh(_aval(x)) is not None


def axis_sharding(x, axis: int):
    """The explicit mesh axes that dimension ``axis`` of ``x`` (a value or an abstract value)
    is sharded over, or None (not sharded, or no explicit mesh)."""
    aval = _aval(x)
    if _explicit_mesh(aval) is None:
        return None
    spec = aval.sharding.spec
    return spec[axis] if axis < len(spec) else None


def axes_of(x) -> dict:
    """Dimension -> the explicit mesh axes it is sharded over (None: not sharded), for every
    dimension of ``x``."""
    return {d: axis_sharding(x, d) for d in range(x.ndim)}


def result_sharding(xp, ndim: int, batch_axis: int | None):
    """A result's sharding under an explicit mesh: xp's batch sharding (xp is (T, B, ...)) on
    its ``batch_axis`` (None: no batch axis), the rest replicated. None elsewhere."""
    mesh = _explicit_mesh(xp)
    if mesh is None:
        return None
    spec = [None] * ndim
    if batch_axis is not None:
        spec[batch_axis] = axis_sharding(xp, 1)
    return NamedSharding(mesh, PartitionSpec(*spec))


def reshard_axes(x, axes: dict, mesh=None):
    """``x`` with each dimension d sharded over ``axes.get(d)`` (None: replicated), where an
    explicit mesh types it (or on ``mesh``, an explicit abstract mesh); else ``x`` itself."""
    own = _explicit_mesh(jax.typeof(x))
    if own is None and mesh is None:
        return x
    want = {d: axes.get(d) for d in range(x.ndim)}
    if own is not None and axes_of(x) == want:
        return x
    return jax.sharding.reshard(x, NamedSharding(own or mesh, PartitionSpec(*want.values())))


def replicate_axis(x, axis: int):
    """``x`` with dimension ``axis`` replicated (its shards gathered) and the others as they
    are, under an explicit mesh; else ``x`` itself."""
    return reshard_axes(x, {**axes_of(x), axis: None})


def like(x, ref):
    """``x`` with ``ref``'s sharding, where an explicit mesh types ``ref``; else ``x``."""
    aval = jax.typeof(ref)
    spec = tuple(aval.sharding.spec) if _explicit_mesh(aval) else ()
    return reshard_axes(x, dict(enumerate(spec)))


def _mesh_axes(entry) -> set:
    return set() if entry is None else set(entry if isinstance(entry, tuple) else (entry,))


def share_batch(xp, *batch_major):
    """xp and the batch-major operands (lengths, carry) resharded to one batch sharding: xp's,
    else the first sharded operand's (as JAX's own ops combine a replicated operand with a
    sharded one), where an explicit mesh types any of them; else unchanged. Other axes keep
    their sharding unless it uses the batch's mesh axes. The results are typed by xp's batch
    axis (``result_sharding``), so the call then runs as typed."""
    operands = (xp, *batch_major)
    mesh = next((m for m in map(_explicit_mesh, map(_aval, operands)) if m is not None), None)
    # Eager calls (no tracer) run as one jitted primitive each, typed as they come out.
    if mesh is None or not any(isinstance(x, jax.core.Tracer) for x in operands):
        return operands
    candidates = [axis_sharding(xp, 1)] + [axis_sharding(x, 0) for x in batch_major]
    batch = next((c for c in candidates if c is not None), None)

    def with_batch(x, axis):
        axes = {d: None if _mesh_axes(a) & _mesh_axes(batch) else a
                for d, a in axes_of(x).items()}
        return reshard_axes(x, {**axes, axis: batch}, mesh)

    return (with_batch(xp, 1), *(with_batch(x, 0) for x in batch_major))
