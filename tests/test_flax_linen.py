"""linen layers: native nn.RNN behaviour, masks, composition, jit and training."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_testing import LENGTHS, assert_close_valid, assert_tree_close, inputs, prune_recurrent
import jax_sprnn as sp
from jax_sprnn import packing
from jax_sprnn.flax import SparseGRU, SparseLSTM, SparseSimpleRNN, StaticMask, from_flax_rnn

H = 6
CELLS = {
    "lstm": (SparseLSTM, nn.LSTMCell, 4),
    "gru": (SparseGRU, nn.GRUCell, 3),
    "rnn": (SparseSimpleRNN, nn.SimpleCell, 1),
}


def flax_pair(kind, density=0.5, **rnn_kwargs):
    """A pruned Flax nn.RNN and the equivalent sparse layer with the same variables."""
    _, cell, _ = CELLS[kind]
    rnn = nn.RNN(cell(H), **rnn_kwargs)
    variables = rnn.init(jax.random.key(0), inputs())
    variables = {"params": prune_recurrent(variables["params"], density)}
    sparse, sparse_vars = from_flax_rnn(rnn, variables)
    return rnn, variables, sparse, sparse_vars


@pytest.mark.parametrize("kind", sorted(CELLS))
def test_same_init_and_tree_as_flax_rnn(kind):
    layer_cls, cell, _ = CELLS[kind]
    x = inputs()
    ours = layer_cls(H).init(jax.random.key(3), x)
    theirs = nn.RNN(cell(H)).init(jax.random.key(3), x)
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)
    assert_tree_close(ours, theirs, atol=0)
    # Dense pattern: same outputs as Flax.
    np.testing.assert_allclose(layer_cls(H).apply(ours, x), nn.RNN(cell(H)).apply(theirs, x),
                               atol=1e-5)


def layout_case(kind, time_major, steps=7):
    """flax_pair's layers, inputs in the layout, and call options with a nonzero initial carry."""
    rnn, variables, sparse, sparse_vars = flax_pair(kind)
    x = inputs(steps=steps)
    if time_major:
        x = jnp.swapaxes(x, 0, 1)
    carry0 = jax.tree_util.tree_map(lambda c: c + 0.3,
                                    rnn.cell.initialize_carry(jax.random.key(0), (4, 5)))
    kw = dict(time_major=time_major, return_carry=True, initial_carry=carry0)
    return (rnn, variables), (sparse, sparse_vars), x, kw


@pytest.mark.parametrize("kind", sorted(CELLS))
@pytest.mark.parametrize("time_major", [False, True])
def test_layouts_return_carry_initial_carry(kind, time_major):
    (rnn, variables), (sparse, sparse_vars), x, kw = layout_case(kind, time_major)
    c_ref, y_ref = rnn.apply(variables, x, **kw)
    c, y = sparse.apply(sparse_vars, x, **kw)
    assert y.shape == ((7, 4, H) if time_major else (4, 7, H))
    np.testing.assert_allclose(y, y_ref, atol=1e-5)
    assert_tree_close(c, c_ref)


def test_extra_batch_dims():
    rnn, variables, sparse, sparse_vars = flax_pair("lstm")
    x = inputs(batch=6).reshape(2, 3, 7, 5)
    np.testing.assert_allclose(sparse.apply(sparse_vars, x), rnn.apply(variables, x), atol=1e-5)
    lengths = np.array([[7, 2, 5], [1, 7, 3]])
    assert_close_valid(sparse.apply(sparse_vars, x, seq_lengths=lengths).reshape(6, 7, H),
                       rnn.apply(variables, x, seq_lengths=lengths).reshape(6, 7, H),
                       lengths.reshape(6))


def test_call_argument_errors():
    _, _, sparse, sparse_vars = flax_pair("lstm")
    x = inputs()
    with pytest.raises(ValueError, match=r"batch shape \(4,\), got \(3,\)"):
        sparse.apply(sparse_vars, x, seq_lengths=np.array([1, 2, 3]))
    with pytest.raises(TypeError, match=r"pair \(c, h\)"):
        sparse.apply(sparse_vars, x, initial_carry=jnp.zeros((4, H)))


@pytest.mark.parametrize("option", ["reverse", "keep_order", "time_major", "return_carry"])
def test_call_options_must_be_bools(option):
    # Truthiness used to run reverse="False" reversed (and time_major="False" time-major).
    _, _, sparse, sparse_vars = flax_pair("gru")
    x = inputs()
    with pytest.raises(TypeError, match=f"{option} must be a bool, got 'False'"):
        sparse.apply(sparse_vars, x, **{option: "False"})
    with pytest.raises(TypeError, match=f"{option} must be a bool, got 2"):
        sparse.clone(**{option: 2}).apply(sparse_vars, x)
    as_bool = sparse.clone(**{option: np.False_}).apply(sparse_vars, x, **{option: 0})
    np.testing.assert_array_equal(as_bool, sparse.apply(sparse_vars, x))


def test_residual_must_be_a_bool():
    _, _, sparse, sparse_vars = flax_pair("rnn")
    with pytest.raises(TypeError, match="residual must be a bool, got 'False'"):
        sparse.clone(residual="False").apply(sparse_vars, inputs())


@pytest.mark.parametrize("kind", sorted(CELLS))
@pytest.mark.parametrize("time_major", [False, True])
def test_zero_timesteps_like_flax_rnn(kind, time_major):
    # T = 0 gives empty outputs and the initial carry, as nn.RNN (the layout reshape once failed).
    (rnn, variables), (sparse, sparse_vars), x, kw = layout_case(kind, time_major, steps=0)
    c_ref, y_ref = rnn.apply(variables, x, **kw)
    for extra in ({}, dict(seq_lengths=np.zeros(4, np.int32), reverse=True)):
        c, y = sparse.apply(sparse_vars, x, **kw, **extra)
        assert y.shape == y_ref.shape == ((0, 4, H) if time_major else (4, 0, H))
        assert_tree_close(c, c_ref, atol=0)
        assert_tree_close(c, kw["initial_carry"], atol=0)


@pytest.mark.parametrize("kind", sorted(CELLS))
@pytest.mark.parametrize("reverse,keep_order", [(False, False), (True, False), (True, True)])
def test_seq_lengths_and_reverse(kind, reverse, keep_order):
    rnn, variables, sparse, sparse_vars = flax_pair(kind)
    x = inputs()
    kw = dict(seq_lengths=LENGTHS, reverse=reverse, keep_order=keep_order, return_carry=True)
    c_ref, y_ref = rnn.apply(variables, x, **kw)
    c, y = sparse.apply(sparse_vars, x, **kw)
    assert_close_valid(y, y_ref, LENGTHS)
    nonempty = LENGTHS > 0  # Flax's carry for a length-0 sequence is undefined; ours is h0
    assert_tree_close(jax.tree_util.tree_map(lambda a: a[nonempty], c),
                      jax.tree_util.tree_map(lambda a: a[nonempty], c_ref))
    for leaf in jax.tree_util.tree_leaves(c):
        np.testing.assert_array_equal(leaf[~nonempty], 0)


@pytest.mark.parametrize("kind", sorted(CELLS))
def test_bidirectional(kind):
    layer_cls, cell, _ = CELLS[kind]
    x = inputs()
    flax_bi = nn.Bidirectional(nn.RNN(cell(H)), nn.RNN(cell(H)))
    variables = flax_bi.init(jax.random.key(0), x)
    variables = {"params": prune_recurrent(variables["params"], 0.4)}
    sparse_bi, sparse_vars = from_flax_rnn(flax_bi, variables)
    assert isinstance(sparse_bi.forward_rnn, layer_cls)
    y_ref = flax_bi.apply(variables, x, seq_lengths=LENGTHS)
    y = sparse_bi.apply(sparse_vars, x, seq_lengths=LENGTHS)
    assert y.shape == (4, 7, 2 * H)
    assert_close_valid(y, y_ref, LENGTHS)
    # Our layers also compose with nn.Bidirectional directly.
    bi = nn.Bidirectional(layer_cls(H, density=0.3), layer_cls(H, density=0.3, mask_seed=1))
    out = bi.apply(bi.init(jax.random.key(1), x), x)
    assert out.shape == (4, 7, 2 * H) and np.all(np.isfinite(out))


class Stacked(nn.Module):
    layers: int = 2

    @nn.compact
    def __call__(self, x, seq_lengths=None):
        for i in range(self.layers):
            x = SparseLSTM(H, density=0.25, mask_seed=i, name=f"lstm_{i}")(
                x, seq_lengths=seq_lengths)
        return nn.Dense(1)(x)[..., 0]


def test_stack_jit_and_train_keeps_pattern():
    model = Stacked()
    x = inputs(batch=8)
    y_true = jnp.sin(jnp.cumsum(x[..., 0], axis=1))
    params = model.init(jax.random.key(0), x)["params"]
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((model.apply({"params": p}, x) - y_true) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    losses = []
    p = params
    for _ in range(30):
        p, opt_state, loss, grads = step(p, opt_state)
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0]
    # Pruned entries get exactly zero gradient and never move; kept ones train.
    layer_mask = SparseLSTM(H, density=0.25, mask_seed=0).static_mask.array
    kernel0 = np.concatenate([params["lstm_0"]["cell"][n]["kernel"]
                              for n in ("hi", "hf", "hg", "ho")], -1)
    kernel1 = np.concatenate([p["lstm_0"]["cell"][n]["kernel"]
                              for n in ("hi", "hf", "hg", "ho")], -1)
    grad = np.concatenate([grads["lstm_0"]["cell"][n]["kernel"]
                           for n in ("hi", "hf", "hg", "ho")], -1)
    assert np.all(grad[~layer_mask] == 0)
    np.testing.assert_array_equal(kernel1[~layer_mask], kernel0[~layer_mask])
    assert np.mean(kernel1[layer_mask] != kernel0[layer_mask]) > 0.9


def test_masks_static_and_validated():
    mask = np.zeros((H, 4 * H), bool)
    mask[:, ::3] = True
    a, b = SparseLSTM(H, mask=mask), SparseLSTM(H, mask=mask.copy())
    assert isinstance(a.mask, StaticMask) and hash(a) == hash(b) and a == b
    assert SparseLSTM(H, density=0.25).static_mask.nnz == round(0.25 * 4 * H * H)
    assert SparseLSTM(H).static_mask.density == 1.0
    x = inputs()
    with pytest.raises(ValueError, match="shape"):
        SparseLSTM(H, mask=np.ones((H, 3 * H), bool)).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="either mask or density"):
        SparseGRU(H, mask=np.ones((H, 3 * H), bool), density=0.5).init(jax.random.key(0), x)
    with pytest.raises(TypeError, match="boolean"):
        SparseLSTM(H, mask=np.ones((H, 4 * H)))
    for features in (0, -1, 4.0):  # 0 was a ZeroDivisionError, -1 a broadcasting TypeError
        with pytest.raises(ValueError, match="hidden size must be a positive integer"):
            SparseLSTM(features).init(jax.random.key(0), x)
    # Values outside the mask are ignored.
    layer = SparseLSTM(H, mask=mask)
    variables = layer.init(jax.random.key(0), x)
    noisy = jax.tree_util.tree_map_with_path(
        lambda p, v: v + 100.0 * ~mask[:, :H]
        if p[-2].key == "hi" and p[-1].key == "kernel" else v, variables)
    np.testing.assert_allclose(layer.apply(noisy, x), layer.apply(variables, x), atol=1e-6)


def test_a_fixed_mask_is_packed_once(monkeypatch):
    # Packing a mask takes seconds at H=4096: init, eager and jitted calls, and another layer
    # with the same StaticMask all reuse the first packing, with the same outputs.
    calls = []
    pack_mask = packing.pack_mask
    monkeypatch.setattr(packing, "pack_mask", lambda *a, **k: calls.append(a) or pack_mask(*a, **k))
    mask = np.random.default_rng(0).random((H, 4 * H)) < 0.3
    layer, x = SparseLSTM(H, mask=mask), inputs()
    variables = layer.init(jax.random.key(0), x)
    eager = layer.apply(variables, x)
    jitted = jax.jit(layer.apply)(variables, x)
    again = SparseLSTM(H, mask=layer.mask).apply(variables, x)
    assert len(calls) == 1
    np.testing.assert_array_equal(eager, again)
    np.testing.assert_allclose(eager, jitted, atol=1e-6)
    w = sp.SparseWeights.from_dense(np.ones(mask.shape, np.float32), mask)
    cols, _, row_ptr = layer.mask.packed()
    np.testing.assert_array_equal(cols, w.col_idx)
    np.testing.assert_array_equal(row_ptr, w.row_ptr)


@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_simple_rnn_activation_and_residual(activation):
    act = {"tanh": jnp.tanh, "relu": jax.nn.relu}[activation]
    rnn = nn.RNN(nn.SimpleCell(H, activation_fn=act, residual=True))
    x = inputs()
    variables = rnn.init(jax.random.key(0), x)
    variables = {"params": prune_recurrent(variables["params"], 0.3)}
    sparse, sparse_vars = from_flax_rnn(rnn, variables)
    assert sparse.activation == activation and sparse.residual
    np.testing.assert_allclose(sparse.apply(sparse_vars, x), rnn.apply(variables, x), atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision(dtype):
    rnn, variables, _, _ = flax_pair("lstm")
    layer = SparseLSTM(H, dtype=dtype, mask=np.asarray(
        np.concatenate([variables["params"]["cell"][n]["kernel"]
                        for n in ("hi", "hf", "hg", "ho")], -1) != 0))
    x = inputs()
    carry, y = layer.apply(variables, x, return_carry=True)
    # docs/FLAX.md: outputs in the compute dtype; the carry in the dtype it went in, here
    # initialize_carry's float32 (as Flax's LSTM), holding the half-precision state.
    assert y.dtype == dtype and all(c.dtype == jnp.float32 for c in carry)
    assert all(np.array_equal(c, c.astype(dtype).astype(jnp.float32)) for c in carry)
    np.testing.assert_allclose(np.asarray(y, np.float32), rnn.apply(variables, x), atol=3e-2)
    half_carry = jax.tree_util.tree_map(lambda c: c.astype(dtype), carry)
    carry2, _ = layer.apply(variables, x, initial_carry=half_carry, return_carry=True)
    assert all(c.dtype == dtype for c in carry2)


def test_half_precision_step_loop_with_its_own_carry():
    """A decoder's scan over one-step calls, the carry from the layer's initialize_carry: the
    carry keeps its type (it came back in the compute dtype, which lax.scan rejected)."""
    layer = SparseLSTM(H, density=0.5, dtype=jnp.bfloat16)
    x = inputs()
    variables = layer.init(jax.random.key(0), x)
    carry0 = layer.initialize_carry(jax.random.key(0), x[:, 0].shape)

    def step(carry, xt):
        carry, y = layer.apply(variables, xt[:, None], initial_carry=carry, return_carry=True)
        return carry, y[:, 0]

    carry, ys = jax.lax.scan(step, carry0, jnp.swapaxes(x, 0, 1))
    assert jax.tree_util.tree_map(lambda c: c.dtype, carry) == (jnp.float32, jnp.float32)
    # One call keeps c in float32 between steps; one-step calls round it to bfloat16 each step.
    whole_carry, whole = layer.apply(variables, x, initial_carry=carry0, return_carry=True)
    np.testing.assert_allclose(np.asarray(jnp.swapaxes(ys, 0, 1), np.float32),
                               np.asarray(whole, np.float32), atol=2e-2)
    assert_tree_close(carry, whole_carry, atol=2e-2)


@pytest.mark.parametrize("layer", [SparseLSTM(H), SparseSimpleRNN(H, density=0.3, residual=True)],
                         ids=["dense_default", "residual"])
def test_layer_packs_its_mask_once(layer, monkeypatch):
    """Masks a layer derives per call (dense default, residual diagonal) keep one packing: a
    new one per eager call re-packed the pattern every time (seconds at H=4096)."""
    x = inputs()
    variables = layer.init(jax.random.key(0), x)
    calls = []
    original = packing.pack_mask
    monkeypatch.setattr(packing, "pack_mask", lambda *a, **k: calls.append(1) or original(*a, **k))
    first = layer.apply(variables, x)
    np.testing.assert_array_equal(layer.apply(variables, x), first)
    assert calls == []


def test_mask_tree_given_as_layer_mask_says_what_to_pass():
    from jax_sprnn import pruning
    x = inputs()
    masks = pruning.magnitude_masks(SparseLSTM(H).init(jax.random.key(0), x)["params"], 0.5)
    with pytest.raises(TypeError, match="one boolean array .* got a mapping"):
        SparseLSTM(H, mask=masks["cell"])


@pytest.mark.parametrize("kind", sorted(CELLS))
def test_density_zero_is_flax_without_recurrent_weights(kind):
    layer_cls, cell, _ = CELLS[kind]
    x = inputs()
    layer = layer_cls(H, density=0.0)  # used to be rejected; the kernel runs density 0
    assert layer.static_mask.nnz == 0
    variables = layer.init(jax.random.key(1), x)
    zeroed = {"params": prune_recurrent(variables["params"], 0.0)}
    np.testing.assert_allclose(layer.apply(variables, x), nn.RNN(cell(H)).apply(zeroed, x),
                               atol=1e-5)


def test_ensemble_under_nn_vmap():
    """nn.vmap over the parameters (an ensemble): each member computes what it computes alone."""
    x = inputs()
    ensemble = nn.vmap(SparseGRU, variable_axes={"params": 0}, split_rngs={"params": True},
                       in_axes=None, axis_size=3)(H, density=0.4)
    variables = ensemble.init(jax.random.key(0), x)
    ys = ensemble.apply(variables, x)
    single = SparseGRU(H, density=0.4, implementation="reference")
    for i in range(3):
        member = jax.tree.map(lambda a: a[i], variables)
        np.testing.assert_allclose(ys[i], single.apply(member, x), atol=1e-5)


def test_public_mask_and_flip_helpers():
    from flax.linen.recurrent import flip_sequences as flax_flip

    from jax_sprnn.flax import flip_sequences, random_mask

    mask = random_mask(5, 4, 0.3, seed=2)
    assert mask.array.shape == (5, 20) and mask.nnz == 30
    assert random_mask(5, 4, 0.3, seed=2) == mask and random_mask(5, 4, 1e-9).nnz == 1
    assert random_mask(5, 4, 0.3, seed=2) is mask  # cached: a re-trace draws no new permutation
    for bad in [(0, 4, 0.3), (2.5, 4, 0.3), (5, 5, 0.3), (5, 4, 1.5), (5, 4, float("nan")),
                (5, 4, 0.3, -1)]:
        with pytest.raises(ValueError):
            random_mask(*bad)
    # NumPy and JAX scalars are taken as the numbers they hold (a JAX one was "unhashable");
    # text, bools and fractional seeds are refused, not compared or drawn from.
    assert random_mask(np.int64(5), 4, np.float64(0.3), seed=jnp.int32(2)) is mask
    assert random_mask(5, 4, jnp.float32(0.3), seed=2) == mask
    for bad in [(5, 4, "0.3"), (5, 4, True), (5, 4, 0.3, 1.5), (5, 4, 0.3, True)]:
        with pytest.raises(TypeError, match="density must be a number|mask_seed must be"):
            random_mask(*bad)
    layer = SparseLSTM(5, density=jnp.float32(0.3), mask_seed=np.int32(2))
    assert layer.static_mask == mask
    x = jnp.arange(2 * 5 * 3, dtype=jnp.float32).reshape(2, 5, 3)
    lengths = jnp.array([5, 2])
    np.testing.assert_array_equal(flip_sequences(x, lengths, time_axis=1),
                                  flax_flip(x, lengths, num_batch_dims=1, time_major=False))
    x_tm = jnp.swapaxes(x, 0, 1)
    np.testing.assert_array_equal(flip_sequences(x_tm, lengths, time_axis=0),
                                  flax_flip(x_tm, lengths, num_batch_dims=1, time_major=True))
    with pytest.raises(ValueError, match="time_axis"):
        flip_sequences(x, lengths, time_axis=2)
    with pytest.raises(ValueError, match=r"seq_lengths must have shape \(2,\)"):
        flip_sequences(x, jnp.array([5, 2, 1]), time_axis=1)
