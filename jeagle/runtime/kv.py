"""Who owns which KV slot: the requests, the prefix cache, or nobody (the free list).

A running request holds one request row and
    positions [0, cached)        slots the prefix cache owns (`RadixCache`), locked by the request
    positions [cached, allocated) slots of its own: while the pool has room to spare (`roomy`) its
                                  whole context at admission, else its prompt and `CHUNK` more, then
                                  on demand (`ensure`): a round's worth ahead plus `CHUNK` (doubling
                                  while roomy); tails past need go back (`trim`) before anything is
                                  refused or retracted
    extra                         its tree and draft scratch slots (speculative), allocated at admission
A speculative round swaps accepted tree slots into positions on the device (`kernels/commit_slots.py`),
so the host knows the request's own slots as a set; which of them holds which position it learns by
reading the request's slot-table row back (`Committed`) when it caches them.

Why not on demand always: each growth is a slot-table update, an executable dispatched between two
rounds that stalls the device (H200, SmolLM2 + EAGLE-3 at batch 48, ms per round: 2.41 with no
updates and no table reads, 2.65 with 64-slot updates, 3.04 with the reads of finished requests'
tables as well; bench/HISTORY.md, 2026-11-26). Under pressure the pool is used on demand, as SGLang
does; with room to spare on-demand growth gains nothing.

The prefix cache takes positions at two moments: after a prefill is dispatched (the prompt's, whose
slots the host assigned itself), and when a request finishes or is retracted (everything committed
on the device). Anything dispatched later that reads those slots runs after the writes on the device.
When the free list runs short, unreferenced cached prefixes are evicted, least recently used first.

Retraction (the scheduler's `_reserve`): when the running batch's next dispatch needs slots the pool
(free, or held by evictable cached prefixes) cannot give, the host reads every result in flight, then
retracts the youngest request: its committed KV goes to the prefix cache, everything else it holds
is freed, and it waits at the head of the queue. Resumed, it prefills its prompt and the tokens it
has emitted (most of them from the cache) and samples its next token from that prefill: greedy
output is unchanged, and target-only sampling too (each token's random draw is keyed by its
position). Admission pauses after a retraction until a request finishes, so the two do not alternate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jeagle.runtime.radix import RadixCache, bigram_keys, token_keys
from jeagle.runtime.slots import SlotPool

CHUNK = 64  # positions allocated past what the next dispatch needs (fewer slot-table updates)
# A cached prefix shorter than this is not used: it would save next to nothing, and a prefill that
# continues a prefix is another executable (prompts sharing only a BOS token would each compile one).
MIN_CACHED = 16
# A request waits for the next prefill to take a prompt of its group from the cache only when it shares
# with it at least this many tokens (or the whole prompt: n samples of one prompt). A shorter shared run
# (a chat template's system line: 24 tokens for SmolLM2) costs less computed again in the same prefill
# than another prefill dispatch does; waiting on it split 48 MT-bench chat prompts into 7 prefills, not 3.
SHARE_WAIT = 256
# A request's slots grow geometrically (`KVManager.ensure`) while this share of the pool stays free.
GROW_FREE = 0.25


@dataclass
class Committed:
    """What a request's KV holds once its last dispatch is done: `length` positions, whose slots are
    `table[:length]` (the device's slot-table row, or the host's where no round swaps slots)."""
    length: int
    table: np.ndarray


class KVManager:
    def __init__(self, pool: SlotPool, *, speculative: bool, vocab: int, prefix_cache: bool):
        self.pool = pool
        self.speculative, self.vocab = speculative, vocab
        self.cache = RadixCache() if prefix_cache else None
        self.chunk = CHUNK
        self.cached_tokens_total = 0
        self.evicted_total = 0
        self.trimmed_total = 0  # slots given back from requests' tables grown ahead of need (`trim`)

    # ---- keys ----------------------------------------------------------------------------------------
    def keys(self, seq, n: int) -> list[int]:
        """Keys of positions 0..n-1 of the token sequence `seq`."""
        return bigram_keys(seq, n, self.vocab) if self.speculative else token_keys(seq, n)

    def usable(self, r) -> bool:
        """Whether a request may start from a cached prefix: not when its prefill must see every
        prompt token (penalties count the prompt's tokens; prompt logprobs score each)."""
        return self.cache is not None and not r.params.penalized and not r.wants_prompt_logprobs

    def shares_prefix(self, r, group) -> bool:
        """Whether r's prompt equals a prompt of the prefill `group` (n samples of one prompt) or shares
        with one at least half its length and at least SHARE_WAIT tokens (a long system prompt, a
        few-shot prefix): r then waits for the next prefill, which reuses that prompt's KV from the
        prefix cache instead of computing it again. Not when the group's request took that part from
        the cache itself: r finds it there too."""
        if not self.usable(r):
            return False
        seq = r.seq
        need = max(SHARE_WAIT, len(seq) // 2)
        for g in group:
            if not self.usable(g):
                continue
            if g.seq == seq:
                run = len(seq) - 1  # what r would take from the cache: all but its last token
            elif len(g.seq) >= need <= len(seq) and g.seq[:need] == seq[:need]:
                run = min(need, len(seq) - 1)
            else:
                continue
            if run >= MIN_CACHED and g.cached < run:
                return True
        return False

    # ---- room -------------------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.pool.free_slots

    @property
    def available(self) -> int:
        """Slots free now or after evicting every unreferenced cached prefix."""
        return self.pool.free_slots + (self.cache.evictable_slots if self.cache is not None else 0)

    def _make_room(self, n: int) -> bool:
        short = n - self.pool.free_slots
        if short > 0 and self.cache is not None:
            for slots in self.cache.evict(short):
                self.pool.allocator.free(slots)
                self.evicted_total += len(slots)
        return self.pool.free_slots >= n

    def roomy(self, n: int, elsewhere: int | None = None) -> bool:
        """Whether n slots can go ahead of need: GROW_FREE of the pool stays free after them, or at
        least `elsewhere` (what every other request could still ask, when the caller knows it: a pool
        that holds every row's whole context is never short). Free slots only: nothing cached is
        evicted for room a request may never use."""
        reserve = GROW_FREE * (self.pool.num_slots - 1)
        if elsewhere is not None:
            reserve = min(reserve, elsewhere)
        return self.pool.free_slots - n >= reserve

    # ---- admission ---------------------------------------------------------------------------------------
    def admit(self, r, positions: int, extra: int, headroom: int = 0) -> bool:
        """Give r a row, its cached prefix, its own slots up to `positions` and `extra` tree/scratch
        slots, if `headroom` slots stay available after it (room the running requests will grow
        into); False (nothing taken) when the pool cannot."""
        if not self.pool.free_rows:
            return False
        seq = r.seq
        cached, node = np.zeros((0,), np.int32), None
        if self.usable(r) and len(seq) > 1:
            cached, node = self.cache.match(self.keys(seq, len(seq) - 1))  # the last token is always prefilled
            if len(cached) < MIN_CACHED:
                cached = cached[:0]
                node = self.cache.root
            self.cache.lock(node)
        m = len(cached)
        need = max(positions - m, 0) + extra
        if self.available - need < headroom or not self._make_room(need):
            if node is not None:
                self.cache.unlock(node)
            return False
        r.row = self.pool.take_row()
        own = self.pool.allocator.alloc(need)
        r.table = np.concatenate([cached, own[: need - extra]]).astype(np.int32)
        r.extra = own[need - extra:]
        r.cached, r.node = m, node
        r.start = m
        if m:
            self.cached_tokens_total += m
        return True

    def ensure(self, r, upto: int) -> tuple[int, np.ndarray] | None:
        """Own slots for positions up to `upto` (plus CHUNK, within r's context): (first new position,
        new slots), or None when nothing was needed. Raises ShortOfSlots when the pool cannot.
        While the pool has room to spare (GROW_FREE of it free afterwards), r's table grows
        geometrically instead, to twice its length: every growth is a slot-table update, a dispatch
        between two rounds that costs the device more than a round's idle host time (bench/HISTORY.md,
        2026-11-26), and this keeps them to a few per request."""
        have = len(r.table)
        if upto <= have:
            return None
        n = min(upto + self.chunk, r.position_cap) - have
        if n <= 0:
            return None
        grow = min(max(upto + self.chunk, 2 * have), r.position_cap) - have
        if grow > n and self.roomy(grow):
            n = grow  # from free slots only: nothing cached is evicted for room r may never use
        if not self._make_room(n):
            raise ShortOfSlots(n)
        new = self.pool.allocator.alloc(n)
        r.table = np.concatenate([r.table, new])
        return have, new

    def trim(self, r, keep: int) -> int:
        """Give back r's own slots of positions `keep` and later (the pool runs short and r grew
        ahead of need): `keep` must bound every position a dispatched step may write (the decoder's
        `prefix_needed`), so the device's slot-table row past it is never read or written again
        (a round swaps slots only below the length it commits). Returns the slots freed."""
        if r.table is None:
            return 0
        keep = max(keep, r.cached)
        n = len(r.table) - keep
        if n <= 0:
            return 0
        self.pool.allocator.free(r.table[keep:])
        r.table = r.table[:keep]
        self.trimmed_total += n
        return n

    # ---- the prefix cache takes KV --------------------------------------------------------------------------
    def prefilled(self, r) -> None:
        """After r's prefill is dispatched: its prompt's positions go to the cache (target-only all of
        them; speculative all but the last, whose draft KV needs the first new token), unless another
        request cached some of them since r was admitted."""
        if not self.usable(r):
            return
        seq = r.seq
        n = len(seq) if not self.speculative else len(seq) - 1
        if n <= r.cached:
            return
        keys = self.keys(seq, n)
        got, _ = self.cache.match(keys)
        if len(got) != r.cached:  # someone cached part of it meanwhile: leave ours own until r finishes
            return
        had, node = self.cache.insert(keys, r.table[:n])
        assert had == r.cached, (had, r.cached)
        self.cache.lock(node)
        if r.node is not None:
            self.cache.unlock(r.node)
        r.node, r.cached = node, n

    def release(self, r, committed: Committed | None = None) -> None:
        """Give back everything r holds: its committed positions (`committed`) to the prefix cache when
        there is one, the rest of its own slots to the free list, its row, its locks."""
        if r.table is None:
            return
        own = np.concatenate([r.table[r.cached:], r.extra])
        if committed is not None and self.cache is not None and self.usable(r) and committed.length > r.cached:
            w = committed.length
            seq = r.seq
            if self.speculative:
                w = min(w, len(seq) - 1)
            else:
                w = min(w, len(seq))
            keys = self.keys(seq, w)
            table = np.asarray(committed.table[:w], np.int32)
            had, node = self.cache.insert(keys, table)
            adopted = table[had:]
            if len(adopted):  # the tree owns these now: not r's to free (sorted lookups, no Python loop)
                order = np.argsort(own, kind="stable")
                at = np.minimum(np.searchsorted(own[order], adopted), max(len(own) - 1, 0))
                found = own[order[at]] == adopted if len(own) else np.zeros(len(adopted), bool)
                if not found.all():
                    raise AssertionError(f"request {r.index}: committed slots {adopted[~found][:8].tolist()} "
                                         "are not its own")
                keep = np.ones(len(own), bool)
                keep[order[at]] = False
                own = own[keep]
        if len(own):
            self.pool.allocator.free(own)
        if r.node is not None:
            self.cache.unlock(r.node)
        self.pool.give_row(r.row)
        r.table, r.extra, r.node, r.cached = None, None, None, 0

    def flush(self) -> int:
        """Evict every unreferenced cached prefix; returns the slots freed."""
        if self.cache is None:
            return 0
        freed = self.cache.clear()
        for s in freed:
            self.pool.allocator.free(s)
        return sum(len(s) for s in freed)

    # ---- checks (tests) -----------------------------------------------------------------------------------------
    def check(self, running) -> None:
        """Every slot is free, cached once, or owned once by one running request; refcounts >= 0."""
        owner = np.zeros(self.pool.num_slots, np.int32)
        owner[self.pool.allocator.free_ids()] += 1
        if self.cache is not None:
            for n in self.cache.nodes():
                if n.ref < 0:
                    raise AssertionError("negative reference count")
                owner[n.slots] += 1
        for r in running:
            if r.table is not None:
                owner[r.table[r.cached:]] += 1
                owner[r.extra] += 1
        if owner[0] != 0 or not np.all(owner[1:] == 1):
            bad = np.nonzero(owner[1:] != 1)[0][:10] + 1
            raise AssertionError(f"slots owned {owner[bad].tolist()} times: {bad.tolist()}")


class ShortOfSlots(Exception):
    """The pool cannot give a running request the slots its next dispatch needs."""
