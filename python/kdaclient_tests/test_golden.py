"""Every golden case through the Python API, inline and through shared-memory staging."""
import os
import unittest

import numpy as np

import kdaclient
from . import Daemon, golden_cases, read_safetensors, rel_rms, GOLDEN_DIR, OUT_TOL, STATE_TOL

CASES = golden_cases()


@unittest.skipUnless(CASES, "no golden cases in %s (set KDAD_GOLDEN_DIR)" % GOLDEN_DIR)
class GoldenTest(unittest.TestCase):
    daemons = {}

    @classmethod
    def tearDownClass(cls):
        daemons, cls.daemons = list(cls.daemons.values()), {}
        errors = []
        for d in daemons:
            try:
                d.stop()
            except RuntimeError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def daemon(self, heads):
        if heads not in self.daemons:
            self.daemons[heads] = Daemon(heads=heads).start()
        return self.daemons[heads]

    def run_case(self, path, inline_max):
        t, meta = read_safetensors(path)
        H = int(meta["H"])
        cu = t["cu_seqlens"]
        N = len(cu) - 1
        with self.daemon(H).connect(inline_max=inline_max) as c:
            name = "golden." + meta["case"]
            c.register_layer(name, t["A_log"], t["dt_bias"], float(meta["lower_bound"]),
                             scale=float(meta["scale"]))
            slots = c.alloc_slots(N)
            if "initial_state" in t:
                for n in range(N):
                    c.write_slot(slots[n], t["initial_state"][n])   # f32 or bf16 bits
            seqs = []
            for n in range(N):
                a, b = int(cu[n]), int(cu[n + 1])
                s = {"slot": slots[n], "expect_pos": 0}
                if b > a:
                    s.update({f: t[f][a:b] for f in ("q", "k", "v", "g", "beta")})
                seqs.append(s)
            res = c.prefill(name, seqs)
            for n in range(N):
                self.assertEqual(res[n]["pos"], int(cu[n + 1] - cu[n]))
            out = np.concatenate([r["out"] for r in res if r["out"] is not None])
            state = np.stack([c.read_slot(s, dtype="f32") for s in slots])
            c.free_slots(slots)
            stats = c.stats()["transport_bytes"]
        out_err = rel_rms(kdaclient.from_bf16(out), t["expected_out"])
        state_err = rel_rms(state, t["expected_final_state"])
        out_bound = max(OUT_TOL, float(meta.get("fla_out_err", 0)))
        state_bound = max(STATE_TOL, float(meta.get("fla_state_err", 0)))
        self.assertLessEqual(out_err, out_bound, "%s: output rel RMS" % meta["case"])
        self.assertLessEqual(state_err, state_bound, "%s: state rel RMS" % meta["case"])
        return stats

    def test_inline(self):
        for path in CASES:
            with self.subTest(case=os.path.basename(path)):
                self.run_case(path, inline_max=None)

    def test_staged(self):
        """The same with every host array through a shared-memory staging buffer."""
        for path in CASES:
            with self.subTest(case=os.path.basename(path)):
                before = self.run_case(path, inline_max=1)
                self.assertGreater(before["shm"]["in"], 0)


if __name__ == "__main__":
    unittest.main()
