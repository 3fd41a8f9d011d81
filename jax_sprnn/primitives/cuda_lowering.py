"""CUDA lowering of the forward primitive onto the sparse persistent kernel (csrc/cuda/).

Owned by the kernel work: it decides the kernel variant, the workspace the kernel needs and
the fallback when a layer does not fit on chip. ``forward_lowering`` is registered for the
"cuda" platform by jax_sprnn/primitives/lowering.py when the CUDA extension is built.

Variants (the ``variant`` attribute, see benchmarks/NOTES.md for their measured effect):

====  =====================================================================================
 -1   default: the fastest, 3
  0   (a) naive sparse persistent: h in shared memory batch-major, one scalar load per batch
      value, grid-wide barrier between steps
  1   (b) + wide loads: the batch tile of a hidden unit is contiguous, one vector load
  2   (c) + bank-aware order: same kernel as 1; the effect comes from packing the weights
      with ``bank_period > 0`` (the default of ``SparseWeights.from_dense``)
  3   (d) + Lamport exchange: value + step tag in one word, readers spin, no grid barrier
  4   fallback: one non-persistent sparse kernel launch per step (always works)
  5   Hopper clusters (sm_90+, opt-in, csrc/cuda/cluster_kernel.cuh): one thread block
      cluster of up to 16 CTAs per batch tile (1-16 sequences) holds all nonzeros in its
      shared memory; h_t goes into every CTA's shared memory by st.async, each store
      counted on the receiver's mbarrier. No grid-wide exchange, no co-residency needed
      beyond the cluster. Correct, but measured 1.05-4x slower than 3 on the H200 (16 SMs
      instead of 132 do the rows), so the default never picks it. Falls back to 3 (with a
      warning) when the layer does not fit one cluster
====  =====================================================================================

A call of one step (T = 1) with the default variant runs neither: it lowers to the
``sprnn_<cell>_step`` target, one launch of variant 4's per-step kernel that reads h0 / c0 and
writes hT / cT itself, with no workspace and no per-call sync (it has no wait to bound). In a
jitted loop of one-step calls (sampling) the persistent kernel's launch, prologue and sync cost
more than the step (benchmarks/decode_loop.py, benchmarks/NOTES.md session 81). The step
targets are registered as compatible with XLA's command buffers, so XLA may capture them in a
CUDA graph with the rest of the loop body (with ``--xla_gpu_enable_command_buffer`` including
WHILE, the whole loop; benchmarks/NOTES.md session 82).

The kernel itself falls back to variant 4 when the layer's hidden state tile cannot be held in
one block's shared memory or the GPU cannot launch a cooperative grid, and streams from L2 the
nonzeros that do not fit on chip. Both cases warn once (``SparseRNNPerformanceWarning``; the
second only when no batch tile would hold the whole layer).

Batch tiles: 1, 2, 4, 8, 16, 32 or 64 sequences per exchange round, the smallest that holds
the batch unless its h tile does not fit in shared memory, whatever share of the nonzeros it
leaves for L2 (smaller tiles, run in turn, hold more of them but measured slower: up to 2.9x,
benchmarks/NOTES.md session 24), except that a smaller tile that holds the whole layer wins
where the large one keeps less than 7/8 (float32) or 1/4 (16-bit) of the nonzeros on chip;
tiles of 16 to 64 share each nonzero between several lanes. From B = 8 on
(default variant), batch groups: the batch splits into the most tiles of >= 4 sequences that
run at once, each on its own blocks holding the whole layer (at most 128 rows per block);
without them every block runs every tile in turn. Threads per
block: a warp per row of the block plus three, 8 to 16 warps (the kernel is built for 512);
where a block has more rows than warps but at most twice as many, each warp takes two rows
side by side (half a warp each). With a batch tile of 4, a 16-bit layer whose gather of h needs
more than one round of loads per thread (H > 4096 at 512 threads) runs a build with twice the
h bytes in flight per thread (the plan's ``deep_gather``; float32 only when forced); otherwise
a 16-bit layer whose rows give each lane more than 4 nonzeros runs a build that keeps each
lane's first 8 weights of its first row in registers (``reg_weights``), and where the layer
still fits on chip with 8 bytes per nonzero, that build keeps each nonzero in shared memory as
its float32 value and the byte offset of its unit's h values (``float_words``: no unpacking in
the row loop; float32 layers always store their nonzeros so). The other 16-bit builds at a
batch tile of 4 keep each nonzero in 4 bytes, its 16-bit value beside the byte offset of its
unit's h values where every offset fits 16 bits (``offset_words``: H <= 8192; one instruction
less per nonzero than a column index: kernel time LSTM H=4096 -1.6%, H=5760 tanh and bf16 ReLU
-1%, fp16 ReLU unchanged), else beside its column. On sm_80+, a 16-bit ReLU layer
at a batch tile of 4 with at least 8.5K nonzeros per block whose blocks average 12-22 rows (H
about 1600-2900 on 132 SMs, from 50% density at H=1536 and 25% at H=2304) runs its rows on the
tensor cores instead (``mma``: the block's rows as a dense tile whose ``mma.sync`` fragments
stay in registers, so a step costs the same at any density). Step probe, fp16, B=4, us/step
sparse / tensor-core: ReLU H=2304 30% 2.65 / 2.30, 50% 3.33 / 2.63, 20% 2.33 / 2.28, 15% 2.16 /
2.28; H=2048 30% 2.15 / 2.14, 50% 2.57 / 2.15; H=1536 50% 2.08 / 1.97, 30% 1.82 / 1.96; H=1152
50% 1.80 / 1.93, 10% 1.53 / 1.89. ``SPRNN_CUDA_MMA=0/1`` forces them off / on wherever the
build fits. They need the sync check: a call whose hidden state becomes inf or NaN (a dense
tile would multiply it by pruned zeros), or whose pattern gives a block more than 24 rows, runs
again on the sparse rows, exactly (so a diverging layer costs both kernels), with a one-time
message on stderr. The 16-bit cells use the hardware tanh
(``tanh.approx.f32``, relative error about 2^-11, the rounding of a 16-bit result) for tanh
and sigmoid on sm_75+, and exp2 / reciprocal forms on sm_70; float32 uses CUDA's accurate
expf / tanhf and a reciprocal refined by one Newton step in the sigmoid (about 1 ulp).
Run-time knobs read by the handler at each call (benchmarks): ``SPRNN_CUDA_BT`` (forced tile,
no batch groups), ``SPRNN_CUDA_GROUPS`` (n forces n batch groups, 1 none),
``SPRNN_CUDA_BLOCKS``, ``SPRNN_CUDA_THREADS`` (at most 512),
``SPRNN_CUDA_MMA=0/1`` (tensor-core rows off / on wherever they fit, above),
``SPRNN_CUDA_COL_FILTER=0`` (tiles >= 16 gather every h unit, not only those their rows read),
``SPRNN_CUDA_SPIN_NS``, ``SPRNN_CUDA_TIMEOUT_MS``, ``SPRNN_CUDA_SYNC_CHECK``,
``SPRNN_CUDA_TEST_STALL=1`` (tests: the grid barrier of variants 0-2 never opens, so its waits
time out),
``SPRNN_CUDA_CLUSTER`` (largest cluster size for variant 5, default 16),
``SPRNN_CUDA_ROW_LANES`` (lanes per row; variants 0-4: 16 or 32 forces half or whole warps,
variant 5: default from the row length), ``SPRNN_CUDA_DEEP_GATHER`` (0 / 1 forces the deep
gather off / on for batch tiles of 4), ``SPRNN_CUDA_REG_WEIGHTS`` (0 / 1 forces the register
weights off / on for 16-bit batch tiles of 4 without the deep gather), ``SPRNN_CUDA_FLOAT_WORDS``
(0 turns the 16-bit float words off, 1 forces them beside the register weights even where
nonzeros then stay in L2), ``SPRNN_CUDA_OFFSET_WORDS`` (0 turns the offset words off:
column words), ``SPRNN_CUDA_W_CAP`` (tests: at most this many words of nonzeros
and row offsets per block on chip, so the rest run from L2),
``SPRNN_CUDA_STEP_STAGED`` (the per-step kernel of one-step calls, variant 4 and layers off chip:
0 never copies h into shared memory, 1 does where that wins, on large layers, 2 wherever the
copy fits in the block's opt-in shared memory, 226 KB on the H200, with the blocks looping over
chunks of units, 3 the same with each warp whole units).
``SPRNN_CUDA_VARIANT`` selects a variant for calls made with the default one.
"""

from __future__ import annotations

import functools
import os
import re
import warnings

import jax
import numpy as np
from jax import core as jcore

from jax_sprnn import _ffi
from jax_sprnn.primitives.recurrence import CELLS

VARIANTS = {"default": -1, "naive": 0, "wide": 1, "bank_aware": 2, "lamport": 3, "step_loop": 4,
            "cluster": 5}
_DTYPE_CODES = {np.dtype("float32"): 0, np.dtype(jax.numpy.bfloat16): 1, np.dtype("float16"): 2}
_warned: set = set()


class SparseRNNPerformanceWarning(UserWarning):
    """The CUDA kernel runs a slower path than the on-chip persistent one for this layer."""


def available(cell: str) -> bool:
    return f"sprnn_{cell}_fwd" in _ffi.CUDA_TARGETS


def plan(cell: str, dtype, hidden: int, batch: int, nnz: int, variant: int = -1,
         sms: int = 0, smem_optin: int = 0, cc_major: int = 0, max_cluster: int = 0,
         activation: str = "tanh") -> dict:
    """The kernel's placement plan for a layer on the current GPU (or a hypothetical one:
    ``sms`` > 0 with ``smem_optin``, ``cc_major`` and ``max_cluster``, 0 = 16 on cc >= 9).
    ``activation`` ("tanh" or "relu") matters for rnn layers: ReLU layers' deep-gather build
    has register weights too (``reg_weights``).

    Keys include ``persistent`` (False: per-step fallback), ``variant``, ``cluster`` (CTAs per
    cluster, 0 = grid plan), ``on_chip``, ``batch_tile``, ``tiles``, ``groups`` (> 1: the
    tiles run at once, each on blocks / groups blocks), ``deep_gather`` (the tile-4 kernel with
    twice the h bytes in flight per thread, for layers whose gather needs more),
    ``reg_weights`` (the tile-4 kernel with each lane's first weights in registers),
    ``float_words`` (nonzeros in shared memory as 8-byte float32 value + h offset),
    ``offset_words`` (4-byte words of a 16-bit value + h offset instead of its column), ``mma``
    (the rows on the tensor cores: dense 16-bit ReLU layers, see the module doc), ``blocks``,
    ``nnz_per_block_capacity``, ``smem_bytes``, ``workspace_bytes`` and ``reason``. On the
    device the handler may still re-plan a cluster plan for a smaller launchable cluster.
    """
    return _ffi.cuda_module.plan(CELLS[cell].gates, _DTYPE_CODES[np.dtype(dtype)], int(hidden),
                                 int(batch), int(nnz), int(variant), int(sms), int(smem_optin),
                                 int(cc_major), int(max_cluster),
                                 cell == "rnn" and activation == "relu")


# The knobs README documents, with the values the handler acts on. The handler reads them at
# each call and takes its default for text it cannot parse (and ignores other tiles), so a
# user's typo would be dropped without a word: the lowering refuses it instead.
USER_KNOBS = {
    "SPRNN_CUDA_TIMEOUT_MS": range(0, 3600001),  # the bound of every wait, in ms
    "SPRNN_CUDA_SYNC_CHECK": (0, 1),
    "SPRNN_CUDA_MMA": (-1, 0, 1),  # -1: the planner's choice
    "SPRNN_CUDA_BT": (0, 1, 2, 4, 8, 16, 32, 64),  # 0: the planner's choice
    "SPRNN_CUDA_VARIANT": tuple(sorted(VARIANTS.values())),
    # the staged per-step kernels: off, where they win, by unit chunks or by warp tasks forced
    "SPRNN_CUDA_STEP_STAGED": (0, 1, 2, 3),
}


def check_user_knobs() -> None:
    """A clear error for a documented knob set to a value the handler would not act on."""
    for name, allowed in USER_KNOBS.items():
        text = os.environ.get(name, "")
        if text == "":
            continue
        # What the handler's strtoll accepts: optional leading space and sign, then digits.
        value = int(text) if re.fullmatch(r"\s*[+-]?\d+", text) else None
        if value is None or value not in allowed:
            expected = (f"an integer in [{allowed.start}, {allowed.stop - 1}]"
                        if isinstance(allowed, range)
                        else "one of " + ", ".join(map(str, allowed)))
            raise ValueError(f"environment variable {name}={text!r}: expected {expected}")


@functools.cache
def _local_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # no GPU backend in this process
        return False


def warn_once(key, message, category=SparseRNNPerformanceWarning):
    """Warns the first time ``key`` comes (a lowering runs again at every trace)."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, category, stacklevel=3)


def forward_lowering(ctx, *operands, cell: str, reverse: bool, activation: int, variant: int):
    """Lowers the forward primitive to the CUDA FFI target; results as the primitive's outputs."""
    xp_aval = ctx.avals_in[0]
    values_aval = ctx.avals_in[2]
    steps, batch, gh = xp_aval.shape
    if not isinstance(batch, (int, np.integer)):  # jax.export with a symbolic batch
        raise ValueError(f"the CUDA kernel needs a concrete batch size (its workspace and plan "
                         f"depend on it), got the symbolic dimension {batch}; export with a "
                         "concrete batch (a symbolic number of steps works)")
    gates = CELLS[cell].gates
    hidden = gh // gates
    nnz = values_aval.shape[0]
    dtype_code = _DTYPE_CODES[np.dtype(xp_aval.dtype)]
    check_user_knobs()
    variant = int(variant)
    if variant == -1:  # benchmarks select a variant for the public API through the environment
        variant = int(os.environ.get("SPRNN_CUDA_VARIANT", "").strip() or -1)
    # A call of one step runs a single launch of the per-step kernel, not the plan
    # (csrc/cuda/handlers.cu): nothing to warn about.
    one_step = isinstance(steps, (int, np.integer)) and steps == 1 and variant == -1
    info = None
    if _local_gpu() and not one_step:  # else an export for a GPU elsewhere: nothing to plan for
        try:
            info = plan(cell, xp_aval.dtype, hidden, batch, nnz, variant,
                        activation="relu" if activation else "tanh")
        except Exception:  # noqa: BLE001 - planning is advisory; the handler re-plans at run time
            info = None
    if info is not None and info["reason"] and variant != VARIANTS["step_loop"]:
        warn_once((cell, str(xp_aval.dtype), hidden, batch, nnz, info["reason"]),
                   f"jax_sprnn CUDA {cell} (H={hidden}, B={batch}, nnz={nnz}, "
                   f"{xp_aval.dtype}): {info['reason']}"
                   + ("" if info["persistent"] else "; running the per-step fallback kernel"))
    attrs = dict(reverse=bool(reverse), variant=np.int64(variant))
    if cell == "rnn":
        attrs["activation"] = np.int64(activation)
    if one_step:  # the target XLA may put in a command buffer; it needs no workspace
        return jax.ffi.ffi_lowering(f"sprnn_{cell}_step")(ctx, *operands, **attrs)
    ws_bytes = int(_ffi.cuda_module.workspace_bytes(gates, dtype_code, hidden, batch))
    ws_aval = jcore.ShapedArray((ws_bytes,), np.uint8)
    ctx2 = ctx.replace(avals_out=[*ctx.avals_out, ws_aval])
    results = jax.ffi.ffi_lowering(f"sprnn_{cell}_fwd")(ctx2, *operands, **attrs)
    return results[:-1]
