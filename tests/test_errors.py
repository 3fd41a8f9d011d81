"""Bad input raises a clear Python error before any kernel runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sprnn as sp

H, T, B = 6, 4, 2


def weights(gates=1, dtype=np.float32):
    kernel = np.random.default_rng(0).standard_normal((H, gates * H)).astype(dtype)
    return sp.SparseWeights.from_dense(kernel)


def f32(*shape):
    return np.zeros(shape, np.float32)


def test_xp_rank():
    with pytest.raises(ValueError, match="time-major"):
        sp.rnn(f32(B, H), f32(B, H), weights())


def test_xp_width():
    with pytest.raises(ValueError, match="last axis"):
        sp.lstm(f32(T, B, 3 * H), (f32(B, H), f32(B, H)), weights(4))


def test_carry_shape():
    with pytest.raises(ValueError, match="h0 must have shape"):
        sp.rnn(f32(T, B, H), f32(B + 1, H), weights())
    with pytest.raises(ValueError, match="c0 must have shape"):
        sp.lstm(f32(T, B, 4 * H), (f32(B, H + 1), f32(B, H)), weights(4))
    with pytest.raises(TypeError, match="pair"):
        sp.lstm(f32(T, B, 4 * H), f32(B, H), weights(4))


def test_wrong_cell_for_weights():
    with pytest.raises(ValueError, match="gate"):
        sp.gru(f32(T, B, 3 * H), f32(B, H), weights(4), f32(H))


def test_dtype_mismatch():
    with pytest.raises(TypeError, match="share one dtype"):
        sp.rnn(f32(T, B, H), np.zeros((B, H), jnp.bfloat16), weights())
    with pytest.raises(TypeError, match="share one dtype"):
        sp.rnn(np.zeros((T, B, H), np.float16), np.zeros((B, H), np.float16), weights())


@pytest.mark.parametrize("dtype", [np.float64, np.int32])
def test_unsupported_dtype(dtype):
    with pytest.raises(TypeError, match="unsupported dtype"):
        sp.rnn(np.zeros((T, B, H), dtype), np.zeros((B, H), dtype), weights())


def test_seq_lengths():
    w = weights()
    with pytest.raises(ValueError, match=r"\[0, T=4\]"):
        sp.rnn(f32(T, B, H), f32(B, H), w, seq_lengths=np.array([5, 1]))
    with pytest.raises(ValueError, match=r"\[0, T=4\]"):
        sp.rnn(f32(T, B, H), f32(B, H), w, seq_lengths=np.array([-1, 1]))
    with pytest.raises(ValueError, match="seq_lengths must have shape"):
        sp.rnn(f32(T, B, H), f32(B, H), w, seq_lengths=np.array([1, 1, 1]))
    with pytest.raises(TypeError, match="integers"):
        sp.rnn(f32(T, B, H), f32(B, H), w, seq_lengths=np.array([1.0, 1.0]))


def test_seq_lengths_as_a_list():
    # Lists are taken as xp and the carry are; their values are still checked.
    rng = np.random.default_rng(1)
    xp, h0, w = rng.standard_normal((T, B, H)).astype(np.float32), f32(B, H), weights()
    from_list = sp.rnn(xp, h0, w, seq_lengths=[3, 0])
    from_array = sp.rnn(xp, h0, w, seq_lengths=np.array([3, 0]))
    jax.tree.map(np.testing.assert_array_equal, from_list, from_array)
    with pytest.raises(ValueError, match=r"\[0, T=4\]"):
        sp.rnn(xp, h0, w, seq_lengths=[5, 1])
    with pytest.raises(TypeError, match="integers"):
        sp.rnn(xp, h0, w, seq_lengths=[1.5, 1.0])


def test_array_arguments_as_lists():
    # Each argument converts as a whole and keeps its dtype (lists used to be mapped leaf by
    # leaf and fail with "'list' object has no attribute 'shape'").
    rng = np.random.default_rng(3)
    xp = rng.standard_normal((T, B, 3 * H)).astype(np.float32)
    h0 = rng.standard_normal((B, H)).astype(np.float32)
    b_hn = rng.standard_normal(H).astype(np.float32)
    w = weights(3)
    expected = sp.gru(xp, h0, w, b_hn)
    jax.tree.map(np.testing.assert_array_equal, sp.gru(list(xp), list(h0), w, list(b_hn)),
                 expected)
    traced_steps = jax.jit(lambda xp: sp.gru([xp[t] for t in range(T)], h0, w, b_hn))(xp)
    jax.tree.map(np.testing.assert_array_equal, traced_steps, expected)
    carry = rng.standard_normal((2, B, H)).astype(np.float32)
    xp4 = rng.standard_normal((T, B, 4 * H)).astype(np.float32)
    jax.tree.map(np.testing.assert_array_equal,
                 sp.lstm(xp4, [list(carry[0]), list(carry[1])], weights(4)),
                 sp.lstm(xp4, tuple(carry), weights(4)))
    # Python floats are float64: refused like a float64 array, not rounded silently.
    with pytest.raises(TypeError, match="h0 has dtype float64"):
        sp.gru(xp, h0.tolist(), w, b_hn)
    with pytest.raises(TypeError, match="unsupported dtype float64"):
        sp.gru(xp.tolist(), h0, w, b_hn)


@pytest.mark.parametrize("reverse", ["yes", "False", None, 2, 0.5])
def test_reverse_must_be_a_bool(reverse):
    with pytest.raises(TypeError, match="reverse must be a bool"):
        sp.rnn(f32(T, B, H), f32(B, H), weights(), reverse=reverse)


def test_reverse_takes_numpy_bools_and_0_or_1():
    xp = np.random.default_rng(2).standard_normal((T, B, H)).astype(np.float32)
    args = (xp, f32(B, H), weights())
    for flag, same_as in [(np.bool_(True), True), (1, True), (0, False), (np.int8(0), False)]:
        jax.tree.map(np.testing.assert_array_equal, sp.rnn(*args, reverse=flag),
                     sp.rnn(*args, reverse=same_as))


def test_traced_reverse_is_an_error():
    run = jax.jit(lambda r: sp.rnn(f32(T, B, H), f32(B, H), weights(), reverse=r))
    with pytest.raises(TypeError, match="static argument"):
        run(True)


def test_b_hn():
    with pytest.raises(ValueError, match="b_hn must have shape"):
        sp.gru(f32(T, B, 3 * H), f32(B, H), weights(3), f32(H + 1))
    with pytest.raises(TypeError, match="gru needs b_hn"):  # was an AttributeError
        sp.gru(f32(T, B, 3 * H), f32(B, H), weights(3), None)


def test_inconsistent_packed_weights():
    # Hand-built weights whose leaves disagree: the handlers' run-time errors come first here.
    w = weights()
    short_row_ptr = sp.SparseWeights(w.values, w.col_idx, w.row_ptr[:-1], hidden_size=H, gates=1)
    with pytest.raises(ValueError, match=r"row_ptr must have shape \(7,\)"):
        sp.rnn(f32(T, B, H), f32(B, H), short_row_ptr)
    short_values = sp.SparseWeights(w.values[:-1], w.col_idx, w.row_ptr, hidden_size=H, gates=1)
    with pytest.raises(ValueError, match="col_idx must have shape"):
        sp.rnn(f32(T, B, H), f32(B, H), short_values)
    float_row_ptr = sp.SparseWeights(w.values, w.col_idx, np.asarray(w.row_ptr, np.float32),
                                     hidden_size=H, gates=1)
    with pytest.raises(TypeError, match="row_ptr must be an integer array"):
        sp.rnn(f32(T, B, H), f32(B, H), float_row_ptr)


def test_int64_pattern_under_x64():
    # Weights built by hand with x64 on hold int64 patterns; the handlers take int32.
    w = weights()
    xp = np.random.default_rng(1).standard_normal((T, B, H)).astype(np.float32)
    expected = sp.rnn(xp, f32(B, H), w)[0]
    with jax.enable_x64(True):
        w64 = sp.SparseWeights(w.values, jnp.asarray(np.asarray(w.col_idx), jnp.int64),
                               jnp.asarray(np.asarray(w.row_ptr), jnp.int64), hidden_size=H,
                               gates=1)
        assert w64.col_idx.dtype == jnp.int64
        np.testing.assert_array_equal(sp.rnn(xp, f32(B, H), w64)[0], expected)


def test_traced_wide_lengths_clamp_instead_of_wrapping():
    """Traced lengths are clamped to [0, T]; int64 ones past 2**31 wrapped in the int32 cast
    (2**32 + 1 ran one step, 2**31 none)."""
    w = weights()
    rng = np.random.default_rng(2)
    xp, h0 = rng.standard_normal((T, B, H)).astype(np.float32), f32(B, H)
    full = sp.rnn(xp, h0, w)[1]
    with jax.enable_x64(True):
        final = jax.jit(lambda lengths: sp.rnn(xp, h0, w, seq_lengths=lengths)[1])
        for big in (2**32 + 1, 2**31):
            lengths = np.full(B, big, np.int64)
            np.testing.assert_array_equal(final(lengths), full)
        np.testing.assert_array_equal(final(np.full(B, -2**40, np.int64)), h0)


def test_activation_and_implementation():
    with pytest.raises(ValueError, match="activation"):
        sp.rnn(f32(T, B, H), f32(B, H), weights(), activation="gelu")
    with pytest.raises(ValueError, match="implementation"):
        sp.rnn(f32(T, B, H), f32(B, H), weights(), implementation="magic")


def test_not_sparse_weights():
    with pytest.raises(TypeError, match="SparseWeights"):
        sp.rnn(f32(T, B, H), f32(B, H), np.eye(H, dtype=np.float32))


@pytest.mark.parametrize("shape", [(H,), (H, 2 * H), (H, H + 1), (0, 0), (H, 5 * H)])
def test_kernel_shape(shape):
    with pytest.raises(ValueError, match="kernel"):
        sp.SparseWeights.from_dense(np.ones(shape, np.float32))


@pytest.mark.parametrize("bank_period", [-3, 2.5, "16", True])
def test_bank_period(bank_period):
    # A string or float used to fail inside NumPy; a negative one silently meant 0.
    with pytest.raises(ValueError, match="bank_period must be an integer >= 0"):
        sp.SparseWeights.from_dense(np.ones((H, H), np.float32), bank_period=bank_period)


def test_mask_errors():
    kernel = np.ones((H, H), np.float32)
    with pytest.raises(TypeError, match="boolean"):
        sp.SparseWeights.from_dense(kernel, np.ones((H, H), np.float32))
    with pytest.raises(ValueError, match="mask shape"):
        sp.SparseWeights.from_dense(kernel, np.ones((H, H + 1), bool))
    with pytest.raises(TypeError, match="concrete"):
        jax.jit(lambda m: sp.SparseWeights.from_dense(kernel, m).values)(np.ones((H, H), bool))
    with pytest.raises(TypeError, match="explicit concrete mask"):
        jax.jit(lambda k: sp.SparseWeights.from_dense(k).values)(kernel)


def test_stacked_weights_without_vmap():
    w = weights()
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), w)
    with pytest.raises(ValueError, match="batch dimensions"):
        sp.rnn(f32(T, B, H), f32(B, H), stacked)


def test_kernel_implementation_requires_compiled_handler(monkeypatch):
    from jax_sprnn import _ffi

    xp, h0, w = f32(T, B, H), f32(B, H), weights()
    if jax.default_backend() == "cpu":
        sp.rnn(xp, h0, w, implementation="kernel")  # built: runs
        monkeypatch.setattr(_ffi, "CPU_TARGETS", frozenset())
    else:
        monkeypatch.setattr(_ffi, "CUDA_TARGETS", frozenset())
    with pytest.raises(RuntimeError, match="compiled handler"):
        sp.rnn(xp, h0, w, implementation="kernel")


def test_missing_extension_says_why(monkeypatch):
    # "not built" and "built but cannot load" need different fixes; the messages tell which.
    from jax_sprnn import _ffi

    monkeypatch.setattr(_ffi, "_MISSING", {})
    assert _ffi._load("_sprnn_never_built") is None
    assert _ffi.why_missing("_sprnn_never_built") == "was not built"

    def unloadable(name):
        raise ImportError("libcudart.so.13: cannot open shared object file")

    monkeypatch.setattr(_ffi.importlib, "import_module", unloadable)
    assert _ffi._load("_sprnn_cuda") is None
    assert _ffi.why_missing("_sprnn_cuda") == (
        "failed to load (libcudart.so.13: cannot open shared object file)")
    backend = "_sprnn_cuda" if jax.default_backend() == "gpu" else "_sprnn_cpu"
    monkeypatch.setitem(_ffi._MISSING, backend, "failed to load (bad ELF)")
    monkeypatch.setattr(_ffi, "CPU_TARGETS", frozenset())
    monkeypatch.setattr(_ffi, "CUDA_TARGETS", frozenset())
    with pytest.raises(RuntimeError, match=r"its extension failed to load \(bad ELF\)"):
        sp.rnn(f32(T, B, H), f32(B, H), weights(), implementation="kernel")
