"""jit and vmap: traced lengths, folded batch axes, per-instance weight gradients, ensembles;
JAX's strict promotion modes."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_sprnn as sp
import oracle
from jax_sprnn.flax import SparseGRU, SparseLSTM, SparseSimpleRNN
from jax_sprnn.flax import nnx as sparse_nnx


def _setup(cell="lstm", seed=0, steps=6, batch=3, hidden=13):
    rng = np.random.default_rng(seed)
    p = oracle.random_problem(rng, cell, steps, batch, hidden, 0.3, jnp.dtype("float32"))
    return rng, p, sp.SparseWeights.from_dense(p["kernel"], p["mask"])


def test_jit_with_traced_lengths():
    rng, p, w = _setup()
    lengths = np.array([6, 1, 4], np.int32)
    f = jax.jit(lambda xp, carry, lengths: sp.lstm(xp, carry, w, lengths, reverse=True))
    ys, final = f(p["xp"], p["carry"], lengths)
    ref_ys, ref_final = oracle.run("lstm", p["xp"], p["carry"], p["kernel"], lengths,
                                   reverse=True)
    assert oracle.rel_error(ys, ref_ys) < 2e-5
    assert oracle.rel_error(final[1], ref_final[1]) < 2e-5


def test_weights_as_jit_argument():
    rng, p, w = _setup("gru")
    f = jax.jit(lambda xp, h0, w, b: sp.gru(xp, h0, w, b))
    ys, _ = f(p["xp"], p["carry"][0], w, p["b_hn"])
    ref, _ = oracle.run("gru", p["xp"], p["carry"], p["kernel"], b_hn=p["b_hn"])
    assert oracle.rel_error(ys, ref) < 2e-5


def test_jax_export_with_the_custom_call_check_disabled():
    # README's recipe: JAX refuses our targets by default and runs them once allowed.
    from jax import export

    _, p, w = _setup()
    f = jax.jit(lambda xp, carry: sp.lstm(xp, carry, w))
    target = "sprnn_lstm_fwd"
    with pytest.raises(ValueError, match=target):
        export.export(f)(p["xp"], p["carry"])
    exported = export.export(
        f, disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(p["xp"], p["carry"])
    ys, _ = exported.call(p["xp"], p["carry"])
    ref, _ = oracle.run("lstm", p["xp"], p["carry"], p["kernel"])
    assert oracle.rel_error(ys, ref) < 2e-5


def test_jax_export_with_symbolic_steps_and_batch():
    from jax import export

    from jax_sprnn.primitives import cuda_lowering

    _, p, w = _setup()
    f = jax.jit(lambda xp, carry: sp.lstm(xp, carry, w))
    checks = [export.DisabledSafetyCheck.custom_call("sprnn_lstm_fwd")]
    steps, batch, hidden = export.symbolic_shape("t, b, 13")
    args = (jax.ShapeDtypeStruct((steps, 3, 4 * hidden), jnp.float32),
            (jax.ShapeDtypeStruct((3, hidden), jnp.float32),) * 2)
    exported = export.export(f, disabled_checks=checks)(*args)  # any number of steps
    for t in (2, 6):
        ys, _ = exported.call(p["xp"][:t], p["carry"])
        ref, _ = oracle.run("lstm", p["xp"][:t], p["carry"], p["kernel"])
        assert oracle.rel_error(ys, ref) < 2e-5
    if cuda_lowering.available("lstm"):  # the CUDA plan and workspace depend on the batch
        batch_args = (jax.ShapeDtypeStruct((6, batch, 4 * hidden), jnp.float32),
                      (jax.ShapeDtypeStruct((batch, hidden), jnp.float32),) * 2)
        with pytest.raises(ValueError, match="concrete batch size"):
            export.export(f, disabled_checks=checks, platforms=("cuda",))(*batch_args)


def test_platforms_without_a_kernel_run_the_pure_jax_fallback(monkeypatch):
    # TPU, ROCm, ...: lowered for them here and run on this CPU (the platform check off), the
    # program holds no custom call and agrees with the oracle, forward and gradients.
    from jax import export

    from jax_sprnn.primitives import cuda_lowering

    monkeypatch.setattr(cuda_lowering, "_warned", set())
    checks = [export.DisabledSafetyCheck.platform()]

    def exported_for(platform, fun, *args):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = export.export(jax.jit(fun), platforms=[platform], disabled_checks=checks)(*args)
        said = [c for c in caught if f"no kernel for {platform}" in str(c.message)]
        assert "custom_call" not in out.mlir_module()
        return out, len(said)

    for n, cell in enumerate(["rnn", "lstm", "gru"]):
        _, p, w = _setup(cell, seed=n)
        lengths = np.array([6, 0, 3], np.int32)

        def f(xp, carry, w, b_hn):
            return oracle.run_api(cell, xp, carry, w, b_hn, lengths, reverse=True)

        def loss(xp, carry, w, b_hn):
            return jnp.sum(jnp.sin(f(xp, carry, w, b_hn)[0]))

        args = (p["xp"], p["carry"], w, p["b_hn"])
        exported, warned = exported_for("tpu", f, *args)
        grad, warned_again = exported_for("tpu", jax.grad(loss), *args)
        assert (warned, warned_again) == (n == 0, 0)  # once per platform
        ys, final = exported.call(*args)
        ref_ys, ref_final = oracle.run(cell, p["xp"], p["carry"], p["kernel"], lengths,
                                       p["b_hn"], reverse=True)
        assert oracle.rel_error(ys, ref_ys) < 2e-5
        assert oracle.rel_error(final[-1], ref_final[-1]) < 2e-5
        assert oracle.rel_error(grad.call(*args), jax.grad(loss)(*args)) < 1e-5
        # ROCm: checked by its text only. Since jax 0.11 a GPU module computes cumsum (the
        # fallback's row index of each nonzero) as a chlo.scan composite, which XLA's CPU
        # compiler aborts on (session 97), so such a module cannot run here.
        assert exported_for("rocm", f, *args)[1] == (n == 0)


@pytest.mark.parametrize("cell", ["rnn", "lstm", "gru"])
def test_vmap_over_xp_carry_and_lengths(cell):
    rng, p, w = _setup(cell)
    n = 4
    xps = rng.standard_normal((n,) + p["xp"].shape).astype(np.float32)
    carries = tuple(rng.standard_normal((n,) + c.shape).astype(np.float32) for c in p["carry"])
    lengths = rng.integers(0, p["xp"].shape[0] + 1, (n, p["xp"].shape[1])).astype(np.int32)

    def f(xp, carry, lengths):
        return oracle.run_api(cell, xp, carry, w, p["b_hn"], lengths)

    batched = jax.jit(jax.vmap(f))(xps, carries, lengths)
    for i in range(n):
        one = f(xps[i], tuple(c[i] for c in carries), lengths[i])
        for a, b in zip(jax.tree.leaves(batched), jax.tree.leaves(one)):
            np.testing.assert_allclose(np.asarray(a)[i], np.asarray(b), rtol=1e-6, atol=1e-6)


def test_vmap_time_axis_not_leading_and_nested():
    rng, p, w = _setup("rnn")
    xps = rng.standard_normal((2, 3) + p["xp"].shape).astype(np.float32)
    h0 = p["carry"][0]  # unbatched carry is broadcast
    f = lambda xp: sp.rnn(xp, h0, w)[0]  # noqa: E731
    nested = jax.vmap(jax.vmap(f))(xps)
    moved = jax.vmap(f, in_axes=2, out_axes=2)(np.moveaxis(xps[0], 0, 2))
    for i in range(2):
        for j in range(3):
            np.testing.assert_allclose(nested[i, j], f(xps[i, j]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.moveaxis(moved, 2, 0), nested[0], rtol=1e-6, atol=1e-6)


def test_per_example_weight_gradients():
    rng, p, w = _setup("lstm")
    xps = rng.standard_normal((3,) + p["xp"].shape).astype(np.float32)

    def loss(kernel, xp):
        w = sp.SparseWeights.from_dense(kernel, p["mask"])
        ys, _ = sp.lstm(xp, p["carry"], w)
        return jnp.sum(ys ** 2)

    per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0))(p["kernel"], xps)
    for i in range(3):
        np.testing.assert_allclose(per_example[i], jax.grad(loss)(p["kernel"], xps[i]),
                                   rtol=1e-5, atol=1e-6)
    summed = jax.grad(lambda k: jax.vmap(lambda x: loss(k, x))(xps).sum())(p["kernel"])
    np.testing.assert_allclose(summed, per_example.sum(0), rtol=1e-5, atol=1e-5)


def _stackable_problems(rng, cell, steps, batch, hidden, density, count=3):
    """`count` float32 problems whose weights stack into one pytree (stacking needs one nnz:
    each mask keeps its first `nnz` entries in flat order). Returns (problems, weights, the
    weights stacked)."""
    problems = [oracle.random_problem(rng, cell, steps, batch, hidden, density,
                                      jnp.dtype("float32")) for _ in range(count)]
    nnz = min(int(p["mask"].sum()) for p in problems)
    for p in problems:
        p["mask"].flat[np.flatnonzero(p["mask"])[nnz:]] = False
        p["kernel"] = np.where(p["mask"], p["kernel"], 0).astype(np.float32)
    ws = [sp.SparseWeights.from_dense(p["kernel"], p["mask"]) for p in problems]
    return problems, ws, jax.tree.map(lambda *a: jnp.stack(a), *ws)


@pytest.mark.parametrize("cell", ["rnn", "lstm", "gru"])
def test_vmap_over_weights_runs_each_instance(cell):
    """An ensemble: weights (values, pattern, b_hn) mapped too, checked against the oracle."""
    problems, ws, stacked = _stackable_problems(np.random.default_rng(7), cell, 5, 3, 9, 0.4)
    b_hn = np.stack([p["b_hn"] if cell == "gru" else np.zeros(9, np.float32) for p in problems])
    lengths = np.array([5, 0, 2], np.int32)

    def run(w, b, xp, carry):
        return oracle.run_api(cell, xp, carry, w, b if cell == "gru" else None, lengths)

    xp = problems[0]["xp"]
    ys, _ = jax.vmap(run, in_axes=(0, 0, None, None))(stacked, b_hn, xp, problems[0]["carry"])
    xps = np.stack([p["xp"] for p in problems])
    carries = tuple(np.stack(c) for c in zip(*(p["carry"] for p in problems)))
    ys_all, final_all = jax.jit(jax.vmap(run))(stacked, b_hn, xps, carries)
    for i, p in enumerate(problems):
        b = p["b_hn"] if cell == "gru" else None
        ref, _ = oracle.run(cell, xp, problems[0]["carry"], p["kernel"], lengths, b)
        assert oracle.rel_error(ys[i], ref) < 2e-5
        ref, ref_final = oracle.run(cell, p["xp"], p["carry"], p["kernel"], lengths, b)
        assert oracle.rel_error(ys_all[i], ref) < 2e-5
        assert oracle.rel_error(final_all[-1][i], ref_final[-1]) < 2e-5

    # Gradients of each member's values, as if each ran alone.
    def loss(values, w, xp, carry):
        member = sp.SparseWeights(values, w.col_idx, w.row_ptr, hidden_size=9, gates=w.gates)
        return jnp.sum(run(member, b_hn[0], xp, carry)[0] ** 2)

    grads = jax.vmap(jax.grad(loss))(stacked.values, stacked, xps, carries)
    for i, (p, w) in enumerate(zip(problems, ws)):
        np.testing.assert_allclose(grads[i], jax.grad(loss)(w.values, w, p["xp"], p["carry"]),
                                   rtol=1e-5, atol=1e-6)


def test_calls_inside_loops_and_cond():
    """What models do around a layer: a generation loop of one-step calls (fori_loop and a
    data-dependent while_loop), a stack of layers scanned over stacked weights, and a cond
    between directions, all under jit, against the float64 oracle. On a GPU XLA may place loop
    bodies in command buffers (CUDA graphs), the one-step calls' target included
    (test_gpu_command_buffers.py): every iteration must still compute its step."""
    rng, p, w = _setup("lstm", steps=7)
    xp, carry = p["xp"], p["carry"]
    ref_ys, ref_final = oracle.run("lstm", xp, carry, p["kernel"])

    def one_step(t, state):
        carry, ys = state
        y, carry = sp.lstm(jax.lax.dynamic_slice_in_dim(xp, t, 1), carry, w)
        return carry, ys.at[t].set(y[0])

    start = (carry, jnp.zeros(ref_ys.shape, jnp.float32))
    final, ys = jax.jit(lambda: jax.lax.fori_loop(0, 7, one_step, start))()
    assert oracle.rel_error(ys, ref_ys) < 2e-5
    assert oracle.rel_error(final[1], ref_final[1]) < 2e-5

    def until_done(state):  # stops on a value the loop computes (here: after step 4)
        t, _, ys = state
        return jnp.logical_and(t < 7, jnp.all(ys[3] == 0))

    t, _, ys = jax.jit(lambda: jax.lax.while_loop(
        until_done, lambda s: (s[0] + 1, *one_step(s[0], s[1:])), (0, *start)))()
    assert int(t) == 4 and not np.any(np.asarray(ys[4:]))
    assert oracle.rel_error(ys[:4], ref_ys[:4]) < 2e-5

    # Three ReLU layers of one nnz, scanned: each layer's outputs are the next one's xp.
    problems, _, stacked = _stackable_problems(rng, "rnn", 7, 3, 13, 0.3)
    h0 = problems[0]["carry"][0]
    top, finals = jax.jit(lambda: jax.lax.scan(
        lambda seq, w_layer: sp.rnn(seq, h0, w_layer, activation="relu"),
        problems[0]["xp"], stacked))()
    seq = problems[0]["xp"]
    for i, q in enumerate(problems):
        seq, ref_h = oracle.run("rnn", seq, (h0,), q["kernel"], activation="relu")
        assert oracle.rel_error(finals[i], ref_h[-1]) < 2e-5
    assert oracle.rel_error(top, seq) < 2e-5

    # A traced switch between the two directions.
    lengths = np.array([7, 2, 0], np.int32)
    pick = jax.jit(lambda backwards: jax.lax.cond(
        backwards, lambda: sp.lstm(xp, carry, w, lengths, reverse=True)[0],
        lambda: sp.lstm(xp, carry, w, lengths)[0]))
    for backwards in (False, True):
        ref, _ = oracle.run("lstm", xp, carry, p["kernel"], lengths, reverse=backwards)
        assert oracle.rel_error(pick(backwards), ref) < 2e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("cell", ["rnn", "lstm", "gru"])
def test_strict_dtype_promotion(cell, dtype):
    """README: the library casts explicitly, so it runs where users set
    jax_numpy_dtype_promotion="strict" (forward and grad, kernel and reference, the Flax
    layers with half-precision compute over float32 parameters), with the same results."""
    rng = np.random.default_rng(3)
    p = oracle.random_problem(rng, cell, 5, 3, 11, 0.4, jnp.dtype(dtype))
    w = sp.SparseWeights.from_dense(p["kernel"], p["mask"])
    lengths = np.array([5, 0, 2], np.int32)

    def loss(xp, carry, implementation):
        ys, final = oracle.run_api(cell, xp, carry, w, p["b_hn"], lengths, True,
                                   implementation=implementation)
        return jnp.sum(ys.astype(jnp.float32)) + sum(jnp.sum(f.astype(jnp.float32))
                                                     for f in final)

    linen_layer = {"rnn": SparseSimpleRNN, "lstm": SparseLSTM, "gru": SparseGRU}[cell](
        11, density=0.4, dtype=dtype)
    nnx_layer = {"rnn": sparse_nnx.SparseSimpleRNN, "lstm": sparse_nnx.SparseLSTM,
                 "gru": sparse_nnx.SparseGRU}[cell](4, 11, density=0.4, dtype=dtype,
                                                    rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((3, 5, 4)), jnp.float32)
    variables = linen_layer.init(jax.random.key(0), x)

    def everything():
        out = [jax.value_and_grad(loss, argnums=(0, 1))(p["xp"], p["carry"], impl)
               for impl in ("auto", "reference")]
        return out + [linen_layer.apply(variables, x, seq_lengths=lengths),
                      nnx_layer(x, seq_lengths=lengths)]

    standard = everything()
    with jax.numpy_dtype_promotion("strict"):
        strict = everything()
    for a, b in zip(jax.tree.leaves(strict), jax.tree.leaves(standard)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
