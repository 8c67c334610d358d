"""Adaptive speculative decoding: policies that switch between pre-compiled step tiers.

Host-only (no JAX here). SGLang's design (docs "Adaptive Speculative Decoding", `../shared/DESIGN.md`
"Adaptive steps"), with two extensions: a tier is a full (S, K, N) triple, so tree tiers adapt too,
and a second policy weighs each tier's accept length against its measured cost. The default is
SGLang's EMA policy: on the H100 it measured ahead of the cost-aware one on the phased workload
(1.12-1.20x vs 1.04-1.06x the best static tier) and the cost-aware one fell 16% behind the static
(5,4,8) at batch 48 on MT-bench (bench/HISTORY.md session 12); "throughput" is there to be chosen.

    AdaptiveConfig       the knobs, from JSON (omitted keys take defaults; unknown keys, bad values: errors)
    ThroughputPolicy     "throughput": the tier with the most expected tokens per second
    AdaptivePolicy       "ema" (default): SGLang's EMA of accepted drafts per request and its thresholds
    RoundTimes           one round's wall time per (tier, bucket): timed at warm-up, refined online
    TierState            one tier's runtime state: its (S, K, N) and its executables, one per bucket
    AdaptiveController   feeds the policy after each verify and swaps the active TierState (a reference
                         swap: every tier is compiled at warm-up, a switch never compiles)

The throughput policy. A round of a tier with reach D = min(S, N - 1) (the deepest node its tree can
hold) accepts a drafts (bonus excluded): depths 1..a passed, depth a + 1 was tried and failed when
a < D, and nothing is known past D. Counts per depth, decayed over the last `accept_window`
request-rounds (so a batch of 16 forgets 16 times faster per verify than a batch of 1), give the
conditional acceptance p_d = P(depth d accepted | depth d - 1 accepted), each shrunk towards the
depth above it (pseudo-counts `PRIOR_WEIGHT`), so a depth no tier has tried yet is estimated like the
deepest one tried (a geometric tail). Tier j would emit E_j = 1 + sum_{d <= D_j} p_1 ... p_d tokens
per round (bonus included) and costs T_j, its measured round time at the current batch bucket;
every `update_interval` verifies after `warmup_batches` (defaults 1 and 8: a decision costs
microseconds; the first rounds' times are noisy) the policy picks argmax E_j / T_j, and leaves
the active tier only for one at least `switch_margin` faster. Under this policy the base tier
(S, K, N) is always one of the tiers (it starts there). Tree shape beyond depth (a wider N at the
same depth) is not modelled: tiers are compared through their depth alone, so a tier whose tree is
narrower than the one that produced the counts is over-estimated. (Per-tier counts with probes were
tried, 6cc26c0: a tier's counts from an earlier phase of the workload then held it off for good;
bench/HISTORY.md session 12.)

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
from typing import Any, Callable, Sequence

POLICIES = ("throughput", "ema")
PRIOR_WEIGHT = 2.0  # pseudo-rounds shrinking a depth's acceptance towards the depth above it
PRIOR_ACCEPT = 0.5  # depth 1's prior acceptance
STALE_DECAY = 4  # counts of depths past the running tier's reach fade this many times faster


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
    update_interval: int | None = None  # None: 5 for "ema" (SGLang's), 1 for "throughput"
    down_hysteresis: float = -0.25
    up_hysteresis: float = 0.0
    policy: str = "ema"  # SGLang's; or "throughput" (expected tokens per second)
    accept_window: int = 32  # throughput: request-rounds over which the per-depth acceptance counts decay (1/e)
    switch_margin: float = 0.03  # throughput: leave the active tier only for one this much faster

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
            object.__setattr__(self, "update_interval", 5 if ema else 1)
        _int("warmup_batches", self.warmup_batches, 0)
        _int("update_interval", self.update_interval, 1)
        object.__setattr__(self, "down_hysteresis", _float("down_hysteresis", self.down_hysteresis))
        object.__setattr__(self, "up_hysteresis", _float("up_hysteresis", self.up_hysteresis))
        _int("accept_window", self.accept_window, 1)
        object.__setattr__(self, "switch_margin", _float("switch_margin", self.switch_margin, 0.0))

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
        if len(accepted) == 0:
            return False
        a = self.cfg.ema_alpha
        self.ema = (1 - a) * self.ema + a * (sum(accepted) / len(accepted))
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


class ThroughputPolicy:
    """The tier with the most expected tokens per second (module docstring). `tiers`: (S, K, N) each,
    in the controller's order."""

    def __init__(self, config: AdaptiveConfig, tiers: Sequence[tuple[int, int, int]], initial_index: int):
        self.cfg = config
        self.reach = [min(s, n - 1) for s, _, n in tiers]
        deepest = max(self.reach)
        self.tried = [0.0] * (deepest + 1)  # [d]: decayed rounds that tried depth d (index 0 unused)
        self.passed = [0.0] * (deepest + 1)  # [d]: ... that accepted it
        self.index = initial_index
        self.batches = 0
        self.last_rates: list[float | None] = [None] * len(tiers)  # expected tokens/ms at the last decision

    def observe(self, accepted: Sequence[int], reach: int) -> None:
        """One verify's accepted drafts per request (bonus excluded) from rounds of reach `reach`."""
        keep = (1.0 - 1.0 / self.cfg.accept_window) ** len(accepted)
        # Depths past `reach` cannot be seen now: their counts are from earlier rounds of a deeper tier,
        # maybe of another workload, and fade STALE_DECAY times faster (else a deep tier that failed
        # once is judged by that failure long after the acceptance above it has recovered).
        fade = [keep if d <= reach else keep**STALE_DECAY for d in range(len(self.tried))]
        self.tried = [x * f for x, f in zip(self.tried, fade)]
        self.passed = [x * f for x, f in zip(self.passed, fade)]
        for a in accepted:
            a = min(int(a), reach)
            for d in range(1, a + 1):
                self.passed[d] += 1.0
            for d in range(1, min(a + 1, reach) + 1):
                self.tried[d] += 1.0

    def accept_rates(self) -> list[float]:
        """p_d, d = 1..deepest: P(depth d accepted | depth d - 1 accepted), shrunk towards p_{d-1}."""
        out, prior = [], PRIOR_ACCEPT
        for d in range(1, len(self.tried)):
            prior = (self.passed[d] + PRIOR_WEIGHT * prior) / (self.tried[d] + PRIOR_WEIGHT)
            out.append(prior)
        return out

    def expected_tokens(self) -> list[float]:
        """E_j: tokens per round (bonus included) each tier would emit."""
        rates, out = self.accept_rates(), []
        for reach in self.reach:
            e, run = 1.0, 1.0
            for p in rates[:reach]:
                run *= p
                e += run
            out.append(e)
        return out

    def update(self, accepted: Sequence[int], ran: int, round_ms: Callable[[int], float | None]) -> bool:
        """Feed one verify of tier index `ran`; round_ms(j): tier j's round time at the current bucket
        (None: unknown). True if the active tier changed."""
        if len(accepted) == 0:
            return False
        self.observe(accepted, self.reach[ran])
        self.batches += 1
        past = self.batches - self.cfg.warmup_batches
        if past <= 0 or past % self.cfg.update_interval:
            return False
        return self._decide(round_ms)

    def _decide(self, round_ms) -> bool:
        times = [round_ms(j) for j in range(len(self.reach))]
        self.last_rates = [e / t if t else None for e, t in zip(self.expected_tokens(), times)]
        now = self.last_rates[self.index]
        if now is None:
            return False
        best = max((j for j, r in enumerate(self.last_rates) if r is not None), key=lambda j: self.last_rates[j])
        if best == self.index or self.last_rates[best] <= now * (1.0 + self.cfg.switch_margin):
            return False
        self.index = best
        return True


class RoundTimes:
    """One round's wall time (ms) per (tier index, bucket): `calibrated` from timed runs at warm-up
    (or the first dispatch of a bucket), `observed` online in the steady state. A tier observed at a
    bucket `min_samples` times is estimated by its observations (an EMA; the first rounds after a
    prefill or a switch are noisy), one not (yet) by its calibration times the running ratio
    observed / calibrated (online rounds carry host work and real prefixes a calibration run on
    padding rows lacks, and every tier carries them alike)."""

    def __init__(self, alpha: float = 0.1, min_samples: int = 8):
        self.alpha, self.min_samples = alpha, min_samples
        self.calibration: dict[tuple, float] = {}
        self.online: dict[tuple, float] = {}
        self.samples: dict[tuple, int] = {}
        self.ratio: float | None = None  # EMA of observed / calibrated

    def has(self, tier: int, bucket) -> bool:
        return (tier, bucket) in self.calibration

    def calibrated(self, tier: int, bucket, ms: float) -> None:
        self.calibration[tier, bucket] = ms

    def observed(self, tier: int, bucket, ms: float) -> None:
        key, a = (tier, bucket), self.alpha
        self.online[key] = ms if key not in self.online else (1 - a) * self.online[key] + a * ms
        self.samples[key] = self.samples.get(key, 0) + 1
        if key in self.calibration:
            r = ms / self.calibration[key]
            self.ratio = r if self.ratio is None else (1 - a) * self.ratio + a * r

    def estimate(self, tier: int, bucket) -> float | None:
        key = (tier, bucket)
        if self.samples.get(key, 0) >= self.min_samples or (key in self.online and key not in self.calibration):
            return self.online[key]
        if key in self.calibration:
            return self.calibration[key] * (self.ratio or 1.0)
        return None


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

    def on_verify_complete(self, accept_lengths: Sequence[float], ran: int | None = None, bucket=None) -> bool:
        """Accepted draft tokens per request of one verify (bonus excluded), of rounds of tier index `ran`
        (default: the active one) at `bucket` (the throughput policy compares the tiers' round times
        there). True if the tier switched; the next dispatch uses `active`."""
        self.verifies += 1
        if isinstance(self.policy, ThroughputPolicy):
            ran = self.policy.index if ran is None else ran
            changed = self.policy.update(accept_lengths, ran, lambda j: self.times.estimate(j, bucket))
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
