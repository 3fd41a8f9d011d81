"""Magnitude pruning of Flax parameter trees: one-shot, gradual schedule, fixed masks."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from flax_testing import inputs
from jax_sprnn import pruning
from jax_sprnn.flax import from_flax_rnn

H = 16


def lstm_params():
    return nn.RNN(nn.LSTMCell(H)).init(jax.random.key(0), inputs())["params"]


def test_default_selects_recurrent_kernels_only():
    params = lstm_params()
    assert sorted(pruning.selected_paths(params)) == [f"cell/h{g}/kernel" for g in "fgio"]
    gru = nn.RNN(nn.GRUCell(H)).init(jax.random.key(0), inputs())["params"]
    assert sorted(pruning.selected_paths(gru)) == [f"cell/h{g}/kernel" for g in "nrz"]
    model = nnx.RNN(nnx.OptimizedLSTMCell(5, H, rngs=nnx.Rngs(0)))
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert pruning.selected_paths(state) == ["cell/dense_h/kernel"]


@pytest.mark.parametrize("density", [0.5, 0.1, 0.03])
def test_one_shot_keeps_largest_exact_count(density):
    params = lstm_params()
    pruned, masks = pruning.prune(params, density)
    for gate in "ifgo":
        kernel = np.asarray(params["cell"][f"h{gate}"]["kernel"])
        mask = masks["cell"][f"h{gate}"]["kernel"]
        assert mask.sum() == round(density * kernel.size)
        # Every kept weight is at least as large as every pruned one.
        assert np.abs(kernel[mask]).min() >= np.abs(kernel[~mask]).max()
        np.testing.assert_array_equal(pruned["cell"][f"h{gate}"]["kernel"],
                                      np.where(mask, kernel, 0))
    # Input kernels and biases untouched.
    np.testing.assert_array_equal(pruned["cell"]["ii"]["kernel"], params["cell"]["ii"]["kernel"])
    assert masks["cell"]["hi"]["bias"].all()
    report = pruning.density_report(pruned)
    assert all(abs(v - density) < 1.0 / H for v in report.values())


@pytest.mark.parametrize("size", [1, 7, 1000])
def test_keep_top_matches_a_stable_sort(size):
    # The kept set is the first `keep` of a stable descending sort: ties by lower flat index,
    # NaN last, -inf (entries pruned before) just before NaN; every keep from 0 to all.
    rng = np.random.default_rng(size)
    for trial in range(20):
        scores = rng.integers(0, 4, size).astype(np.float32)  # many ties
        if trial % 2:
            scores[rng.random(size) < 0.2] = np.nan
        if trial % 3:
            scores[rng.random(size) < 0.2] = -np.inf
        for keep in sorted({0, 1, size // 3, size // 2, size - 1, size}):
            want = np.zeros(size, bool)
            want[np.argsort(-scores, kind="stable")[:keep]] = True
            np.testing.assert_array_equal(pruning._keep_top(scores, keep), want)


def test_global_scope_and_custom_select():
    params = lstm_params()
    params["cell"]["hi"]["kernel"] = params["cell"]["hi"]["kernel"] * 10  # one big gate
    masks = pruning.magnitude_masks(params, 0.25, scope="global")
    dens = pruning.density_report(masks)
    assert dens["cell/hi/kernel"] > 0.7 and dens["cell/hf/kernel"] < 0.15
    total = sum(masks["cell"][f"h{g}"]["kernel"].sum() for g in "ifgo")
    assert total == round(0.25 * 4 * H * H)
    everything = pruning.magnitude_masks(params, 0.5, select=lambda p, x: np.ndim(x) == 2)
    assert not everything["cell"]["ii"]["kernel"].all()
    with pytest.raises(ValueError, match="no parameter"):
        pruning.magnitude_masks(params, 0.5, select=lambda p, x: False)
    with pytest.raises(ValueError, match="density"):
        pruning.magnitude_masks(params, 1.5)


def test_cubic_schedule():
    sched = pruning.PolynomialSchedule(final_sparsity=0.9, begin_step=100, end_step=1100,
                                       frequency=100)
    assert sched(0) == 0.0 and sched(100) == 0.0
    assert sched(1100) == pytest.approx(0.9) and sched(5000) == pytest.approx(0.9)
    # Zhu & Gupta: s_t = s_f + (s_i - s_f)(1 - (t - t0)/(n dt))^3
    assert sched(600) == pytest.approx(0.9 - 0.9 * 0.5 ** 3)
    values = [sched(t) for t in range(0, 1201, 50)]
    assert all(b >= a for a, b in zip(values, values[1:]))  # monotone
    assert [t for t in range(0, 1300) if sched.should_update(t)] == list(range(100, 1101, 100))
    assert float(pruning.polynomial_sparsity(jnp.asarray(600), final_sparsity=0.9,
                                             begin_step=100, end_step=1100)) == \
        pytest.approx(sched(600))
    with pytest.raises(ValueError, match="must exceed begin_step"):
        pruning.PolynomialSchedule(final_sparsity=0.5, begin_step=10, end_step=10)
    # Power 0 used to keep the initial sparsity for ever, -1 divided by zero at end_step, a
    # frequency of 1.5 updated at steps 0, 3, 6, 9; the function took a sparsity of 1.5.
    for bad, match in [(dict(power=0), "power must be a positive"),
                       (dict(power=-1), "power must be a positive"),
                       (dict(frequency=1.5), "frequency must be an integer"),
                       (dict(final_sparsity="0.9"), "final_sparsity must be a number"),
                       (dict(end_step=10.5), "end_step must be an integer")]:
        args = {**dict(final_sparsity=0.9, begin_step=0, end_step=10), **bad}
        with pytest.raises((ValueError, TypeError), match=match):
            pruning.PolynomialSchedule(**args)
    with pytest.raises(ValueError, match="final_sparsity must be a number in"):
        pruning.polynomial_sparsity(5, final_sparsity=1.5, begin_step=0, end_step=10)


def test_gradual_pruning_never_regrows_and_masks_stay_fixed_in_training():
    model = nn.RNN(nn.OptimizedLSTMCell(H))
    x = inputs(batch=8)
    y = jnp.tanh(jnp.cumsum(x, axis=1)).sum(-1, keepdims=True)
    params = model.init(jax.random.key(0), x)["params"]
    opt = optax.chain(optax.adamw(1e-2, weight_decay=1e-2))
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, masks):
        def loss_fn(p):
            out = model.apply({"params": pruning.apply_masks(p, masks)}, x)
            return jnp.mean((out.sum(-1, keepdims=True) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, pruning.masked_updates(updates, masks)), opt_state

    sched = pruning.PolynomialSchedule(final_sparsity=0.8, begin_step=0, end_step=40,
                                       frequency=10)
    masks = pruning.ones_like_masks(params)
    history = []
    for t in range(60):
        if sched.should_update(t):
            new = pruning.magnitude_masks(params, sched.density(t), previous=masks)
            for old_m, new_m in zip(jax.tree_util.tree_leaves(masks),
                                    jax.tree_util.tree_leaves(new)):
                assert not np.any(new_m & ~old_m), "a pruned weight regrew"
            masks = new
            params = pruning.apply_masks(params, masks)
            history.append(np.mean(list(pruning.density_report(masks).values())))
        params, opt_state = step(params, opt_state, masks)
    assert history[0] == 1.0 and history[-1] == pytest.approx(0.2, abs=0.01)
    assert all(b <= a for a, b in zip(history, history[1:]))
    # After the schedule ends, adamw's weight decay and momentum did not revive pruned entries.
    assert pruning.density_report(params) == pytest.approx(pruning.density_report(masks))
    # And the pruned dense model converts to the sparse layer with the same outputs.
    sparse, sv = from_flax_rnn(model, {"params": params})
    assert sparse.mask.density == pytest.approx(0.2, abs=0.01)
    np.testing.assert_allclose(sparse.apply(sv, x), model.apply({"params": params}, x),
                               atol=1e-5)


def test_keep_pattern_transformation_and_masks_from_zeros():
    params = lstm_params()
    pruned, masks = pruning.prune(params, 0.3)
    for a, b in zip(jax.tree_util.tree_leaves(pruning.masks_from_zeros(pruned)),
                    jax.tree_util.tree_leaves(masks)):
        np.testing.assert_array_equal(a, b)
    opt = optax.chain(optax.sgd(0.1, momentum=0.9), pruning.keep_pattern(masks))
    state = opt.init(pruned)
    grads = jax.tree_util.tree_map(jnp.ones_like, pruned)
    p = pruned
    for _ in range(3):
        updates, state = opt.update(grads, state, p)
        p = optax.apply_updates(p, updates)
    kernel = np.asarray(p["cell"]["hf"]["kernel"])
    mask = masks["cell"]["hf"]["kernel"]
    assert np.all(kernel[~mask] == 0)
    assert np.all(kernel[mask] != np.asarray(pruned["cell"]["hf"]["kernel"])[mask])


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_previous_masks_forbid_regrowth(scope):
    params = lstm_params()
    masks = pruning.magnitude_masks(params, 0.25, scope=scope)
    assert pruning.magnitude_masks(params, 0.25, previous=masks, scope=scope) is not None
    with pytest.raises(ValueError, match="never regrows"):  # used to revive pruned entries
        pruning.magnitude_masks(params, 0.5, previous=masks, scope=scope)
    with pytest.raises(ValueError, match="must not exceed final_sparsity"):
        pruning.PolynomialSchedule(final_sparsity=0.5, initial_sparsity=0.8, begin_step=0,
                                   end_step=10)


def test_previous_masks_must_match_the_tree():
    params = lstm_params()
    masks = pruning.ones_like_masks(params)
    masks["cell"]["hf"]["kernel"] = np.ones((1, 4 * H), np.bool_)  # used to broadcast silently
    with pytest.raises(ValueError, match=r"cell/hf/kernel \(1, 64\) against cell/hf/kernel"):
        pruning.magnitude_masks(params, 0.5, previous=masks)
    renamed = {"cell": {("x" + k): v for k, v in pruning.ones_like_masks(params)["cell"].items()}}
    with pytest.raises(ValueError, match="do not match the parameter tree"):
        pruning.magnitude_masks(params, 0.5, previous=renamed)
    with pytest.raises(ValueError, match="leaves"):
        pruning.magnitude_masks(params, 0.5, previous={"cell": masks["cell"]["hi"]})
    floats = jax.tree.map(lambda m: np.where(m, 1.0, 0.3), pruning.ones_like_masks(params))
    with pytest.raises(TypeError, match="previous masks must be boolean, got dtype float64"):
        pruning.magnitude_masks(params, 0.5, previous=floats)  # 0.3 used to count as kept
    for density in ("0.5", True, float("nan")):
        with pytest.raises(ValueError, match="density must be a number in"):
            pruning.magnitude_masks(params, density)
    # An nnx State and its pure dict name the same paths: either may be the previous masks.
    model = nnx.RNN(nnx.OptimizedLSTMCell(5, H, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    first = pruning.magnitude_masks(nnx.to_pure_dict(state), 0.5)
    second = pruning.magnitude_masks(state, 0.25, previous=first)
    first, second = (np.asarray(m["cell"]["dense_h"]["kernel"]) for m in (first, second))
    assert second.sum() == round(0.25 * H * 4 * H)
    assert not np.any(second & ~first)


def test_apply_masks_matches_leaves_by_path_and_checks_shapes():
    params = lstm_params()
    pruned, masks = pruning.prune(params, 0.3)
    reordered = {"cell": dict(reversed(list(masks["cell"].items())))}  # same paths, other order
    for got, want in zip(jax.tree_util.tree_leaves(pruning.apply_masks(params, reordered)),
                         jax.tree_util.tree_leaves(pruned)):
        np.testing.assert_array_equal(got, want)
    bad = jax.tree_util.tree_map(lambda m: m[:1], masks)  # would broadcast in jnp.where
    with pytest.raises(ValueError, match=r"the mask of cell/\w+/\w+ has shape \(1,\)"):
        pruning.apply_masks(params, bad)
    with pytest.raises(ValueError, match="no mask for the parameter cell/hf/bias"):
        pruning.apply_masks(params, {"cell": {"hi": masks["cell"]["hi"]}})
