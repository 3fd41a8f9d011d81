"""The functional API: sparse rnn / lstm / gru over a precomputed input projection.

Arguments shared by the three functions:

- ``xp``: ``(T, B, G*H)``, time-major: ``x_t @ W_x + b`` for every step, the input-side biases
  included (G = 1 rnn, 4 lstm, 3 gru, in the cell's gate order).
- ``w``: :class:`SparseWeights` of the recurrent kernel ``(H, G*H)`` (``pre = h @ kernel``).
- ``seq_lengths``: ``(B,)`` integers in ``[0, T]`` or None (all T). Sequence ``b`` runs the
  steps ``t < L_b``; ``ys`` is 0 at the others and the returned carry is the state after the
  last valid step (the initial one if ``L_b = 0``). Traced lengths are clamped to ``[0, T]``.
- ``reverse``: a static bool; True runs ``t = L_b - 1 .. 0`` and writes ``ys`` in place.
- ``implementation``: "auto" (the compiled kernel of the platform; the pure-JAX fallback with a
  warning where none was built), "kernel" (the compiled kernel or an error) or "reference"
  (the dense ``lax.scan``).

xp, the carry, the kernel values and b_hn share one dtype (float32, bfloat16 or float16);
accumulation is float32. Bad shapes, dtypes or lengths raise before anything runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_sprnn import _ffi, reference, validation
from jax_sprnn.primitives import autodiff  # registers the primitives' lowerings
from jax_sprnn.weights import SparseWeights

# "auto": the compiled handler of the platform, or the pure-JAX fallback (with a warning) where
# none was built; "kernel": the compiled handler or an error; "reference": the dense lax.scan.
IMPLEMENTATIONS = ("auto", "kernel", "reference")


def _require_compiled_kernel():
    backend = jax.default_backend()
    extension = {"gpu": "_sprnn_cuda", "cpu": "_sprnn_cpu"}.get(backend)
    targets = _ffi.CUDA_TARGETS if backend == "gpu" else _ffi.CPU_TARGETS
    if extension is None or not targets:
        why = "" if extension is None else f": its extension {_ffi.why_missing(extension)}"
        raise RuntimeError(f"implementation='kernel' needs jax_sprnn's compiled handler for the "
                           f"{backend!r} backend, which this build does not have{why} "
                           "(see BUILD_NOTES.md)")


def _as_array(x):
    """An array argument as given; a (nested) list becomes one array, keeping its own dtype."""
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return x
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x)):
        return jnp.asarray(x)  # e.g. a list of traced steps; NumPy cannot hold tracers
    return np.asarray(x)


def _run(cell, xp, carry, w, b_hn, seq_lengths, reverse, activation, implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    # Validate the caller's own dtypes: converting first would silently turn float64 to float32.
    # Whole arguments, not their leaves: a list h0 is one array, not a list of scalars.
    xp, carry = _as_array(xp), tuple(_as_array(c) for c in carry)
    b_hn, seq_lengths = (None if x is None else _as_array(x) for x in (b_hn, seq_lengths))
    lengths = validation.check_call(cell, xp, carry, w, b_hn, seq_lengths)
    reverse = validation.check_flag("reverse", reverse)
    xp, carry, b_hn = jax.tree.map(jnp.asarray, (xp, carry, b_hn))
    steps, batch, _ = xp.shape
    if steps == 0 or batch == 0:  # nothing to run: empty outputs, carry unchanged
        return jnp.zeros((steps, batch, w.hidden_size), xp.dtype), carry
    if implementation == "kernel":
        _require_compiled_kernel()
    if implementation == "reference":
        return reference.recurrence(cell, xp, carry, w.to_dense(), lengths, b_hn,
                                    reverse=reverse, activation=activation)
    return autodiff.sparse_recurrence(cell, xp, carry, w, lengths, b_hn,
                                      reverse=reverse, activation=activation)


def rnn(xp, h0, w: SparseWeights, activation: str = "tanh", seq_lengths=None, reverse=False, *,
        implementation: str = "auto"):
    """Simple RNN (Flax's SimpleCell): ``h' = act(xp_t + h @ W)``, act "tanh" or "relu".

    xp (T, B, H), h0 (B, H); the other arguments as in ``help(jax_sprnn.api)``.
    Returns ``(ys (T, B, H), h_T)``.
    """
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"activation must be 'tanh' or 'relu', got {activation!r}")
    ys, (h,) = _run("rnn", xp, (h0,), w, None, seq_lengths, reverse,
                    reference.ACTIVATIONS[activation], implementation)
    return ys, h


def lstm(xp, carry, w: SparseWeights, seq_lengths=None, reverse=False, *,
         implementation: str = "auto"):
    """LSTM (Flax's LSTMCell): gates i, f, g, o; ``c' = sigmoid(f) c + sigmoid(i) tanh(g)``,
    ``h' = sigmoid(o) tanh(c')``.

    xp (T, B, 4H), carry ``(c0, h0)`` (c first, as in Flax), each (B, H); the other arguments
    as in ``help(jax_sprnn.api)``. Returns ``(ys (T, B, H), (c_T, h_T))``.
    """
    if not isinstance(carry, (tuple, list)) or len(carry) != 2:
        raise TypeError("lstm's carry must be a pair (c, h), c first as in Flax's LSTM cells")
    ys, (c, h) = _run("lstm", xp, tuple(carry), w, None, seq_lengths, reverse, 0, implementation)
    return ys, (c, h)


def gru(xp, h0, w: SparseWeights, b_hn, seq_lengths=None, reverse=False, *,
        implementation: str = "auto"):
    """GRU (Flax's GRUCell): gates r, z, n; ``n = tanh(xp_n + r * (h @ W_n + b_hn))``,
    ``h' = (1 - z) n + z h``.

    xp (T, B, 3H), h0 (B, H), b_hn (H,) the hidden-side bias of n (zeros for none); the other
    arguments as in ``help(jax_sprnn.api)``. Returns ``(ys (T, B, H), h_T)``.
    """
    ys, (h,) = _run("gru", xp, (h0,), w, b_hn, seq_lengths, reverse, 0, implementation)
    return ys, h
