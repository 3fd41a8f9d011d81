"""Which bad direct FFI calls of the CPU handlers crash on this jax? One subprocess per case."""
import subprocess, sys, textwrap, os

CASE = textwrap.dedent('''
import sys, numpy as np, jax, jax.numpy as jnp
import jax_sprnn
case = sys.argv[1]
sds = jax.ShapeDtypeStruct
rng = np.random.default_rng(0)
T, B, H = 3, 4, 8
kernel = rng.standard_normal((H, 3 * H)).astype(np.float32) * (rng.random((H, 3 * H)) < 0.5)
w = jax_sprnn.SparseWeights.from_dense(kernel)
xp = jnp.asarray(rng.standard_normal((T, B, 3 * H)), jnp.float32)
h0 = jnp.zeros((B, H), jnp.float32); b_hn = jnp.zeros((H,), jnp.float32)
lengths = jnp.full((B,), T, jnp.int32)
act = None
if case == "bad_h0": h0 = jnp.zeros((B, 7), jnp.float32)
if case == "bad_bhn": b_hn = jnp.zeros((9,), jnp.float32)
if case == "mixed": h0 = h0.astype(jnp.bfloat16)
if case == "lengths": lengths = lengths[:3]
state, seq = sds((B, H), jnp.float32), sds((T, B, H), jnp.float32)
common = (xp, lengths, w.values, w.col_idx, w.row_ptr)
try:
    if case == "activation":
        kr = jax_sprnn.SparseWeights.from_dense(kernel[:, :H])
        out = jax.ffi.ffi_call("sprnn_rnn_fwd", (seq, state))(
            xp[..., :H], lengths, kr.values, kr.col_idx, kr.row_ptr, h0, reverse=False,
            activation=5, variant=-1)
    else:
        out = jax.ffi.ffi_call("sprnn_gru_fwd", (seq, state))(
            *common, h0, b_hn, reverse=False, variant=-1)
    print("ok", float(np.asarray(out[0]).sum()))
except Exception as e:
    print("raised", type(e).__name__, str(e)[:300])
''')

print("jax", __import__("jax").__version__, "XLA_FLAGS", os.environ.get("XLA_FLAGS"))
for case in ["valid", "bad_h0", "bad_bhn", "mixed", "lengths", "activation"]:
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", CASE, case],
                       capture_output=True, text=True, timeout=120)
    lines = [l for l in (r.stdout + r.stderr).strip().splitlines() if not l.startswith("  File")]
    print(f"{case:10s} rc={r.returncode}", " | ".join(lines[-4:])[:700])
