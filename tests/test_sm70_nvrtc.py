"""The CUDA kernel source stays compilable for sm_70 (V100) by CUDA 12.

CUDA 13 (this project's nvcc) dropped sm_70, so CI compiles the header-only kernel core
(csrc/cuda/kernel_core.cuh and the headers it includes) with NVRTC 12 from PyPI, on a
CPU-only machine:

    python -m pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12
    python -m pytest tests/test_sm70_nvrtc.py

Every kernel instantiation the handlers use is compiled to sm_70 machine code (cubin), which
also runs ptxas for sm_70. Skips when NVRTC 12 is not installed.
"""

import ctypes
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")


def _nvrtc12():
    try:
        import nvidia.cuda_nvrtc  # noqa: PLC0415
    except ImportError:
        return None
    for base in list(getattr(nvidia.cuda_nvrtc, "__path__", [])):
        libs = sorted(glob.glob(os.path.join(base, "lib", "libnvrtc.so.12*")))
        if libs:
            return ctypes.CDLL(libs[0])
    return None


LIB = _nvrtc12()
pytestmark = pytest.mark.skipif(LIB is None, reason="NVRTC 12 (pip nvidia-cuda-nvrtc-cu12) "
                                                    "is not installed")

CELLS = ["kRnnTanh", "kLstm", "kGru"]
RELU = "kRnnRelu"  # ReLU's own wide builds (launch.cuh: sign-tagged exchange words)
DTYPES = {d: (1, 2, 4, 8, 16, 32, 64) for d in ("kF32", "kBF16", "kF16")}


def instantiations(cell):
    """The instantiations of one cell: one NVRTC program per cell, so that the four compile in
    parallel under pytest-xdist (all in one program took ~11 minutes on a slow 2-core machine)."""
    names = []
    words = "sprnn::cuda::Words::"
    for dt, tiles in DTYPES.items():
        persistent = f"sprnn::cuda::persistent_fwd<sprnn::Cell::{cell}, sprnn::cuda::DType::{dt}, "
        # float32: float words; 16-bit: column words, and offset words for the tile-4
        # builds of 4-byte words (launch.cuh)
        fw = words + ("kFloat" if dt == "kF32" else "kColumn")
        names += [f"{persistent}{bt}, true, false, 0, {fw}>" for bt in tiles]
        names.append(f"{persistent}4, true, true, 0, {fw}>")  # deep gather
        if dt != "kF32":  # register weights (launch.cuh: 16-bit), offset words
            names += [f"{persistent}4, true, false, sprnn::cuda::kRegWeights, {words}{w}>"
                      for w in ("kColumn", "kOffset", "kFloat")]
            names += [f"{persistent}4, true, {deep}, 0, {words}kOffset>"
                      for deep in ("false", "true")]
        if cell == RELU:
            continue  # ReLU runs kRnnTanh's naive, cluster and per-step builds
        names.append(f"{persistent}4, false>")
        for bt in (1, 2, 4, 8, 16):  # the sm_90 cluster kernel compiles to a stub here
            names.append(f"sprnn::cuda::cluster_fwd<sprnn::Cell::{cell}, "
                         f"sprnn::cuda::DType::{dt}, {bt}>")
        for k in ("step_init", "step_final"):
            names.append(f"sprnn::cuda::{k}<sprnn::Cell::{cell}, sprnn::cuda::DType::{dt}>")
        # the per-step kernel for each column count (step_kernels.cuh step_kernel), also as a
        # call of one step (T = 1) in one launch
        names += [f"sprnn::cuda::{k}<sprnn::Cell::{cell}, sprnn::cuda::DType::{dt}, "
                  f"{one}, {cols}>" for k in ("step_fwd", "step_fwd_staged", "step_fwd_tasks")
                  for one in ("false", "true") for cols in (1, 4, 8)]
    return names


def _check(rc, prog=None):
    if rc != 0:
        msg = ctypes.c_char_p(LIB.nvrtcGetErrorString(rc)).value.decode()
        log = ""
        if prog is not None:
            size = ctypes.c_size_t()
            LIB.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            LIB.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
        raise AssertionError(f"NVRTC error {msg}\n{log}")


@pytest.mark.parametrize("cell", CELLS + [RELU])
def test_kernel_core_compiles_for_sm70(cell):
    LIB.nvrtcGetErrorString.restype = ctypes.c_char_p
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(LIB.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
    assert major.value == 12, f"expected NVRTC 12, got {major.value}.{minor.value}"
    src = b'#include "cuda/kernel_core.cuh"\n#include "cuda/cluster_kernel.cuh"\n'
    prog = ctypes.c_void_p()
    _check(LIB.nvrtcCreateProgram(ctypes.byref(prog), src, b"sm70_check.cu", 0, None, None))
    names = instantiations(cell)
    for n in names:
        _check(LIB.nvrtcAddNameExpression(prog, n.encode()))
    opts = [b"--gpu-architecture=sm_70", b"-std=c++17", f"-I{CSRC}".encode(),
            b"-default-device"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    _check(LIB.nvrtcCompileProgram(prog, len(opts), arr), prog)
    size = ctypes.c_size_t()
    _check(LIB.nvrtcGetCUBINSize(prog, ctypes.byref(size)), prog)
    assert size.value > 10000
    for n in names:  # every instantiation was emitted
        lowered = ctypes.c_char_p()
        _check(LIB.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(lowered)), prog)
        assert lowered.value
    LIB.nvrtcDestroyProgram(ctypes.byref(prog))
