"""Device time of a jitted call from a JAX profiler trace (CUPTI activity records).

Wall time through JAX includes host dispatch before the first device operation and the
completion wait after the last, tens to hundreds of us per call that no recurrence
implementation can remove. The trace gives, per call: the device span (first operation's
start to the last one's end, gaps included), the busy time (the operations' durations summed)
and the time of the operations whose name matches a pattern (our kernel). Used by
bench_gpu.py --device-time and trace_calls.py.
"""

from __future__ import annotations

import glob
import tempfile
import time

import jax
import numpy as np
from jax.profiler import ProfileData

CALL_GAP_S = 0.002  # idle time between traced calls, which splits the timeline into calls


def kind_of(name):
    n = name.lower()
    if "copy_abort_flag" in n:  # the sync check's one-thread copy (sync_check.cuh), not ours to time
        return "flag copy"
    if "persistent_fwd" in n or "cluster_fwd" in n or "sprnn" in n:
        return "kernel"
    if "memset" in n:
        return "memset"
    if "memcpy" in n:
        return "memcpy"
    return "other"


def device_events(path):
    """(name, start_ns, duration_ns) of every activity on the GPU planes, in start order."""
    out = []
    for plane in ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                out += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
    return sorted(out, key=lambda e: e[1])


def split_calls(events, gap_ns=CALL_GAP_S * 1e9 / 2):
    """The events grouped into calls at idle gaps longer than gap_ns."""
    calls, cur = [], []
    for e in events:
        if cur and e[1] - max(c[1] + c[2] for c in cur) > gap_ns:
            calls.append(cur)
            cur = []
        cur.append(e)
    return calls + ([cur] if cur else [])


def traced_calls(f, args, calls=4):
    """Runs f(*args) calls + 1 times under the profiler: (wall us per call, events per call,
    trace path), the first call dropped."""
    jax.block_until_ready(f(*args))
    d = tempfile.mkdtemp()
    walls = []
    with jax.profiler.trace(d):
        for _ in range(calls + 1):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            walls.append((time.perf_counter() - t0) * 1e6)
            time.sleep(CALL_GAP_S)
    path = glob.glob(d + "/**/*.xplane.pb", recursive=True)[0]
    return walls[1:], split_calls(device_events(path))[1:], path


def call_times(events):
    """us of one call's device span, busy time and our kernels' time."""
    if not events:
        return dict(span=np.nan, busy=np.nan, kernel=np.nan)
    end = max(e[1] + e[2] for e in events)
    return dict(span=(end - events[0][1]) / 1e3, busy=sum(e[2] for e in events) / 1e3,
                kernel=sum(e[2] for e in events if kind_of(e[0]) == "kernel") / 1e3)


def device_times(f, args, calls=4):
    """Medians over calls of call_times (us per call)."""
    _, per_call, _ = traced_calls(f, args, calls)
    ts = [call_times(c) for c in per_call]
    return {k: float(np.median([t[k] for t in ts])) if ts else np.nan
            for k in ("span", "busy", "kernel")}
