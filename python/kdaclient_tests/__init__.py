"""Tests of the kdaclient package against a real kdad.

Each test module starts its own kdad (from this repository's build, or $KDAD_BIN) on a socket
in a temporary folder.  Run them from python/ (or with kdaclient installed)::

    python3 -m unittest discover -s kdaclient_tests -t .     # CPU backend, CI
    python3 -m unittest kdaclient_tests.test_cuda           # PyTorch CUDA tensors (GPU host)

Environment: KDAD_BIN (the kdad executable), KDAD_GOLDEN_DIR (golden-vector cases),
KDAD_TEST_BACKEND (cpu by default; test_cuda uses cuda).
"""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

import numpy as np

import kdaclient

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The golden-vector cases (GOLDEN.md format); one variable, to repoint them in one place.
GOLDEN_DIR = os.environ.get("KDAD_GOLDEN_DIR") or os.path.join(REPO, "..", "shared", "golden")
OUT_TOL = 0.005     # KDA.md accuracy contract: output rel RMS against the float64 oracle
STATE_TOL = 0.005   # final state


def kdad_bin():
    """The kdad to test: $KDAD_BIN, else this repository's build."""
    env = os.environ.get("KDAD_BIN")
    if env:
        return env
    for d in ("build", "build-asan"):
        p = os.path.join(REPO, d, "daemon", "kdad")
        if os.path.exists(p):
            return p
    return None


class Daemon:
    """A kdad process on a fresh socket: start() ... stop()."""

    def __init__(self, heads=4, slots=64, backend=None, config=None):
        self.heads, self.slots = heads, slots
        self.backend = backend or os.environ.get("KDAD_TEST_BACKEND", "cpu")
        self.config = config
        self.dir = tempfile.mkdtemp(prefix="kdaclient-test-")
        self.sock = os.path.join(self.dir, "kdad.sock")
        self.log = os.path.join(self.dir, "kdad.log")
        self.proc = None

    def start(self):
        exe = kdad_bin()
        if not exe:
            raise RuntimeError("no kdad: build it (cmake --build build) or set KDAD_BIN")
        argv = [exe, "--socket", self.sock, "--backend", self.backend, "--heads",
                str(self.heads), "--slots", str(self.slots), "--log-level", "notice"]
        if self.config:
            path = os.path.join(self.dir, "kdad.yaml")
            with open(path, "w") as f:
                f.write(self.config)
            argv += ["--config", path]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                break
            try:
                kdaclient.connect(self.sock, timeout=5).close()
                return self
            except kdaclient.Error:
                time.sleep(0.05)
        log = self.read_log()
        self.stop(check=False)
        raise RuntimeError("kdad did not start:\n" + log)

    def read_log(self):
        try:
            with open(self.log) as f:
                return f.read()
        except OSError:
            return ""

    def stop(self, check=True):
        """SIGTERM and wait for the drain.  check: raise unless kdad exited 0 (a sanitizer's
        report, a crash, a drain that hung)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        log = self.read_log()
        shutil.rmtree(self.dir, ignore_errors=True)
        if check and self.proc and self.proc.returncode != 0:
            raise RuntimeError("kdad exited with %s:\n%s" % (self.proc.returncode, log[-4000:]))

    def connect(self, **kw):
        kw.setdefault("timeout", 120)
        return kdaclient.connect(self.sock, **kw)


@contextlib.contextmanager
def daemon(**kw):
    d = Daemon(**kw).start()
    try:
        yield d
    finally:
        d.stop()


class DaemonTestCase(unittest.TestCase):
    """A kdad for the class (self.d, its exit checked when the class ends), an rng seeded with
    SEED (self.rng) and a layer's parameters drawn from it first (self.layer: A_log, dt_bias);
    with LAYER set, a client per test (self.c) with that layer registered under LAYER
    (lower bound -5), closed after the test.  DAEMON: Daemon's keyword arguments."""
    DAEMON = {}
    SEED = 0
    LAYER = None

    @classmethod
    def setUpClass(cls):
        cls.d = Daemon(**cls.DAEMON).start()
        cls.rng = np.random.default_rng(cls.SEED)
        cls.layer = rand_layer(cls.rng, cls.d.heads)

    @classmethod
    def tearDownClass(cls):
        cls.d.stop()

    def setUp(self):
        if self.LAYER:
            self.c = self.d.connect()
            self.addCleanup(self.c.close)
            self.c.register_layer(self.LAYER, *self.layer, -5.0)


# ---------------------------------------------------------------------------------------------
# Data and the float64 reference (KDA.md, "Per token")


def rand_layer(rng, H):
    return (rng.random(H).astype(np.float32), rng.random((H, 128)).astype(np.float32))


def rand_seq(rng, T, H):
    """bf16 (uint16) q, k, v, g [T, H, 128] and beta [T, H], drawn as the golden cases are."""
    mk = lambda *shape: kdaclient.to_bf16(rng.standard_normal(shape))
    return {"q": mk(T, H, 128), "k": mk(T, H, 128), "v": mk(T, H, 128), "g": mk(T, H, 128),
            "beta": mk(T, H)}


def slice_seq(seq, a, b):
    return {n: seq[n][a:b] for n in ("q", "k", "v", "g", "beta")}


def kda_reference(seq, A_log, dt_bias, lower_bound=-5.0, scale=kdaclient.DEFAULT_SCALE,
                  state=None):
    """float64 token loop: returns (out [T, H, 128], final state [H, 128(v), 128(k)])."""
    f = lambda x: kdaclient.from_bf16(x, np.float64)
    q, k, v, g, beta = (f(seq[n]) for n in ("q", "k", "v", "g", "beta"))
    T, H, D = q.shape
    S = np.zeros((H, D, D)) if state is None else np.array(state, dtype=np.float64)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    a = np.exp(lower_bound / (1 + np.exp(-(np.exp(np.float64(A_log))[None, :, None]
                                           * (g + np.float64(dt_bias)[None])))))
    b = 1 / (1 + np.exp(-beta))
    out = np.empty((T, H, D))
    for t in range(T):
        S *= a[t][:, None, :]
        u = b[t][:, None] * (v[t] - np.einsum("hvk,hk->hv", S, k[t]))
        S += u[:, :, None] * k[t][:, None, :]
        out[t] = scale * np.einsum("hvk,hk->hv", S, q[t])
    return out, S


def rel_rms(x, ref):
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-300))


# ---------------------------------------------------------------------------------------------
# safetensors (the golden cases)

_DTYPES = {"F32": np.float32, "BF16": np.uint16, "I64": np.int64, "F64": np.float64}


def read_safetensors(path):
    """(tensors, metadata) of a .safetensors file; BF16 comes as its uint16 bits."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, t in header.items():
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data, dtype=_DTYPES[t["dtype"]], count=(b - a) //
                                  np.dtype(_DTYPES[t["dtype"]]).itemsize,
                                  offset=base + a).reshape(t["shape"])
    return out, meta


def golden_cases():
    """Paths of the golden cases, or [] when the folder is absent."""
    if not os.path.isdir(GOLDEN_DIR):
        return []
    return sorted(os.path.join(GOLDEN_DIR, f) for f in os.listdir(GOLDEN_DIR)
                  if f.endswith(".safetensors"))
