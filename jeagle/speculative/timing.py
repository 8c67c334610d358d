"""Round times for the adaptive throughput policy: every tier's round timed at a bucket on padding rows
(`calibrate`: after warm-up, or at the first dispatch of a bucket not timed yet), its call's host time
with it, and each step's host time besides its dispatch (`host_step`, from the scheduler), into the
controller's `RoundTimes` (jeagle/speculative/adaptive_throughput.py), whose model weighs host against device.
A mixin of `SpecDecoder` (speculative/decoder.py), which holds the tiers, their executables and the controller.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jeagle.runtime.buckets import pad
from jeagle.runtime.dispatch import resolve


class TierTiming:
    """`calibrate`, `calibrate_keys` and `host_step` of a `SpecDecoder`."""

    def calibrate(self, b: int, kv: int, greedy: bool, runs: int = 5, warm: int = 2) -> None:
        """Time one round of every tier at bucket (b, kv, greedy) on padding rows (the scratch row, which
        every padded batch computes on anyway) for the throughput policy (`controller.times`): `warm`
        untimed rounds of each tier, then `runs` each, interleaved, every round timed alone (dispatch to
        result; its call's host time too), the medians kept (per round: a dispatch of R unrolled rounds
        counts R). (Back to back after one untimed run, (1,4,3) read 4.9 ms where a (5,4,8) round takes
        2.5 ms on the H100: first runs and clock ramps, bench/HISTORY.md, 2026-11-25.) Waits for what is
        in flight first."""
        start, compiled = time.perf_counter(), self.executables.compile_seconds
        rows = pad([], b, self.scratch_row, np.int32)
        exes = [self.round_exe(state, b, kv, greedy) for state in self.tier_states]  # compiles count themselves
        for exe in exes:
            for _ in range(warm):
                jax.block_until_ready((resolve(self.dispatch(exe, rows)), self.state))
        samples, calls = [[] for _ in exes], [[] for _ in exes]
        for _ in range(runs):
            for j, exe in enumerate(exes):
                t0 = time.perf_counter()
                jax.block_until_ready((resolve(self.dispatch(exe, rows)), self.state))
                samples[j].append(time.perf_counter() - t0)
                calls[j].append(self.last_call_s)
        # A dispatch of unrolled rounds runs all R on the padding rows (the loop stops after the first).
        per = self.rounds_per_dispatch if self.config.unroll_rounds else 1
        ms = lambda seconds: float(np.median(seconds)) * 1e3 / per  # noqa: E731  (ms per round)
        self.controller.times.threaded = self.threaded
        for j in range(len(exes)):
            self.controller.times.calibrated(j, (b, kv, greedy), ms(samples[j]), ms(calls[j]))
        self.last_read = None  # the next sample would include this
        # Start-up work, not serving; the compiles in it are counted already.
        self.executables.add_startup_seconds(time.perf_counter() - start - (self.executables.compile_seconds - compiled))

    def host_step(self, seconds: float) -> None:
        """The last step's host time besides its dispatch (the scheduler's): the round-time model's."""
        if self.timed and self.last_bucket is not None:
            self.controller.times.host_observed(self.last_bucket, seconds * 1e3 / self.rounds_per_dispatch)

    def calibrate_keys(self, keys, compile: bool = True) -> None:
        """After a warm-up: time the tiers at every round bucket among `keys` not timed yet (compile
        False: only buckets whose every tier's executable is in memory already)."""
        if not self.timed:
            return
        for b, kv, greedy in sorted({(k.batch, k.kv_len, k.greedy) for k in keys if k.phase == "round"}):
            if all(self.controller.times.has(j, (b, kv, greedy)) for j in range(len(self.tiers))):
                continue
            if compile or all(self.executables.has(self.round_key(t, b, kv, greedy)) for t in self.tiers):
                self.calibrate(b, kv, greedy)

