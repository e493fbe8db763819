#!/usr/bin/env python3
"""Per-call overhead of the Python API over libkdaclient: the same blocking prefill (one
sequence of T tokens, inline tensors, fresh), same daemon, same transport, timed from C
(prefill_loop.c) and from Python, in alternating rounds; prints the p50 latency of each, the
calling thread's CPU time per call (what the client itself spends: steadier than latency on
a loaded machine), and the differences.

    python3 python/bench/overhead.py --kdad build/daemon/kdad --build build [--heads 32]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
import kdaclient  # noqa: E402
from kdaclient_tests import Daemon  # noqa: E402


def build_c(build):
    exe = os.path.join(tempfile.mkdtemp(), "prefill_loop")
    subprocess.run(["cc", "-O2", "-std=gnu11", os.path.join(HERE, "prefill_loop.c"),
                    "-I" + os.path.join(REPO, "client", "include"),
                    os.path.join(build, "client", "libkdaclient.a"), "-lmsgpackc", "-o", exe],
                   check=True)
    return exe


def py_loop(c, T, H, calls, out_given):
    rng = np.random.default_rng(0)
    x = {n: kdaclient.to_bf16(rng.standard_normal((T, H, 128))) for n in "qkvg"}
    x["beta"] = np.zeros((T, H), np.uint16)
    slot, = c.alloc_slots(1)
    seq = dict(x, slot=slot, fresh=True)
    if out_given:
        seq["out"] = np.empty((T, H, 128), np.uint16)
    seqs = [seq]
    wall, cpu = [], []
    for _ in range(calls):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        c.prefill("bench.overhead", seqs)
        c1 = time.thread_time_ns()
        wall.append(time.perf_counter_ns() - t0)
        cpu.append(c1 - c0)
    c.free_slots([slot])
    return wall[100:], cpu[100:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kdad", default=os.path.join(REPO, "build", "daemon", "kdad"))
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--tokens", default="1,64")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    os.environ["KDAD_BIN"] = args.kdad
    exe = build_c(args.build)
    d = Daemon(heads=args.heads).start()
    try:
        with d.connect() as c:
            c.register_layer("bench.overhead", np.zeros(args.heads), np.zeros((args.heads, 128)),
                             -5.0)
            for T in (int(t) for t in args.tokens.split(",")):
                res = {k: ([], []) for k in ("C", "Python", "Python, out given")}
                for _ in range(args.rounds):   # alternate, so drift hits all alike
                    p = subprocess.run([exe, d.sock, str(T), str(args.calls)], check=True,
                                       capture_output=True, text=True)
                    rows = [tuple(map(int, l.split())) for l in p.stdout.splitlines()[100:]]
                    got = {"C": ([r[0] for r in rows], [r[1] for r in rows]),
                           "Python": py_loop(c, T, args.heads, args.calls, False),
                           "Python, out given": py_loop(c, T, args.heads, args.calls, True)}
                    for k, (wall, cpu) in got.items():
                        res[k][0].append(statistics.median(wall))
                        res[k][1].append(statistics.mean(cpu))
                base_w = statistics.median(res["C"][0])
                base_c = statistics.median(res["C"][1])
                print("H=%d T=%d inline, %d calls x %d rounds (median over rounds):"
                      % (args.heads, T, args.calls, args.rounds))
                for k, (w, cp) in res.items():
                    mw, mc = statistics.median(w), statistics.median(cp)
                    print("  %-18s latency p50 %7.1f us (%+6.1f)   client CPU/call %6.1f us "
                          "(%+5.1f)" % (k, mw / 1e3, (mw - base_w) / 1e3, mc / 1e3,
                                        (mc - base_c) / 1e3))
    finally:
        d.stop()


if __name__ == "__main__":
    main()
