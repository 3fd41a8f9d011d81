"""SparseWeights: packing, layout invariants, bank-aware order, round trip, pytree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sprnn as sp
from jax_sprnn import packing
import oracle


@pytest.mark.parametrize("gates", [1, 3, 4])
@pytest.mark.parametrize("density", [0.0, 0.07, 0.5, 1.0])
@pytest.mark.parametrize("hidden", [1, 37, 128])
def test_round_trip_and_layout(gates, density, hidden):
    rng = np.random.default_rng(hidden + gates)
    mask = oracle.random_mask(rng, hidden, gates, density)
    kernel = (rng.standard_normal(mask.shape) * mask).astype(np.float32)
    w = sp.SparseWeights.from_dense(kernel, mask).validate()
    np.testing.assert_array_equal(np.asarray(w.to_dense()), kernel)
    assert w.nnz == mask.sum() and w.hidden_size == hidden and w.gates == gates
    assert w.density == pytest.approx(mask.mean())
    # Unit-major rows: packed row u*G + g holds dense column g*H + u.
    row_ptr, col_idx, values = map(np.asarray, (w.row_ptr, w.col_idx, w.values))
    for r in rng.integers(0, gates * hidden, 5):
        u, g = divmod(int(r), gates)
        seg = slice(row_ptr[r], row_ptr[r + 1])
        column = g * hidden + u
        np.testing.assert_array_equal(np.sort(col_idx[seg]), np.flatnonzero(mask[:, column]))
        np.testing.assert_array_equal(values[seg], kernel[col_idx[seg], column])


def test_from_packed_mask_checks_the_packing_against_the_kernel():
    rng = np.random.default_rng(11)
    mask = oracle.random_mask(rng, 40, 4, 0.2)
    kernel = rng.standard_normal(mask.shape).astype(np.float32)
    packed = packing.pack_mask(mask, 4)
    w, want = sp.SparseWeights.from_packed_mask(kernel, packed), \
        sp.SparseWeights.from_dense(kernel, mask)
    for name in ("values", "col_idx", "row_ptr"):
        np.testing.assert_array_equal(getattr(w, name), getattr(want, name))
    col_idx, dense_col, row_ptr = packed
    wrong = {
        "another H": packing.pack_mask(oracle.random_mask(rng, 39, 4, 0.2), 4),
        "another G": packing.pack_mask(oracle.random_mask(rng, 40, 3, 0.2), 3),
        "dense columns of other rows": (col_idx, np.roll(dense_col, 1), row_ptr),
        "a short dense_col": (col_idx, dense_col[:-1], row_ptr),
    }
    for what, bad in wrong.items():
        with pytest.raises(ValueError):
            sp.SparseWeights.from_packed_mask(kernel, bad)
            pytest.fail(what)
    with pytest.raises(TypeError, match="pack_mask's output"):
        sp.SparseWeights.from_packed_mask(kernel, (col_idx, row_ptr))


def test_mask_none_uses_nonzeros_and_explicit_mask_keeps_zeros():
    kernel = np.array([[0.0, 2.0], [3.0, 0.0]], np.float32)
    assert sp.SparseWeights.from_dense(kernel).nnz == 2
    assert sp.SparseWeights.from_dense(kernel, np.ones((2, 2), bool)).nnz == 4


def conflicts(cols, period):
    """Sum over aligned groups of (largest multiplicity of a residue - 1)."""
    total = 0
    for start in range(0, len(cols), period):
        group = cols[start:start + period] % period
        total += np.bincount(group).max() - 1 if len(group) else 0
    return total


@pytest.mark.parametrize("period", [8, 16, 32])
def test_bank_aware_order_reduces_conflicts(period):
    rng = np.random.default_rng(period)
    hidden = 1152
    mask = oracle.random_mask(rng, hidden, 1, 0.1)
    kernel = mask.astype(np.float32)
    plain = sp.SparseWeights.from_dense(kernel, mask, bank_period=0)
    aware = sp.SparseWeights.from_dense(kernel, mask, bank_period=period)
    np.testing.assert_array_equal(np.asarray(plain.to_dense()), np.asarray(aware.to_dense()))
    rp = np.asarray(aware.row_ptr)
    before = after = 0
    for r in range(0, hidden, 7):
        a = np.asarray(aware.col_idx)[rp[r]:rp[r + 1]]
        p = np.asarray(plain.col_idx)[rp[r]:rp[r + 1]]
        assert sorted(a) == sorted(p)
        before += conflicts(p, period)
        after += conflicts(a, period)
    assert after < 0.6 * before


@pytest.mark.parametrize("period", [8, 16, 32])
def test_bank_aware_order_reaches_the_lower_bound(period):
    # Rows of F full groups: a residue class of k members forces |k - F| groups with a repeated
    # residue (packing.bank_aware_order), so at least max |k - F| conflicts; the order has
    # exactly that many, one per such group (each conflicting group repeats residues once).
    rng = np.random.default_rng(period)
    for _ in range(200):
        full = int(rng.integers(1, 50))
        hidden = int(rng.integers(period * full, 4 * period * full + 1))
        cols = np.sort(rng.choice(hidden, period * full, replace=False))
        if rng.random() < 0.2:  # skewed residues
            cols = np.sort(rng.choice(np.arange(0, hidden, 2), min(period * full, hidden // 2),
                                      replace=False))
            full = len(cols) // period
            cols = cols[:period * full]
        counts = np.bincount(cols % period, minlength=period)
        bound = np.abs(counts - full).max()
        order = packing.bank_aware_order(np.zeros(len(cols), np.int64), cols, period)
        assert sorted(order) == list(range(len(cols)))
        if counts.max() <= 2 * full:  # beyond that a class needs 3 per group somewhere
            assert conflicts(cols[order], period) == min(bound, full)


def test_bank_aware_order_mixes_fallback_rows_and_ordered_rows():
    # Rows whose columns all share one residue (the round-robin deal) beside uniform rows, each
    # row placed by its own rule: every row keeps exactly its columns, and the uniform rows
    # still have fewer conflicts than in column order.
    rng = np.random.default_rng(7)
    hidden, period = 320, 16
    mask = rng.random((hidden, hidden)) < 0.3
    mask[:, ::3] = False
    mask[::period, ::3] = True  # dense column 3k: inputs 0, 16, 32, ... (one residue)
    w = sp.SparseWeights.from_dense(mask.astype(np.float32), mask, bank_period=period)
    rp, cols = np.asarray(w.row_ptr), np.asarray(w.col_idx)
    before = after = 0
    for r in range(hidden):
        row = cols[rp[r]:rp[r + 1]]
        np.testing.assert_array_equal(np.sort(row), np.flatnonzero(mask[:, r]))
        if r % 3:
            before += conflicts(np.sort(row), period)
            after += conflicts(row, period)
    assert after < 0.6 * before
    np.testing.assert_array_equal(np.asarray(w.to_dense()), mask.astype(np.float32))


def test_bank_aware_order_is_conflict_free_when_possible():
    # 64 nonzeros, 2 per residue mod 32: two groups of 32 with all-distinct residues exist.
    cols = np.concatenate([np.arange(0, 32), np.arange(32, 64)])
    rows = np.zeros(64, np.int64)
    order = packing.bank_aware_order(rows, cols, 32)
    assert conflicts(cols[order], 32) == 0
    assert sorted(order) == list(range(64))


def test_pytree_and_traced_kernel():
    rng = np.random.default_rng(0)
    mask = rng.random((8, 32)) < 0.3
    kernel = rng.standard_normal((8, 32)).astype(np.float32)
    w = sp.SparseWeights.from_dense(kernel, mask)
    leaves, tree = jax.tree.flatten(w)
    assert len(leaves) == 3
    w2 = jax.tree.unflatten(tree, leaves)
    assert w2.hidden_size == 8 and w2.gates == 4 and w2.nnz == w.nnz
    dense = jax.jit(lambda k: sp.SparseWeights.from_dense(k, mask).to_dense())(kernel)
    np.testing.assert_array_equal(np.asarray(dense), kernel * mask)
    grad = jax.grad(lambda k: jnp.sum(sp.SparseWeights.from_dense(k, mask).values ** 2))(kernel)
    np.testing.assert_allclose(grad, 2 * kernel * mask)


def test_astype_casts_only_the_values():
    rng = np.random.default_rng(3)
    kernel = (rng.standard_normal((12, 48)) * (rng.random((12, 48)) < 0.4)).astype(np.float32)
    w = sp.SparseWeights.from_dense(kernel)
    half = w.astype(jnp.bfloat16)
    assert half.values.dtype == jnp.bfloat16 and half.col_idx.dtype == w.col_idx.dtype
    np.testing.assert_array_equal(half.to_dense(), jnp.asarray(kernel, jnp.bfloat16))
    xp = jnp.asarray(rng.standard_normal((5, 2, 48)), jnp.bfloat16)
    carry = (jnp.zeros((2, 12), jnp.bfloat16),) * 2
    ys, _ = sp.lstm(xp, carry, half)
    want, _ = sp.lstm(xp, carry, sp.SparseWeights.from_dense(jnp.asarray(kernel, jnp.bfloat16)))
    np.testing.assert_array_equal(ys, want)
    # A cast of the whole tree casts the pattern too: the error says how to cast instead.
    with pytest.raises(TypeError, match=r"cast with w.astype\(dtype\)"):
        sp.lstm(xp, carry, jax.tree.map(lambda a: a.astype(jnp.bfloat16), w))
    with pytest.raises(TypeError, match="floating point"):
        w.astype(jnp.int32)


def test_pytree_paths_name_the_leaves(tmp_path):
    w = sp.SparseWeights.from_dense(np.eye(6, 18, dtype=np.float32) + 0.5 * np.eye(6, 18, 3))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(w)[0]]
    assert paths == [".values", ".col_idx", ".row_ptr"]
    # What the names are for: picking the trainable leaf by path (optax / Flax labels).
    halved = jax.tree_util.tree_map_with_path(
        lambda p, x: x / 2 if jax.tree_util.keystr(p) == ".values" else x, w)
    np.testing.assert_array_equal(halved.to_dense(), w.to_dense() / 2)
    # An Orbax checkpoint restores the same weights (leaves saved under their names).
    import orbax.checkpoint as ocp
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "w", w)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "w", w)
    assert isinstance(restored, sp.SparseWeights) and restored.gates == 3
    np.testing.assert_array_equal(restored.to_dense(), w.to_dense())


def test_validate_rejects_bad_layouts():
    w = sp.SparseWeights.from_dense(np.eye(4, dtype=np.float32))
    bad = sp.SparseWeights(w.values, w.col_idx + 4, w.row_ptr, hidden_size=4, gates=1)
    with pytest.raises(ValueError, match="out of range"):
        bad.validate()
    bad = sp.SparseWeights(w.values, w.col_idx, w.row_ptr[::-1], hidden_size=4, gates=1)
    with pytest.raises(ValueError, match="row_ptr"):
        bad.validate()
    old = sp.SparseWeights(w.values, w.col_idx, w.row_ptr, hidden_size=4, gates=1,
                           layout_version=0)
    with pytest.raises(ValueError, match="version"):
        old.validate()
    with pytest.raises(ValueError, match="version"):
        sp.rnn(np.zeros((2, 1, 4), np.float32), np.zeros((1, 4), np.float32), old)
