"""Forward pass of the sparse recurrences vs the float64 NumPy oracle, over many shapes."""

import itertools
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

import jax_sprnn as sp
import oracle

SHAPES = [  # (T, B, H): H = 1, odd and larger; B = 1; T = 1
    (1, 1, 1), (7, 3, 37), (5, 1, 64), (1, 4, 33), (12, 5, 129), (4, 2, 300),
]
DENSITIES = [0.0, 1.0, 0.1, 0.3, 0.05, 0.5]
PATTERNS = ["uniform", "empty_rows", "skewed"]
DTYPES = ["float32", "bfloat16", "float16"]
CELLS = ["rnn", "lstm", "gru"]
LENGTHS = ["full", "ragged", "none"]


def _cases():
    """Every cell x dtype x shape, cycling densities, patterns, lengths, direction."""
    for n, (cell, dtype, shape) in enumerate(itertools.product(CELLS, DTYPES, SHAPES)):
        yield pytest.param(cell, dtype, shape, DENSITIES[n % 6], PATTERNS[n % 3],
                           LENGTHS[(n // 3) % 3], bool(n % 2),
                           id=f"{cell}-{dtype}-T{shape[0]}B{shape[1]}H{shape[2]}-n{n}")


def check_against_oracle(cell, p, lengths, reverse, activation="tanh", implementation="auto"):
    w = sp.SparseWeights.from_dense(jnp.asarray(p["kernel"]), p["mask"])
    ys, final = oracle.run_api(cell, p["xp"], p["carry"], w, p["b_hn"], lengths, reverse,
                               activation, implementation)
    ref_ys, ref_final = oracle.run(cell, p["xp"], p["carry"], p["kernel"], lengths, p["b_hn"],
                                   reverse, activation)
    dtype = str(p["xp"].dtype)
    assert ys.dtype == p["xp"].dtype and ys.shape == ref_ys.shape
    assert oracle.rel_error(ys, ref_ys) < oracle.RTOL[dtype]
    for got, want in zip(final, ref_final):
        assert got.dtype == p["xp"].dtype
        assert oracle.rel_error(got, want) < oracle.RTOL[dtype]
    if lengths is not None:  # padding is exactly zero
        steps = p["xp"].shape[0]
        pad = np.arange(steps)[:, None] >= np.asarray(lengths)[None, :]
        assert np.all(np.asarray(ys, np.float32)[pad] == 0)


@pytest.mark.parametrize("cell,dtype,shape,density,pattern,lengths_kind,reverse", list(_cases()))
@pytest.mark.parametrize("implementation", ["auto", "reference"])
def test_matches_oracle(cell, dtype, shape, density, pattern, lengths_kind, reverse,
                        implementation):
    rng = np.random.default_rng(zlib.crc32(repr((cell, dtype, shape, density)).encode()))
    steps, batch, hidden = shape
    p = oracle.random_problem(rng, cell, steps, batch, hidden, density, jnp.dtype(dtype),
                              pattern)
    lengths = oracle.make_lengths(rng, lengths_kind, steps, batch)
    check_against_oracle(cell, p, lengths, reverse, implementation=implementation)


@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("reverse", [False, True])
def test_rnn_activations(activation, reverse):
    rng = np.random.default_rng(7)
    p = oracle.random_problem(rng, "rnn", 9, 3, 45, 0.2, jnp.dtype("float32"), "skewed")
    check_against_oracle("rnn", p, np.array([9, 0, 4], np.int32), reverse, activation)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell,activation", [("rnn", "tanh"), ("rnn", "relu"), ("lstm", "tanh"),
                                             ("gru", "tanh")])
def test_nan_spreads_along_nonzeros(cell, activation, dtype):
    # One NaN input reaches every unit that reads it through a nonzero, step after step (a ReLU
    # keeps NaN, as jax.nn.relu), and no other sequence, whose values match the oracle. (The
    # handlers' padded nonzero groups may spread it further, as the dense matmul of
    # jax_sprnn.reference does everywhere: only the step it enters is exact.)
    rng = np.random.default_rng(11)
    steps, batch, hidden, b = 6, 3, 40, 1
    p = oracle.random_problem(rng, cell, steps, batch, hidden, 0.1, jnp.dtype(dtype))
    xp, want = oracle.with_nan(p, cell, b)
    w = sp.SparseWeights.from_dense(jnp.asarray(p["kernel"]), p["mask"])
    ys, _ = oracle.run_api(cell, xp, p["carry"], w, p["b_hn"], activation=activation)
    got = np.isnan(np.asarray(ys, np.float32))
    np.testing.assert_array_equal(got & want, want)
    np.testing.assert_array_equal(got[:2], want[:2])
    assert not got[:, np.arange(batch) != b].any()
    assert oracle.others_error(ys, p, xp, cell, b, activation) < oracle.RTOL[dtype]


def test_zero_lengths_return_initial_carry():
    rng = np.random.default_rng(3)
    p = oracle.random_problem(rng, "lstm", 4, 2, 16, 0.5, jnp.dtype("float32"))
    w = sp.SparseWeights.from_dense(p["kernel"], p["mask"])
    ys, (c, h) = sp.lstm(p["xp"], p["carry"], w, seq_lengths=np.zeros(2, np.int32))
    assert np.all(np.asarray(ys) == 0)
    np.testing.assert_array_equal(np.asarray(c), p["carry"][0])
    np.testing.assert_array_equal(np.asarray(h), p["carry"][1])


def test_empty_time_axis():
    w = sp.SparseWeights.from_dense(np.eye(5, dtype=np.float32))
    h0 = np.ones((2, 5), np.float32)
    ys, h = sp.rnn(np.zeros((0, 2, 5), np.float32), h0, w)
    assert ys.shape == (0, 2, 5)
    np.testing.assert_array_equal(np.asarray(h), h0)


def test_reverse_keeps_padding_at_end():
    """reverse runs t = L-1 .. 0 and writes ys at the original positions."""
    kernel = np.zeros((1, 1), np.float32)
    w = sp.SparseWeights.from_dense(kernel, np.ones((1, 1), bool))
    xp = np.arange(1, 5, dtype=np.float32).reshape(4, 1, 1) * 0.1
    ys, h = sp.rnn(xp, np.zeros((1, 1), np.float32), w, "relu", np.array([3]), reverse=True)
    np.testing.assert_allclose(np.asarray(ys)[:, 0, 0], [0.1, 0.2, 0.3, 0.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(h), [[0.1]], rtol=1e-6)  # state after t = 0


def test_offsets_past_int32():
    # xp of 4100 x 16384 x 32 halves (2.15e9 elements, 4.3 GB): its last offsets pass int32.
    # Only three sequences run (little compute); the rest have a NaN xp that must not be read.
    steps, batch, hidden = 4100, 16384, 8
    assert steps * batch * 4 * hidden > 2**31
    errors, idle_ys, idle_carry_off = oracle.check_few_live_sequences(
        "lstm", steps, batch, hidden, "float16", [0, batch // 2 + 3, batch - 1])
    assert max(errors) < oracle.RTOL["float16"], errors
    assert idle_ys == 0 and set(idle_carry_off) == {0}, (idle_ys, idle_carry_off)
