"""nnx layers: native nnx.RNN behaviour, masks, composition, nnx.jit and training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from flax_testing import LENGTHS, assert_close_valid, assert_tree_close, inputs
from jax_sprnn.flax import StaticMask, from_nnx_rnn
from jax_sprnn.flax.nnx import SparseGRU, SparseLSTM, SparseSimpleRNN

H, I = 6, 5
LAYERS = {"lstm": SparseLSTM, "gru": SparseGRU, "rnn": SparseSimpleRNN}
CELLS = {"lstm": nnx.OptimizedLSTMCell, "gru": nnx.GRUCell, "rnn": nnx.SimpleCell}


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_params_are_plain_and_mask_is_static(kind):
    layer = LAYERS[kind](I, H, density=0.3, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    gates = {"lstm": 4, "gru": 3, "rnn": 1}[kind]
    assert params["dense_h"]["kernel"].shape == (H, gates * H)
    assert params["dense_i"]["kernel"].shape == (I, gates * H)
    assert isinstance(layer.mask, StaticMask)
    # The mask is not state: everything in the state is a trainable Param.
    assert len(jax.tree_util.tree_leaves(nnx.state(layer))) == len(
        jax.tree_util.tree_leaves(nnx.state(layer, nnx.Param)))
    assert layer.mask.nnz == round(0.3 * gates * H * H)


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("time_major", [False, True])
def test_matches_nnx_rnn_on_dense_pattern(kind, time_major):
    rnn = nnx.RNN(CELLS[kind](I, H, rngs=nnx.Rngs(0)), time_major=time_major,
                  return_carry=True)
    sparse = from_nnx_rnn(rnn)  # the dense pattern: every recurrent entry is nonzero
    assert sparse.mask.density == 1.0
    x = inputs()
    if time_major:
        x = jnp.swapaxes(x, 0, 1)
    c_ref, y_ref = rnn(x)
    c, y = sparse(x)
    np.testing.assert_allclose(y, y_ref, atol=1e-5)
    assert_tree_close(c, c_ref)


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_same_rngs_draw_the_nnx_cells_parameters(kind, x64):
    """SparseSimpleRNN drew other parameters than nnx.SimpleCell (another recurrent init, the
    Linear layers made in the other order), and with x64 on SparseLSTM and SparseGRU drew
    their recurrent kernels in float64 (nnx.LSTMCell's init, not their cells'); every layer
    now draws its cell's."""
    with jax.enable_x64(x64):
        ours = nnx.to_pure_dict(nnx.state(LAYERS[kind](I, H, rngs=nnx.Rngs(7)), nnx.Param))
        theirs = nnx.to_pure_dict(nnx.state(CELLS[kind](I, H, rngs=nnx.Rngs(7)), nnx.Param))
    assert_tree_close(ours, theirs, atol=0)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_zero_timesteps_like_nnx_rnn(kind):
    rnn = nnx.RNN(CELLS[kind](I, H, rngs=nnx.Rngs(0)), return_carry=True)
    sparse = from_nnx_rnn(rnn)
    x = inputs(steps=0)
    c_ref, y_ref = rnn(x)
    c, y = sparse(x)
    assert y.shape == y_ref.shape == (4, 0, H)
    assert_tree_close(c, c_ref, atol=0)


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("reverse,keep_order", [(False, False), (True, False), (True, True)])
def test_seq_lengths_reverse_initial_carry(kind, reverse, keep_order):
    layer = LAYERS[kind](I, H, density=0.4, rngs=nnx.Rngs(1))
    x = inputs()
    carry0 = jax.tree_util.tree_map(lambda c: c + 0.2, layer.initialize_carry((4, I)))
    c, y = layer(x, initial_carry=carry0, seq_lengths=LENGTHS, reverse=reverse,
                 keep_order=keep_order, return_carry=True)
    # Oracle: the equivalent nnx cell with the masked kernel, run by nnx.RNN.
    cell = CELLS[kind](I, H, rngs=nnx.Rngs(0))
    cell.dense_i.kernel[...] = layer.dense_i.kernel[...]
    if kind == "lstm":
        cell.dense_h.bias[...] = layer.dense_h.bias[...]
    else:
        cell.dense_i.bias[...] = layer.dense_i.bias[...]
    cell.dense_h.kernel[...] = jnp.where(layer.mask.array, layer.dense_h.kernel[...], 0)
    c_ref, y_ref = nnx.RNN(cell)(x, initial_carry=carry0, seq_lengths=LENGTHS, reverse=reverse,
                                 keep_order=keep_order, return_carry=True)
    assert_close_valid(y, y_ref, LENGTHS)
    keep = LENGTHS > 0
    assert_tree_close(jax.tree_util.tree_map(lambda a: a[keep], c),
                      jax.tree_util.tree_map(lambda a: a[keep], c_ref))


def test_bidirectional_and_stack_under_nnx_jit():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.bi = nnx.Bidirectional(SparseLSTM(I, H, density=0.3, rngs=rngs),
                                        SparseGRU(I, H, density=0.3, mask_seed=1, rngs=rngs),
                                        rngs=rngs)
            self.top = SparseSimpleRNN(2 * H, H, density=0.5, rngs=rngs)
            self.out = nnx.Linear(H, 1, rngs=rngs)

        def __call__(self, x, seq_lengths=None):
            return self.out(self.top(self.bi(x, seq_lengths=seq_lengths),
                                     seq_lengths=seq_lengths))[..., 0]

    model = Model(nnx.Rngs(0))
    x = inputs(batch=8)
    y_true = jnp.tanh(jnp.cumsum(x[..., 1], axis=1))
    eager = model(x)
    assert eager.shape == (8, 7)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(model, x), eager, atol=1e-5)

    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    kernel0 = np.asarray(model.bi.forward_rnn.dense_h.kernel[...])
    mask = model.bi.forward_rnn.mask.array

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            return jnp.mean((model(x) - y_true) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss, grads

    losses = []
    for _ in range(30):
        loss, grads = step(model, optimizer)
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0]
    grad_h = np.asarray(grads["bi"]["forward_rnn"]["dense_h"]["kernel"][...])
    assert np.all(grad_h[~mask] == 0)
    kernel1 = np.asarray(model.bi.forward_rnn.dense_h.kernel[...])
    np.testing.assert_array_equal(kernel1[~mask], kernel0[~mask])
    assert np.mean(kernel1[mask] != kernel0[mask]) > 0.9


def test_gru_recurrent_bias_matches_linen_gru():
    import flax.linen as nn

    from jax_sprnn.flax import from_flax_rnn

    rnn = nn.RNN(nn.GRUCell(H))
    x = inputs()
    v = rnn.init(jax.random.key(0), x)
    p = v["params"]["cell"]
    p["hr"]["kernel"] = p["hr"]["kernel"].at[0].set(0.0)
    layer = SparseGRU(I, H, recurrent_bias=True, rngs=nnx.Rngs(0))
    cat = lambda names, key: jnp.concatenate([p[n][key] for n in names], -1)  # noqa: E731
    layer.dense_i.kernel[...] = cat(("ir", "iz", "in"), "kernel")
    layer.dense_i.bias[...] = cat(("ir", "iz", "in"), "bias")
    layer.dense_h.kernel[...] = cat(("hr", "hz", "hn"), "kernel")
    layer.dense_h.bias[...] = jnp.concatenate([jnp.zeros(2 * H), p["hn"]["bias"]])
    np.testing.assert_allclose(layer(x), rnn.apply(v, x), atol=1e-5)
    sparse, sv = from_flax_rnn(rnn, v)
    np.testing.assert_allclose(sparse.apply(sv, x), layer(x), atol=1e-5)


@pytest.mark.parametrize("option", ["reverse", "keep_order", "time_major", "return_carry"])
def test_call_options_must_be_bools(option):
    x = inputs()
    with pytest.raises(TypeError, match=f"{option} must be a bool, got 'no'"):
        SparseLSTM(I, H, density=0.5, rngs=nnx.Rngs(0), **{option: "no"})(x)
    layer = SparseLSTM(I, H, density=0.5, rngs=nnx.Rngs(0))
    setattr(layer, option, None)
    with pytest.raises(TypeError, match=f"{option} must be a bool, got None"):
        layer(x)


def test_constructor_switches_must_be_bools():
    # "False" used to be truthy: a residual identity or a recurrent bias added silently.
    with pytest.raises(TypeError, match="residual must be a bool, got 'False'"):
        SparseSimpleRNN(I, H, residual="False", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="recurrent_bias must be a bool, got 'False'"):
        SparseGRU(I, H, recurrent_bias="False", rngs=nnx.Rngs(0))


def test_residual_layer_follows_a_new_mask():
    """Re-pruning sets layer.mask; the residual layer built its pattern (mask + diagonal) once
    and kept running the old one."""
    layer = SparseSimpleRNN(I, H, residual=True, density=0.3, rngs=nnx.Rngs(0))
    new = ~layer.mask.array  # every entry outside the old pattern
    layer.mask = StaticMask(new)
    fresh = SparseSimpleRNN(I, H, residual=True, mask=new, rngs=nnx.Rngs(0))
    nnx.update(fresh, nnx.state(layer, nnx.Param))
    x = inputs(features=I)
    np.testing.assert_array_equal(layer(x), fresh(x))
    reference = SparseSimpleRNN(I, H, residual=True, mask=new, rngs=nnx.Rngs(0),
                                implementation="reference")
    nnx.update(reference, nnx.state(layer, nnx.Param))
    np.testing.assert_allclose(layer(x), reference(x), atol=1e-5)


def test_half_precision_carry_keeps_its_dtype():
    layer = SparseGRU(I, H, density=0.5, dtype=jnp.bfloat16, return_carry=True,
                      rngs=nnx.Rngs(0))
    x = inputs(features=I)
    carry, y = layer(x)  # default carry: initialize_carry's, in param_dtype (as nnx.RNN)
    assert y.dtype == jnp.bfloat16 and carry.dtype == jnp.float32
    carry2, _ = layer(x, initial_carry=carry.astype(jnp.bfloat16))
    assert carry2.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(carry2, np.float32), np.asarray(
        layer(x, initial_carry=carry)[0]))


def test_pure_dict_masks_in_an_nnx_optimizer():
    """docs/FLAX.md's route: masks from nnx.to_pure_dict, keep_pattern in an nnx.Optimizer (whose
    updates are an nnx.State): it raised a pytree structure error."""
    from jax_sprnn import pruning
    layer = SparseLSTM(I, H, rngs=nnx.Rngs(0))
    pruned, masks = pruning.prune(nnx.to_pure_dict(nnx.state(layer, nnx.Param)), 0.3)
    state = nnx.state(layer, nnx.Param)
    nnx.replace_by_pure_dict(state, pruned)
    nnx.update(layer, state)
    optimizer = nnx.Optimizer(layer, optax.chain(optax.adamw(1e-2, weight_decay=0.5),
                                                 pruning.keep_pattern(masks)), wrt=nnx.Param)
    x = inputs(features=I)

    @nnx.jit
    def step(model, optimizer):
        optimizer.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))

    before = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    for _ in range(3):
        step(layer, optimizer)
    after = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    kernel, mask = np.asarray(after["dense_h"]["kernel"]), masks["dense_h"]["kernel"]
    assert np.all(kernel[~mask] == 0)
    assert not np.allclose(kernel[mask], np.asarray(before["dense_h"]["kernel"])[mask])


def test_nnx_mask_errors():
    with pytest.raises(ValueError, match="shape"):
        SparseLSTM(I, H, mask=np.ones((H, H), bool), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="density"):
        SparseGRU(I, H, density=1.5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="hidden size must be a positive integer"):
        SparseGRU(I, 0, rngs=nnx.Rngs(0))  # was a ZeroDivisionError at the first call
    assert SparseGRU(I, H, density=0.0, rngs=nnx.Rngs(0)).mask.nnz == 0
    with pytest.raises(ValueError, match="activation"):
        SparseSimpleRNN(I, H, activation="gelu", rngs=nnx.Rngs(0))
