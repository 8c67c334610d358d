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

The throughput policy. Every `update_interval` verifies after `warmup_batches` (defaults 1 and 8: a
decision costs microseconds; the first rounds' times are noisy) it picks argmax E_j / T_j, E_j the
tokens per round (bonus included) tier j would emit now and T_j its measured round time at the
current batch bucket (`RoundTimes`), and leaves the active tier only for one at least
`switch_margin` faster. Under this policy the base tier (S, K, N) is always one of the tiers (it
starts there). E_j comes from, in order:
  1. rounds that observed tier j: its own, and those of any tier that nests it (the same K, no more
     steps: `nested_tiers`). A round reports what each nested tier's tree would have accepted
     (`jeagle.spec.round.nested_accepts`: exact for greedy rows but in a rare case, where it is a
     lower bound), so the tiers below the active one are measured every round, tree width included;
     decayed over the last `accept_window` request-rounds (a batch of 16 forgets 16 times faster per
     verify than a batch of 1).
  2. for a tier the active one does not nest: the active tier's E times the ratio of the two over
     the request-rounds that observed both, kept over RATIO_WINDOW accept windows (a ratio holds
     across text far better than either accept length). A larger tier's rounds observe the active
     one, so every `probe_interval` verifies one round runs the smallest tier nesting the active one
     (a probe) to keep that ratio current.
  3. a tier never observed beside the active one: the depth model below, scaled to agree with the
     active tier's observed E.
At a switch the estimates decided on seed every tier's recent mean (SEED_ROUNDS of a window), so the
new tier's first rounds refine them rather than its rounds from long ago.
The depth model. A round of reach D = min(S, N - 1) (the deepest node its tree can hold) accepts a
drafts: depths 1..a passed, depth a + 1 was tried and failed when a < D, nothing is known past D.
Counts per depth, decayed like (1), give p_d = P(depth d accepted | depth d - 1 accepted), each
shrunk towards the depth above it (pseudo-counts `PRIOR_WEIGHT`), so a depth no tier has tried is
estimated like the deepest one tried (a geometric tail); E_j = 1 + sum_{d <= D_j} p_1 ... p_d. It
sees depth only: a narrower tree at the same depth is over-estimated, a wider one under-estimated,
which is why (1) and (2) come first. (Per-tier counts with probes and no nesting were tried in
6cc26c0: a tier's counts from an earlier phase of the workload then held it off for good;
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
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

POLICIES = ("throughput", "ema")
PRIOR_WEIGHT = 2.0  # pseudo-rounds shrinking a depth's acceptance towards the depth above it
PRIOR_ACCEPT = 0.5  # depth 1's prior acceptance
STALE_DECAY = 4  # counts of depths past the running tier's reach fade this many times faster
RATIO_WINDOW = 8  # two tiers' accept-length ratio is kept over this many accept windows
MIN_PAIR_TOKENS = 4.0  # tokens (decayed) behind a ratio before it replaces the depth model
SEED_ROUNDS = 0.25  # at a switch, the estimates decided on count as this share of an accept window


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
    probe_interval: int = 16  # throughput: every this many verifies, one round of the next larger tier (0: never)

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
        _int("probe_interval", self.probe_interval, 0)

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


def nested_tiers(tiers: Sequence[tuple[int, int, int]]) -> list[tuple[int, ...]]:
    """For each tier (S, K, N), the indices of the other tiers nested in it: the same K and S' <= S,
    so that a round of it tells what each of them would have accepted (`jeagle.spec.round.nested_accepts`)."""
    return [tuple(i for i, (s_i, k_i, _) in enumerate(tiers) if i != j and k_i == k and s_i <= s)
            for j, (s, k, _) in enumerate(tiers)]


class ThroughputPolicy:
    """The tier with the most expected tokens per second (module docstring). `tiers`: (S, K, N) each,
    in the controller's order."""

    def __init__(self, config: AdaptiveConfig, tiers: Sequence[tuple[int, int, int]], initial_index: int):
        self.cfg = config
        self.tiers = [tuple(t) for t in tiers]
        self.reach = [min(s, n - 1) for s, _, n in tiers]
        deepest = max(self.reach)
        self.tried = [0.0] * (deepest + 1)  # [d]: decayed rounds that tried depth d (index 0 unused)
        self.passed = [0.0] * (deepest + 1)  # [d]: ... that accepted it
        self.nests = nested_tiers(self.tiers)
        n = len(tiers)
        # Tokens per request-round (bonus included) each tier emitted or would have emitted, decayed over
        # accept_window request-rounds (a tier not observed fades with the rest)...
        self.tokens = np.zeros(n)
        self.weight = np.zeros(n)
        # ... and for each pair (j, i) observed in the same request-rounds, over a window RATIO_WINDOW
        # times longer: pair_num[j, i] sums tier j's tokens, pair_den[j, i] tier i's (j's relative to i's).
        self.pair_num = np.zeros((n, n))
        self.pair_den = np.zeros((n, n))
        self.index = initial_index
        self.batches = 0
        self.since_probe = 0
        self.probes = 0
        self.last_rates: list[float | None] = [None] * len(tiers)  # expected tokens/ms at the last decision

    # ---- the depth model (tiers no round has observed) -------------------------------------------
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

    def model_tokens(self) -> list[float]:
        """The depth model's tokens per round (bonus included) for each tier."""
        rates, out = self.accept_rates(), []
        for reach in self.reach:
            e, run = 1.0, 1.0
            for p in rates[:reach]:
                run *= p
                e += run
            out.append(e)
        return out

    # ---- observed and nested accept lengths ------------------------------------------------------
    def record(self, accepted: Sequence[int], ran: int, nested: Sequence[Sequence[int]] | None = None) -> None:
        """One verify of tier `ran`: its accepted drafts per request and, per request, what each tier of
        `nests[ran]` would have accepted (-1: unknown)."""
        n, t = len(accepted), len(self.tiers)
        vals = np.full((n, t), np.nan)
        vals[:, ran] = np.asarray(accepted, float) + 1.0
        nest = self.nests[ran] if nested is not None else ()
        if nest:
            would = np.asarray(nested, float).reshape(n, len(nest))
            vals[:, list(nest)] = np.where(would >= 0, would + 1.0, np.nan)
        seen = ~np.isnan(vals)
        v = np.where(seen, vals, 0.0)
        keep = (1.0 - 1.0 / self.cfg.accept_window) ** n
        self.tokens = self.tokens * keep + v.sum(0)
        self.weight = self.weight * keep + seen.sum(0)
        both = v.T @ seen  # [j, i]: tier j's tokens over the request-rounds that observed i too
        pairs = np.zeros((t, t), bool)
        cols = [ran, *nest]
        pairs[np.ix_(cols, cols)] = True
        np.fill_diagonal(pairs, False)
        slow = np.where(pairs, (1.0 - 1.0 / (RATIO_WINDOW * self.cfg.accept_window)) ** n, 1.0)
        self.pair_num = self.pair_num * slow + np.where(pairs, both, 0.0)
        self.pair_den = self.pair_den * slow + np.where(pairs, both.T, 0.0)

    def expected_tokens(self) -> list[float]:
        """E_j: tokens per round (bonus included) each tier would emit now. The active tier and those
        nested in it: their recent rounds (observed or would-be, exact for greedy rows); a larger tier:
        the active one's times its ratio to it over the request-rounds that observed both (a probe
        round observes both: `probe`); a tier never observed beside the active one: the depth model,
        scaled to agree with the active tier's observed accept length."""
        r = self.index
        model = self.model_tokens()
        if self.weight[r] <= 0:
            return model
        e_r = float(self.tokens[r] / self.weight[r])
        out = []
        for j in range(len(self.tiers)):
            num, den = self.pair_num[j, r], self.pair_den[j, r]
            if (j == r or j in self.nests[r]) and self.weight[j] > 0:
                out.append(float(self.tokens[j] / self.weight[j]))
            elif den >= MIN_PAIR_TOKENS:
                out.append(float(e_r * num / den))
            else:
                out.append(model[j] * e_r / model[r])
        return out

    def probe(self) -> int | None:
        """The tier to run for one round instead of the active one, or None: every `probe_interval`
        verifies, the smallest tier that nests the active one (so its round also tells the active
        tier's, and the pair's ratio stays current while the active tier cannot see it)."""
        if not self.cfg.probe_interval or self.since_probe < self.cfg.probe_interval:
            return None
        up = [j for j in range(len(self.tiers)) if self.index in self.nests[j] and self.tiers[j] != self.tiers[self.index]]
        if not up:
            return None
        self.since_probe = 0
        self.probes += 1
        return min(up, key=lambda j: self.tiers[j])

    def update(self, accepted: Sequence[int], ran: int, round_ms: Callable[[int], float | None],
               nested: Sequence[Sequence[int]] | None = None) -> bool:
        """Feed one verify of tier index `ran`; round_ms(j): tier j's round time at the current bucket
        (None: unknown). True if the active tier changed."""
        if len(accepted) == 0:
            return False
        self.observe(accepted, self.reach[ran])
        self.record(accepted, ran, nested)
        self.batches += 1
        self.since_probe += 1
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
        # What the decision saw becomes every tier's recent mean, at the weight of SEED_ROUNDS of the
        # window's request-rounds: the new tier's own rounds take over from there (its old rounds, from
        # before it was left, would otherwise speak first and could send the policy straight back).
        seed = self.cfg.accept_window * SEED_ROUNDS
        self.tokens = np.asarray(self.expected_tokens()) * seed
        self.weight = np.full(len(self.tiers), seed)
        self.index = best
        return True


class RoundTimes:
    """One round's wall time (ms) per (tier index, bucket): `calibrated` from timed runs at warm-up
    (or the first dispatch of a bucket), `observed` online in the steady state. A tier observed at a
    bucket `min_samples` times is estimated by the median of its last `window` observations (the
    first rounds after a prefill or a switch, and a round the host kept waiting, are outliers an
    average would carry for many rounds), one not (yet) by its calibration times the ratio observed /
    calibrated of the tier observed most at that bucket (online rounds carry host work and real
    prefixes a calibration run on padding rows lacks, and the tiers carry them alike), else the
    median ratio of the last `window` observations anywhere."""

    def __init__(self, window: int = 15, min_samples: int = 8):
        self.window, self.min_samples = window, min_samples
        self.calibration: dict[tuple, float] = {}
        self.online: dict[tuple, deque] = {}
        self.at_bucket: dict[Any, dict[int, deque]] = {}  # bucket -> tier -> its online samples
        self.ratios: deque = deque(maxlen=window)  # observed / calibrated

    def has(self, tier: int, bucket) -> bool:
        return (tier, bucket) in self.calibration

    def calibrated(self, tier: int, bucket, ms: float) -> None:
        self.calibration[tier, bucket] = ms

    def observed(self, tier: int, bucket, ms: float) -> None:
        key = (tier, bucket)
        if key not in self.online:
            self.online[key] = self.at_bucket.setdefault(bucket, {})[tier] = deque(maxlen=self.window)
        self.online[key].append(ms)
        if key in self.calibration:
            self.ratios.append(ms / self.calibration[key])

    @property
    def ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    def bucket_ratio(self, bucket) -> float | None:
        """Observed / calibrated at `bucket`, from its most observed calibrated tier (None: none yet)."""
        seen = [(len(d), t) for t, d in self.at_bucket.get(bucket, {}).items()
                if len(d) >= self.min_samples and (t, bucket) in self.calibration]
        if not seen:
            return None
        t = max(seen)[1]
        return statistics.median(self.online[t, bucket]) / self.calibration[t, bucket]

    def estimate(self, tier: int, bucket) -> float | None:
        key = (tier, bucket)
        seen = self.online.get(key, ())
        if len(seen) >= self.min_samples or (seen and key not in self.calibration):
            return statistics.median(seen)
        if key in self.calibration:
            r = self.bucket_ratio(bucket)
            return self.calibration[key] * (r if r is not None else (self.ratio or 1.0))
        return None

    def report(self, tiers: int, bucket) -> dict:
        """Per tier at `bucket`: the calibration and the observed median (ms; None: none)."""
        med = lambda d: round(statistics.median(d), 4) if d else None  # noqa: E731
        return {"calibrated": [None if (j, bucket) not in self.calibration else round(self.calibration[j, bucket], 4)
                               for j in range(tiers)],
                "observed": [med(self.online.get((j, bucket))) for j in range(tiers)]}


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

    def dispatch_index(self) -> int:
        """The tier the next dispatch runs: the active one, or now and then a probe (`ThroughputPolicy.probe`)."""
        if isinstance(self.policy, ThroughputPolicy):
            probe = self.policy.probe()
            if probe is not None:
                return probe
        return self.policy.index

    def on_verify_complete(self, accept_lengths: Sequence[float], ran: int | None = None, bucket=None,
                           nested: Sequence[Sequence[int]] | None = None) -> bool:
        """Accepted draft tokens per request of one verify (bonus excluded), of rounds of tier index `ran`
        (default: the active one) at `bucket` (the throughput policy compares the tiers' round times
        there); nested: per request, what each tier nested in `ran` would have accepted. True if the
        tier switched; the next dispatch uses `active`."""
        self.verifies += 1
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
            out["probes"] = self.policy.probes
        else:
            out["ema"] = round(self.policy.ema, 3)
        return out
