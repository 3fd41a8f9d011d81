"""Shared-memory load counters of one kernel call under Nsight Compute (ncu): bank conflicts,
wavefronts and load instructions, for the ablation table (the paper's Table 1 analogue).

ncu replays the kernel once per counter group, so each variant is counted in its own process:
`bench_gpu.py --ncu-one V` makes one call (ReLU H=1152, 10%, fp16, B=4, T=32) under
`ncu -c 1`, which profiles the first persistent kernel launch only.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys

METRICS = {
    "bank_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "wavefronts": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "shared_loads": "smsp__sass_inst_executed_op_shared_ld.sum",
}
BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_gpu.py")


def parse_ncu_csv(text: str) -> dict:
    """{our name: int} from `ncu --csv` output. Only the quoted lines are ncu's CSV; the rest is
    the profiled program's output and ncu's ==PROF== log."""
    rows = csv.DictReader(line for line in text.splitlines() if line.startswith('"'))
    by_metric = {row.get("Metric Name"): row.get("Metric Value", "") for row in rows}
    counts = {}
    for name, metric in METRICS.items():
        value = by_metric.get(metric)
        if value is None:
            raise ValueError(f"ncu printed no value for {metric}")
        counts[name] = int(float(value.replace(",", "")))
    return counts


def shared_counts(variant: int, timeout_s: float = 180) -> dict:
    """The counters of variant `variant`'s first kernel, or {"error": why} where ncu is missing
    or fails (e.g. no permission for the GPU's performance counters)."""
    ncu = shutil.which("ncu")
    if ncu is None:
        return {"error": "ncu not found"}
    cmd = [ncu, "--csv", "--clock-control", "none", "-k", "regex:persistent_fwd", "-c", "1",
           "--metrics", ",".join(METRICS.values()), sys.executable, BENCH, "--ncu-one",
           str(variant)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        return parse_ncu_csv(run.stdout)
    except subprocess.TimeoutExpired:
        return {"error": f"ncu ran past {timeout_s:.0f} s"}
    except ValueError as err:
        tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
        return {"error": f"{err} (rc {run.returncode}: {' / '.join(tail)[:300]})"}
