"""PyTorch CUDA tensors in and out through CUDA regions (needs torch with a CUDA GPU and a kdad
built with CUDA; skipped otherwise).

    KDAD_BIN=/path/to/kdad python3 -m unittest -v kdaclient_tests.test_cuda

Checks: no host copy of the tensor data (the daemon's transport counters: everything on
cuda_ipc, nothing inline or through shared memory), results bit-equal to the host path,
registrations cached per allocation and given back when the allocation goes, the region
budget, slot read/write into device memory, expandable segments (VMM, posix_fd regions),
decode steps with states kept in device memory and a draft rolled back from them, prefills
ordered by a PyTorch stream (the host not waiting; a failure releasing the stream), and the
H = 32, 8192-token prefill end to end against the kernel time.
"""
import os
import subprocess
import sys
import threading
import time
import unittest

import numpy as np

import kdaclient
from . import DaemonTestCase, rand_layer, rand_seq, rel_rms

try:
    import torch
    HAVE_CUDA = torch.cuda.is_available()
except ImportError:
    torch = None
    HAVE_CUDA = False

H = 8
SKIP = "needs PyTorch with a CUDA GPU (and KDAD_BIN: a kdad built with CUDA)"


def to_cuda(seq, dtype=None):
    """uint16 bf16 bits -> torch bf16 CUDA tensors (or their int16 view)."""
    out = {}
    for n, a in seq.items():
        t = torch.from_numpy(a.view(np.int16)).cuda()
        out[n] = t if dtype == "int16" else t.view(torch.bfloat16)
    return out


def host_bits(t):
    """A CUDA bf16/int16 tensor -> its bits as a uint16 NumPy array."""
    return t.view(torch.int16).cpu().numpy().view(np.uint16)


@unittest.skipUnless(HAVE_CUDA, SKIP)
class CudaTest(DaemonTestCase):
    DAEMON = dict(heads=H, backend="cuda", config="limits:\n  max_regions_per_client: 9\n")
    SEED = 5
    LAYER = "C"

    def test_tensors_in_and_out_without_host_copy(self):
        T = 300
        x = rand_seq(self.rng, T, H)
        s1, s2 = self.c.alloc_slots(2)
        dx = to_cuda(x)
        out = torch.empty((T, H, 128), dtype=torch.bfloat16, device="cuda")
        before = self.c.stats()["transport_bytes"]
        res = self.c.prefill("C", [dict(dx, slot=s1, out=out)])
        after = self.c.stats()["transport_bytes"]
        self.assertIs(res[0]["out"], out)
        self.assertEqual(res[0]["pos"], T)
        for tr in ("inline", "shm"):
            self.assertEqual(after[tr], before[tr], tr)
        self.assertEqual(after["cuda_ipc"]["in"] - before["cuda_ipc"]["in"], T * H * (4 * 256 + 2))
        self.assertEqual(after["cuda_ipc"]["out"] - before["cuda_ipc"]["out"], T * H * 256)
        ref = self.c.prefill("C", [dict(x, slot=s2)])[0]["out"]        # the inline path
        np.testing.assert_array_equal(host_bits(out), ref)
        np.testing.assert_array_equal(self.c.read_slot(s1), self.c.read_slot(s2))

    def test_int16_views_through_cuda_array_interface(self):
        class OnlyCAI:      # as Numba or an older CuPy offers device memory
            def __init__(self, t):
                self.t = t

            @property
            def __cuda_array_interface__(self):
                return self.t.__cuda_array_interface__

        T = 64
        x = rand_seq(self.rng, T, H)
        s1, s2 = self.c.alloc_slots(2)
        dx = {n: OnlyCAI(t) for n, t in to_cuda(x, "int16").items()}
        out = torch.empty((T, H, 128), dtype=torch.int16, device="cuda")
        self.c.prefill("C", [dict(dx, slot=s1, out=OnlyCAI(out))])
        ref = self.c.prefill("C", [dict(x, slot=s2)])[0]["out"]
        np.testing.assert_array_equal(host_bits(out), ref)

    def test_registration_cached_per_allocation(self):
        x = to_cuda(rand_seq(self.rng, 32, H))
        s, = self.c.alloc_slots(1)
        out = torch.empty((32, H, 128), dtype=torch.bfloat16, device="cuda")
        self.c.prefill("C", [dict(x, slot=s, out=out)])
        n = self.c.regions()["cuda_registered"]
        for _ in range(5):
            self.c.prefill("C", [dict(x, slot=s, out=out)])
        self.assertEqual(self.c.regions()["cuda_registered"], n)
        self.assertLessEqual(self.c.regions()["cuda"], n)

    def test_released_when_the_allocation_goes(self):
        s, = self.c.alloc_slots(1)
        T = 512   # 1 MiB per tensor: a separate 2 MiB+ segment each time it is made anew
        big = torch.empty((6 * 32 << 20,), dtype=torch.uint8, device="cuda")   # own segment
        views = {n: big[i * (T * H * 256):(i + 1) * (T * H * 256)].view(torch.int16)
                 .view(T, H, 128) for i, n in enumerate(("q", "k", "v", "g"))}
        for t in views.values():
            t.copy_(torch.randint(-2000, 2000, t.shape, dtype=torch.int16))
        beta = big[4 * T * H * 256:4 * T * H * 256 + T * H * 2].view(torch.int16).view(T, H)
        beta.zero_()
        self.c.prefill("C", [dict(views, beta=beta, slot=s)])
        released = self.c.regions()["cuda_released"]
        del views, beta, big, t                         # t: the loop's last view of big
        torch.cuda.empty_cache()                        # the segment is freed
        other = to_cuda(rand_seq(self.rng, 16, H))
        self.c.prefill("C", [dict(other, slot=s)])      # a miss sweeps the dead registration
        self.assertGreater(self.c.regions()["cuda_released"], released)

    def test_region_budget(self):
        """More allocations than max_regions_per_client allows: the least recently used
        registrations are evicted, never one the request being built uses."""
        s, = self.c.alloc_slots(1)
        segs = []
        n = 16 * H * 128 * 2
        for _ in range(8):
            seg = torch.empty((32 << 20,), dtype=torch.uint8, device="cuda")  # its own segment
            segs.append(seg)                                 # all stay allocated
            x = rand_seq(self.rng, 16, H)
            dx = {}
            for i, name in enumerate(("q", "k", "v", "g")):
                dx[name] = seg[i * (1 << 20):i * (1 << 20) + n].view(torch.int16).view(16, H, 128)
                dx[name].copy_(torch.from_numpy(x[name].view(np.int16)))
            dx["beta"] = torch.from_numpy(x["beta"].view(np.int16)).cuda()
            self.c.prefill("C", [dict(dx, slot=s)])
            self.assertLessEqual(self.c.regions()["cuda"], 9 - 5)   # less the client's reserve
        self.assertGreater(self.c.regions()["cuda_released"], 0)

    def test_slot_read_write_in_device_memory(self):
        s1, s2 = self.c.alloc_slots(2)
        self.c.prefill("C", [dict(rand_seq(self.rng, 40, H), slot=s1)])
        st = torch.empty((H, 128, 128), dtype=torch.float32, device="cuda")
        self.c.read_slot(s1, dtype="f32", out=st)
        np.testing.assert_array_equal(st.cpu().numpy(), self.c.read_slot(s1, dtype="f32"))
        self.c.write_slot(s2, st, pos=40)
        np.testing.assert_array_equal(self.c.read_slot(s2), self.c.read_slot(s1))

    def test_expandable_segments(self):
        """PyTorch's expandable segments are VMM mappings: they travel as posix_fd regions."""
        code = (
            "import numpy as np, torch, kdaclient\n"
            "from kdaclient_tests import rand_layer, rand_seq\n"
            "from kdaclient_tests.test_cuda import to_cuda, host_bits\n"
            "rng = np.random.default_rng(1); H = %d\n"
            "c = kdaclient.connect(%r, timeout=120)\n"
            "c.register_layer('V', *rand_layer(rng, H), -5.0)\n"
            "a, b = c.alloc_slots(2); x = rand_seq(rng, 16, H)\n"
            "out = torch.empty((16, H, 128), dtype=torch.bfloat16, device='cuda')\n"
            "c.prefill('V', [dict(to_cuda(x), slot=a, out=out)])\n"
            "ref = c.prefill('V', [dict(x, slot=b)])[0]['out']\n"
            "assert (host_bits(out) == ref).all(), 'differs from the host path'\n"
            "assert c.stats()['transport_bytes']['cuda_ipc']['out'] > 0\n"
            "print('VMM OK', c.regions())\n" % (H, self.d.sock))
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("VMM OK", p.stdout)


@unittest.skipUnless(HAVE_CUDA, SKIP)
class CudaStepStreamTest(DaemonTestCase):
    """Decode steps with CUDA tensors (states kept in device memory, a draft rolled back from
    them), and prefills ordered by a PyTorch stream (prefill_on_stream)."""
    DAEMON = dict(heads=H, backend="cuda")
    SEED = 23
    LAYER = "T"

    def primed(self, n, sets, prompt=7):
        """`sets` lists of n slots, list j's slot i holding sequence i's prompt state."""
        xs = [rand_seq(self.rng, prompt, H) for _ in range(n)]
        out = []
        for _ in range(sets):
            slots = self.c.alloc_slots(n)
            self.c.prefill("T", [dict(x, slot=s) for x, s in zip(xs, slots)])
            out.append(slots)
        return out

    def test_step_cuda_tensors_states_and_rollback(self):
        """A draft of k = 3 tokens for 4 sequences from CUDA tensors with the states kept in
        a CUDA tensor: outputs and states equal the host path's bit for bit, nothing moves
        inline or through shared memory, and writing state j - 1 back from device memory
        leaves each slot as a step of the j accepted tokens does."""
        k, n = 3, 4
        T = k * n
        a, b, c_ = self.primed(n, 3)
        x = rand_seq(self.rng, T, H)
        dx = to_cuda(x)
        f32 = self.c.hello()["state_dtype"] == "f32"
        states = torch.empty((T, H, 128, 128), dtype=torch.float32 if f32 else torch.int16,
                             device="cuda")
        out = torch.empty((T, H, 128), dtype=torch.bfloat16, device="cuda")
        before = self.c.stats()["transport_bytes"]
        res = self.c.step("T", a, dx["q"], dx["k"], dx["v"], dx["g"], dx["beta"], lens=k,
                          out=out, states=states, expect_pos=[7] * n)
        after = self.c.stats()["transport_bytes"]
        self.assertEqual(res["pos"], [7 + k] * n)
        self.assertIs(res["out"], out)
        self.assertIs(res["states"], states)
        for tr in ("inline", "shm"):
            self.assertEqual(after[tr], before[tr], tr)
        ref = self.c.step("T", b, x["q"], x["k"], x["v"], x["g"], x["beta"], lens=k,
                          states=True)
        np.testing.assert_array_equal(host_bits(out), ref["out"])
        got = states.cpu().numpy()
        np.testing.assert_array_equal(got if f32 else got.view(np.uint16), ref["states"])
        # sequence i accepts j = i % k + 1 tokens: state start + j - 1 back, from the GPU
        lens = [i % k + 1 for i in range(n)]
        for i, s in enumerate(a):
            self.c.write_slot(s, states[i * k + lens[i] - 1], pos=7 + lens[i])
        acc = {f: np.concatenate([x[f][i * k:i * k + lens[i]] for i in range(n)])
               for f in ("q", "k", "v", "g", "beta")}
        self.c.step("T", c_, acc["q"], acc["k"], acc["v"], acc["g"], acc["beta"], lens=lens)
        for sa, sc in zip(a, c_):
            ga, pa = self.c.read_slot(sa, with_pos=True)
            gc, pc = self.c.read_slot(sc, with_pos=True)
            self.assertEqual(pa, pc)
            np.testing.assert_array_equal(ga, gc)

    def test_prefill_on_stream(self):
        """Inputs produced on a busy stream, the prefill ordered by it, the output consumed
        on it: the call returns before the stream reaches the ready store, and the consumer
        reads the daemon's output, equal to the host path's."""
        T = 64
        x = rand_seq(self.rng, T, H)
        s, ref_slot = self.c.alloc_slots(2)
        host = {n: torch.from_numpy(a.view(np.int16)).pin_memory() for n, a in x.items()}
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            dx = {n: torch.empty(t.shape, dtype=torch.int16, device="cuda")
                  for n, t in host.items()}
            out = torch.zeros((T, H, 128), dtype=torch.int16, device="cuda")
        # a first round registers the allocations and the words (round trips to the daemon)
        warm, = self.c.alloc_slots(1)
        self.c.prefill_on_stream("T", [dict(dx, slot=warm, out=out)], stream).result(60)
        stream.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1_000_000_000)            # keeps the stream busy (~0.5 s)
            for n, t in dx.items():
                t.copy_(host[n], non_blocking=True)      # the producer
            t0 = time.perf_counter()
            h = self.c.prefill_on_stream("T", [dict(dx, slot=s, out=out, expect_pos=0)],
                                         stream)
            call_s = time.perf_counter() - t0
            early = h.done()
            consumed = out.clone()                       # runs after the done wait
        res = h.result(timeout=60)
        stream.synchronize()
        self.assertFalse(early)
        self.assertLess(call_s, 0.1)
        self.assertEqual(res[0]["pos"], T)
        self.assertEqual(h.done_word(), 1)
        ref = self.c.prefill("T", [dict(x, slot=ref_slot)])[0]["out"]
        np.testing.assert_array_equal(consumed.cpu().numpy().view(np.uint16), ref)
        print("\nprefill_on_stream: the call took %.0f us; daemon run %d us"
              % (call_s * 1e6, h.timings["run_us"]), file=sys.stderr)

    def test_stream_released_on_failure(self):
        """A request that fails (expect_pos) releases the stream's wait with the failure bit:
        the stream finishes, and result() raises PositionMismatch.  A stream given as an int
        cudaStream_t."""
        T = 8
        dx = to_cuda(rand_seq(self.rng, T, H))
        s, = self.c.alloc_slots(1)
        out = torch.empty((T, H, 128), dtype=torch.bfloat16, device="cuda")
        stream = torch.cuda.Stream()
        h = self.c.prefill_on_stream("T", [dict(dx, slot=s, out=out, expect_pos=5)],
                                     stream.cuda_stream)
        with self.assertRaises(kdaclient.PositionMismatch):
            h.result(timeout=60)
        done = []
        t = threading.Thread(target=lambda: (stream.synchronize(), done.append(1)))
        t.start()
        t.join(60)
        self.assertEqual(done, [1], "the stream still waits on the done word")
        self.assertEqual(h.done_word(), -1)
        self.assertEqual(self.c.slot_info(s)[0]["pos"], 0)


@unittest.skipUnless(HAVE_CUDA, SKIP)
class CudaH32Test(unittest.TestCase):
    """The H = 32, 8192-token prefill from PyTorch over CUDA regions, end to end (the Python
    call) against the kernel's time as the daemon reports it; equal to the staged host path."""

    def test_h32_8192(self):
        Hh, T, N = 32, 8192, 30
        with _daemon(Hh) as d:
            with d.connect() as c:
                rng = np.random.default_rng(9)
                c.register_layer("B", *rand_layer(rng, Hh), -5.0)
                s, ref_slot = c.alloc_slots(2)
                x = rand_seq(rng, T, Hh)
                dx = to_cuda(x)
                out = torch.empty((T, Hh, 128), dtype=torch.bfloat16, device="cuda")
                e2e, kern, dev = [], [], []
                for i in range(N):
                    t0 = time.perf_counter()
                    c.prefill("B", [dict(dx, slot=s, out=out, fresh=True)])
                    e2e.append((time.perf_counter() - t0) * 1e6)
                    kern.append(c.last_timings["kernel_us"])
                    dev.append(c.last_timings["device_us"])
                ref = c.prefill("B", [dict(x, slot=ref_slot, fresh=True)])[0]["out"]
                np.testing.assert_array_equal(host_bits(out), ref)
        p50 = lambda v: float(np.median(v[5:]))
        print("\nH=32 T=8192 CUDA regions from PyTorch: end to end p50 %.1f us, device p50 %.1f "
              "us, kernel p50 %.1f us (ratio e2e/kernel %.3f)"
              % (p50(e2e), p50(dev), p50(kern), p50(e2e) / max(p50(kern), 1)), file=sys.stderr)
        self.assertGreater(p50(kern), 0)


def _daemon(heads):
    from . import daemon
    return daemon(heads=heads, backend="cuda")


if __name__ == "__main__":
    unittest.main()
