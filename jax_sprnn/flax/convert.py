"""Conversion of trained (pruned) Flax RNNs into the sparse layers.

``from_flax_rnn`` takes a linen ``nn.RNN`` (or ``nn.Bidirectional`` of two) over ``LSTMCell``,
``OptimizedLSTMCell``, ``GRUCell`` or ``SimpleCell``; ``from_nnx_rnn`` does the same for
``nnx.RNN`` / ``nnx.Bidirectional``. The pattern is the nonzeros of the recurrent kernels, or
an explicit mask. The converted layer computes what the Flax model computes, except that
outputs at padding positions (``t >= seq_lengths``) are zeros where Flax leaves the values of
steps it ran past the end.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx
from flax.core import unfreeze

from jax_sprnn.flax import common
from jax_sprnn.flax import linen as sp_linen
from jax_sprnn.flax import nnx as sp_nnx
from jax_sprnn.flax.common import StaticMask

_LINEN_CELLS = {nn.LSTMCell: "lstm", nn.OptimizedLSTMCell: "lstm", nn.GRUCell: "gru",
                nn.SimpleCell: "rnn"}
_NNX_CELLS = {nnx.LSTMCell: "lstm", nnx.OptimizedLSTMCell: "lstm", nnx.GRUCell: "gru",
              nnx.SimpleCell: "rnn"}
_RECURRENT = {"lstm": ("hi", "hf", "hg", "ho"), "gru": ("hr", "hz", "hn"), "rnn": ("h",)}
_NNX_LSTM_INPUT = ("ii", "if_", "ig", "io")


def _same_fn(fn, *candidates) -> bool:
    return any(fn is c for c in candidates)


def _check_activations(cell, kind: str) -> str:
    """The cell's activation name; raises for gate/activation functions the kernel lacks."""
    name = type(cell).__name__
    if kind in ("lstm", "gru"):
        if not _same_fn(cell.gate_fn, jax.nn.sigmoid, nn.sigmoid):
            raise ValueError(f"{name}.gate_fn must be sigmoid to convert, got {cell.gate_fn}")
        if not _same_fn(cell.activation_fn, jnp.tanh, nn.tanh):
            raise ValueError(f"{name}.activation_fn must be tanh to convert, "
                             f"got {cell.activation_fn}")
        return "tanh"
    if _same_fn(cell.activation_fn, jnp.tanh, nn.tanh):
        return "tanh"
    if _same_fn(cell.activation_fn, jax.nn.relu, nn.relu):
        return "relu"
    raise ValueError(f"{name}.activation_fn must be tanh or relu to convert, "
                     f"got {cell.activation_fn}")


def _cell_kind(cell, supported: dict):
    """The sparse cell kind ('lstm', 'gru', 'rnn') and activation of a Flax cell, or an error."""
    kind = supported.get(type(cell))
    if kind is None:
        raise TypeError(f"cannot convert an RNN over {type(cell).__name__}; supported cells: "
                        + ", ".join(c.__name__ for c in supported))
    return kind, _check_activations(cell, kind)


def _mask_array(mask, kernel_h, hidden: int, gates: int, gate_masks=None) -> np.ndarray:
    """The (H, G*H) pattern: explicit array, per-gate masks, or the kernel's nonzeros."""
    if mask is None and gate_masks is None:
        return np.asarray(kernel_h) != 0
    if gate_masks is not None:
        array = np.concatenate([np.asarray(m) for m in gate_masks], axis=-1)
    else:
        array = np.asarray(mask.array if isinstance(mask, StaticMask) else mask)
    if array.dtype != np.bool_:  # a float 0/1 tree would otherwise keep every nonzero entry
        raise TypeError(f"mask must be boolean, got dtype {array.dtype}")
    if array.shape != (hidden, gates * hidden):
        raise ValueError(f"the recurrent mask must have shape ({hidden}, {gates * hidden}), "
                         f"got {array.shape}")
    return array


def _subtree(tree, *keys):
    """tree[k1][k2]... skipping keys the tree does not start with (e.g. 'params')."""
    for key in keys:
        if isinstance(tree, Mapping) and key in tree:
            tree = tree[key]
    return tree


def _direction_masks(mask, tree_keys):
    """(forward, backward) masks of a Bidirectional: a pair, a tree, or one mask for both."""
    if isinstance(mask, (tuple, list)):
        if len(mask) != 2:
            raise ValueError("a Bidirectional takes a pair of masks (forward, backward), "
                             f"got {len(mask)}")
        return mask
    if isinstance(mask, Mapping):
        tree = _subtree(mask, *tree_keys)
        return tree["forward_rnn"], tree["backward_rnn"]
    return mask, mask


def _split_tree_mask(mask, names):
    """Per-gate recurrent masks from a pruning mask tree, or None if mask is not a tree."""
    if not isinstance(mask, Mapping):
        return None
    cell = _subtree(mask, "params", "cell")
    return [np.asarray(_subtree(cell, n)["kernel"]) for n in names]


# -- linen --------------------------------------------------------------------------------------
def from_flax_rnn(module, variables, mask=None, *, implementation: str = "auto"):
    """Converts a linen ``nn.RNN`` (or ``nn.Bidirectional``) into the sparse linen layer.

    Args:
      module: ``nn.RNN`` over ``LSTMCell``, ``OptimizedLSTMCell``, ``GRUCell`` or
        ``SimpleCell`` (sigmoid gates, tanh activation; SimpleCell tanh or relu), or an
        ``nn.Bidirectional`` of two such RNNs.
      variables: the module's variables, ``{'params': {'cell': {...}}}``.
      mask: None (the nonzeros of the recurrent kernels define the pattern), a boolean
        ``(H, G*H)`` array over the concatenated recurrent kernel (gate order of the cell), or a
        boolean tree shaped like ``variables`` / ``variables['params']`` (as made by
        :func:`jax_sprnn.pruning.magnitude_masks`). For ``nn.Bidirectional``: a pair
        ``(forward_mask, backward_mask)`` or a tree.
      implementation: passed to the sparse layers.

    Returns:
      ``(sparse_module, sparse_variables)``: ``sparse_variables`` has the same tree as
      ``variables`` with the pruned recurrent entries set to zero.
    """
    variables = unfreeze(variables)
    if not isinstance(variables, Mapping) or "params" not in variables:
        got = sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__
        raise ValueError("variables must be the module's variables, {'params': ...} as "
                         f"module.init returns (not variables['params']); got {got}")
    if isinstance(module, nn.Bidirectional):
        params = variables["params"]
        masks = _direction_masks(mask, ("params",))
        fwd, fwd_vars = from_flax_rnn(module.forward_rnn, {"params": params["forward_rnn"]},
                                      masks[0], implementation=implementation)
        bwd, bwd_vars = from_flax_rnn(module.backward_rnn, {"params": params["backward_rnn"]},
                                      masks[1], implementation=implementation)
        sparse = nn.Bidirectional(fwd, bwd, merge_fn=module.merge_fn,
                                  time_major=module.time_major,
                                  return_carry=module.return_carry)
        return sparse, {**variables, "params": {"forward_rnn": fwd_vars["params"],
                                                "backward_rnn": bwd_vars["params"]}}
    if not isinstance(module, nn.RNN):
        raise TypeError(f"from_flax_rnn expects flax.linen.RNN or Bidirectional, got "
                        f"{type(module).__name__}")
    cell = module.cell
    kind, activation = _cell_kind(cell, _LINEN_CELLS)
    params = variables["params"]["cell"]
    names = _RECURRENT[kind]
    hidden = cell.features
    gates = common.GATES[kind]
    for n in names:  # variables of another model would fail later as a broadcasting error
        shape = np.shape(params[n]["kernel"])
        if shape != (hidden, hidden):
            raise ValueError(f"variables do not match the module: params['cell']['{n}'] "
                             f"kernel has shape {shape}, the cell's features={hidden} needs "
                             f"({hidden}, {hidden})")
    kernel_h = np.concatenate([np.asarray(params[n]["kernel"]) for n in names], axis=-1)
    array = _mask_array(None if isinstance(mask, Mapping) else mask, kernel_h, hidden, gates,
                        _split_tree_mask(mask, names))
    static = StaticMask(array)

    new_cell = dict(params)
    for g, n in enumerate(names):
        keep = array[:, g * hidden:(g + 1) * hidden]
        kernel = jnp.asarray(params[n]["kernel"])
        new_cell[n] = {**params[n], "kernel": jnp.where(keep, kernel, jnp.zeros((), kernel.dtype))}
    kwargs = dict(features=hidden, mask=static, time_major=module.time_major,
                  return_carry=module.return_carry, reverse=module.reverse,
                  keep_order=module.keep_order, kernel_init=cell.kernel_init,
                  recurrent_kernel_init=cell.recurrent_kernel_init, bias_init=cell.bias_init,
                  dtype=cell.dtype, param_dtype=cell.param_dtype, carry_init=cell.carry_init,
                  implementation=implementation)
    if kind == "rnn":
        kwargs.update(activation=activation, residual=cell.residual)
    sparse = sp_linen.LAYERS[kind](**kwargs)
    return sparse, {**variables, "params": {**variables["params"], "cell": new_cell}}


# -- nnx ----------------------------------------------------------------------------------------
def _value(var) -> jax.Array:
    return jnp.asarray(var[...])


def _nnx_fused(cell, kind: str):
    """(kernel_i, bias_i, kernel_h, bias_h) of an nnx cell, fused in gate order."""
    if isinstance(cell, nnx.LSTMCell):
        kernel_i = jnp.concatenate([_value(getattr(cell, n).kernel) for n in _NNX_LSTM_INPUT],
                                   axis=-1)
        hs = [getattr(cell, n) for n in _RECURRENT["lstm"]]
        kernel_h = jnp.concatenate([_value(h.kernel) for h in hs], axis=-1)
        bias_h = jnp.concatenate([_value(h.bias) for h in hs])
        return kernel_i, None, kernel_h, bias_h
    bias_i = _value(cell.dense_i.bias) if cell.dense_i.bias is not None else None
    bias_h = _value(cell.dense_h.bias) if cell.dense_h.bias is not None else None
    return _value(cell.dense_i.kernel), bias_i, _value(cell.dense_h.kernel), bias_h


def _nnx_tree_mask(mask, kind: str):
    """Per-gate (LSTMCell) or fused recurrent mask from a tree mirroring nnx.state(rnn)."""
    cell = _subtree(mask, "cell")
    if "dense_h" in cell:
        return [np.asarray(_subtree(cell["dense_h"], "kernel"))]
    return [np.asarray(_subtree(cell[n], "kernel")) for n in _RECURRENT[kind]]


def from_nnx_rnn(rnn, mask=None, *, implementation: str = "auto"):
    """Converts an ``nnx.RNN`` (or ``nnx.Bidirectional``) into the sparse nnx layer.

    Supported cells: ``nnx.LSTMCell``, ``nnx.OptimizedLSTMCell``, ``nnx.GRUCell`` (no b_hn)
    and ``nnx.SimpleCell``. ``mask`` is None (the recurrent kernels' nonzeros), a boolean
    ``(H, G*H)`` array over the fused recurrent kernel, or a tree shaped like
    ``nnx.to_pure_dict(nnx.state(rnn, nnx.Param))``; for ``Bidirectional`` a pair or such a tree.
    Returns a new sparse module holding copies of the parameters (pruned entries zeroed).
    """
    if isinstance(rnn, nnx.Bidirectional):
        masks = _direction_masks(mask, ())
        fwd = from_nnx_rnn(rnn.forward_rnn, masks[0], implementation=implementation)
        bwd = from_nnx_rnn(rnn.backward_rnn, masks[1], implementation=implementation)
        return nnx.Bidirectional(fwd, bwd, merge_fn=rnn.merge_fn, time_major=rnn.time_major,
                                 return_carry=rnn.return_carry, rngs=False)
    if not isinstance(rnn, nnx.RNN):
        raise TypeError(f"from_nnx_rnn expects flax.nnx.RNN or Bidirectional, got "
                        f"{type(rnn).__name__}")
    cell = rnn.cell
    kind, activation = _cell_kind(cell, _NNX_CELLS)
    hidden, gates = cell.hidden_features, common.GATES[kind]
    kernel_i, bias_i, kernel_h, bias_h = _nnx_fused(cell, kind)
    gate_masks = _nnx_tree_mask(mask, kind) if isinstance(mask, Mapping) else None
    array = _mask_array(None if isinstance(mask, Mapping) else mask, kernel_h, hidden, gates,
                        gate_masks)

    kwargs = dict(mask=StaticMask(array), time_major=rnn.time_major,
                  return_carry=rnn.return_carry, reverse=rnn.reverse,
                  keep_order=rnn.keep_order, dtype=cell.dtype, param_dtype=cell.param_dtype,
                  carry_init=cell.carry_init, implementation=implementation,
                  rngs=nnx.Rngs(0))
    if kind == "rnn":
        kwargs.update(activation=activation, residual=cell.residual)
    sparse = sp_nnx.LAYERS[kind](cell.in_features, hidden, **kwargs)
    sparse.dense_i.kernel[...] = kernel_i
    if sparse.dense_i.bias is not None:
        sparse.dense_i.bias[...] = bias_i
    sparse.dense_h.kernel[...] = jnp.where(array, kernel_h, jnp.zeros((), kernel_h.dtype))
    if sparse.dense_h.bias is not None:
        sparse.dense_h.bias[...] = bias_h
    return sparse

