"""CUDA lowering of the forward primitive onto the sparse persistent kernel (csrc/cuda/).

Owned by the kernel work: it decides the kernel variant, the workspace the kernel needs and
the fallback when a layer does not fit on chip. ``forward_lowering`` is registered for the
"cuda" platform by jax_sprnn/primitives/lowering.py when the CUDA extension is built.
"""

from __future__ import annotations

import jax

from jax_sprnn import _ffi


def available(cell: str) -> bool:
    return f"sprnn_{cell}_fwd" in _ffi.CUDA_TARGETS


def forward_lowering(ctx, *operands, cell: str, reverse: bool, activation: int, variant: int):
    """Lowers the forward primitive to the CUDA FFI target; results as the primitive's outputs."""
    attrs = dict(reverse=reverse, variant=variant)
    if cell == "rnn":
        attrs["activation"] = activation
    return jax.ffi.ffi_lowering(f"sprnn_{cell}_fwd")(ctx, *operands, **attrs)
