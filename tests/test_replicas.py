"""Data-parallel replicas behind one server (`--dp N`, `jeagle.serve.router`): the policy on fake
replicas, then two target-only engine processes (the tiny bigram target of tests/test_serve.py, batch
2: every executable they touch compiles in each, a few seconds apiece on CPU) behind one app over real
HTTP: the same greedy text as one engine, distinct prompts spread evenly, a shared prefix kept on one
replica, `/server_info` and `/flush_cache` over both, and a replica killed mid-stream (its requests end
with an error at once, `/health` names it, the other serves on). The router never looks inside an
engine: EAGLE replicas are routed alike (EngineProcess with EAGLE: tests/test_serve.py)."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jeagle.serve.router import BLOCK, PrefixRecord, Router, block_hashes, replica_env
from tests.test_serve import MODEL, PROMPTS, char_tokenizer, start_server

ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.0123456789"


# ---- the policy, on fake replicas ------------------------------------------------------------------------
class FakeReplica:
    facts, extra = "facts", {"name": "fake"}

    def __init__(self):
        self.jobs, self.alive = [], True

    def try_submit(self, job) -> bool:
        if self.alive:
            self.jobs.append(job)
        return self.alive

    def in_flight(self) -> int:
        return len(self.jobs)

    def is_alive(self) -> bool:
        return self.alive

    def info(self) -> dict:
        return {"running_requests": len(self.jobs), "kv_slots_total": 10, "avg_spec_accept_length": 2.0,
                "internal_states": [{"last_gen_throughput": 1.0}], "spec_accept_length_counts": [1, 2]}


class FakeJob:
    def __init__(self, prompt, arrived=None):
        self.prompt, self.arrived, self.replica = prompt, time.perf_counter() if arrived is None else arrived, -1


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 90) for _ in range(n)]


def test_the_policy_prefix_then_least_loaded():
    rng = random.Random(0)
    assert block_hashes(list(range(40))) == block_hashes(list(range(32)) + [7]) and len(block_hashes([1] * 15)) == 0
    record = PrefixRecord(max_blocks=3)
    record.insert(block_hashes(list(range(64))))  # 4 blocks: the first is dropped
    assert record.match(block_hashes(list(range(64)))) == 0 and len(record.blocks) == 3
    router = Router([FakeReplica(), FakeReplica()])
    # Distinct prompts: the least loaded, ties to the fewest routed: alternating.
    for _ in range(10):
        router.submit(FakeJob(words(rng, 40)))
    assert router.routed == [5, 5]
    # A shared prefix: where the first went, while the loads stay balanced ...
    shared = words(rng, 6 * BLOCK)
    first = FakeJob(shared + words(rng, 5))
    router.submit(first)
    for _ in range(8):
        job = FakeJob(shared + words(rng, 5))
        router.submit(job)
        assert job.replica == first.replica
    # ... and a short match (below the threshold) does not count.
    job = FakeJob(shared[:BLOCK] + words(rng, 3 * BLOCK))
    router.submit(job)
    assert job.replica != first.replica
    # Imbalanced past the thresholds: the least loaded takes even a matching prompt.
    router.replicas[first.replica].jobs += [None] * 40
    job = FakeJob(shared + words(rng, 5))
    router.submit(job)
    assert job.replica != first.replica
    # The n choices of one request (one prompt list, one arrival) go together, whatever the loads.
    prompt, now = words(rng, 40), time.perf_counter()
    jobs = [FakeJob(prompt, now) for _ in range(3)]
    for j in jobs:
        router.submit(j)
    assert len({j.replica for j in jobs}) == 1
    # A replica gone: the other takes everything; none left: refused (the event goes to the job's loop).
    router.replicas[0].alive = False
    assert router.down() == [0] and router.is_alive()
    for _ in range(3):
        job = FakeJob(shared + words(rng, 5))
        router.submit(job)
        assert job.replica == 1
    info = router.info()
    assert info["dp"] == 2 and [r["alive"] for r in info["replicas"]] == [False, True]
    assert info["kv_slots_total"] == 10 and len(info["internal_states"]) == 2  # summed over the live one
    assert info["spec_accept_length_counts"] == [2, 4]


def test_replica_devices():
    assert replica_env(1, 2, {"JAX_PLATFORMS": "cpu"}) == {}
    assert replica_env(1, 2, {}) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert replica_env(1, 1, {"CUDA_VISIBLE_DEVICES": "4,5,6"}) == {"CUDA_VISIBLE_DEVICES": "5"}
    with pytest.raises(ValueError, match="replica 1 needs GPUs 2-3"):
        replica_env(1, 2, {"CUDA_VISIBLE_DEVICES": "0,1,2"})


def test_dp_flag_is_checked():
    from jeagle.serve.options import parse_options

    assert parse_options([]).dp == 1 and parse_options(["--dp", "3"]).dp == 3
    for bad in (["--dp", "0"], ["--dp", "2", "--engine-thread"]):
        with pytest.raises(SystemExit):
            parse_options(bad)


# ---- two engine processes over HTTP -----------------------------------------------------------------------
def replica_build(batch: int = 2):
    """EngineProcess's build: the tiny bigram target, target-only (the `reference` engine's, seeded alike)."""
    from jeagle.engine import EngineConfig, target_only
    from tests.spec_models import bigram_target, target_config

    return (target_only(bigram_target(target_config()), EngineConfig(max_batch_size=batch, max_context=128)),
            char_tokenizer(), {"built": "tiny"})


@pytest.fixture(scope="module")
def dp():
    from jeagle.serve import create_app
    from jeagle.serve.router import start_replicas

    router = start_replicas(replica_build, (), 2)
    srv, thread, url = start_server(create_app(router, char_tokenizer(), MODEL))
    yield url, router
    srv.should_exit = True
    thread.join(timeout=30)
    assert not router.is_alive()


@pytest.fixture(scope="module")
def reference():
    """One engine's greedy text (in this process)."""
    from jeagle.engine import EngineConfig, target_only
    from jeagle.sampling import SamplingParams
    from tests.spec_models import bigram_target, target_config

    eng, tok = target_only(bigram_target(target_config()), EngineConfig(max_batch_size=1, max_context=128)), \
        char_tokenizer()

    def run(prompt: str, max_tokens: int) -> str:
        out = eng.generate([tok.encode(prompt)], SamplingParams(max_new_tokens=max_tokens))[0]
        return tok.decode(out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids)
    return run


def post(c: httpx.Client, prompt: str, **kw) -> dict:
    r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "temperature": 0} | kw)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_replicas_serve_what_one_engine_serves(dp, reference):
    url, router = dp
    with httpx.Client(base_url=url, timeout=120) as c:
        for prompt in PROMPTS[:4]:
            want = reference(prompt, 16)
            assert post(c, prompt, max_tokens=16)["choices"][0]["text"] == want
            with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 16,
                                                           "temperature": 0, "stream": True}) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and "".join(
                json.loads(e)["choices"][0]["text"] for e in events[:-1]) == want
        before = list(router.routed)
        body = post(c, PROMPTS[4], max_tokens=10, n=3)
        assert [ch["text"] for ch in body["choices"]] == [reference(PROMPTS[4], 10)] * 3
        assert sorted(a - b for a, b in zip(router.routed, before)) == [0, 3]  # the 3 choices on one replica
    assert all(n > 0 for n in router.routed)


def test_distinct_prompts_spread_evenly(dp):
    """A uniform load: waves of 4 concurrent requests of one size, distinct prompts (no shared block)."""
    url, router = dp
    rng = random.Random(1)
    prompts = ["".join(rng.choice(ALPHABET) for _ in range(32)) for _ in range(40)]
    before = list(router.routed)
    with httpx.Client(base_url=url, timeout=120) as c, ThreadPoolExecutor(4) as pool:
        for wave in range(0, len(prompts), 4):
            list(pool.map(lambda p: post(c, p, max_tokens=4, ignore_eos=True), prompts[wave:wave + 4]))
    a, b = (x - y for x, y in zip(router.routed, before))
    assert a + b == 40 and abs(a - b) <= 0.1 * max(a, b), (a, b)


def test_a_shared_prefix_stays_on_one_replica(dp):
    url, router = dp
    rng = random.Random(2)
    prefixes = ["".join(rng.choice(ALPHABET) for _ in range(72)) for _ in range(2)]
    landed: dict[int, list[int]] = {0: [], 1: []}
    cached = 0
    with httpx.Client(base_url=url, timeout=120) as c:
        for k in range(20):  # the two groups interleaved, one request at a time (its replica: the count that grew)
            before = list(router.routed)
            body = post(c, prefixes[k % 2] + "".join(rng.choice(ALPHABET) for _ in range(6)), max_tokens=2)
            landed[k % 2].append([x - y for x, y in zip(router.routed, before)].index(1))
            cached += body["usage"]["prompt_tokens_details"]["cached_tokens"] if k >= 2 else 0
    for group in landed.values():
        assert max(group.count(0), group.count(1)) >= 0.9 * len(group), landed
    assert cached >= 18 * 64  # and the replica's prefix cache held it


def test_server_info_health_and_flush_cover_every_replica(dp):
    url, router = dp
    with httpx.Client(base_url=url, timeout=60) as c:
        deadline = time.time() + 15
        while (info := c.get("/server_info").json())["running_requests"] and time.time() < deadline:
            time.sleep(0.05)
        reps = info["replicas"]
        assert info["dp"] == 2 and [r["replica"] for r in reps] == [0, 1] and all(r["alive"] for r in reps)
        assert [r["routed"] for r in reps] == router.routed and len(info["internal_states"]) == 2
        assert info["kv_slots_total"] == sum(r["kv_slots_total"] for r in reps)  # summed ...
        assert info["speculative"] is False and info["compilations"] == reps[0]["compilations"]  # ... or replica 0's
        assert info["prefix_cache_slots"] > 0
        assert c.get("/health").json() == {"status": "ok"}
        assert c.post("/flush_cache").status_code == 200
        deadline = time.time() + 10
        while c.get("/server_info").json()["prefix_cache_slots"] and time.time() < deadline:
            time.sleep(0.05)
        info = c.get("/server_info").json()
        assert [r["prefix_cache_slots"] for r in info["replicas"]] == [0, 0]


def test_a_killed_replica_fails_its_requests_at_once_and_the_other_serves_on(dp):
    """Run last: it kills a replica of the module's server (replica 0, or 1 if 0 had finished its part)."""
    url, router = dp
    rng = random.Random(3)
    results: list = [None] * 4  # 2 streamed, 2 whole: one batch of 2 on each replica
    started = [threading.Event() for _ in results]

    def one(i):
        body = {"model": MODEL, "prompt": "".join(rng.choice(ALPHABET) for _ in range(20)) + str(i),
                "max_tokens": 90, "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}
        with httpx.Client(base_url=url, timeout=60) as c:
            if not body["stream"]:
                started[i].set()
                r = c.post("/v1/completions", json=body)
                results[i] = ("whole", r.status_code, r.json(), time.time())
                return
            text, err = "", None
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        err = event["error"]
                        break
                    text += event["choices"][0]["text"]
                    started[i].set()
            results[i] = ("stream", err, text, time.time())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(60)
    victim = 0 if router.replicas[0].in_flight() else 1
    assert router.replicas[victim].in_flight() > 0, "no replica had anything in flight to lose"
    os.kill(router.replicas[victim].pid, signal.SIGKILL)
    killed_at = time.time()
    gone = f"engine process of replica {victim} exited"
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a request hung"
    failed = 0
    for kind, status_or_err, body, ended in results:
        if kind == "whole" and status_or_err != 200:
            assert status_or_err >= 500 and gone in body["error"]["message"]
        elif kind == "stream" and status_or_err is not None:
            assert gone in status_or_err["message"]
        else:
            assert len(body if kind == "stream" else body["choices"][0]["text"]) > 0
            continue
        failed += 1
        assert ended - killed_at < 5
    assert failed > 0
    with httpx.Client(base_url=url, timeout=60) as c:
        h = c.get("/health")
        assert h.status_code == 200 and h.json() == {"status": "ok", "replicas_down": [victim]}
        before = list(router.routed)
        for k in range(4):
            assert post(c, PROMPTS[k], max_tokens=8)["choices"][0]["text"]
        other = 1 - victim
        assert router.routed[victim] == before[victim] and router.routed[other] == before[other] + 4
        info = c.get("/server_info").json()
        assert [r["alive"] for r in info["replicas"]] == [victim != 0, victim != 1]
        os.kill(router.replicas[other].pid, signal.SIGKILL)  # none left: 503s, not hangs
        deadline = time.time() + 5
        while router.is_alive() and time.time() < deadline:
            time.sleep(0.02)
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["replicas_down"] == [0, 1]
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["message"] == "no engine replica is alive"
