"""Each error class, raised by what causes it, with the daemon's message.

Codes no correct client can provoke from a healthy daemon (HELLO_REQUIRED, UNKNOWN_METHOD,
FRAME_TOO_LARGE, REGION_BOUNDS: the package checks ranges itself; DEVICE_FAILED, NO_MEMORY,
INTERNAL, BUSY; SYSTEM) are checked as classes only: name, code, retryable flag."""
import os
import signal
import socket
import tempfile
import threading
import time
import unittest

import numpy as np

import kdaclient
from . import Daemon, DaemonTestCase, rand_layer, rand_seq

H = 4
CONFIG = """
limits:
  max_batch_tokens: 1024
  max_slots_per_client: 8
"""


class ErrorClassesTest(unittest.TestCase):
    def test_table(self):
        rows = kdaclient._kdaclient.error_table()
        self.assertGreaterEqual(len(rows), 31)
        for name, code, retryable, _ in rows:
            cls = getattr(kdaclient, "".join(p.capitalize() for p in name.split("_")))
            self.assertTrue(issubclass(cls, kdaclient.Error))
            self.assertEqual((cls.name, cls.code), (name, code))
            e = cls("why", code, retryable)
            self.assertEqual(e.retryable, retryable)
            self.assertEqual(str(e), "%s: why" % name)
        self.assertEqual(kdaclient.PositionMismatch.code, -17)
        self.assertTrue(kdaclient.PoolFull("x", -30, True).retryable)


class DaemonErrorsTest(DaemonTestCase):
    DAEMON = dict(heads=H, slots=16, config=CONFIG)
    SEED = 3
    LAYER = "E"

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.x = rand_seq(cls.rng, 16, H)

    def check(self, cls, fn, pattern=None):
        with self.assertRaises(cls) as cm:
            fn()
        self.assertIsInstance(cm.exception, kdaclient.Error)
        self.assertEqual(cm.exception.code, cls.code)
        self.assertTrue(cm.exception.message)
        if pattern:
            self.assertRegex(cm.exception.message, pattern)
        return cm.exception

    def test_invalid_params(self):
        self.check(kdaclient.InvalidParams,
                   lambda: self.c.register_layer("bad name!", *self.layer, -5.0), "name")
        self.check(kdaclient.InvalidParams,
                   lambda: self.c.register_layer("E3", *self.layer, 0.5), "lower_bound")

    def test_limit_exceeded(self):
        s, = self.c.alloc_slots(1)
        big = rand_seq(np.random.default_rng(1), 1100, H)
        self.check(kdaclient.LimitExceeded, lambda: self.c.prefill("E", [dict(big, slot=s)]),
                   "1024")

    def test_unknown_layer(self):
        s, = self.c.alloc_slots(1)
        self.check(kdaclient.UnknownLayer, lambda: self.c.prefill("nope", [dict(self.x, slot=s)]))

    def test_layer_exists(self):
        a, d = self.layer
        self.check(kdaclient.LayerExists, lambda: self.c.register_layer("E", a + 1, d, -5.0))

    def test_unknown_slot(self):
        s, = self.c.alloc_slots(1)
        bad = (s >> 32 << 32) | 1000
        self.check(kdaclient.UnknownSlot, lambda: self.c.read_slot(bad))

    def test_stale_slot(self):
        s, = self.c.alloc_slots(1)
        self.c.free_slots([s])
        self.check(kdaclient.StaleSlot, lambda: self.c.prefill("E", [dict(self.x, slot=s)]))

    def test_position_mismatch(self):
        s, = self.c.alloc_slots(1)
        self.c.prefill("E", [dict(self.x, slot=s)])
        e = self.check(kdaclient.PositionMismatch,
                       lambda: self.c.prefill("E", [dict(self.x, slot=s, expect_pos=0)]),
                       "position 16, expect_pos 0")
        self.assertFalse(e.retryable)

    def test_state_lost(self):
        s, = self.c.alloc_slots(1, zero=False)
        self.check(kdaclient.StateLost, lambda: self.c.read_slot(s))
        self.check(kdaclient.StateLost, lambda: self.c.prefill("E", [dict(self.x, slot=s)]))
        self.c.prefill("E", [dict(self.x, slot=s, fresh=True)])    # fresh repairs it

    def test_region_invalid(self):
        fd = os.memfd_create("unsealed")      # no F_SEAL_SHRINK: refused
        os.ftruncate(fd, 4096)
        try:
            self.check(kdaclient.RegionInvalid,
                       lambda: self.c._add_shared(fd, 0, 4096, None), "seal")
        finally:
            os.close(fd)

    def test_permission_denied(self):
        s, = self.c.alloc_slots(1)
        with self.d.connect() as other:
            self.check(kdaclient.PermissionDenied, lambda: other.read_slot(s))

    def test_not_supported(self):
        class FakeCuda:     # device memory offered to a CPU daemon
            __cuda_array_interface__ = {"data": (1 << 40, False), "shape": (16, H, 128),
                                        "typestr": "<u2", "version": 3}
        s, = self.c.alloc_slots(1)
        self.check(kdaclient.NotSupported,
                   lambda: self.c.prefill("E", [dict(self.x, slot=s, q=FakeCuda())]))

    def test_quota_exceeded(self):
        self.c.alloc_slots(5)
        self.check(kdaclient.QuotaExceeded, lambda: self.c.alloc_slots(4))

    def test_pool_full(self):
        with self.d.connect() as a, self.d.connect() as b:
            a.alloc_slots(8)
            b.alloc_slots(8)
            e = self.check(kdaclient.PoolFull, lambda: self.c.alloc_slots(1))
            self.assertTrue(e.retryable)

    def test_invalid_argument(self):
        c = self.d.connect()
        c.close()
        self.check(kdaclient.InvalidArgument, lambda: c.hello())


class ConnectionErrorsTest(unittest.TestCase):
    def test_not_running(self):
        d = tempfile.mkdtemp()
        self.assertRaises(kdaclient.NotRunning, kdaclient.connect, os.path.join(d, "none.sock"))
        os.rmdir(d)

    def test_connect(self):
        with tempfile.NamedTemporaryFile() as f:   # a path that is no socket: refused
            with self.assertRaises((kdaclient.Connect, kdaclient.NotRunning)):
                kdaclient.connect(f.name)

    def _fake(self, reply):
        """A server that answers the hello frame with reply(body) (bytes), or not at all."""
        d = tempfile.mkdtemp()
        path = os.path.join(d, "fake.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)

        def serve():
            conn, _ = srv.accept()
            n = int.from_bytes(conn.recv(4), "big")
            body = b""
            while len(body) < n:
                body += conn.recv(n - len(body))
            out = reply(body)
            if out is not None:
                conn.sendall(out)
            time.sleep(1.0)
            conn.close()

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        return path, srv, t

    def test_protocol(self):
        path, srv, t = self._fake(lambda body: b"\x00\x00\x00\x01\xc0")   # a nil body
        with self.assertRaises(kdaclient.Protocol):
            kdaclient.connect(path, timeout=5)
        srv.close()

    def test_unsupported_version(self):
        def reply(body):
            rid = body[2]   # [0, id, "hello", ...]: a small id is one fixint byte
            err = (b"\x84\xa4code\xfd\xa4name\xb3UNSUPPORTED_VERSION\xa7message\xa9versions!"
                   b"\xa9retryable\xc2")
            msg = b"\x94\x01" + bytes([rid]) + err + b"\xc0"
            return len(msg).to_bytes(4, "big") + msg
        path, srv, t = self._fake(reply)
        with self.assertRaises(kdaclient.UnsupportedVersion) as cm:
            kdaclient.connect(path, timeout=5)
        self.assertIn("versions!", str(cm.exception))
        srv.close()

    def test_timeout(self):
        path, srv, t = self._fake(lambda body: None)    # never answers
        t0 = time.monotonic()
        with self.assertRaises(kdaclient.Timeout) as cm:
            kdaclient.connect(path, timeout=0.2)
        self.assertTrue(cm.exception.retryable)
        self.assertLess(time.monotonic() - t0, 0.9)
        srv.close()

    def test_shutting_down_disconnected_canceled(self):
        d = Daemon(heads=H).start()
        try:
            c = d.connect()
            c.register_layer("E", *rand_layer(np.random.default_rng(0), H), -5.0)
            s, = c.alloc_slots(1)
            x = rand_seq(np.random.default_rng(0), 8, H)
            got = []
            c._submit_prefill("E", [dict(x, slot=s)], lambda r, e, t: got.append((r, e)))
            c.close()    # in flight: completes with CANCELED inside close
            self.assertEqual(len(got), 1)
            self.assertIsInstance(got[0][1], kdaclient.Canceled)

            c = d.connect()
            killer = d.connect()
            d.proc.send_signal(signal.SIGTERM)      # drain, then goodbye SHUTTING_DOWN
            d.proc.wait(30)
            with self.assertRaises(kdaclient.ShuttingDown):
                c.alloc_slots(1)
            c.close()
            killer.close()
        finally:
            d.stop()
        d = Daemon(heads=H).start()
        try:
            c = d.connect()
            d.proc.kill()                           # no goodbye: the socket just ends
            d.proc.wait(30)
            with self.assertRaises(kdaclient.Disconnected) as cm:
                c.alloc_slots(1)
            self.assertTrue(cm.exception.retryable)
            c.close()
        finally:
            d.stop(check=False)   # killed on purpose


if __name__ == "__main__":
    unittest.main()
