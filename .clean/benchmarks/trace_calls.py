"""Where a call's time goes on the device: the GPU timeline of chained kernel calls, from a JAX
profiler trace (CUPTI activity records), beside the host's wall time of the same calls.

    python benchmarks/trace_calls.py --out DIR [--T 1 256 1024]

Why: through JAX the target layers cost 0.2-0.4 us/step more at T=256 than their per-step
slope (bench_gpu.py --overhead), and wall times alone cannot say whether that is kernel time,
the workspace memset, idle gaps between the device operations, or host dispatch. For each
layer, T and sync-check setting this prints per call of bench_gpu.K recurrences: the wall time,
the device span, our kernel's duration, the memsets and the gaps between operations; and the
kernel-only per-step slope between the last two T values. Writes trace.md, trace.json and
timelines.txt (host events and device operations of one call, for the middle T) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.profiler import ProfileData  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu as bg  # noqa: E402
from device_time import call_times, kind_of, traced_calls  # noqa: E402


def host_events(path):
    """(thread, name, start_ns, duration_ns) of the host's CUDA API calls and XLA thunks."""
    out = []
    for plane in ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for e in line.events:
                n = e.name
                if n.startswith("cu") or any(k in n.lower() for k in ("sprnn", "custom", "thunk",
                                                                      "execute", "pjit")):
                    out.append((line.name[:24], n[:70], e.start_ns, e.duration_ns))
    return out


def timeline(call, path):
    """One call's device operations and the host events around them, in time order (us from
    300 us before its first operation)."""
    lo, hi = call[0][1] - 300_000, max(e[1] + e[2] for e in call)
    rows = [((e[2] - lo) / 1e3, f"+{e[3] / 1e3:7.1f} us  {e[0]}  {e[1]}")
            for e in host_events(path) if lo <= e[2] <= hi]
    rows += [((e[1] - lo) / 1e3, f"+{e[2] / 1e3:7.1f} us  device  {kind_of(e[0])} {e[0][:50]}")
             for e in call]
    return [f"{t:9.1f} {s}" for t, s in sorted(rows)]


def parse_knobs(spec):
    """'label=VAR=VALUE,VAR2=VALUE2' (or a bare label: no knobs) -> (label, {VAR: VALUE})."""
    label, _, rest = spec.partition("=")
    knobs = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return label, knobs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", type=int, nargs="+", default=[1, 256, 1024])
    ap.add_argument("--knobs", nargs="+", metavar="LABEL[=VAR=VALUE,...]",
                    help="knob settings to trace in turn (default: the sync check on and off), "
                    "e.g. on off=SPRNN_CUDA_SYNC_CHECK=0")
    a = ap.parse_args()
    settings = bg.SYNC_CHECK_ON_OFF if not a.knobs else [parse_knobs(k) for k in a.knobs]
    os.makedirs(a.out, exist_ok=True)
    B, dt = 4, bg.jnp.float16
    res, lines = [], [f"# Device timeline of {bg.K} chained recurrences per call, B={B}, fp16",
                      "", f"commit {os.environ.get('SPRNN_COMMIT', '?')}, "
                      f"{jax.devices()[0].device_kind}", ""]

    def say(s):
        lines.append(s)
        print(s, flush=True)

    for cell, act, H, density in bg.SMALL_LAYERS:
        layer = bg.config_name(cell, H, density, dt)
        kern_med = {}
        for T in a.T:
            f, xp, c0 = bg.kernel_call(cell, act, H, B, T, density, dt)
            for label, knobs in settings:
                with bg.knobs_set(knobs):
                    walls, calls, path = traced_calls(f, (xp, c0))
                kus = [e[2] / 1e3 for c in calls for e in c if kind_of(e[0]) == "kernel"]
                if not kus:
                    say(f"- {layer} T={T}: no kernel on a GPU timeline")
                    continue
                mus = [e[2] / 1e3 for c in calls for e in c if kind_of(e[0]) == "memset"]
                gaps = [(b[1] - a_[1] - a_[2]) / 1e3 for c in calls for a_, b in zip(c, c[1:])]
                spans = [call_times(c)["span"] for c in calls]
                kern_med[(T, label)] = float(np.median(kus))
                res.append(dict(layer=layer, T=T, knobs=label, wall_us=walls,
                                span_us=spans, kernel_us=kus, memset_us=mus, gaps_us=gaps))
                say(f"- {layer} T={T} {label}: wall/call median {np.median(walls):.1f} us; "
                    f"device span {np.median(spans):.1f}; kernel median {np.median(kus):.2f} us "
                    f"({np.median(kus) / T:.3f} us/step); memset median {np.median(mus or [0]):.2f}; "
                    f"gaps median / max {np.median(gaps or [0]):.1f} / {max(gaps or [0]):.1f} us; "
                    f"ops of one call: {' '.join(f'{kind_of(e[0])}:{e[2] / 1e3:.1f}' for e in calls[-1])}")
                if T == a.T[len(a.T) // 2]:
                    with open(os.path.join(a.out, "timelines.txt"), "a") as fh:
                        fh.write(f"== {layer} T={T} {label}: host events and device ops of "
                                 "the last call (us from its first op - 300)\n")
                        fh.write("\n".join(timeline(calls[-1], path)[:300]) + "\n")
        first = settings[0][0]
        if len(a.T) > 1 and all(kern_med.get((T, first)) for T in a.T[-2:]):
            t1, t2 = a.T[-2:]
            slope = (kern_med[(t2, first)] - kern_med[(t1, first)]) / (t2 - t1)
            say(f"- {layer}: kernel-only slope T={t1}->{t2} {slope:.3f} us/step, in-kernel "
                f"fixed {kern_med[(t1, first)] - slope * t1:.1f} us")
    with open(os.path.join(a.out, "trace.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(os.path.join(a.out, "trace.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
