"""Host-side packing of a boolean mask into the kernel's CSR layout (docs/INTERFACE.md).

All of this runs once per layer on concrete NumPy arrays, vectorized over every nonzero and with
one sort, so packing an H=4096 LSTM at 10% (67M mask entries) takes about 3.5 s on 2 cores.
"""

from __future__ import annotations

import numpy as np

LAYOUT_VERSION = 1
DEFAULT_BANK_PERIOD = 16
SUPPORTED_GATES = (1, 3, 4)


def packed_row_to_dense_column(rows: np.ndarray, hidden: int, gates: int) -> np.ndarray:
    """Packed row r = u*G + g holds the dense kernel column g*H + u."""
    return (rows % gates) * hidden + rows // gates


def _exclusive_cumsum(a: np.ndarray) -> np.ndarray:
    """Per row of a (rows, classes) array: the sum over the classes before each one."""
    return np.cumsum(a, axis=1) - a


def _round_robin_positions(q: np.ndarray, n: np.ndarray, P: int) -> np.ndarray:
    """Positions of the plain round-robin deal of a row's n nonzeros (ranks q) over its
    m = ceil(n / P) groups: the first `last * m` go one per group in turn, the rest fill the
    m - 1 full groups' remaining slots."""
    m = -(-n // P)
    last = n - P * (m - 1)
    m_minus = np.maximum(m - 1, 1)
    q2 = q - last * m
    return np.where(q < last * m, (q % m) * P + q // m,
                    (q2 % m_minus) * P + last + q2 // m_minus)


def bank_aware_order(row_of: np.ndarray, cols: np.ndarray, period: int) -> np.ndarray:
    """Permutation of nonzeros (sorted by row) that spreads each row's columns over banks.

    What it optimizes: a warp's lanes read ``h[col]`` for ``period`` consecutive nonzeros of a
    row at once (an aligned group). The shared memory serves such a read in as many passes
    (wavefronts) as the largest number of the group's columns that share a residue
    ``col mod period`` (a bank). The order minimizes the row's total passes, the sum over its
    groups of that largest multiplicity.

    Why it is optimal: with F full groups, a residue class of k members needs at least k - F
    groups holding two of it, and a class of k < F members leaves F - k groups that must hold a
    duplicate of some other class instead. So at least D = max over classes of |k - F| groups
    cost two passes, whatever the order. The construction reaches that bound: F - D "single"
    groups take one member of every class (placed in residue order), and the D "double"
    groups share the rest, dealt round-robin in residue order, at most two per class each. The
    last, partial group (n mod period members) takes one member from each of the largest
    classes first. (Rows where some class exceeds 2F, or too few distinct classes remain for
    the partial group, get the plain round-robin deal.) On random masks this takes the 8-byte
    gathers from 1.50-1.59x the conflict-free passes (the round-robin deal used before session
    7) to 1.26-1.31x, against a bound of 1.22-1.27x (benchmarks/NOTES.md, session 7). The
    time on the H200 changed by under 1% (the rows there are bound by instruction issue).

    How the CUDA kernel reads it (csrc/cuda/rows.cuh): one warp (or half warp) per
    packed row, the row's k-th nonzero on lane k % 32 (k % 16), and h in shared memory as
    h[col][batch tile]. With the default period 16 and an fp16/bf16 batch tile of 4 (8-byte
    loads, served per half warp) a single group's 16 lanes read 16 distinct 8-byte bank pairs.
    For 16-byte loads (float32 tile of 4, 16-bit tile of 8; served 8 lanes at a time) a single
    group's residue order puts 0..7 and 8..15 in its two halves, also distinct mod 8.

    ``row_of`` must be non-decreasing. Returns indices into the inputs.
    """
    n_total = row_of.shape[0]
    if n_total == 0 or period <= 1:
        return np.arange(n_total)
    P = period
    # Compact row index r of every nonzero (rows are contiguous, so sorting within rows keeps it).
    first = np.flatnonzero(np.r_[True, row_of[1:] != row_of[:-1]])
    r = np.repeat(np.arange(first.size), np.diff(np.r_[first, n_total]))
    # Residue-sorted within each row, columns in input order within a residue (one int64 sort
    # key: several times faster than a lexsort of row, residue and column).
    by_residue = np.argsort(r * P + cols % P, kind="stable")
    res = cols[by_residue] % P
    # Per-row class counts (rows, P).
    counts = np.bincount(r * P + res, minlength=first.size * P).reshape(-1, P)
    n = counts.sum(axis=1)
    full = n // P
    part = n - P * full
    q = np.arange(n_total) - first[r]  # rank within the row, in residue order
    class_start = _exclusive_cumsum(counts)
    j = q - class_start[r, res]  # rank within the residue class

    # The partial group: the last member of each of the `part` largest classes.
    by_size = np.argsort(-counts, axis=1, kind="stable")
    size_rank = np.empty_like(by_size)
    np.put_along_axis(size_rank, by_size, np.arange(P)[None, :], axis=1)
    chosen = (size_rank < part[:, None]) & (counts > 0)
    rest = counts - chosen
    doubles = np.minimum(np.abs(rest - full[:, None]).max(axis=1), full)
    singles = full - doubles
    to_doubles = rest - singles[:, None]
    fallback = (chosen.sum(axis=1) < part) | (to_doubles.max(axis=1) > 2 * doubles)

    is_partial = chosen[r, res] & (j == counts[r, res] - 1)
    is_single = ~is_partial & (j < singles[r])
    t = _exclusive_cumsum(to_doubles)[r, res] + j - singles[r]
    d = np.maximum(doubles[r], 1)
    position = np.where(
        is_partial, P * full[r] + _exclusive_cumsum(chosen)[r, res],
        np.where(is_single, P * (doubles[r] + j) + res, P * (t % d) + t // d))
    dealt = np.flatnonzero(fallback[r])  # rare on random masks: deal only those rows' nonzeros
    position[dealt] = _round_robin_positions(q[dealt], n[r[dealt]], P)
    # Both orders place a row's n nonzeros at positions 0..n-1, each once: scatter, no sort.
    order = np.full(n_total, -1, np.int64)
    order[first[r] + position] = by_residue
    if order.min() < 0:
        raise RuntimeError("internal error: bank_aware_order placed two nonzeros of a row at one "
                           "position")
    return order


def pack_mask(mask: np.ndarray, gates: int, bank_period: int = DEFAULT_BANK_PERIOD):
    """Packs a (H, G*H) boolean mask.

    Returns (col_idx, dense_col, row_ptr): the kept entries ``kernel[col_idx, dense_col]`` in
    packed order (so ``values = kernel[col_idx, dense_col]``; the kernel's row is the hidden
    unit the weight multiplies) and the row pointer over the G*H unit-major packed rows.
    """
    hidden = mask.shape[0]
    # Nonzeros of the kernel by packed row (the output they feed), then input unit: the mask as
    # (unit, gate, input unit) lists them in that order, with no sort.
    by_row = np.ascontiguousarray(mask.reshape(hidden, gates, hidden).transpose(2, 1, 0))
    packed_row, in_unit = np.nonzero(by_row.reshape(gates * hidden, hidden))
    out_col = packed_row_to_dense_column(packed_row, hidden, gates)
    order = bank_aware_order(packed_row, in_unit, bank_period)
    in_unit, out_col, packed_row = in_unit[order], out_col[order], packed_row[order]
    counts = np.bincount(packed_row, minlength=gates * hidden)
    row_ptr = np.zeros(gates * hidden + 1, dtype=np.int64)
    np.cumsum(counts, out=row_ptr[1:])
    if row_ptr[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"too many nonzeros for int32 indices: {row_ptr[-1]}")
    return in_unit.astype(np.int32), out_col.astype(np.int32), row_ptr.astype(np.int32)


def check_packed_arrays(col_idx, row_ptr, hidden: int, gates: int, nnz: int):
    """The layout's shapes and integer dtypes (traced arrays too): every call checks them
    before a kernel."""
    for name, array in (("col_idx", col_idx), ("row_ptr", row_ptr)):
        if not np.issubdtype(np.dtype(array.dtype), np.integer):
            raise TypeError(f"{name} must be an integer array, got dtype {array.dtype}: a "
                            "jax.tree.map over the weights (e.g. a cast of a whole parameter "
                            "tree) reaches their sparsity pattern too; cast with w.astype(dtype)")
    if tuple(row_ptr.shape) != (gates * hidden + 1,):
        raise ValueError(f"row_ptr must have shape ({gates * hidden + 1},), "
                         f"got {tuple(row_ptr.shape)}")
    if tuple(col_idx.shape) != (nnz,):
        raise ValueError(f"col_idx must have shape ({nnz},), got {tuple(col_idx.shape)}")


def validate_packed(col_idx: np.ndarray, row_ptr: np.ndarray, hidden: int, gates: int, nnz: int):
    """Checks a packed layout on the host; raises ValueError (TypeError for non-integer
    arrays) describing the first problem."""
    check_packed_arrays(col_idx, row_ptr, hidden, gates, nnz)
    if row_ptr[0] != 0 or row_ptr[-1] != nnz or np.any(np.diff(row_ptr) < 0):
        raise ValueError("row_ptr must start at 0, end at nnz and never decrease")
    if nnz and (col_idx.min() < 0 or col_idx.max() >= hidden):
        raise ValueError(f"col_idx out of range [0, {hidden})")


def checked_mask_packing(packed, hidden: int, gates: int):
    """``pack_mask``'s output as NumPy arrays, checked against a kernel of H = ``hidden`` and
    G = ``gates``: a packing of another shape would gather wrong entries (JAX clamps indices)."""
    try:
        col_idx, dense_col, row_ptr = (np.asarray(a) for a in packed)
    except (TypeError, ValueError):
        raise TypeError("packed must be pack_mask's output, (col_idx, dense_col, row_ptr)") \
            from None
    validate_packed(col_idx, row_ptr, hidden, gates, col_idx.shape[0])
    rows = np.repeat(np.arange(gates * hidden), np.diff(row_ptr))
    if dense_col.shape != col_idx.shape or \
            not np.array_equal(dense_col, packed_row_to_dense_column(rows, hidden, gates)):
        raise ValueError(f"packed does not match a kernel of shape ({hidden}, {gates * hidden}): "
                         "its dense columns differ from its rows' (pack the mask of this kernel)")
    return col_idx, dense_col, row_ptr
