"""jax_sprnn: sparse persistent RNN kernels for JAX and Flax."""

from jax_sprnn.api import gru, lstm, rnn
from jax_sprnn.weights import SparseWeights

__all__ = ["SparseWeights", "rnn", "lstm", "gru"]
__version__ = "0.1.0"
