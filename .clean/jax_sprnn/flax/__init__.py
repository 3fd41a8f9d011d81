"""Flax (linen and nnx) layers on the sparse persistent RNN kernels, conversion and pruning.

- :mod:`jax_sprnn.flax.linen`: ``SparseLSTM``, ``SparseGRU``, ``SparseSimpleRNN`` (linen)
- :mod:`jax_sprnn.flax.nnx`: the same layers for ``flax.nnx``
- :mod:`jax_sprnn.flax.convert`: ``from_flax_rnn`` (linen ``nn.RNN``) and ``from_nnx_rnn``
- :mod:`jax_sprnn.pruning`: magnitude pruning of Flax parameter trees
"""

from jax_sprnn.flax import linen, nnx
from jax_sprnn.flax.common import StaticMask, flip_sequences, random_mask
from jax_sprnn.flax.convert import from_flax_rnn, from_nnx_rnn
from jax_sprnn.flax.linen import SparseGRU, SparseLSTM, SparseSimpleRNN

__all__ = ["linen", "nnx", "StaticMask", "random_mask", "flip_sequences", "from_flax_rnn",
           "from_nnx_rnn", "SparseLSTM", "SparseGRU", "SparseSimpleRNN"]
