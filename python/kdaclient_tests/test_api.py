"""The Python API against a kdad on the CPU backend: prefill and slots, chunked continuation,
arrays (NumPy, DLPack, shared arrays, staging), threads."""
import os
import threading
import unittest

import numpy as np

import kdaclient
from . import (Daemon, DaemonTestCase, kda_reference, rand_seq, rel_rms, slice_seq,
               OUT_TOL, STATE_TOL)

H = 4


class ApiTest(DaemonTestCase):
    DAEMON = dict(heads=H)
    SEED = 7
    LAYER = "L"

    def seq(self, T):
        return rand_seq(self.rng, T, H)

    def test_hello(self):
        h = self.c.hello()
        self.assertEqual(h["heads"], H)
        self.assertEqual(h["head_dim"], 128)
        self.assertEqual(h["backend"], "cpu")
        self.assertIn("inline", h["transports"])
        self.assertGreater(h["limits"]["max_regions_per_client"], 0)
        self.assertEqual(self.c.heads, H)
        self.assertEqual(kdaclient.__version__, kdaclient._kdaclient.LIBRARY_VERSION)
        self.assertEqual(h["limits"]["max_slots_per_uid"], 64)
        self.assertGreater(h["limits"]["max_layers_per_uid"], 0)
        self.assertEqual(h["limits"]["clients"]["frame_stall_seconds"], 30)
        # the cpu backend's memory: its pool, in host memory
        elem = 4 if h["state_dtype"] == "f32" else 2
        pool = h["slots"] * H * 128 * 128 * elem
        self.assertEqual(h["memory"], dict(pool=pool, staging=0, scratch=0, kernel=0, lanes=0,
                                           layers=0, total=pool))
        self.assertEqual(self.c.stats()["memory"], h["memory"])

    def test_bounds(self):
        """A daemon's clients.* bounds in hello and stats, and the usage against them."""
        d = Daemon(heads=H, config="clients:\n  max_inflight_bytes_per_uid: 300MiB\n"
                                   "  max_connections_per_uid: 7\n  output_stall_seconds: 9\n")
        d.start()
        try:
            c = d.connect()
            other = d.connect()
            bounds = c.hello()["limits"]["clients"]
            self.assertEqual(bounds["max_inflight_bytes_per_uid"], 300 << 20)
            self.assertEqual(bounds["max_connections_per_uid"], 7)
            self.assertEqual(bounds["output_stall_seconds"], 9)
            self.assertGreaterEqual(bounds["max_inflight_bytes_total"], 300 << 20)
            s, = c.alloc_slots(1)
            c.read_slot(s)
            st = c.stats()
            self.assertEqual(st["uid"]["uid"], os.getuid())
            self.assertEqual(st["uid"]["slots"], 1)
            self.assertGreaterEqual(st["uid"]["connections"], 2)  # and a probe not yet closed
            self.assertGreater(st["uid"]["held"]["inflight_bytes"], 0)  # the stats request
            self.assertEqual(st["uid"]["held"]["partial_bytes"], 0)
            # the slot's state went out as an answer: 4 heads x 128 x 128 f32
            self.assertGreater(st["clients"]["peak"]["output_bytes"], H * 128 * 128 * 4)
            self.assertEqual(st["clients"]["stalled"], 0)
            self.assertEqual(st["clients"]["refused"], 0)
            self.assertEqual(st["clients"]["bounds"], bounds)
            other.close()
            c.close()
        finally:
            d.stop()

    def test_register_layer_created(self):
        self.assertFalse(self.c.register_layer("L", *self.layer, -5.0))
        A_log, dt_bias = self.layer
        self.assertTrue(self.c.register_layer("L2", A_log.tolist(), dt_bias, -3.0, scale=0.1))
        names = {l["name"]: l for l in self.c.layers()}
        self.assertAlmostEqual(names["L2"]["scale"], 0.1, places=6)
        self.c.drop_layer("L2")
        self.assertNotIn("L2", {l["name"] for l in self.c.layers()})

    def test_prefill_matches_reference(self):
        s, = self.c.alloc_slots(1)
        x = self.seq(77)
        res = self.c.prefill("L", [dict(x, slot=s, expect_pos=0)])
        self.assertEqual(res[0]["pos"], 77)
        out = res[0]["out"]
        self.assertEqual(out.shape, (77, H, 128))
        self.assertEqual(out.dtype, np.uint16)
        ref_out, ref_state = kda_reference(x, *self.layer)
        self.assertLess(rel_rms(kdaclient.from_bf16(out), ref_out), OUT_TOL)
        state, pos = self.c.read_slot(s, with_pos=True)
        self.assertEqual(pos, 77)
        self.assertEqual(state.dtype, np.float32)
        self.assertLess(rel_rms(state, ref_state), STATE_TOL)
        bf = self.c.read_slot(s, dtype="bf16")
        self.assertEqual(bf.dtype, np.uint16)
        self.assertLess(rel_rms(kdaclient.from_bf16(bf), state), 0.01)

    def test_out_given(self):
        s1, s2 = self.c.alloc_slots(2)
        x = self.seq(33)
        out = np.zeros((33, H, 128), np.uint16)
        res = self.c.prefill("L", [dict(x, slot=s1, out=out)])
        self.assertIs(res[0]["out"], out)
        ref = self.c.prefill("L", [dict(x, slot=s2)])[0]["out"]
        np.testing.assert_array_equal(out, ref)

    def test_chunked_continuation(self):
        """300 + 300 + 400 tokens on one slot equal 1000 at once (and the float64 loop)."""
        one, chunked = self.c.alloc_slots(2)
        x = self.seq(1000)
        whole = self.c.prefill("L", [dict(x, slot=one)])[0]["out"]
        parts = []
        for a, b in ((0, 300), (300, 600), (600, 1000)):
            r = self.c.prefill("L", [dict(slice_seq(x, a, b), slot=chunked, expect_pos=a)])
            self.assertEqual(r[0]["pos"], b)
            parts.append(r[0]["out"])
        parts = np.concatenate(parts)
        self.assertLess(rel_rms(kdaclient.from_bf16(parts), kdaclient.from_bf16(whole)), OUT_TOL)
        s1, s2 = self.c.read_slot(one), self.c.read_slot(chunked)
        self.assertLess(rel_rms(s2, s1), STATE_TOL)
        ref_out, ref_state = kda_reference(x, *self.layer)
        self.assertLess(rel_rms(kdaclient.from_bf16(parts), ref_out), OUT_TOL)
        self.assertLess(rel_rms(s2, ref_state), STATE_TOL)

    def test_many_sequences_and_len0(self):
        slots = self.c.alloc_slots(3)
        xs = [self.seq(n) for n in (5, 64, 19)]
        seqs = [dict(x, slot=s) for x, s in zip(xs, slots)]
        res = self.c.prefill("L", seqs)
        self.assertEqual([r["pos"] for r in res], [5, 64, 19])
        # a sequence without tokens only checks its position
        res = self.c.prefill("L", [{"slot": slots[1], "expect_pos": 64}])
        self.assertEqual(res[0]["pos"], 64)
        self.assertIsNone(res[0]["out"])
        res = self.c.prefill("L", [{"slot": slots[1], "fresh": True}])
        self.assertEqual(res[0]["pos"], 0)

    def test_slots(self):
        a, b = self.c.alloc_slots(2)
        x = self.seq(10)
        self.c.prefill("L", [dict(x, slot=a)])
        dst, pos = self.c.fork_slot(a)
        self.assertEqual(pos, 10)
        np.testing.assert_array_equal(self.c.read_slot(dst), self.c.read_slot(a))
        st = np.full((H, 128, 128), 0.5, np.float32)
        self.c.write_slot(b, st, pos=42)
        got, pos = self.c.read_slot(b, with_pos=True)
        self.assertEqual(pos, 42)
        np.testing.assert_array_equal(got, st)
        self.c.write_slot(b, kdaclient.to_bf16(st), pos=7)     # bf16 bits
        np.testing.assert_array_equal(self.c.read_slot(b), st)
        self.c.reset_slots([b])
        self.assertEqual(self.c.slot_info([b])[0]["pos"], 0)
        e, = self.c.alloc_slots(1, zero=False)
        self.assertEqual(self.c.slot_info(e)[0]["status"], "empty")
        self.c.free_slots([a, b, dst, e])
        self.assertEqual(self.c.slot_info(), [])

    def test_staging_large_host_arrays(self):
        """Host arrays over inline_max travel through a shared-memory staging buffer."""
        s1, s2 = self.c.alloc_slots(2)
        x = self.seq(300)
        before = self.c.stats()["transport_bytes"]
        with self.d.connect(inline_max=64 << 10) as small:
            small.register_layer("L", *self.layer, -5.0)
            t1, = small.alloc_slots(1)
            staged = small.prefill("L", [dict(x, slot=t1)])[0]["out"]
            self.assertGreaterEqual(small.regions()["staging"], 1)
            state_staged = small.read_slot(t1)
        after = self.c.stats()["transport_bytes"]
        nbytes = 300 * H * (4 * 256 + 2)
        self.assertGreaterEqual(after["shm"]["in"] - before["shm"]["in"], nbytes)
        inline = self.c.prefill("L", [dict(x, slot=s2)])[0]["out"]
        np.testing.assert_array_equal(staged, inline)
        np.testing.assert_array_equal(state_staged, self.c.read_slot(s2))

    def test_shared_arrays_travel_without_copy(self):
        s1, s2 = self.c.alloc_slots(2)
        T = 64
        x = self.seq(T)
        arena = self.c.shared_array((5 * T * H * 128 + T * H,), np.uint16)
        shared = {}
        off = 0
        for n in ("q", "k", "v", "g"):
            shared[n] = arena[off:off + T * H * 128].reshape(T, H, 128)
            shared[n][...] = x[n]
            off += T * H * 128
        shared["beta"] = arena[off:off + T * H].reshape(T, H)
        shared["beta"][...] = x["beta"]
        off += T * H
        out = arena[off:off + T * H * 128].reshape(T, H, 128)
        before = self.c.stats()["transport_bytes"]
        res = self.c.prefill("L", [dict(shared, slot=s1, out=out)])
        after = self.c.stats()["transport_bytes"]
        self.assertEqual(after["inline"]["in"], before["inline"]["in"])
        self.assertEqual(after["inline"]["out"], before["inline"]["out"])
        self.assertEqual(after["shm"]["in"] - before["shm"]["in"], T * H * (4 * 256 + 2))
        self.assertEqual(after["shm"]["out"] - before["shm"]["out"], T * H * 256)
        ref = self.c.prefill("L", [dict(x, slot=s2)])[0]["out"]
        np.testing.assert_array_equal(res[0]["out"], ref)
        self.assertEqual(self.c.regions()["shared"], 1)

    def test_dlpack_host(self):
        """A host array offered only through __dlpack__ (as a CPU torch tensor is)."""
        class OnlyDLPack:
            def __init__(self, a):
                self.a = a

            def __dlpack__(self, stream=None):
                return self.a.__dlpack__()

            def __dlpack_device__(self):
                return self.a.__dlpack_device__()

        s1, s2 = self.c.alloc_slots(2)
        x = self.seq(20)
        wrapped = {n: OnlyDLPack(a.view(np.int16)) for n, a in x.items()}
        a = self.c.prefill("L", [dict(wrapped, slot=s1)])[0]["out"]
        b = self.c.prefill("L", [dict(x, slot=s2)])[0]["out"]
        np.testing.assert_array_equal(a, b)

    def test_bad_arrays(self):
        s, = self.c.alloc_slots(1)
        x = self.seq(8)
        with self.assertRaisesRegex(TypeError, r"seqs\[0\]\.q: .*float32.*bf16"):
            self.c.prefill("L", [dict(x, slot=s, q=np.zeros((8, H, 128), np.float32))])
        with self.assertRaisesRegex(TypeError, r"seqs\[0\]\.k: float16 elements"):
            self.c.prefill("L", [dict(x, slot=s, k=np.zeros((8, H, 128), np.float16))])
        with self.assertRaisesRegex(ValueError, r"seqs\[0\]\.beta: .*bytes"):
            self.c.prefill("L", [dict(x, slot=s, beta=x["beta"][:4])])
        with self.assertRaisesRegex(ValueError, r"unknown key 'expected_pos'"):
            self.c.prefill("L", [dict(x, slot=s, expected_pos=0)])
        with self.assertRaisesRegex(ValueError, r"seqs\[0\]\.slot: missing"):
            self.c.prefill("L", [dict(x)])
        frozen = np.zeros((8, H, 128), np.uint16)
        frozen.setflags(write=False)
        with self.assertRaisesRegex(TypeError, r"seqs\[0\]\.out: an output must be writable"):
            self.c.prefill("L", [dict(x, slot=s, out=frozen)])
        with self.assertRaisesRegex(TypeError, r"seqs\[0\]\.out: an output must be writable"):
            self.c.prefill("L", [dict(x, slot=s, out=np.zeros((H, 128, 8), np.uint16).T)])
        # strided input: copied to a contiguous array, then sent
        wide = np.zeros((8, H, 256), np.uint16)
        wide[..., ::2] = x["q"]
        r = self.c.prefill("L", [dict(x, slot=s, q=wide[..., ::2], expect_pos=0)])
        self.assertEqual(r[0]["pos"], 8)
        self.assertEqual(self.c.slot_info(s)[0]["pos"], 8)   # the failures changed nothing

    @unittest.skipUnless(__import__("importlib").util.find_spec("ml_dtypes"), "no ml_dtypes")
    def test_ml_dtypes_bfloat16(self):
        import ml_dtypes
        s1, s2 = self.c.alloc_slots(2)
        x = self.seq(9)
        bf = {n: a.view(ml_dtypes.bfloat16) for n, a in x.items()}
        a = self.c.prefill("L", [dict(bf, slot=s1)])[0]["out"]
        b = self.c.prefill("L", [dict(x, slot=s2)])[0]["out"]
        np.testing.assert_array_equal(a, b)

    @unittest.skipUnless(__import__("importlib").util.find_spec("torch"), "no PyTorch")
    def test_torch_cpu_tensors(self):
        """torch.bfloat16 host tensors through DLPack, out written in place."""
        import torch
        s1, s2 = self.c.alloc_slots(2)
        x = self.seq(12)
        t = {n: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for n, a in x.items()}
        out = torch.empty((12, H, 128), dtype=torch.bfloat16)
        r = self.c.prefill("L", [dict(t, slot=s1, out=out)])
        self.assertIs(r[0]["out"], out)
        ref = self.c.prefill("L", [dict(x, slot=s2)])[0]["out"]
        np.testing.assert_array_equal(out.view(torch.int16).numpy().view(np.uint16), ref)
        with self.assertRaisesRegex(TypeError, r"seqs\[0\]\.v: .*DLPack code 2, 32 bits"):
            self.c.prefill("L", [dict(t, slot=s1, v=torch.zeros((12, H, 128)))])

    def test_threads_share_a_client(self):
        slots = self.c.alloc_slots(4)
        xs = [self.seq(50) for _ in slots]
        results = [None] * 4

        def work(i):
            for _ in range(5):
                self.c.reset_slots([slots[i]])
                results[i] = self.c.prefill("L", [dict(xs[i], slot=slots[i], expect_pos=0)])

        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        check, = self.c.alloc_slots(1)
        for i in range(4):
            ref = self.c.prefill("L", [dict(xs[i], slot=check, fresh=True)])[0]["out"]
            np.testing.assert_array_equal(results[i][0]["out"], ref)

    def test_context_manager_and_close(self):
        with self.d.connect() as c:
            self.assertFalse(c.closed)
            self.assertTrue(c.path.endswith("kdad.sock"))
        self.assertTrue(c.closed)
        with self.assertRaises(kdaclient.InvalidArgument):
            c.alloc_slots(1)
        c.close()   # twice is fine


if __name__ == "__main__":
    unittest.main()
