#!/usr/bin/env python3
"""A decode step from Python two ways against one kdad: one Client.step of N sequences x 1
token (packed [N, H, 128], out given) and one Client.prefill of N 1-token sequences,
alternating in blocks of --block calls so that load and drift hit both alike; prints the p50
latency of each call and the daemon's kernel time (last_timings["kernel_us"]).

    python3 python/bench/decode.py --kdad build/daemon/kdad [--heads 4] [--seqs 32]
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from kdaclient_tests import Daemon, rand_layer, rand_seq  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kdad", required=True)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--block", type=int, default=25)
    a = ap.parse_args()
    os.environ["KDAD_BIN"] = a.kdad
    H, N = a.heads, a.seqs
    d = Daemon(heads=H, slots=2 * N + 8, backend=a.backend).start()
    try:
        with d.connect() as c:
            rng = np.random.default_rng(0)
            c.register_layer("B", *rand_layer(rng, H), -5.0)
            steps, prefills = c.alloc_slots(N), c.alloc_slots(N)
            x = rand_seq(rng, N, H)
            seqs = [dict({n: x[n][i:i + 1] for n in x}, slot=s) for i, s in enumerate(prefills)]
            out = np.empty((N, H, 128), np.uint16)
            lat = {"step": [], "prefill": []}
            kern = {"step": [], "prefill": []}
            calls = {"step": lambda: c.step("B", steps, x["q"], x["k"], x["v"], x["g"],
                                            x["beta"], out=out),
                     "prefill": lambda: c.prefill("B", seqs)}
            for _ in range(a.blocks):
                for name, call in calls.items():
                    for _ in range(a.block):
                        t0 = time.perf_counter()
                        call()
                        lat[name].append((time.perf_counter() - t0) * 1e6)
                        kern[name].append(c.last_timings["kernel_us"])
    finally:
        d.stop()
    p50 = {n: float(np.median(v[a.block:])) for n, v in lat.items()}   # first block: warm-up
    k50 = {n: float(np.median(v[a.block:])) for n, v in kern.items()}
    print("H=%d, %d sequences x 1 token, %s backend, %d calls each in blocks of %d:"
          % (H, N, a.backend, a.blocks * a.block, a.block))
    for n in ("step", "prefill"):
        print("  %-8s p50 %8.0f us   kernel_us p50 %8.0f" % (n, p50[n], k50[n]))
    print("  prefill / step: %.2fx" % (p50["prefill"] / p50["step"]))


if __name__ == "__main__":
    main()
