"""Types under a mesh in explicit sharding mode (``AxisType.Explicit``).

There JAX types every value with its sharding and checks it. The call runs shard by shard over
xp's batch axis (sharding.py), so a result's batch axis has xp's batch sharding and every other
axis is replicated; the abstract evals say so through ``result_sharding``. Under any other mesh
(or none) it gives None and the results carry the default type, as before.

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


def reshard_axes(x, axes: dict):
    """``x`` with each dimension d sharded over ``axes.get(d)`` (None: replicated), where an
    explicit mesh types it; else ``x`` itself."""
    aval = jax.typeof(x)
    if _explicit_mesh(aval) is None:
        return x
    want = tuple(axes.get(d) for d in range(x.ndim))
    have = tuple(aval.sharding.spec) + (None,) * (x.ndim - len(aval.sharding.spec))
    return x if have == want else jax.sharding.reshard(x, PartitionSpec(*want))


def replicate_axis(x, axis: int):
    """``x`` with dimension ``axis`` replicated (its shards gathered) and the others as they
    are, under an explicit mesh; else ``x`` itself."""
    return reshard_axes(x, {d: axis_sharding(x, d) for d in range(x.ndim) if d != axis})


def like(x, ref):
    """``x`` with ``ref``'s sharding, where an explicit mesh types ``ref``; else ``x``."""
    aval = jax.typeof(ref)
    spec = tuple(aval.sharding.spec) if _explicit_mesh(aval) else ()
    return reshard_axes(x, dict(enumerate(spec)))
