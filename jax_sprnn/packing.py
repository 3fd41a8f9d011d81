"""Host-side packing of a boolean mask into the kernel's CSR layout (docs/INTERFACE.md).

All of this runs once per layer on concrete NumPy arrays, vectorized over every nonzero, so
packing an H=4096 LSTM (67M mask entries) takes about a second.
"""

from __future__ import annotations

import numpy as np

LAYOUT_VERSION = 1
DEFAULT_BANK_PERIOD = 16
SUPPORTED_GATES = (1, 3, 4)


def packed_row_to_dense_column(rows: np.ndarray, hidden: int, gates: int) -> np.ndarray:
    """Packed row r = u*G + g holds the dense kernel column g*H + u."""
    return (rows % gates) * hidden + rows // gates


def bank_aware_order(row_of: np.ndarray, cols: np.ndarray, period: int) -> np.ndarray:
    """Permutation of nonzeros (sorted by row) that spreads each row's columns over banks.

    What it optimizes: a warp's lanes read ``h[col]`` for ``period`` consecutive nonzeros of a
    row at once. Those reads are conflict-free when the columns have distinct residues
    ``col mod period`` (distinct shared-memory banks). Within a row of n nonzeros split into
    m = ceil(n / period) aligned groups, nonzeros sorted by residue are dealt round-robin to the
    groups (the last, partial group drops out of the deal once it is full). A residue class of
    k members then lands at most ceil(k / m') times in any group, which is the best possible
    up to one, and a row whose residues are balanced gets entirely conflict-free groups.

    How the CUDA kernel reads it (csrc/cuda/kernel_core.cuh): one warp per packed row, the
    row's k-th nonzero on lane k % 32, and h in shared memory as h[col][batch tile]. With the
    default period 16 and an fp16/bf16 batch tile of 4 (8-byte loads, served per half-warp),
    the 16 lanes of a half-warp then read 16 distinct 8-byte bank pairs. For 16-byte loads
    (float32 tile of 4, 16-bit tile of 8; served 8 lanes at a time) the members of a group are
    placed in residue order, so a full group of distinct residues 0..15 puts 0..7 and 8..15 in
    its two halves, which are also distinct mod 8. Measured with ncu on the H200 (ReLU H=1152,
    d=10%, fp16, B=4): 41% fewer shared-load bank conflicts than plain column order
    (benchmarks/NOTES.md).

    ``row_of`` must be non-decreasing. Returns indices into the inputs.
    """
    n_total = row_of.shape[0]
    if n_total == 0 or period <= 1:
        return np.arange(n_total)
    residue = cols % period
    by_residue = np.lexsort((cols, residue, row_of))  # row-major, residue-sorted within a row
    rows_sorted = row_of[by_residue]
    starts = np.searchsorted(rows_sorted, rows_sorted, side="left")
    q = np.arange(n_total) - starts  # rank within the row, in residue order
    counts = np.bincount(rows_sorted)
    n = counts[rows_sorted]
    m = -(-n // period)  # groups in the row
    r = n - period * (m - 1)  # size of the last group, in [1, period]
    first = q < r * m  # dealt while all m groups take one per round
    q2 = q - r * m
    m_minus = np.maximum(m - 1, 1)
    group = np.where(first, q % m, q2 % m_minus)
    round_ = np.where(first, q // m, r + q2 // m_minus)
    position = group * period + round_
    final = np.lexsort((position, rows_sorted))
    return by_residue[final]


def pack_mask(mask: np.ndarray, gates: int, bank_period: int = DEFAULT_BANK_PERIOD):
    """Packs a (H, G*H) boolean mask.

    Returns (col_idx, dense_col, row_ptr): the kept entries ``kernel[col_idx, dense_col]`` in
    packed order (so ``values = kernel[col_idx, dense_col]``; the kernel's row is the hidden
    unit the weight multiplies) and the row pointer over the G*H unit-major packed rows.
    """
    hidden = mask.shape[0]
    # Nonzeros of the kernel, grouped by packed row (the output they feed).
    in_unit, out_col = np.nonzero(mask)
    packed_row = (out_col % hidden) * gates + out_col // hidden
    by_row = np.lexsort((in_unit, packed_row))
    in_unit, out_col, packed_row = in_unit[by_row], out_col[by_row], packed_row[by_row]
    order = bank_aware_order(packed_row, in_unit, bank_period)
    in_unit, out_col, packed_row = in_unit[order], out_col[order], packed_row[order]
    counts = np.bincount(packed_row, minlength=gates * hidden)
    row_ptr = np.zeros(gates * hidden + 1, dtype=np.int64)
    np.cumsum(counts, out=row_ptr[1:])
    if row_ptr[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"too many nonzeros for int32 indices: {row_ptr[-1]}")
    return in_unit.astype(np.int32), out_col.astype(np.int32), row_ptr.astype(np.int32)


def validate_packed(col_idx: np.ndarray, row_ptr: np.ndarray, hidden: int, gates: int, nnz: int):
    """Checks a packed layout on the host; raises ValueError describing the first problem."""
    if row_ptr.shape != (gates * hidden + 1,):
        raise ValueError(f"row_ptr must have shape ({gates * hidden + 1},), got {row_ptr.shape}")
    if col_idx.shape != (nnz,):
        raise ValueError(f"col_idx must have shape ({nnz},), got {col_idx.shape}")
    if row_ptr[0] != 0 or row_ptr[-1] != nnz or np.any(np.diff(row_ptr) < 0):
        raise ValueError("row_ptr must start at 0, end at nnz and never decrease")
    if nnz and (col_idx.min() < 0 or col_idx.max() >= hidden):
        raise ValueError(f"col_idx out of range [0, {hidden})")
