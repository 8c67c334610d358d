"""The thread that owns the engine: it applies submit/abort commands between steps, steps while there
is work, and hands each job its tokens and its end. HTTP handlers never touch the engine's queues;
they talk to this thread through its command queue and hear back through their job's asyncio queue.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from jeagle.sampling import SamplingParams


@dataclass
class Job:
    """One request's link between its HTTP handler and the engine thread. Events: ("tokens", (ids,
    their TokenLogprobs or None)), ("done", finish_reason), ("error", message)."""
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: Any = None  # the engine's request, once submitted

    def emit(self, event) -> None:  # engine thread → handler, at once
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def _put_all(events: list) -> None:  # on the handlers' loop: one wake-up for a whole step's events
    for job, event in events:
        job.events.put_nowait(event)


class EngineLoop(threading.Thread):
    """Owns the engine (`submit`, `abort`, `abort_all`, `step`, `has_work`, `info`)."""

    def __init__(self, engine):
        super().__init__(daemon=True, name="jeagle-engine")
        self.engine = engine
        self.commands: queue.Queue = queue.Queue()
        self.jobs: dict[int, Job] = {}  # engine request index → job
        self._lock = threading.Lock()  # guards _info, which /server_info reads
        self._info: dict = engine.info()  # the engine is idle until the thread starts
        self._out: list = []  # (job, event) of this step, handed over together after it
        self.stopped = threading.Event()

    def submit(self, job: Job) -> None:
        self.commands.put(("submit", job))

    def abort(self, job: Job) -> None:
        self.commands.put(("abort", job))

    def stop(self) -> None:
        self.stopped.set()
        self.commands.put(("stop", None))

    def info(self) -> dict:
        """The engine's live counters after the last step (a copy)."""
        with self._lock:
            return dict(self._info)

    def _apply(self, cmd, job) -> None:
        eng = self.engine
        if cmd == "submit":
            try:
                job.request = eng.submit(job.prompt, job.params, on_tokens=lambda _i, ids, j=job: self._out.append((
                    j, ("tokens", (ids, None if j.request.out.logprobs is None else j.request.out.logprobs[-len(ids):])))))
            except Exception as e:  # checked before, so this is rare (e.g. the pool is smaller than asked)
                job.emit(("error", str(e)))
                return
            self.jobs[job.request.index] = job
        elif cmd == "abort" and job.request is not None and not job.request.done:
            eng.abort(job.request)

    def _take_commands(self) -> bool:
        """Apply the queued commands (waiting for one only when the engine is idle); False on stop."""
        idle = not self.engine.has_work
        try:
            cmd, job = self.commands.get(block=idle, timeout=None if idle else 0)
            while cmd != "stop":
                self._apply(cmd, job)
                cmd, job = self.commands.get_nowait()
            return False
        except queue.Empty:
            return True

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as e:  # the engine is left idle; every job in flight fails
            print(f"[jeagle.serve] engine step failed: {e!r}", file=sys.stderr, flush=True)
            self.engine.abort_all()
            for j in self.jobs.values():  # after the tokens the step had already handed out
                self._out.append((j, ("error", f"engine failure: {e}")))
            self.jobs.clear()

    def _hand_over(self) -> None:
        """This step's events to their handlers: one cross-thread wake-up per event loop, not per job
        (at batch 48 a wake-up per job and round cost the engine thread its GIL time)."""
        if not self._out:
            return
        by_loop: dict = {}
        for job, event in self._out:
            by_loop.setdefault(job.loop, []).append((job, event))
        self._out = []
        for loop, events in by_loop.items():
            loop.call_soon_threadsafe(_put_all, events)

    def run(self) -> None:
        while not self.stopped.is_set():
            if not self._take_commands():
                return
            if self.engine.has_work:
                self._step()
            for index, j in list(self.jobs.items()):
                if j.request.done:
                    self._out.append((j, ("done", j.request.out.finish_reason)))
                    del self.jobs[index]
            self._hand_over()
            with self._lock:
                self._info = self.engine.info()
