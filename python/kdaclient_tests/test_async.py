"""AsyncClient: many requests in flight on one connection, driven by loop.add_reader."""
import asyncio
import unittest
from unittest import mock

import numpy as np

import kdaclient
from . import DaemonTestCase, rand_seq, slice_seq

H = 4


class AsyncTest(DaemonTestCase):
    DAEMON = dict(heads=H)
    SEED = 11

    def test_32_in_flight(self):
        xs = [rand_seq(self.rng, int(n), H) for n in self.rng.integers(1, 200, 32)]

        async def main():
            async with kdaclient.AsyncClient(path=self.d.sock, timeout=120) as ac:
                ac.register_layer("A", *self.layer, -5.0)
                slots = ac.alloc_slots(32)
                tasks = [asyncio.ensure_future(ac.prefill("A", [dict(x, slot=s, expect_pos=0)]))
                         for x, s in zip(xs, slots)]
                await asyncio.sleep(0)        # every task has submitted its request
                inflight = ac.client.inflight
                results = await asyncio.gather(*tasks)
                return inflight, results, ac.client.inflight

        inflight, results, after = asyncio.run(main())
        self.assertEqual(inflight, 32)
        self.assertEqual(after, 0)
        with self.d.connect() as c:
            c.register_layer("A", *self.layer, -5.0)
            s, = c.alloc_slots(1)
            for x, r in zip(xs, results):
                self.assertEqual(r[0]["pos"], len(x["q"]))
                ref = c.prefill("A", [dict(x, slot=s, fresh=True)])[0]["out"]
                np.testing.assert_array_equal(r[0]["out"], ref)

    def test_pipelined_chunks_and_errors(self):
        """Chunks of one sequence pipelined with expect_pos; a failed chunk fails the rest."""
        x = rand_seq(self.rng, 1000, H)

        async def main():
            async with kdaclient.AsyncClient(path=self.d.sock, timeout=120) as ac:
                ac.register_layer("A", *self.layer, -5.0)
                a, b = ac.alloc_slots(2)
                cuts = [(0, 300), (300, 600), (600, 1000)]
                good = await asyncio.gather(*(ac.prefill("A", [dict(slice_seq(x, p, q), slot=a,
                                                                    expect_pos=p)])
                                              for p, q in cuts))
                whole = await ac.prefill("A", [dict(x, slot=b)])
                bad = await asyncio.gather(
                    ac.prefill("A", [dict(slice_seq(x, 0, 300), slot=b, expect_pos=5)]),
                    ac.prefill("A", [dict(slice_seq(x, 300, 600), slot=b, expect_pos=300)]),
                    ac.prefill("nope", [dict(slice_seq(x, 0, 10), slot=b)]),
                    return_exceptions=True)
                return good, whole, bad

        good, whole, bad = asyncio.run(main())
        self.assertEqual([g[0]["pos"] for g in good], [300, 600, 1000])
        parts = np.concatenate([g[0]["out"] for g in good])
        diff = kdaclient.from_bf16(parts) - kdaclient.from_bf16(whole[0]["out"])
        self.assertLess(np.sqrt(np.mean(diff ** 2)), 0.005)
        self.assertIsInstance(bad[0], kdaclient.PositionMismatch)
        self.assertIsInstance(bad[1], kdaclient.PositionMismatch)
        self.assertIsInstance(bad[2], kdaclient.UnknownLayer)

    def test_close_cancels(self):
        x = rand_seq(self.rng, 64, H)

        async def main():
            ac = kdaclient.AsyncClient(path=self.d.sock, timeout=120)
            ac.register_layer("A", *self.layer, -5.0)
            s, = ac.alloc_slots(1)
            t = asyncio.ensure_future(ac.prefill("A", [dict(x, slot=s)]))
            await asyncio.sleep(0)
            ac.close()
            return await asyncio.gather(t, return_exceptions=True)

        r, = asyncio.run(main())
        self.assertIsInstance(r, kdaclient.Canceled)

    def test_close_fails_the_awaits_of_a_client_not_owned(self):
        """close() of an AsyncClient driving a client it did not open: the prefill and step
        awaits in progress fail with Canceled (nothing reads their answers any more) and a
        later one is refused; the client serves on, its next call taking the dropped answers
        off the socket."""
        x = rand_seq(self.rng, 64, H)
        with self.d.connect() as c:
            c.register_layer("A", *self.layer, -5.0)
            a, b = c.alloc_slots(2)

            async def main():
                ac = kdaclient.AsyncClient(c)
                tasks = [asyncio.ensure_future(ac.prefill("A", [dict(x, slot=a)])),
                         asyncio.ensure_future(ac.step("A", [b], x["q"][:1], x["k"][:1],
                                                       x["v"][:1], x["g"][:1], x["beta"][:1]))]
                await asyncio.sleep(0)        # both submitted, neither answer read
                inflight = c.inflight
                ac.close()
                got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
                with self.assertRaisesRegex(RuntimeError, "the AsyncClient was closed"):
                    await ac.prefill("A", [dict(x, slot=a)])
                return inflight, got

            inflight, got = asyncio.run(main())
            self.assertEqual(inflight, 2)
            for r in got:
                self.assertIsInstance(r, kdaclient.Canceled)
            self.assertFalse(c.closed)
            with mock.patch("sys.unraisablehook") as hook:   # the dropped answers: no error
                after = c.prefill("A", [dict(slice_seq(x, 0, 8), slot=a, expect_pos=64)])
                stepped = c.step("A", [b], x["q"][1:2], x["k"][1:2], x["v"][1:2], x["g"][1:2],
                                 x["beta"][1:2], expect_pos=[1])
            hook.assert_not_called()
            self.assertEqual(after[0]["pos"], 72)     # the dropped requests ran
            self.assertEqual(stepped["pos"], [2])
            self.assertEqual(c.inflight, 0)


if __name__ == "__main__":
    unittest.main()
