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


@pytest.fixture
def explicit_mesh():
    from jax.sharding import AxisType
    return Mesh(np.array(jax.devices("cpu")[:4]), ("data",), axis_types=(AxisType.Explicit,))


@pytest.mark.parametrize("cell", ["rnn", "lstm", "gru"])
def test_explicit_mesh_types_results_by_the_batch(explicit_mesh, cell):
    """Under a mesh in explicit sharding mode the results were typed replicated (so later ops
    took them for whole arrays) and a vmap over a batch-sharded call could not fold its axis
    (a reshape JAX cannot type). Results now carry xp's batch sharding, each device still runs
    its shard, and vmap and grad give the reference's values with the operands' types."""
    rng = np.random.default_rng(4)
    steps, batch, hidden = 5, 8, 12
    p = oracle.random_problem(rng, cell, steps, batch, hidden, 0.4, jnp.dtype("float32"))
    lengths = np.array([5, 0, 3, 5, 1, 2, 4, 5], np.int32)
    b_hn = p["b_hn"] if p["b_hn"] is not None else np.zeros(hidden, np.float32)
    seen = {}

    def loss(xp, carry, kernel, b_hn, implementation="auto"):
        w = sp.SparseWeights.from_dense(kernel, p["mask"])
        ys, final = oracle.run_api(cell, xp, carry, w, b_hn if cell == "gru" else None,
                                   lengths, implementation=implementation)
        seen.setdefault("types", (jax.typeof(ys).sharding.spec,  # the first trace's, unmapped
                                  jax.typeof(final[-1]).sharding.spec))
        return jnp.sum(ys ** 2) + sum(jnp.sum(jnp.sin(c)) for c in final)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    with jax.set_mesh(explicit_mesh):
        xp = jax.device_put(p["xp"], P(None, "data"))
        carry = tuple(jax.device_put(c, P("data")) for c in p["carry"])
        got = jax.jit(grad)(xp, carry, p["kernel"], b_hn)
        hlo = jax.jit(loss).lower(xp, carry, p["kernel"], b_hn).compile().as_text()
        # vmap over 4 instances: sharded by the batch (the instances fold in after it), then by
        # the instances; per-instance gradients (the backward replicates the batch first).
        x4 = np.stack([p["xp"] * (1 + i / 4) for i in range(4)])
        c4 = tuple(np.stack([c] * 4) for c in p["carry"])
        by_batch = (jax.device_put(x4, P(None, None, "data")),
                    tuple(jax.device_put(c, P(None, "data")) for c in c4))
        by_instance = (jax.device_put(x4, P("data")),
                       tuple(jax.device_put(c, P("data")) for c in c4))
        per_instance = jax.jit(jax.vmap(grad, in_axes=(0, 0, None, None)))
        vmapped = [per_instance(*a, p["kernel"], b_hn) for a in (by_batch, by_instance)]
    assert seen["types"] == (P(None, "data", None), P("data", None))
    want = grad(p["xp"], p["carry"], p["kernel"], b_hn, "reference")
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert oracle.rel_error(g, r) < 1e-5
    assert jax.typeof(got[0]).sharding.spec == P(None, "data", None)
    assert not re.search(COLLECTIVES, hlo)
    calls = re.findall(
        rf"f32\[{steps},(\d+),{hidden}\][^\n]*custom_call_target=\"sprnn_{cell}_fwd\"", hlo)
    assert calls and all(int(b) == batch // 4 for b in calls)  # each device its 2 sequences
    want4 = jax.vmap(lambda x, c: grad(x, c, p["kernel"], b_hn, "reference"))(x4, c4)
    for got4, spec in zip(vmapped, (P(None, None, "data", None), P("data", None, None, None))):
        for g, r in zip(jax.tree.leaves(got4), jax.tree.leaves(want4)):
            assert oracle.rel_error(g, r) < 1e-5
        assert jax.typeof(got4[0]).sharding.spec == spec


def test_explicit_mesh_flax_layers(explicit_mesh):
    """The Flax layers on a batch sharded under an explicit mesh: the linen layer's gradient
    failed (its zero initial carry is replicated while the carry's gradient came out sharded,
    and a custom VJP must type each gradient as its primal). Values and gradients as without a
    mesh, outputs sharded by the batch."""
    from flax import nnx

    from jax_sprnn.flax import linen as sparse_linen
    from jax_sprnn.flax import nnx as sparse_nnx
    x = np.random.default_rng(5).standard_normal((8, 6, 5)).astype(np.float32)
    lengths = np.array([6, 0, 3, 6, 1, 2, 4, 6], np.int32)
    linen_layer = sparse_linen.SparseLSTM(features=16, density=0.3)
    params = linen_layer.init(jax.random.key(0), x)
    nnx_layer = sparse_nnx.SparseGRU(5, 16, density=0.3, rngs=nnx.Rngs(0))

    def linen_loss(params, x, lengths):
        return jnp.sum(jnp.tanh(linen_layer.apply(params, x, seq_lengths=lengths)))

    def nnx_loss(layer, x, lengths):
        return jnp.sum(jnp.tanh(layer(x, seq_lengths=lengths)))

    want = (linen_layer.apply(params, x, seq_lengths=lengths),
            jax.grad(linen_loss)(params, x, lengths),
            nnx_layer(x, seq_lengths=lengths), nnx.grad(nnx_loss)(nnx_layer, x, lengths))
    with jax.set_mesh(explicit_mesh):
        xs, ls = jax.device_put(x, P("data")), jax.device_put(lengths, P("data"))
        got = (jax.jit(lambda p, x, l: linen_layer.apply(p, x, seq_lengths=l))(params, xs, ls),
               jax.jit(jax.grad(linen_loss))(params, xs, ls),
               nnx.jit(lambda m, x, l: m(x, seq_lengths=l))(nnx_layer, xs, ls),
               nnx.jit(nnx.grad(nnx_loss))(nnx_layer, xs, ls))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    for out in (got[0], got[2]):
        assert jax.typeof(out).sharding.spec == P("data", None, None)


def test_explicit_mesh_mixed_and_two_axis_shardings():
    """Under an explicit mesh: a replicated xp with a batch-sharded carry types the results by
    the carry's sharding, as JAX's own ops (the reference's scan) do; an xp sharded on its
    hidden axis over the batch's mesh axis works; and vmap over a 2-D mesh with the instances
    on one axis and the batch on the other (the batch-major operands broadcast with sharded
    instances), with per-instance gradients."""
    from jax.sharding import AxisType
    rng = np.random.default_rng(6)
    steps, batch, hidden = 5, 8, 12
    p = oracle.random_problem(rng, "lstm", steps, batch, hidden, 0.4, jnp.dtype("float32"))
    lengths = np.array([5, 0, 3, 5, 1, 2, 4, 5], np.int32)
    w = sp.SparseWeights.from_dense(p["kernel"], p["mask"])
    ref_ys, ref_final = oracle.run("lstm", p["xp"], p["carry"], p["kernel"], lengths)
    types = {}

    def f(xp, carry, implementation="auto"):
        ys, final = sp.lstm(xp, carry, w, lengths, implementation=implementation)
        types[implementation] = jax.typeof(ys).sharding.spec
        return ys, final

    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        carry = tuple(jax.device_put(c, P("data")) for c in p["carry"])
        hidden_sharded = jax.device_put(p["xp"], P(None, None, "data"))
        # (The reference refuses the second: its add of the two shardings is ill-typed.)
        for xp, implementation in ((p["xp"], "reference"), (p["xp"], "auto"),
                                   (hidden_sharded, "auto")):
            ys, final = jax.jit(f, static_argnums=2)(xp, carry, implementation)
            assert oracle.rel_error(ys, ref_ys) < 1e-5
            assert oracle.rel_error(final[1], ref_final[1]) < 1e-5
            assert types[implementation] == P(None, "data", None)

    def loss(xp, carry, kernel, implementation="auto"):
        ys, final = sp.lstm(xp, carry, sp.SparseWeights.from_dense(kernel, p["mask"]), lengths,
                            implementation=implementation)
        return jnp.sum(ys ** 2) + jnp.sum(jnp.sin(final[0]))

    grad = jax.grad(loss, argnums=(0, 2))
    x4 = np.stack([p["xp"] * (1 + i / 4) for i in range(4)])
    c4 = tuple(np.stack([c] * 4) for c in p["carry"])
    want = jax.vmap(lambda x, c: grad(x, c, p["kernel"], "reference"))(x4, c4)
    grid = Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("model", "data"),
                axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(grid):
        for inst, b in (("model", "data"), ("data", "model")):
            xs = jax.device_put(x4, P(inst, None, b))
            cs = tuple(jax.device_put(c, P(inst, b)) for c in c4)
            got = jax.jit(jax.vmap(grad, in_axes=(0, 0, None)))(xs, cs, p["kernel"])
            for g, r in zip(got, want):
                assert oracle.rel_error(g, r) < 1e-5
            assert jax.typeof(got[0]).sharding.spec == P(inst, None, b, None)
