"""The CUDA sparse persistent kernel (csrc/cuda/) vs the float64 NumPy oracle, every variant,
plus the safety properties of issue 3: jit beside other work, two calls in one program, vmap,
another kernel on another stream, and a timed-out wait that becomes a Python error.

Skips cleanly without a GPU or without the CUDA extension.
"""

import os
import threading
import zlib

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_sprnn as sp  # noqa: E402
import oracle  # noqa: E402
from jax_sprnn import _ffi, reference  # noqa: E402


def _gpu_ok():
    try:
        return bool(jax.devices("gpu")) and _ffi.cuda_module is not None
    except RuntimeError:
        return False


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_ok(), reason="needs a CUDA GPU and _sprnn_cuda")]

CELLS = ["rnn", "lstm", "gru"]
DTYPES = ["float32", "bfloat16", "float16"]
VARIANTS = [0, 1, 2, 3, 4]  # (a) naive, (b) wide, (c) bank-aware, (d) Lamport, per-step fallback
# (T, B, H, density, pattern): H = 1, odd and large; B = 1; T = 1; density 0 and 1; empty and
# skewed rows. Lengths and direction rotate over the cases.
SHAPES = [
    (1, 1, 1, 1.0, "uniform"),
    (7, 3, 37, 0.0, "uniform"),
    (5, 1, 64, 0.3, "empty_rows"),
    (1, 4, 33, 1.0, "uniform"),
    (12, 5, 129, 0.1, "skewed"),
    (9, 2, 300, 0.5, "uniform"),
    (6, 4, 1152, 0.1, "uniform"),
    (5, 9, 517, 0.2, "skewed"),
    (4, 16, 2048, 0.05, "uniform"),
]
LENGTHS = ["full", "ragged", "none"]


def kernel_forward(cell, xp, carry, w, lengths, b_hn=None, reverse=False, activation=0,
                   variant=-1):
    """The CUDA forward primitive with an explicit kernel variant. Returns (ys, carry, cs)."""
    from jax_sprnn.primitives import lowering  # noqa: F401, PLC0415 (registers lowerings)
    from jax_sprnn.primitives.recurrence import forward_p  # noqa: PLC0415

    steps, batch, _ = xp.shape
    if lengths is None:
        lengths = np.full(batch, steps, np.int32)
    extras = (b_hn,) if cell == "gru" else ()

    @jax.jit
    def run(xp, lengths, values, col_idx, row_ptr, carry, extras):
        return forward_p.bind(xp, lengths, values, col_idx, row_ptr, *carry, *extras, cell=cell,
                              reverse=reverse, activation=activation, variant=variant,
                              local=True)

    outs = run(jnp.asarray(xp), jnp.asarray(lengths, jnp.int32), w.values, w.col_idx, w.row_ptr,
               tuple(jnp.asarray(c) for c in carry), tuple(jnp.asarray(e) for e in extras))
    n_carry = 2 if cell == "lstm" else 1
    return outs[0], tuple(outs[1:1 + n_carry]), (outs[-1] if cell == "lstm" else None)


def check(cell, dtype, shape, variant, n, activation="tanh", bank_period=None, band=None,
          scale=None):
    steps, batch, hidden, density, pattern = shape
    rng = np.random.default_rng(zlib.crc32(repr((cell, dtype, shape, variant, n)).encode()))
    p = oracle.random_problem(rng, cell, steps, batch, hidden, density, jnp.dtype(dtype), pattern,
                              scale=0.7 if band is not None and scale is None else scale)
    if band is not None:  # output j reads only inputs within `band` of j % H (block-local)
        i = np.arange(hidden)[:, None]
        j = np.arange(p["mask"].shape[1])[None, :] % hidden
        p["mask"] = np.abs(i - j) <= band
        p["kernel"] = (np.asarray(p["kernel"], np.float32) * p["mask"]).astype(jnp.dtype(dtype))
    lengths = oracle.make_lengths(rng, LENGTHS[n % 3], steps, batch)
    reverse = bool(n % 2)
    kw = {} if bank_period is None else dict(bank_period=bank_period)
    w = sp.SparseWeights.from_dense(jnp.asarray(p["kernel"]), p["mask"], **kw)
    act = reference.ACTIVATIONS[activation]
    fallbacks = _ffi.cuda_module.step_fallbacks()
    ys, final, cs = kernel_forward(cell, p["xp"], p["carry"], w, lengths, p["b_hn"], reverse,
                                   act, variant)
    ref_ys, ref_final = oracle.run(cell, p["xp"], p["carry"], p["kernel"], lengths, p["b_hn"],
                                   reverse, activation)
    tol = oracle.RTOL[dtype]
    what = f"{cell} {dtype} variant={variant} shape={shape} lengths={lengths} reverse={reverse}"
    assert ys.dtype == jnp.dtype(dtype) and ys.shape == ref_ys.shape, what
    # A persistent plan that the GPU would not launch runs per step (correct, much slower).
    assert _ffi.cuda_module.step_fallbacks() == fallbacks, f"ran per step: {what}"
    err = oracle.rel_error(ys, ref_ys)
    assert err < tol, f"ys rel error {err:.3g} >= {tol} for {what}"
    for got, want in zip(final, ref_final):
        err = oracle.rel_error(got, want)
        assert err < tol, f"carry rel error {err:.3g} >= {tol} for {what}"
    full = np.full(batch, steps) if lengths is None else lengths
    pad = np.arange(steps)[:, None] >= np.asarray(full)[None, :]
    assert np.all(np.asarray(ys, np.float32)[pad] == 0), f"padding not zero for {what}"
    if cell == "lstm":
        _, _, ref_cs = reference.recurrence(
            "lstm", jnp.asarray(p["xp"], jnp.float32),
            tuple(jnp.asarray(c, jnp.float32) for c in p["carry"]),
            jnp.asarray(p["kernel"], jnp.float32),
            jnp.asarray(full, jnp.int32), reverse=reverse, return_cell_states=True)
        err = oracle.rel_error(cs, np.asarray(ref_cs, np.float64))
        assert err < tol, f"cs rel error {err:.3g} >= {tol} for {what}"
        assert np.all(np.asarray(cs, np.float32)[pad] == 0)


def reg_weight_builds(dtype):
    """The register-weights builds' knobs, with 4-byte and float words (16-bit types only)."""
    if dtype == "float32":
        return []
    return [{"SPRNN_CUDA_REG_WEIGHTS": "1", "SPRNN_CUDA_FLOAT_WORDS": words} for words in "01"]


def check_builds(monkeypatch, builds, cell, dtype, shapes, n0=0, **kw):
    """check() (variant 3) on every shape under each build's environment knobs."""
    for knobs in builds:
        with monkeypatch.context() as m:
            for name, value in knobs.items():
                m.setenv(name, value)
            for n, shape in enumerate(shapes):
                check(cell, dtype, shape, 3, n0 + n, **kw)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", CELLS)
def test_kernel_matches_oracle(cell, dtype, variant):
    # Variants 0 and 1 are the ablation's no-bank-order baselines: pack them plainly.
    bank_period = 0 if variant in (0, 1) else None
    for n, shape in enumerate(SHAPES):
        check(cell, dtype, shape, variant, n, bank_period=bank_period)


# Calls of one step (T = 1: B = 1, H = 1, density 0 and 1, skewed and empty rows, lengths 0 and
# 1 and reverse rotating over the cases).
ONE_STEP_SHAPES = [(1, 1, 1, 1.0, "uniform"), (1, 4, 33, 0.0, "uniform"),
                   (1, 9, 517, 0.2, "skewed"), (1, 3, 300, 0.3, "empty_rows"),
                   (1, 4, 1152, 0.1, "uniform"), (1, 5, 129, 1.0, "uniform"),
                   (1, 17, 70, 0.5, "skewed"),  # 17: three blocks of batch columns
                   (1, 2, 95, 0.4, "uniform")]  # 2: a block of 4 columns, two in use


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", CELLS)
def test_one_step_calls(cell, dtype):
    """The default plan of a one-step call (a sampling loop's iteration) is a single launch of
    the per-step kernel, which reads h0 / c0 and writes hT / cT itself."""
    calls = _ffi.cuda_module.one_step_calls()
    for n, shape in enumerate(ONE_STEP_SHAPES):
        act = "relu" if cell == "rnn" and n % 2 else "tanh"
        check(cell, dtype, shape, -1, n, activation=act)
    assert _ffi.cuda_module.one_step_calls() == calls + len(ONE_STEP_SHAPES)


def staged_fits(shape, dtype, one_step):
    """Whether the staged per-step kernel's copy of h (H x the block's 1, 4 or 8 columns, in the
    call's dtype for one-step calls, else float32) fits this GPU's shared memory for a block."""
    _, batch, hidden, _, _ = shape
    cols = 1 if batch <= 1 else 4 if batch <= 4 else 8
    copy = hidden * cols * (jnp.dtype(dtype).itemsize if one_step else 4)
    return copy <= _ffi.cuda_module.staged_step_max_bytes()


# One-step shapes about the 48 KB a kernel gets without raising its limit, for 16-bit blocks of 8
# columns: a 47 KB copy, and 48 KB (which with the block's other 1 KB of shared memory needs the
# limit raised).
STAGED_EDGE_SHAPES = [(1, 8, 3008, 0.05, "uniform"), (1, 8, 3072, 0.05, "uniform")]


# The staged per-step kernels by SPRNN_CUDA_STEP_STAGED value, each with its launch counter:
# step_fwd_staged (blocks looping over unit chunks) and step_fwd_tasks (each warp whole units).
STAGED_KERNELS = {"2": "staged_steps", "3": "task_steps"}


def step_launches():
    """Launches so far of step_fwd_staged and of step_fwd_tasks."""
    return {knob: getattr(_ffi.cuda_module, name)() for knob, name in STAGED_KERNELS.items()}


@pytest.mark.parametrize("kernel", STAGED_KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", CELLS)
def test_staged_step_kernel(cell, dtype, kernel, monkeypatch):
    """The staged per-step kernels (h of the block's columns copied into shared memory once)
    run by default only on large layers; forced wherever they fit, each must match the oracle
    on the one-step shapes and, as loop steps, variant 4's, and only it must run."""
    monkeypatch.setenv("SPRNN_CUDA_STEP_STAGED", kernel)
    before = step_launches()
    want = 0
    for n, shape in enumerate(ONE_STEP_SHAPES + STAGED_EDGE_SHAPES):
        check(cell, dtype, shape, -1, n, activation="relu" if cell == "rnn" and n % 2 else "tanh")
        want += staged_fits(shape, dtype, True)
    for n, shape in enumerate(SHAPES):
        check(cell, dtype, shape, 4, n)
        want += shape[0] * staged_fits(shape, dtype, False)
    after = step_launches()
    assert {k: after[k] - before[k] for k in after} == {k: want * (k == kernel) for k in after}


@pytest.mark.parametrize("kernel", STAGED_KERNELS)
def test_staged_step_kernel_at_the_device_limit(kernel, monkeypatch):
    """Loop steps whose float32 copy of h (8 columns) takes exactly the largest copy this GPU
    allows run the forced staged kernel and match the oracle; one unit more runs step_fwd."""
    monkeypatch.setenv("SPRNN_CUDA_STEP_STAGED", kernel)
    largest = _ffi.cuda_module.staged_step_max_bytes() // (8 * 4)
    for n, (hidden, want) in enumerate([(largest, 2), (largest + 1, 0)]):
        before = step_launches()[kernel]
        check("rnn", "float32", (2, 8, hidden, 0.01, "uniform"), 4, n)
        assert step_launches()[kernel] == before + want, f"H={hidden}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_staged_step_kernel_by_default(dtype, monkeypatch):
    """By default (step_kernels.cuh step_launch) step_fwd_tasks runs on layers of at least
    tasks_edge units per SM (at B=1, 4, 8: LSTM 12, 9, 8; GRU 17, 10, 10; RNN 40, 18, 5),
    step_fwd_staged on smaller ones of two chunks of units per SM, or with blocks of 4 or 8
    columns of 7/8 to one chunk per SM, step_fwd on the rest. Fixed cases, for GPUs of 65 to 144
    SMs: one-step LSTM H=4096 (B=8: a 64 KB copy of h, the limit raised) and ReLU H=5760 by
    tasks at B=1, 4 and 8; ReLU H=1152 at B=4 (36 chunks of 32 units) by step_fwd. And the
    rules' edges on this GPU at B=1, 4 and 8: the tasks edge of each cell, and for the LSTM
    (chunks of 8 units) the staged kernel's edges where they lie below the tasks edge: 7/8 of a
    chunk per SM (B=4 and 8) and one chunk (B=4)."""
    monkeypatch.delenv("SPRNN_CUDA_STEP_STAGED", raising=False)
    sms = _ffi.cuda_module.plan(4, 0, 1024, 4, 1024)["sms"]  # this GPU's (any layer's plan)
    cases = [("lstm", (1, batch, 4096, 0.1, "uniform"), "3") for batch in (1, 4, 8)]
    cases += [("rnn", (1, batch, 5760, 0.1, "uniform"), "3") for batch in (1, 4, 8)]
    cases += [("rnn", (1, 4, 1152, 0.1, "uniform"), None)]
    # (cell, B, tasks edge in units per SM, the kernel one unit below it)
    edges = [("lstm", 1, 12, None), ("lstm", 4, 9, None), ("lstm", 8, 8, "2"),
             ("gru", 1, 17, None), ("gru", 4, 10, "2"),
             ("rnn", 1, 40, None), ("rnn", 4, 18, None), ("rnn", 8, 5, None)]
    for cell, batch, edge, below in edges:
        cases += [(cell, (1, batch, edge * sms, 0.05, "uniform"), "3"),
                  (cell, (1, batch, edge * sms - 1, 0.05, "uniform"), below)]
    seven_eighths = -(-7 * sms // 8)  # chunks (rounded up)
    for batch in (4, 8):
        cases += [("lstm", (1, batch, 8 * seven_eighths, 0.1, "uniform"), "2"),
                  ("lstm", (1, batch, 8 * (seven_eighths - 1), 0.1, "uniform"), None)]
    cases += [("lstm", (1, 4, 8 * sms, 0.05, "uniform"), "2"),  # one chunk per SM
              ("lstm", (1, 4, 8 * sms + 1, 0.05, "uniform"), None)]
    for n, (cell, shape, want) in enumerate(cases):
        before = step_launches()
        check(cell, dtype, shape, -1, n)
        after = step_launches()
        got = {k: after[k] - before[k] for k in after}
        assert got == {k: int(k == want) for k in got}, f"{cell} {shape} {dtype}"


@pytest.mark.parametrize("staged", ["1", "2", "3"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", CELLS)
def test_one_step_nan_in_h0_reaches_only_its_readers(cell, dtype, staged, monkeypatch):
    # One-step calls of up to 4 columns gather without branches (step_kernels.cuh): a lane past
    # its row's end reads column 0 and a select drops its sum. So a NaN in h0's unit 0 must show
    # in exactly the units with a nonzero in column 0 (oracle.h0_nan_reach), in blocks of 1, 4
    # (two in use) and 8 columns; the other sequences match the oracle. The same in the staged
    # kernels (forced: SPRNN_CUDA_STEP_STAGED=2 or 3), whose lanes past the row read column 0
    # too.
    monkeypatch.setenv("SPRNN_CUDA_STEP_STAGED", staged)
    calls, before = _ffi.cuda_module.one_step_calls(), step_launches()
    cases = [(1, 300, 0.05), (4, 129, 0.1), (2, 517, 0.02), (6, 200, 0.05)]
    for n, (batch, hidden, density) in enumerate(cases):
        rng = np.random.default_rng(300 + n)
        p = oracle.random_problem(rng, cell, 1, batch, hidden, density, jnp.dtype(dtype))
        b = batch // 2
        h0 = np.asarray(p["carry"][-1]).copy()  # (lstm: the carry is (c, h))
        h0[b, 0] = np.nan
        p["carry"] = (*p["carry"][:-1], h0)
        want = oracle.h0_nan_reach(p["mask"], cell, 0)
        assert 0 < want.sum() < hidden, "the NaN should reach some units and not others"
        w = sp.SparseWeights.from_dense(jnp.asarray(p["kernel"]), p["mask"])
        act = n % 2 if cell == "rnn" else 0
        ys, _, _ = kernel_forward(cell, p["xp"], p["carry"], w, None, p["b_hn"], activation=act)
        got = np.isnan(np.asarray(ys, np.float32))
        np.testing.assert_array_equal(got[0, b], want, err_msg=f"{cell} {dtype} case {n}")
        err = oracle.others_error(ys, p, p["xp"], cell, b, ("tanh", "relu")[act])
        assert err < oracle.RTOL[dtype], f"rel error {err:.3g} of the other sequences, {dtype}"
    assert _ffi.cuda_module.one_step_calls() == calls + len(cases)  # all by the per-step kernel
    after = step_launches()
    want = {k: len(cases) * (k == staged) for k in after}
    assert {k: after[k] - before[k] for k in after} == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_large_and_wide_batch(dtype):
    for n, shape in enumerate([(8, 4, 5760, 0.1, "uniform"), (6, 64, 1152, 0.1, "uniform"),
                               (3, 33, 700, 0.3, "skewed")]):
        check("rnn", dtype, shape, 3, n, activation="relu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_sign_tagged_builds(dtype, monkeypatch):
    # ReLU layers run their own builds (launch.cuh kRnnRelu), whose exchange words carry a
    # one-bit step tag in each value's sign (storage.cuh XWord): the shape sweep (ragged
    # lengths with 0 and T, where a sequence that never runs keeps a negative h0, and reverse),
    # every tile and build that changes the gather (chunks of 2 and 4 units at tiles 4, 2 and 1,
    # their last one past H at odd H) or the rows (the deep gather with and without register
    # weights), and long sequences over which the bit alternates many times, one with a band
    # matrix where blocks wait on one unit each.
    for n, shape in enumerate(SHAPES):
        check("rnn", dtype, shape, 3, n, activation="relu")
    builds = [{"SPRNN_CUDA_BT": bt} for bt in ("1", "2", "8", "16", "64")]
    builds += [{"SPRNN_CUDA_DEEP_GATHER": "1", "SPRNN_CUDA_REG_WEIGHTS": "0"},
               {"SPRNN_CUDA_DEEP_GATHER": "1", "SPRNN_CUDA_REG_WEIGHTS": "1"},
               {"SPRNN_CUDA_W_CAP": "300"},
               {"SPRNN_CUDA_ROW_LANES": "16"}, {"SPRNN_CUDA_GROUPS": "4"}]
    check_builds(monkeypatch, builds + reg_weight_builds(dtype), "rnn", dtype,
                 SPLIT_SHAPES + [(6, 16, 300, 0.2, "skewed")], n0=1, activation="relu")
    # (Smaller weight scales than the sweep's: with those ReLU layers grow over hundreds of
    # steps, to infinity in float16.)
    for n, (steps, batch, hidden, density, pattern) in enumerate(
            [(300, 4, 1152, 0.1, "uniform"), (257, 3, 700, 0.3, "skewed")]):
        check("rnn", dtype, (steps, batch, hidden, density, pattern), 3, n, activation="relu",
              scale=0.75 / np.sqrt(density * hidden))
    check("rnn", dtype, (96, 17, 1152, 1.0, "uniform"), 3, 1, activation="relu", band=1,
          scale=0.25)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell,activation", [("lstm", 0), ("rnn", 1), ("rnn", 0), ("gru", 0)])
def test_nan_reaches_every_later_step(cell, activation, dtype):
    # Bit-tagged words (storage.cuh XWord): float32 LSTM layers have no room for NaN and
    # publish it as a code that readers turn back into NaN; ReLU layers' NaN (a ReLU keeps it,
    # as jax.nn.relu) has its sign bit cleared for the tag. One NaN input must reach exactly the
    # units that read it through a nonzero, step after step (oracle.nan_reach; the dense
    # oracle's matmul would spread it through the zeros too), in the builds the plans pick
    # (tile 4, tile 1, tile 16), in every cell; the other sequences match the oracle.
    act = ("tanh", "relu")[activation]
    for n, (steps, batch, hidden, density) in enumerate(
            [(6, 4, 300, 0.3), (5, 4, 1024, 0.02), (5, 1, 129, 0.05), (4, 16, 300, 0.01)]):
        rng = np.random.default_rng(100 + n)
        p = oracle.random_problem(rng, cell, steps, batch, hidden, density, jnp.dtype(dtype))
        b = batch // 2
        xp, want = oracle.with_nan(p, cell, b)  # the first gate of unit 5 at t = 1
        w = sp.SparseWeights.from_dense(jnp.asarray(p["kernel"]), p["mask"])
        ys, _, _ = kernel_forward(cell, xp, p["carry"], w, None, p["b_hn"], activation=activation)
        np.testing.assert_array_equal(np.isnan(np.asarray(ys, np.float32)), want,
                                      err_msg=f"{cell} {act} {dtype} case {n}")
        err = oracle.others_error(ys, p, xp, cell, b, act)
        assert err < oracle.RTOL[dtype], f"rel error {err:.3g} of the other sequences, {dtype}"


# Batch tiles of 16 to 64 (the "batch lanes" row mapping, several lanes per nonzero) and
# batches over several of them: B=16 -> one tile of 16, 17 -> one of 32 with 15 padding
# columns, 33 and 64 -> one of 64 where H x 64 values fit in shared memory, else tiles of 32
# (33: the second with one real column).
LARGE_B_SHAPES = [
    (9, 16, 300, 0.2, "uniform"),
    (7, 17, 129, 0.3, "skewed"),
    (6, 33, 517, 0.1, "empty_rows"),
    (5, 64, 1152, 0.1, "uniform"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", CELLS)
def test_large_batch_tiles(cell, dtype, monkeypatch):
    # All blocks on every tile, in turn (the default runs these batches in batch groups:
    # test_batch_groups and the shape sweep).
    monkeypatch.setenv("SPRNN_CUDA_GROUPS", "1")
    for shape in LARGE_B_SHAPES:
        for n in (1, 4):  # ragged lengths (with 0 and T), reverse and forward
            check(cell, dtype, shape, 3, n)
    check(cell, dtype, (6, 33, 517, 0.1, "uniform"), 1, 1, bank_period=0)  # barrier exchange


def test_large_batch_tile_plans(monkeypatch):
    from jax_sprnn.primitives import cuda_lowering  # noqa: PLC0415

    nnz = int(0.1 * 1152 * 1152)
    # (The default's batch groups on an H200: tests/test_cuda_plans.py.)
    monkeypatch.setenv("SPRNN_CUDA_GROUPS", "1")  # below: the tile choice alone
    for dtype, B, bt, tiles in [(jnp.float16, 8, 8, 1), (jnp.float16, 9, 16, 1),
                                (jnp.float16, 17, 32, 1), (jnp.float16, 33, 64, 1),
                                (jnp.float16, 64, 64, 1), (jnp.float32, 5, 8, 1),
                                (jnp.float32, 33, 32, 2),  # 64 x H float32 does not fit
                                (jnp.bfloat16, 16, 16, 1)]:
        info = cuda_lowering.plan("rnn", dtype, 1152, B, nnz, variant=3)  # the grid planner
        assert info["persistent"] and info["on_chip"], info
        assert (info["batch_tile"], info["tiles"]) == (bt, tiles), (dtype, B, info)
        if bt >= 16:
            assert info["threads"] <= 512, info


# Batches past the largest tile (64 columns): batch groups or tiles in turn, the last partial.
PAST_TILE_SHAPES = [(5, 65, 300, 0.2, "uniform"), (4, 130, 129, 0.3, "skewed"),
                    (3, 300, 517, 0.1, "empty_rows")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", CELLS)
def test_batches_past_the_largest_tile(cell, dtype):
    for n, shape in enumerate(PAST_TILE_SHAPES):
        check(cell, dtype, shape, -1, n)  # the default plan; ragged lengths, both directions


@pytest.mark.parametrize("cell", CELLS)
def test_offsets_past_int32(cell):
    # xp of more than 2**31 halves (4.3 GB; the rnn's ys too) in which three sequences run:
    # every index of the kernels' last steps passes int32.
    hidden, batch = 256, 1024
    steps = 2**31 // (batch * oracle.GATES[cell] * hidden) + 8
    errors, idle_ys, idle_carry_off = oracle.check_few_live_sequences(
        cell, steps, batch, hidden, "float16", [0, 517, batch - 1])
    assert max(errors) < oracle.RTOL["float16"], errors
    assert idle_ys == 0 and set(idle_carry_off) == {0}, (idle_ys, idle_carry_off)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forced_tiles_and_column_filter(dtype, monkeypatch):
    # Several tiles of 16 with a ragged last one, and tiles of 32 / 16 with the filter off.
    monkeypatch.setenv("SPRNN_CUDA_BT", "16")
    check("lstm", dtype, (5, 40, 300, 0.2, "uniform"), 3, 1)
    check("rnn", dtype, (5, 64, 1152, 0.1, "uniform"), 3, 4, activation="relu")
    monkeypatch.setenv("SPRNN_CUDA_BT", "32")
    check("gru", dtype, (5, 20, 129, 0.3, "skewed"), 3, 1)
    check("rnn", dtype, (4, 64, 300, 0.1, "uniform"), 3, 4, activation="relu")  # two tiles
    monkeypatch.setenv("SPRNN_CUDA_COL_FILTER", "0")
    check("rnn", dtype, (6, 33, 517, 0.1, "uniform"), 3, 1)
    monkeypatch.delenv("SPRNN_CUDA_BT")
    check("gru", dtype, (6, 17, 1152, 0.1, "uniform"), 3, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", CELLS)
def test_two_rows_per_warp(cell, dtype, monkeypatch):
    # Half a warp per row (rows.cuh compute_rows). By default only where it saves a pass
    # over the rows (LSTM H=1024: 31 rows per block, 16 warps); SPRNN_CUDA_ROW_LANES=16 forces
    # it on every shape, incl. a row left without a partner and the 16-wide tiles (two lanes
    # per nonzero).
    check(cell, dtype, (6, 4, 1024, 0.1, "skewed"), 3, 0)
    monkeypatch.setenv("SPRNN_CUDA_ROW_LANES", "16")
    for n, shape in enumerate(SHAPES):
        check(cell, dtype, shape, 3, n)
    monkeypatch.setenv("SPRNN_CUDA_BT", "16")
    check(cell, dtype, (5, 20, 300, 0.2, "skewed"), 3, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", CELLS)
def test_batch_groups(cell, dtype, monkeypatch):
    # Batch groups (SPRNN_CUDA_GROUPS, Params::groups): every batch tile on its own blocks, all
    # tiles at once. Ragged lengths (a group can finish early and write its own padding),
    # reverse, a ragged last tile, tiles of 1 to 16 (16: the column filter), barrier variant.
    from jax_sprnn.primitives import cuda_lowering  # noqa: PLC0415

    monkeypatch.setenv("SPRNN_CUDA_GROUPS", "4")
    info = cuda_lowering.plan(cell, jnp.dtype(dtype), 1152, 16, int(0.1 * 1152 * 1152 * 3))
    assert (info["groups"], info["batch_tile"], info["tiles"]) == (4, 4, 4), info
    assert info["blocks"] % 4 == 0 and info["on_chip"], info
    for n, shape in enumerate([(7, 16, 1152, 0.1, "uniform"), (6, 13, 300, 0.2, "skewed"),
                               (5, 64, 1152, 0.1, "uniform"), (6, 8, 129, 0.0, "uniform"),
                               (5, 6, 517, 0.3, "empty_rows")]):
        check(cell, dtype, shape, 3, n)
    check(cell, dtype, (5, 16, 300, 0.2, "uniform"), 1, 1, bank_period=0)
    monkeypatch.setenv("SPRNN_CUDA_GROUPS", "64")  # 17 tiles of 1, 7 blocks each
    check(cell, dtype, (5, 17, 300, 0.2, "skewed"), 3, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", CELLS)
def test_deep_gather(cell, dtype, monkeypatch):
    # The tile-4 build with twice the h bytes in flight per thread (launch.cuh, handlers.cu):
    # the default plan at a large H (deep for 16-bit layers whose gather needs more than one
    # round), and forced on every shape (tiles other than 4 ignore it) with
    # SPRNN_CUDA_DEEP_GATHER=1, float32 included.
    check(cell, dtype, (3, 4, 4608 if cell == "rnn" else 2304, 0.05, "skewed"), 3, 1)
    monkeypatch.setenv("SPRNN_CUDA_DEEP_GATHER", "1")
    for n, shape in enumerate(SHAPES):
        check(cell, dtype, shape, 3, n)
    monkeypatch.setenv("SPRNN_CUDA_THREADS", "128")  # a gather of several deep rounds
    check(cell, dtype, (4, 4, 2304, 0.05, "uniform"), 3, 2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tensor_core_rows(dtype, monkeypatch):
    # The rows on the tensor cores (mma_rows.cuh; 16-bit ReLU layers): the default plan where it
    # is picked, then forced on every shape (H not a multiple of 32, density 0 and 1, T = 1;
    # batches other than 3-4 run other tiles without it). Calls that the build cannot run (a
    # block of a skewed pattern over its 24 rows, inf or NaN in h) run again on the sparse rows:
    # exact results, counted by mma_reruns; the others must not rerun.
    from jax_sprnn.primitives import cuda_lowering  # noqa: PLC0415

    reruns = _ffi.cuda_module.mma_reruns
    before = reruns()
    for H, d in ((2304, 0.3), (1536, 0.5)):  # two and one 16-row tiles per block
        assert cuda_lowering.plan("rnn", jnp.dtype(dtype), H, 4, int(d * H * H),
                                  activation="relu")["mma"]
        check("rnn", dtype, (5, 4, H, d, "uniform"), 3, 1, activation="relu")
    monkeypatch.setenv("SPRNN_CUDA_MMA", "1")
    for n, shape in enumerate(SHAPES + [(4, 3, 1000, 1.0, "uniform"), (6, 4, 2500, 0.5, "uniform"),
                                        (3, 4, 700, 0.6, "empty_rows")]):
        check("rnn", dtype, shape, 3, n, activation="relu")
    assert reruns() == before
    check("rnn", dtype, (4, 4, 2304, 0.3, "skewed"), 3, 2, activation="relu")
    assert reruns() == before + 1  # the skewed pattern's first blocks hold > 24 rows
    rng = np.random.default_rng(7)
    p = oracle.random_problem(rng, "rnn", 6, 4, 2304, 0.3, jnp.dtype(dtype))
    xp, want = oracle.with_nan(p, "rnn", 1)
    w = sp.SparseWeights.from_dense(jnp.asarray(p["kernel"]), p["mask"])
    ys, _, _ = kernel_forward("rnn", xp, p["carry"], w, None, activation=1)
    np.testing.assert_array_equal(np.isnan(np.asarray(ys, np.float32)), want)
    assert oracle.others_error(ys, p, xp, "rnn", 1, "relu") < oracle.RTOL[dtype]
    assert reruns() == before + 2


@pytest.mark.parametrize("words", ["offset_words", "column_words", "float_words"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("cell", CELLS)
def test_reg_weights(cell, dtype, words, monkeypatch):
    # The tile-4 build with each lane's first weights in registers (rows.cuh
    # kRegWeights), with 4-byte offset or column words or 8-byte float words (RowWord): the
    # default plan where it is picked, then forced on every shape (other tiles ignore it) and
    # on rows longer than the register round (shared-memory rounds after it), skewed and with
    # empty rows, whole and half warps per row; float words also where they push nonzeros out
    # to L2.
    from jax_sprnn.primitives import cuda_lowering  # noqa: PLC0415

    def plan(H, d):
        nnz = int(d * oracle.GATES[cell] * H * H)
        return cuda_lowering.plan(cell, jnp.dtype(dtype), H, 4, nnz)

    monkeypatch.setenv("SPRNN_CUDA_FLOAT_WORDS", "1" if words == "float_words" else "0")
    monkeypatch.setenv("SPRNN_CUDA_OFFSET_WORDS", "0" if words == "column_words" else "1")
    H, d = (2304, 0.3) if cell == "rnn" else (1024, 0.1)
    info = plan(H, d)
    assert info["reg_weights"] and info["float_words"] == (words == "float_words"), info
    assert info["offset_words"] == (words == "offset_words"), info
    check(cell, dtype, (3, 4, H, d, "skewed"), 3, 1)
    if words == "float_words":
        d = 0.2 if cell == "rnn" else 0.1
        info = plan(4096, d)
        assert info["float_words"] and not info["on_chip"], info
        check(cell, dtype, (3, 4, 4096, d, "uniform"), 3, 2)
    monkeypatch.setenv("SPRNN_CUDA_REG_WEIGHTS", "1")
    for n, shape in enumerate(SHAPES + [(4, 3, 700, 0.6, "empty_rows"), (5, 4, 900, 0.4, "skewed")]):
        check(cell, dtype, shape, 3, n)
    for lanes in ("16", "32"):
        monkeypatch.setenv("SPRNN_CUDA_ROW_LANES", lanes)
        check(cell, dtype, (4, 4, 517, 0.7, "skewed"), 3, 2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("cell", CELLS)
def test_column_words(cell, dtype, monkeypatch):
    # The 16-bit tile-4 builds keep a nonzero's column where its unit's byte offset does not
    # fit an offset word (H > 8192; storage.cuh RowWord), and with SPRNN_CUDA_OFFSET_WORDS=0
    # anywhere: such a layer (rnn, tanh and ReLU) in its default deep build, then the plain,
    # deep and register builds with column words forced over the larger shapes of the sweep.
    from jax_sprnn.primitives import cuda_lowering  # noqa: PLC0415

    if cell == "rnn":
        H, d = 8200, 0.01
        for n, act in enumerate(["tanh", "relu"]):
            info = cuda_lowering.plan(cell, jnp.dtype(dtype), H, 4, int(d * H * H),
                                      activation=act)
            assert info["batch_tile"] == 4 and info["deep_gather"], info
            assert not info["offset_words"] and info["on_chip"], info
            check(cell, dtype, (3, 4, H, d, "skewed"), 3, n, activation=act)
    monkeypatch.setenv("SPRNN_CUDA_OFFSET_WORDS", "0")
    check_builds(monkeypatch, [{}, {"SPRNN_CUDA_DEEP_GATHER": "1"},
                               {"SPRNN_CUDA_REG_WEIGHTS": "1", "SPRNN_CUDA_FLOAT_WORDS": "0"}],
                 cell, dtype, SHAPES[4:])


SPLIT_SHAPES = [(5, 4, 517, 0.3, "skewed"), (4, 9, 1152, 0.1, "empty_rows")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", CELLS)
def test_rows_from_l2(cell, dtype, monkeypatch):
    # Rows past a block's on-chip room run from L2 in rounds (rows.cuh row_dot).
    # SPRNN_CUDA_W_CAP caps the room: 0 puts every row in L2 (the shape sweep, and the naive
    # layout); 300 words split blocks between the two paths (the row offsets come first), in
    # the default build and in those that change the row loop: register weights, float words,
    # the deep gather, half warps, tiles 1, 2 (gather chunks of several units, at odd H the last
    # one past H) and 16.
    from jax_sprnn.primitives import cuda_lowering  # noqa: PLC0415

    monkeypatch.setenv("SPRNN_CUDA_W_CAP", "0")
    info = cuda_lowering.plan(cell, jnp.dtype(dtype), 517, 4, 50000)
    assert info["nnz_per_block_capacity"] == 0 and not info["on_chip"], info
    for n, shape in enumerate(SHAPES):
        check(cell, dtype, shape, 3, n)
    check(cell, dtype, (5, 4, 300, 0.5, "skewed"), 0, 1, bank_period=0)
    monkeypatch.setenv("SPRNN_CUDA_W_CAP", "300")
    builds = [{}, {"SPRNN_CUDA_DEEP_GATHER": "1"}, {"SPRNN_CUDA_ROW_LANES": "16"},
              {"SPRNN_CUDA_BT": "1"}, {"SPRNN_CUDA_BT": "2"}, {"SPRNN_CUDA_BT": "16"}]
    check_builds(monkeypatch, builds + reg_weight_builds(dtype), cell, dtype, SPLIT_SHAPES)


@pytest.mark.parametrize("cell", CELLS)
def test_block_local_weights_long_sequence(cell):
    # A banded matrix: a block's rows read only its own and neighbouring units, so with the
    # column filter the blocks depend on each other only through the one unit per block every
    # block reads (the Lamport two-slot rule). 96 steps, 132 blocks: a block running two
    # steps ahead would overwrite words a slower block still waits for (timeout error).
    check(cell, "float16", (96, 17, 1152, 1.0, "uniform"), 3, 1, band=1)
    check(cell, "float32", (40, 33, 700, 1.0, "uniform"), 3, 4, band=0)


def test_lstm_h4096_on_chip_plan():
    from jax_sprnn.primitives import cuda_lowering  # noqa: PLC0415

    nnz = int(0.1 * 4096 * 4 * 4096)
    info = cuda_lowering.plan("lstm", jnp.float16, 4096, 4, nnz)
    assert info["persistent"], info
    assert cuda_lowering.plan("lstm", jnp.float16, 4096, 2, nnz)["on_chip"]
    check("lstm", "float16", (3, 4, 4096, 0.1, "uniform"), 3, 0)


# ---- variant 5: Hopper thread block clusters (cluster_kernel.cuh) ------------------------------

def _cc_major():
    try:
        return int(str(jax.devices("gpu")[0].compute_capability).split(".")[0])
    except Exception:  # noqa: BLE001
        return 0


needs_sm90 = pytest.mark.skipif(_cc_major() < 9, reason="thread block clusters need sm_90+")

# Batches over several clusters (one per tile of up to 16): B=17 -> two tiles of 16, 33 -> three
# (the last with one column), 64 -> four; H below, at and above the cluster's 16 CTAs.
CLUSTER_SHAPES = [
    (6, 1, 300, 0.2, "uniform"),
    (5, 2, 9, 0.5, "uniform"),
    (7, 17, 129, 0.3, "skewed"),
    (6, 33, 517, 0.1, "empty_rows"),
    (5, 64, 1152, 0.1, "uniform"),
]


@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", CELLS)
def test_cluster_matches_oracle(cell, dtype):
    from jax_sprnn.primitives import cuda_lowering  # noqa: PLC0415

    for n, shape in enumerate(SHAPES + CLUSTER_SHAPES):
        check(cell, dtype, shape, 5, n)
    for shape in CLUSTER_SHAPES[2:]:
        check(cell, dtype, shape, 5, 1)  # ragged lengths with 0 and T, reverse
    # The sweep above ran the cluster kernel, not only variant 5's fallback to 3.
    info = cuda_lowering.plan(cell, dtype, 300, 4, int(0.2 * 300 * 300 * oracle.GATES[cell]),
                              variant=5)
    assert info["variant"] == 5 and info["cluster"] > 0, info


@needs_sm90
@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_cluster_sizes(size, monkeypatch):
    # Smaller clusters (3: a size that is not a power of two) and the relu activation.
    monkeypatch.setenv("SPRNN_CUDA_CLUSTER", str(size))
    check("rnn", "float16", (9, 5, 517, 0.1, "uniform"), 5, 1, activation="relu")
    check("lstm", "float32", (6, 9, 129, 0.3, "skewed"), 5, 4)


def test_public_api_routes_to_kernel():
    rng = np.random.default_rng(0)
    p = oracle.random_problem(rng, "gru", 6, 3, 96, 0.2, jnp.float32)
    w = sp.SparseWeights.from_dense(jnp.asarray(p["kernel"]), p["mask"])
    ys, h = sp.gru(p["xp"], p["carry"][0], w, p["b_hn"], implementation="kernel")
    ref_ys, _ = oracle.run("gru", p["xp"], p["carry"], p["kernel"], None, p["b_hn"])
    assert oracle.rel_error(ys, ref_ys) < oracle.RTOL["float32"]


# ---- safety ------------------------------------------------------------------------------------

def _problem(seed, cell="rnn", steps=32, batch=4, hidden=1152, density=0.1, dtype=jnp.float16):
    rng = np.random.default_rng(seed)
    p = oracle.random_problem(rng, cell, steps, batch, hidden, density, jnp.dtype(dtype))
    w = sp.SparseWeights.from_dense(jnp.asarray(p["kernel"]), p["mask"])
    return p, w


def test_jit_beside_other_work():
    p, w = _problem(1)
    a = jnp.asarray(np.random.default_rng(2).standard_normal((2048, 2048)), jnp.float32)

    @jax.jit
    def f(xp, h0, a):
        m = a @ a  # independent work XLA may overlap with the kernel
        ys, h = sp.rnn(xp, h0, w, implementation="kernel")
        return ys, h, (m @ a).sum()

    ys, _, s = f(p["xp"], p["carry"][0], a)
    ref_ys, _ = oracle.run("rnn", p["xp"], p["carry"], p["kernel"])
    assert oracle.rel_error(ys, ref_ys) < oracle.RTOL["float16"]
    np.testing.assert_allclose(float(s), float(((a @ a) @ a).sum()), rtol=1e-3)


def test_two_calls_in_one_program_bidirectional():
    p, w = _problem(3, cell="lstm", hidden=1024)
    lengths = np.array([32, 17, 0, 5], np.int32)

    @jax.jit
    def f(xp, carry):
        fwd = sp.lstm(xp, carry, w, lengths, implementation="kernel")
        bwd = sp.lstm(xp, carry, w, lengths, reverse=True, implementation="kernel")
        return fwd, bwd

    (ys_f, _), (ys_b, _) = f(p["xp"], p["carry"])
    ref_f, _ = oracle.run("lstm", p["xp"], p["carry"], p["kernel"], lengths)
    ref_b, _ = oracle.run("lstm", p["xp"], p["carry"], p["kernel"], lengths, reverse=True)
    assert oracle.rel_error(ys_f, ref_f) < oracle.RTOL["float16"]
    assert oracle.rel_error(ys_b, ref_b) < oracle.RTOL["float16"]


def test_vmap_folds_into_batch():
    p, w = _problem(4, cell="gru", hidden=512, batch=3, dtype=jnp.float32)
    rng = np.random.default_rng(5)
    xs = rng.standard_normal((5,) + p["xp"].shape).astype(np.float32)
    h0s = rng.standard_normal((5,) + p["carry"][0].shape).astype(np.float32) * 0.5
    f = jax.jit(jax.vmap(lambda x, h: sp.gru(x, h, w, p["b_hn"], implementation="kernel")))
    ys, hs = f(xs, h0s)
    for i in range(5):
        ref_ys, ref_h = oracle.run("gru", xs[i], (h0s[i],), p["kernel"], None, p["b_hn"])
        assert oracle.rel_error(ys[i], ref_ys) < oracle.RTOL["float32"]
        assert oracle.rel_error(hs[i], ref_h[0]) < oracle.RTOL["float32"]


def test_concurrent_kernel_on_another_stream():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    p, w = _problem(6, steps=256, hidden=2304, density=0.3)
    f = jax.jit(lambda xp, h0: sp.rnn(xp, h0, w, "tanh", implementation="kernel"))
    ref_ys, _ = oracle.run("rnn", p["xp"], p["carry"], p["kernel"])
    f(p["xp"], p["carry"][0])[0].block_until_ready()  # compile first
    stop = threading.Event()

    def busy():
        s = torch.cuda.Stream()
        a = torch.randn(4096, 4096, device="cuda")
        with torch.cuda.stream(s):
            while not stop.is_set():
                for _ in range(20):
                    a = torch.tanh(a @ a * 1e-3)
                s.synchronize()

    t = threading.Thread(target=busy)
    t.start()
    try:
        for _ in range(10):
            ys, _ = f(p["xp"], p["carry"][0])
            assert oracle.rel_error(ys, ref_ys) < oracle.RTOL["float16"]
    finally:
        stop.set()
        t.join()


def test_timeout_becomes_python_error(monkeypatch):
    p, w = _problem(7, steps=128, hidden=2048)
    ref_ys, _ = oracle.run("rnn", p["xp"], p["carry"], p["kernel"])
    # A wait checks its bound every 32 or 64 polls, so even at 0 one expires only if it spins
    # that long, which this layer's waits may not do (the stalled-barrier test below always
    # times out).
    monkeypatch.setenv("SPRNN_CUDA_TIMEOUT_MS", "0")
    raised = False
    try:
        ys, _, _ = kernel_forward("rnn", p["xp"], p["carry"], w, None, variant=3)
        ys = np.asarray(ys)
    except Exception as err:  # noqa: BLE001 - XlaRuntimeError's class moves between versions
        assert "timed out" in str(err), err
        raised = True
    if not raised:  # no wait spun long enough to expire: the result must then be right
        assert oracle.rel_error(ys, ref_ys) < oracle.RTOL["float16"]
    monkeypatch.delenv("SPRNN_CUDA_TIMEOUT_MS")
    ys, _, _ = kernel_forward("rnn", p["xp"], p["carry"], w, None, variant=3)
    assert oracle.rel_error(ys, ref_ys) < oracle.RTOL["float16"]  # the GPU is still usable


@pytest.mark.parametrize("timeout_ms", ["50", "-5"])
def test_stalled_barrier_times_out_into_a_python_error(monkeypatch, timeout_ms):
    # SPRNN_CUDA_TEST_STALL=1 keeps the grid barrier (variant 0) shut, so every wait must end
    # by its bound. The lowering refuses a negative bound, but one set after compiling reaches
    # the handler, which must take it as 0 (compared as unsigned it was no bound: a hang).
    p, w = _problem(7, steps=8, hidden=512)
    run = jax.jit(lambda xp, h0: kernel_forward("rnn", xp, (h0,), w, None, variant=0)[0])
    args = (jnp.asarray(p["xp"]), jnp.asarray(p["carry"][0]))
    compiled = run.lower(*args).compile()
    monkeypatch.setenv("SPRNN_CUDA_TEST_STALL", "1")
    monkeypatch.setenv("SPRNN_CUDA_TIMEOUT_MS", timeout_ms)
    with pytest.raises(Exception, match="timed out waiting for other blocks"):
        np.asarray(compiled(*args))
    monkeypatch.delenv("SPRNN_CUDA_TEST_STALL")
    monkeypatch.delenv("SPRNN_CUDA_TIMEOUT_MS")
    ref_ys, _ = oracle.run("rnn", p["xp"], p["carry"], p["kernel"])
    assert oracle.rel_error(compiled(*args), ref_ys) < oracle.RTOL["float16"]  # still usable
