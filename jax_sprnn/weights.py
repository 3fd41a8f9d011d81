"""SparseWeights: a pruned recurrent kernel packed for the sparse persistent kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_sprnn import packing


def _concrete(x, what: str) -> np.ndarray:
    """NumPy value of x, or a clear error when x is traced."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"{what} must be concrete (a NumPy or JAX array outside jit), not a traced value; "
            "the sparsity pattern is fixed when the weights are packed."
        )
    return np.asarray(x)


def _check_bank_period(bank_period) -> None:
    if isinstance(bank_period, (bool, np.bool_)) or \
            not isinstance(bank_period, (int, np.integer)) or bank_period < 0:
        raise ValueError(f"bank_period must be an integer >= 0, got {bank_period!r}")


def _kernel_layout(kernel) -> tuple[int, int]:
    """(H, G) of a recurrent kernel (H, G*H), or a clear error for another shape or dtype."""
    shape = tuple(np.shape(kernel))
    if len(shape) != 2 or shape[0] < 1 or shape[1] % shape[0] != 0:
        raise ValueError(f"kernel must have shape (H, G*H) with H >= 1, got {shape}")
    hidden, gates = shape[0], shape[1] // shape[0]
    if gates not in packing.SUPPORTED_GATES:
        raise ValueError(
            f"kernel shape {shape} gives G={gates} gates; expected 1 (rnn), 4 (lstm) or 3 (gru)")
    if not jnp.issubdtype(jnp.result_type(kernel), jnp.floating):
        raise TypeError(f"kernel must be floating point, got {jnp.result_type(kernel)}")
    return hidden, gates


_LEAVES = ("values", "col_idx", "row_ptr")


# Keyed leaves, so tree paths read `.values` / `.col_idx` / `.row_ptr` (optax / orbax labels,
# JAX's error messages) instead of flat indices.
@jax.tree_util.register_pytree_with_keys_class
class SparseWeights:
    """A recurrent kernel ``(H, G*H)`` (Flax convention ``h @ kernel``) stored as sparse rows.

    Leaves: ``values`` (nnz,), ``col_idx`` (nnz,) int32, ``row_ptr`` (G*H+1,) int32, in the
    layout described in docs/INTERFACE.md. Gradients flow to ``values``; the pattern is static.
    """

    def __init__(self, values, col_idx, row_ptr, *, hidden_size: int, gates: int,
                 bank_period: int = packing.DEFAULT_BANK_PERIOD,
                 layout_version: int = packing.LAYOUT_VERSION):
        self.values = values
        self.col_idx = col_idx
        self.row_ptr = row_ptr
        self.hidden_size = hidden_size
        self.gates = gates
        self.bank_period = bank_period
        self.layout_version = layout_version

    # -- pytree ----------------------------------------------------------------------------
    def _aux(self):
        return self.hidden_size, self.gates, self.bank_period, self.layout_version

    def tree_flatten(self):
        return tuple(getattr(self, name) for name in _LEAVES), self._aux()

    def tree_flatten_with_keys(self):
        return (tuple((jax.tree_util.GetAttrKey(name), getattr(self, name)) for name in _LEAVES),
                self._aux())

    @classmethod
    def tree_unflatten(cls, aux, children):
        hidden_size, gates, bank_period, layout_version = aux
        return cls(*children, hidden_size=hidden_size, gates=gates, bank_period=bank_period,
                   layout_version=layout_version)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, kernel, mask=None, *, bank_period: int = packing.DEFAULT_BANK_PERIOD):
        """Packs the entries of ``kernel`` kept by ``mask`` (default: ``kernel != 0``).

        ``kernel`` may be traced when ``mask`` is given: gradients flow to the kept entries.
        ``mask`` must be a concrete boolean array of the kernel's shape. ``bank_period``: the
        bank-aware order's period (packing.bank_aware_order); 0 keeps column order.
        """
        _check_bank_period(bank_period)
        hidden, gates = _kernel_layout(kernel)
        if mask is None:
            try:
                mask_np = _concrete(kernel, "kernel (when mask is None)") != 0
            except TypeError as err:
                raise TypeError(f"{err} Pass an explicit concrete mask to pack a traced kernel.") \
                    from None
        else:
            mask_np = _concrete(mask, "mask")
            if mask_np.dtype != np.bool_:
                raise TypeError(f"mask must be a boolean array, got dtype {mask_np.dtype}")
            if mask_np.shape != (hidden, gates * hidden):
                raise ValueError(f"mask shape {mask_np.shape} differs from kernel shape "
                                 f"{(hidden, gates * hidden)}")
        return cls._from_packing(kernel, packing.pack_mask(mask_np, gates, bank_period),
                                 bank_period=bank_period)

    @classmethod
    def from_packed_mask(cls, kernel, packed, *,
                         bank_period: int = packing.DEFAULT_BANK_PERIOD):
        """The entries of ``kernel`` (H, G*H) at a mask packed before: ``packed`` is
        ``packing.pack_mask(mask, G, bank_period)``'s output, checked against the kernel's
        shape. A fixed mask packed once serves every call (packing an H=4096 LSTM mask takes
        seconds); ``kernel`` may be traced."""
        _check_bank_period(bank_period)
        hidden, gates = _kernel_layout(kernel)
        return cls._from_packing(
            kernel, packing.checked_mask_packing(packed, hidden, gates), bank_period=bank_period)

    @classmethod
    def _from_packing(cls, kernel, packed, *, bank_period: int = packing.DEFAULT_BANK_PERIOD):
        """``from_packed_mask`` without its checks, for callers that made ``packed`` from a
        mask of the kernel's shape themselves (``from_dense``, the Flax layers' every trace)."""
        col_idx, dense_col, row_ptr = packed
        values = jnp.asarray(kernel)[col_idx, dense_col]
        hidden = np.shape(kernel)[0]
        return cls(values, jnp.asarray(col_idx), jnp.asarray(row_ptr), hidden_size=hidden,
                   gates=np.shape(kernel)[1] // hidden, bank_period=bank_period)

    # -- properties ------------------------------------------------------------------------
    @property
    def nnz(self) -> int:
        return int(self.values.shape[-1])

    @property
    def density(self) -> float:
        return self.nnz / float(self.gates * self.hidden_size * self.hidden_size)

    @property
    def dtype(self):
        return self.values.dtype

    def __repr__(self):
        return (f"SparseWeights(hidden_size={self.hidden_size}, gates={self.gates}, "
                f"nnz={self.nnz}, density={self.density:.4f}, dtype={self.dtype})")

    def astype(self, dtype) -> "SparseWeights":
        """The same pattern with ``values`` cast to ``dtype`` (a ``jax.tree.map`` cast would
        cast the integer pattern too)."""
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"weights must be floating point, got dtype {jnp.dtype(dtype)}")
        return SparseWeights(jnp.asarray(self.values).astype(dtype), self.col_idx, self.row_ptr,
                             hidden_size=self.hidden_size, gates=self.gates,
                             bank_period=self.bank_period, layout_version=self.layout_version)

    def to_dense(self) -> jax.Array:
        """The dense ``(H, G*H)`` kernel (zeros where pruned)."""
        hidden, gates = self.hidden_size, self.gates
        if isinstance(self.row_ptr, jax.core.Tracer):
            rows = jnp.repeat(jnp.arange(gates * hidden, dtype=jnp.int32),
                              jnp.diff(self.row_ptr), total_repeat_length=self.nnz)
        else:  # concrete pattern: index on the host (XLA would constant-fold it slowly)
            rows = np.repeat(np.arange(gates * hidden, dtype=np.int32), np.diff(self.row_ptr))
        dense_col = (rows % gates) * hidden + rows // gates
        dense = jnp.zeros((hidden, gates * hidden), self.values.dtype)
        return dense.at[self.col_idx, dense_col].set(self.values)

    def validate(self) -> "SparseWeights":
        """Checks the packed layout on the host (needs concrete arrays). Returns self."""
        if self.layout_version != packing.LAYOUT_VERSION:
            raise ValueError(f"packed layout version {self.layout_version} is not supported "
                             f"(this build reads version {packing.LAYOUT_VERSION}); repack")
        if np.ndim(self.values) != 1:
            raise ValueError(f"values must be 1-D, got shape {np.shape(self.values)}")
        packing.validate_packed(_concrete(self.col_idx, "col_idx"),
                                _concrete(self.row_ptr, "row_ptr"),
                                self.hidden_size, self.gates, self.nnz)
        return self
