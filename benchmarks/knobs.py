"""Run-time knobs of the CUDA handler (environment variables it reads at each call), set for a
block of code and restored afterwards: a value the user had set comes back, one they had not
is removed. Shared by the benchmark scripts (bench_gpu.py, capacity.py)."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def knobs_set(kn: dict):
    saved = {k: os.environ.get(k) for k in kn}
    os.environ.update(kn)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
