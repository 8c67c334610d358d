"""Adaptive speculative decoding: policies that switch between pre-compiled step tiers.

Host-only (no JAX here; numpy). SGLang's design (docs "Adaptive Speculative Decoding", `../shared/DESIGN.md`
"Adaptive steps"), with two extensions: a tier is a full (S, K, N) triple, so tree tiers adapt too,
and a second policy weighs each tier's accept length against its measured cost. The default is
SGLang's EMA policy: on the H100 it measured ahead of the cost-aware one on the phased workload
(1.12-1.20x vs 1.04-1.06x the best static tier) and the cost-aware one fell 16% behind the static
(5,4,8) at batch 48 on MT-bench (bench/HISTORY.md, 2026-11-25); "throughput" is there to be chosen.
(2026-11-27: with its host time per verify cut ~0.1 -> ~0.04 ms it ran 0.91 of static (5,4,8) on
MT-bench at batch 16, medians of 8 runs each (the occasional run at ~0.6 hit static too: the host's,
not the policy's), where the EMA policy's (3,4,5) ran 0.82-0.90; on the phased workload EMA still
leads, 1.18 / 1.23 vs 1.01 / 1.10 the best static tier. On 2026-11-28, paired run by run against static
(5,4,8) in one process: throughput 0.91-1.01 / 0.89-0.96 / 0.94-0.99 at batch 1 / 16 / 48, EMA 0.99 /
0.94 / 0.85; `observe_every` 4 cuts the policy's host work in a round, but left free it visits losing
tiers more often, so it is off by default.)

    AdaptiveConfig       the knobs, from JSON (omitted keys take defaults; unknown keys, bad values: errors)
    ThroughputPolicy     "throughput": the tier with the most expected tokens per second (adaptive_throughput.py)
    AdaptivePolicy       "ema" (default): SGLang's EMA of accepted drafts per request and its thresholds
    RoundTimes           one round's wall time per (tier, bucket): timed at warm-up, refined online (ditto)
    TierState            one tier's runtime state: its (S, K, N) and its executables, one per bucket
    AdaptiveController   feeds the policy after each verify and swaps the active TierState (a reference
                         swap: every tier is compiled at warm-up, a switch never compiles)

The throughput policy: jeagle/speculative/adaptive_throughput.py.

The EMA policy. After each verify, batch_avg = mean accepted draft tokens per request (bonus
excluded), ema = (1-α)·ema + α·batch_avg, ema starting at steps-1 of the initial tier. The first
`warmup_batches` verifies only feed the EMA; after them, every `update_interval`-th verify re-decides:
move down while ema ≤ steps[i-1] - 0.5 + down_hysteresis, else up while ema > steps[i] - 0.5 +
up_hysteresis. That is "steps ≈ round(ema) + 1", probing one step past what is accepted now, with a
margin against oscillation. The initial steps snap to the nearest candidate (the smaller on a tie).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jeagle.speculative.adaptive_throughput import RoundTimes, ThroughputPolicy

POLICIES = ("throughput", "ema")


class AdaptiveConfigError(ValueError):
    """An adaptive config that cannot be used; the message names the key."""


def _int(key: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise AdaptiveConfigError(f"adaptive config: {key} must be an integer >= {lo}, got {v!r}")
    return v


def _float(key: str, v: Any, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise AdaptiveConfigError(f"adaptive config: {key} must be a finite number, got {v!r}")
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise AdaptiveConfigError(f"adaptive config: {key} must be in {rng}, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class AdaptiveConfig:
    candidate_steps: tuple[int, ...] = (1, 3, 7)
    # Explicit tiers, each [S, K, N], in increasing S; when given they replace candidate_steps.
    candidate_tiers: tuple[tuple[int, int, int], ...] | None = None
    ema_alpha: float = 0.2
    warmup_batches: int | None = None  # None: 10 for "ema" (SGLang's), 8 for "throughput"
    update_interval: int | None = None  # None: 5 for "ema" (SGLang's), 4 for "throughput"
    down_hysteresis: float = -0.25
    up_hysteresis: float = 0.0
    policy: str = "ema"  # SGLang's; or "throughput" (expected tokens per second)
    accept_window: int = 32  # throughput: request-rounds over which the per-depth acceptance counts decay (1/e)
    window_verifies: int = 0  # throughput: ... or at least this many verifies of the running batch size
    switch_margin: float = 0.03  # throughput: leave the active tier only for one this much faster
    min_dwell: int = 0  # throughput: verifies a tier runs after a switch before the policy may leave it
    observe_every: int = 1  # throughput: the policy sees one verify in this many (module docstring)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise AdaptiveConfigError(f"adaptive config: policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        steps = self.candidate_steps
        if not isinstance(steps, (list, tuple)) or not steps:
            raise AdaptiveConfigError(f"adaptive config: candidate_steps must be a non-empty list, got {steps!r}")
        steps = tuple(_int("candidate_steps", s, 1) for s in steps)
        if len(set(steps)) != len(steps):
            raise AdaptiveConfigError(f"adaptive config: candidate_steps has duplicates: {list(steps)}")
        object.__setattr__(self, "candidate_steps", tuple(sorted(steps)))
        if self.candidate_tiers is not None:
            tiers = self.candidate_tiers
            if not isinstance(tiers, (list, tuple)) or not tiers:
                raise AdaptiveConfigError(f"adaptive config: candidate_tiers must be a non-empty list, got {tiers!r}")
            out = []
            for t in tiers:
                if not isinstance(t, (list, tuple)) or len(t) != 3:
                    raise AdaptiveConfigError(f"adaptive config: candidate_tiers entries are [S, K, N], got {t!r}")
                out.append(tuple(_int("candidate_tiers", x, 1) for x in t))
            if any(a[0] >= b[0] for a, b in zip(out, out[1:])):
                raise AdaptiveConfigError("adaptive config: candidate_tiers must have strictly increasing S "
                                          f"(num_steps), got {[list(t) for t in out]}")
            object.__setattr__(self, "candidate_tiers", tuple(out))
        object.__setattr__(self, "ema_alpha", _float("ema_alpha", self.ema_alpha, 0.0, 1.0, lo_open=True))
        ema = self.policy == "ema"
        if self.warmup_batches is None:
            object.__setattr__(self, "warmup_batches", 10 if ema else 8)
        if self.update_interval is None:
            object.__setattr__(self, "update_interval", 5 if ema else 4)
        _int("warmup_batches", self.warmup_batches, 0)
        _int("update_interval", self.update_interval, 1)
        object.__setattr__(self, "down_hysteresis", _float("down_hysteresis", self.down_hysteresis))
        object.__setattr__(self, "up_hysteresis", _float("up_hysteresis", self.up_hysteresis))
        _int("accept_window", self.accept_window, 1)
        _int("window_verifies", self.window_verifies, 0)
        object.__setattr__(self, "switch_margin", _float("switch_margin", self.switch_margin, 0.0))
        _int("min_dwell", self.min_dwell, 0)
        _int("observe_every", self.observe_every, 1)

    @classmethod
    def from_dict(cls, d: dict) -> "AdaptiveConfig":
        if not isinstance(d, dict):
            raise AdaptiveConfigError(f"adaptive config must be a JSON object, got {type(d).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise AdaptiveConfigError(f"adaptive config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return cls(**d)

    @classmethod
    def from_json(cls, path: str | Path) -> "AdaptiveConfig":
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise AdaptiveConfigError(f"adaptive config {path}: {e.strerror or e}") from e
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise AdaptiveConfigError(f"adaptive config {path}: not valid JSON ({e})") from e
        return cls.from_dict(d)

    def tiers(self, steps: int, topk: int, draft_tokens: int) -> tuple[tuple[int, int, int], ...]:
        """The (S, K, N) tiers for a base tier (steps, topk, draft_tokens): candidate_tiers as given, else
        one per candidate step count (the base tier's included, under the throughput policy) with the
        base topk; N = S + 1 for a chain (K = 1), else the base
        N scaled by (S + 1) / (steps + 1), at least S + 1 and at most what S steps of top-K produce (so
        the base tier comes back unchanged when its S is a candidate)."""
        if self.candidate_tiers is not None:
            return self.candidate_tiers
        out = []
        candidates = self.candidate_steps
        if self.policy == "throughput":  # the base tier runs too: the policy starts there and may stay
            candidates = tuple(sorted(set(candidates) | {steps}))
        for s in candidates:
            if topk == 1:
                n = s + 1
            else:
                n = max(s + 1, round(draft_tokens * (s + 1) / (steps + 1)))
                n = min(n, topk + (s - 1) * topk * topk + 1)
            out.append((s, topk, n))
        return tuple(out)


def nearest(candidates: Sequence[int], steps: int) -> int:
    """Index of the candidate nearest `steps` (the smaller on a tie)."""
    return min(range(len(candidates)), key=lambda i: (abs(candidates[i] - steps), candidates[i]))


class AdaptivePolicy:
    """The EMA policy over candidate step counts (ascending)."""

    def __init__(self, config: AdaptiveConfig, steps: Sequence[int], initial_steps: int):
        self.cfg = config
        self.steps = tuple(steps)
        if list(self.steps) != sorted(set(self.steps)):
            raise AdaptiveConfigError(f"tier steps must be strictly increasing, got {list(self.steps)}")
        self.index = nearest(self.steps, initial_steps)
        self.ema = float(self.steps[self.index] - 1)
        self.batches = 0

    @property
    def current(self) -> int:
        return self.steps[self.index]

    def update(self, accepted: Sequence[float]) -> bool:
        """Feed one verify's accepted draft tokens per request (bonus excluded). True if the tier changed."""
        n = len(accepted)
        if n == 0:
            return False
        a = self.cfg.ema_alpha
        self.ema = (1 - a) * self.ema + a * (float(np.sum(accepted)) / n)
        self.batches += 1
        past = self.batches - self.cfg.warmup_batches
        if past <= 0 or past % self.cfg.update_interval:
            return False
        return self._decide()

    def _decide(self) -> bool:
        s, i = self.steps, self.index
        while i > 0 and self.ema <= s[i - 1] - 0.5 + self.cfg.down_hysteresis:
            i -= 1
        if i == self.index:
            while i < len(s) - 1 and self.ema > s[i] - 0.5 + self.cfg.up_hysteresis:
                i += 1
        changed, self.index = i != self.index, i
        return changed


@dataclass
class TierState:
    """One tier's runtime state: its (S, K, N) (or any tier object) and its executables by key."""
    tier: Any
    steps: int
    executables: dict = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.tier.shape) if hasattr(self.tier, "shape") else tuple(self.tier)


class AdaptiveController:
    """Chooses the active tier after each verify; switching swaps which TierState is active.
    `times` (the throughput policy's round times) is filled by the decoder, which times the rounds."""

    def __init__(self, config: AdaptiveConfig, states: Sequence[TierState], initial_steps: int):
        self.cfg, self.states, self.initial_steps = config, list(states), initial_steps
        self.times = RoundTimes()
        self.reset()

    def reset(self) -> None:
        """Back to the initial tier with a fresh policy (the executables and the round times stay)."""
        steps = [st.steps for st in self.states]
        self.policy = AdaptivePolicy(self.cfg, steps, self.initial_steps)  # also validates the steps
        if self.cfg.policy == "throughput":
            self.policy = ThroughputPolicy(self.cfg, [st.shape for st in self.states], self.policy.index)
        self.verifies = 0
        self.switches = 0

    @property
    def active(self) -> TierState:
        return self.states[self.policy.index]

    @property
    def active_index(self) -> int:
        return self.policy.index

    @property
    def nests(self) -> list[tuple[int, ...]]:
        """Per tier, the tiers nested in it whose would-be accept lengths its rounds should report
        (the throughput policy's; none for the EMA policy)."""
        if isinstance(self.policy, ThroughputPolicy):
            return self.policy.nests
        return [()] * len(self.states)

    def observes(self) -> bool:
        """Whether the policy takes the next verify (`observe_every`: the throughput policy sees one
        verify in that many, the first of each run of them; the decoder skips the nested columns of
        the others)."""
        every = self.cfg.observe_every if isinstance(self.policy, ThroughputPolicy) else 1
        return self.verifies % every == 0

    def on_verify_complete(self, accept_lengths: Sequence[float], ran: int | None = None, bucket=None,
                           nested: Sequence[Sequence[int]] | None = None) -> bool:
        """Accepted draft tokens per request of one verify (bonus excluded), of rounds of tier index `ran`
        (default: the active one) at `bucket` (the throughput policy compares the tiers' round times
        there); nested: per request, what each tier nested in `ran` would have accepted. True if the
        tier switched; the next dispatch uses `active`. A verify the policy does not observe
        (`observes`) is only counted."""
        observed = self.observes()
        self.verifies += 1
        if not observed:
            return False
        if isinstance(self.policy, ThroughputPolicy):
            ran = self.policy.index if ran is None else ran
            changed = self.policy.update(accept_lengths, ran, lambda j: self.times.estimate(j, bucket), nested)
        else:
            changed = self.policy.update(accept_lengths)
        self.switches += changed
        return changed

    def report(self) -> dict:
        """What the policy knows now (`--json` stats, `/server_info`)."""
        out = {"policy": self.cfg.policy, "active_tier": list(self.active.shape), "switches": self.switches}
        if isinstance(self.policy, ThroughputPolicy):
            out["expected_accept_length"] = {str(list(st.shape)): round(e, 3)
                                             for st, e in zip(self.states, self.policy.expected_tokens())}
            out["expected_tokens_per_ms"] = {str(list(st.shape)): (None if r is None else round(r, 4))
                                             for st, r in zip(self.states, self.policy.last_rates)}
        else:
            out["ema"] = round(self.policy.ema, 3)
        return out
