"""Stream-ordered prefills (Client.prefill_on_stream) with the ready word written by the host
(stream=None), against a kdad on the CPU backend: the request waits for its ready word, its
done word and response, failures (the daemon's error, READY_TIMEOUT, a daemon that dies)
releasing the done word with the failure bit and raising at result(), awaited handles of
AsyncClient.prefill_on_stream, and the arguments refused.  The CUDA stream form is in
test_cuda.py."""
import asyncio
import threading
import time
import unittest

import numpy as np

import kdaclient
from . import Daemon, DaemonTestCase, rand_layer, rand_seq

H = 4
FIELDS = ("q", "k", "v", "g", "beta")
CONFIG = "batching:\n  ready_timeout_ms: 300\n"


def place(arena, off, x, with_out=True):
    """Copies seq x into arena (uint16) from off at 16-byte aligned offsets; returns the
    placed seq (views) and the next offset."""
    placed = {}
    for name in FIELDS + (("out",) if with_out else ()):
        shape = x["q"].shape if name == "out" else x[name].shape
        size = int(np.prod(shape))
        placed[name] = arena[off:off + size].reshape(shape)
        placed[name][...] = 0 if name == "out" else x[name]
        off += (size + 7) // 8 * 8
    return placed, off


class OrderedTest(DaemonTestCase):
    DAEMON = dict(heads=H, config=CONFIG)
    SEED = 13
    LAYER = "O"

    def setUp(self):
        super().setUp()
        self.arena = self.c.shared_array(1 << 20)
        self.off = 0

    def seq(self, T):
        x = rand_seq(self.rng, T, H)
        placed, self.off = place(self.arena, self.off, x)
        return x, placed

    def test_feature(self):
        self.assertIn("prefill.semaphores", self.c.hello()["features"])

    def test_waits_for_ready_then_equals_prefill(self):
        x, placed = self.seq(40)
        s, ref_slot = self.c.alloc_slots(2)
        h = self.c.prefill_on_stream("O", [dict(placed, slot=s, expect_pos=0)], None)
        time.sleep(0.1)
        self.assertFalse(h.done())
        self.assertEqual(h.done_word(), 0)
        info, = self.c.slot_info(s)
        self.assertEqual((info["pos"], info["queued"]), (0, 1))   # admitted, gated
        h.set_ready()
        res = h.result(timeout=30)
        self.assertTrue(h.done())
        self.assertEqual(h.done_word(), 1)
        self.assertEqual(res[0]["pos"], 40)
        self.assertIs(res[0]["out"], placed["out"])
        self.assertGreater(h.timings["run_us"], 0)
        ref = self.c.prefill("O", [dict(x, slot=ref_slot)])[0]["out"]
        np.testing.assert_array_equal(placed["out"], ref)
        np.testing.assert_array_equal(self.c.read_slot(s), self.c.read_slot(ref_slot))

    def test_chained_layers_in_flight(self):
        """Eight requests on one slot sent up front, each set ready in turn from another
        thread: they run in order, each continuing the last."""
        s, ref_slot = self.c.alloc_slots(2)
        chunks = [self.seq(8) for _ in range(8)]
        hs = [self.c.prefill_on_stream("O", [dict(p, slot=s, expect_pos=8 * i)], None)
              for i, (_, p) in enumerate(chunks)]
        t = threading.Thread(target=lambda: [h.set_ready() for h in reversed(hs)])
        t.start()
        t.join()
        for i, h in enumerate(hs):
            self.assertEqual(h.result(timeout=30)[0]["pos"], 8 * (i + 1))
        for x, p in chunks:
            ref = self.c.prefill("O", [dict(x, slot=ref_slot)])[0]["out"]
            np.testing.assert_array_equal(p["out"], ref)

    def test_completed_by_another_call(self):
        """A thread waiting in result() while this thread's blocking calls take the response
        off the socket: the waiter still returns."""
        x, placed = self.seq(16)
        s, other = self.c.alloc_slots(2)
        h = self.c.prefill_on_stream("O", [dict(placed, slot=s)], None)
        got = []
        t = threading.Thread(target=lambda: got.append(h.result(timeout=30)))
        t.start()
        h.set_ready()
        for _ in range(20):
            self.c.prefill("O", [dict(x, slot=other, fresh=True)])
        t.join(30)
        self.assertFalse(t.is_alive())
        self.assertEqual(got[0][0]["pos"], 16)

    def test_failure_sets_the_bit_and_raises(self):
        _, placed = self.seq(4)
        s, = self.c.alloc_slots(1)
        h = self.c.prefill_on_stream("O", [dict(placed, slot=s, expect_pos=3)], None)
        h.set_ready()
        with self.assertRaises(kdaclient.PositionMismatch):
            h.result(timeout=30)
        self.assertEqual(h.done_word(), -1)
        self.assertIsNone(h.timings)
        h2 = self.c.prefill_on_stream("nope", [dict(placed, slot=s)], None)
        with self.assertRaises(kdaclient.UnknownLayer):
            h2.result(timeout=30)
        self.assertEqual(h2.done_word(), -1)
        # the slot serves on: a request after the failed ones runs
        h3 = self.c.prefill_on_stream("O", [dict(placed, slot=s, expect_pos=0)], None)
        h3.set_ready()
        self.assertEqual(h3.result(timeout=30)[0]["pos"], 4)

    def test_ready_timeout(self):
        _, placed = self.seq(4)
        s, = self.c.alloc_slots(1)
        h = self.c.prefill_on_stream("O", [dict(placed, slot=s)], None)
        with self.assertRaises(TimeoutError):
            h.result(timeout=0.05)
        with self.assertRaises(kdaclient.ReadyTimeout) as cm:
            h.result(timeout=30)
        self.assertEqual(cm.exception.code, -23)
        self.assertEqual(h.done_word(), -1)
        self.assertEqual(self.c.slot_info(s)[0]["pos"], 0)

    def test_asyncio_completes_the_handle(self):
        """AsyncClient's reader completes the handle without an await."""
        _, placed = self.seq(6)
        s, = self.c.alloc_slots(1)

        async def run():
            async with kdaclient.AsyncClient(self.c) as ac:
                h = ac.prefill_on_stream("O", [dict(placed, slot=s)], None)
                h.set_ready()
                for _ in range(3000):
                    if h._finished:
                        return h.result()
                    await asyncio.sleep(0.01)
        self.assertEqual(asyncio.run(run())[0]["pos"], 6)

    def test_await(self):
        """await h: the response once it arrives, the loop running meanwhile; equal to the
        blocking prefill's; awaited again, or by several tasks, the same result."""
        x, placed = self.seq(24)
        s, ref_slot = self.c.alloc_slots(2)

        async def run():
            async with kdaclient.AsyncClient(self.c) as ac:
                h = ac.prefill_on_stream("O", [dict(placed, slot=s, expect_pos=0)], None)
                ticks = 0

                async def tick():          # the loop is not blocked by the await
                    nonlocal ticks
                    while not h._finished:
                        ticks += 1
                        await asyncio.sleep(0.005)
                ticker = asyncio.ensure_future(tick())
                asyncio.get_running_loop().call_later(0.1, h.set_ready)
                first, second = await asyncio.wait_for(asyncio.gather(h, h), 30)
                await ticker
                again = await h            # finished: at once
                return h, first, second, again, ticks
        h, first, second, again, ticks = asyncio.run(run())
        self.assertGreater(ticks, 5)
        self.assertIs(first, second)
        self.assertIs(first, again)
        self.assertEqual(first[0]["pos"], 24)
        self.assertIs(first[0]["out"], placed["out"])
        self.assertEqual(h.done_word(), 1)
        self.assertGreater(h.timings["run_us"], 0)
        ref = self.c.prefill("O", [dict(x, slot=ref_slot)])[0]["out"]
        np.testing.assert_array_equal(placed["out"], ref)

    def test_await_chained_and_failed(self):
        """Four requests on one slot and a fifth that fails, gathered: each awaits its own
        response; the failure raises its class at its await; a cancelled await leaves the
        request in flight, to be awaited again."""
        s, = self.c.alloc_slots(1)
        chunks = [self.seq(8)[1] for _ in range(4)]

        async def run():
            async with kdaclient.AsyncClient(self.c) as ac:
                hs = [ac.prefill_on_stream("O", [dict(p, slot=s, expect_pos=8 * i)], None)
                      for i, p in enumerate(chunks)]
                bad = ac.prefill_on_stream("O", [dict(chunks[0], slot=s, expect_pos=5)], None)
                with self.assertRaises(asyncio.TimeoutError):   # not ready: still waiting
                    await asyncio.wait_for(hs[0], 0.05)
                self.assertFalse(hs[0]._finished)
                for h in hs + [bad]:
                    h.set_ready()
                res = await asyncio.wait_for(asyncio.gather(*hs, return_exceptions=True), 30)
                with self.assertRaises(kdaclient.PositionMismatch):
                    await asyncio.wait_for(bad, 30)
                return res, bad
        res, bad = asyncio.run(run())
        self.assertEqual([r[0]["pos"] for r in res], [8, 16, 24, 32])
        self.assertEqual(bad.done_word(), -1)

    def test_await_needs_an_async_client(self):
        _, placed = self.seq(4)
        s, = self.c.alloc_slots(1)
        h = self.c.prefill_on_stream("O", [dict(placed, slot=s)], None)

        async def run():
            await h
        with self.assertRaisesRegex(TypeError, "only AsyncClient.prefill_on_stream's handles"):
            asyncio.run(run())

        async def closed():
            ac = kdaclient.AsyncClient(self.c)
            h2 = ac.prefill_on_stream("O", [dict(placed, slot=s)], None)
            ac.close()                                  # the client is ours and stays open
            with self.assertRaisesRegex(RuntimeError, "was closed; call result"):
                await h2
            return h2
        h2 = asyncio.run(closed())
        h.set_ready()
        h2.set_ready()
        self.assertEqual(h.result(timeout=30)[0]["pos"], 4)
        self.assertEqual(h2.result(timeout=30)[0]["pos"], 8)

    def test_close_fails_the_awaits(self):
        """close() of an AsyncClient fails its handles' awaits in progress, whoever owns the
        client: with RuntimeError when the client is not its own (the request stays in
        flight and result() gives its answer), with Canceled when it is (closing the client
        fails the request)."""
        _, placed = self.seq(4)
        s, = self.c.alloc_slots(1)

        async def wait(h):
            return await h

        async def not_owned():
            ac = kdaclient.AsyncClient(self.c)
            h = ac.prefill_on_stream("O", [dict(placed, slot=s)], None)
            tasks = [asyncio.ensure_future(wait(h)) for _ in range(2)]
            await asyncio.sleep(0)                      # both awaits in progress
            ac.close()
            return h, await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        h, got = asyncio.run(not_owned())
        for r in got:
            self.assertIsInstance(r, RuntimeError)
            self.assertRegex(str(r), "was closed; call result")
        h.set_ready()
        self.assertEqual(h.result(timeout=30)[0]["pos"], 4)

        async def owned():
            ac = kdaclient.AsyncClient(path=self.d.sock, timeout=120)
            ac.register_layer("O", *self.layer, -5.0)
            p, _ = place(ac.shared_array(1 << 16), 0, rand_seq(self.rng, 4, H))
            h = ac.prefill_on_stream("O", [dict(p, slot=ac.alloc_slots(1)[0])], None)
            t = asyncio.ensure_future(wait(h))
            await asyncio.sleep(0)
            ac.close()
            return h, await asyncio.wait_for(asyncio.gather(t, return_exceptions=True), 30)
        h, (r,) = asyncio.run(owned())
        self.assertIsInstance(r, kdaclient.Canceled)
        self.assertEqual(h.done_word(), -1)

    def test_refused(self):
        x, placed = self.seq(4)
        s, = self.c.alloc_slots(1)
        with self.assertRaisesRegex(ValueError, r"seqs\[0\]\.q: .*host memory outside "
                                                r"shared_array"):
            self.c.prefill_on_stream("O", [dict(x, slot=s)], None)
        no_out = {n: placed[n] for n in FIELDS}
        with self.assertRaisesRegex(ValueError, r"seqs\[0\]\.out: missing, or"):
            self.c.prefill_on_stream("O", [dict(no_out, slot=s)], None)
        with self.assertRaisesRegex(TypeError, "not a CUDA stream"):
            self.c.prefill_on_stream("O", [dict(placed, slot=s)], "stream")
        h = self.c.prefill_on_stream("O", [dict(placed, slot=s)], None)
        h.set_ready()
        h.result(timeout=30)
        h.set_ready()                  # again, after completion: harmless
        self.assertEqual(self.c.slot_info(s)[0]["pos"], 4)


class OrderedDisconnectTest(unittest.TestCase):
    def waiting(self, seed, check):
        """A kdad of its own, stopped after the test (check: its exit checked), and a client
        with a host-ordered prefill waiting for its ready word: (kdad, client, handle)."""
        d = Daemon(heads=H).start()
        self.addCleanup(d.stop, check=check)
        c = d.connect()
        rng = np.random.default_rng(seed)
        c.register_layer("O", *rand_layer(rng, H), -5.0)
        placed, _ = place(c.shared_array(1 << 16), 0, rand_seq(rng, 4, H))
        s, = c.alloc_slots(1)
        return d, c, c.prefill_on_stream("O", [dict(placed, slot=s)], None)

    def test_daemon_dies(self):
        """kdad killed with a request waiting for its ready word: result() raises
        Disconnected and the done word carries the failure bit (libkdaclient wrote it)."""
        d, c, h = self.waiting(17, check=False)
        d.proc.kill()
        d.proc.wait()
        with self.assertRaises(kdaclient.Disconnected):
            h.result(timeout=30)
        self.assertEqual(h.done_word(), -1)
        c.close()

    def test_close_cancels(self):
        _, c, h = self.waiting(19, check=True)
        c.close()
        with self.assertRaises(kdaclient.Canceled):
            h.result()
        self.assertEqual(h.done_word(), -1)      # libkdaclient wrote the failure bit


if __name__ == "__main__":
    unittest.main()
