"""Summarises an ncu SASS source page (--page source --csv --print-source sass): stall
reasons in total and the N instructions with the most warp-stall samples.

    python benchmarks/ncu_sass_top.py sass.csv [N]
"""
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = rows[1]; data = rows[2:]
iS = hdr.index("Warp Stall Sampling (All Samples)"); iE = hdr.index("Instructions Executed")
stalls = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
tot = sum(int(r[iS] or 0) for r in data)
print("total samples", tot)
agg = {hdr[i]: sum(int(r[i] or 0) for r in data) for i in stalls}
print(sorted(agg.items(), key=lambda x: -x[1])[:8])
n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
top = sorted(range(len(data)), key=lambda k: -int(data[k][iS] or 0))[:n]
for k in sorted(top):
    r = data[k]
    st = sorted(((int(r[i] or 0), hdr[i][6:]) for i in stalls), reverse=True)[:2]
    print(f"{k:5d} {int(r[iS]):6d} ex={r[iE]:>7} {r[1].strip()[:60]:60s} {st}")
