"""Sparse recurrent layers for ``flax.nnx``, used like ``nnx.RNN(nnx.OptimizedLSTMCell(...))``.

Each layer is a whole ``nnx.RNN`` (one call runs every timestep). Parameters follow nnx's
fused cells: ``dense_i`` (an ``nnx.Linear`` from the inputs to all gates) and ``dense_h`` (an
``nnx.Linear`` from the hidden state to all gates, kernel ``(H, G*H)``), as in
``nnx.OptimizedLSTMCell`` and ``nnx.GRUCell``. The sparsity pattern of ``dense_h.kernel`` is a
static attribute (:class:`~jax_sprnn.flax.StaticMask`, part of the graph definition, never a
``Param``): ``nnx.state(layer, nnx.Param)`` holds only trainable arrays, pruned entries get
zero gradient and are ignored by the layer.

Example::

    from flax import nnx
    from jax_sprnn.flax.nnx import SparseLSTM

    layer = SparseLSTM(64, 256, density=0.1, rngs=nnx.Rngs(0))
    y = layer(x)                                    # x: (batch, time, 64) -> (batch, time, 256)
    bi = nnx.Bidirectional(SparseLSTM(64, 256, density=0.1, rngs=rngs),
                           SparseLSTM(64, 256, density=0.1, rngs=rngs))
"""

from __future__ import annotations

import inspect

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.nnx.nn.linear import default_kernel_init

from jax_sprnn.flax import common
from jax_sprnn.validation import check_flag


class _SparseRNNBase(nnx.Module):
    """Shared body of the sparse nnx layers; see :class:`SparseLSTM` for the arguments."""

    cell_type = ""
    input_bias = True
    recurrent_bias = False
    # The matching nnx cell (whose recurrent init is the default) and which Linear it makes first.
    matching_cell: type[nnx.Module]
    recurrent_first = False

    def __init__(self, in_features: int, hidden_features: int, *, mask=None,
                 density: float | None = None, mask_seed: int = 0, time_major: bool = False,
                 return_carry: bool = False, reverse: bool = False, keep_order: bool = False,
                 kernel_init=default_kernel_init, recurrent_kernel_init=None,
                 bias_init=initializers.zeros_init(), dtype=None, param_dtype=jnp.float32,
                 carry_init=None, implementation: str = "auto", rngs: nnx.Rngs):
        gates = common.GATES[self.cell_type]
        self.in_features = in_features
        self.hidden_features = hidden_features
        self.mask = common.layer_mask(mask, density, mask_seed, hidden_features, gates)
        self.time_major = time_major
        self.return_carry = return_carry
        self.reverse = reverse
        self.keep_order = keep_order
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.carry_init = carry_init
        self.implementation = implementation
        if recurrent_kernel_init is None:  # read from the cell, so the draws match it in any mode
            recurrent_kernel_init = inspect.signature(self.matching_cell.__init__).parameters[
                "recurrent_kernel_init"].default
        make_i = lambda: nnx.Linear(  # noqa: E731
            in_features, gates * hidden_features, use_bias=self.input_bias,
            kernel_init=kernel_init, bias_init=bias_init, dtype=dtype, param_dtype=param_dtype,
            rngs=rngs)
        make_h = lambda: nnx.Linear(  # noqa: E731
            hidden_features, gates * hidden_features, use_bias=self.recurrent_bias,
            kernel_init=recurrent_kernel_init, bias_init=bias_init, dtype=dtype,
            param_dtype=param_dtype, rngs=rngs)
        # In the matching nnx cell's order, so one Rngs draws the cell's own parameters.
        if self.recurrent_first:
            self.dense_h = make_h()
            self.dense_i = make_i()
        else:
            self.dense_i = make_i()
            self.dense_h = make_h()

    # -- hooks ---------------------------------------------------------------------------------
    def _activation(self) -> str:
        return "tanh"

    def _fused(self):
        """(kernel_i, bias_i, kernel_h, b_hn, mask) for common.run_layer."""
        kernel_i = self.dense_i.kernel[...]
        bias_i = self.dense_i.bias[...] if self.dense_i.bias is not None else None
        kernel_h = self.dense_h.kernel[...]
        bias_h = self.dense_h.bias[...] if self.dense_h.bias is not None else None
        if bias_h is not None:  # LSTM: recurrent-side biases add to the projection
            bias_i = bias_h if bias_i is None else bias_i + bias_h
        return kernel_i, bias_i, kernel_h, None, self.mask

    # -- public --------------------------------------------------------------------------------
    @property
    def num_feature_axes(self) -> int:
        return 1

    def initialize_carry(self, input_shape, rngs=None, carry_init=None):
        """Carry for inputs of shape ``(*batch, features)``: zeros unless a carry_init is given
        (which then needs ``rngs``)."""
        carry_init = carry_init or self.carry_init
        shape = tuple(input_shape[:-1]) + (self.hidden_features,)
        n = 2 if self.cell_type == "lstm" else 1
        if carry_init is None:
            parts = [jnp.zeros(shape, self.param_dtype) for _ in range(n)]
        else:
            if rngs is None:
                raise ValueError("rngs are needed to initialize the carry with carry_init")
            stream = rngs.carry if isinstance(rngs, nnx.Rngs) else rngs
            parts = [carry_init(stream(), shape, self.param_dtype) for _ in range(n)]
        return tuple(parts) if n == 2 else parts[0]

    def __call__(self, inputs, *, initial_carry=None, rngs=None, seq_lengths=None,
                 return_carry=None, time_major=None, reverse=None, keep_order=None):
        """Runs the layer over a sequence; arguments and results as ``flax.nnx.RNN``.

        Outputs at padding positions (``t >= seq_lengths``) are zeros.
        """
        options = common.call_options(self, return_carry=return_carry, time_major=time_major,
                                      reverse=reverse, keep_order=keep_order)
        if initial_carry is None:  # as nnx.RNN: the cell's carry, in param_dtype
            initial_carry = self.initialize_carry(
                common.step_shape(inputs, options["time_major"]), rngs)
        return common.run_module(self, inputs, self._fused(), options, initial_carry, seq_lengths)


class SparseLSTM(_SparseRNNBase):
    """Sparse LSTM layer, the sparse counterpart of ``nnx.RNN(nnx.OptimizedLSTMCell(I, H))``.

    Args:
      in_features, hidden_features: I and H.
      mask: fixed boolean pattern of ``dense_h.kernel`` ``(H, 4H)`` (gate order i, f, g, o);
        NumPy array or :class:`StaticMask`.
      density, mask_seed: without a mask, a random pattern keeping this fraction. With
        neither, the layer is dense.
      time_major, return_carry, reverse, keep_order: as ``nnx.RNN``.
      kernel_init, recurrent_kernel_init, bias_init, dtype, param_dtype, carry_init: as the
        nnx cells (``recurrent_kernel_init=None``: the matching cell's default), so the same
        ``Rngs`` draw the cell's own parameters. ``dense_i`` has no bias, ``dense_h`` has one
        (as OptimizedLSTMCell).
      implementation: "auto" | "kernel" | "reference", passed to :func:`jax_sprnn.lstm`.
      rngs: ``nnx.Rngs`` for parameter initialization.
    """

    cell_type = "lstm"
    matching_cell = nnx.OptimizedLSTMCell
    input_bias = False
    recurrent_bias = True


class SparseGRU(_SparseRNNBase):
    """Sparse GRU layer, the sparse counterpart of ``nnx.RNN(nnx.GRUCell(I, H))``.

    ``dense_i`` has a bias and ``dense_h`` none, as nnx's GRUCell. With
    ``recurrent_bias=True`` ``dense_h`` gets a bias ``(3H,)`` ``[b_hr, b_hz, b_hn]``:
    ``n = tanh(x_n + r * (h W_hn + b_hn))`` (the form of linen's GRUCell and PyTorch).
    The mask has shape ``(H, 3H)``, gate order r, z, n.
    """

    cell_type = "gru"
    matching_cell = nnx.GRUCell

    def __init__(self, in_features: int, hidden_features: int, *, recurrent_bias: bool = False,
                 **kwargs):
        self.recurrent_bias = check_flag("recurrent_bias", recurrent_bias)
        super().__init__(in_features, hidden_features, **kwargs)

    def _fused(self):
        kernel_i = self.dense_i.kernel[...]
        bias_i = self.dense_i.bias[...]
        kernel_h = self.dense_h.kernel[...]
        b_hn = None
        if self.dense_h.bias is not None:
            h = self.hidden_features
            bias_h = self.dense_h.bias[...]
            bias_i = bias_i + jnp.concatenate([bias_h[:2 * h], jnp.zeros_like(bias_h[2 * h:])])
            b_hn = bias_h[2 * h:]
        return kernel_i, bias_i, kernel_h, b_hn, self.mask


class SparseSimpleRNN(_SparseRNNBase):
    """Sparse simple RNN layer, the counterpart of ``nnx.RNN(nnx.SimpleCell(I, H))``.

    Extra arguments: ``activation`` ("tanh" | "relu") and ``residual`` (``h' = act(x W_i + b
    + h W_h + h)``: the identity is folded into the recurrent kernel and its diagonal into the
    pattern). The mask has shape ``(H, H)``.
    """

    cell_type = "rnn"
    matching_cell = nnx.SimpleCell
    recurrent_first = True

    def __init__(self, in_features: int, hidden_features: int, *, activation: str = "tanh",
                 residual: bool = False, **kwargs):
        common.check_cell("rnn", activation)
        self.activation = activation
        self.residual = check_flag("residual", residual)
        super().__init__(in_features, hidden_features, **kwargs)

    def _activation(self) -> str:
        return self.activation

    def _fused(self):
        kernel_i, bias_i, kernel_h, _, mask = super()._fused()
        if self.residual:  # from the current mask: a re-pruned layer sets a new one
            kernel_h, mask = common.residual_kernel(kernel_h, mask)
        return kernel_i, bias_i, kernel_h, None, mask


LAYERS = {"lstm": SparseLSTM, "gru": SparseGRU, "rnn": SparseSimpleRNN}
