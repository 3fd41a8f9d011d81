"""from_flax_rnn / from_nnx_rnn: same outputs as the pruned Flax model, for every cell."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_testing import (LENGTHS, assert_close_valid, assert_tree_close, inputs, prune_kernel,
                          prune_recurrent)
from jax_sprnn import pruning
from jax_sprnn.flax import from_flax_rnn, from_nnx_rnn
from jax_sprnn.flax import linen as sp_linen
from jax_sprnn.flax import nnx as sp_nnx

H, I = 8, 5
LINEN = [nn.LSTMCell, nn.OptimizedLSTMCell, nn.GRUCell, nn.SimpleCell]
NNX = [nnx.LSTMCell, nnx.OptimizedLSTMCell, nnx.GRUCell, nnx.SimpleCell]
CALLS = {
    "plain": {},
    "seq_lengths": {"seq_lengths": LENGTHS},
    "reverse": {"reverse": True},
    "reverse_lengths": {"reverse": True, "seq_lengths": LENGTHS},
    "reverse_keep_order": {"reverse": True, "keep_order": True, "seq_lengths": LENGTHS},
}


def _compare(y, y_ref, c, c_ref, call, atol=1e-5):
    lengths = call.get("seq_lengths", np.full(y.shape[0], y.shape[1]))
    assert_close_valid(y, y_ref, lengths, atol=atol)
    keep = np.asarray(lengths) > 0
    assert_tree_close(jax.tree_util.tree_map(lambda a: a[keep], c),
                      jax.tree_util.tree_map(lambda a: a[keep], c_ref), atol=atol)


# -- linen ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cell", LINEN, ids=lambda c: c.__name__)
@pytest.mark.parametrize("call", sorted(CALLS))
def test_linen_cells(cell, call):
    rnn = nn.RNN(cell(H), return_carry=True)
    x = inputs()
    variables = {"params": prune_recurrent(rnn.init(jax.random.key(0), x)["params"], 0.3)}
    sparse, sparse_vars = from_flax_rnn(rnn, variables)
    assert type(sparse) is sp_linen.LAYERS[
        {"GRUCell": "gru", "SimpleCell": "rnn"}.get(cell.__name__, "lstm")]
    assert 0.2 < sparse.mask.density < 0.4
    assert jax.tree_util.tree_structure(sparse_vars) == jax.tree_util.tree_structure(variables)
    c_ref, y_ref = rnn.apply(variables, x, **CALLS[call])
    c, y = jax.jit(lambda v, x: sparse.apply(v, x, **CALLS[call]))(sparse_vars, x)
    _compare(y, y_ref, c, c_ref, CALLS[call])


@pytest.mark.parametrize("cell", [nn.OptimizedLSTMCell, nn.GRUCell], ids=lambda c: c.__name__)
def test_linen_bidirectional(cell):
    bi = nn.Bidirectional(nn.RNN(cell(H)), nn.RNN(cell(H)), return_carry=True)
    x = inputs()
    variables = {"params": prune_recurrent(bi.init(jax.random.key(0), x)["params"], 0.2)}
    sparse, sparse_vars = from_flax_rnn(bi, variables)
    assert isinstance(sparse, nn.Bidirectional)
    (cf_ref, cb_ref), y_ref = bi.apply(variables, x, seq_lengths=LENGTHS)
    (cf, cb), y = sparse.apply(sparse_vars, x, seq_lengths=LENGTHS)
    _compare(y, y_ref, (cf, cb), (cf_ref, cb_ref), {"seq_lengths": LENGTHS})


def test_linen_explicit_masks_array_and_tree():
    rnn = nn.RNN(nn.LSTMCell(H))
    x = inputs()
    variables = rnn.init(jax.random.key(0), x)  # dense values
    pruned, masks = pruning.prune(variables["params"], 0.25)
    # A mask tree (from pruning) on unpruned values: the values outside are zeroed.
    sparse, sparse_vars = from_flax_rnn(rnn, variables, mask=masks)
    assert sparse.mask.nnz == round(0.25 * H * H) * 4
    assert_tree_close(sparse_vars["params"], pruned, atol=0)
    np.testing.assert_allclose(sparse.apply(sparse_vars, x), rnn.apply({"params": pruned}, x),
                               atol=1e-5)
    # The same pattern as one (H, 4H) array.
    array = np.concatenate([masks["cell"][n]["kernel"] for n in ("hi", "hf", "hg", "ho")], -1)
    sparse2, sparse_vars2 = from_flax_rnn(rnn, variables, mask=array)
    assert sparse2.mask == sparse.mask
    assert_tree_close(sparse_vars2, sparse_vars, atol=0)
    with pytest.raises(ValueError, match="shape"):
        from_flax_rnn(rnn, variables, mask=np.ones((H, 3 * H), bool))


def test_linen_bfloat16_model():
    rnn = nn.RNN(nn.OptimizedLSTMCell(H, dtype=jnp.bfloat16))
    x = inputs()
    variables = {"params": prune_recurrent(rnn.init(jax.random.key(0), x)["params"], 0.3)}
    sparse, sparse_vars = from_flax_rnn(rnn, variables)
    y, y_ref = sparse.apply(sparse_vars, x), rnn.apply(variables, x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32),
                               atol=5e-2)


def test_linen_unsupported():
    x = inputs()
    for module in (nn.RNN(nn.MGUCell(H)), nn.Dense(3)):
        with pytest.raises(TypeError, match="convert|expects"):
            from_flax_rnn(module, module.init(jax.random.key(0), x))
    rnn = nn.RNN(nn.LSTMCell(H, gate_fn=jax.nn.hard_sigmoid))
    with pytest.raises(ValueError, match="sigmoid"):
        from_flax_rnn(rnn, rnn.init(jax.random.key(0), x))


@pytest.mark.parametrize("bidirectional", [False, True])
def test_linen_variables_without_params(bidirectional):
    # A common slip: passing variables["params"]; it names the mistake instead of a KeyError.
    rnn = nn.RNN(nn.LSTMCell(H))
    module = nn.Bidirectional(rnn, nn.RNN(nn.LSTMCell(H))) if bidirectional else rnn
    variables = module.init(jax.random.key(0), inputs())
    with pytest.raises(ValueError, match=r"not variables\['params'\]"):
        from_flax_rnn(module, variables["params"])


def test_linen_variables_of_another_size():
    rnn = nn.RNN(nn.LSTMCell(H))
    other = nn.RNN(nn.LSTMCell(H - 2)).init(jax.random.key(0), inputs())
    with pytest.raises(ValueError, match=r"do not match the module.*\(6, 6\)"):
        from_flax_rnn(rnn, other)


def _bad_masks(tree):
    """Masks the converters refuse: float leaves (0.3 would keep everything) and 1 or 3 masks
    for a Bidirectional."""
    floats = jax.tree_util.tree_map(lambda a: np.full(np.shape(a), 0.3), tree)
    return [(floats, TypeError, "boolean"), ((None,), ValueError, "pair of masks.*got 1"),
            ((None,) * 3, ValueError, "pair of masks.*got 3")]


def test_linen_bad_masks():
    rnn = nn.RNN(nn.LSTMCell(H))
    bi = nn.Bidirectional(rnn, nn.RNN(nn.LSTMCell(H)))
    x = inputs()
    variables, bi_variables = rnn.init(jax.random.key(0), x), bi.init(jax.random.key(0), x)
    (floats, error, match), *pairs = _bad_masks(variables)
    with pytest.raises(error, match=match):
        from_flax_rnn(rnn, variables, mask=floats)
    for mask, error, match in pairs:
        with pytest.raises(error, match=match):
            from_flax_rnn(bi, bi_variables, mask=mask)


# -- nnx --------------------------------------------------------------------------------------
def _pruned_nnx(cell, density=0.3, seed=0, **rnn_kwargs):
    rnn = nnx.RNN(cell(I, H, rngs=nnx.Rngs(seed)), return_carry=True, **rnn_kwargs)
    state = nnx.state(rnn, nnx.Param)
    for path, var in jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]:
        if pruning.is_recurrent_kernel(path, var[...]):
            var[...] = prune_kernel(var[...], density, seed)
    nnx.update(rnn, state)
    return rnn


@pytest.mark.parametrize("cell", NNX, ids=lambda c: c.__name__)
@pytest.mark.parametrize("call", sorted(CALLS))
def test_nnx_cells(cell, call):
    rnn = _pruned_nnx(cell)
    sparse = from_nnx_rnn(rnn)
    assert 0.2 < sparse.mask.density < 0.4
    x = inputs()
    c_ref, y_ref = rnn(x, **CALLS[call])
    c, y = nnx.jit(lambda m, x: m(x, **CALLS[call]))(sparse, x)
    _compare(y, y_ref, c, c_ref, CALLS[call])


@pytest.mark.parametrize("cell", [nnx.LSTMCell, nnx.GRUCell], ids=lambda c: c.__name__)
def test_nnx_bidirectional(cell):
    bi = nnx.Bidirectional(_pruned_nnx(cell, seed=0), _pruned_nnx(cell, seed=1),
                           return_carry=True)
    sparse = from_nnx_rnn(bi)
    assert isinstance(sparse.forward_rnn, sp_nnx.LAYERS["gru" if cell is nnx.GRUCell
                                                       else "lstm"])
    x = inputs()
    c_ref, y_ref = bi(x, seq_lengths=LENGTHS)
    c, y = sparse(x, seq_lengths=LENGTHS)
    _compare(y, y_ref, c, c_ref, {"seq_lengths": LENGTHS})


def test_nnx_explicit_mask_and_residual_simple_cell():
    rnn = nnx.RNN(nnx.SimpleCell(I, H, residual=True, rngs=nnx.Rngs(0)))
    mask = np.random.default_rng(0).random((H, H)) < 0.3
    sparse = from_nnx_rnn(rnn, mask=mask)
    np.testing.assert_array_equal(sparse.mask.array, mask)
    kernel = np.asarray(sparse.dense_h.kernel[...])
    assert np.all(kernel[~mask] == 0)
    rnn.cell.dense_h.kernel[...] = kernel  # the Flax model with the same pruning
    x = inputs()
    np.testing.assert_allclose(sparse(x), rnn(x), atol=1e-5)
    # A mask tree shaped like the nnx state works too.
    tree = {"cell": {"dense_h": {"kernel": mask}}}
    assert from_nnx_rnn(rnn, mask=tree).mask == sparse.mask


def test_nnx_unsupported():
    with pytest.raises(TypeError, match="convert"):
        from_nnx_rnn(nnx.RNN(_Other()))


class _Other(nnx.Module):
    num_feature_axes = 1


def test_nnx_bad_masks():
    rnn = nnx.RNN(nnx.LSTMCell(I, H, rngs=nnx.Rngs(0)))
    bi = nnx.Bidirectional(rnn, nnx.RNN(nnx.LSTMCell(I, H, rngs=nnx.Rngs(1))), rngs=nnx.Rngs(2))
    (floats, error, match), *pairs = _bad_masks(nnx.to_pure_dict(nnx.state(rnn, nnx.Param)))
    with pytest.raises(error, match=match):
        from_nnx_rnn(rnn, mask=floats)
    for mask, error, match in pairs:
        with pytest.raises(error, match=match):
            from_nnx_rnn(bi, mask=mask)
