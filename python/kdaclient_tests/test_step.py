"""Decode steps (Client.step, AsyncClient.step) against a kdad on the CPU backend: steps of
1-token sequences bit-equal to a prefill of those sequences, multi-token steps against the
float64 loop, expect_pos, kept states and the rollback of a speculative draft, arrays in
shared memory and through staging, and the arguments the package refuses."""
import asyncio
import unittest

import numpy as np

import kdaclient
from . import DaemonTestCase, kda_reference, rand_seq, rel_rms, OUT_TOL, STATE_TOL

H = 4
FIELDS = ("q", "k", "v", "g", "beta")


def packed(seqs):
    """A list of per-sequence tensors -> one packed tensor per input (tokens back to back)."""
    return {n: np.concatenate([s[n] for s in seqs]) for n in FIELDS}


def tokens(x, a, b):
    return {n: x[n][a:b] for n in FIELDS}


class StepTest(DaemonTestCase):
    DAEMON = dict(heads=H, slots=64)
    SEED = 11
    LAYER = "S"

    def primed(self, n, prompt=9):
        """Two sets of n slots holding the same state after a prompt of `prompt` tokens."""
        a = self.c.alloc_slots(n)
        b = self.c.alloc_slots(n)
        xs = [rand_seq(self.rng, prompt, H) for _ in range(n)]
        self.c.prefill("S", [dict(x, slot=s) for x, s in zip(xs, a)])
        self.c.prefill("S", [dict(x, slot=s) for x, s in zip(xs, b)])
        return a, b, xs

    def step(self, slots, x, **kw):
        return self.c.step("S", slots, x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)

    def test_feature(self):
        self.assertIn("step", self.c.hello()["features"])

    def test_one_token_steps_equal_prefill(self):
        """A decode loop of 1-token steps over 6 sequences: its outputs equal, bit for bit,
        1-token prefills of the same sequences, and its states theirs to float32 rounding
        (the step's recurrent kernel and the chunked prefill sum in different orders)."""
        n = 6
        a, b, _ = self.primed(n)
        for t in range(4):
            xs = [rand_seq(self.rng, 1, H) for _ in range(n)]
            res = self.step(a, packed(xs), expect_pos=[9 + t] * n)
            ref = self.c.prefill("S", [dict(x, slot=s) for x, s in zip(xs, b)])
            self.assertEqual(res["pos"], [10 + t] * n)
            self.assertEqual(res["out"].shape, (n, H, 128))
            self.assertEqual(res["out"].dtype, np.uint16)
            self.assertIsNone(res["states"])
            np.testing.assert_array_equal(res["out"], np.concatenate([r["out"] for r in ref]))
        for sa, sb in zip(a, b):
            self.assertLess(rel_rms(self.c.read_slot(sa), self.c.read_slot(sb)), 1e-6)
        t = self.c.last_timings
        self.assertGreater(t["run_us"], 0)

    def test_token_steps_equal_one_step(self):
        """Four 1-token steps equal one step of the 4 tokens, bit for bit (outputs, states)."""
        a, b, _ = self.primed(2)
        xs = [rand_seq(self.rng, 4, H) for _ in range(2)]
        outs = [self.step(a, packed([tokens(x, t, t + 1) for x in xs]))["out"] for t in range(4)]
        one = self.step(b, packed(xs), lens=[4, 4])
        self.assertEqual(one["pos"], [13, 13])
        for i in range(2):
            np.testing.assert_array_equal(one["out"][4 * i:4 * i + 4],
                                          np.stack([o[i] for o in outs]))
            np.testing.assert_array_equal(self.c.read_slot(a[i]), self.c.read_slot(b[i]))

    def test_multi_token_step_matches_reference(self):
        """Sequences of 1, 5, 16 and 3 tokens in one step: each against the float64 loop from
        its prompt's state, and its slot's position and state."""
        lens = [1, 5, 16, 3]
        slots = self.c.alloc_slots(len(lens))
        prompts = [rand_seq(self.rng, 20, H) for _ in lens]
        self.c.prefill("S", [dict(p, slot=s) for p, s in zip(prompts, slots)])
        drafts = [rand_seq(self.rng, L, H) for L in lens]
        out = np.zeros((sum(lens), H, 128), np.uint16)
        res = self.step(slots, packed(drafts), lens=lens, out=out)
        self.assertIs(res["out"], out)
        self.assertEqual(res["pos"], [20 + L for L in lens])
        start = 0
        for s, p, x, L in zip(slots, prompts, drafts, lens):
            _, st0 = kda_reference(p, *self.layer)
            ref_out, ref_state = kda_reference(x, *self.layer, state=st0)
            self.assertLess(rel_rms(kdaclient.from_bf16(out[start:start + L]), ref_out), OUT_TOL)
            self.assertLess(rel_rms(self.c.read_slot(s), ref_state), STATE_TOL)
            start += L

    def test_lens_int_and_numpy(self):
        a, b, _ = self.primed(3)
        x = rand_seq(self.rng, 6, H)
        r1 = self.step(a, x, lens=2)
        r2 = self.step(b, x, lens=np.array([2, 2, 2]), expect_pos=np.array([9, 9, 9]))
        self.assertEqual(r1["pos"], [11, 11, 11])
        np.testing.assert_array_equal(r1["out"], r2["out"])

    def test_expect_pos_mismatch_applies_nothing(self):
        a, _, _ = self.primed(3)
        x = rand_seq(self.rng, 3, H)
        with self.assertRaises(kdaclient.PositionMismatch) as cm:
            self.step(a, x, expect_pos=[9, 8, 9])
        self.assertIn("expect_pos", str(cm.exception))
        self.assertEqual([i["pos"] for i in self.c.slot_info(a)], [9, 9, 9])
        self.assertEqual(self.step(a, x, expect_pos=[9, 9, 9])["pos"], [10, 10, 10])

    def test_kept_states_and_rollback(self):
        """A draft of k = 5 tokens per sequence with the states kept; sequence i accepts
        j = i + 1 of them by writing state start + j - 1 back: the slot then equals, bit for
        bit, a slot that stepped only the j accepted tokens, and so do the next outputs."""
        k, n = 5, 4
        a, b, _ = self.primed(n)
        xs = [rand_seq(self.rng, k, H) for _ in range(n)]
        res = self.step(a, packed(xs), lens=k, states=True)
        states = res["states"]
        self.assertEqual(states.shape, (n * k, H, 128, 128))
        self.assertEqual(states.dtype, np.float32)   # the pool's dtype
        # the last kept state of each sequence is its slot's state
        for i, s in enumerate(a):
            np.testing.assert_array_equal(states[i * k + k - 1], self.c.read_slot(s))
        for i, s in enumerate(a):
            j = i + 1
            self.c.write_slot(s, states[i * k + j - 1], pos=9 + j)
        acc = self.step(b, packed([tokens(x, 0, i + 1) for i, x in enumerate(xs)]),
                        lens=[i + 1 for i in range(n)])
        # the draft's outputs of the accepted tokens are the accepted step's
        start = 0
        for i in range(n):
            np.testing.assert_array_equal(res["out"][i * k:i * k + i + 1],
                                          acc["out"][start:start + i + 1])
            start += i + 1
        for i, (sa, sb) in enumerate(zip(a, b)):
            sta, pa = self.c.read_slot(sa, with_pos=True)
            stb, pb = self.c.read_slot(sb, with_pos=True)
            self.assertEqual(pa, pb)
            self.assertEqual(pa, 9 + i + 1)
            np.testing.assert_array_equal(sta, stb)
        nxt = rand_seq(self.rng, n, H)
        np.testing.assert_array_equal(self.step(a, nxt)["out"], self.step(b, nxt)["out"])

    def test_states_in_shared_memory(self):
        """States and inputs in shared_array memory travel as regions (nothing inline)."""
        k, n = 3, 2
        a, b, _ = self.primed(n)
        T = k * n
        arena = self.c.shared_array(T * H * 128 * 128 + 8 * T * H * 128, dtype=np.float32)
        states = arena[:T * H * 128 * 128].reshape(T, H, 128, 128)
        bits = arena[T * H * 128 * 128:].view(np.uint16)
        x = rand_seq(self.rng, T, H)
        placed, off = {}, 0
        for name in FIELDS + ("out",):
            shape = x["q"].shape if name == "out" else x[name].shape
            size = int(np.prod(shape))
            placed[name] = bits[off:off + size].reshape(shape)
            if name != "out":
                placed[name][...] = x[name]
            off += (size + 7) // 8 * 8                 # 16-byte aligned offsets
        before = self.c.stats()["transport_bytes"]["inline"]["in"]
        res = self.step(a, placed, lens=k, out=placed["out"], states=states)
        after = self.c.stats()["transport_bytes"]["inline"]["in"]
        self.assertEqual(after, before)
        self.assertIs(res["states"], states)
        ref = self.step(b, x, lens=k, states=True)
        np.testing.assert_array_equal(placed["out"], ref["out"])
        np.testing.assert_array_equal(states, ref["states"])

    def test_staged_inputs(self):
        """Inputs above inline_max go through a staging buffer, with the same result."""
        small = self.d.connect(inline_max=4096)
        try:
            small.register_layer("S", *self.layer, -5.0)
            a = small.alloc_slots(8)
            b = self.c.alloc_slots(8)
            x = rand_seq(self.rng, 8, H)
            r1 = small.step("S", a, x["q"], x["k"], x["v"], x["g"], x["beta"])
            self.assertGreaterEqual(small.regions()["staging"], 1)
            r2 = self.step(b, x)
            np.testing.assert_array_equal(r1["out"], r2["out"])
        finally:
            small.close()

    def test_refused_arguments(self):
        s = self.c.alloc_slots(2)
        x = rand_seq(self.rng, 2, H)
        with self.assertRaisesRegex(ValueError, r"lens\[1\]: 17"):
            self.step(s, x, lens=[1, 17])
        with self.assertRaisesRegex(ValueError, "lens: 3 entries"):
            self.step(s, x, lens=[1, 1, 1])
        with self.assertRaisesRegex(ValueError, "expect_pos: 1 entries"):
            self.step(s, x, expect_pos=[0])
        with self.assertRaisesRegex(ValueError, r"q: .* 3 tokens"):
            self.step(s, x, lens=[1, 2])
        with self.assertRaisesRegex(TypeError, "states: 2-byte elements"):
            self.step(s, x, states=np.zeros((2, H, 128, 256), np.uint16))
        with self.assertRaisesRegex(TypeError, "beta: float32"):
            self.c.step("S", s, x["q"], x["k"], x["v"], x["g"], x["beta"].astype(np.float32))
        with self.assertRaises(kdaclient.InvalidParams):
            self.step([s[0], s[0]], x)                   # a slot twice
        with self.assertRaises(kdaclient.UnknownLayer):
            self.c.step("nope", s, x["q"], x["k"], x["v"], x["g"], x["beta"])
        self.c.free_slots(s[1])
        with self.assertRaises(kdaclient.StaleSlot):
            self.step(s, x)
        self.assertEqual([i["pos"] for i in self.c.slot_info(s[0])], [0])

    def test_async_steps(self):
        """16 steps in flight on one connection, each on its own slot, as blocking steps."""
        n = 16
        a, b, _ = self.primed(n, prompt=3)
        xs = [rand_seq(self.rng, 2, H) for _ in range(n)]

        async def run():
            async with kdaclient.AsyncClient(self.c) as ac:
                return await asyncio.gather(*(ac.step("S", [s], x["q"], x["k"], x["v"], x["g"],
                                                      x["beta"], lens=[2], expect_pos=[3])
                                              for s, x in zip(a, xs)))
        got = asyncio.run(run())
        for r, s, x in zip(got, b, xs):
            ref = self.step([s], x, lens=2)
            self.assertEqual(r["pos"], [5])
            np.testing.assert_array_equal(r["out"], ref["out"])

        async def fail():
            async with kdaclient.AsyncClient(self.c) as ac:
                x = xs[0]
                await ac.step("S", [a[0]], x["q"][:1], x["k"][:1], x["v"][:1], x["g"][:1],
                              x["beta"][:1], expect_pos=[0])
        with self.assertRaises(kdaclient.PositionMismatch):
            asyncio.run(fail())


if __name__ == "__main__":
    unittest.main()
