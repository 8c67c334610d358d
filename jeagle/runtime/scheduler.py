"""The Engine: a scheduler driving one decoder, with continuous batching and pipelined dispatch.

The engine owns the host side: the queue, admission (a request gets a row, its longest cached
prefix and slots for its prompt and a little more, `runtime/kv.py`), grouping of prefills, slots on
demand before each dispatch, retraction when the pool runs short, the batch of each decode step or
speculative round, the overlap of host and device, reading results back, the verify_done wait and
the stats. The decoder (`runtime/decoder.py` says what it provides) owns the device state and the
executables. Requests wait in the queue while the pool lacks room; when the engine asks for slots,
retracts and releases: `runtime/kv_flow.py`; the books it keeps: `runtime/kv.py`.

Pipelining: the host dispatches step c+1 (its inputs live on the device) before it reads the tokens
of step c, whose device→host copy was started right after dispatch. A request that finishes inside
step c has already been dispatched into step c+1: that extra work is discarded.

Every (phase, bucket) executable is compiled ahead of time on first need or by `warmup()`; compile
time is counted apart from serving time.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

import jax
import numpy as np

from jeagle.runtime.admission import AdmissionGate
from jeagle.runtime.compile_count import CompilationsAfterWarmup
from jeagle.runtime.decoder import wants_grammar
from jeagle.runtime.dispatch import resolve
from jeagle.runtime.gc_clock import gc_totals
from jeagle.runtime.host_clock import StepClock
from jeagle.runtime.kv import KVManager
from jeagle.runtime.kv_flow import KVFlow
from jeagle.runtime.requests import Output, Request, RequestLimits, make_request
from jeagle.runtime.slots import OutOfSlots, SlotPool
from jeagle.runtime.stats import Stats, latency_stats
from jeagle.runtime.verify_done import VerifyDone, verify_done_mode
from jeagle.sampling import SamplingParams

log = logging.getLogger("jeagle.runtime")

HISTORY = 100_000  # per-step records kept between reset_stats() calls (a server runs for days)


class Engine(KVFlow, CompilationsAfterWarmup):
    def __init__(self, decoder, config):
        self.decoder, self.config = decoder, config
        self.model_cfg = decoder.model_cfg
        self.executables = decoder.executables
        self.buckets = decoder.buckets
        self.max_context, self.max_running = decoder.max_ctx, decoder.max_reqs
        self.pool = SlotPool(decoder.num_slots, decoder.max_reqs)
        self.kv = KVManager(self.pool, speculative=decoder.speculative, vocab=self.model_cfg.vocab_size,
                            prefix_cache=config.prefix_cache)
        self.limits = RequestLimits(max_ctx=decoder.max_ctx, vocab_size=self.model_cfg.vocab_size,
                                    eos_token_ids=tuple(self.model_cfg.eos_token_ids),
                                    context_reserve=decoder.context_reserve, pool_slots=decoder.num_slots - 1)
        self.verify_done = VerifyDone(verify_done_mode(config.verify_done_wait))
        self.gate = AdmissionGate(config.admission_delay, config.admission_max_wait_steps)  # admission in groups
        self.bucket_shrink_ratio, self._bucket = 1.0 if config.disable_padding else config.bucket_shrink_ratio, 0  # `step`
        # The queues: waiting to be admitted, admitted, dispatched but unread ((kind, requests, result)).
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._pending: deque = deque()
        self._releasing: deque = deque()  # (finished requests, their slot tables being read back)
        self._to_read: list[Request] = []  # finished in this processing, their tables not asked for yet
        self._admitted = 0  # admissions so far (a request's admit_order: the youngest is retracted first)
        self._hold_admission = False  # after a retraction, until a request finishes
        self._admitting: list[Request] = []  # admitted by the current `_admit_waiting`, not yet prefilled
        self._unjoined = None  # the last step's result while its call runs on the dispatch thread (`_join_step`)
        self.retractions = 0
        # The host's time since start (s), summed, for a server's /server_info (a client takes differences):
        # steps that dispatched a decode step or round; their host time not spent waiting on the device
        # ("busy") and waiting ("blocked"); the decode/round dispatch calls and the prefill calls (inputs
        # packed and the executable called: XLA's per-call work is most of it).
        self.host_totals = {"steps": 0, "busy_s": 0.0, "blocked_s": 0.0, "dispatch_s": 0.0, "prefills": 0,
                            "prefill_dispatch_s": 0.0}
        self.tables_waited_s = 0.0  # reading finished requests' slot tables back (KVFlow._complete)
        # Executables run once on padding rows (warm-up on a GPU, and a warm start's preload): `_prime`.
        self._primed: set = set()
        self.prime_after_warmup = jax.default_backend() == "gpu"
        self._init_ratios(config.schedule_conservativeness)
        self._next_index = 0
        self.last_stats: Stats | None = None
        self.reset_stats()

    # ---- what the engine is ------------------------------------------------------------------------
    @property
    def speculative(self) -> bool:
        return self.decoder.speculative

    @property
    def adaptive(self) -> bool:
        return getattr(self.decoder, "controller", None) is not None

    @property
    def context_reserve(self) -> int:
        """Positions of the context a request must leave free (speculative: S + 1)."""
        return self.decoder.context_reserve

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        return self.buckets.batch

    @property
    def verify_done_mode(self) -> str:
        return self.verify_done.mode

    @property
    def compile_seconds(self) -> float:
        return self.executables.compile_seconds

    @property
    def num_compiled(self) -> int:
        return self.executables.num_compiled

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._pending)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def info(self) -> dict:
        """The live counters a server reports (`/server_info`)."""
        kv, cache = self.kv, self.kv.cache
        return {"running_requests": self.num_running, "queued_requests": self.num_waiting,
                "kv_slots_free": self.pool.free_slots, "kv_slots_total": self.pool.num_slots - 1,
                "prefix_cache": cache is not None, "prefix_cache_slots": cache.cached_slots if cache else 0,
                "prefix_cache_evictable_slots": cache.evictable_slots if cache else 0,
                "cached_tokens_total": kv.cached_tokens_total, "evicted_slots_total": kv.evicted_total,
                "retractions": self.retractions, "new_token_ratio": round(self.new_token_ratio, 4),
                "host_totals": self.host_totals | gc_totals(), "admission_held_steps": self.gate.held} | self.decoder.info()

    def check_kv(self) -> None:  # raise unless every KV slot is free, cached once or owned once (`KVManager.check`)
        holders = list(self._running) + self._to_read + [r for done, _ in self._releasing for r in done]
        self.kv.check(holders)

    def flush_cache(self) -> int:  # evict every cached prefix no request uses; returns the slots freed
        return self.kv.flush()

    # ---- requests ------------------------------------------------------------------------------------
    def check(self, prompt: list[int], params: SamplingParams = SamplingParams(), index: int = 0) -> Request:
        """The request `submit` would queue, checked (PromptTooLong, OutOfSlots, ValueError), queued nowhere."""
        layout, max_ctx = self.decoder.layout, self.max_context
        return make_request(index, prompt, params, self.limits, lambda n, m: layout.slots_needed(n, m, max_ctx),
                            lambda n, m: layout.positions(n, m, max_ctx))

    def submit(self, prompt: list[int], params: SamplingParams = SamplingParams(),
               on_tokens: Callable[[int, list[int]], None] | None = None, index: int | None = None) -> Request:
        """Queue one request (checked now: a bad one raises and queues nothing). `step()` admits it
        when a row and its slots are free; its `out` fills as tokens arrive, `done` says when it
        finished; `on_tokens(index, ids)` streams."""
        if index is None:
            index = self._next_index
        self._next_index = max(self._next_index, index + 1)
        r = self.check(prompt, params, index)
        r.on_tokens, r.t_submit, r.compile_mark = on_tokens, time.perf_counter(), self.compile_seconds
        if params.grammar is not None:  # started here, not in check(): a matcher builds the grammar's parser
            # Admitted once built (`_admit_waiting`); a copy of the grammar's where the host walks its rows.
            r.matcher = params.grammar.matcher(background=True, shared=self.decoder.walks(params))
        self._waiting.append(r)
        return r

    def abort(self, r: Request) -> None:
        """Stop a request now: it leaves the queue or the batch, its row and slots are free at once (steps already in
        flight still write them, but anything reusing them is dispatched after), its tokens in flight are dropped."""
        if r.done:
            return
        r.finish("abort")
        if r in self._waiting:
            self._waiting.remove(r)
        elif r.table is not None:
            self.kv.release(r)  # nothing cached: its last dispatches may still be in flight
        self._running = [x for x in self._running if x is not r]

    def abort_all(self) -> list[Request]:
        """Abort every request (waiting, running, in flight) and leave the engine idle: after a failed
        step, nothing in flight is read. Returns the requests aborted."""
        self.decoder.settle()  # a call still on the dispatch thread: waited for, its error dropped (not raised again)
        self._unjoined, self._bucket = None, 0
        reqs = [*self._waiting, *self._admitting, *self._running] + [r for _, batch, _ in self._pending for r in batch]
        reqs = list({id(r): r for r in reqs if not r.done}.values())
        for r in reqs:
            self.abort(r)
        self._pending.clear()
        for r in self._to_read:  # finished, their tables never read: their KV is freed, not cached
            self.kv.release(r)
        self._to_read.clear()
        while self._releasing:  # finished before the failure: their tables' reads may have failed too
            done, handle = self._releasing.popleft()
            try:
                self._complete(done, handle)
            except Exception:
                for r in done:
                    self.kv.release(r)
        self.decoder.dropped()
        self._admitting = []
        try:  # after a failed step the last round's results may be the failure itself: drop them
            self.verify_done.wait()
        except Exception:
            log.warning("abort_all: the last step's results failed; dropped", exc_info=True)
        return reqs

    def _deliver(self, r: Request, tokens, logprobs=None) -> None:
        new = r.take(tokens, self.compile_seconds, logprobs)
        if new and r.on_tokens is not None:
            r.on_tokens(r.index, new)
        if r.done:
            self._hold_admission = False
            self._release(r)

    # ---- the scheduler step ----------------------------------------------------------------------------
    def _admit_waiting(self) -> None:
        """Admit what fits, in arrival order, and prefill it in groups of bounded padded size."""
        waiting, running, dec = self._waiting, self._running, self.decoder
        group: list[Request] = []
        self._admitting = group  # admitted in this call, not running yet: admission counts them (`_holders`)
        longest = 0

        def flush():
            b, t = self.buckets.prefill(len(group), longest)
            context = self.buckets.context(max(len(r.seq) for r in group)) if any(r.start for r in group) else 0
            t0, compiled = time.perf_counter(), self.compile_seconds
            self._pending.append(("prefill", list(group), dec.prefill(group, b, t, context=context)))
            spent = time.perf_counter() - t0
            self.host_totals["prefills"] += 1
            self.host_totals["prefill_dispatch_s"] += spent
            self._acct["prefill_dispatches"].append(spent)
            self.gate.prefill_called(spent, self.compile_seconds != compiled)
            for r in group:
                self.kv.prefilled(r)  # its prompt's KV is on its way: later requests may share it
            running.extend(group)
            group.clear()

        if self._hold_admission and running or waiting and not self.gate.due(len(running), self.max_running, len(waiting)):
            return
        if waiting and (self._to_read or self._releasing) and len(running) < self.max_running:
            # Finished requests' KV into the prefix cache before admitting: a waiting request may
            # continue one of them (the next turn of a chat). This waits for the round in flight.
            self._ask_tables()
            self._complete_releases()
        self._open_books()  # admission's sums over the running requests: once in this call, not per request
        try:
            while waiting and len(running) + len(group) < self.max_running:
                nxt = waiting[0]
                if nxt.matcher is not None and not nxt.matcher.ready and (group or running):
                    break  # its grammar's matcher is being built (the prefill needs its mask): next step
                if group and (not self.buckets.prefill_fits(len(group) + 1, max(longest, len(nxt.seq) - nxt.start))
                              or self.kv.shares_prefix(nxt, group)):
                    flush()
                    longest = 0
                    continue
                if not self._admit(nxt):
                    break
                group.append(waiting.popleft())
                longest = max(longest, len(nxt.seq) - nxt.start)
        finally:
            self._close_books()
        if group:
            flush()
        if waiting and not running and not self._pending:
            r = waiting.popleft()
            r.finish("abort")
            raise OutOfSlots(f"cannot admit request {r.index} although nothing is running (it was dropped)")

    def step(self) -> None:
        """One scheduler step: wait (verify_done) → admit (prefill what fits) → dispatch one decode step or
        round over the live batch → process the results that are due (with overlap, the previous step's:
        this one stays in flight) → release finished requests' slots. Host time: `StepClock`."""
        dec, pending = self.decoder, self._pending
        clock = StepClock(self)
        clock.joined(self._join_step())
        clock.waited(self.verify_done.wait())  # the last round's verify results (sync: a hard wait)
        if not self._running:  # nothing runs that waiting on the finished requests' table reads would stall
            self._ask_tables()
            self._complete_releases()

        self._admit_waiting()

        live, longest = [r for r in self._running if dec.wants_step(r)], 0
        if live:
            live, waited, longest = self._reserve(live)
            clock.waited(waited)
        grammar = wants_grammar(live)

        def drain():  # grammar masks need every token in flight: target-only first, EAGLE inside its round
            with clock.waiting():
                while pending:
                    self._process(*pending.popleft())
        if grammar and pending and not dec.speculative:
            drain()
            self._running = [r for r in self._running if not r.done]
            live = [r for r in self._running if dec.wants_step(r)]
        if live:
            b, kv = self.buckets.decode(len(live), longest, self._bucket, self.bucket_shrink_ratio)
            self._bucket = b
            self._acct["buckets_used"].add(b)
            with clock.dispatching():
                result = dec.step(live, b, kv, drain)
            pending.append(("step", live, result))
            self._unjoined = result
            if not dec.threaded:  # else its call runs beside this step's processing and the server's hand-over
                self._join_step()  # (the calling thread's result: its verify_done handle recorded at dispatch)

        # Overlap: keep this step in flight while the host processes the previous one; without overlap (or
        # with nothing more to dispatch) process everything now. A target-only grammar step is processed at
        # once: its requests' next masks need its tokens.
        keep = 1 if live and self.config.overlap and (dec.speculative or not grammar) else 0
        while len(pending) > keep:
            clock.waited(self._process(*pending.popleft()))
        self._running = [r for r in self._running if not r.done]

        # The finished requests' slot tables are read when their rows and slots are wanted (requests wait) or
        # nothing else runs: a read between two rounds stalls the device more than a round's host work would
        # (bench/HISTORY.md, 2026-11-26), and until then their KV stays where it is.
        if self._waiting or not self._running:
            self._ask_tables()
        self._complete_releases(wait=False)  # after the dispatch: their host work overlaps the device's
        if live:
            clock.book()
            self._decay_ratio()
        if not self.has_work:  # idle: nothing may stay pending
            self._join_step()
            self._bucket = 0
            self.verify_done.wait()
            self._complete_releases()

    def _join_step(self) -> float:
        """Record the last step's verify_done handle; where a dispatch thread runs its call
        (`EngineConfig.dispatch_thread`: joined at the next step's start), wait for the call first. Returns
        the seconds waited (the call's host time that did not overlap the host's own work)."""
        result, self._unjoined = self._unjoined, None
        if result is None:
            return 0.0
        t0 = time.perf_counter()
        handle = self.decoder.verify_handle(resolve(result))
        if handle is not None:
            self.verify_done.record(handle)
        return time.perf_counter() - t0

    def _process(self, kind, batch, result) -> float:
        """Read one dispatched result and deliver its tokens; returns the seconds the host waited."""
        t1 = time.perf_counter()
        host = np.asarray(result)  # its copy started at dispatch: this waits only if it is not done
        waited = time.perf_counter() - t1
        for r, got in zip(batch, self.decoder.unpack(kind, batch, host)):
            if r.done:
                continue
            if got.prompt_logprobs is not None:
                r.out.prompt_logprobs = got.prompt_logprobs
            self._deliver(r, got.tokens, got.logprobs)
            if got.finished and not r.done:
                raise AssertionError(f"request {r.index}: the device finished it, the host did not")
        return waited

    # ---- warm-up -------------------------------------------------------------------------------------------
    def warmup(self, batch_sizes=None, prefill_lengths=None, kv_lengths=None, greedy=(True, False),
               progress: bool = True, **modes) -> float:
        """Compile ahead of time every executable `generate()` can dispatch for the given sizes (None: all of them):
        prefill for every (batch, length) bucket pair within max_prefill_tokens, decode steps / rounds (every tier's)
        for every (batch, prefix) bucket pair in each mode of `greedy`; all of them in each mode of `logprobs` (True:
        the executables that also return logprobs) and the decode steps / rounds in each mode of `penalties` (True:
        those that apply penalties), and the prefills in each mode of `prefix` (True: those that continue a cached
        prefix, every context bucket; a server with the prefix cache on wants both), the decode steps / rounds in
        each mode of `grammar` (True: those grammar batches run). Afterwards generate() compiles nothing for those
        shapes (stats: `compilations_after_warmup`; JAX's count: `xla_compilations_after_warmup`). Returns the seconds."""
        return self._warmup(self.warmup_plan(batch_sizes, prefill_lengths, kv_lengths, greedy, **modes), progress)

    def _warmup(self, keys, progress: bool) -> float:
        """Compile `keys`, run each once on padding rows on a GPU (`_prime`), then let the decoder time what it times
        (the adaptive tiers' rounds); all counted as warm-up and compile time."""
        self.executables.warmup(keys, progress)
        if self.prime_after_warmup:
            t0 = time.perf_counter()
            for key in dict.fromkeys(keys):
                self._prime(key)
            self.executables.add_startup_seconds(time.perf_counter() - t0)
        self.decoder.calibrate_keys(keys)
        return self._warmed_up(self.executables.warmup_seconds)

    def _prime(self, key) -> None:
        """`decoder.prime(key)` once per executable: its first run on the device (kernels and constants loaded, 15-17 ms
        for a fresh 256-token prefill on an H100, HISTORY, 2026-11-26) falls in the warm-up, not in a first token."""
        if key not in self._primed:
            self._primed.add(key)
            self.decoder.prime(key)

    def warmup_plan(self, batch_sizes=None, prefill_lengths=None, kv_lengths=None, greedy=(True, False),
                    prefix=(False,), **modes) -> list:
        """The step keys `warmup` compiles for these sizes (see there; modes: logprobs, penalties, grammar)."""
        prefill, decode = self.buckets.warmup_plan(batch_sizes, prefill_lengths, kv_lengths,
                                                   prefix if self.kv.cache is not None else (False,))
        return self.decoder.warmup_keys(prefill, decode, greedy, **modes)

    def plan_for(self, prompt_lengths, max_new_tokens: int, greedy=(True, False), **modes) -> list:
        """The step keys these prompts can dispatch: batch sizes up to their number (capped by the running batch),
        their prompt-length buckets, the prefix buckets up to the longest context they can reach; in the modes
        asked (logprobs, penalties, grammar: `warmup`). With the prefix cache on, also the prefills that continue
        a cached prefix unless `prefix` says otherwise: a prompt admitted after another with the same start (a
        chat template's) continues it, which at batch 1 is every prompt after the first."""
        lengths = list(prompt_lengths)
        n = min(len(lengths), self.max_running)
        longest = max(self.decoder.prefix_bound(x, max_new_tokens, self.config.overlap) for x in lengths)
        kv = [k for k in self.buckets.kv if k < longest] + [longest]
        modes.setdefault("prefix", (False, True) if len(lengths) > 1 else (False,))
        return self.warmup_plan(batch_sizes=range(1, n + 1), prefill_lengths=lengths, kv_lengths=kv, greedy=greedy,
                                **modes)

    def warmup_for(self, prompt_lengths, max_new_tokens: int, greedy=(True, False), progress: bool = True,
                   **modes) -> float:
        """Warm up only what these prompts can dispatch (`plan_for`)."""
        return self._warmup(self.plan_for(prompt_lengths, max_new_tokens, greedy, **modes), progress)

    def preload_for(self, prompt_lengths, max_new_tokens: int, greedy=(True, False), **modes) -> int:
        """A warm start's warm-up, which compiles nothing: of what these prompts can dispatch (`plan_for`), what the
        executable store holds loads now, in parallel, and each runs once on padding rows (`decoder.prime`), so that
        neither its loading nor its first run on the device (~0.2 s for a prefill on an H100) falls in a request's
        time to first token. The rest compiles on first use. Counted as compile time; returns how many loaded."""
        keys = self.plan_for(prompt_lengths, max_new_tokens, greedy, **modes)
        loaded = self.executables.preload(keys, self._prime)
        self.decoder.calibrate_keys(keys, compile=False)
        return self._warmed_up(loaded)

    # ---- stats -----------------------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Start a new accounting window for `stats()`."""
        self._acct = {"t0": time.perf_counter(), "compile0": self.compile_seconds, "compiled0": self.num_compiled,
                      "blocked_per_step": deque(maxlen=HISTORY), "busy_per_step": deque(maxlen=HISTORY),
                      "dispatch_per_step": deque(maxlen=HISTORY), "prefill_dispatches": deque(maxlen=HISTORY),
                      "buckets_used": set(), "held0": self.gate.held, "prefills0": self.host_totals["prefills"],
                      "retractions0": self.retractions, "mask0": self.decoder.grammar_mask_s,
                      "decoder": self.decoder.stats_window()}

    def stats(self, reqs: list[Request]) -> Stats:
        """Stats of the window since `reset_stats()` for the requests `reqs`."""
        acct, exes = self._acct, self.executables
        wall = time.perf_counter() - acct["t0"] - (self.compile_seconds - acct["compile0"])
        compiled = self.num_compiled - acct["compiled0"]
        return Stats(prompt_tokens=sum(len(r.prompt) for r in reqs),
                     new_tokens=sum(len(r.out.token_ids) for r in reqs), wall_s=wall,
                     compile_s=self.compile_seconds - acct["compile0"], compilations=compiled,
                     compilations_after_warmup=compiled if exes.warmup_seconds is not None else None,
                     warmup_s=exes.warmup_seconds, steps=len(acct["blocked_per_step"]),
                     host_blocked_ms=latency_stats(acct["blocked_per_step"]),
                     host_busy_ms=latency_stats(acct["busy_per_step"]),
                     host_dispatch_ms=latency_stats(acct["dispatch_per_step"]),
                     host_prefill_dispatch_ms=latency_stats(acct["prefill_dispatches"]),
                     prefill_calls=self.host_totals["prefills"] - acct["prefills0"],
                     admission_held_steps=self.gate.held - acct["held0"],
                     buckets_used=sorted(acct["buckets_used"]), overlap=self.config.overlap,
                     verify_done_wait=self.verify_done.mode, executables_from_store=exes.loaded_from_store,
                     cached_tokens=sum(r.cached_tokens for r in reqs),
                     retractions=self.retractions - acct["retractions0"],
                     grammar_mask_ms=(self.decoder.grammar_mask_s - acct["mask0"]) * 1e3,
                     speculative=self.decoder.stats(acct["decoder"]))

    # ---- all at once ----------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = SamplingParams(),
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Output]:
        """Run every prompt to completion; outputs in prompt order. `on_tokens(index, ids)` streams
        (index: the prompt's position). Built on submit() / step(); the stats land in `last_stats`."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt")
        if self.has_work:
            raise RuntimeError("generate() on an engine with requests in flight; finish them with step() first")
        # Check every prompt before queueing any: a bad one fails the call and loses nothing.
        for i, (p, sp) in enumerate(zip(prompts, params)):
            self.check(p, sp, i)
        self.reset_stats()
        reqs = [self.submit(p, sp, on_tokens, index=i) for i, (p, sp) in enumerate(zip(prompts, params))]
        try:
            while self.has_work:
                self.step()
        except BaseException:
            self.abort_all()  # leave the engine idle and its slots free
            raise
        self.last_stats = self.stats(reqs)
        return [r.out for r in reqs]
