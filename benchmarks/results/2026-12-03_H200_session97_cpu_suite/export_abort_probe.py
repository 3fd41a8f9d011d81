"""Which export-for-another-platform runs abort XLA's CPU compile on this jax? One subprocess
per case, so an abort is reported, not fatal. Arguments: plain fwd grad fwdw gradw (default the
first three); env PREC (matmul precision), DUMP (a folder for the exported modules).
Session 97: `JAX_PLATFORMS=cpu python3 export_abort_probe.py fwdw gradw` after a CPU-only build."""
import subprocess, sys, textwrap

CASE = textwrap.dedent('''
import sys, warnings
import numpy as np, jax, jax.numpy as jnp
from jax import export
import os
if os.environ.get("PREC"): jax.config.update("jax_default_matmul_precision", os.environ["PREC"])
cell, platform, what = sys.argv[1], sys.argv[2], sys.argv[3]
checks = [export.DisabledSafetyCheck.platform()]
if what == "plain":
    def f(x, h):
        def step(h, x):
            h = jnp.tanh(x + h @ jnp.ones((h.shape[-1], h.shape[-1]), h.dtype) * 0.1)
            return h, h
        return jax.lax.scan(step, h, x)
    args = (np.ones((5, 3, 4), np.float32), np.zeros((3, 4), np.float32))
    e = export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(*args)
    print("ok", [np.asarray(a).sum() for a in jax.tree.leaves(e.call(*args))])
    sys.exit(0)
import jax_sprnn as sp
rng = np.random.default_rng(0)
H, B, T, G = 5, 3, 6, {"rnn": 1, "lstm": 4, "gru": 3}[cell]
kernel = rng.standard_normal((H, G * H)).astype(np.float32) * (rng.random((H, G * H)) < 0.5)
w = sp.SparseWeights.from_dense(kernel)
xp = rng.standard_normal((T, B, G * H)).astype(np.float32)
h = np.zeros((B, H), np.float32)
carry = (h, h) if cell == "lstm" else h
lengths = np.array([6, 0, 3], np.int32)
def f(xp, carry, w):
    if cell == "rnn": return sp.rnn(xp, carry, w, seq_lengths=lengths, reverse=True)
    if cell == "lstm": return sp.lstm(xp, carry, w, seq_lengths=lengths, reverse=True)
    return sp.gru(xp, carry, w, np.zeros(H, np.float32), seq_lengths=lengths, reverse=True)
if what.endswith("w"):  # "fwdw", "gradw": the weights as an argument (traced), as the test has
    f2, args = f, (xp, carry, w)
else:  # "fwd", "grad": the weights closed over (constants)
    f2, args = (lambda xp, carry: f(xp, carry, w)), (xp, carry)
fun = f2 if what.startswith("fwd") else jax.grad(lambda *a: jnp.sum(jnp.sin(f2(*a)[0])))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    e = export.export(jax.jit(fun), platforms=[platform], disabled_checks=checks)(*args)
txt = e.mlir_module()
print("exported", len(txt), "scatter" in txt, flush=True)
if os.environ.get("DUMP"): open(f"{os.environ['DUMP']}/{what}_{cell}_{platform}.mlir", "w").write(txt)
out = e.call(*args)
print("ok", float(sum(np.asarray(a, np.float64).sum() for a in jax.tree.leaves(out))))
''')

import os
print("jax", __import__("jax").__version__, "PREC", os.environ.get("PREC"), "XLA_FLAGS", os.environ.get("XLA_FLAGS"))
for what in sys.argv[1:] or ["plain", "fwd", "grad"]:
    for cell in (["-"] if what == "plain" else ["rnn", "lstm", "gru"]):
        for platform in ["tpu", "rocm"]:
            r = subprocess.run([sys.executable, "-c", CASE, cell, platform, what],
                               capture_output=True, text=True, timeout=300)
            tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
            print(f"{what:5s} {cell:4s} {platform:4s} rc={r.returncode}", " | ".join(tail)[:600])
