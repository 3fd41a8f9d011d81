"""Helpers shared by the Flax tests (layers, conversion, pruning, examples)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

LENGTHS = np.array([7, 3, 0, 5], np.int32)  # a full, a short, an empty and a middle sequence


def inputs(batch=4, steps=7, features=5, seed=1, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), (batch, steps, features)).astype(dtype)


def valid(lengths, steps):
    """(B, T, 1) bool: positions Flax computes from real data (batch-major)."""
    t = np.arange(steps)[None, :]
    return (t < np.asarray(lengths)[:, None])[..., None]


def assert_close_valid(actual, expected, lengths, atol=1e-5):
    """Equal on valid positions; ours is zero on padding."""
    m = valid(lengths, actual.shape[1])
    np.testing.assert_allclose(np.where(m, actual, 0), np.where(m, expected, 0), atol=atol,
                               rtol=1e-5)
    assert np.all(np.where(m, 0, np.asarray(actual)) == 0), "padding outputs must be zero"


def assert_tree_close(a, b, atol=1e-5):
    jax.tree_util.tree_map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x, np.float32),
                                                np.asarray(y, np.float32), atol=atol, rtol=1e-5),
        a, b)


def prune_kernel(kernel, density, seed=0):
    """Zero all but a random fraction of a kernel (NumPy)."""
    kernel = np.array(kernel)
    keep = np.random.default_rng(seed).random(kernel.shape) < density
    return np.where(keep, kernel, 0).astype(kernel.dtype)


def prune_recurrent(params, density, seed=0):
    """Randomly prune every recurrent kernel (names h*, dense_h) of a param dict."""
    from jax_sprnn import pruning

    return jax.tree_util.tree_map_with_path(
        lambda p, x: prune_kernel(x, density, seed) if pruning.is_recurrent_kernel(p, x) else x,
        params)
