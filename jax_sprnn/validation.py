"""Input checks run before any kernel: every bad input becomes a clear Python error."""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from jax_sprnn.packing import LAYOUT_VERSION, check_packed_arrays
from jax_sprnn.weights import SparseWeights

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _dtype_name(dtypes) -> str:
    return ", ".join(str(d) for d in dtypes)


def check_dtype(name: str, x, dtype) -> None:
    if jnp.dtype(x.dtype) != dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but xp has dtype {dtype}; xp, the carry, "
                        "the kernel and b_hn must share one dtype")


def check_shape(name: str, x, shape) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_call(cell: str, xp, carry: tuple, w, b_hn=None, seq_lengths=None):
    """Validates a call's arguments. Returns the per-sequence lengths as an int32 array."""
    if not isinstance(w, SparseWeights):
        raise TypeError(f"w must be a jax_sprnn.SparseWeights, got {type(w).__name__}; "
                        "build one with SparseWeights.from_dense(kernel, mask)")
    gates = {"rnn": 1, "lstm": 4, "gru": 3}[cell]
    if w.gates != gates:
        raise ValueError(f"{cell} needs a kernel of shape (H, {gates}*H) but the weights have "
                         f"{w.gates} gate(s)")
    if np.ndim(w.values) != 1:
        raise ValueError("the weights have batch dimensions; one call takes one set of weights "
                         "(for several, an ensemble, jax.vmap the call over them)")
    if w.layout_version != LAYOUT_VERSION:
        raise ValueError(f"packed layout version {w.layout_version} is not supported (this "
                         f"build reads version {LAYOUT_VERSION}); repack with from_dense")
    if np.ndim(xp) != 3:
        raise ValueError(f"xp must be time-major (T, B, {gates}*H), got shape {np.shape(xp)}")
    dtype = jnp.dtype(xp.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}; supported: {_dtype_name(SUPPORTED_DTYPES)}")
    steps, batch, width = xp.shape
    hidden = w.hidden_size
    if width != gates * hidden:
        raise ValueError(f"xp's last axis is {width} but the weights need {gates}*H = "
                         f"{gates * hidden} (H = {hidden})")
    # The handlers check these too, but only as a JaxRuntimeError at run time.
    check_packed_arrays(w.col_idx, w.row_ptr, hidden, gates, w.nnz)
    names = ("c0", "h0") if cell == "lstm" else ("h0",)
    for name, c in zip(names, carry):
        check_shape(name, c, (batch, hidden))
        check_dtype(name, c, dtype)
    check_dtype("the kernel values", w.values, dtype)
    if cell == "gru":
        if b_hn is None:
            raise TypeError("gru needs b_hn, the hidden-side bias of the n gate, shape (H,); "
                            "pass zeros for a cell without one")
        check_shape("b_hn", b_hn, (hidden,))
        check_dtype("b_hn", b_hn, dtype)
    return check_lengths(seq_lengths, steps, batch)


def is_real_number(value) -> bool:
    """A Python, NumPy or JAX real scalar; not text or a bool (``float`` takes both)."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def as_fraction(name: str, value, not_a_number=TypeError) -> float:
    """A real number in [0, 1] (a density, a sparsity) as a float: ``not_a_number`` for text,
    bools and other non-numbers, ValueError outside the range (NaN too)."""
    if not is_real_number(value):
        raise not_a_number(f"{name} must be a number in [0, 1], got {value!r}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def as_int(name: str, value, minimum: int | None = None) -> int:
    """A Python, NumPy or JAX integer scalar as an int (not a bool): TypeError for other kinds,
    ValueError below ``minimum``."""
    expected = "an integer" if minimum is None else f"an integer >= {minimum}"
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {expected}, got {value!r}") from None
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return result


def check_flag(name: str, value) -> bool:
    """A static switch (reverse picks the kernel's direction): a bool, or the integer 0 or 1.

    Not ``bool(value)``: that would run ``"False"`` as True.
    """
    if isinstance(value, (bool, np.bool_)) or (
            isinstance(value, (int, np.integer)) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}; it is static, so under jit pass "
                    "it as a static argument")


def check_lengths(seq_lengths, steps: int, batch: int):
    if seq_lengths is None:
        return jnp.full((batch,), steps, jnp.int32)
    if not jnp.issubdtype(jnp.result_type(seq_lengths), jnp.integer):
        raise TypeError(f"seq_lengths must be integers, got {jnp.result_type(seq_lengths)}")
    check_shape("seq_lengths", seq_lengths, (batch,))
    if not isinstance(seq_lengths, jax.core.Tracer):
        values = np.asarray(seq_lengths)
        if values.size and (values.min() < 0 or values.max() > steps):
            raise ValueError(f"seq_lengths must lie in [0, T={steps}], got values in "
                             f"[{values.min()}, {values.max()}]")
    # Traced lengths cannot be checked here; the kernels clamp them to [0, T]. Integers past
    # int32's range (int64 under x64, uint32) are clamped first: the cast would wrap them.
    seq_lengths = jnp.asarray(seq_lengths)
    if jnp.iinfo(seq_lengths.dtype).max > jnp.iinfo(jnp.int32).max:
        seq_lengths = jnp.clip(seq_lengths, 0, steps)
    return seq_lengths.astype(jnp.int32)
