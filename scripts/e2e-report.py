#!/usr/bin/env python3
"""Joins scripts/e2e-bench.sh output with the kernel's own times (bench_kernel --json
from the same GPU call) into bench/h200-e2e.json and prints a markdown table.

  scripts/e2e-report.py KERNEL_JSON E2E_JSONL [E2E_JSONL...] > table.md

Latency rows (1 client, 1 request in flight): e2e_ms is the client's median
latency (send to completion) and kernel_ms the bare kernel on the same batch.
Throughput rows (C clients each sending 1024-token prefills): tokens_per_s is
the daemon's, compared with the bare kernel on the packed batch of C x 1024.
"""
import json
import sys

kernel = {w["workload"]: w for w in json.load(open(sys.argv[1]))}
rows = []
for path in sys.argv[2:]:
    for line in open(path):
        rec = json.loads(line)
        b, name = rec["bench"], rec["workload"]
        if b["errors"]:
            raise SystemExit(f"{name}: {b['errors']} failed requests: {b['first_error']}")
        clients = b["clients"]
        if "clients x 1024" in name:
            ref = kernel[f"H96 uniform {clients}x1024" if clients != 8 else "H96 uniform 8x1024"]
            kernel_tps = clients * 1024 / (ref["ms"] * 1e-3)
            row = {"workload": name, "transport": b["transport"], "clients": clients,
                   "kernel_ms": ref["ms"], "e2e_ms": round(b["latency_ms"]["p50"], 4),
                   "overhead_pct": None, "tokens_per_s": round(b["tokens_per_s"]),
                   "kernel_tokens_per_s": round(kernel_tps),
                   "pct_of_kernel_throughput": round(100 * b["tokens_per_s"] / kernel_tps, 1)}
        else:
            k = kernel[name]["ms"]
            e2e = b["latency_ms"]["p50"]
            row = {"workload": name, "transport": b["transport"], "clients": clients,
                   "kernel_ms": k, "e2e_ms": round(e2e, 4),
                   "overhead_pct": round(100 * (e2e - k) / k, 1),
                   "tokens_per_s": round(b["tokens_per_s"]),
                   "daemon_run_us": round(b["daemon_run_us_mean"]),
                   "daemon_queue_us": round(b["daemon_queue_us_mean"])}
        rows.append(row)

json.dump(rows, open("bench/h200-e2e.json", "w"), indent=1)
print("| workload | transport | clients | kernel ms | e2e p50 ms | overhead | tokens/s | note |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    note = (f"{r['pct_of_kernel_throughput']}% of the bare kernel's {r['kernel_tokens_per_s']:,} tokens/s"
            if r["overhead_pct"] is None else f"daemon run {r['daemon_run_us']} us")
    over = "-" if r["overhead_pct"] is None else f"{r['overhead_pct']}%"
    print(f"| {r['workload']} | {r['transport']} | {r['clients']} | {r['kernel_ms']:.3f} | "
          f"{r['e2e_ms']:.3f} | {over} | {r['tokens_per_s']:,} | {note} |")
