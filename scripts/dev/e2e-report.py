#!/usr/bin/env python3
"""Joins scripts/dev/e2e-bench.sh output with the kernel's own times (bench_kernel --json
from the same GPU call) into bench/h200-e2e.json and prints markdown tables.

  scripts/dev/e2e-report.py [--out FILE] KERNEL_JSON E2E_JSONL [E2E_JSONL...] > table.md

Latency rows (1 client, 1 request in flight): e2e_ms is the client's median
latency (send to completion) and kernel_ms the bare kernel on the same batch.
Throughput rows (C clients each sending 1024-token prefills): tokens_per_s is
the daemon's, compared with the bare kernel on the packed batch of C x 1024.

Every row also carries where the daemon's time went:
  daemon_{queue,run,device,kernel}_us_p50  medians of the per-request times in
      the prefill results (queue: arrival to launch; run: launch to the batch
      seen done; device: the batch's GPU time, first copy in to last copy out;
      kernel: the kernel alone, between the graph's events)
  daemon_run_us, daemon_queue_us           the same means (as before)
  batch_phases_us                          per phase, the mean over the
      measurement's batches (from the stats batch_us sums before and after it):
      form, stage, launch, wait, notice, unstage, reply, total, device, kernel, host;
      and how many of those batches were held (device busy) or gathered (idle device)
  variant                                  "poll", "block" (cuda_completion), "spin" (clients
                                           spin 200 us before sleeping), "depth2" (two
                                           requests in flight per client), "spin-2ms"
                                           (clients poll 2 ms after each answer), "ring-spin"
                                           (the same over a frame ring), "ring" (a frame
                                           ring, clients sleeping)
A "socket round trip" line (kdactl ping) gives the host's floor for any request over the
socket, a "ring round trip" line (kdactl ping --ring --spin 2000) the floor over a frame ring.
The second table splits each latency row's overhead over the bare kernel into
  client (e2e - run - queue: socket, client, admission),
  queue (arrival to launch: formation, staging), run - device (launch and the
  completion's notice), device - kernel (copies, slot operations), and
  kernel - bare kernel (the kernel inside kdad against bench_kernel's).
"""
import json
import sys

PHASES = ["form", "stage", "launch", "wait", "notice", "unstage", "reply", "total", "device",
          "kernel", "host"]

args = sys.argv[1:]
out_path = "bench/h200-e2e.json"
if len(args) >= 2 and args[0] == "--out":
    out_path, args = args[1], args[2:]
if len(args) < 2:
    raise SystemExit(__doc__)
kernel = {w["workload"]: w for w in json.load(open(args[0]))}


def phases(before, after):
    """Mean microseconds per batch of each phase between two stats snapshots."""
    if not before or not after or "batch_us" not in before or "batch_us" not in after:
        return None
    b, a = before["batch_us"], after["batch_us"]
    n = a["count"] - b["count"]
    if n <= 0:
        return None
    res = {"batches": n}
    for k in ["batches_held", "batches_gathered"]:   # counted by newer kdad builds only
        if k in a and k in b:
            res[k.replace("batches_", "")] = a[k] - b[k]
    for p in PHASES:
        if p in a["phases"] and p in b["phases"]:
            res[p] = round((a["phases"][p]["sum"] - b["phases"][p]["sum"]) / n, 1)
    return res


rows, pings = [], []
for path in args[1:]:
    for line in open(path):
        rec = json.loads(line)
        if "ping" in rec:
            pings.append(rec["ping"])
            continue
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
                   "tokens_per_s": round(b["tokens_per_s"])}
        row["variant"] = rec.get("variant", "poll")
        row["daemon_run_us"] = round(b["daemon_run_us_mean"])
        row["daemon_queue_us"] = round(b["daemon_queue_us_mean"])
        for t in ["queue", "run", "device", "kernel"]:
            key = f"daemon_{t}_us_p50"
            if key in b:
                row[key] = round(b[key], 1)
        ph = phases(rec.get("stats_before"), rec.get("stats_after"))
        if ph:
            row["batch_phases_us"] = ph
        rows.append(row)

json.dump(rows, open(out_path, "w"), indent=1)


def tag(r):
    return "" if r["variant"] == "poll" else f" ({r['variant']})"


print("| workload | transport | clients | kernel ms | e2e p50 ms | overhead | tokens/s | note |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    if r["overhead_pct"] is None:
        note = (f"{r['pct_of_kernel_throughput']}% of the bare kernel's "
                f"{r['kernel_tokens_per_s']:,} tokens/s")
    else:
        note = f"daemon run {r['daemon_run_us']} us"
    over = "-" if r["overhead_pct"] is None else f"{r['overhead_pct']}%"
    print(f"| {r['workload']}{tag(r)} | {r['transport']} | {r['clients']} | {r['kernel_ms']:.3f} | "
          f"{r['e2e_ms']:.3f} | {over} | {r['tokens_per_s']:,} | {note} |")

print()
print("Where the overhead goes (latency rows, medians per request in us; kernel = the graph in kdad):")
print()
for p in pings:
    if p.get("ring"):
        print(f"Frame ring round trip of a health request, client polling (kdactl ping --ring "
              f"--spin {p.get('spin_us', 0)}, {p['count']} in a row): p50 {p['rtt_us_p50']:.0f} us, "
              f"p99 {p['rtt_us_p99']:.0f} us.")
    else:
        print(f"Socket round trip of a health request on this host (kdactl ping, {p['count']} in a "
              f"row): p50 {p['rtt_us_p50']:.0f} us, p99 {p['rtt_us_p99']:.0f} us; it is part of "
              "every socket request's client time.")
    print()
print("| workload | transport | e2e - bare kernel | client | queue | run - device | device - kernel "
      "| kernel - bare kernel |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    if r["overhead_pct"] is None or "daemon_device_us_p50" not in r:
        continue
    e2e, bare = r["e2e_ms"] * 1e3, r["kernel_ms"] * 1e3
    q, run = r["daemon_queue_us_p50"], r["daemon_run_us_p50"]
    dev, ker = r["daemon_device_us_p50"], r["daemon_kernel_us_p50"]
    print(f"| {r['workload']}{tag(r)} | {r['transport']} | {e2e - bare:.0f} | {e2e - run - q:.0f} | "
          f"{q:.0f} | {run - dev:.0f} | {dev - ker:.0f} | {ker - bare:.0f} |")

print()
print("Per batch, mean us by phase (stats batch_us over each measurement):")
print()
print("| workload | transport | clients | batches | held | gathered | " + " | ".join(PHASES) + " |")
print("|---|---|---|---|---|---|" + "---|" * len(PHASES))
for r in rows:
    ph = r.get("batch_phases_us")
    if not ph:
        continue
    cells = " | ".join(f"{ph[p]:.0f}" if p in ph else "-" for p in PHASES)
    held, gathered = ph.get("held", "-"), ph.get("gathered", "-")
    print(f"| {r['workload']}{tag(r)} | {r['transport']} | {r['clients']} | {ph['batches']} | "
          f"{held} | {gathered} | {cells} |")
