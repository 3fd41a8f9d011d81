"""jit and vmap: traced lengths, folded batch axes, per-instance weight gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sprnn as sp
import oracle


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


def test_vmap_over_weights_is_an_error():
    rng, p, w = _setup("rnn")
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), w)
    with pytest.raises(ValueError, match="vmap|batch"):
        jax.vmap(lambda w: sp.rnn(p["xp"], p["carry"][0], w)[0])(stacked)
