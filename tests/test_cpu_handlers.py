"""The CPU FFI targets of docs/INTERFACE.md, called directly through jax.ffi.ffi_call.

Forward outputs are compared with jax_sprnn.reference.recurrence (and, for the LSTM residual
`cs` and the float32 runs, with a float64 NumPy loop); backward outputs with jax.vjp of the
reference. Needs the installed package with its compiled extension (`pip install .`).
"""

from __future__ import annotations

import functools
import pathlib
import re
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from oracle import GATES

import jax_sprnn
from jax_sprnn import _ffi, reference

pytestmark = [
    # These tests call the CPU FFI targets directly: on GPU machines, keep them on the CPU.
    pytest.mark.cpu_only,
    pytest.mark.skipif("sprnn_rnn_fwd" not in _ffi.CPU_TARGETS,
                       reason="jax_sprnn's C++ CPU extension is not built (pip install .)"),
]

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
RTOL = {"f32": 2e-5, "bf16": 2.5e-2, "f16": 1e-2}


# ---- problem construction ---------------------------------------------------------------------

def make_problem(cell, T, B, H, density, dtype, seed, lengths="mixed", empty_rows=False):
    rng = np.random.default_rng(seed)
    G = GATES[cell]
    mask = rng.random((H, G * H)) < density
    if empty_rows and H > 2:  # whole output columns pruned = empty packed rows
        mask[:, rng.choice(G * H, size=max(1, G * H // 4), replace=False)] = False
        mask[:, 0] = False
    per_row = max(1.0, density * H)
    kernel = (rng.standard_normal((H, G * H)) * (1.5 / np.sqrt(per_row))).astype(np.float32)
    kernel = jnp.asarray(kernel, dtype)
    w = jax_sprnn.SparseWeights.from_dense(kernel, mask)
    xp = jnp.asarray(rng.standard_normal((T, B, G * H)), dtype)
    h0 = jnp.asarray(rng.standard_normal((B, H)) * 0.5, dtype)
    c0 = jnp.asarray(rng.standard_normal((B, H)) * 0.5, dtype)
    b_hn = jnp.asarray(rng.standard_normal(H) * 0.5, dtype)
    if lengths == "full":
        lens = np.full(B, T)
    else:
        lens = rng.integers(0, T + 1, B)
        if B >= 2:
            lens[0], lens[-1] = 0, T
    return dict(w=w, xp=xp, h0=h0, c0=c0, b_hn=b_hn, lengths=jnp.asarray(lens, jnp.int32),
                rng=rng)


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


# ---- direct FFI calls -------------------------------------------------------------------------

def ffi_forward(cell, p, reverse, activation=0):
    xp, w = p["xp"], p["w"]
    T, B, _ = xp.shape
    H, dt = w.hidden_size, xp.dtype
    state = sds((B, H), dt)
    seq = sds((T, B, H), dt)
    common = (xp, p["lengths"], w.values, w.col_idx, w.row_ptr)
    if cell == "rnn":
        ys, hT = jax.ffi.ffi_call("sprnn_rnn_fwd", (seq, state))(
            *common, p["h0"], reverse=reverse, activation=activation, variant=-1)
        return dict(ys=ys, hT=hT)
    if cell == "lstm":
        ys, cT, hT, cs = jax.ffi.ffi_call("sprnn_lstm_fwd", (seq, state, state, seq))(
            *common, p["c0"], p["h0"], reverse=reverse, variant=-1)
        return dict(ys=ys, cT=cT, hT=hT, cs=cs)
    ys, hT = jax.ffi.ffi_call("sprnn_gru_fwd", (seq, state))(
        *common, p["h0"], p["b_hn"], reverse=reverse, variant=-1)
    return dict(ys=ys, hT=hT)


def ffi_backward(cell, p, fwd, cot, reverse, groups, activation=0):
    xp, w = p["xp"], p["w"]
    T, B, GH = xp.shape
    H, dt = w.hidden_size, xp.dtype
    state = sds((B, H), dt)
    outs_common = (sds((T, B, GH), dt), sds((groups, w.nnz), dt))
    common = (xp, p["lengths"], w.values, w.col_idx, w.row_ptr)
    if cell == "rnn":
        dxp, dv, dh0 = jax.ffi.ffi_call("sprnn_rnn_bwd", outs_common + (state,))(
            *common, p["h0"], fwd["ys"], cot["ys"], cot["hT"], reverse=reverse,
            activation=activation, groups=groups)
        return dict(xp=dxp, values=dv, h0=dh0)
    if cell == "lstm":
        dxp, dv, dc0, dh0 = jax.ffi.ffi_call("sprnn_lstm_bwd", outs_common + (state, state))(
            *common, p["c0"], p["h0"], fwd["ys"], fwd["cs"], cot["ys"], cot["cT"], cot["hT"],
            reverse=reverse, groups=groups)
        return dict(xp=dxp, values=dv, c0=dc0, h0=dh0)
    dxp, dv, dh0, db = jax.ffi.ffi_call("sprnn_gru_bwd", outs_common + (state, sds((groups, H), dt)))(
        *common, p["h0"], p["b_hn"], fwd["ys"], cot["ys"], cot["hT"], reverse=reverse,
        groups=groups)
    return dict(xp=dxp, values=dv, h0=dh0, b_hn=db)


# ---- references -------------------------------------------------------------------------------

# The reference only needs to be right, not fast: compiling it without XLA's backend
# optimizations keeps the test quick.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.partial(jax.jit, static_argnames=("cell", "reverse", "activation", "groups",
                                             "hidden", "gates"),
                   compiler_options=_FAST_COMPILE)
def _reference(xp, h0, c0, values, col_idx, row_ptr, b_hn, lengths, cot, *, cell, reverse,
               activation, groups, hidden, gates):
    """Forward of the reference and its jax.vjp, with the batch split into groups that each
    get their own copy of the weights (so weight gradients stay per group, as `groups` asks).
    One jit, so each case compiles once."""

    def run(xp, h0, c0, values, b_hn, lengths):
        kernel = jax_sprnn.SparseWeights(values, col_idx, row_ptr, hidden_size=hidden,
                                         gates=gates).to_dense()
        carry = (c0, h0) if cell == "lstm" else (h0,)
        return reference.recurrence(cell, xp, carry, kernel, lengths,
                                    b_hn if cell == "gru" else None, reverse=reverse,
                                    activation=activation)

    # Batch rows split into groups, one copy of values (and b_hn) per group: the gradient of
    # each copy is that group's weight gradient.
    T, B, GH = xp.shape
    per = B // groups
    split_t = lambda a: a.reshape(a.shape[0], groups, per, *a.shape[2:]).swapaxes(0, 1)  # noqa
    split_b = lambda a: a.reshape(groups, per, *a.shape[1:])  # noqa: E731
    tile = lambda a: jnp.broadcast_to(a, (groups,) + a.shape)  # noqa: E731
    primals = (split_t(xp), split_b(h0), split_b(c0), tile(values), tile(b_hn))
    (ys, final), vjp = jax.vjp(lambda *a: jax.vmap(run)(*a, split_b(lengths)), *primals)
    final_cot = (cot["cT"], cot["hT"]) if cell == "lstm" else (cot["hT"],)
    dxp, dh0, dc0, dvalues, db_hn = vjp((split_t(cot["ys"]), tuple(split_b(c) for c in final_cot)))
    merge_t = lambda a: a.swapaxes(0, 1).reshape(T, B, *a.shape[3:])  # noqa: E731
    merge_b = lambda a: a.reshape(B, *a.shape[2:])  # noqa: E731
    fwd = dict(ys=merge_t(ys), hT=merge_b(final[-1]))
    if cell == "lstm":
        fwd["cT"] = merge_b(final[0])
    grads = dict(xp=merge_t(dxp), h0=merge_b(dh0), c0=merge_b(dc0), values=dvalues, b_hn=db_hn)
    return fwd, grads


def reference_outputs(cell, p, cot, reverse, groups, activation=0):
    w = p["w"]
    return _reference(p["xp"], p["h0"], p["c0"], w.values, w.col_idx, w.row_ptr, p["b_hn"],
                      p["lengths"], cot, cell=cell, reverse=reverse, activation=activation,
                      groups=groups, hidden=w.hidden_size, gates=w.gates)


def numpy_forward(cell, p, reverse, activation=0):
    """Float64 loop over the dense kernel, also giving the LSTM cell states cs."""
    f64 = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    w = p["w"]
    G, H = w.gates, w.hidden_size
    rows = np.repeat(np.arange(G * H), np.diff(np.asarray(w.row_ptr)))
    W = np.zeros((H, G * H))
    W[np.asarray(w.col_idx), (rows % G) * H + rows // G] = f64(w.values)
    xp, lengths = f64(p["xp"]), np.asarray(p["lengths"])
    h, c, bhn = f64(p["h0"]), f64(p["c0"]), f64(p["b_hn"])
    T, B, _ = xp.shape
    H = h.shape[1]
    ys, cs = np.zeros((T, B, H)), np.zeros((T, B, H))
    sig = lambda a: 1.0 / (1.0 + np.exp(-a))  # noqa: E731
    for b in range(B):
        L = int(lengths[b])
        for s in range(L):
            t = L - 1 - s if reverse else s
            pre = xp[t, b] + h[b] @ W
            if cell == "rnn":
                h[b] = np.tanh(pre) if activation == 0 else np.maximum(pre, 0.0)
            elif cell == "lstm":
                i, f, g, o = np.split(pre, 4)
                c[b] = sig(f) * c[b] + sig(i) * np.tanh(g)
                h[b] = sig(o) * np.tanh(c[b])
                cs[t, b] = c[b]
            else:
                hw = h[b] @ W
                r = sig(xp[t, b, :H] + hw[:H])
                z = sig(xp[t, b, H:2 * H] + hw[H:2 * H])
                n = np.tanh(xp[t, b, 2 * H:] + r * (hw[2 * H:] + bhn))
                h[b] = (1 - z) * n + z * h[b]
            ys[t, b] = h[b]
    return dict(ys=ys, hT=h, cT=c, cs=cs)


def close(actual, expected, dtype_key, what):
    a = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    e = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    rtol = RTOL[dtype_key]
    scale = max(1.0, float(np.abs(e).max(initial=0.0)))
    np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale, err_msg=what)


# ---- the cases --------------------------------------------------------------------------------

# (cell, activation, T, B, H, density, dtype, reverse, lengths, groups, empty_rows)
CASES = [
    ("rnn", 0, 6, 3, 37, 0.3, "f32", False, "mixed", 1, True),
    ("rnn", 1, 5, 4, 16, 1.0, "f32", True, "mixed", 2, False),
    ("rnn", 0, 1, 1, 1, 1.0, "f32", False, "full", 1, False),
    ("rnn", 0, 4, 2, 9, 0.0, "f32", True, "mixed", 2, False),
    ("rnn", 1, 7, 8, 24, 0.25, "f32", False, "mixed", 4, True),
    ("lstm", 0, 6, 4, 37, 0.2, "f32", False, "mixed", 2, True),
    ("lstm", 0, 5, 3, 12, 1.0, "f32", True, "mixed", 1, False),
    ("lstm", 0, 1, 1, 1, 1.0, "f32", True, "full", 1, False),
    ("lstm", 0, 3, 2, 8, 0.0, "f32", False, "full", 1, False),
    ("gru", 0, 6, 4, 37, 0.2, "f32", True, "mixed", 2, True),
    ("gru", 0, 5, 5, 10, 1.0, "f32", False, "mixed", 1, False),
    ("gru", 0, 1, 1, 1, 1.0, "f32", False, "full", 1, False),
    ("gru", 0, 4, 2, 6, 0.0, "f32", True, "full", 2, False),
    ("rnn", 0, 6, 4, 33, 0.3, "bf16", True, "mixed", 2, True),
    ("rnn", 1, 5, 2, 20, 0.5, "f16", False, "mixed", 1, False),
    ("lstm", 0, 5, 4, 21, 0.3, "bf16", False, "mixed", 2, True),
    ("lstm", 0, 4, 2, 16, 0.5, "f16", True, "mixed", 1, False),
    ("gru", 0, 5, 4, 19, 0.3, "bf16", True, "mixed", 1, False),
    ("gru", 0, 4, 3, 15, 0.5, "f16", False, "mixed", 3, True),
]


def case_id(c):
    cell, act, T, B, H, d, dt, rev, lens, groups, empty = c
    name = cell if cell != "rnn" else ("rnn_tanh" if act == 0 else "rnn_relu")
    return (f"{name}-T{T}-B{B}-H{H}-d{d}-{dt}{'-rev' if rev else ''}-{lens}-g{groups}"
            f"{'-empty' if empty else ''}")


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_forward_and_backward(case):
    check_case(case)


# Several threads split the hidden units (the handlers only start them for large problems on
# their own; SPRNN_CPU_THREADS forces them). 3 threads: uneven ranges, one may own no rows.
THREADED = [
    ("rnn", 0, 6, 4, 40, 0.3, "f32", True, "mixed", 2, True),
    ("lstm", 0, 5, 3, 23, 0.4, "f32", False, "mixed", 1, True),
    ("gru", 0, 5, 4, 17, 0.3, "bf16", True, "mixed", 2, False),
    ("lstm", 0, 3, 2, 2, 1.0, "f32", True, "mixed", 1, False),
]


@pytest.mark.parametrize("case", THREADED, ids=[case_id(c) for c in THREADED])
def test_threads(case, monkeypatch):
    monkeypatch.setenv("SPRNN_CPU_THREADS", "3")
    check_case(case)


def check_case(case):
    cell, act, T, B, H, density, dt, reverse, lens, groups, empty = case
    p = make_problem(cell, T, B, H, density, DTYPES[dt], seed=zlib.crc32(case_id(case).encode()),
                     lengths=lens, empty_rows=empty)
    rng = p["rng"]
    dt_ = p["xp"].dtype
    cot = dict(ys=jnp.asarray(rng.standard_normal((T, B, H)), dt_),
               hT=jnp.asarray(rng.standard_normal((B, H)), dt_),
               cT=jnp.asarray(rng.standard_normal((B, H)), dt_))
    ref, want = reference_outputs(cell, p, cot, reverse, groups, act)
    fwd = ffi_forward(cell, p, reverse, act)
    for k in ref:
        assert fwd[k].dtype == p["xp"].dtype
        close(fwd[k], ref[k], dt, f"forward {k}")
    if dt == "f32":
        npy = numpy_forward(cell, p, reverse, act)
        for k in ("ys", "hT") + (("cT", "cs") if cell == "lstm" else ()):
            close(fwd[k], npy[k], dt, f"forward {k} vs float64")
    elif cell == "lstm":
        close(fwd["cs"], numpy_forward(cell, p, reverse, act)["cs"], dt, "forward cs")
    # invalid steps are exactly zero
    valid = np.arange(T)[:, None] < np.asarray(p["lengths"])[None, :]
    assert np.all(np.asarray(fwd["ys"], np.float32)[~valid] == 0)
    if cell == "lstm":
        assert np.all(np.asarray(fwd["cs"], np.float32)[~valid] == 0)

    got = ffi_backward(cell, p, fwd, cot, reverse, groups, act)
    for k in got:
        assert got[k].dtype == dt_
        close(got[k], want[k], dt, f"backward d{k}")


def test_dys_at_invalid_steps_is_ignored():
    p = make_problem("lstm", 5, 3, 8, 0.5, jnp.float32, seed=1)
    fwd = ffi_forward("lstm", p, False)
    rng = p["rng"]
    cot = dict(ys=jnp.asarray(rng.standard_normal((5, 3, 8)), jnp.float32),
               hT=jnp.ones((3, 8)), cT=jnp.ones((3, 8)))
    valid = np.arange(5)[:, None, None] < np.asarray(p["lengths"])[None, :, None]
    noisy = dict(cot, ys=jnp.where(valid, cot["ys"], 1e3))
    a = ffi_backward("lstm", p, fwd, cot, False, 1)
    b = ffi_backward("lstm", p, fwd, noisy, False, 1)
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    assert np.all(np.asarray(a["xp"])[~np.broadcast_to(valid, (5, 3, 32))] == 0)


# The f16 inputs overflow to inf on purpose; NumPy warns about that cast.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_half_conversions_round_to_nearest_even(dt):
    """relu(x + v*h) with H = 1 is one float32 add: the narrowing must match NumPy exactly."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng(7)
    B, T = 512, 3
    if dt == "f16":  # span subnormals, normals and overflow to inf
        mag = 2.0 ** rng.uniform(-26, 17, (T, B, 1))
    else:
        mag = 2.0 ** rng.uniform(-130, 128, (T, B, 1))
    x = jnp.asarray(mag, dtype)
    h0 = jnp.asarray(2.0 ** rng.uniform(-12, 4, (B, 1)), dtype)
    w = jax_sprnn.SparseWeights.from_dense(jnp.asarray([[1e-3]], dtype), np.ones((1, 1), bool))
    p = dict(xp=x, w=w, h0=h0, lengths=jnp.full((B,), 1, jnp.int32))
    ys = np.asarray(ffi_forward("rnn", p, False, activation=1)["ys"])
    np_dtype = np.float16 if dt == "f16" else ml_dtypes.bfloat16
    f32 = lambda a: np.asarray(a).astype(np.float32)  # noqa: E731
    pre = f32(x[0]) + f32(w.values)[0] * f32(h0)
    expected = np.maximum(pre, np.float32(0)).astype(np_dtype)
    np.testing.assert_array_equal(ys[0].view(np.uint16), expected.view(np.uint16))
    assert np.all(ys[1:].astype(np.float32) == 0)


def test_bad_shapes_and_dtypes_give_clear_errors():
    p = make_problem("gru", 3, 4, 8, 0.5, jnp.float32, seed=3)
    bad_h0 = dict(p, h0=jnp.zeros((4, 7), jnp.float32))
    with pytest.raises(Exception, match="xp has shape"):
        ffi_forward("gru", bad_h0, False)
    bad_bhn = dict(p, b_hn=jnp.zeros((9,), jnp.float32))
    with pytest.raises(Exception, match="b_hn has shape"):
        ffi_forward("gru", bad_bhn, False)
    mixed = dict(p, h0=p["h0"].astype(jnp.bfloat16))
    with pytest.raises(Exception, match="h0 has dtype bfloat16"):
        ffi_forward("gru", mixed, False)
    fwd = ffi_forward("gru", p, False)
    cot = dict(ys=jnp.zeros((3, 4, 8)), hT=jnp.zeros((4, 8)), cT=None)
    with pytest.raises(Exception, match="groups = 3"):
        ffi_backward("gru", p, fwd, cot, False, groups=3)
    pr = dict(p, lengths=p["lengths"][:3])
    with pytest.raises(Exception, match="lengths has shape"):
        ffi_forward("gru", pr, False)
    with pytest.raises(Exception, match="activation must be"):
        ffi_forward("rnn", make_problem("rnn", 2, 2, 4, 0.5, jnp.float32, seed=0), False,
                    activation=5)


def test_native_sources_use_no_iostreams():
    """The failure above, on jaxlib 0.11.2 with a statically linked libstdc++: the CPU
    library's shape messages, then built with a std::ostringstream, segfaulted the process
    (session 97; BUILD_NOTES.md). CI's jaxlib cannot show that, so this keeps iostreams out of
    every native source."""
    csrc = pathlib.Path(__file__).resolve().parents[1] / "csrc"
    sources = [f for f in csrc.rglob("*") if f.suffix in {".cc", ".cu", ".cuh", ".h"}]
    assert len(sources) > 10
    stream = re.compile(r"#include\s*<[a-z]*stream>|std::\w*stream\b|std::(cout|cerr|clog)\b")
    offenders = [f"{f.relative_to(csrc)}:{n}" for f in sources  # code, not comments
                 for n, line in enumerate(f.read_text().splitlines(), 1)
                 if stream.search(line.split("//")[0])]
    assert not offenders, offenders


# The row kernels and cell passes have a baseline build and an AVX2+FMA build picked at run
# time (B = 4 has its own kernel: several nonzeros per vector instruction, with 8- and 4-wide
# blocks and a scalar tail per row, so rows of many lengths). SPRNN_CPU_ISA=base forces the
# baseline; both must match the oracle and each other. Odd batch sizes take the generic path.
ISA_CASES = [
    ("rnn", 0, 5, 4, 64, 0.3, "f32", False, "mixed", 2, True),
    ("lstm", 0, 4, 4, 40, 0.35, "f32", True, "full", 1, False),
    ("gru", 0, 4, 4, 45, 0.4, "f32", False, "mixed", 2, True),
    ("lstm", 0, 3, 4, 33, 0.5, "bf16", False, "mixed", 1, False),
    ("rnn", 1, 4, 3, 50, 0.3, "f32", True, "mixed", 3, False),
    ("gru", 0, 3, 5, 41, 0.3, "f32", False, "mixed", 1, False),
    ("lstm", 0, 3, 16, 30, 0.3, "f32", False, "mixed", 4, True),
]


@pytest.mark.parametrize("isa", ["base", "default"])
@pytest.mark.parametrize("case", ISA_CASES, ids=[case_id(c) for c in ISA_CASES])
def test_isa_builds(case, isa, monkeypatch):
    if isa == "base":
        monkeypatch.setenv("SPRNN_CPU_ISA", "base")
    check_case(case)


@pytest.mark.parametrize("case", ISA_CASES[:4], ids=[case_id(c) for c in ISA_CASES[:4]])
def test_isa_builds_agree(case, monkeypatch):
    cell, act, T, B, H, density, dt, reverse, lens, groups, empty = case
    p = make_problem(cell, T, B, H, density, DTYPES[dt], seed=11, lengths=lens,
                     empty_rows=empty)
    fast = ffi_forward(cell, p, reverse, act)
    monkeypatch.setenv("SPRNN_CPU_ISA", "base")
    base = ffi_forward(cell, p, reverse, act)
    for k in fast:
        close(fast[k], base[k], dt, f"default vs baseline build: {k}")


@pytest.mark.parametrize("isa", ["base", "default"])
def test_float16_weights_widen_exactly(isa, monkeypatch):
    """Each weight once through the rows: h = +-1, xp = 0 and a diagonal mask make every
    pre-activation one weight, so ReLU's output is +-the weight (or 0) bit for bit. Both builds
    (the default widens halves with F16C, 8 at a time, then a scalar tail: 240-247 weights give
    every tail length) over normals, subnormals, signed zeros, the largest half, inf and NaN."""
    if isa == "base":
        monkeypatch.setenv("SPRNN_CPU_ISA", "base")
    rng = np.random.default_rng(3)
    special = np.array([0.0, -0.0, 6e-8, -6e-8, 3e-5, 65504.0, -65504.0, np.inf, -np.inf,
                        np.nan, 1.0, -1.0], np.float16)
    for H in range(240, 248):
        magnitudes = 2.0 ** rng.uniform(-24, 15, H - special.size)
        values = np.concatenate([special, (magnitudes * rng.choice([-1, 1], magnitudes.size))
                                 .astype(np.float16)])
        w = jax_sprnn.SparseWeights.from_dense(jnp.asarray(np.diag(values)),
                                               np.eye(H, dtype=bool))
        for sign in (1, -1):
            p = dict(xp=jnp.zeros((1, 1, H), jnp.float16), w=w,
                     h0=jnp.full((1, H), sign, jnp.float16), lengths=jnp.ones((1,), jnp.int32))
            ys = np.asarray(ffi_forward("rnn", p, False, activation=1)["ys"], np.float32)[0, 0]
            signed = sign * values.astype(np.float32)
            expected = np.where(np.isnan(signed), np.nan, np.maximum(signed, 0))
            np.testing.assert_array_equal(ys, expected, err_msg=f"H={H}, h={sign}")


# A thread that keeps waiting for the others finishes the call alone (team.h, SoloSwitch);
# SPRNN_CPU_SOLO_TEST=1 forces the last thread to take over after step 1.
@pytest.mark.parametrize("case", THREADED[:3], ids=[case_id(c) for c in THREADED[:3]])
def test_threads_solo_switch(case, monkeypatch):
    monkeypatch.setenv("SPRNN_CPU_THREADS", "3")
    monkeypatch.setenv("SPRNN_CPU_SOLO_TEST", "1")
    check_case(case)
