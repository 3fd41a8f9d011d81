"""The CUDA kernel's placement planner (csrc/cuda/handlers.cu make_plan) for a hypothetical
H200 (132 SMs, 227 KB of shared memory per block, sm_90): host code, so it runs without a GPU
wherever the CUDA extension was built (CI builds it with nvcc).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sprnn as sp
from jax_sprnn import _ffi
from oracle import GATES

pytestmark = pytest.mark.skipif(_ffi.cuda_module is None, reason="needs _sprnn_cuda (nvcc)")

if _ffi.cuda_module is not None:
    from jax_sprnn.primitives import cuda_lowering

H200 = dict(sms=132, smem_optin=232448, cc_major=9)


def nnz_of(cell, H, density):
    """Nonzeros of a layer's (gates * H) x H recurrent matrix at this density."""
    return int(density * GATES[cell] * H * H)


def test_batch_group_plans():
    # The default's batch groups: the most that keep tiles of 4+ and <= 128 rows per block.
    for cell, H, d, B, groups, bt in [("rnn", 1152, 0.1, 4, 1, 4), ("rnn", 1152, 0.1, 8, 2, 4),
                                      ("rnn", 1152, 0.1, 16, 4, 4), ("rnn", 1152, 0.1, 64, 8, 8),
                                      ("lstm", 1024, 0.1, 64, 4, 16),
                                      ("rnn", 2304, 0.3, 64, 1, 32)]:  # too big to replicate
        info = cuda_lowering.plan(cell, jnp.float16, H, B, nnz_of(cell, H, d), variant=3, **H200)
        assert (info["groups"], info["batch_tile"]) == (groups, bt), (cell, H, B, info)
        assert info["on_chip"] and info["blocks"] == 132 // groups * groups, info


def test_cluster_plans():
    h200 = dict(H200, variant=5)
    nnz = int(0.1 * 1152 * 1152)
    info = cuda_lowering.plan("rnn", jnp.float16, 1152, 4, nnz, **h200)
    got = (info["variant"], info["cluster"], info["batch_tile"], info["blocks"])
    assert got == (5, 16, 4, 16), info
    assert info["persistent"] and info["on_chip"] and not info["reason"], info
    # LSTM H=1024 d=10% fp16 (1.7 MB of nonzeros) fits 16 CTAs; B=64 runs 4 clusters of 16.
    lstm_nnz = int(0.1 * 1024 * 4096)
    assert cuda_lowering.plan("lstm", jnp.float16, 1024, 4, lstm_nnz, **h200)["variant"] == 5
    info = cuda_lowering.plan("rnn", jnp.float16, 1152, 64, nnz, **h200)
    got = (info["variant"], info["batch_tile"], info["tiles"], info["blocks"])
    assert got == (5, 16, 4, 64), info
    # Too large for one cluster, or no clusters: the grid plan (variant 5 says why).
    big = int(0.1 * 4096 * 4 * 4096)
    info = cuda_lowering.plan("lstm", jnp.float16, 4096, 4, big, **h200)
    assert info["variant"] == 3 and "variant 5" in info["reason"], info
    info = cuda_lowering.plan("rnn", jnp.float16, 1152, 4, nnz, **dict(h200, cc_major=8))
    assert info["variant"] == 3 and "9.0" in info["reason"], info
    info = cuda_lowering.plan("rnn", jnp.float16, 1152, 4, nnz, max_cluster=8, **h200)
    assert info["cluster"] == 8, info
    # The default never picks clusters (measured slower, benchmarks/NOTES.md).
    assert cuda_lowering.plan("rnn", jnp.float16, 1152, 4, nnz, **H200)["variant"] == 3


def test_deep_gather_plans(monkeypatch):
    def deep(cell, dtype, H, B=4, d=0.1, activation="tanh"):
        info = cuda_lowering.plan(cell, dtype, H, B, nnz_of(cell, H, d), activation=activation,
                                  **H200)
        return info["deep_gather"], info

    # 16-bit: 512 threads x 8 chunks cover H units in one round; float32 only when forced.
    assert deep("rnn", jnp.float16, 5760)[0], deep("rnn", jnp.float16, 5760)[1]
    assert deep("rnn", jnp.float16, 5760, activation="relu")[0]  # two units per chunk, as many bytes
    assert not deep("rnn", jnp.float16, 1152)[0]
    assert not deep("lstm", jnp.float16, 4096)[0]  # exactly one round
    assert not deep("rnn", jnp.float16, 2304, d=0.3)[0]
    assert not deep("rnn", jnp.float32, 4608)[0]  # measured no gain for float32
    assert not deep("rnn", jnp.float16, 5760, B=1)[0]  # tile 1: no deep build
    monkeypatch.setenv("SPRNN_CUDA_DEEP_GATHER", "0")
    assert not deep("rnn", jnp.float16, 5760)[0]
    monkeypatch.setenv("SPRNN_CUDA_DEEP_GATHER", "1")
    assert deep("rnn", jnp.float16, 1152)[0]
    assert deep("rnn", jnp.float32, 4608)[0]


def test_reg_weights_plans(monkeypatch):
    def reg(cell, dtype, H, B=4, d=0.1, activation="tanh"):
        info = cuda_lowering.plan(cell, dtype, H, B, nnz_of(cell, H, d), activation=activation,
                                  **H200)
        return info["reg_weights"], info

    # 16-bit tile 4 where a lane's share of a row is more than 3.5 nonzeros (the kernel's rows
    # per lane: half warps when a block has 17..32 rows, else whole warps).
    for cell, H, d in [("lstm", 1024, 0.1), ("gru", 1024, 0.1), ("rnn", 2304, 0.3),
                       ("lstm", 4096, 0.1), ("rnn", 1152, 0.1), ("rnn", 2304, 0.05)]:
        got, info = reg(cell, jnp.float16, H, d=d)
        assert got, (cell, H, d, info)
        assert reg(cell, jnp.bfloat16, H, d=d)[0], (cell, H, d)
    assert not reg("rnn", jnp.float16, 1024)[0]  # 102-nonzero rows, whole warps: 3.2 per lane
    assert not reg("rnn", jnp.float16, 1152, d=0.05)[0]
    assert not reg("lstm", jnp.float32, 1024)[0]  # 16-bit weights only
    assert not reg("rnn", jnp.float16, 5760)[0]  # the deep build holds its gather there
    got, info = reg("rnn", jnp.float16, 5760, activation="relu")  # but ReLU's has room
    assert got and info["deep_gather"] and not info["float_words"], info
    assert not reg("lstm", jnp.float16, 1024, B=1)[0]  # tile 1: no register build
    # Two batch groups of tile 4 on 66 blocks each: ReLU H=1152 then has 17-18 rows per block
    # (half warps, 7.2 per lane), LSTM H=1024 62 (whole warps, 3.2 per lane).
    assert reg("rnn", jnp.float16, 1152, B=8)[0]
    assert not reg("lstm", jnp.float16, 1024, B=8)[0]
    monkeypatch.setenv("SPRNN_CUDA_REG_WEIGHTS", "0")
    assert not reg("lstm", jnp.float16, 1024)[0]
    monkeypatch.setenv("SPRNN_CUDA_REG_WEIGHTS", "1")
    assert reg("rnn", jnp.float16, 1152)[0]
    assert not reg("rnn", jnp.float32, 1152)[0]
    monkeypatch.setenv("SPRNN_CUDA_DEEP_GATHER", "1")
    assert not reg("rnn", jnp.float16, 1152)[0]


def test_float_words_plans(monkeypatch):
    def plan(cell, dtype, H, B=4, d=0.1):
        return cuda_lowering.plan(cell, dtype, H, B, nnz_of(cell, H, d), **H200)

    # The register build's float words (8 bytes per nonzero) where the layer stays on chip.
    for cell, H, d in [("lstm", 1024, 0.1), ("gru", 1024, 0.1), ("rnn", 2304, 0.3)]:
        for dtype in (jnp.float16, jnp.bfloat16):
            info = plan(cell, dtype, H, d=d)
            assert info["reg_weights"] and info["float_words"] and info["on_chip"], info
            assert info["smem_bytes"] <= H200["smem_optin"], info
            monkeypatch.setenv("SPRNN_CUDA_FLOAT_WORDS", "0")
            packed = plan(cell, dtype, H, d=d)
            monkeypatch.delenv("SPRNN_CUDA_FLOAT_WORDS")
            assert packed["reg_weights"] and not packed["float_words"], packed
            # Half as many 8-byte words as 4-byte ones fit in the same bytes (minus alignment).
            cap, cap4 = info["nnz_per_block_capacity"], packed["nnz_per_block_capacity"]
            assert abs(2 * cap - cap4) <= 4, (cap, cap4)
    # Two batch groups on 66 blocks each (register build, half warps): still on chip.
    info = plan("rnn", jnp.float16, 1152, B=8)
    assert info["float_words"] and info["groups"] == 2 and info["blocks"] == 132, info
    # LSTM H=4096 fills shared memory with 4-byte words: no float words.
    info = plan("lstm", jnp.float16, 4096)
    assert info["reg_weights"] and not info["float_words"], info
    for args in [("rnn", jnp.float16, 1024), ("rnn", jnp.float16, 5760),
                 ("lstm", jnp.float16, 1024, 1)]:
        assert not plan(*args)["float_words"], args  # no register build
    for args in [("lstm", jnp.float32, 1024), ("rnn", jnp.float32, 1152, 64),
                 ("rnn", jnp.float32, 4608)]:
        assert plan(*args)["float_words"], args  # float32: 8-byte words either way
    monkeypatch.setenv("SPRNN_CUDA_FLOAT_WORDS", "1")  # forced: even where nonzeros spill
    info = plan("lstm", jnp.float16, 4096)
    assert info["float_words"] and not info["on_chip"], info
    monkeypatch.setenv("SPRNN_CUDA_REG_WEIGHTS", "0")
    assert not plan("lstm", jnp.float16, 1024)["float_words"]


def test_offset_words_plans(monkeypatch):
    def plan(cell, dtype, H, B=4, d=0.1, **kw):
        return cuda_lowering.plan(cell, dtype, H, B, nnz_of(cell, H, d), **H200, **kw)

    # The 16-bit tile-4 builds of 4-byte words take offset words while every unit's byte
    # offset in the tile (8 bytes a unit) fits 16 bits: H <= 8192.
    for args, kw in [(("rnn", jnp.float16, 5760), {"activation": "relu"}),  # deep + register
                     (("rnn", jnp.bfloat16, 5760), {}),  # deep
                     (("lstm", jnp.float16, 4096), {}),  # register
                     (("rnn", jnp.float16, 1024), {}),  # plain (3.2 nonzeros per lane)
                     (("gru", jnp.bfloat16, 8192, 4, 0.02), {})]:
        info = plan(*args, **kw)
        assert info["batch_tile"] == 4 and info["offset_words"], (args, info)
        assert not info["float_words"], (args, info)
    for args, kw in [(("rnn", jnp.float16, 8193, 4, 0.02), {"activation": "relu"}),
                     (("lstm", jnp.bfloat16, 9000, 4, 0.01), {})]:
        info = plan(*args, **kw)
        assert info["batch_tile"] == 4 and not info["offset_words"], (args, info)
    # Not beside float words (8-byte words hold the offset already), not for float32, not for
    # other tiles, not for the tensor-core rows (which keep no words).
    info = plan("lstm", jnp.float16, 1024)
    assert info["float_words"] and not info["offset_words"], info
    assert not plan("rnn", jnp.float32, 1152)["offset_words"]
    assert not plan("rnn", jnp.float16, 1152, B=1)["offset_words"]
    info = plan("rnn", jnp.float16, 2304, d=0.3, activation="relu")
    assert info["mma"] and not info["offset_words"], info
    # Same bytes per nonzero: the same capacity either way.
    monkeypatch.setenv("SPRNN_CUDA_OFFSET_WORDS", "0")
    column = plan("lstm", jnp.float16, 4096)
    monkeypatch.delenv("SPRNN_CUDA_OFFSET_WORDS")
    offset = plan("lstm", jnp.float16, 4096)
    assert not column["offset_words"] and offset["offset_words"]
    assert column["nnz_per_block_capacity"] == offset["nnz_per_block_capacity"]


def test_partition_room(monkeypatch):
    # A unit costs its average nonzeros in the block partition, so no block can get more than
    # twice the average units: shared memory is reserved for that many (units_cap), not three
    # times as many, and LSTM H=4096 10% fp16 fits wholly on chip at batch tile 2 (it did not).
    for cell, H, d in [("rnn", 1152, 0.1), ("lstm", 1024, 0.1), ("lstm", 4096, 0.1),
                       ("gru", 777, 0.0), ("rnn", 5760, 0.01)]:
        info = cuda_lowering.plan(cell, jnp.float16, H, 4, nnz_of(cell, H, d), **H200)
        per_group = info["blocks"] // info["groups"]
        assert info["units_cap"] <= 2 * H // per_group + 3, (cell, H, d, info)
    monkeypatch.setenv("SPRNN_CUDA_BT", "2")
    info = cuda_lowering.plan("lstm", jnp.float16, 4096, 4, nnz_of("lstm", 4096, 0.1), **H200)
    assert info["batch_tile"] == 2 and info["on_chip"] and not info["reason"], info


def test_partial_fit_tiles():
    # A layer that does not fit on chip at the tile that holds its batch keeps that tile and
    # reads the rest from L2 (smaller tiles, run in turn, measured up to 2.9x slower), unless a
    # smaller tile holds the whole layer and the large one keeps < 7/8 (float32) or < 1/4
    # (16-bit) on chip. The warning (reason) only where no tile would hold the layer.
    for cell, H, B, d, dtype, bt, on_chip, warned in [
            ("lstm", 4096, 4, 0.1, jnp.float16, 4, False, False),   # 92% at 4, 100% at 2
            ("rnn", 20000, 4, 0.01, jnp.float16, 4, False, False),  # 49% at 4, 100% at 2
            ("lstm", 2048, 4, 0.3, jnp.float32, 4, False, True),    # 60% at 4, 68% at 1
            ("lstm", 1024, 8, 1.0, jnp.float32, 8, False, True),    # 68% at 8, 79% at 1
            ("rnn", 12000, 4, 0.01, jnp.float32, 2, True, False),   # 37% at 4, 100% at 2
            ("rnn", 7000, 4, 0.05, jnp.float32, 2, True, False)]:   # 76% at 4, 100% at 2
        info = cuda_lowering.plan(cell, dtype, H, B, nnz_of(cell, H, d), **H200)
        got = (info["batch_tile"], info["tiles"], info["on_chip"], bool(info["reason"]))
        assert got == (bt, (B + bt - 1) // bt, on_chip, warned), (cell, H, B, d, info)
        if warned:
            assert "do not fit on chip" in info["reason"], info


def test_w_cap_knob(monkeypatch):
    # SPRNN_CUDA_W_CAP (the GPU tests' way to run rows from L2 in every build) lowers the room
    # for nonzeros only: the tile and blocks stay, and no warning (a tile would hold the layer).
    nnz = nnz_of("rnn", 1152, 0.1)
    base = cuda_lowering.plan("rnn", jnp.float16, 1152, 4, nnz, **H200)
    assert base["on_chip"] and base["nnz_per_block_capacity"] > 300, base
    for cap in (0, 300):
        monkeypatch.setenv("SPRNN_CUDA_W_CAP", str(cap))
        info = cuda_lowering.plan("rnn", jnp.float16, 1152, 4, nnz, **H200)
        assert info["nnz_per_block_capacity"] == cap and not info["on_chip"], info
        assert (info["batch_tile"], info["blocks"], info["reason"]) == (4, 132, ""), info
    monkeypatch.setenv("SPRNN_CUDA_W_CAP", str(10 ** 9))  # above the room: no change
    assert cuda_lowering.plan("rnn", jnp.float16, 1152, 4, nnz, **H200) == base


def test_tensor_core_row_plans(monkeypatch):
    # The tensor-core rows (handlers.cu, mma_rows.cuh): 16-bit ReLU layers with >= 8.5K
    # nonzeros per block whose blocks average 12-22 rows, batch tile 4, sm_80+, sync check on.
    def mma(H=2304, d=0.3, B=4, dtype=jnp.float16, activation="relu", **gpu):
        info = cuda_lowering.plan("rnn", dtype, H, B, nnz_of("rnn", H, d), variant=3,
                                  activation=activation, **dict(H200, **gpu))
        if info["mma"]:
            assert info["persistent"] and info["on_chip"] and info["threads"] == 512, info
            assert not (info["reg_weights"] or info["deep_gather"] or info["float_words"]), info
        return info["mma"]

    assert mma() and mma(dtype=jnp.bfloat16) and mma(H=2500, d=0.5) and mma(B=3)
    assert not mma(activation="tanh") and not mma(dtype=jnp.float32)
    assert mma(H=2048, d=0.5) and mma(H=1536, d=0.5)  # 16 and 12 rows per block
    assert not mma(d=0.2) and not mma(H=1536) and not mma(H=1152, d=0.5)  # < 8.5K per block
    assert not mma(H=1152, d=1.0) and not mma(H=3072)  # rows off range (9 and 24 per block)
    assert not mma(B=8) and not mma(B=2) and not mma(cc_major=7)
    assert not cuda_lowering.plan("lstm", jnp.float16, 1024, 4, nnz_of("lstm", 1024, 0.3),
                                  **H200)["mma"]
    monkeypatch.setenv("SPRNN_CUDA_MMA", "1")  # wherever the build fits
    assert mma(H=1152, d=0.1) and mma(H=33, d=1.0) and not mma(H=3200) and not mma(B=8)
    monkeypatch.setenv("SPRNN_CUDA_SYNC_CHECK", "0")  # no rerun possible: never
    assert not mma()
    monkeypatch.setenv("SPRNN_CUDA_SYNC_CHECK", "1")
    monkeypatch.setenv("SPRNN_CUDA_MMA", "0")
    assert not mma()


def _export_for_cuda(steps=5):
    """Lowers a small ReLU layer for CUDA (no GPU needed): runs the CUDA lowering's checks.

    The layer fits any GPU: no performance warning (on a machine without a GPU the lowering
    used to plan for "a GPU without cooperative launches" and warn of the per-step fallback).
    """
    from jax import export  # noqa: PLC0415

    w = sp.SparseWeights.from_dense(np.eye(8, dtype=np.float16))
    f = jax.jit(lambda xp, h0: sp.rnn(xp, h0, w, activation="relu"))
    checks = [export.DisabledSafetyCheck.custom_call(f"sprnn_rnn_{kind}")
              for kind in ("fwd", "step")]
    with warnings.catch_warnings():
        warnings.simplefilter("error", cuda_lowering.SparseRNNPerformanceWarning)
        return export.export(f, disabled_checks=checks, platforms=("cuda",))(
            jnp.zeros((steps, 4, 8), jnp.float16), jnp.zeros((4, 8), jnp.float16))


@pytest.mark.parametrize("name,bad,good", [
    ("SPRNN_CUDA_TIMEOUT_MS", "-1", "0"),  # negative: the handler's waits had no bound at all
    ("SPRNN_CUDA_TIMEOUT_MS", "5s", " 2500"),  # text: the handler took 5000 without a word
    ("SPRNN_CUDA_SYNC_CHECK", "off", "0"),
    ("SPRNN_CUDA_MMA", "2", "-1"),
    ("SPRNN_CUDA_BT", "3", "16"),  # a tile the planner has not: ignored before
    ("SPRNN_CUDA_VARIANT", "6", "+3"),
    ("SPRNN_CUDA_STEP_STAGED", "4", "3"),
])
def test_documented_knobs_are_checked_at_lowering(monkeypatch, name, bad, good):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"{name}='{bad}': expected"):
        _export_for_cuda()
    monkeypatch.setenv(name, good)
    assert "sprnn_rnn_fwd" in _export_for_cuda().mlir_module()


def test_export_for_cuda_on_a_machine_without_a_gpu_warns_nothing():
    _export_for_cuda()  # a performance warning is an error inside


def test_one_step_calls_do_not_warn_of_the_plan(monkeypatch):
    # A call of one step runs a single launch of the per-step kernel (handlers.cu), never the
    # plan: the planner's performance warning would be wrong there. As if on a GPU whose plan
    # for this layer had a reason to warn:
    reason = f"a reason to warn ({id(monkeypatch)})"  # once per test run (warn_once)
    monkeypatch.setattr(cuda_lowering, "_local_gpu", lambda: True)
    monkeypatch.setattr(cuda_lowering, "plan",
                        lambda *a, **k: {"reason": reason, "persistent": True})
    _export_for_cuda(steps=1)  # a performance warning is an error inside
    with pytest.raises(cuda_lowering.SparseRNNPerformanceWarning, match="a reason to warn"):
        _export_for_cuda(steps=2)


@pytest.mark.parametrize("steps,variant,target", [
    (1, None, "sprnn_rnn_step"), (2, None, "sprnn_rnn_fwd"), (1, "4", "sprnn_rnn_fwd"),
    (1, "3", "sprnn_rnn_fwd")])
def test_one_step_calls_lower_to_the_step_target(monkeypatch, steps, variant, target):
    # Calls of one step with the default variant go to the target registered for XLA's command
    # buffers, with no workspace result; every other call to the fwd target and its workspace.
    if variant is not None:
        monkeypatch.setenv("SPRNN_CUDA_VARIANT", variant)
    text = _export_for_cuda(steps=steps).mlir_module()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and f"@{target}(" in calls[0], calls
    workspace = "xui8>" in calls[0].split("->")[-1]
    assert workspace == (target == "sprnn_rnn_fwd"), calls[0]


def test_step_targets_are_registered_for_command_buffers():
    # What XLA reads to capture a call in a CUDA graph; the fwd targets sync and must not be.
    assert _ffi.COMMAND_BUFFER_TARGETS == {f"sprnn_{c}_step" for c in GATES}
    assert _ffi.COMMAND_BUFFER_TARGETS <= _ffi.CUDA_TARGETS
