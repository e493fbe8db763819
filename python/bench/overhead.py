#!/usr/bin/env python3
"""Per-call overhead of the Python API over libkdaclient: the same blocking prefill (one
sequence of T tokens, inline tensors, fresh), same daemon, same transport, timed from C
(prefill_loop.c) and from Python, alternating in blocks of --block calls so that load and
drift hit all alike; prints the p50 latency of each, the calling thread's CPU time per call
(what the client itself spends: steadier than latency on a loaded machine), and the
differences.

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


class PyLoop:
    def __init__(self, c, T, H, out_given):
        rng = np.random.default_rng(0)
        x = {n: kdaclient.to_bf16(rng.standard_normal((T, H, 128))) for n in "qkvg"}
        x["beta"] = np.zeros((T, H), np.uint16)
        slot, = c.alloc_slots(1)
        seq = dict(x, slot=slot, fresh=True)
        if out_given:
            seq["out"] = np.empty((T, H, 128), np.uint16)
        self.c, self.seqs = c, [seq]

    def run(self, calls):
        wall, cpu = [], []
        for _ in range(calls):
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            self.c.prefill("bench.overhead", self.seqs)
            c1 = time.thread_time_ns()
            wall.append(time.perf_counter_ns() - t0)
            cpu.append(c1 - c0)
        return wall, cpu


class CLoop:
    def __init__(self, exe, sock, T):
        self.p = subprocess.Popen([exe, sock, str(T)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)

    def run(self, calls):
        self.p.stdin.write("%d\n" % calls)
        self.p.stdin.flush()
        wall, cpu = [], []
        for line in self.p.stdout:
            if line.startswith("done"):
                return wall, cpu
            w, c = line.split()
            wall.append(int(w))
            cpu.append(int(c))
        raise RuntimeError("prefill_loop ended")

    def close(self):
        self.p.stdin.close()
        self.p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kdad", default=os.path.join(REPO, "build", "daemon", "kdad"))
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--tokens", default="1,64")
    ap.add_argument("--calls", type=int, default=5000, help="calls per variant")
    ap.add_argument("--block", type=int, default=50, help="calls per turn")
    args = ap.parse_args()
    os.environ["KDAD_BIN"] = args.kdad
    exe = build_c(args.build)
    d = Daemon(heads=args.heads).start()
    try:
        with d.connect() as c:
            c.register_layer("bench.overhead", np.zeros(args.heads), np.zeros((args.heads, 128)),
                             -5.0)
            for T in (int(t) for t in args.tokens.split(",")):
                loops = {"C": CLoop(exe, d.sock, T),
                         "Python": PyLoop(c, T, args.heads, False),
                         "Python, out given": PyLoop(c, T, args.heads, True)}
                res = {k: ([], []) for k in loops}
                for k, lp in loops.items():       # warm up
                    lp.run(args.block)
                for _ in range(args.calls // args.block):
                    for k, lp in loops.items():
                        w, cp = lp.run(args.block)
                        res[k][0].extend(w)
                        res[k][1].extend(cp)
                loops["C"].close()
                base_w = statistics.median(res["C"][0])
                base_c = statistics.median(res["C"][1])
                print("H=%d T=%d inline, %d calls each, alternating in blocks of %d:"
                      % (args.heads, T, len(res["C"][0]), args.block))
                for k, (w, cp) in res.items():
                    mw, mc = statistics.median(w), statistics.median(cp)
                    print("  %-18s latency p50 %7.1f us (%+6.1f)   client CPU p50 %6.1f us "
                          "(%+5.1f)" % (k, mw / 1e3, (mw - base_w) / 1e3, mc / 1e3,
                                        (mc - base_c) / 1e3))
    finally:
        d.stop()


if __name__ == "__main__":
    main()
