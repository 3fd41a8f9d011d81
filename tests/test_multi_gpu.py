"""More than one GPU in a process: each runs the persistent kernel (not the per-step fallback)
and a batch sharded over all of them matches the float64 oracle, forward and gradients.

The kernel's shared-memory limit is an attribute of the kernel as loaded on one device, so a
limit raised on the first GPU does not hold on the second. Skips without two GPUs.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_sprnn as sp  # noqa: E402
import oracle  # noqa: E402
from jax_sprnn import _ffi  # noqa: E402


def _gpus():
    try:
        return jax.devices("gpu") if _ffi.cuda_module is not None else []
    except RuntimeError:
        return []


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(len(_gpus()) < 2, reason="needs two CUDA GPUs and _sprnn_cuda")]

# (cell, dtype, H, density, activation): each plan needs more than the 48 KB of shared memory a
# kernel gets without raising its limit, checked below.
LAYERS = [("rnn", "float16", 1152, 0.1, "relu"), ("lstm", "bfloat16", 1024, 0.1, "tanh"),
          ("gru", "float32", 700, 0.2, "tanh")]
GATES = {"rnn": 1, "lstm": 4, "gru": 3}
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}


def _problem(cell, dtype, hidden, density, seed, steps=9, batch=4):
    rng = np.random.default_rng(seed)
    p = oracle.random_problem(rng, cell, steps, batch, hidden, density, jnp.dtype(dtype))
    p["lengths"] = oracle.make_lengths(rng, "ragged", steps, batch)
    return p


def _check(cell, dtype, activation, p, ys, final, reverse=False):
    want_ys, want_final = oracle.run(cell, p["xp"], p["carry"], p["kernel"], p["lengths"],
                                     p["b_hn"], reverse, activation)
    tol = oracle.RTOL[dtype]
    assert oracle.rel_error(ys, want_ys) < tol
    for got, want in zip(jax.tree.leaves(final), want_final):
        assert oracle.rel_error(got, want) < tol


@pytest.mark.parametrize("cell,dtype,hidden,density,activation", LAYERS)
def test_every_gpu_runs_the_persistent_kernel(cell, dtype, hidden, density, activation):
    p = _problem(cell, dtype, hidden, density, seed=hidden)
    w = sp.SparseWeights.from_dense(p["kernel"], p["mask"])
    plan = _ffi.cuda_module.plan(GATES[cell], DTYPE_CODES[dtype], hidden, 4, w.nnz,
                                 relu=activation == "relu")
    assert plan["persistent"] and plan["smem_bytes"] > 48 * 1024, plan
    fallbacks = _ffi.cuda_module.step_fallbacks()
    # Device 0 first, so that every later device finds the kernel already used elsewhere.
    for n, device in enumerate(_gpus() + _gpus()[:1]):
        reverse = bool(n % 2)
        args = jax.device_put((p["xp"], p["carry"], w, p["b_hn"], p["lengths"]), device)
        ys, final = jax.jit(oracle.run_api, static_argnums=(0, 6, 7))(
            cell, args[0], args[1], args[2], args[3], args[4], reverse, activation)
        assert ys.devices() == {device}
        _check(cell, dtype, activation, p, ys, final, reverse)
        assert _ffi.cuda_module.step_fallbacks() == fallbacks, f"per-step fallback on {device}"


def test_batch_sharded_over_every_gpu():
    gpus = _gpus()
    mesh = Mesh(np.array(gpus), ("data",))
    cell, dtype, hidden = "lstm", "float32", 768
    p = _problem(cell, dtype, hidden, 0.1, seed=7, batch=4 * len(gpus))
    mask = p["mask"]
    time_major = NamedSharding(mesh, P(None, "data", None))
    batch_major = NamedSharding(mesh, P("data"))
    xp = jax.device_put(p["xp"], time_major)
    carry = tuple(jax.device_put(c, batch_major) for c in p["carry"])
    lengths = jax.device_put(p["lengths"], batch_major)
    fallbacks = _ffi.cuda_module.step_fallbacks()

    def forward(xp, carry, kernel, lengths, implementation="auto"):
        w = sp.SparseWeights.from_dense(kernel, mask)
        return sp.lstm(xp, carry, w, lengths, implementation=implementation)

    ys, final = jax.jit(forward)(xp, carry, p["kernel"], lengths)
    assert ys.sharding.is_equivalent_to(time_major, ys.ndim)  # never gathered
    _check(cell, dtype, "tanh", p, ys, final)
    assert _ffi.cuda_module.step_fallbacks() == fallbacks

    def loss(xp, carry, kernel, implementation="auto"):
        ys, _ = forward(xp, carry, kernel, lengths, implementation)
        return jnp.sum(jnp.sin(ys))

    got = jax.jit(jax.grad(loss, argnums=(0, 2)))(xp, carry, p["kernel"])
    want = jax.jit(jax.grad(loss, argnums=(0, 2)), static_argnums=3)(
        xp, carry, p["kernel"], "reference")
    for g, r in zip(got, want):
        assert oracle.rel_error(g, r) < 1e-4
