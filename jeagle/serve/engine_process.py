"""`EngineProcess`: the engine and its `EngineLoop` in a process of their own, what `python -m
jeagle.serve` runs by default (SGLang's scheduler and vLLM's engine core run apart from their HTTP
servers for the same reason).

In one process the engine thread and the HTTP handlers share the GIL: every event the handlers
build, encode and write (a streamed `top_logprobs: 5` token is six JSON entries) is time the engine
thread waits to dispatch the next round. On the H100, SmolLM2 with EAGLE served 16 clients at
~0.6 of the engine's own batch-16 throughput, and logprobs cost ~15-25% more (bench/HISTORY.md,
2026-11-25). Apart, the handlers' work overlaps the engine's.

The parent (this class) keeps the handlers' side of the protocol unchanged: `submit`, `abort`,
`flush_cache`, `info`, `facts`, `start`, `stop`, `is_alive`, with each job's events (see
`engine_loop`) put on its asyncio queue. Between the two: one duplex pipe. Parent → child:
("submit", id, prompt, params) (a grammar travels as its llguidance text and is rebuilt there),
("abort", id), ("flush",), ("stop",). Child → parent: ("events", [(id, event), ...]) once per engine
step (token log-probabilities as the events carry them, packed bytes; a prompt's as one packed
array), ("info", counters) after a step at most every `INFO_PERIOD_S` and whenever the engine goes
idle.

When the child exits (killed, crashed) the reader hears it at once (the pipe's end, or the process's
sentinel): every job in flight gets an ("error", ...) event naming the exit code, `is_alive` turns
False, and a later submit is refused with a 503 (`try_submit`: False, for `router.Router`).
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import sys
import threading
import time

from jeagle.runtime.gc_clock import freeze_heap
from jeagle.serve.engine_loop import EngineLoop, Job, by_loop, params_to_wire

INFO_PERIOD_S = 0.05


class EngineFailed(RuntimeError):
    """The engine process could not start (its message says why; it also printed it)."""


class EngineProcess:
    """build(*args) -> (engine, tokenizer, extra) runs in a spawned process (a picklable, importable
    function): it loads and warms up the engine there; `extra` (a picklable dict) comes back as
    `self.extra`. The constructor returns once the engine is ready (or raises EngineFailed).
    env: variables set in the child before the build (a replica's CUDA_VISIBLE_DEVICES, `router`);
    name: what its errors call it ("replica 1"), None for the only engine."""

    def __init__(self, build, args: tuple = (), env: dict | None = None, name: str | None = None):
        ctx = mp.get_context("spawn")  # no CUDA or JAX state is inherited
        self.name = name
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(build, args, child, env or {}),
                                 name="jeagle-engine" if name is None else f"jeagle-engine-{name}", daemon=True)
        self._proc.start()
        child.close()
        try:
            msg = self._conn.recv()
        except EOFError:
            msg = ("failed", f"the engine process exited with code {self._proc.join(5) or self._proc.exitcode}")
        if msg[0] != "ready":
            self._proc.join(5)
            raise EngineFailed(msg[1])
        _, self.facts, self.extra, self._info = msg
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # one sender at a time; guards `_down` and the jobs' registration
        self._down = False  # the pipe closed: the process is gone (or going), its jobs were told
        self._reader = threading.Thread(target=self._read, daemon=True, name="jeagle-engine-link")

    # ---- the handlers' side (EngineLoop's interface) ----------------------------------------------------
    def start(self) -> None:
        self._reader.start()

    def submit(self, job: Job) -> None:
        if not self.try_submit(job):  # the process is gone: the request is refused, never left waiting
            by_loop([(job, ("rejected", (self._exited(), 503)))])

    def try_submit(self, job: Job) -> bool:
        """Submit `job` unless the engine process is gone (False: nothing was queued, no event will come)."""
        params = params_to_wire(job.params)
        with self._lock:  # registered and sent, or refused, as one step against the reader's end
            if self._down:
                return False
            job.id = next(self._ids)
            self._jobs[job.id] = job
            try:
                self._conn.send(("submit", job.id, job.prompt, params))
            except OSError:
                del self._jobs[job.id]
                return False
        return True

    def abort(self, job: Job) -> None:
        try:
            self._send(("abort", job.id))
        except OSError:  # the process is gone: its jobs heard so already
            pass

    def flush_cache(self) -> None:
        self._send(("flush",))

    def info(self) -> dict:
        return dict(self._info)

    def is_alive(self) -> bool:
        return not self._down and self._proc.is_alive()

    def in_flight(self) -> int:
        """Jobs submitted whose last event has not come back yet (the router's load)."""
        return len(self._jobs)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stop(self) -> None:
        try:
            self._send(("stop",))
        except OSError:
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.terminate()

    # ---- internals -------------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        with self._lock:
            self._conn.send(msg)

    def _read(self) -> None:
        from jeagle.sampling import logprobs

        while (msg := self._next()) is not None:
            if msg[0] == "info":
                self._info = msg[1]
                continue
            batch = []
            for jid, (kind, value) in msg[1]:
                job = self._jobs.get(jid)
                if job is None:
                    continue
                if kind == "tokens":
                    ids, packed, facts = value
                    if facts is not None and facts["prompt_logprobs"] is not None:
                        facts = facts | {"prompt_logprobs": [None] + logprobs.unpack(facts["prompt_logprobs"])}
                        value = (ids, packed, facts)
                elif kind != "accepted":
                    del self._jobs[jid]  # its last event
                batch.append((job, (kind, value)))
            by_loop(batch)
        # The engine process is gone: every job still waiting hears so, and later submits are refused.
        with self._lock:
            self._down = True
            jobs, self._jobs = list(self._jobs.values()), {}
        self._proc.join(1)  # (a killed process is reaped at once: its exit code goes in the message)
        by_loop([(job, ("error", self._exited())) for job in jobs])

    def _next(self):
        """The child's next message; None once it is gone: the pipe closed, or the process exited with
        nothing left to read (a process it started may still hold the pipe's end open)."""
        try:
            while True:
                ready = mp_connection.wait([self._conn, self._proc.sentinel])
                if self._conn in ready or self._conn.poll(0):
                    return self._conn.recv()
                if self._proc.sentinel in ready:
                    return None
        except (EOFError, OSError):
            return None

    def _exited(self) -> str:
        code = self._proc.exitcode
        return (f"the engine process{'' if self.name is None else ' of ' + self.name} exited"
                + ("" if code is None else f" (exit code {code})"))


class _ChildLoop(EngineLoop):
    """The engine process's EngineLoop: a step's events and its counters go down the pipe."""

    def __init__(self, engine, conn, jobs: dict, followers=None):
        super().__init__(engine, deliver=self._send_events, followers=followers)
        self.conn, self.jobs_by_id, self._sent_info = conn, jobs, 0.0

    def _send_events(self, events) -> None:
        from jeagle.sampling import logprobs

        wire = []
        for job, (kind, value) in events:
            if kind == "tokens":
                ids, packed, facts = value  # packed: the tokens' logprobs as bytes already (EngineLoop._tokens)
                if facts is not None and facts["prompt_logprobs"] is not None:  # [None, TokenLogprob, ...]
                    facts = facts | {"prompt_logprobs": logprobs.stack(facts["prompt_logprobs"][1:])}
                    value = (ids, packed, facts)
            elif kind != "accepted":
                self.jobs_by_id.pop(job.id, None)
            wire.append((job.id, (kind, value)))
        self.conn.send(("events", wire))

    def run(self) -> None:
        try:
            super().run()
        except BaseException as e:  # the loop itself broke (not a step: those it reports and survives)
            print(f"[jeagle.serve] the engine loop failed: {e!r}", file=sys.stderr)
            self.fatal = True
        if self.fatal:  # the engine is done: the process ends, and the parent hears it at once (never a hang)
            sys.stderr.flush()
            os._exit(1)

    def after_iteration(self) -> None:
        now = time.perf_counter()
        if now - self._sent_info >= INFO_PERIOD_S or not self.engine.has_work:
            self._sent_info = now
            self.conn.send(("info", self.info()))


def _child_main(build, args, conn, env: dict) -> None:
    """The engine process: build the engine, say ready, then run its loop (a thread) while this
    thread reads commands; exits when the parent says stop or goes away. Under --nnodes it is rank 0:
    its loop sends each pass's commands to the other processes (`PassChannel`)."""
    os.environ.update(env)  # before anything brings the devices up
    try:
        engine, tokenizer, extra = build(*args)
        freeze_heap()  # this process serves from here on: later collections skip what start-up built
        jobs: dict[int, Job] = {}
        nnodes, followers = extra.get("nnodes", 1), None
        if nnodes > 1:
            from jeagle.parallel.distributed import PassChannel

            followers = PassChannel()
        loop = _ChildLoop(engine, conn, jobs, followers)  # (its first counters, sent with "ready", show the freeze)
    except BaseException as e:  # reported to the parent, which raises EngineFailed with it
        if not isinstance(e, EngineFailed):  # (an EngineFailed was printed where it was raised)
            print(f"[jeagle.serve] the engine failed to start: {e!r}", file=sys.stderr, flush=True)
        conn.send(("failed", str(e) or repr(e)))
        return
    conn.send(("ready", loop.facts, extra, loop.info()))
    loop.start()
    grammars: dict = {}
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "submit":
                _, jid, prompt, params = msg
                job = jobs[jid] = Job(prompt, params_from_wire(params, grammars, tokenizer, engine), None, id=jid)
                loop.submit(job)
            elif msg[0] == "abort":
                job = jobs.get(msg[1])
                if job is not None:
                    loop.abort(job)
            elif msg[0] == "flush":
                loop.flush_cache()
            elif msg[0] == "stop":
                break
    except KeyboardInterrupt:
        pass
    loop.stop()
    loop.join(10)
    if nnodes > 1:  # after the followers' last pass: they stop, and every process leaves the runtime
        from jeagle.parallel.distributed import shutdown

        shutdown()


def params_from_wire(params, grammars: dict, tokenizer, engine):
    """`params_to_wire`'s params back: a grammar the sender compiled and checked, rebuilt from its llguidance
    text on this process's backend (built on first use, kept in `grammars`; a schema's requests share one,
    `GrammarBackend.rebuild`)."""
    if params.grammar is None:
        return params
    from jeagle.sampling.grammar import GrammarBackend

    if "backend" not in grammars:
        cfg = engine.model_cfg
        grammars["backend"] = GrammarBackend(tokenizer, cfg.vocab_size, cfg.eos_token_ids[0])
    return dataclasses.replace(params, grammar=grammars["backend"].rebuild(*params.grammar))
