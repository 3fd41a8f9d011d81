"""The standalone GPU probes in benchmarks/ still build with the flags benchmarks/gpu_check.sh
uses. They include csrc/cuda/*.cuh, so a kernel change can break them without any package test
noticing, and a broken probe would only show on the GPU machine. Needs nvcc (skipped without it);
builds for sm_90, as on the H200.
"""

import os
import re
import shlex
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc")


def gpu_check_nvcc():
    """The probes' compiler command, as gpu_check.sh defines it (PROBE_NVCC=(...))."""
    with open(os.path.join(ROOT, "benchmarks", "gpu_check.sh")) as f:
        m = re.search(r"^PROBE_NVCC=\((.*)\)$", f.read(), re.MULTILINE)
    assert m, "gpu_check.sh no longer defines PROBE_NVCC"
    return shlex.split(m.group(1))


# build -> (probe source, the extra nvcc flags of its gpu_check.sh mode; an -arch there replaces
# the shared one); the step probe's default build has the probe mode as a constant, its other
# build reads it at run time.
PROBES = {
    "step_probe": ("step_probe", ["-DSPRNN_STEP_PROBE", "-DSPRNN_PROBE_FIXED_MODE=0"]),
    "step_probe_runtime_mode": ("step_probe", ["-DSPRNN_STEP_PROBE"]),
    "exchange_probe": ("exchange_probe", []),
    "l1_gather_probe": ("l1_gather_probe", []),
    "cluster_reg_probe": ("cluster_reg_probe", []),
    "mma_clock_probe": ("mma_clock_probe", ["-arch=sm_90a"]),
    "diag_mma_probe": ("diag_mma_probe", []),
    "func_attr_probe": ("func_attr_probe", []),
    "step_kernel_probe": ("step_kernel_probe", []),
}


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("build", sorted(PROBES))
def test_probe_builds(build, tmp_path):
    exe = tmp_path / build
    nvcc, *flags = gpu_check_nvcc()
    assert nvcc == "nvcc"
    source, extra = PROBES[build]
    if any(f.startswith("-arch=") for f in extra):
        flags = [f for f in flags if not f.startswith("-arch=")]
    cmd = [NVCC, *flags, *extra, os.path.join("benchmarks", source + ".cu"), "-o", str(exe)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert exe.stat().st_size > 0
