"""The step-wise engine API a server drives: submit() / step() / abort(), requests joining and leaving
between steps, slots freed on abort, bad input refused before anything is queued."""

from __future__ import annotations

import numpy as np
import pytest

from jeagle.engine import EngineConfig, PromptTooLong, speculative, target_only
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config
from tests.util import kv_idle

CFG = EngineConfig(max_batch_size=3, max_context=96, batch_buckets=(1, 2, 3))


@pytest.fixture(scope="module")
def target():
    return bigram_target(target_config())


@pytest.fixture(scope="module")
def engines(target):
    head = signed_identity_head(target, +1.0, noise=0.08)
    return {"target-only": target_only(target, CFG), "eagle": speculative(target, head, CFG, SpecConfig(3, 2, 5))}


PROMPTS = [list(np.random.default_rng(4).integers(4, 96, n)) for n in (5, 3, 8, 2, 6)]
PARAMS = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (9, 14, 6, 11, 8)]


@pytest.fixture(scope="module")
def alone(target):
    """Each request run by itself (greedy): what it must produce in any company."""
    eng = target_only(target, CFG)
    return [eng.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, PARAMS)]


def idle_state(eng):
    return kv_idle(eng)


@pytest.mark.parametrize("name", ["target-only", "eagle"])
def test_requests_join_between_steps(engines, alone, name):
    eng = engines[name]
    idle = idle_state(eng)
    reqs = [eng.submit(p, sp) for p, sp in zip(PROMPTS[:2], PARAMS[:2])]
    for _ in range(3):
        eng.step()
    reqs += [eng.submit(p, sp) for p, sp in zip(PROMPTS[2:], PARAMS[2:])]  # more than the free rows
    assert eng.num_waiting + eng.num_running <= 5
    while eng.has_work:
        eng.step()
    assert [r.out.token_ids for r in reqs] == alone
    assert all(r.done and r.out.finish_reason == "length" for r in reqs)
    assert idle_state(eng) == idle


@pytest.mark.parametrize("name", ["target-only", "eagle"])
def test_abort_frees_slots_and_leaves_the_others_alone(engines, alone, name):
    eng = engines[name]
    idle = idle_state(eng)
    streamed = {}
    reqs = [eng.submit(p, sp, on_tokens=lambda i, ids: streamed.setdefault(i, []).extend(ids))
            for p, sp in zip(PROMPTS, PARAMS)]
    while not reqs[1].out.token_ids:  # request 1 is running and has streamed tokens
        eng.step()
    eng.abort(reqs[1])  # mid-stream, rounds for it possibly still in flight
    eng.abort(reqs[4])  # still waiting for a row
    eng.abort(reqs[4])  # twice is a no-op
    got_at_abort = list(reqs[1].out.token_ids)
    while eng.has_work:
        eng.step()
    assert reqs[1].out.finish_reason == "abort" and reqs[1].out.token_ids == got_at_abort
    assert reqs[4].out.finish_reason == "abort" and reqs[4].out.token_ids == []
    assert got_at_abort == alone[1][: len(got_at_abort)]
    for i in (0, 2, 3):
        assert reqs[i].out.token_ids == alone[i] and streamed[reqs[i].index] == alone[i]
    assert idle_state(eng) == idle


def test_bad_submit_queues_nothing(engines):
    eng = engines["target-only"]
    with pytest.raises(PromptTooLong):
        eng.submit(list(range(4, 100)), SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.submit([5, 6, 10_000], SamplingParams())
    assert not eng.has_work
    with pytest.raises(PromptTooLong):  # generate checks every prompt before queueing any
        eng.generate([[5, 6], list(range(4, 100))], SamplingParams(max_new_tokens=4))
    assert not eng.has_work


@pytest.mark.parametrize("name", ["target-only", "eagle"])
def test_abort_all_after_a_failed_step_leaves_the_engine_idle_and_usable(engines, alone, name):
    """What a server does after a step raised: abort everything; nothing in flight is read, a wait on
    the failed step's results does not raise again, every row and slot is free, and the next request
    runs as if alone."""
    from jeagle.runtime.verify_done import VerifyDone

    eng = engines[name]
    idle = idle_state(eng)
    reqs = [eng.submit(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    eng.step()  # a prefill (and a first step) in flight, two requests still waiting

    def failed(_):
        raise RuntimeError("the step's results failed on the device")

    kept = eng.verify_done
    eng.verify_done = VerifyDone("sync", block=failed)
    eng.verify_done.record(object())
    try:
        aborted = eng.abort_all()
    finally:
        eng.verify_done = kept
    assert sorted(r.index for r in aborted) == sorted(r.index for r in reqs if r.out.finish_reason == "abort")
    assert len(aborted) == 5 and all(r.done for r in reqs)
    assert not eng.has_work and idle_state(eng) == idle
    again = eng.submit(PROMPTS[0], PARAMS[0])
    while eng.has_work:
        eng.step()
    assert again.out.token_ids == alone[0]


@pytest.mark.parametrize("name", ["target-only", "eagle"])
def test_a_batch_after_abort_all_starts_at_its_own_bucket(engines, alone, name):
    """The bucket a running batch holds (`bucket_shrink_ratio`, default 2) is let go by `abort_all`:
    two requests after an abort at bucket 3 run at bucket 2 (held, 2 rows would keep 3: 2 > 3 / 2)."""
    eng = engines[name]
    assert eng.bucket_shrink_ratio == 2.0
    reqs = [eng.submit(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in PROMPTS[:3]]
    eng.reset_stats()
    for _ in range(3):
        eng.step()
    assert eng.stats(reqs).buckets_used == [3] and not any(r.done for r in reqs)
    eng.abort_all()
    eng.reset_stats()
    again = [eng.submit(p, sp) for p, sp in zip(PROMPTS[:2], PARAMS[:2])]
    while eng.has_work:
        eng.step()
    assert [r.out.token_ids for r in again] == alone[:2]
    assert eng.stats(again).buckets_used == [1, 2]  # 2 rows, then 1 (1 <= 2 / 2)
