"""Types inside ``shard_map``: which manual mesh axes a value varies over.

With ``check_vma`` (shard_map's default) JAX types every value by the manual axes it varies
over, and autodiff relies on it: the transpose of "invariant -> varying" is a psum, which is
how the gradient of replicated weights gets summed over the shards. The primitives' results
therefore carry their operands' axes, and their operands are made to agree first (the way
JAX's own primitives insert these casts). Outside shard_map every set here is empty and
nothing changes.

The attribute holding the axes moved between JAX versions (``vma``, then
``manual_axis_type.varying``), so it is read through one helper.
"""

from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
    """The manual mesh axes that ``x`` (a value or an abstract value) varies over."""
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def result_aval(operand, shape, dtype) -> jax.core.ShapedArray:
    """A result's abstract value: varying over the same manual axes as ``operand``."""
    if not varying_axes(operand):
        return jax.core.ShapedArray(shape, dtype)
    return operand.update(shape=shape, dtype=dtype, weak_type=False)


def vary_together(*arrays):
    """The arrays (None kept), each cast to vary over every manual axis any of them varies over.

    A no-op cast on the data; it types e.g. replicated weights as per-shard operands of a
    batch-sharded call, so their gradient comes back summed over the shards.
    """
    axes = frozenset().union(*(varying_axes(a) for a in arrays if a is not None))
    if not axes:
        return arrays

    def cast(a):
        missing = axes - varying_axes(a)
        return jax.lax.pcast(a, tuple(sorted(missing)), to="varying") if missing else a

    return tuple(None if a is None else cast(a) for a in arrays)
