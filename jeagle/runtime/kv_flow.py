"""The engine's side of KV slot ownership (`KVFlow`, a base of `runtime.scheduler.Engine`): admission
(a row, the longest cached prefix, slots), growth before each dispatch (`_reserve`), retraction when
the pool runs short, and the release of finished requests into the prefix cache or the free list.
`runtime/kv.py` (`KVManager`) keeps the books; this is when the engine asks it, and what it waits on.

Finished requests of a speculative engine are released from their slot-table rows as the device
left them (rounds swap slots there), read back asynchronously. Those reads, like the slot-table
updates that grow a request, are executables dispatched between two rounds: each stalls the device
(bench/HISTORY.md, 2026-11-26), so the reads are asked for only when rows or slots are wanted
(requests wait) or nothing runs, and completed without waiting while a batch runs.
"""

from __future__ import annotations

import logging
import math
import time

from jeagle.runtime.kv import Committed, ShortOfSlots
from jeagle.runtime.requests import Request
from jeagle.runtime.slots import OutOfSlots

log = logging.getLogger("jeagle.runtime")

# The expected share of a running request's remaining tokens that admission keeps room for (SGLang's
# new_token_ratio: init 0.7, floor 0.1, back from init to the floor in 600 steps, each times
# EngineConfig.schedule_conservativeness); after a retraction, what the running requests have decoded
# so far (plus RETRACT_STEPS each) over what they may decode.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
RATIO_DECAY_STEPS = 600
RETRACT_STEPS = 20


class KVFlow:
    """Engine methods over its KVManager (`self.kv`), pool, decoder and queues (see `Engine`)."""

    def _init_ratios(self, conservativeness: float) -> None:
        self._conservativeness = conservativeness
        self._ratio_init = INIT_NEW_TOKEN_RATIO * conservativeness
        self._ratio_min = MIN_NEW_TOKEN_RATIO * conservativeness
        self.new_token_ratio = self._ratio_init

    def _decay_ratio(self) -> None:
        """After each dispatched step: the estimate relaxes towards its floor."""
        step = (self._ratio_init - self._ratio_min) / RATIO_DECAY_STEPS
        self.new_token_ratio = max(self._ratio_min, self.new_token_ratio - step)

    def _expected_room(self, r: Request, positions: int) -> int:
        """Slots to keep free beyond r's first `positions` (what its admission takes): the expected
        share (`new_token_ratio`) of the tokens every running request and r may still decode, past
        what they hold. Admitting only what fits now fills the pool with requests that then outgrow
        it: under a closed loop of clients at max_tokens = the context, the policy of 2026-11-26
        retracted 47 requests in 15 s and served 0.92x (target-only) and 0.31x (EAGLE) the old
        whole-context reservation (H100, bench/HISTORY.md, 2026-11-26). r's cached prefix is not
        counted (`KVManager.admit` takes only what r adds). Nothing running: none (r is admitted if
        it fits at all). The running requests' part is summed once per `_admit_waiting` (`_books`)."""
        ratio = self.new_token_ratio
        books = self._books()
        if ratio <= 0 or not books.holders:
            return 0
        return math.ceil(books.grow.value() + max(0.0, expected_positions(r, ratio) - positions))

    def _retracted_ratio(self) -> None:
        """After a retraction (SGLang's estimate): the share the running requests have used so far
        (times the conservativeness: 0 keeps admission eager)."""
        running = self._holders()
        total = sum(max(1, x.position_cap - len(x.prompt)) for x in running)
        if total:
            used = sum(len(x.out.token_ids) for x in running) + RETRACT_STEPS * len(running)
            c = self._conservativeness
            self.new_token_ratio = min(c, max(self.new_token_ratio, c * used / total))

    def _holders(self) -> list[Request]:
        """The requests holding slots that admission must leave room for: running, and admitted
        earlier in the same `_admit_waiting` call (their prefill not dispatched yet)."""
        return [x for x in self._running + self._admitting if x.table is not None]

    # Admission's sums over `_holders()` (`AdmissionBooks`), kept through one `_admit_waiting` call
    # (`_open_books` .. `_close_books`): there nothing changes a holder's table or tokens, or the
    # ratio, but a trim (they are summed again) and the admissions (each adds its request). Outside
    # such a call every `_admit` sums afresh. Summed per admitted request, they cost O(running) each:
    # O(N^2) host time to fill a batch of N (bench/probes/admission.py, CPU: generate() of 8,000
    # requests at once spent 41 of its 42 s admitting them, target-only; 3.2 s in all with the books).
    # Once per call, not kept across steps: the ratio moves every step and with it every holder's term
    # (and whether it is clipped at 0), so no exact running form outlives a step; a step costs
    # O(running) anyway.
    _books_open = False
    _books_kept: AdmissionBooks | None = None

    def _open_books(self) -> None:
        self._books_open, self._books_kept = True, None

    def _close_books(self) -> None:
        self._books_open, self._books_kept = False, None

    def _books(self) -> AdmissionBooks:
        books = self._books_kept
        if books is None or books.ratio != self.new_token_ratio:
            books = AdmissionBooks(self.new_token_ratio, self.kv.chunk)
            for x in self._holders():
                books.add(x)
            if self._books_open:
                self._books_kept = books
        return books

    def _admit(self, r: Request) -> bool:
        """Admit r if the pool has room for it and for what the holders are expected to grow into
        (`KVManager.admit`); the caller then adds it to `_admitting`."""
        lay, kv = self.decoder.layout, self.kv
        extra = lay.tree + lay.scratch
        # Room for the prompt and a chunk more (its whole context while the pool has room to spare:
        # no slot-table update while it runs); the running requests keep a chunk each to grow into.
        chunk = kv.chunk
        books = self._books()
        headroom = books.headroom
        # What everything else could still ask: the running requests' whole contexts, a whole context
        # for every other free row.
        elsewhere = books.want + (self.pool.free_rows - 1) * (self.max_context + extra)
        positions = (r.position_cap if kv.roomy(r.position_cap + extra + headroom, elsewhere)
                     else min(r.position_cap, len(r.seq) + chunk))
        room = max(headroom, self._expected_room(r, positions))
        if not kv.admit(r, positions, extra, room):
            # Tails the running requests grew ahead of need go back before r is turned away, unless the
            # expected growth turned it away: a trim moves slots from the tables to the free list and as
            # many into the growth still expected, so it would only cost slot-table updates.
            if room > headroom or not (self.pool.free_rows and self._trim_running()):
                return False
            self._books_kept = None  # the running requests' tables shrank: summed again
            positions = min(r.position_cap, len(r.seq) + chunk)
            if not kv.admit(r, positions, extra, max(headroom, self._expected_room(r, positions))):
                return False
        if not r.retractions:
            r.cached_tokens = r.cached
        self._admitted += 1
        r.admit_order = self._admitted
        if self._books_kept is not None:
            self._books_kept.add(r)  # the next holder: the caller appends r to `_admitting`
        return True

    def _trim_running(self) -> int:
        """The running requests' slots past what any dispatch may write back to the pool; returns how many."""
        return sum(self.kv.trim(x, self.decoder.prefix_needed(x)) for x in self._running)

    def _release(self, r: Request) -> None:
        """A finished request's KV: what it committed to the prefix cache, the rest freed. Where rounds
        swap slots on the device, its slot-table row is read back first (asynchronously)."""
        if r.table is None:  # released already: an abort from the request's own token callback
            return
        if not self.kv.usable(r):
            self.kv.release(r)
        elif self.decoder.swaps_slots:
            self._to_read.append(r)
        else:
            self.kv.release(r, Committed(len(r.seq) - 1, r.table))

    def _ask_tables(self) -> None:
        """Start reading the slot tables of the requests that finished in this processing."""
        if self._to_read:
            done = [r for r in self._to_read if r.table is not None]
            if done:  # (read before they leave _to_read: a failed read leaves them for abort_all to free)
                self._releasing.append((done, self.decoder.read_tables([r.row for r in done])))
            self._to_read = []

    def _complete(self, done, handle) -> None:
        t = time.perf_counter()
        tables, lengths = self.decoder.tables_of(handle)  # blocks while the read is in flight
        self.tables_waited_s += time.perf_counter() - t
        for r, table, n in zip(done, tables, lengths):
            if r.table is not None:
                self.kv.release(r, Committed(int(n), table))

    def _complete_releases(self, wait: bool = True) -> None:
        """Release the finished requests whose slot tables were read: all of them (wait: the host
        blocks on reads still in flight), or only those whose reads are done (a read dispatched behind
        the round in flight is not done before that round is: waiting on it would idle the device)."""
        while self._releasing and (wait or self.decoder.tables_ready(self._releasing[0][1])):
            self._complete(*self._releasing.popleft())

    def _reserve(self, live: list[Request]) -> tuple[list[Request], float, int]:
        """Slots for every position the next dispatch over `live` may write (written into the device's
        slot table), retracting the youngest requests while the pool cannot give them. Returns (the
        batch to dispatch, seconds the host waited on results in flight, the longest prefix it needs).
        When a row needs slots, every row within half a chunk of its end gets its next chunk in the
        same slot-table update: one update every few dozen rounds, not one per row crossing a chunk
        (each is a dispatch of its own on the host's critical path)."""
        dec, waited, trimmed = self.decoder, 0.0, False
        while True:
            need = [dec.prefix_needed(r) for r in live]
            entries, short = [], False
            if any(n > len(r.table) for r, n in zip(live, need)):
                ahead = 0 if trimmed else self.kv.chunk // 2  # none once the pool ran short
                for r, n in zip(live, need):
                    try:
                        got = self.kv.ensure(r, n + ahead)
                    except ShortOfSlots:
                        try:  # without the half chunk ahead
                            got = self.kv.ensure(r, n)
                        except ShortOfSlots:
                            short = True
                            break
                    if got is not None:
                        entries.append((r.row, *got))
            if entries:
                dec.assign_slots(entries)
            if not short:
                return live, waited, max(need, default=0)
            # Short: first the slots requests hold ahead of need (grown while the pool had room), once
            # (what this loop allocates again past need would be trimmed again, without end).
            if not trimmed:
                trimmed = True
                if self._trim_running():
                    continue
            if self._pending or self._to_read or self._releasing:
                # Read every result in flight (finished requests free their slots; the rest's state
                # is final), then try again.
                t1, tables0 = time.perf_counter(), self.tables_waited_s
                while self._pending:
                    self._process(*self._pending.popleft())
                self._ask_tables()
                self._complete_releases()
                waited += time.perf_counter() - t1 - (self.tables_waited_s - tables0)  # (the step adds those)
            elif len(self._running) > 1:
                self._retract(max(self._running, key=lambda x: x.admit_order))
            else:
                raise OutOfSlots(f"request {live[0].index} alone cannot get the KV slots it needs "
                                 f"({self.kv.available} available of {self.pool.num_slots - 1})")
            self._running = [r for r in self._running if not r.done]
            live = [r for r in self._running if dec.wants_step(r)]
            if not live:
                return live, waited, 0

    def _retract(self, r: Request) -> None:
        """Take r out of the batch (nothing of it in flight): its committed KV to the prefix cache,
        the rest freed, r back at the head of the queue to resume from its tokens so far."""
        dec = self.decoder
        if dec.swaps_slots:
            tables, lengths = dec.tables_of(dec.read_tables([r.row]))
            committed = Committed(int(lengths[0]), tables[0])
        else:
            committed = Committed(len(r.seq) - 1, r.table)
        self.kv.release(r, committed)
        r.row, r.start, r.length, r.dispatched, r.processed = -1, 0, 0, 0, 0
        r.retractions += 1
        self.retractions += 1
        self._hold_admission = True
        self._running = [x for x in self._running if x is not r]
        self._waiting.appendleft(r)
        self._retracted_ratio()
        log.info("retracted request %d after %d tokens (%d KV slots free)", r.index, len(r.out.token_ids),
                 self.pool.free_slots)


def expected_positions(x: Request, ratio: float) -> float:
    """The positions x is expected to reach: what it holds of its sequence and `ratio` of the rest."""
    n = len(x.prompt) + len(x.out.token_ids)  # len(x.seq), without building it
    return n + ratio * max(0, x.position_cap - n)


class FloatSum:
    """`builtins.sum` of the floats added so far, in that order, kept as they come: CPython (3.12 and
    later, what jeagle requires) sums floats with Neumaier's compensation, and `value()` is that sum
    bit for bit (tests/test_admission_books.py)."""
    __slots__ = ("s", "c")

    def __init__(self):
        self.s, self.c = 0.0, 0.0

    def add(self, x: float) -> None:
        s = self.s
        t = s + x
        if abs(s) >= abs(x):
            self.c += (s - t) + x
        else:
            self.c += (x - t) + s
        self.s = t

    def value(self) -> float:
        c = self.c
        return self.s + c if c and math.isfinite(c) else self.s


class AdmissionBooks:
    """What admission sums over the requests holding slots (`KVFlow._holders`), in their order, at one
    `new_token_ratio`: `headroom` (a chunk each, within its context), `want` (the rest of every
    context) and `grow` (the expected positions past what each holds, `KVFlow._expected_room`)."""
    __slots__ = ("ratio", "chunk", "holders", "headroom", "want", "grow")

    def __init__(self, ratio: float, chunk: int):
        self.ratio, self.chunk = ratio, chunk
        self.holders = self.headroom = self.want = 0
        self.grow = FloatSum()

    def add(self, x: Request) -> None:
        have, cap = len(x.table), x.position_cap
        self.holders += 1
        self.headroom += min(self.chunk, cap - have)
        self.want += cap - have
        self.grow.add(max(0.0, expected_positions(x, self.ratio) - have))
