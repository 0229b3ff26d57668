NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
NCU=1 $NCU --clock-control none --kernel-name regex:"_sel_dkdv_wg|_sel_bwd_dkdv" --launch-skip 3 --launch-count 3 --csv --page raw \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__inst_executed.sum,gpu__time_duration.sum,launch__registers_per_thread,smsp__warps_active.avg.per_cycle_active \
  python benchmarks/probes/gluon_walk.py m7c:8192:2 ncu 2>/dev/null > $OUT/ncu_walk_stalls.csv
python3 - <<'PY'
import csv, os
rows = list(csv.reader(open(os.environ["OUT"] + "/ncu_walk_stalls.csv")))
i = next(k for k, r in enumerate(rows) if "Kernel Name" in r)
hdr = rows[i]; data = [r for r in rows[i+2:] if len(r) == len(hdr)]
for r in data:
    d = dict(zip(hdr, r))
    print(d["Kernel Name"], d.get("gpu__time_duration.sum"), "inst", d.get("smsp__inst_executed.sum"), "regs", d.get("launch__registers_per_thread"), "warps", d.get("smsp__warps_active.avg.per_cycle_active"))
    st = sorted(((float(v), k.replace("smsp__average_warps_issue_stalled_", "").replace("_per_issue_active.ratio", "")) for k, v in d.items() if k.startswith("smsp__average_warps_issue_stalled") and v.replace('.', '', 1).isdigit()), reverse=True)
    print("   ", ", ".join(f"{k} {v:.2f}" for v, k in st[:9]))
PY
