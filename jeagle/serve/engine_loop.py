"""The thread that owns the engine: it applies submit/abort commands between steps, steps while there
is work, and hands each job its tokens and its end. HTTP handlers never touch the engine's queues;
they talk to this thread through its command queue and hear back through their job's asyncio queue.
`jeagle.serve.engine_process` runs the same loop in a process of its own (what `python -m
jeagle.serve` does), so the handlers' host work never takes the engine's GIL.

A job's events, in order: ("accepted", None) or ("rejected", (message, status)); then ("tokens",
(ids, their logprobs or None, facts or None)) as steps emit them, the first carrying the request's
facts ({"cached_tokens", "prompt_logprobs"}); then ("done", finish_reason) or ("error", message).
A tokens event's logprobs are the tokens' packed blocks as one bytes object (the chunk the request
keeps them in, `jeagle.sampling.logprobs.LogprobRows.tail_bytes`: no TokenLogprob is made on this thread): it
crosses to the engine process's parent as one copy, and the handler reads every number of a piece
with a few C calls instead of one TokenLogprob and a few numpy calls per token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from jeagle.runtime.requests import PromptTooLong
from jeagle.runtime.slots import OutOfSlots
from jeagle.sampling import SamplingParams


@dataclass
class Job:
    """One request's link between its HTTP handler and the engine (thread or process)."""
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: Any = None  # the engine's request, once submitted (on the engine's side)
    id: int = -1  # the engine process's name for it
    replica: int = -1  # (`router.Router`) the replica it went to
    cached_tokens: int = 0  # from the first tokens event: prompt tokens the prefix cache gave
    prompt_logprobs: list | None = None  # from the first tokens event, when asked (echo)
    follow_id: int = -1  # (engine side, --nnodes) its name in the commands the other processes follow
    told: bool = False  # (engine side) the first tokens event, with the request's facts, went out
    arrived: float = field(default_factory=time.perf_counter)  # (handler side) when its HTTP request came in


@dataclass(frozen=True)
class EngineFacts:
    """What handlers need to know of the engine, fixed at its start (picklable)."""
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_context: int
    context_reserve: int
    max_running_requests: int
    batch_buckets: tuple[int, ...]
    overlap: bool
    verify_done_wait: str
    speculative: bool
    adaptive: bool
    slice_fusion: bool  # XLA's dynamic-slice fusions (KernelSettings.slice_fusion; the server's default: off)
    dispatch_thread: bool  # the executables called on a thread of their own (the server's default: on)
    bucket_shrink_ratio: float  # a draining batch keeps its bucket until it fills at most 1/this of it

    @classmethod
    def of(cls, engine) -> "EngineFacts":
        return cls(tuple(engine.model_cfg.eos_token_ids), engine.model_cfg.vocab_size, engine.max_context,
                   engine.context_reserve, engine.max_running, tuple(engine.batch_buckets), engine.config.overlap,
                   engine.verify_done_mode, engine.speculative, engine.adaptive, engine.config.kernels.slice_fusion,
                   engine.config.dispatch_thread, engine.bucket_shrink_ratio)


def rejection(e: Exception) -> tuple[str, int]:
    """A submit's exception → (message, HTTP status): the request's fault (400) or the server's (500)."""
    return str(e), 400 if isinstance(e, (PromptTooLong, ValueError, OutOfSlots)) else 500


def put_all(events: list) -> None:
    """On the handlers' event loop: a batch of (job, event), one wake-up for all of them."""
    for job, event in events:
        job.events.put_nowait(event)


def by_loop(events: list) -> None:
    """Hand (job, event) pairs to their handlers: one cross-thread wake-up per event loop, not per job
    (at batch 48 a wake-up per job and round cost the engine thread its GIL time)."""
    loops: dict = {}
    for job, event in events:
        loops.setdefault(job.loop, []).append((job, event))
    for loop, batch in loops.items():
        loop.call_soon_threadsafe(put_all, batch)


def params_to_wire(params: SamplingParams) -> SamplingParams:
    """The params as they cross to another process: a grammar as its llguidance (kind, text), rebuilt there
    (`engine_process.params_from_wire`)."""
    if params.grammar is None:
        return params
    return dataclasses.replace(params, grammar=(params.grammar.kind, params.grammar.source))


class GenThroughput:
    """SGLang's `last_gen_throughput`: the tokens the engine emitted per second over its last `steps` steps (SGLang's
    `decode_log_interval`), or over its last busy stretch when that ended sooner; 0.0 before any. Unlike SGLang's, the
    time the engine sat idle between requests is left out: the figure is what it emits while it works."""

    def __init__(self, steps: int = 40):
        self.steps, self.value = steps, 0.0
        self._tokens, self._seconds, self._n = 0, 0.0, 0
        self._last: float | None = None  # the end of the last step, while requests are in flight

    def stepped(self, started: float, tokens: int, busy: bool) -> None:
        """After a step begun at `started` (perf_counter) that emitted `tokens`; busy: requests are still in
        flight, so the time until the next step's end (the hand-over, the commands) counts too."""
        now = time.perf_counter()
        self._seconds += now - (started if self._last is None else self._last)
        self._tokens, self._n, self._last = self._tokens + tokens, self._n + 1, now if busy else None
        if self._n >= self.steps or not busy:
            if self._tokens:  # a stretch that emitted nothing (a step that only released rows) keeps the last figure
                self.value = self._tokens / self._seconds if self._seconds > 0 else 0.0
            self._tokens, self._seconds, self._n = 0, 0.0, 0


class EngineLoop(threading.Thread):
    """Owns the engine (`submit`, `abort`, `abort_all`, `step`, `has_work`, `info`, `flush_cache`).
    deliver(events): where a step's (job, event) pairs go (default: their jobs' event loops)."""

    def __init__(self, engine, deliver=by_loop, followers=None):
        super().__init__(daemon=True, name="jeagle-engine")
        self.followers = followers  # under --nnodes on rank 0: the other processes' `PassChannel`
        self._follow_ids = itertools.count()
        self.multi_node = followers is not None  # (a follower's loop sets it too)
        self.fatal = False  # under --nnodes a step failed: the loop ends after handing out its errors
        self.engine, self.deliver = engine, deliver
        self.facts = EngineFacts.of(engine)
        self.commands: queue.Queue = queue.Queue()
        self.jobs: dict[int, Job] = {}  # engine request index → job
        self._out: list = []  # (job, event) of this step, handed over together after it
        self._emitted = 0  # tokens handed out in this step (`_tokens`), for `throughput`
        self.throughput = GenThroughput()
        self._lock = threading.Lock()  # guards _info, which /server_info reads
        self._info: dict = self._read_info()  # the engine is idle until the thread starts
        self.stopped = threading.Event()

    def submit(self, job: Job) -> None:
        self.commands.put(("submit", job))

    def abort(self, job: Job) -> None:
        self.commands.put(("abort", job))

    def flush_cache(self) -> None:
        """Evict the cached prefixes no request uses, before the commands queued after this one."""
        self.commands.put(("flush", None))

    def stop(self) -> None:
        self.stopped.set()
        self.commands.put(("stop", None))

    def info(self) -> dict:
        """The engine's live counters after the last step (a copy)."""
        with self._lock:
            return dict(self._info)

    def _read_info(self) -> dict:
        # Read here, in the engine's process: JAX's count of compilations is that process's (`compile_count`).
        eng = self.engine
        info = eng.info() | {"compilations": eng.num_compiled, "warmup_s": eng.executables.warmup_seconds,
                             "compilations_after_warmup": eng.xla_compilations_after_warmup}
        # SGLang's /server_info `internal_states`, one per scheduler (here one engine), under SGLang's names:
        # its bench_serving reads `avg_spec_accept_length` there. The decoder's figure is already on SGLang's
        # scale, tokens per request-round with the bonus token (accepted drafts + 1); without speculation, or
        # before any round, SGLang leaves the key out, and so does this.
        state = {"last_gen_throughput": self.throughput.value}
        if info.get("avg_spec_accept_length") is not None:
            state["avg_spec_accept_length"] = info["avg_spec_accept_length"]
        # The speculative decoder's request-rounds since start by tokens emitted (index k: rounds that
        # emitted k, bonus included), for /metrics' histogram: a few ints it already keeps.
        counts = getattr(eng.decoder, "accept_counts", None)
        if counts is not None:
            info["spec_accept_length_counts"] = counts.tolist()
        return info | {"internal_states": [state]}

    def _tokens_of(self, index: int, ids: list[int]) -> None:  # the engine's on_tokens
        self._tokens(self.jobs[index], ids)

    def _tokens(self, job: Job, ids: list[int]) -> None:
        r, facts = job.request, None
        if not job.told:
            job.told, facts = True, {"cached_tokens": r.cached_tokens, "prompt_logprobs": r.out.prompt_logprobs}
        self._emitted += len(ids)
        rows = r.out.logprob_rows  # the packed blocks as they arrived: the last len(ids) are these tokens'
        self._out.append((job, ("tokens", (ids, None if rows is None else rows.tail_bytes(len(ids)), facts))))

    def _apply(self, cmd, job) -> None:
        eng = self.engine
        if cmd == "submit":
            try:
                # By index, not a closure over the job: a request and its job referring to each other
                # would be a cycle that only the garbage collector frees, for every request served.
                job.request = eng.submit(job.prompt, job.params, on_tokens=self._tokens_of)
            except Exception as e:  # the engine's checks (prompt length, vocabulary, slots): queued nothing
                self._out.append((job, ("rejected", rejection(e))))
                return
            self._out.append((job, ("accepted", None)))
            self.jobs[job.request.index] = job
        elif cmd == "abort" and job.request is not None and not job.request.done:
            eng.abort(job.request)
        elif cmd == "flush":
            eng.flush_cache()

    def _next_pass(self) -> list:
        """The queued commands as (cmd, job) pairs, up to a "stop" (waiting for one only when the engine is idle)."""
        idle = not self.engine.has_work
        taken = []
        try:
            cmd, job = self.commands.get(block=idle, timeout=None if idle else 0)
            while True:
                taken.append((cmd, job))
                if cmd == "stop":
                    break
                cmd, job = self.commands.get_nowait()
        except queue.Empty:
            pass
        return taken

    def _take_commands(self) -> bool:
        """Apply this pass's commands; False on stop. Under --nnodes they go to the other processes first
        (`followers`), an empty list too."""
        taken = self._next_pass()
        if self.followers is not None:
            self._send_pass(taken)
        for cmd, job in taken:
            if cmd == "stop":
                return False
            self._apply(cmd, job)
        return True

    def _send_pass(self, taken) -> None:
        wire = []
        for cmd, job in taken:
            if cmd == "submit":
                job.follow_id = next(self._follow_ids)
                wire.append(("submit", job.follow_id, job.prompt, params_to_wire(job.params)))
            elif cmd == "abort":
                wire.append(("abort", job.follow_id))
            else:
                wire.append((cmd,))
        self.followers.send(wire)

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as e:  # the engine is left idle; every job in flight fails
            print(f"[jeagle.serve] engine step failed: {e!r}", file=sys.stderr, flush=True)
            self.engine.abort_all()
            for j in self.jobs.values():  # after the tokens the step had already handed out
                self._out.append((j, ("error", f"engine failure: {e}")))
            self.jobs.clear()
            if self.multi_node:  # the processes may be out of step (a node lost): this engine is done
                print("[jeagle.serve] --nnodes: a step failed, so the nodes can no longer be trusted to run the same "
                      "steps; the engine stops (restart every node)", file=sys.stderr, flush=True)
                self.fatal = True

    def _hand_over(self) -> None:
        if self._out:
            out, self._out = self._out, []
            self.deliver(out)

    def after_iteration(self) -> None:
        """Called after every pass of the loop (the engine process sends its counters here)."""

    def run(self) -> None:
        try:
            while not self.stopped.is_set() and self.iterate():
                pass
        finally:
            if self.followers is not None:  # (again, after a "stop" pass: a follower stops at the first)
                try:
                    self.followers.send([("stop",)])
                except Exception as e:  # the coordinator or a node is gone: nothing left to tell
                    print(f"[jeagle.serve] could not tell the other nodes to stop: {e!r}", file=sys.stderr, flush=True)

    def iterate(self) -> bool:
        """One pass: the queued commands, a step when there is work, the hand-over, the info; False on stop."""
        if not self._take_commands():
            return False
        self._hand_over()  # acceptances before the step's tokens
        if self.engine.has_work:
            started, self._emitted = time.perf_counter(), 0
            self._step()
            # Busy while requests are in flight: a step left over after the last one finished (an
            # overlapped round to drain, tables to read) neither delays the figure nor counts in it.
            eng = self.engine
            self.throughput.stepped(started, self._emitted, eng.num_running + eng.num_waiting > 0)
        for index, j in list(self.jobs.items()):
            if j.request.done:
                self._out.append((j, ("done", j.request.out.finish_reason)))
                del self.jobs[index]
        self._hand_over()
        with self._lock:
            self._info = self._read_info()
        self.after_iteration()
        return not self.fatal
