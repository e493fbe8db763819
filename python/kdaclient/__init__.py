"""kdaclient: the Python client of kdad, the Kimi Delta Attention prefill daemon.

A thin layer over libkdaclient (compiled into the extension ``kdaclient._kdaclient``)::

    import kdaclient
    with kdaclient.connect() as c:
        H = c.hello()["heads"]
        c.register_layer("L0", A_log, dt_bias, lower_bound=-5.0)
        slot, = c.alloc_slots(1)
        res = c.prefill("L0", [{"slot": slot, "q": q, "k": k, "v": v, "g": g, "beta": beta}])
        out, pos = res[0]["out"], res[0]["pos"]

Tensors are bf16 (pass the bits as uint16 NumPy arrays, ml_dtypes.bfloat16 arrays, or any
bf16/int16 tensor through DLPack), shapes ``[len, H, 128]`` (``beta``: ``[len, H]``).  Host
arrays travel inline, or through shared memory when large; CUDA tensors (DLPack or
``__cuda_array_interface__``) travel as CUDA regions, without a copy.  See docs/python.md.
"""
import asyncio
import fcntl
import mmap
import os

from . import _kdaclient
from ._kdaclient import (DEFAULT_SCALE, HEAD_DIM, LIBRARY_VERSION, PROTOCOL_VERSION,
                         socket_default)
from .aio import AsyncClient

__version__ = LIBRARY_VERSION
__all__ = ["connect", "Client", "AsyncClient", "StreamPrefill", "Error", "to_bf16", "from_bf16",
           "socket_default",
           "DEFAULT_SCALE", "HEAD_DIM", "PROTOCOL_VERSION", "__version__"]


class Error(Exception):
    """A kdad or libkdaclient failure.

    ``code`` is the protocol's negative code (PROTOCOL.md, Errors; -100 and below are the
    library's), ``name`` its symbolic name, ``retryable`` whether the same call, made again
    unchanged later, may succeed, and ``message`` the daemon's (or library's) sentence, which
    names the offending field.  Each code has its subclass: ``kdaclient.PositionMismatch``,
    ``kdaclient.StaleSlot``, ...
    """
    name = "UNKNOWN_CODE"
    code = None

    def __init__(self, message, code=None, retryable=None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.retryable = bool(retryable) if retryable is not None else False

    def __str__(self):
        return "%s: %s" % (self.name, self.message)


def _class_name(name):
    return "".join(p.capitalize() for p in name.split("_"))


_classes = {}
for _name, _code, _retryable, _msg in _kdaclient.error_table():
    _cls = type(_class_name(_name), (Error,), {
        "__doc__": "%s (%d): %s.%s" % (_name, _code, _msg,
                                       " Retryable." if _retryable else ""),
        "name": _name, "code": _code, "__module__": __name__})
    globals()[_cls.__name__] = _cls
    __all__.append(_cls.__name__)
    _classes[_code] = _cls
del _name, _code, _retryable, _msg, _cls

_BF16 = 0   # the extension's kp_elem for bf16 fields


def _coerce(obj, field, elem):
    """Turns an array-like without a usable buffer into one (called by the extension)."""
    import numpy as np
    a = np.asarray(obj)
    if a.dtype.name == "bfloat16":           # ml_dtypes: the bits as uint16
        a = a.view(np.uint16)
    if elem == _BF16 and a.dtype.itemsize != 2 and a.dtype != np.uint8:
        raise TypeError("%s: %s elements; kdad takes bf16 here (its bits as uint16, or "
                        "ml_dtypes.bfloat16); kdaclient.to_bf16 converts" % (field, a.dtype))
    if elem == _BF16 and a.dtype.kind == "f":
        raise TypeError("%s: float16 is not bf16; kdaclient.to_bf16 converts" % field)
    return np.ascontiguousarray(a)


_kdaclient._set_hooks(Error, _classes, _coerce)


def to_bf16(x):
    """float array -> its bf16 bits as uint16 (round to nearest, ties to even)."""
    import numpy as np
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        r[nan] = 0x7FC0
    return r


def from_bf16(u, dtype="float32"):
    """bf16 bits (uint16) -> float32 (exact), or the dtype given."""
    import numpy as np
    a = np.ascontiguousarray(u).view(np.uint16)
    return (a.astype(np.uint32) << 16).view(np.float32).astype(dtype, copy=False)


class Client(_kdaclient._Client):
    """One connection to kdad.  Make it with :func:`connect`; use it as a context manager.

    A client is used by one thread at a time (calls from other threads wait); blocking calls
    release the GIL.  Slots belong to the connection unless the daemon persists them; regions
    (shared arrays, staging buffers, CUDA registrations) die with it.
    """

    def register_layer(self, name, A_log, dt_bias, lower_bound, scale=None):
        """Registers a layer's weights under ``name`` (daemon-wide).

        ``A_log``: float32 ``[H]``; ``dt_bias``: float32 ``[H, 128]`` (any array-like,
        converted); ``lower_bound`` in [-5, 0); ``scale`` defaults to 1/sqrt(128).
        Returns True when created, False when an identical layer existed.
        Raises LayerExists (same name, other content), QuotaExceeded, InvalidParams.
        """
        import numpy as np
        a = np.ascontiguousarray(A_log, dtype=np.float32)
        d = np.ascontiguousarray(dt_bias, dtype=np.float32)
        return self._register_layer(name, a, d, float(lower_bound),
                                    None if scale is None else float(scale))

    def shared_array(self, shape, dtype="uint16"):
        """A NumPy array in shared memory registered with the daemon (one region).

        Arrays placed here (or views of them at 16-byte aligned offsets) travel as region
        references: no copy at all for inputs, outputs written in place.  The memory stays
        registered as long as the connection; each call takes one of the connection's
        ``max_regions_per_client`` regions, so allocate a few large arenas and slice them.
        """
        import numpy as np
        dt = np.dtype(dtype)
        count = 1
        for n in (shape if isinstance(shape, (tuple, list)) else (shape,)):
            count *= int(n)
        size = max(count * dt.itemsize, 1)
        size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        fd = os.memfd_create("kdaclient-shared", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mm = mmap.mmap(fd, size)
            arr = np.frombuffer(mm, dtype=dt, count=count).reshape(shape)
            self._add_shared(fd, arr.__array_interface__["data"][0], size, mm)
        finally:
            os.close(fd)
        return arr

    def prefill_on_stream(self, layer, seqs, stream):
        """A prefill ordered by a CUDA stream instead of the host; returns a
        :class:`StreamPrefill` at once, without waiting.

        ``stream``: a ``torch.cuda.Stream`` (or anything with ``cuda_stream``, ``ptr`` or
        ``__cuda_stream__``), or a ``cudaStream_t`` as an int, of the calling thread's current
        CUDA context.  On it the call enqueues the store of the request's ready word (work
        enqueued before the call produces the inputs) and a wait for its done word (work
        enqueued after the call may consume the outputs), then sends the request; the daemon
        runs it once the stream reaches the ready store.  ``stream=None``: the host orders it
        instead, the request waiting in the daemon until :meth:`StreamPrefill.set_ready`.

        ``seqs`` as for :meth:`prefill`, but every tensor, ``out`` included, must be a CUDA
        tensor or lie in :meth:`shared_array` memory (a host array would be read when the call
        is made, before the stream has produced it).  A request that fails, however it fails
        (the daemon's error, a lost connection, :meth:`close`), releases the stream's wait
        with the failure bit: check :meth:`StreamPrefill.result` before trusting the outputs.
        The client learns of a lost connection when it reads its socket: keep calling
        ``result()`` / ``done()``, or drive it with an :class:`AsyncClient`, while streams wait.
        Needs the daemon's ``prefill.semaphores`` feature (else NotSupported).
        """
        h = StreamPrefill(self)
        h._pair, h._value = self._submit_prefill_on_stream(layer, seqs, _stream_handle(stream),
                                                           h._complete)
        h._host = stream is None
        return h

    def regions(self):
        """What this client holds of its ``max_regions_per_client``: CUDA registrations
        (``cuda``, and ``cuda_registered`` / ``cuda_released`` since it opened), staging
        buffers, shared arrays."""
        return self._region_counts()


def _stream_handle(stream):
    """A CUDA stream object (or int) -> its cudaStream_t as an int; None stays None."""
    if stream is None or isinstance(stream, int):
        return stream
    if hasattr(stream, "__cuda_stream__"):   # the CUDA stream protocol: (version, handle)
        v = stream.__cuda_stream__
        return int((v() if callable(v) else v)[1])
    for attr in ("cuda_stream", "ptr"):      # torch.cuda.Stream, cupy.cuda.Stream
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise TypeError("stream: %r is not a CUDA stream (torch.cuda.Stream, an int cudaStream_t, "
                    "or None)" % (stream,))


class StreamPrefill:
    """A stream-ordered prefill in flight (:meth:`Client.prefill_on_stream`).

    Its response arrives whenever the client next reads its socket: :meth:`result` waits for
    it, :meth:`done` takes what has arrived without waiting, and an :class:`AsyncClient`
    driving the same client completes it by itself.  A handle from
    :meth:`AsyncClient.prefill_on_stream` is awaitable: ``await h`` returns what
    :meth:`result` returns, or raises its error, once the response arrives.
    """

    def __init__(self, client):
        self._c = client
        self._finished = False
        self._result = self._exc = None
        self._last_word = 0
        self._aio = None        # the AsyncClient whose reader completes it (awaitable)
        self._waiters = []      # futures of the awaits in progress
        self.timings = None
        """The daemon's times of the request (as ``Client.last_timings``) once it succeeded."""

    def _complete(self, result, exc, timings):
        self._result, self._exc, self.timings = result, exc, timings
        self._last_word = self._c._done_word(self._pair, self._value)
        self._finished = True
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            _wake(fut)

    def _outcome(self):
        if self._exc is not None:
            raise self._exc
        return self._result

    def set_ready(self):
        """Writes the ready word from the host (``stream=None`` only): call it once the
        request's inputs are written.  Any thread may call it; after completion it does
        nothing."""
        if not self._host:
            raise ValueError("set_ready: this prefill's stream writes its ready word")
        if not self._finished:
            self._c._set_ready(self._pair, self._value)

    def done_word(self):
        """The done word as the host sees it: 0 not yet, 1 done, -1 failed (a word in shared
        memory; on a GPU the daemon may write it after its response)."""
        if self._c.closed:
            return self._last_word           # as it was when the response came
        w = self._c._done_word(self._pair, self._value)
        if self._finished and self._exc is None:
            w = 1 if w else 0                # the pair may serve a later request by now
        return w

    def done(self):
        """True once the response arrived (reads what the socket holds, without waiting)."""
        if not self._finished and not self._c.closed:
            self._c._progress()
        return self._finished

    def result(self, timeout=None):
        """Waits for the response; returns what :meth:`Client.prefill` returns (one dict per
        sequence: ``pos``, ``out``) or raises its :class:`Error` (``ReadyTimeout`` when the
        ready word stayed low, ``Disconnected`` or ``Canceled`` when the connection went).
        ``timeout``: seconds, None to wait without a bound; TimeoutError when it passes (the
        request stays in flight)."""
        import time
        end = None if timeout is None else time.monotonic() + timeout
        while not self._finished:
            if self._c.closed:
                raise Canceled("the client was closed", -104, False)
            left = 0.1 if end is None else end - time.monotonic()
            if left <= 0:
                raise TimeoutError("the stream-ordered prefill has not completed")
            # at most 0.1 s per wait: another thread's call (or an AsyncClient) may take the
            # response off the socket and complete this handle meanwhile
            if self._c._wait(min(left, 0.1)) != 0 and not self._finished:
                raise Disconnected("the connection failed", -102, True)
        return self._outcome()

    def __await__(self):
        """``await h`` (a handle of :meth:`AsyncClient.prefill_on_stream`): the response, as
        :meth:`result` gives it, without blocking the loop.  Cancelling the await does not
        cancel the request; the handle may be awaited again, or by several tasks."""
        if not self._finished:
            ac = self._aio
            if ac is None:
                raise TypeError("await: this StreamPrefill comes from Client.prefill_on_stream; "
                                "only AsyncClient.prefill_on_stream's handles are awaitable "
                                "(its reader completes them), else call result()")
            if not ac._watching():
                raise _await_closed()
            fut = ac._await_future(_await_closed)   # its close() fails the await
            self._waiters.append(fut)
            try:
                yield from fut.__await__()
            finally:
                if fut in self._waiters:     # cancelled before the response
                    self._waiters.remove(fut)
        return self._outcome()


def _await_closed():
    return RuntimeError("await: the AsyncClient that completes this StreamPrefill was closed; "
                        "call result()")


def _wake(fut):
    """Resolves an await's future from the thread that completed the handle (the loop's, when
    an AsyncClient read the response; another when that thread's call did)."""
    loop = fut.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        if not fut.done():
            fut.set_result(None)
        return
    try:
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
    except RuntimeError:                     # its loop is closed: nobody awaits any more
        pass


def connect(path=None, timeout=None, *, name=None, inline_max=None):
    """Connects to kdad and runs the hello handshake; returns a :class:`Client`.

    ``path``: the socket (default: ``$KDAD_SOCKET``, else ``$XDG_RUNTIME_DIR/kdad.sock`` if it
    exists, else ``/run/kdad/kdad.sock``, as kdactl).  ``timeout``: seconds each blocking call
    may take (None: wait forever; a call that times out closes the connection).
    ``name``: the client's name in the daemon's logs.  ``inline_max``: host arrays of a request
    above this many bytes (in, or out) go through a shared-memory staging buffer instead of
    the socket (default 4 MiB; the daemon's ``max_inline_bytes`` caps it).
    Raises NotRunning, Connect, UnsupportedVersion, PermissionDenied, Timeout.
    """
    return Client(path, timeout, name, inline_max)
