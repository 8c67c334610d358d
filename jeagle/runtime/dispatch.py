"""Where a decoder's executables are called: on the engine's thread, or on a dispatch thread of their own.

A served engine's thread is busy ~0.9 of the wall at 16-32 clients on the H100, two thirds of it inside
the executables' calls, where XLA prepares and launches the work on the host (bench/HISTORY.md,
2026-11-27). JAX releases the GIL inside a call, so with `EngineConfig.dispatch_thread` the decoders hand
each call to one thread of their own and the engine processes the previous round's results
(`Engine.step`) while XLA works on this one. Off by default until the GPU measures it
(`bench/probes/dispatch_thread.py`, removed after commit `b436043`; served: `bench/serve.py --engine-config
'{"dispatch_thread":true}'`).

What keeps it safe: a call donates the decoder's device state and returns the next one, so every read
or write of `state` on the engine's thread first waits for the call in flight (`Dispatching.state`);
the calls run one at a time, in the order the engine made them. A call's result comes back as a
`Dispatched`: `np.asarray` of it (the engine's read) waits for the call, then for the copy to the host
that the call started; `resolve` gives the device array. A failed call raises once on the engine's
thread (where its result or the state is read next); the engine's abort path `settle`s it.

The call's Python part (JAX's argument handling, ~a fifth of it) and its return take the GIL back, so
how much of a call overlaps the engine's Python depends on how often that Python lets the GIL go
(`sys.setswitchinterval`); the GPU measures it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np


class Dispatched:
    """A step's device result whose call runs on the dispatch thread."""

    __slots__ = ("future", "owner")

    def __init__(self, future: Future, owner: "Dispatching"):
        self.future, self.owner = future, owner

    def result(self):
        """The device result (waits for the call; its error is raised here, once: the state's next read
        does not raise it again)."""
        if self.owner._in_flight is self.future:
            self.owner._in_flight = None
        return self.future.result()

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.result(), dtype)


def _copy_to_host(res, to_host) -> None:
    for leaf in (to_host(res) if to_host is not None else (res,)):
        leaf.copy_to_host_async()


def resolve(result):
    """The device result of a call (a `Dispatched` one waited for)."""
    return result.result() if isinstance(result, Dispatched) else result


class Dispatching:
    """For a decoder with `param_leaves`: its device `state` and `dispatch`, which runs one executable
    (exe(params, state, inputs) -> (result, next state)) on the calling thread or the dispatch thread."""

    _device_state = None
    _pool: ThreadPoolExecutor | None = None
    _in_flight: Future | None = None
    last_call_s = 0.0  # the last call's host seconds (the executable's call and its copy's start), either thread

    def use_dispatch_thread(self, threaded: bool) -> None:
        """Calls on a dispatch thread or not (again: a probe switching modes; nothing may be in flight)."""
        if self._pool is not None:
            self._pool.shutdown()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jeagle-dispatch") if threaded else None

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    @property
    def state(self):
        """The device state, once the call in flight (if any) has returned it."""
        self._join()
        return self._device_state

    @state.setter
    def state(self, value) -> None:
        self._join()
        self._device_state = value

    def _join(self) -> None:
        future, self._in_flight = self._in_flight, None
        if future is not None:
            future.result()  # the call's error, if it failed, is raised here, on the engine's thread

    def settle(self) -> None:
        """Wait for the call in flight, if any, without raising its error (the engine's abort path,
        which has the error already or drops what is in flight anyway)."""
        future, self._in_flight = self._in_flight, None
        if future is not None:
            future.exception()

    def dispatch(self, exe, inputs, to_host=None):
        """Call `exe` on the state and `inputs`; the result's copy to the host is started with it (or
        only the arrays `to_host(result)` lists: a result with arrays the host never reads)."""
        if self._pool is None:
            leaves, state, t0 = self.param_leaves, self.state, time.perf_counter()
            res, self.state = exe(leaves, state, inputs)
            _copy_to_host(res, to_host)  # the host reads it a step later; this copy is then done
            self.last_call_s = time.perf_counter() - t0
            return res
        leaves, state = self.param_leaves, self.state  # (waits for the call before)
        started = threading.Event()

        def run():
            started.set()
            t0 = time.perf_counter()
            res, self._device_state = exe(leaves, state, inputs)
            _copy_to_host(res, to_host)
            self.last_call_s = time.perf_counter() - t0
            return res

        self._in_flight = self._pool.submit(run)
        # Until the dispatch thread holds the GIL the call has not begun: without this wait it would
        # begin when the engine thread next blocks or after Python's switch interval (5 ms), whichever
        # comes first (measured on a CPU: 3 ms of Python after the hand-over delayed the call by 3 ms).
        started.wait()
        return Dispatched(self._in_flight, self)
