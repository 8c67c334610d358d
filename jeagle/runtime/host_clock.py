"""The host's time in one scheduler step, kept apart from the step's decisions (`Engine.step`).

A step's wall splits into time the host waited on the device ("blocked": the verify_done wait, slot
reservations, reading results back, finished requests' slot tables) and the rest ("busy"), of which
the decode step's or round's dispatch call is one part. `StepClock` collects them while the step runs
and, for a step that dispatched, books them once at its end: the engine's stats window (`Engine._acct`),
its running totals (`Engine.host_totals`, `/server_info`), the adaptive throughput policy's round-time
model (`decoder.host_step`) and the admission gate's step time (`AdmissionGate.observe_step`).
"""

from __future__ import annotations

import contextlib
import time


class StepClock:
    def __init__(self, engine):
        self.engine = engine
        self.start = time.perf_counter()
        self.tables0 = engine.tables_waited_s  # slot-table reads happen inside the engine's own methods
        self.compiled0 = engine.compile_seconds
        self.prefill0 = engine.host_totals["prefill_dispatch_s"]
        self.blocked = 0.0  # seconds waited on the device
        self.dispatch = 0.0  # the dispatch call's host time, the results it read inside (`drain`) left out
        self._drained = 0.0  # waits inside the dispatch call

    def waited(self, seconds: float) -> None:
        """A wait measured elsewhere (returned by the call that waited)."""
        self.blocked += seconds

    @contextlib.contextmanager
    def waiting(self):
        """The block's time is a wait on the device; inside `dispatching`, it is not dispatch time."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - t0
            self.blocked += spent
            self._drained += spent

    def joined(self, seconds: float) -> None:
        """The last call's host time still running on the dispatch thread when this step began: dispatch time."""
        self.dispatch += seconds

    @contextlib.contextmanager
    def dispatching(self):
        t0, drained0 = time.perf_counter(), self._drained
        try:
            yield
        finally:
            self.dispatch += time.perf_counter() - t0 - (self._drained - drained0)

    def book(self) -> None:
        """Book a step that dispatched a decode step or round (see the module docstring)."""
        eng = self.engine
        self.blocked += eng.tables_waited_s - self.tables0
        now = time.perf_counter()
        busy = now - self.start - self.blocked
        eng.decoder.host_step(busy - self.dispatch)
        acct, tot = eng._acct, eng.host_totals
        acct["blocked_per_step"].append(self.blocked)
        acct["busy_per_step"].append(busy)
        acct["dispatch_per_step"].append(self.dispatch)
        tot["steps"] += 1
        tot["busy_s"] += busy
        tot["blocked_s"] += self.blocked
        tot["dispatch_s"] += self.dispatch
        # The admission gate's step time leaves out the prefill calls made in this step.
        eng.gate.observe_step(now - self.start - (tot["prefill_dispatch_s"] - self.prefill0),
                              eng.compile_seconds != self.compiled0)
