"""The pure-JAX fallback of both primitives (what GPUs run for the backward pass, and for the
forward pass without the CUDA extension) agrees with the C++ handlers operand for operand."""

import jax.numpy as jnp
import numpy as np
import pytest

import oracle
import jax_sprnn as sp
from jax_sprnn.primitives import jax_fallback
from jax_sprnn.primitives.recurrence import CELLS, backward_p, forward_p


def _operands(cell, seed, steps=5, batch=4, hidden=13):
    rng = np.random.default_rng(seed)
    p = oracle.random_problem(rng, cell, steps, batch, hidden, 0.4, jnp.dtype("float32"),
                              "empty_rows")
    w = sp.SparseWeights.from_dense(p["kernel"], p["mask"])
    lengths = jnp.asarray(oracle.make_lengths(rng, "ragged", steps, batch))
    extras = (jnp.asarray(p["b_hn"]),) if CELLS[cell].has_b_hn else ()
    ins = (jnp.asarray(p["xp"]), lengths, w.values, w.col_idx, w.row_ptr,
           *map(jnp.asarray, p["carry"]), *extras)
    return rng, ins


@pytest.mark.parametrize("cell", ["rnn", "lstm", "gru"])
@pytest.mark.parametrize("reverse", [False, True])
def test_fallback_matches_cpu_handlers(cell, reverse):
    rng, ins = _operands(cell, seed=len(cell) + reverse)
    params = dict(cell=cell, reverse=reverse, activation=1 if cell == "rnn" else 0)
    handler_fwd = forward_p.bind(*ins, variant=-1, local=True, **params)
    fallback_fwd = jax_fallback.forward(*ins, **params)
    for got, want in zip(fallback_fwd, handler_fwd, strict=True):
        assert oracle.rel_error(got, want) < 2e-5

    n_carry = len(CELLS[cell].carry)
    saved = (handler_fwd[0], *handler_fwd[1 + n_carry:])  # ys (and the lstm's cs)
    cotangents = [jnp.asarray(rng.standard_normal(y.shape), jnp.float32)
                  for y in handler_fwd[:1 + n_carry]]  # for ys and the final carry
    bwd_ins = (*ins, *saved, *cotangents)
    for groups in (1, 2):
        want = backward_p.bind(*bwd_ins, groups=groups, local=True, **params)
        got = jax_fallback.backward(*bwd_ins, groups=groups, **params)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            assert oracle.rel_error(g, w) < 1e-4
