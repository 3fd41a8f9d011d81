"""One-step calls inside XLA's command buffers (CUDA graphs).

The one-step targets (sprnn_<cell>_step) are registered as command-buffer compatible, so with
``--xla_gpu_enable_command_buffer`` including WHILE, XLA records a sampling loop's body once
and replays it: our handler runs when XLA records, not at every iteration. The loop must still
compute every step, also on the staged per-step kernel with its shared-memory limit raised.
XLA reads XLA_FLAGS once per process, hence the subprocess.
"""

import json
import os
import subprocess
import sys

import pytest

from test_gpu_kernel import _gpu_ok

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_ok(), reason="needs a CUDA GPU and _sprnn_cuda")]

HERE = os.path.dirname(os.path.abspath(__file__))
COMMAND_BUFFERS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,"
                   "CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1")


def test_sampling_loop_in_a_command_buffer():
    env = dict(os.environ, XLA_FLAGS=COMMAND_BUFFERS, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    done = subprocess.run([sys.executable, os.path.join(HERE, "command_buffer_loop.py")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(r["cell"], r["hidden"]) for r in rows] == [
        ("rnn", 70), ("lstm", 70), ("gru", 70), ("rnn", 1601)], done.stdout
    # The last case forces the staged kernel (command_buffer_loop.py CASES): it ran.
    assert [r["staged_launches"] > 0 for r in rows] == [False, False, False, True], rows
    for r in rows:
        # float32 tolerance (oracle.RTOL): every step of the loop ran, on the right state
        assert r["loop_error"] < 2e-5 and r["loop_final_error"] < 2e-5, r
        assert r["whole_error"] < 2e-5, r
        # XLA replayed the recorded loop: the handler ran fewer times than the loop's trips
        assert all(0 <= n < r["trips"] for n in r["handler_runs"]), r
