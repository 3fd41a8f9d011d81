"""Sparse recurrent layers for ``flax.linen``, used like ``nn.RNN(nn.LSTMCell(H))``.

Each layer is a whole ``nn.RNN`` (one call runs every timestep, on the sparse persistent
kernel where available). The parameter tree is exactly the one of ``nn.RNN`` over the matching
Flax cell (``{'cell': {'ii': {'kernel'}, 'hi': {'kernel', 'bias'}, ...}}``), so a trained or
pruned Flax checkpoint loads unchanged. The sparsity pattern of the recurrent kernel is a fixed
module attribute (:class:`~jax_sprnn.flax.StaticMask`), not a parameter: pruned entries are
ignored by the layer and receive zero gradient, and optax only ever moves kept values.

Example::

    import flax.linen as nn
    from jax_sprnn.flax import SparseLSTM

    layer = SparseLSTM(features=256, density=0.1)           # random 10% pattern
    layer = SparseLSTM(features=256, mask=mask)              # or a given (H, 4H) pattern
    variables = layer.init(jax.random.key(0), x)            # x: (batch, time, features)
    y = layer.apply(variables, x)                           # (batch, time, 256)
    bi = nn.Bidirectional(SparseLSTM(256, density=0.1), SparseLSTM(256, density=0.1))
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import initializers
from flax.linen.linear import default_kernel_init

from jax_sprnn.flax import common
from jax_sprnn.flax.common import StaticMask
from jax_sprnn.validation import check_flag

Array = Any
Initializer = Any

# Parameter names of the matching Flax cells, in gate order.
_NAMES = {
    # cell: (input-side dense names, recurrent-side dense names, input side has bias,
    #        recurrent side has bias)
    "lstm": (("ii", "if", "ig", "io"), ("hi", "hf", "hg", "ho")),
    "gru": (("ir", "iz", "in"), ("hr", "hz", "hn")),
    "rnn": (("i",), ("h",)),
}


class _Dense(nn.Module):
    """Creates the parameters of a ``flax.linen.Dense`` (same names, shapes and init)."""

    features: int
    use_bias: bool
    kernel_init: Initializer
    bias_init: Initializer
    param_dtype: Any

    @nn.compact
    def __call__(self, in_features: int):
        kernel = self.param("kernel", self.kernel_init, (in_features, self.features),
                            self.param_dtype)
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)
        return kernel, bias


class _CellParams(nn.Module):
    """The parameters of Flax's LSTMCell / GRUCell / SimpleCell, fused for one layer call.

    Returns ``(kernel_i (I, G*H), bias_i (G*H,) | None, kernel_h (H, G*H), b_hn | None)``.
    """

    cell: str
    features: int
    kernel_init: Initializer
    recurrent_kernel_init: Initializer
    bias_init: Initializer
    param_dtype: Any

    @nn.compact
    def __call__(self, in_features: int):
        in_names, h_names = _NAMES[self.cell]
        hidden = self.features
        dense = lambda name, n_in, init, bias: _Dense(  # noqa: E731
            hidden, bias, init, self.bias_init, self.param_dtype, name=name)(n_in)
        # Same bias placement as Flax: LSTM biases on the recurrent side, GRU / simple on the
        # input side, plus the GRU's hn bias (b_hn) inside r * (h W_hn + b_hn).
        i_bias = self.cell != "lstm"
        ins = [dense(n, in_features, self.kernel_init, i_bias) for n in in_names]
        hs = [dense(n, hidden, self.recurrent_kernel_init,
                    self.cell == "lstm" or n == "hn") for n in h_names]
        kernel_i = jnp.concatenate([k for k, _ in ins], axis=-1)
        kernel_h = jnp.concatenate([k for k, _ in hs], axis=-1)
        b_hn = None
        if self.cell == "lstm":
            bias_i = jnp.concatenate([b for _, b in hs])
        else:
            bias_i = jnp.concatenate([b for _, b in ins])
            if self.cell == "gru":
                b_hn = hs[2][1]
        return kernel_i, bias_i, kernel_h, b_hn


class _SparseRNNBase(nn.Module):
    """Shared body of the sparse linen layers; see :class:`SparseLSTM` for the attributes."""

    features: int
    mask: Any = None
    density: float | None = None
    mask_seed: int = 0
    time_major: bool = False
    return_carry: bool = False
    reverse: bool = False
    keep_order: bool = False
    kernel_init: Initializer = default_kernel_init
    recurrent_kernel_init: Initializer = initializers.orthogonal()
    bias_init: Initializer = initializers.zeros_init()
    dtype: Any = None
    param_dtype: Any = jnp.float32
    carry_init: Initializer = initializers.zeros_init()
    implementation: str = "auto"

    cell_type: ClassVar[str] = ""

    def __post_init__(self):
        # A NumPy mask becomes a hashable StaticMask once, so the module stays hashable.
        if self.mask is not None and not isinstance(self.mask, StaticMask):
            object.__setattr__(self, "mask", StaticMask(self.mask))
        super().__post_init__()

    # -- hooks for subclasses -------------------------------------------------------------
    def _activation(self) -> str:
        return "tanh"

    def _kernel_and_mask(self, kernel_h, mask: StaticMask):
        return kernel_h, mask

    # -- public ----------------------------------------------------------------------------
    @property
    def gates(self) -> int:
        return common.GATES[self.cell_type]

    @property
    def static_mask(self) -> StaticMask:
        """The fixed pattern of the recurrent kernel ``(H, G*H)`` this layer runs with."""
        return common.layer_mask(self.mask, self.density, self.mask_seed, self.features,
                                 self.gates)

    @nn.nowrap
    def initialize_carry(self, rng, input_shape):
        """Carry for inputs of shape ``(*batch, features)``, as Flax's cells make it."""
        shape = tuple(input_shape[:-1]) + (self.features,)
        if self.cell_type == "lstm":
            k1, k2 = jax.random.split(rng)
            return (self.carry_init(k1, shape, self.param_dtype),
                    self.carry_init(k2, shape, self.param_dtype))
        return self.carry_init(rng, shape, self.param_dtype)

    @nn.compact
    def __call__(self, inputs, *, initial_carry=None, init_key=None, seq_lengths=None,
                 return_carry=None, time_major=None, reverse=None, keep_order=None):
        """Runs the layer over a sequence; arguments and results as ``flax.linen.RNN``.

        inputs: ``(*batch, time, features)`` (``(time, *batch, features)`` if ``time_major``).
        Outputs at padding positions (``t >= seq_lengths``) are zeros.
        """
        options = common.call_options(self, return_carry=return_carry, time_major=time_major,
                                      reverse=reverse, keep_order=keep_order)
        mask = self.static_mask  # checks features and density before any parameter is made
        kernel_i, bias_i, kernel_h, b_hn = _CellParams(
            self.cell_type, self.features, self.kernel_init, self.recurrent_kernel_init,
            self.bias_init, self.param_dtype, name="cell")(inputs.shape[-1])
        if initial_carry is None:
            initial_carry = self.initialize_carry(
                jax.random.key(0) if init_key is None else init_key,
                common.step_shape(inputs, options["time_major"]))
        kernel_h, mask = self._kernel_and_mask(kernel_h, mask)
        return common.run_module(self, inputs, (kernel_i, bias_i, kernel_h, b_hn, mask), options,
                                 initial_carry, seq_lengths)


class SparseLSTM(_SparseRNNBase):
    """Sparse LSTM layer: ``nn.RNN(nn.LSTMCell(features))`` with a pruned recurrent kernel.

    Attributes:
      features: hidden size H.
      mask: fixed boolean pattern of the recurrent kernel ``(H, 4H)``, columns in gate order
        i, f, g, o (``concatenate([hi, hf, hg, ho] kernels, -1)``). A NumPy array or
        :class:`StaticMask`.
      density: if no mask is given, a random pattern with this fraction kept (seed
        ``mask_seed``). With neither, the layer is dense (every entry kept).
      time_major, return_carry, reverse, keep_order: as ``flax.linen.RNN``.
      kernel_init, recurrent_kernel_init, bias_init, dtype, param_dtype, carry_init: as
        ``flax.linen.LSTMCell``. Gates are sigmoid and the activation is tanh.
      implementation: ``"auto"`` (the sparse kernel), ``"kernel"`` or ``"reference"``
        (pure JAX), passed to :func:`jax_sprnn.lstm`.
    """

    cell_type: ClassVar[str] = "lstm"


class SparseGRU(_SparseRNNBase):
    """Sparse GRU layer: ``nn.RNN(nn.GRUCell(features))`` with a pruned recurrent kernel.

    The mask has shape ``(H, 3H)``, gate order r, z, n (``hr``, ``hz``, ``hn`` kernels).
    Other attributes as :class:`SparseLSTM`.
    """

    cell_type: ClassVar[str] = "gru"


class SparseSimpleRNN(_SparseRNNBase):
    """Sparse simple RNN layer: ``nn.RNN(nn.SimpleCell(features))`` with a pruned kernel.

    Extra attributes: ``activation`` ("tanh" or "relu") and ``residual`` (as SimpleCell's:
    ``h' = act(x W_i + b + h W_h + h)``; the identity is folded into the recurrent kernel, so
    the diagonal is added to the pattern). The mask has shape ``(H, H)``.
    """

    activation: str = "tanh"
    residual: bool = False

    cell_type: ClassVar[str] = "rnn"

    def _activation(self) -> str:
        return self.activation

    def _kernel_and_mask(self, kernel_h, mask: StaticMask):
        if not check_flag("residual", self.residual):
            return kernel_h, mask
        return common.residual_kernel(kernel_h, mask)


LAYERS = {"lstm": SparseLSTM, "gru": SparseGRU, "rnn": SparseSimpleRNN}
