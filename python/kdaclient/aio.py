"""asyncio for kdaclient: many prefills in flight on one connection.

``AsyncClient`` drives a :class:`kdaclient.Client` from the running loop: the connection's
socket is watched with ``loop.add_reader`` (and ``add_writer`` while requests wait for room
in it), and each completion resolves its future.  Setup calls (layers, slots, regions,
stats) stay blocking and short; they are available on the wrapper as on the client.
"""
import asyncio
import functools

from . import _kdaclient


class AsyncClient:
    """An asyncio front of one connection::

        async with kdaclient.AsyncClient(path=sock) as ac:
            slots = ac.alloc_slots(32)
            results = await asyncio.gather(*(ac.prefill("L0", [seq]) for seq in seqs))

    ``client``: an open :class:`kdaclient.Client` to drive (it stays yours to close), or None
    to connect with ``connect_kwargs`` (closed with this object).  Use it from the loop's
    thread only.  :meth:`close` fails every await still in progress, whoever owns the client.
    """

    def __init__(self, client=None, *, loop=None, **connect_kwargs):
        from . import connect
        self._own = client is None
        self._c = connect(**connect_kwargs) if client is None else client
        self._loop = loop or asyncio.get_running_loop()
        self._fd = self._c.fileno()
        self._writing = False
        self._pending = {}      # future of an await in progress -> its error if closed first
        self._loop.add_reader(self._fd, self._io)

    @property
    def client(self):
        """The underlying blocking :class:`kdaclient.Client`."""
        return self._c

    def __getattr__(self, name):
        # hello, register_layer, alloc_slots, free_slots, read_slot, write_slot, stats ...
        return getattr(self._c, name)

    async def prefill(self, layer, seqs, *, sync=True):
        """Like :meth:`Client.prefill`, without blocking the loop: queues the request and
        awaits its answer.  Any number may be in flight at once (the daemon stops reading
        past ``max_inflight_requests`` and resumes as answers go out).  The arrays must stay
        unchanged until it completes.  Cancelling the await does not cancel the request."""
        fut = self._await_future(_request_closed)
        self._c._submit_prefill(layer, seqs, functools.partial(_resolve, fut), sync=sync)
        self._arm(self._c._events())
        return await fut

    async def step(self, layer, slots, q, k, v, g, beta, *, lens=None, expect_pos=None,
                   out=None, states=None, sync=True):
        """Like :meth:`Client.step`, without blocking the loop (the arrays must stay unchanged
        until it completes)."""
        fut = self._await_future(_request_closed)
        self._c._submit_step(layer, slots, q, k, v, g, beta, lens=lens, expect_pos=expect_pos,
                             out=out, states=states, sync=sync,
                             callback=functools.partial(_resolve, fut))
        self._arm(self._c._events())
        return await fut

    def prefill_on_stream(self, layer, seqs, stream):
        """:meth:`Client.prefill_on_stream`, returning at once; this object's reader completes
        the handle, which is awaitable: ``h = ac.prefill_on_stream(...)``, work on the stream
        (or ``h.set_ready()``), then ``await h`` for the response."""
        self._check_open()
        h = self._c.prefill_on_stream(layer, seqs, stream)
        h._aio = self
        self._arm(self._c._events())
        return h

    def _watching(self):
        return self._fd is not None

    def _check_open(self):
        if not self._watching():   # nothing would read the answer: its await would hang
            raise RuntimeError("the AsyncClient was closed")

    def _await_future(self, closed_error):
        """A future for an await on this object's loop; close() fails it with
        closed_error() unless it is done by then."""
        self._check_open()
        fut = self._loop.create_future()
        self._pending[fut] = closed_error
        fut.add_done_callback(self._forget)
        return fut

    def _forget(self, fut):
        self._pending.pop(fut, None)

    def _arm(self, events):
        want = bool(events & _kdaclient.WRITABLE)
        if want and not self._writing:
            self._loop.add_writer(self._fd, self._io)
        elif not want and self._writing:
            self._loop.remove_writer(self._fd)
        self._writing = want

    def _io(self):
        if self._c.closed:
            self._unwatch()
            return
        rc, events = self._c._progress()
        if rc != 0:   # the connection failed: every request in flight got the error
            self._unwatch()
            return
        self._arm(events)

    def _unwatch(self):
        if self._fd is None:
            return
        self._loop.remove_reader(self._fd)
        if self._writing:
            self._loop.remove_writer(self._fd)
        self._writing = False
        self._fd = None

    def close(self):
        """Stops watching the connection and fails every await still in progress.  If this
        object opened the connection, it closes it: requests in flight fail with Canceled.
        Else the client stays open with its requests in flight, and the awaits fail all the
        same (nothing reads the answers for them any more): those of :meth:`prefill` and
        :meth:`step` with Canceled (their answers are dropped), those of a
        :class:`~kdaclient.StreamPrefill` handle with RuntimeError (its ``result()`` still
        gives the answer)."""
        self._unwatch()
        if self._own:
            self._c.close()     # runs the completions with Canceled: they resolve the awaits
        pending, self._pending = self._pending, {}
        for fut, closed_error in pending.items():
            if not fut.done():
                fut.set_exception(closed_error())

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()
        return False


def _resolve(fut, result, exc, timings):
    if fut.done():   # cancelled, or failed by close() before the answer came
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _request_closed():
    from . import Canceled
    return Canceled("the AsyncClient was closed with the request in flight; its answer is "
                    "dropped", -104, False)
