"""Where a call's time goes on the device: the GPU timeline of chained kernel calls, from a JAX
profiler trace (CUPTI activity records), beside the host's wall time of the same calls.

    python benchmarks/trace_calls.py --out DIR [--T 1 256 1024]

Why: through JAX the target layers cost 0.2-0.4 us/step more at T=256 than their per-step
slope (bench_gpu.py --overhead), and wall times alone cannot say whether that is kernel time,
the workspace memset, idle gaps between the device operations, or host dispatch. For each
layer, T and sync-check setting this prints per recurrence: the memset, the gap to the kernel,
the kernel's duration, the gap to the next operation, and the call's wall time; and the
kernel-only per-step slope between the T values. Writes trace.md and trace.json under --out.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.profiler import ProfileData  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu as bg  # noqa: E402

CALLS = 5  # traced calls per setting (the first is dropped)


def device_events(path):
    """(name, start_ns, duration_ns) of every activity on the GPU planes, in start order."""
    out = []
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            out += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
    return sorted(out, key=lambda e: e[1])


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
    return sorted(out, key=lambda e: e[2])


def kind_of(name):
    n = name.lower()
    if "persistent_fwd" in n or "cluster_fwd" in n or "sprnn" in n:
        return "kernel"
    if "memset" in n:
        return "memset"
    if "memcpy" in n:
        return "memcpy"
    return "other"


def trace_setting(f, args, knobs):
    """Wall times (us) of CALLS calls and the device events of each, traced."""
    with bg.knobs_set(knobs):
        for _ in range(3):
            jax.block_until_ready(f(*args))
        d = tempfile.mkdtemp()
        walls, marks = [], []
        with jax.profiler.trace(d):
            for _ in range(CALLS):
                t0 = time.perf_counter()
                jax.block_until_ready(f(*args))
                walls.append((time.perf_counter() - t0) * 1e6)
                time.sleep(0.002)  # a clear gap between calls in the timeline
        path = glob.glob(d + "/**/*.xplane.pb", recursive=True)[0]
    ev = device_events(path)
    hev = host_events(path)
    # Split the timeline into calls at gaps over 1 ms (the sleeps above).
    calls, cur = [], []
    for e in ev:
        if cur and e[1] - (cur[-1][1] + cur[-1][2]) > 1_000_000:
            calls.append(cur)
            cur = []
        cur.append(e)
    if cur:
        calls.append(cur)
    # The host's events during the last call (from its first device op - 300 us to its end).
    lo, hi = (calls[-1][0][1] - 300_000, calls[-1][-1][1] + calls[-1][-1][2]) if calls else (0, 0)
    host = [f"{(e[2] - lo) / 1e3:9.1f} +{e[3] / 1e3:7.1f} us  {e[0]}  {e[1]}"
            for e in hev if lo <= e[2] <= hi]
    dev = [f"{(e[1] - lo) / 1e3:9.1f} +{e[2] / 1e3:7.1f} us  device  {kind_of(e[0])} {e[0][:50]}"
           for e in (calls[-1] if calls else [])]
    return walls, calls, sorted(host + dev, key=lambda t: float(t.split()[0]))


def summarize(calls):
    """Per call (first dropped): kernel us each, memset us each, gaps us, device span us."""
    rows = []
    for c in calls[1:]:
        kern = [e for e in c if kind_of(e[0]) == "kernel"]
        mems = [e for e in c if kind_of(e[0]) == "memset"]
        gaps = [(b[1] - (a[1] + a[2])) / 1e3 for a, b in zip(c, c[1:])]
        rows.append(dict(kernel_us=[e[2] / 1e3 for e in kern], memset_us=[e[2] / 1e3 for e in mems],
                         gaps_us=gaps, span_us=(c[-1][1] + c[-1][2] - c[0][1]) / 1e3,
                         ops=[f"{kind_of(e[0])}:{e[2] / 1e3:.1f}" for e in c]))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", type=int, nargs="+", default=[1, 256, 1024])
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    B = 4
    res, lines = [], [f"# Device timeline of {bg.K} chained recurrences per call, B={B}, fp16",
                      "", f"commit {os.environ.get('SPRNN_COMMIT', '?')}, "
                      f"{jax.devices()[0].device_kind}", ""]
    for cell, act, H, density in bg.SMALL_LAYERS:
        kern_med = {}
        for T in a.T:
            f, xp, c0 = bg.kernel_call(cell, act, H, B, T, density, bg.jnp.float16)
            for label, knobs in bg.SYNC_CHECK_ON_OFF:
                walls, calls, timeline = trace_setting(f, (xp, c0), knobs)
                if T == a.T[len(a.T) // 2]:
                    with open(os.path.join(a.out, "timelines.txt"), "a") as fh:
                        fh.write(f"== {cell} H={H} T={T} sync {label}: host events and device "
                                 "ops of the last call (us from its first op - 300)\n")
                        fh.write("\n".join(timeline[:300]) + "\n")
                rows = summarize(calls)
                kus = [k for r in rows for k in r["kernel_us"]]
                mus = [m for r in rows for m in r["memset_us"]]
                gaps = [g for r in rows for g in r["gaps_us"]]
                entry = dict(layer=bg.config_name(cell, H, density, bg.jnp.float16), T=T,
                             sync_check=label, wall_us=walls[1:], rows=rows)
                res.append(entry)
                kern_med[(T, label)] = float(np.median(kus)) if kus else None
                if not kus:
                    print(f"- {entry['layer']} T={T}: no kernel on a GPU timeline", flush=True)
                    continue
                lines.append(
                    f"- {entry['layer']} T={T} sync {label}: wall/call median "
                    f"{np.median(walls[1:]):.1f} us; device span {np.median([r['span_us'] for r in rows]):.1f}; "
                    f"kernel median {np.median(kus):.2f} us ({np.median(kus) / T:.3f} us/step); "
                    f"memset median {np.median(mus) if mus else 0:.2f}; gaps median / max "
                    f"{np.median(gaps or [0]):.1f} / {max(gaps or [0]):.1f} us; ops of one call: "
                    f"{' '.join(rows[-1]['ops'])}")
                print(lines[-1], flush=True)
        if len(a.T) > 1 and all(kern_med.get((T, "on")) for T in a.T[-2:]):
            t1, t2 = a.T[-2:]
            slope = (kern_med[(t2, "on")] - kern_med[(t1, "on")]) / (t2 - t1)
            fixed = kern_med[(t1, "on")] - slope * t1
            lines.append(f"- {bg.config_name(cell, H, density, bg.jnp.float16)}: kernel-only "
                         f"slope T={t1}->{t2} {slope:.3f} us/step, in-kernel fixed {fixed:.1f} us")
            print(lines[-1], flush=True)
    with open(os.path.join(a.out, "trace.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(os.path.join(a.out, "trace.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
