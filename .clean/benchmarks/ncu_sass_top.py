"""Summarises an ncu SASS source page: the stall reasons in total, then the N instructions with
the most warp-stall samples (with their two largest reasons and execution counts).

    ncu -i report.ncu-rep --page source --csv --print-source sass > sass.csv
    python benchmarks/ncu_sass_top.py sass.csv [N]

The CSV's first line names the kernel, the second holds the column names.
"""

import csv
import sys


def main(path: str, top: int = 40) -> None:
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    header, data = rows[1], rows[2:]
    samples = header.index("Warp Stall Sampling (All Samples)")
    executed = header.index("Instructions Executed")
    stalls = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]

    def count(row, i):
        return int(row[i] or 0)

    print("total samples", sum(count(r, samples) for r in data))
    totals = {header[i]: sum(count(r, i) for r in data) for i in stalls}
    print(sorted(totals.items(), key=lambda kv: -kv[1])[:8])
    hottest = sorted(range(len(data)), key=lambda k: -count(data[k], samples))[:top]
    for k in sorted(hottest):  # in program order
        row = data[k]
        reasons = sorted(((count(row, i), header[i][len("stall_"):]) for i in stalls),
                         reverse=True)[:2]
        print(f"{k:5d} {count(row, samples):6d} ex={row[executed]:>7} "
              f"{row[1].strip()[:60]:60s} {reasons}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
