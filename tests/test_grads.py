"""Gradients w.r.t. xp, the carry, the kernel values (through from_dense) and b_hn."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_sprnn as sp
import oracle


def loss_fn(cell, mask, lengths, reverse, implementation="auto"):
    """A scalar loss of every output, as a function of all differentiable inputs."""

    def loss(xp, carry, kernel, b_hn):
        w = sp.SparseWeights.from_dense(kernel, mask)
        if cell == "rnn":
            ys, h = sp.rnn(xp, carry[0], w, "tanh", lengths, reverse,
                           implementation=implementation)
            final = (h,)
        elif cell == "lstm":
            ys, final = sp.lstm(xp, carry, w, lengths, reverse, implementation=implementation)
        else:
            ys, h = sp.gru(xp, carry[0], w, b_hn, lengths, reverse,
                           implementation=implementation)
            final = (h,)
        weights = jnp.cos(jnp.arange(ys.size, dtype=jnp.float32)).reshape(ys.shape)
        return jnp.sum(ys * weights) + sum(jnp.sum(jnp.sin(f)) for f in final)

    return loss


def _problem(cell, seed=0, steps=5, batch=3, hidden=11, density=0.4, dtype="float32"):
    rng = np.random.default_rng(seed)
    p = oracle.random_problem(rng, cell, steps, batch, hidden, density, jnp.dtype(dtype),
                              "empty_rows")
    b_hn = p["b_hn"] if cell == "gru" else np.zeros(hidden, dtype)
    return p, (p["xp"], p["carry"], p["kernel"], b_hn)


@pytest.mark.parametrize("cell", ["rnn", "lstm", "gru"])
@pytest.mark.parametrize("reverse", [False, True])
def test_check_grads(cell, reverse):
    """Reverse mode against finite differences (forward mode is not defined: custom VJP)."""
    p, args = _problem(cell)
    lengths = np.array([5, 0, 3], np.int32)
    args = jax.tree.map(lambda a: np.asarray(a, np.float32), args)
    check_grads(loss_fn(cell, p["mask"], lengths, reverse), args, order=1, modes=["rev"],
                atol=2e-2, rtol=2e-2, eps=1e-2)


@pytest.mark.parametrize("cell", ["rnn", "lstm", "gru"])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 5e-2), ("float16", 1e-2)])
def test_grads_match_reference(cell, dtype, tol):
    """The C++ backward agrees with autodiff of the pure-JAX reference."""
    p, args = _problem(cell, seed=1, steps=6, batch=4, hidden=19, dtype=dtype)
    lengths = np.array([6, 2, 0, 5], np.int32)
    for reverse in (False, True):
        got = jax.grad(loss_fn(cell, p["mask"], lengths, reverse), argnums=(0, 1, 2, 3))(*args)
        want = jax.grad(loss_fn(cell, p["mask"], lengths, reverse, "reference"),
                        argnums=(0, 1, 2, 3))(*args)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.dtype == r.dtype
            assert oracle.rel_error(g, r) < tol
        # Pruned entries get no gradient.
        assert np.all(np.asarray(got[2], np.float32)[~p["mask"]] == 0)
        if cell != "gru":
            assert np.all(np.asarray(got[3], np.float32) == 0)


def test_grad_under_jit_and_value_and_grad():
    p, args = _problem("lstm", seed=2)
    f = loss_fn("lstm", p["mask"], None, False)
    value, grads = jax.jit(jax.value_and_grad(f, argnums=2))(*args)
    ref_value = loss_fn("lstm", p["mask"], None, False, "reference")(*args)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    assert grads.shape == p["kernel"].shape


def test_second_order_is_a_clear_error():
    # Both used to end in JAX's "Differentiation rule for 'sprnn_...' not implemented".
    p, (xp, carry, kernel, b_hn) = _problem("rnn")

    def f(x):
        return loss_fn("rnn", p["mask"], None, False)(x, carry, kernel, b_hn)

    jax.grad(f)(xp)  # first order works
    with pytest.raises(NotImplementedError, match="differentiable once, in reverse mode"):
        jax.hessian(f)(xp)
    with pytest.raises(NotImplementedError, match="differentiable once, in reverse mode"):
        jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(xp)
