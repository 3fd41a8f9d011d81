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


@pytest.mark.parametrize("cell", ["rnn", "lstm", "gru"])
def test_shard_map_types_results_and_sums_weight_gradients(mesh, cell):
    """Inside shard_map (check_vma on): results vary over the batch axis like their inputs, a
    data-parallel step's gradient of the replicated kernel and b_hn comes back summed over the
    shards, and an output left un-summed is rejected. The results were typed as replicated:
    grad failed on a type mismatch and a missing psum went through with one shard's sum."""
    from jax import shard_map
    rng = np.random.default_rng(2)
    p = oracle.random_problem(rng, cell, 4, 8, 12, 0.4, jnp.dtype("float32"))
    lengths = np.array([4, 0, 3, 4, 1, 2, 4, 4], np.int32)
    b_hn = p["b_hn"] if p["b_hn"] is not None else np.zeros(12, np.float32)

    def loss(xp, carry, kernel, b_hn, lengths, implementation="auto"):
        w = sp.SparseWeights.from_dense(kernel, p["mask"])
        ys, final = oracle.run_api(cell, xp, carry, w, b_hn if cell == "gru" else None,
                                   lengths, implementation=implementation)
        return jnp.sum(ys ** 2) + sum(jnp.sum(jnp.sin(c)) for c in final)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    specs = (P(None, "data"), P("data"), P(), P(), P("data"))
    per_shard = shard_map(lambda *a: grad(*a), mesh=mesh, in_specs=specs, out_specs=specs[:4])
    got = jax.jit(per_shard)(p["xp"], p["carry"], p["kernel"], b_hn, lengths)
    want = grad(p["xp"], p["carry"], p["kernel"], b_hn, lengths, "reference")
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert oracle.rel_error(g, r) < 1e-5

    def local_sum(xp, carry, lengths):
        return loss(xp, carry, p["kernel"], b_hn, lengths)

    with pytest.raises(ValueError, match="out_specs"):
        jax.jit(shard_map(local_sum, mesh=mesh, in_specs=(specs[0], specs[1], specs[4]),
                          out_specs=P()))(p["xp"], p["carry"], lengths)


def test_partially_manual_shard_map():
    """Manual over one mesh axis, automatic over the other: the partitioner got a sharding
    without a spec and failed (AttributeError); it now keeps that call's batch whole."""
    from jax import shard_map
    rng = np.random.default_rng(3)
    p = oracle.random_problem(rng, "rnn", 4, 8, 8, 0.4, jnp.dtype("float32"))
    grid = Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("a", "b"))
    xp = jax.device_put(p["xp"], NamedSharding(grid, P(None, ("a", "b"))))
    h0 = jax.device_put(p["carry"][0], NamedSharding(grid, P(("a", "b"))))

    def loss(xp, h0, kernel, implementation="auto"):
        w = sp.SparseWeights.from_dense(kernel, p["mask"])
        ys, h = sp.rnn(xp, h0, w, implementation=implementation)
        return jnp.sum(ys ** 2) + jnp.sum(h)

    def per_shard(xp, h0, kernel):
        return jax.grad(loss, argnums=(0, 1, 2))(xp, h0, kernel)

    got = jax.jit(shard_map(per_shard, mesh=grid, in_specs=(P(None, "a"), P("a"), P()),
                            out_specs=(P(None, "a"), P("a"), P()), axis_names={"a"}))(
        xp, h0, p["kernel"])
    want = jax.grad(loss, argnums=(0, 1, 2))(p["xp"], p["carry"][0], p["kernel"], "reference")
    for g, r in zip(got, want):
        assert oracle.rel_error(g, r) < 1e-5
