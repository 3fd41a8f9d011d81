"""Lowering of the primitives: through custom partitioning, then to each platform's handler.

forward_p/backward_p with ``local=False`` lower through ``sharding.partitioned`` (so a batch
sharded over a mesh runs shard by shard); the per-shard call binds ``local=True``, which lowers
to the C++ handler on CPU, the CUDA kernel on GPU, or the pure-JAX fallback (on every other
platform: ROCm, TPU, ...).
"""

from __future__ import annotations

import functools

import jax
from jax._src import dispatch  # no public equivalent; see below
from jax.interpreters import mlir

from jax_sprnn import _ffi
from jax_sprnn.primitives import cuda_lowering, jax_fallback, sharding
from jax_sprnn.primitives.recurrence import backward_p, forward_p


def _attributes(cell, reverse, activation, **extra):
    attrs = dict(reverse=reverse, **extra)
    if cell == "rnn":
        attrs["activation"] = activation
    return attrs


def _forward_cpu(ctx, *operands, cell, reverse, activation, variant):
    return jax.ffi.ffi_lowering(f"sprnn_{cell}_fwd")(
        ctx, *operands, **_attributes(cell, reverse, activation, variant=variant))


def _backward_cpu(ctx, *operands, cell, reverse, activation, groups):
    return jax.ffi.ffi_lowering(f"sprnn_{cell}_bwd")(
        ctx, *operands, **_attributes(cell, reverse, activation, groups=groups))


def _pure_jax(function, ctx, *operands, **params):
    """Lowers ``function`` (jax_fallback.forward or .backward) in place of a handler."""
    return mlir.lower_fun(functools.partial(function, **params), multiple_results=True)(
        ctx, *operands)


def _forward_cuda(ctx, *operands, cell, **params):
    if cuda_lowering.available(cell):
        return cuda_lowering.forward_lowering(ctx, *operands, cell=cell, **params)
    cuda_lowering.warn_once(
        "no CUDA extension", f"jax_sprnn's CUDA extension {_ffi.why_missing('_sprnn_cuda')}: "
        "GPU calls run the pure-JAX lax.scan fallback. Rebuild with nvcc on PATH (see "
        "BUILD_NOTES.md) for the sparse persistent kernel.", RuntimeWarning)
    return _pure_jax(jax_fallback.forward, ctx, *operands, cell=cell, **params)


def _forward_elsewhere(ctx, *operands, **params):
    """Platforms without a handler of ours (ROCm, TPU, ...): the pure-JAX fallback, warned once
    per platform, so that a model with sparse layers still runs there (at dense speed)."""
    platforms = ", ".join(ctx.module_context.platforms)
    cuda_lowering.warn_once(
        ("no kernel", platforms), f"jax_sprnn has no kernel for {platforms} (only CPU and CUDA "
        "GPUs): its calls run the pure-JAX lax.scan fallback there, correct but at the speed "
        "of a dense recurrence.", RuntimeWarning)
    return _pure_jax(jax_fallback.forward, ctx, *operands, **params)


def _dispatch(primitive, platform_rule):
    """Lowering rule: partitioned call when local=False, else the platform handler."""

    def rule(ctx, *operands, local, **params):
        if not local and _DEVICES_AT_LOWERING is not None:
            fun = functools.partial(sharding.partitioned, primitive, params)
            return mlir.lower_fun(fun, multiple_results=True)(ctx, *operands)
        return platform_rule(ctx, *operands, **params)

    return rule


def _require_cpu(rule):
    def checked(ctx, *operands, **params):
        _ffi.require_cpu_extension()
        return rule(ctx, *operands, **params)

    return checked


# custom_partitioning's lowering needs the device assignment, which JAX only passes to
# lowerings of primitives in this set (JAX's cuDNN attention registers itself the same way).
# Without it (a future JAX), the primitives lower unpartitioned: correct, but not sharded.
_DEVICES_AT_LOWERING = getattr(dispatch, "prim_requires_devices_during_lowering", None)
if _DEVICES_AT_LOWERING is not None:
    _DEVICES_AT_LOWERING.update({forward_p, backward_p})

mlir.register_lowering(forward_p, _dispatch(forward_p, _require_cpu(_forward_cpu)),
                       platform="cpu")
mlir.register_lowering(backward_p, _dispatch(backward_p, _require_cpu(_backward_cpu)),
                       platform="cpu")
mlir.register_lowering(forward_p, _dispatch(forward_p, _forward_cuda), platform="cuda")
# The backward has no CUDA handler: pure JAX on GPUs as on every other platform.
_backward_pure_jax = functools.partial(_pure_jax, jax_fallback.backward)
mlir.register_lowering(backward_p, _dispatch(backward_p, _backward_pure_jax), platform="cuda")
# Every other platform (no platform argument: the default rule).
mlir.register_lowering(forward_p, _dispatch(forward_p, _forward_elsewhere))
mlir.register_lowering(backward_p, _dispatch(backward_p, _backward_pure_jax))
