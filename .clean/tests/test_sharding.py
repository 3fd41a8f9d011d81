"""Batch sharding over a 4-device CPU mesh: each device runs its shard, xp is never gathered."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_sprnn as sp
import oracle

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 4,
                                reason="needs 4 host devices (XLA_FLAGS set in conftest.py)")
COLLECTIVES = r"(all-gather|all-to-all|collective-permute)"


@pytest.fixture
def mesh():
    return Mesh(np.array(jax.devices("cpu")[:4]), ("data",))


@pytest.mark.parametrize("cell", ["rnn", "lstm", "gru"])
def test_forward_runs_per_shard(mesh, cell):
    rng = np.random.default_rng(0)
    steps, batch, hidden = 5, 8, 24
    p = oracle.random_problem(rng, cell, steps, batch, hidden, 0.3, jnp.dtype("float32"))
    w = sp.SparseWeights.from_dense(p["kernel"], p["mask"])
    lengths = rng.integers(0, steps + 1, batch).astype(np.int32)
    time_major = NamedSharding(mesh, P(None, "data", None))
    batch_major = NamedSharding(mesh, P("data"))
    xp = jax.device_put(p["xp"], time_major)
    carry = tuple(jax.device_put(c, batch_major) for c in p["carry"])
    lens = jax.device_put(lengths, batch_major)

    def f(xp, carry, lengths):
        return oracle.run_api(cell, xp, carry, w, p["b_hn"], lengths)

    fn = jax.jit(f)
    ys, _ = fn(xp, carry, lens)
    ref, _ = oracle.run(cell, p["xp"], p["carry"], p["kernel"], lengths, p["b_hn"])
    assert oracle.rel_error(ys, ref) < 2e-5
    assert ys.sharding.spec[1] == "data"
    hlo = fn.lower(xp, carry, lens).compile().as_text()
    assert not re.search(COLLECTIVES, hlo)
    # The custom call sees the local batch (8 / 4 = 2 sequences per device).
    calls = re.findall(rf"f32\[{steps},(\d+),{hidden}\][^\n]*custom_call_target=\"sprnn_{cell}_fwd\"",
                       hlo)
    assert calls and all(int(b) == batch // 4 for b in calls)


def test_gradients_sharded(mesh):
    rng = np.random.default_rng(1)
    p = oracle.random_problem(rng, "lstm", 4, 8, 16, 0.4, jnp.dtype("float32"))
    xp = jax.device_put(p["xp"], NamedSharding(mesh, P(None, "data", None)))
    carry = tuple(jax.device_put(c, NamedSharding(mesh, P("data"))) for c in p["carry"])

    def loss(xp, carry, kernel, implementation="auto"):
        w = sp.SparseWeights.from_dense(kernel, p["mask"])
        return jnp.sum(sp.lstm(xp, carry, w, implementation=implementation)[0] ** 2)

    fn = jax.jit(jax.grad(loss, argnums=(0, 2)))
    got = fn(xp, carry, p["kernel"])
    want = jax.grad(loss, argnums=(0, 2))(p["xp"], p["carry"], p["kernel"], "reference")
    for g, r in zip(got, want):
        assert oracle.rel_error(g, r) < 1e-5
    hlo = fn.lower(xp, carry, p["kernel"]).compile().as_text()
    assert not re.search(COLLECTIVES, hlo)  # only the weight-gradient all-reduce
