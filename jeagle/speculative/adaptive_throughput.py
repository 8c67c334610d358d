"""The adaptive controller's cost-aware policy, "throughput" (`jeagle/speculative/adaptive.py` holds the config, SGLang's
EMA policy and the controller): the tier with the most expected tokens per second, and the round
times it weighs them by. Host-only (no JAX here).

    nested_tiers      which tiers a round of each tier also observes
    ThroughputPolicy  the policy
    RoundTimes        one round's wall time per (tier, bucket): timed at warm-up, refined online

The throughput policy. Every `update_interval` verifies after `warmup_batches` (defaults 4 and 8: a
decision and the counts it folds in cost ~0.1 ms of host time, which at batch 16 is on a round's
critical path; the first rounds' times are noisy) it picks argmax E_j / T_j, E_j the
tokens per round (bonus included) tier j would emit now and T_j its measured round time at the
current batch bucket (`RoundTimes`), and leaves the active tier only for one at least
`switch_margin` faster. `observe_every` E > 1: the policy sees one verify in E (the controller counts
the others and the decoder skips their nested columns), each standing for E in the decay and the
cadence, for a host that sets the pace of the rounds (at batch 16 and 48 on the H100 the policy's work
was ~0.1 ms of a ~1.7 ms round, bench/HISTORY.md, 2026-11-28; with E = 4 it visited losing tiers more
often, so E = 1 stays the default). Under this policy the base tier (S, K, N) is always one of the
tiers (it starts there). E_j comes from:
  1. rounds that observed tier j: its own, and those of any tier that nests it (the same K, no more
     steps: `nested_tiers`). A round reports what each nested tier's tree would have accepted
     (`jeagle.speculative.round.nested_accepts`: exact for greedy rows but in a rare case, where it is a
     lower bound), so the tiers below the active one are measured every round, tree width included;
     decayed over the last `accept_window` request-rounds (a batch of 16 forgets 16 times faster per
     verify than a batch of 1), or over `window_verifies` verifies if that is longer (the requests of
     one batch are at the same stage of their answers: 16 of them are not 16 independent samples).
  2. a tier the active one does not nest: the depth model below, scaled to agree with the active
     tier's observed E.
At a switch the estimates decided on seed every tier's recent mean (SEED_ROUNDS of a window, at the
last verify's size), so the
new tier's first rounds refine them rather than its rounds from long ago. `min_dwell` (default 0)
holds a tier that many verifies after a switch: on the H100, at batch 16, (7,4,11)'s rounds in runs
that switched between it and (5,4,8) every few verifies took 1.7-1.9x (5,4,8)'s where its device time is
1.11x (bench/HISTORY.md, 2026-11-26). The cause (2026-11-27): each tier's result had its own width, so
after a switch XLA re-recorded the new executable's command buffer in the call (+2-4.5 ms at batch 48);
every tier's result now has one shape (`RoundKey.width`) and a switch costs ~0.2-0.3 ms.
Tried and taken out (2026-11-26): a larger tier estimated as the active one's E times the ratio of the
two over the request-rounds that observed both, kept current by a probe round of the larger tier every
N verifies. On the phased workload (bench/adaptive.py) the ratio from one phase misjudged the next (the
low phase's ~1.0 held (6,4,16) off in the high phase): 0.97 / 0.84 of the best static tier (chain /
tree) where the depth model alone had measured 1.10 / 1.01.
The depth model. A round of reach D = min(S, N - 1) (the deepest node its tree can hold) accepts a
drafts: depths 1..a passed, depth a + 1 was tried and failed when a < D, nothing is known past D.
Counts per depth, decayed like (1), give p_d = P(depth d accepted | depth d - 1 accepted), each
shrunk towards the depth above it (pseudo-counts `PRIOR_WEIGHT`), so a depth no tier has tried is
estimated like the deepest one tried (a geometric tail); E_j = 1 + sum_{d <= D_j} p_1 ... p_d. It
sees depth only: a narrower tree at the same depth is over-estimated, a wider one under-estimated,
which is why (1) comes first. (Per-tier counts with probes and no nesting were tried in
6cc26c0: a tier's counts from an earlier phase of the workload then held it off for good;
bench/HISTORY.md, 2026-11-25.)
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

if TYPE_CHECKING:
    from jeagle.speculative.adaptive import AdaptiveConfig

PRIOR_WEIGHT = 2.0  # pseudo-rounds shrinking a depth's acceptance towards the depth above it
PRIOR_ACCEPT = 0.5  # depth 1's prior acceptance
STALE_DECAY = 4  # counts of depths past the running tier's reach fade this many times faster
SEED_ROUNDS = 0.25  # at a switch, the estimates decided on count as this share of an accept window
MAX_PENDING = 8  # verifies buffered before they are folded into the counts without a decision


def nested_tiers(tiers: Sequence[tuple[int, int, int]]) -> list[tuple[int, ...]]:
    """For each tier (S, K, N), the indices of the other tiers nested in it: the same K and S' <= S,
    so that a round of it tells what each of them would have accepted (`jeagle.speculative.round.nested_accepts`)."""
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
        self._tried = np.zeros(deepest + 1)  # [d]: decayed rounds that tried depth d (index 0 unused)
        self._passed = np.zeros(deepest + 1)  # [d]: ... that accepted it
        self._pending: list = []  # verifies not yet in the counts: (tier ran, accepted, nested)
        self.nests = nested_tiers(self.tiers)
        n = len(tiers)
        # Tokens per request-round (bonus included) each tier emitted or would have emitted, decayed over
        # accept_window request-rounds (a tier not observed fades with the rest).
        self.tokens = np.zeros(n)
        self.weight = np.zeros(n)
        self.index = initial_index
        self.batches = 0
        self.since_switch = config.min_dwell  # the start is no switch (warmup_batches covers it)
        self._last_size = 1  # requests in the last verify (the window in request-rounds scales with it)
        self.last_rates: list[float | None] = [None] * len(tiers)  # expected tokens/ms at the last decision

    # ---- the depth model (tiers no round has observed) -------------------------------------------
    @property
    def tried(self) -> list[float]:
        return self._tried.tolist()

    @property
    def passed(self) -> list[float]:
        return self._passed.tolist()

    def keep(self, n: int) -> float:
        """What the decayed counts keep over one verify of n requests: (1 - 1/W)^n, W the window in
        request-rounds: `accept_window`, or `window_verifies` verifies of this size if that is longer.
        With `observe_every` E the policy sees one verify in E and each stands for E: (1 - 1/W)^(n·E),
        so the window spans the same rounds."""
        w = max(self.cfg.accept_window, self.cfg.window_verifies * n)
        return (1.0 - 1.0 / w) ** (n * self.cfg.observe_every)

    def observe(self, accepted, reach: int, weights=None, keep: float | None = None) -> None:
        """Accepted drafts per request (bonus excluded; a sequence or an int array) of one verify from
        rounds of reach `reach`; or of several verifies of one reach in a row, with `weights` per
        request: how much its counts have decayed by the end of them, and `keep` what the counts before
        them keep (`fold`), which gives the counts verify-by-verify updates would."""
        a = np.asarray(accepted, dtype=np.int64).reshape(-1)
        keep = self.keep(a.size) if keep is None else keep
        # at_least[v]: requests whose accepted depth (capped at reach) is >= v, v = 0..reach. Depth d was
        # tried by those that accepted d - 1 (d <= reach) and passed by those that accepted d.
        # (Negative: no round for the request; the decoder drops those before here.)
        ran = a >= 0
        at_least = np.bincount(np.minimum(a[ran], reach), minlength=reach + 1,
                               weights=None if weights is None else weights[ran])[::-1].cumsum()[::-1]
        # Depths past `reach` cannot be seen now: their counts are from earlier rounds of a deeper tier,
        # maybe of another workload, and fade STALE_DECAY times faster (else a deep tier that failed
        # once is judged by that failure long after the acceptance above it has recovered).
        r = min(reach, len(self._tried) - 1)
        self._tried[1:r + 1] = self._tried[1:r + 1] * keep + at_least[:r]
        self._passed[1:r + 1] = self._passed[1:r + 1] * keep + at_least[1:r + 1]
        self._tried[r + 1:] *= keep**STALE_DECAY
        self._passed[r + 1:] *= keep**STALE_DECAY

    def accept_rates(self) -> list[float]:
        """p_d, d = 1..deepest: P(depth d accepted | depth d - 1 accepted), shrunk towards p_{d-1}."""
        out, prior = [], PRIOR_ACCEPT
        for passed, tried in zip(self._passed.tolist()[1:], self._tried.tolist()[1:]):
            prior = (passed + PRIOR_WEIGHT * prior) / (tried + PRIOR_WEIGHT)
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
    def record(self, accepted, ran: int, nested=None, weights=None, keep: float | None = None) -> None:
        """Rounds of tier `ran`: their accepted drafts per request and, per request, what each tier of
        `nests[ran]` would have accepted (-1: unknown), as rows [requests, nested tiers] or flat, row
        after row (sequences or int arrays); `weights` and `keep` as `observe` takes them."""
        a = np.asarray(accepted, dtype=np.int64).reshape(-1)
        n = a.size
        wt = np.ones(n) if weights is None else weights
        tokens, seen = np.zeros(len(self.tiers)), np.zeros(len(self.tiers))
        tokens[ran], seen[ran] = wt @ (a + 1), wt.sum()
        nest = list(self.nests[ran]) if nested is not None else []
        if nest:
            w = self._nested_values(nested, n, ran)
            known = w >= 0
            tokens[nest], seen[nest] = wt @ np.where(known, w + 1, 0), wt @ known
        keep = self.keep(n) if keep is None else keep
        self.tokens = self.tokens * keep + tokens
        self.weight = self.weight * keep + seen

    def _nested_values(self, nested, n: int, ran: int, copy: bool = False) -> np.ndarray:
        """`nested` as an int array [n, len(nests[ran])] (copy: what `update` buffers, since the caller
        may reuse its own); a wrong count of values is an error."""
        k = len(self.nests[ran])
        w = (np.array if copy else np.asarray)(nested, dtype=np.int64).reshape(-1)
        if w.size != n * k:
            raise ValueError(f"nested: {w.size} values for {n} requests x {k} nested tiers")
        return w.reshape(n, k)

    def fold(self) -> None:
        """Take the buffered verifies into the counts, each run of verifies of one tier (with or without
        nested values) in one pass: every request weighted by the decay of the verifies after its own in
        the run, so the counts equal verify-by-verify updates (whenever the fold happens)."""
        pending, self._pending = self._pending, []
        start = 0
        for end in range(1, len(pending) + 1):
            if end < len(pending) and (pending[end][0], pending[end][2] is None) == (
                    pending[start][0], pending[start][2] is None):
                continue
            group = pending[start:end]
            ran = group[0][0]
            acc = np.concatenate([a for _, a, _ in group])
            sizes = [a.size for _, a, _ in group]
            keeps = np.array([self.keep(n) for n in sizes])
            after = np.append(np.cumprod(keeps[::-1])[::-1][1:], 1.0)  # the decay of the verifies after each
            weights = np.repeat(after, sizes)
            nested = None if group[0][2] is None else np.concatenate([w for _, _, w in group])
            total = float(np.prod(keeps))
            self.observe(acc, self.reach[ran], weights, total)
            self.record(acc, ran, nested, weights, total)
            start = end

    def expected_tokens(self) -> list[float]:
        """E_j: tokens per round (bonus included) each tier would emit now. The active tier and those
        nested in it: their recent rounds (observed or would-be, exact for greedy rows); the others:
        the depth model, scaled to agree with the active tier's observed accept length."""
        if self._pending:
            self.fold()
        r = self.index
        model = self.model_tokens()
        if self.weight[r] <= 0:
            return model
        e_r = float(self.tokens[r] / self.weight[r])
        return [float(self.tokens[j] / self.weight[j]) if (j == r or j in self.nests[r]) and self.weight[j] > 0
                else model[j] * e_r / model[r] for j in range(len(self.tiers))]

    def update(self, accepted, ran: int, round_ms: Callable[[int], float | None], nested=None) -> bool:
        """Feed one verify of tier index `ran` (accepted: per request, a sequence or an int array; nested:
        as `record` takes it); round_ms(j): tier j's round time at the current bucket (None: unknown).
        True if the active tier changed. The verify is checked and buffered; the buffer is folded into
        the counts (`fold`: the counts verify-by-verify updates give) when a decision is due or it
        holds MAX_PENDING verifies: one numpy pass per run of verifies, where a pass per verify in
        Python over its requests cost ~60 us a verify at batch 16 on the H100's host
        (bench/HISTORY.md, 2026-11-27)."""
        a = np.array(accepted, dtype=np.int64).reshape(-1)  # a copy: the caller may reuse its buffer
        if a.size == 0:
            return False
        nest = self._nested_values(nested, a.size, ran, copy=True) if nested is not None and self.nests[ran] else None
        self._pending.append((ran, a, nest))
        self._last_size = a.size
        # Counted in verifies, observed or not (`observe_every` E: this one stands for E): a decision is due
        # at the observed verify that reaches or passes each update_interval-th verify after the warm-up.
        every = self.cfg.observe_every
        self.batches += every
        self.since_switch += every
        past = self.batches - self.cfg.warmup_batches
        due = (past > 0 and past // self.cfg.update_interval > max(past - every, 0) // self.cfg.update_interval
               and self.since_switch >= self.cfg.min_dwell)
        if not due:
            if len(self._pending) >= MAX_PENDING:
                self.fold()
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
        seed = max(self.cfg.accept_window, self.cfg.window_verifies * self._last_size) * SEED_ROUNDS
        self.tokens = np.asarray(self.expected_tokens()) * seed
        self.weight = np.full(len(self.tiers), seed)
        self.index = best
        self.since_switch = 0
        return True


class RoundTimes:
    """One round's wall time (ms) per (tier index, bucket): `calibrated` from timed runs at warm-up
    (or the first dispatch of a bucket), `observed` online in the steady state. A tier observed at a
    bucket `min_samples` times is estimated by the median of its last `window` observations (the
    first rounds after a prefill or a switch, and a round the host kept waiting, are outliers an
    average would carry for many rounds); one not (yet) by a model scaled to the tier observed most at
    that bucket, else by its calibration times the median ratio observed / calibrated of the last
    `window` observations anywhere.

    The model: rounds in flight one behind the other take the longer of the host's part and the device's
    (`modelled`): the call's host time (`calibrated(..., call_ms)`) plus the step's other host work
    (`host_observed`, online; beside the call instead when it runs on a thread of its own, `threaded`)
    against the device's, the calibration less the call. Where the host sets the pace (batch 16 and 48
    on the H200: a round's host work 1.66 ms against 1.43 ms of device time, bench/HISTORY.md,
    2026-11-28) a cheaper tier's round is no shorter, which its calibration alone (timed with nothing in flight)
    would promise. Without the call's time or host samples: the calibration times the ratio observed /
    calibrated of the tier observed most at the bucket (online rounds carry host work and real
    prefixes a calibration run on padding rows lacks).

    Online ratios between tiers come first (`relative`): at a bucket where a tier has too few rounds of its
    own, its wall is the reference tier's there times the ratio of the two observed at other buckets. The
    calibrations (padding rows, nothing in flight) and the calls' host times in them misjudge the tiers
    against each other: at batch 16 on the H200 they put (3,4,5)'s round at 0.75x (5,4,8)'s and its call at
    0.54x where online rounds were 0.98x, and the policy, deciding at each shrinking bucket from them, ran
    0.92x of static there (bench/HISTORY.md, 2026-11-28)."""

    def __init__(self, window: int = 15, min_samples: int = 8, threaded: bool = False):
        self.window, self.min_samples, self.threaded = window, min_samples, threaded
        self.calibration: dict[tuple, float] = {}
        self.calls: dict[tuple, float] = {}  # (tier, bucket) -> the call's host ms at calibration
        self.host: dict[Any, deque] = {}  # bucket -> the steps' host ms besides the call, online
        self.online: dict[tuple, deque] = {}
        self.at_bucket: dict[Any, dict[int, deque]] = {}  # bucket -> tier -> its online samples
        self.ratios: deque = deque(maxlen=window)  # observed / calibrated
        self._medians: dict[tuple, float] = {}  # (tier, bucket) -> its online median, until its next sample

    def has(self, tier: int, bucket) -> bool:
        return (tier, bucket) in self.calibration

    def calibrated(self, tier: int, bucket, ms: float, call_ms: float | None = None) -> None:
        self.calibration[tier, bucket] = ms
        if call_ms is not None:
            self.calls[tier, bucket] = call_ms

    def host_observed(self, bucket, ms: float) -> None:
        """A step's host time (ms) at `bucket` outside the round's dispatch, not waiting on the device."""
        self.host.setdefault(bucket, deque(maxlen=self.window)).append(ms)

    def modelled(self, tier: int, bucket) -> float | None:
        """The model's round wall (class docstring), or None without the call's time or host samples."""
        key, host = (tier, bucket), self.host.get(bucket)
        if key not in self.calls or not host:
            return None
        call, rest = self.calls[key], statistics.median(host)
        return max(max(call, rest) if self.threaded else call + rest, self.calibration[key] - call)

    def observed(self, tier: int, bucket, ms: float) -> None:
        key = (tier, bucket)
        if key not in self.online:
            self.online[key] = self.at_bucket.setdefault(bucket, {})[tier] = deque(maxlen=self.window)
        self.online[key].append(ms)
        self._medians.pop(key, None)
        if key in self.calibration:
            self.ratios.append(ms / self.calibration[key])

    @property
    def ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    def _most_observed(self, bucket) -> int | None:
        """The calibrated tier with the most online samples (at least `min_samples`) at `bucket`."""
        seen = [(len(d), t) for t, d in self.at_bucket.get(bucket, {}).items()
                if len(d) >= self.min_samples and (t, bucket) in self.calibration]
        return max(seen)[1] if seen else None

    def relative(self, tier: int, other: int) -> float | None:
        """The median over buckets where both were observed (`min_samples` each) of `tier`'s observed round
        wall over `other`'s; None where there is none."""
        ratios = []
        for bucket, tiers in self.at_bucket.items():
            if len(tiers.get(tier, ())) >= self.min_samples and len(tiers.get(other, ())) >= self.min_samples:
                if (theirs := self._median(other, bucket)) > 0:
                    ratios.append(self._median(tier, bucket) / theirs)
        return statistics.median(ratios) if ratios else None

    def _median(self, tier: int, bucket) -> float:
        key = (tier, bucket)
        if key not in self._medians:
            self._medians[key] = statistics.median(self.online[key])
        return self._medians[key]

    def _most_observed_anywhere(self, bucket) -> int | None:
        """The tier calibrated at `bucket` with the most online samples over all buckets."""
        counts: dict[int, int] = {}
        for (t, _), d in self.online.items():
            counts[t] = counts.get(t, 0) + len(d)
        seen = [(n, t) for t, n in counts.items() if (t, bucket) in self.calibration]
        return max(seen)[1] if seen else None

    def estimate(self, tier: int, bucket) -> float | None:
        """Its own median online at `bucket` once it has `min_samples` there; else the tier observed most at
        the bucket (or anywhere, through its calibration) times the two tiers' ratio observed at other
        buckets; else the model or the calibrations (class docstring)."""
        key = (tier, bucket)
        seen = self.online.get(key, ())
        if len(seen) >= self.min_samples or (seen and key not in self.calibration):
            return statistics.median(seen)
        if key in self.calibration:
            a = self._most_observed(bucket)  # scaled to the tier observed most at this bucket
            if a is not None:
                observed = self._median(a, bucket)
                if (rel := self.relative(tier, a)) is not None:
                    return observed * rel
                mine, theirs = self.modelled(tier, bucket), self.modelled(a, bucket)
                if mine is not None and theirs:
                    return mine * observed / theirs
                return self.calibration[key] * observed / self.calibration[a, bucket]
            a = self._most_observed_anywhere(bucket)
            if a is not None and a != tier and (rel := self.relative(tier, a)) is not None:
                return self.calibration[a, bucket] * (self.ratio or 1.0) * rel
            return self.calibration[key] * (self.ratio or 1.0)
        return None

    def report(self, tiers: int, bucket) -> dict:
        """Per tier at `bucket`: the calibration, its call's host time and the observed median (ms; None:
        none); the steps' median host time besides the call."""
        med = lambda d: round(statistics.median(d), 4) if d else None  # noqa: E731
        got = lambda table, j: None if (j, bucket) not in table else round(table[j, bucket], 4)  # noqa: E731
        return {"calibrated": [got(self.calibration, j) for j in range(tiers)],
                "call": [got(self.calls, j) for j in range(tiers)],
                "observed": [med(self.online.get((j, bucket))) for j in range(tiers)],
                "host_besides_call": med(self.host.get(bucket))}
