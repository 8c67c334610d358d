"""What an accounting window of the engine reports (`Engine.stats`, `Engine.last_stats`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np


def latency_stats(seconds) -> dict[str, float] | None:
    """mean / p50 / p99 in milliseconds, or None for no samples."""
    if not len(seconds):
        return None
    ms = np.asarray(seconds) * 1e3
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


@dataclass
class SpecStats:
    """A speculative decoder's part of the stats."""
    rounds: int = 0  # request-rounds (a batch of B rounds counts B)
    round_dispatches: int = 0
    accept_length: float = 1.0  # tokens per request-round, bonus included
    accept_length_histogram: dict[str, int] = field(default_factory=dict)
    adaptive: bool = False
    tiers: list[list[int]] = field(default_factory=list)  # every (S, K, N) the decoder runs
    tier_history: dict[str, list[int]] = field(default_factory=dict)  # round index (from 0) -> tier from then on
    tier_switches: int = 0
    rounds_per_dispatch: int = 1  # rounds one dispatch runs (all of them unrolled; the loop stops once all rows finish)
    # Grammar rows' rounds whose tree masks came from checking the verify's best tokens (greedy rows,
    # `jeagle.sampling.grammar_walk.walk_nodes`) and from a mask per tree node (the rest, and what the walk left undecided).
    grammar_rows_walked: int = 0
    grammar_rows_masked: int = 0
    # Adaptive: the policy's view at the end of the window (`AdaptiveController.report`): policy, active
    # tier, and for "throughput" each tier's expected accept length, round ms at the last bucket and
    # expected tokens per ms; None when not adaptive.
    adaptive_state: dict | None = None


@dataclass
class Stats:
    prompt_tokens: int
    new_tokens: int
    wall_s: float  # serving time: compiling excluded
    compile_s: float
    compilations: int
    compilations_after_warmup: int | None  # None without a warm-up
    warmup_s: float | None
    steps: int  # decode steps / rounds dispatched for the batch
    host_blocked_ms: dict[str, float] | None  # per step: mean / p50 / p99
    buckets_used: list[int]
    overlap: bool
    verify_done_wait: str
    executables_from_store: int | None  # engine lifetime; None without a store
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of prefilled
    # Per step that dispatched (mean / p50 / p99, ms): the host's time in the step not waiting on the
    # device (when it is as long as a step's device time, the host sets the pace; a target-only grammar
    # step's reading of the results in flight counts as waiting, as in host_blocked_ms), and within it
    # the decode/round dispatch (inputs and the executable's call; a grammar round's host masks too; a
    # compile after warm-up too); per prefill call, its dispatch.
    host_busy_ms: dict[str, float] | None = None
    host_dispatch_ms: dict[str, float] | None = None
    host_prefill_dispatch_ms: dict[str, float] | None = None
    prefill_calls: int = 0
    admission_held_steps: int = 0  # steps a free row waited for company (runtime/admission.py)
    retractions: int = 0  # requests retracted to make room (and resumed), in the window
    # Host time computing grammar masks (jeagle/sampling/grammar.py); a speculative round computes its tree's
    # while the device runs the verify's forward, so only what outlasts that forward stalls the device.
    grammar_mask_ms: float = 0.0
    speculative: SpecStats | None = None

    @property
    def tokens_per_second(self) -> float | None:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else None

    @property
    def accept_length(self) -> float:
        """Tokens per request-round, bonus included (1.0 for target-only decoding)."""
        return self.speculative.accept_length if self.speculative is not None else 1.0

    def to_dict(self) -> dict:
        """A flat dict (the speculative fields beside the others, with their target-only defaults when
        the engine decodes with the target alone): the `--json` stats."""
        out = dataclasses.asdict(self)
        spec = out.pop("speculative") or dataclasses.asdict(SpecStats())
        return out | spec
