"""`jeagle.serve` over real HTTP on loopback: a tiny fp32 target with an EAGLE head (greedy output must
equal target-only decoding), a character-level tokenizer, the `openai` client and raw `httpx`."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from jeagle.loading.tokenizer import Tokenizer
from tests.spec_models import bigram_target, signed_identity_head, target_config

MODEL = "tiny-bigram"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def char_tokenizer(last: str = "z") -> Tokenizer:
    """ids 0-3 special (</s> = 3, the tiny target's EOS), then one character each: " " to `last`, and
    newline (last "z": ids 4-95; "~", all of printable ASCII: ids 4-99)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Fast

    chars = [chr(c) for c in range(32, ord(last) + 1)] + ["\n"]
    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "</s>": 3} | {c: 4 + i for i, c in enumerate(chars)}
    fast = Fast(models.WordLevel(vocab, unk_token="<unk>"))
    fast.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    fast.decoder = decoders.Fuse()
    fast.add_special_tokens(["<|im_start|>", "<|im_end|>", "</s>", "<unk>"])
    return Tokenizer(fast, {"eos_token": "</s>", "unk_token": "<unk>", "chat_template": TEMPLATE})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(app):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{server.config.port}"


@pytest.fixture(scope="module")
def parts():
    target = bigram_target(target_config())
    head = signed_identity_head(target, +1.0, noise=0.08)
    return target, head, char_tokenizer()


def make_app(parts, api_key=None, batch=8):
    from jeagle.serve import create_app

    target, head, tok = parts
    engine = speculative(target, head, EngineConfig(max_batch_size=batch, max_context=128), SpecConfig(3, 2, 5))
    return create_app(engine, tok, MODEL, api_key, aliases=("/models/" + MODEL,)), engine


@pytest.fixture(scope="module")
def server(parts):
    app, engine = make_app(parts)
    srv, thread, url = start_server(app)
    yield url, engine
    srv.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def reference(parts):
    """Greedy target-only decoding of a prompt (token ids) → (text, finish_reason)."""
    target, _, tok = parts
    eng = target_only(target, EngineConfig(max_batch_size=1, max_context=128))

    def run(ids, max_tokens):
        out = eng.generate([ids], SamplingParams(max_new_tokens=max_tokens))[0]
        body = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
        return tok.decode(body), out.finish_reason
    return run


PROMPTS = ["hello world", "abc", "The quick brown fox", "zz", "jeagle serves text", "0123456789"]


def test_openai_client_completions_and_chat(server, parts, reference):
    from openai import OpenAI

    url, _ = server
    tok = parts[2]
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [MODEL]
    want, finish = reference(tok.encode(PROMPTS[0]), 20)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == finish
    assert r.usage.prompt_tokens == len(tok.encode(PROMPTS[0])) and r.usage.completion_tokens >= 1
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0, stream=True))
    assert streamed == want

    messages = [{"role": "user", "content": PROMPTS[2]}]
    want, finish = reference(tok.encode_chat(messages), 24)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == finish


def test_model_names_sglang_clients_send(server):
    """SGLang's conventional `default`, the served name and the target's path are all this model; any
    other name is a 400 that names the field."""
    url, _ = server
    with httpx.Client(base_url=url, timeout=60) as c:
        for name in ("default", MODEL, "/models/" + MODEL):
            r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0, "model": name})
            assert r.status_code == 200, (name, r.text)
            assert r.json()["model"] == MODEL
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                 "model": "default"})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "model": "Default"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_httpx_raw_stream_and_stop_strings(server, parts, reference):
    url, _ = server
    tok = parts[2]
    want, _ = reference(tok.encode(PROMPTS[4]), 30)
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPTS[4], "max_tokens": 30, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        lines = []
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[4], "max_tokens": 30, "temperature": 0,
                                                        "stream": True}) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1]) == want
        if len(want) >= 6:  # a stop string from the middle of the greedy text cuts it there
            stop = want[3:5]
            r = c.post("/v1/completions", json={"prompt": PROMPTS[4], "max_tokens": 30, "temperature": 0,
                                                "stop": [stop]})
            choice = r.json()["choices"][0]
            assert choice["text"] == want[: want.index(stop)] and choice["finish_reason"] == "stop"


def test_32_concurrent_requests_equal_each_alone(server, parts, reference):
    url, _ = server
    tok = parts[2]
    rng = np.random.default_rng(0)
    jobs = [(PROMPTS[i % len(PROMPTS)] * int(rng.integers(1, 4)), int(rng.integers(4, 40))) for i in range(32)]

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            rs = await asyncio.gather(*[c.post("/v1/completions", json={"prompt": p, "max_tokens": m, "temperature": 0})
                                        for p, m in jobs])
        return [r.json()["choices"][0]["text"] for r in rs]

    got = asyncio.run(go())
    assert got == [reference(tok.encode(p), m)[0] for p, m in jobs]


def test_api_key(parts):
    app, engine = make_app(parts, api_key="s3cret", batch=2)
    srv, thread, url = start_server(app)
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            body = {"prompt": "abc", "max_tokens": 4, "temperature": 0}
            assert c.post("/v1/completions", json=body).status_code == 401
            r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert c.get("/v1/models").status_code == 401 and c.get("/server_info").status_code == 401
            assert c.get("/health").status_code == 200
            assert engine._next_index == 0  # nothing was generated
            r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200 and engine._next_index == 1
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


def test_aborted_stream_frees_its_slots(server):
    url, engine = server
    def unused(info):  # free, or held only by cached prefixes nobody uses
        return info["kv_slots_free"] + info["prefix_cache_evictable_slots"]

    idle = unused(httpx.get(f"{url}/server_info").json())
    with httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 100, "temperature": 0,
                                                       "ignore_eos": True, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    break  # the first chunk, then hang up
        deadline = time.time() + 30
        while True:
            info = c.get("/server_info").json()
            if unused(info) == idle and info["running_requests"] == 0:
                break
            assert time.time() < deadline, info
            time.sleep(0.1)
        assert info["speculative_tier"] == [3, 2, 5] and info["queued_requests"] == 0
        assert info["bucket_shrink_ratio"] == 2.0  # the default bucket rule, reported


@pytest.mark.parametrize("body,param", [
    ("{not json", None),
    ({"prompt": "abc", "max_tokens": 4, "frequency_penality": 1}, "frequency_penality"),
    ({"prompt": "abc", "temperature": 3.0}, "temperature"),
    ({"prompt": "abc", "top_p": 0}, "top_p"),
    ({"prompt": "abc", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "abc", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "abc", "n": 0}, "n"),
    ({"prompt": "abc", "n": 17}, "n"),
    ({"prompt": "abc", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "abc", "logprobs": 21}, "logprobs"),
    ({"prompt": "abc", "logprobs": -1}, "logprobs"),
    ({"prompt": "abc", "logprobs": True}, "logprobs"),
    ({"prompt": "abc", "echo": "yes"}, "echo"),
    ({"prompt": "abc", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x" * 200}, "prompt"),  # longer than the context (128)
    ({"prompt": "abc", "max_tokens": 500}, "max_tokens"),  # beyond the context
    ({"prompt": [5, 6, 1000]}, "prompt"),  # a token id outside the vocabulary
    ({"prompt": 5}, "prompt"),
    ({"prompt": "abc", "model": "gpt-4"}, "model"),
])
def test_bad_input_is_400_and_the_server_keeps_serving(server, body, param):
    url, _ = server
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", content=body if isinstance(body, str) else json.dumps(body),
                   headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param
        r = c.post("/v1/chat/completions", json={"messages": "hi"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0}).status_code == 200


def test_a_handler_behind_the_engine_gets_one_piece_for_its_queued_steps():
    """Steps' token events queued before the handler reads them become one piece (one event on the
    wire); a stop string inside them still cuts there and aborts; done and errors keep their order."""
    import asyncio
    from types import SimpleNamespace

    from jeagle.serve.app import pieces
    from jeagle.serve.engine_loop import Job

    tok = char_tokenizer()
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731

    async def run(events, stops=()):
        aborted = []
        s = SimpleNamespace(tokenizer=tok, loop=SimpleNamespace(abort=aborted.append,
                                                                facts=SimpleNamespace(eos_token_ids=(3,))))
        job = Job([], SamplingParams(max_new_tokens=64), asyncio.get_running_loop())
        for e in events:
            job.events.put_nowait(e)
        out = []
        try:
            async for p in pieces(s, job, list(stops)):
                out.append((p.text, p.finish, p.n_tokens))
        except RuntimeError as e:
            out.append(str(e))
        return out, len(aborted)

    steps = [("tokens", (ids("Hello"), None, {"cached_tokens": 0, "prompt_logprobs": None})),
             ("tokens", (ids(", wor"), None, None)), ("tokens", (ids("ld"), None, None))]
    assert asyncio.run(run(steps + [("done", "length")])) == ([("Hello, world", None, 12), ("", "length", 12)], 0)
    assert asyncio.run(run(steps + [("done", "length")], stops=["o, w"])) == ([("Hell", "stop", 8)], 1)
    assert asyncio.run(run(steps[:2] + [("error", "engine failure: x")])) == (
        [("Hello, wor", None, 10), "engine failure: x"], 0)


def tiny_engine_build(batch: int = 8, checkpoint: str | None = None):
    """EngineProcess's build for the tests: the `parts` engine of `make_app`, made again in the engine
    process (the models are seeded, so the same weights); a checkpoint path fails as a missing one would."""
    if checkpoint is not None:
        from jeagle.loading.checkpoint import load_model

        load_model(checkpoint)
    target = bigram_target(target_config())
    head = signed_identity_head(target, +1.0, noise=0.08)
    engine = speculative(target, head, EngineConfig(max_batch_size=batch, max_context=128), SpecConfig(3, 2, 5))
    return engine, char_tokenizer(), {"built": "tiny"}


def test_the_engine_in_its_own_process_serves_what_the_thread_serves(server, parts, reference):
    """`EngineProcess`: the same tokens (greedy, streamed and whole), logprobs, a regex grammar, the
    engine's rejections as 400s, counters in /server_info, /flush_cache; stop ends the process."""
    from openai import OpenAI

    from jeagle.serve import create_app
    from jeagle.serve.engine_process import EngineFailed, EngineProcess

    tok = parts[2]
    link = EngineProcess(tiny_engine_build)
    assert link.extra == {"built": "tiny"} and link.facts.eos_token_ids == (3,)
    srv, thread, url = start_server(create_app(link, tok, MODEL))
    try:
        client, here = OpenAI(base_url=f"{url}/v1", api_key="unused"), OpenAI(base_url=f"{server[0]}/v1",
                                                                               api_key="unused")
        for prompt in PROMPTS[:3]:
            want, finish = reference(tok.encode(prompt), 20)
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
            assert (r.choices[0].text, r.choices[0].finish_reason) == (want, finish)
            assert "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True)) == want
        messages = [{"role": "user", "content": PROMPTS[2]}]
        kw = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
                  extra_body={"ignore_eos": True})
        a, b = client.chat.completions.create(**kw).choices[0], here.chat.completions.create(**kw).choices[0]
        assert a.message.content == b.message.content
        np.testing.assert_allclose([c.logprob for c in a.logprobs.content], [c.logprob for c in b.logprobs.content],
                                   atol=1e-5)
        assert [[t.token for t in c.top_logprobs] for c in a.logprobs.content] == [
            [t.token for t in c.top_logprobs] for c in b.logprobs.content]
        r = client.completions.create(model=MODEL, prompt="ab", max_tokens=8, temperature=0,
                                      extra_body={"regex": "[0-9]{3}x"})
        assert re.fullmatch("[0-9]{3}x", r.choices[0].text), r.choices[0].text
        with httpx.Client(base_url=url, timeout=60) as c:
            bad = c.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 200, "max_tokens": 4})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
            deadline = time.time() + 10  # the counters come after the last answer (a message of their own)
            while (info := c.get("/server_info").json())["running_requests"] and time.time() < deadline:
                time.sleep(0.05)
            assert info["running_requests"] == 0 and info["prefix_cache_slots"] > 0
            assert info["kv_slots_free"] + info["prefix_cache_slots"] == info["kv_slots_total"]
            assert info["speculative"] is True and info["compilations"] > 0
            assert info["warmup_s"] is None and info["compilations_after_warmup"] is None  # this build's: none
            assert info["internal_states"][0]["avg_spec_accept_length"] == info["avg_spec_accept_length"] > 1
            # The engine's process froze its start-up heap (the counting itself: tests/test_gc_clock.py).
            tot = info["host_totals"]
            assert tot["gc_frozen"] > 10_000 and {"gc_collections", "gc_full_collections", "gc_s"} <= set(tot)
            assert c.post("/flush_cache").status_code == 200
            deadline = time.time() + 10  # the counters come back after the engine process applied it
            while c.get("/server_info").json()["prefix_cache_slots"] and time.time() < deadline:
                time.sleep(0.05)
            info = c.get("/server_info").json()
            assert info["prefix_cache_slots"] == 0 and info["kv_slots_free"] == info["kv_slots_total"]
            assert c.get("/health").status_code == 200
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
    assert not link.is_alive()  # the server's shutdown stopped it

    with pytest.raises(EngineFailed, match="no-such-model"):  # the child's error, not a hang
        EngineProcess(tiny_engine_build, (8, "/no-such-model"))


def idle_info(c: httpx.Client, until=lambda info: True, timeout: float = 30) -> dict:
    """/server_info once nothing runs and `until(info)` holds (the counters follow the answers)."""
    deadline = time.time() + timeout
    while True:
        info = c.get("/server_info").json()
        if info["running_requests"] == 0 and until(info):
            return info
        assert time.time() < deadline, info
        time.sleep(0.05)


def test_server_info_has_sglangs_internal_states(parts):
    """SGLang's `internal_states`, one per scheduler (its bench_serving reads `internal_states[0]
    ["avg_spec_accept_length"]`): the accept length on SGLang's scale, tokens per request and round with the
    bonus token, once a round ran (before, left out, as SGLang does); the top-level figure is the same."""
    app, engine = make_app(parts)
    srv, thread, url = start_server(app)
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.get("/server_info").json()["internal_states"] == [{"last_gen_throughput": 0.0}]
            r = c.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0,
                                                "ignore_eos": True})
            assert r.status_code == 200, r.text
            info = idle_info(c, lambda i: "avg_spec_accept_length" in i["internal_states"][0])
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
    (state,) = info["internal_states"]
    # The engine's stats count the same rounds apart, from its histogram of tokens per request-round.
    rounds = engine.stats([]).speculative
    assert 0 < rounds.rounds < 512 and rounds.accept_length > 1
    assert state["avg_spec_accept_length"] == pytest.approx(rounds.accept_length)
    assert state["avg_spec_accept_length"] == info["avg_spec_accept_length"]
    assert state["last_gen_throughput"] > 0


def wait_until_healthy(url: str, proc, stderr, timeout: float = 300) -> None:
    """Poll `url`/health until it answers 200; fails with the server's stderr (`stderr()`) if its process ends."""
    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None, stderr()[-2000:]
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "server did not come up"
        time.sleep(0.2)


def test_the_server_warms_up_by_default(tiny_target_dir, tmp_path):
    """`python -m jeagle.serve` with its defaults (the engine in a process of its own) warms up before it
    serves and says so on stderr; requests of the warmed sizes (greedy, sampled, after a prefix-cache hit)
    compile nothing after it: JAX's count, read in the engine's process, reaches /server_info. Target-only:
    no accept length in `internal_states`."""
    import subprocess
    import sys

    port = free_port()
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "jeagle.serve", "--target", str(tiny_target_dir),
                                 "--speculative-algorithm", "none", "--batch-size", "1", "--max-context", "64",
                                 "--compile-cache-dir", str(tmp_path / "xla"), "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, proc, lambda: log.read_text())
        with httpx.Client(base_url=url, timeout=120) as c:
            warmed = idle_info(c)
            assert warmed["warmup_s"] > 0 and warmed["compilations_after_warmup"] == 0
            for body in ({"prompt": "The quick brown fox jumps", "max_tokens": 8, "temperature": 0},
                         {"prompt": "The quick brown fox jumps over the dog", "max_tokens": 12,  # a cached prefix
                          "temperature": 0},
                         {"prompt": "abc", "max_tokens": 6, "temperature": 0.8, "seed": 1}):
                r = c.post("/v1/completions", json=body | {"ignore_eos": True})
                assert r.status_code == 200, r.text
            info = idle_info(c)
        assert info["cached_tokens_total"] > 0  # the second prompt continued the first's prefix
        assert info["compilations_after_warmup"] == 0 and info["compilations"] == warmed["compilations"]
        assert info["warmup_s"] == warmed["warmup_s"]
        assert info["internal_states"] == [{"last_gen_throughput": info["internal_states"][0]["last_gen_throughput"]}]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    line = re.search(r"\[jeagle\.serve\] warm-up: (\d+) executables in ([\d.]+) s \(no executable store\)",
                     log.read_text())
    assert line is not None, log.read_text()[-2000:]
    assert int(line[1]) == warmed["compilations"] and float(line[2]) == pytest.approx(warmed["warmup_s"], abs=0.05)


def test_gen_throughput_keeps_its_figure_over_a_stretch_without_tokens(monkeypatch):
    """`last_gen_throughput` is tokens per second over the engine's last busy stretch; a stretch that emitted
    nothing (a step that only released finished rows) leaves the last figure in place instead of 0."""
    from jeagle.serve import engine_loop

    clock = iter([1.0, 2.0, 3.0, 10.0])
    monkeypatch.setattr(engine_loop.time, "perf_counter", lambda: next(clock))
    g = engine_loop.GenThroughput(steps=40)
    g.stepped(0.0, 10, busy=True)   # 1 s, 10 tokens
    g.stepped(1.0, 10, busy=False)  # the stretch ends: 20 tokens in 2 s
    assert g.value == pytest.approx(10.0)
    g.stepped(2.5, 0, busy=False)   # a release-only step
    assert g.value == pytest.approx(10.0)
    g.stepped(9.0, 4, busy=False)   # 4 tokens in 1 s
    assert g.value == pytest.approx(4.0)


def test_gen_throughput_is_in_place_once_no_request_is_in_flight(parts):
    """The info the loop publishes once the last request finished already holds that stretch's figure, also
    when the engine still has a step left (an overlapped round to drain): a client that waits for
    `running_requests == 0` and reads `last_gen_throughput` never sees the 0 of an unclosed stretch."""
    from jeagle.serve.engine_loop import EngineLoop, Job

    target, head, tok = parts
    engine = speculative(target, head, EngineConfig(max_batch_size=8, max_context=128), SpecConfig(3, 2, 5))
    delivered: list = []
    link = EngineLoop(engine, deliver=delivered.extend)  # driven pass by pass here, no thread
    job = Job(tok.encode(PROMPTS[2]), SamplingParams(max_new_tokens=24, ignore_eos=True), loop=None)
    link.submit(job)
    left_over = False
    while not any(event[0] == "done" for _, event in delivered):
        assert link.iterate()
        info = link.info()
        if info["running_requests"] == 0 and any(event[0] == "tokens" for _, event in delivered):
            left_over |= engine.has_work
            assert info["internal_states"][0]["last_gen_throughput"] > 0, info
    assert job.request.done and info["running_requests"] == 0
    assert info["internal_states"][0]["last_gen_throughput"] > 0
    while engine.has_work:  # the left-over steps keep the figure
        assert link.iterate()
        assert link.info()["internal_states"][0]["last_gen_throughput"] > 0
    assert left_over, "no step was left over after the last request: this test no longer covers that case"
