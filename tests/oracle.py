"""Independent float64 NumPy oracle of the recurrences, written from the equations in
../shared/DESIGN.md (not from the library's code), plus random-problem builders for tests."""

from __future__ import annotations

import numpy as np

GATES = {"rnn": 1, "lstm": 4, "gru": 3}

# Relative tolerances of ||out - ref|| / ||ref|| per dtype (float32 accumulation everywhere).
RTOL = {"float32": 2e-5, "bfloat16": 3e-2, "float16": 5e-3}


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def run(cell, xp, carry, kernel, lengths=None, b_hn=None, reverse=False, activation="tanh"):
    """xp (T, B, G*H), carry tuple of (B, H), kernel (H, G*H). Returns (ys, carry_T)."""
    xp = np.asarray(xp, np.float64)
    kernel = np.asarray(kernel, np.float64)
    steps, batch, _ = xp.shape
    hidden = kernel.shape[0]
    lengths = np.full(batch, steps) if lengths is None else np.asarray(lengths)
    ys = np.zeros((steps, batch, hidden))
    final = [np.zeros((batch, hidden)) for _ in carry]
    for b in range(batch):
        state = [np.asarray(c, np.float64)[b].copy() for c in carry]
        order = range(lengths[b] - 1, -1, -1) if reverse else range(lengths[b])
        for t in order:
            x = xp[t, b]
            hw = state[-1] @ kernel
            if cell == "rnn":
                a = x + hw
                state = [np.tanh(a) if activation == "tanh" else np.maximum(a, 0.0)]
            elif cell == "lstm":
                i, f, g, o = np.split(x + hw, 4)
                c = _sigmoid(f) * state[0] + _sigmoid(i) * np.tanh(g)
                state = [c, _sigmoid(o) * np.tanh(c)]
            else:
                xr, xz, xn = np.split(x, 3)
                hr, hz, hn = np.split(hw, 3)
                r, z = _sigmoid(xr + hr), _sigmoid(xz + hz)
                n = np.tanh(xn + r * (hn + np.asarray(b_hn, np.float64)))
                state = [(1 - z) * n + z * state[0]]
            ys[t, b] = state[-1]
        for f_, s in zip(final, state):
            f_[b] = s
    return ys, tuple(final)


def nan_reach(mask, cell, steps, unit, t0):
    """(steps, H) bool: where a NaN put into input column `unit` (< H) of one sequence at step
    t0 must show in that sequence's ys of a sparse layer: the unit at t0 (and after, where a state
    keeps it: lstm's c, gru's h), then every unit with a nonzero in a column that was NaN the
    step before. (A dense matmul, as in `run`, spreads it through the zeros too: NaN * 0.)"""
    hidden = mask.shape[0]
    reads = mask.reshape(hidden, GATES[cell], hidden).any(axis=1)  # reads[i, u]: u reads h_i
    want = np.zeros((steps, hidden), bool)
    for t in range(t0, steps):
        if t > t0:
            want[t] = reads[want[t - 1]].any(axis=0)
        if t == t0 or cell != "rnn":
            want[t, unit] = True
    return want


def h0_nan_reach(mask, cell, unit):
    """(H,) bool: where a NaN put into h0's `unit` of one sequence must show in that sequence's
    output of a one-step call of a sparse layer: every unit with a nonzero in column `unit`, and
    for the gru the unit itself (its update mixes in its own h: z * NaN)."""
    hidden = mask.shape[0]
    want = mask.reshape(hidden, GATES[cell], hidden).any(axis=1)[unit].copy()
    if cell == "gru":
        want[unit] = True
    return want


def with_nan(p, cell, b, unit=5, t0=1):
    """Problem p's xp with one NaN input (sequence b, the first gate of `unit`, step t0), and
    where that NaN must show in ys: (steps, batch, H) bool, nan_reach in sequence b."""
    xp = np.asarray(p["xp"]).copy()
    xp[t0, b, unit] = np.nan
    steps, batch = xp.shape[:2]
    want = np.zeros((steps, batch, p["mask"].shape[0]), bool)
    want[:, b] = nan_reach(p["mask"], cell, steps, unit, t0)
    assert want[-1, b].sum() > 1, "the NaN should have spread"
    return xp, want


def others_error(ys, p, xp, cell, b, activation) -> float:
    """rel_error of ys against `run` in every sequence but b (the one with with_nan's NaN)."""
    ref_ys, _ = run(cell, xp, p["carry"], p["kernel"], None, p["b_hn"], False, activation)
    others = np.arange(xp.shape[1]) != b
    return rel_error(np.asarray(ys, np.float64)[:, others], ref_ys[:, others])


def rel_error(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    scale = max(np.linalg.norm(ref), 1e-30)
    return float(np.linalg.norm(out - ref) / scale)


def random_mask(rng, hidden, gates, density, pattern="uniform"):
    """Masks of the kinds the kernels must handle: uniform, with empty rows, skewed rows."""
    shape = (hidden, gates * hidden)
    mask = rng.random(shape) < density
    if pattern == "empty_rows":  # every other output (packed row) has no nonzero
        mask[:, ::2] = False
    elif pattern == "skewed":  # a few outputs are dense, the rest very sparse
        mask = rng.random(shape) < density * 0.1
        mask[:, : max(1, gates * hidden // 8)] = True
    return mask


def random_problem(rng, cell, steps, batch, hidden, density, dtype, pattern="uniform",
                   scale=None):
    gates = GATES[cell]
    mask = random_mask(rng, hidden, gates, density, pattern)
    # Scale keeps pre-activations O(1) whatever H and density are.
    scale = scale or 1.5 / np.sqrt(max(1.0, density * hidden))
    kernel = (rng.standard_normal(mask.shape) * scale * mask).astype(np.float32)
    xp = rng.standard_normal((steps, batch, gates * hidden)).astype(np.float32)
    carry = tuple(rng.standard_normal((batch, hidden)).astype(np.float32) * 0.5
                  for _ in range(2 if cell == "lstm" else 1))
    b_hn = rng.standard_normal(hidden).astype(np.float32) * 0.5 if cell == "gru" else None
    cast = (lambda a: None if a is None else np.asarray(a).astype(dtype))
    return dict(xp=cast(xp), carry=tuple(cast(c) for c in carry), kernel=cast(kernel),
                mask=mask, b_hn=cast(b_hn))


def make_lengths(rng, kind, steps, batch):
    """seq_lengths of a kind: None, all T, or ragged with an empty and (B > 1) a full one."""
    if kind == "none":
        return None
    if kind == "full":
        return np.full(batch, steps, np.int32)
    lengths = rng.integers(0, steps + 1, batch).astype(np.int32)
    lengths[0] = 0
    if batch > 1:
        lengths[-1] = steps
    return lengths


def run_api(cell, xp, carry, w, b_hn=None, lengths=None, reverse=False, activation="tanh",
            implementation="auto"):
    """Calls sp.rnn / sp.lstm / sp.gru uniformly; returns (ys, carry tuple)."""
    import jax_sprnn as sp  # noqa: PLC0415

    if cell == "lstm":
        return sp.lstm(xp, carry, w, lengths, reverse, implementation=implementation)
    if cell == "gru":
        ys, h = sp.gru(xp, carry[0], w, b_hn, lengths, reverse, implementation=implementation)
    else:
        ys, h = sp.rnn(xp, carry[0], w, activation, lengths, reverse,
                       implementation=implementation)
    return ys, (h,)


def check_few_live_sequences(cell, steps, batch, hidden, dtype, live, reverse=True,
                             density=0.3, implementation="kernel"):
    """One call over a large (steps, batch) in which only the sequences `live` run; the others
    have length 0, a NaN xp and a carry of 0.25. Large enough, xp holds more than 2**31 elements
    (offsets past int32) at little compute. The live sequences must match `run` on them alone,
    the others give zero ys and keep their carry. The whole xp is built on the device, once."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    import jax_sprnn as sp  # noqa: PLC0415

    rng = np.random.default_rng(len(live) * steps + batch + hidden)
    p = random_problem(rng, cell, steps, len(live), hidden, density, np.dtype(dtype))
    live = np.asarray(live)
    idle = np.ones(batch, bool)
    idle[live] = False

    w0 = sp.SparseWeights.from_dense(p["kernel"], p["mask"])

    def spread(a, fill):  # the live sequences' rows in a (..., batch, n) array of `fill`
        return jnp.full((*a.shape[:-2], batch, a.shape[-1]), fill, a.dtype).at[..., live, :].set(a)

    @jax.jit
    def call(xp_live, carry_live, values):
        w = sp.SparseWeights(values, w0.col_idx, w0.row_ptr, hidden_size=hidden,
                             gates=GATES[cell])
        lengths = jnp.zeros(batch, jnp.int32).at[live].set(steps)
        ys, final = run_api(cell, spread(xp_live, jnp.nan),
                            tuple(spread(c, 0.25) for c in carry_live), w, p["b_hn"], lengths,
                            reverse, implementation=implementation)
        idle_ys = jnp.max(jnp.abs(jnp.where(jnp.asarray(idle)[None, :, None], ys, 0)))
        idle_carry_off = [jnp.max(jnp.abs(jnp.where(jnp.asarray(idle)[:, None], c - 0.25, 0)))
                          for c in final]
        return ys[:, live], tuple(c[live] for c in final), idle_ys, idle_carry_off

    ys, final, idle_ys, idle_carry_off = call(p["xp"], p["carry"], w0.values)
    ref_ys, ref_final = run(cell, p["xp"], p["carry"], p["kernel"], None, p["b_hn"], reverse)
    errors = [rel_error(ys, ref_ys)] + [rel_error(c, r) for c, r in zip(final, ref_final)]
    return errors, float(idle_ys), [float(c) for c in idle_carry_off]
