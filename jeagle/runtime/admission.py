"""When to admit waiting requests into rows that running ones have freed: at once, or in groups.

Every admission is a prefill call between two steps: ~1-2 ms of the host's launch work on an H200 for a
small model, whatever the number of prompts it carries (bench/HISTORY.md, 2026-11-28). Under continuous
batching with a queue, a speculative engine frees its rows one at a time (rows accept different
lengths), so admitting each freed row at once pays one call per request: at batch 48 that made EAGLE
slower than target-only (2026-11-28, 0.91x).

The gate trades the rows' idle time for fewer calls, as a rent-or-buy choice: while requests run and more
wait than the free rows can take, a free row stays empty until the batch time its emptiness has cost
(each step, the step's wall x free rows / rows) reaches `delay` x the measured host time of one prefill
call, or until `max_wait_steps` steps have passed (a bound on the wait it adds to time to first token).
Rows free steadily, so groups grow to about sqrt(2 x rate x rows x cost) rows, the optimum of that trade.
Admission is immediate when nothing runs, when every waiting request fits, before the first prefill and
step were timed, and with `delay` 0 (SGLang's and vLLM's rule). TGI's `waiting_served_ratio` /
`max_waiting_tokens` make the same trade with fixed ratios.
"""

from __future__ import annotations

EMA = 0.2  # weight of the newest sample in the step-wall and prefill-call averages


class AdmissionGate:
    def __init__(self, delay: float, max_wait_steps: int):
        if delay < 0 or max_wait_steps < 0:
            raise ValueError(f"admission delay and max wait steps must be >= 0, got {delay}, {max_wait_steps}")
        self.delay, self.max_wait_steps = delay, max_wait_steps
        self.step_s: float | None = None  # a step's wall (its prefill calls left out), averaged
        self.prefill_s: float | None = None  # one prefill call's host time, averaged
        self.idle_s = 0.0  # batch time the free rows have cost since the last admission
        self.waited = 0  # steps a free row has waited since then
        self.held = 0  # steps held in all (the stats)

    @staticmethod
    def _avg(old: float | None, new: float) -> float:
        return new if old is None else old + EMA * (new - old)

    def observe_step(self, wall_s: float, compiled: bool = False) -> None:
        """A dispatching step's wall, its prefill calls left out (one that compiled or loaded an
        executable is no sample)."""
        if not compiled:
            self.step_s = self._avg(self.step_s, wall_s)

    def prefill_called(self, host_s: float, compiled: bool = False) -> None:
        """A prefill call admitted requests: its host time is a sample (unless it compiled or loaded an
        executable: seconds, where a call takes milliseconds), and the idle time starts from nothing."""
        if not compiled:
            self.prefill_s = self._avg(self.prefill_s, host_s)
        self.idle_s, self.waited = 0.0, 0

    def due(self, running: int, rows: int, waiting: int) -> bool:
        """Called once a step, before admission, with requests waiting: admit now? (rows: the most
        that may run). The idle time counts on until a prefill call admits requests (`prefill_called`): a
        request due but turned away (the pool short of slots, its grammar not built yet) is due again at
        the next step."""
        free = rows - running
        if not running:
            return True
        if free <= 0:
            return False
        if self.delay <= 0 or waiting <= free or self.step_s is None or self.prefill_s is None:
            return True
        self.idle_s += self.step_s * free / rows
        self.waited += 1
        if self.idle_s >= self.delay * self.prefill_s or self.waited > self.max_wait_steps:
            return True
        self.held += 1
        return False
