"""Admission in groups (`runtime/admission.py`): the gate's rent-or-buy rule on its own, and engines that
hold freed rows for company — fewer prefill calls, the same greedy tokens as admitting at once (fp32,
target-only and EAGLE, a stop token and max-new limits that free rows at different steps), every KV slot
free afterwards, a bounded wait, and bad settings refused."""

from __future__ import annotations

import numpy as np
import pytest

from jeagle.engine import EngineConfig, EngineSpec, speculative, target_only
from jeagle.runtime.admission import AdmissionGate
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config
from tests.util import kv_idle


def timed(delay=1.0, max_wait=20, step_s=1.0, prefill_s=2.0) -> AdmissionGate:
    g = AdmissionGate(delay, max_wait)
    g.observe_step(step_s)
    g.prefill_called(prefill_s)
    return g


def test_admits_at_once_when_nothing_runs_everything_fits_untimed_or_delay_zero():
    assert timed().due(running=0, rows=8, waiting=30)  # nothing runs: the device idles
    assert timed().due(running=6, rows=8, waiting=2)  # every waiting request fits
    assert AdmissionGate(1.0, 20).due(running=7, rows=8, waiting=30)  # no timings yet
    assert timed(delay=0.0).due(running=7, rows=8, waiting=30)  # SGLang's rule
    assert not timed().due(running=8, rows=8, waiting=30)  # no free row: nothing to admit


def test_a_free_row_waits_until_its_idle_time_pays_for_a_prefill_call():
    g = timed(delay=1.0, step_s=1.0, prefill_s=2.0)  # a call costs two steps of the whole batch
    # One free row of 8 costs 1/8 of a step each step: 16 steps to reach the call's 2 s.
    held = 0
    while not g.due(running=7, rows=8, waiting=30):
        held += 1
    assert held == 15 and g.held == 15
    # Due but turned away (the pool short of slots): due again at the next step, not held once more.
    assert g.due(running=7, rows=8, waiting=30) and g.held == 15
    g.prefill_called(2.0)  # requests admitted: the idle time starts from nothing
    assert g.idle_s == 0.0 and g.waited == 0 and g.held == 15
    # Rows freeing one a step: the cost grows as 1/8 + 2/8 + 3/8 + ... and passes 2 at the sixth step.
    freed = 0
    while True:
        freed += 1
        if g.due(running=8 - freed, rows=8, waiting=30):
            break
    assert freed == 6
    # A slower prefill or a larger delay holds longer, a longer step shorter.
    assert steps_held(timed(delay=2.0, max_wait=100)) == 31 and steps_held(timed(step_s=4.0)) == 3


def test_a_call_that_compiled_is_no_sample():
    g = timed(step_s=1.0, prefill_s=2.0)
    g.prefill_called(30.0, compiled=True)  # a compile: seconds where a call takes milliseconds
    g.observe_step(40.0, compiled=True)
    assert g.prefill_s == 2.0 and g.step_s == 1.0
    assert AdmissionGate(1.0, 20).due(running=0, rows=0, waiting=3)  # nothing runs: due (the engine then raises)


def steps_held(g: AdmissionGate) -> int:
    n = 0
    while not g.due(running=7, rows=8, waiting=30):
        n += 1
    return n


def test_the_wait_is_bounded_by_max_wait_steps():
    assert steps_held(timed(max_wait=4, prefill_s=1e9)) == 4
    assert steps_held(timed(max_wait=0, prefill_s=1e9)) == 0


def test_timings_are_averaged():
    g = AdmissionGate(1.0, 20)
    g.prefill_called(1.0)
    g.prefill_called(2.0)
    assert g.prefill_s == pytest.approx(1.2)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="admission"):
        EngineConfig(admission_delay=-1.0)
    with pytest.raises(ValueError, match="admission"):
        EngineConfig(admission_max_wait_steps=-1)
    assert EngineSpec(admission_delay=0.5, admission_max_wait_steps=3).engine_config(4, None).admission_delay == 0.5


# ---- engines ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    target = bigram_target(target_config())
    return target, signed_identity_head(target, +1.0, noise=0.08)


@pytest.fixture(scope="module")
def workload():
    """Fourteen requests on four rows; max-new limits and a stop token free rows at different steps."""
    rng = np.random.default_rng(11)
    prompts = [list(rng.integers(4, 96, int(n))) for n in rng.integers(2, 12, 14)]
    params = [SamplingParams(max_new_tokens=int(m), ignore_eos=True) for m in rng.integers(3, 24, 14)]
    params[4] = SamplingParams(max_new_tokens=30, stop_token_ids=(7, 11, 19))
    return prompts, params


def engine(models, kind, **kw):
    cfg = EngineConfig(max_batch_size=4, max_context=96, batch_buckets=(1, 2, 4), **kw)
    if kind == "target":
        return target_only(models[0], cfg)
    return speculative(models[0], models[1], cfg, SpecConfig(3, 2, 5))


def pin_timings(eng, step_s: float, prefill_s: float) -> None:
    """The gate's timings fixed (a CPU's are not the GPU's, and fixed ones make the test deterministic)."""
    g = eng.gate
    g.step_s, g.prefill_s = step_s, prefill_s
    g.observe_step = lambda *a: None
    calls = g.prefill_called
    g.prefill_called = lambda s, compiled=False: calls(prefill_s)


@pytest.mark.parametrize("kind", ["target", "eagle"])
def test_grouped_admission_gives_the_same_tokens_with_fewer_prefill_calls(models, workload, kind):
    prompts, params = workload
    at_once = engine(models, kind, admission_delay=0.0)
    ref = [o.token_ids for o in at_once.generate(prompts, params)]
    calls_at_once = at_once.last_stats.prefill_calls
    assert at_once.last_stats.admission_held_steps == 0

    grouped = engine(models, kind, admission_delay=1.0, admission_max_wait_steps=6)
    pin_timings(grouped, step_s=1.0, prefill_s=1.0)  # a call costs one step of the batch
    outs = grouped.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    stats = grouped.last_stats
    assert stats.admission_held_steps > 0
    assert stats.prefill_calls < calls_at_once, (stats.prefill_calls, calls_at_once)
    assert kv_idle(grouped)[0] == grouped.pool.num_slots - 1  # every slot back
    assert grouped.info()["admission_held_steps"] == stats.admission_held_steps  # one window: the engine's life


def test_a_held_row_is_filled_within_max_wait_steps(models, workload):
    """With a prefill call priced out of reach, every hold ends at the step bound: counted at the engine,
    steps that began with a free row and requests waiting, and admitted none, never run more than 3 in a
    row; the requests all finish and every slot comes back."""
    prompts, params = workload
    eng = engine(models, "eagle", admission_delay=1.0, admission_max_wait_steps=3)
    pin_timings(eng, step_s=1.0, prefill_s=1e9)
    reqs = [eng.submit(p, sp) for p, sp in zip(prompts, params)]
    streak = most = 0
    while eng.has_work:
        free, waiting = eng.max_running - eng.num_running, eng.num_waiting
        eng.step()
        streak = streak + 1 if free > 0 and waiting and eng.num_waiting == waiting else 0
        most = max(most, streak)
    assert all(r.out.finish_reason in ("length", "stop") for r in reqs)
    assert 0 < most <= 3
    assert kv_idle(eng)[0] == eng.pool.num_slots - 1
