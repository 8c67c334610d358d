"""Wiring between the scheduler, the decoders and the runtime's small parts that no output shows: the
verify_done wait in each mode, every result the host reads having had its copy to the host started,
the smallest bucket that fits, and when an adaptive tier switch takes effect with and without overlap.
Each of them can break with every token still right, so these tests watch the calls themselves."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax._src.array import ArrayImpl

import jeagle.runtime.decoder as runtime_decoder
import jeagle.runtime.scheduler as scheduler
from jeagle.speculative.adaptive import AdaptiveConfig
from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.runtime.buckets import pick_bucket
from jeagle.runtime.dispatch import Dispatched, resolve
from jeagle.runtime.verify_done import STREAM_WAIT_ENV, VerifyDone, verify_done_mode
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config

# Batch 8 with the default buckets: (1, ..., 8) for decode, (1, 4, 8) for prefill, so a small batch has
# buckets above it that a wrong choice would pick.
CFG = EngineConfig(max_batch_size=8, max_context=96)
SPEC = SpecConfig(3, 2, 5)
PROMPTS = [list(np.random.default_rng(7).integers(4, 96, n)) for n in (5, 3, 8)]
PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return bigram_target(target_config())


@pytest.fixture(scope="module")
def head(target):
    return signed_identity_head(target, +1.0, noise=0.08)  # partial acceptance: rounds of different lengths


@pytest.fixture(scope="module")
def engines(target, head):
    # Built with the environment's switch unset: the default mode is what these engines must have.
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(STREAM_WAIT_ENV, raising=False)
        return {"target-only": target_only(target, CFG), "eagle": speculative(target, head, CFG, SPEC),
                "eagle-sync": speculative(target, head, dataclasses.replace(CFG, verify_done_wait="sync"), SPEC)}


def record_rounds(monkeypatch, dec, events):
    """Log ("dispatch", result) for every round the decoder dispatches."""
    step = dec.step

    def logged(*a, **k):
        out = step(*a, **k)
        events.append(("dispatch", resolve(out)))
        return out
    monkeypatch.setattr(dec, "step", logged)


# ---- 1. the verify_done wait ------------------------------------------------------------------------
class FakeHandle:
    """A handle whose readiness the test sees: ready only once something blocked on it."""

    def __init__(self):
        self.ready = False

    def block_until_ready(self):
        self.ready = True
        return self


def test_sync_wait_blocks_through_the_default_block_and_dataflow_does_not():
    vd = VerifyDone("sync")  # the default block: jax.block_until_ready
    h = FakeHandle()
    vd.record(h)
    vd.wait()
    assert h.ready and not vd.pending
    vd = VerifyDone("dataflow", check=lambda arrays: None)  # a live handle: no fallback
    h = FakeHandle()
    vd.record(h)
    vd.wait()
    assert not h.ready and not vd.pending and vd.fallbacks == 0


def test_sync_mode_blocks_on_each_round_before_the_next_dispatch(engines, monkeypatch):
    eng = engines["eagle-sync"]
    vd = eng.verify_done
    assert eng.verify_done_mode == vd.mode == "sync"
    events, block = [], vd._block

    def blocking(arrays):
        out = block(arrays)
        assert all(x.is_ready() for x in jax.tree.leaves(arrays)), "the hard wait returned before the results"
        events.append(("block", arrays))
        return out
    monkeypatch.setattr(vd, "_block", blocking)
    record_rounds(monkeypatch, eng.decoder, events)
    eng.generate(PROMPTS[:1], PARAMS)  # one request: the executables EAGLE's other tests here use
    rounds = [x for kind, x in events if kind == "dispatch"]
    blocks = [x for kind, x in events if kind == "block"]
    assert len(rounds) > 2 and eng.last_stats.verify_done_wait == "sync"
    assert len(blocks) == len(rounds), f"{len(rounds)} rounds dispatched, {len(blocks)} hard waits on their results"
    # Every round's result is blocked on once, after its dispatch and before the next round's.
    assert [kind for kind, _ in events] == ["dispatch", "block"] * len(rounds)
    assert all(b is r for (_, r), (_, b) in zip(events[::2], events[1::2]))


def test_dataflow_is_the_default_and_never_blocks(engines, monkeypatch):
    monkeypatch.delenv(STREAM_WAIT_ENV, raising=False)
    assert EngineConfig().verify_done_wait is None and verify_done_mode(None) == "dataflow"
    eng = engines["eagle"]
    vd = eng.verify_done
    assert eng.verify_done_mode == vd.mode == "dataflow"
    events, check = [], vd._check
    monkeypatch.setattr(vd, "_block", lambda arrays: events.append(("block", arrays)))
    monkeypatch.setattr(vd, "_check", lambda arrays: (check(arrays), events.append(("check", arrays))))
    record_rounds(monkeypatch, eng.decoder, events)
    eng.generate(PROMPTS[:1], PARAMS)
    kinds = [kind for kind, _ in events]
    assert kinds.count("dispatch") > 2 and kinds.count("block") == 0, f"dataflow blocked {kinds.count('block')} times"
    assert kinds == ["dispatch", "check"] * (len(events) // 2) and vd.fallbacks == 0
    assert all(c is r for (_, r), (_, c) in zip(events[::2], events[1::2]))


# ---- 2. every result read had its copy to the host started ----------------------------------------------
class ReadingNumpy:
    """numpy for one module, with `asarray` of a device array logged (the host's reads of results)."""

    def __init__(self, reads):
        self._reads = reads

    def __getattr__(self, name):
        return getattr(np, name)

    def asarray(self, x, *a, **k):
        if isinstance(x, (jax.Array, Dispatched)):
            self._reads.append(resolve(x))
        return np.asarray(x, *a, **k)


def reads_without_copies(monkeypatch, run):
    """Run `run()` watching the host's reads of device arrays: (result reads, table reads, the shapes of those
    read without their copy to the host started first). Also the GPU runner's check (tests/test_gpu_engine.py)."""
    started, results, tables = {}, [], []
    copy = ArrayImpl.copy_to_host_async

    def starting(self):
        started[id(self)] = self  # held: an id is not reused while the test runs
        return copy(self)
    monkeypatch.setattr(ArrayImpl, "copy_to_host_async", starting)
    # Where the host turns device arrays into numpy: the scheduler's read of each step's result, the
    # decoders' reads of slot tables (a speculative round's commit moves slots: read back at a finish).
    monkeypatch.setattr(scheduler, "np", ReadingNumpy(results))
    monkeypatch.setattr(runtime_decoder, "np", ReadingNumpy(tables))
    run()
    return results, tables, [x.shape for x in results + tables if id(x) not in started]


@pytest.mark.parametrize("name", ["target-only", "eagle"])
def test_every_result_read_had_its_copy_started(engines, monkeypatch, name):
    eng = engines[name]
    results, tables, unstarted = reads_without_copies(
        monkeypatch, lambda: eng.generate(PROMPTS[: 1 if eng.speculative else 3], PARAMS))
    assert len(results) > eng.last_stats.steps > 2
    assert bool(tables) == eng.decoder.swaps_slots
    assert not unstarted, f"{len(unstarted)} of {len(results + tables)} reads had no copy started: {unstarted}"


# ---- 3. the smallest bucket that fits ------------------------------------------------------------------------
@pytest.mark.parametrize("name,n", [("target-only", 1), ("target-only", 3), ("eagle", 1)])
def test_a_batch_runs_at_the_smallest_bucket_that_fits(engines, monkeypatch, name, n):
    eng = engines[name]
    dec, buckets = eng.decoder, eng.buckets
    steps, prefills = [], []  # (rows, batch bucket); (prompts, longest, batch bucket, length bucket)
    step, prefill = dec.step, dec.prefill

    def stepping(reqs, b, kv, *a, **k):
        steps.append((len(reqs), b))
        return step(reqs, b, kv, *a, **k)

    def prefilling(reqs, b, t, *a, **k):
        prefills.append((len(reqs), max(len(r.seq) - r.start for r in reqs), b, t))
        return prefill(reqs, b, t, *a, **k)
    monkeypatch.setattr(dec, "step", stepping)
    monkeypatch.setattr(dec, "prefill", prefilling)
    eng.generate(PROMPTS[:n], PARAMS)  # equal lengths: the batch runs whole until every request ends together
    want = pick_bucket(buckets.batch, n)
    assert want < buckets.batch[-1] and buckets.prefill_len[0] < buckets.prefill_len[-1]
    assert steps and all(got == (n, want) for got in steps), f"(rows, bucket) of each step: {steps}; want {want}"
    assert eng.last_stats.buckets_used == [want]
    assert prefills and all((b, t) == (pick_bucket(buckets.prefill_batch, m), pick_bucket(buckets.prefill_len, x))
                            for m, x, b, t in prefills), f"(prompts, longest, batch bucket, length bucket): {prefills}"
    assert any(b < buckets.prefill_batch[-1] for _, _, b, _ in prefills)


# ---- 4. an adaptive tier switch takes effect one dispatch late with overlap, at once without --------------
TIERS = ((1, 1, 2), (2, 1, 3))


@pytest.mark.parametrize("overlap,lag", [(True, 1), (False, 0)], ids=["overlap", "no-overlap"])
def test_an_adaptive_switch_runs_one_dispatch_late_with_overlap_and_at_once_without(target, monkeypatch, overlap, lag):
    """The oracle head accepts every draft, so the EMA policy (alpha 1, deciding at every verify) moves
    up to the second tier on reading the first round. With overlap round c+1 is dispatched before
    round c is read, so the tier chosen on reading round c first runs in round c+2; without, in c+1."""
    adaptive = AdaptiveConfig(candidate_tiers=TIERS, ema_alpha=1.0, warmup_batches=0, update_interval=1,
                              policy="ema")
    eng = speculative(target, signed_identity_head(target, +1.0),
                      EngineConfig(max_batch_size=1, max_context=96, overlap=overlap), SpecConfig(*TIERS[0]),
                      adaptive=adaptive)
    dec, ctl = eng.decoder, eng.decoder.controller
    # The tier each round dispatched ran; rounds read so far; per verify the controller heard: (the round
    # read, the active tier after it, the tier that round ran, whether it switched, rounds dispatched by then).
    ran, reads, decisions = [], [0], []
    round_exe, unpack, verify = dec.round_exe, dec.unpack, ctl.on_verify_complete

    def exe(state, *a, **k):
        ran.append(dec.tier_states.index(state))
        return round_exe(state, *a, **k)

    def read(kind, *a, **k):
        out = unpack(kind, *a, **k)
        reads[0] += kind == "step"
        return out

    def decide(accepted, tier, *a, **k):
        changed = verify(accepted, tier, *a, **k)
        decisions.append((reads[0], ctl.active_index, tier, changed, len(ran)))
        return changed
    monkeypatch.setattr(dec, "round_exe", exe)
    monkeypatch.setattr(dec, "unpack", read)
    monkeypatch.setattr(ctl, "on_verify_complete", decide)
    eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=40, ignore_eos=True))

    assert all(ran[c] == tier for c, _, tier, _, _ in decisions)  # the controller heard which tier each round ran
    switches = [(c, new, dispatched) for c, new, _, changed, dispatched in decisions if changed]
    assert len(switches) == 1, decisions
    (c, new, dispatched), = switches
    # Decided on reading the first round; rounds dispatched by then: c + 2 with overlap (round c + 1 in
    # flight), c + 1 without. The next dispatch is the first to run the new tier, and every later one does.
    assert (c, new) == (0, 1) and dispatched == c + 1 + lag, (decisions, ran)
    assert ran == [0] * dispatched + [1] * (len(ran) - dispatched) and len(ran) > dispatched + 2, ran
