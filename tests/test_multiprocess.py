"""Tensor parallelism across processes (`--nnodes`, jeagle/parallel/distributed.py): two processes with
two virtual CPU devices each run `python -m jeagle.generate --tp 4` over JAX's distributed runtime (gloo
collectives), and rank 0's output equals one process at `--tp 1`, target-only and with an EAGLE head; the
same for `python -m jeagle.serve`, rank 0 serving and rank 1 following. Plus the flags' checks (no devices)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

PROMPTS = ("abc", "hello there", "zyx w")
SMALL_TIER = ("--speculative-num-steps", "2", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """A tiny random fp32 target whose heads, KV heads, MLP and vocabulary divide 4 (every layer's
    output projections live, so each one's collectives matter), an EAGLE-1 head the same, and the
    character tokenizer."""
    import numpy as np
    from flax import nnx

    from jeagle.loading.checkpoint import save_checkpoint
    from jeagle.models.eagle import random_draft
    from jeagle.models.llama import random_model
    from tests.spec_models import draft_config, target_config
    from tests.test_serve import char_tokenizer

    cfg = target_config().replace(name="tiny", num_kv_heads=4)
    out = tmp_path_factory.mktemp("mp")
    target, head = out / "target", out / "head"
    model = random_model(cfg, 5)
    save_checkpoint(target, cfg, {k: np.asarray(v) for k, v in nnx.to_pure_dict(nnx.split(model)[1]).items()})
    char_tokenizer()._fast.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "unk_token": "<unk>"}))
    dcfg = draft_config(cfg).replace(num_kv_heads=4)
    draft = random_draft(dcfg, 6)
    save_checkpoint(head, dcfg, {k: np.asarray(v) for k, v in nnx.to_pure_dict(nnx.split(draft)[1]).items()})
    return target, head


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return env | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def _args(target, extra) -> list[str]:
    return [sys.executable, "-m", "jeagle.generate", "--target", str(target), "--dtype", "float32", "--json", "--raw",
            "--ignore-eos", "--max-new-tokens", "12", "--no-compile-cache", *extra, *PROMPTS]


def run_single(target, extra) -> dict:
    proc = subprocess.run(_args(target, ["--tp", "1", *extra]), capture_output=True, text=True, env=_env(1),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def run_two_processes(target, extra) -> list[subprocess.CompletedProcess]:
    """Ranks 0 and 1, two CPU devices each, `--tp 4` over the four."""
    addr = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(_args(target, ["--tp", "4", "--nnodes", "2", "--node-rank", str(rank),
                                             "--dist-init-addr", addr, *extra]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(2))
             for rank in (0, 1)]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, proc in enumerate(done):
        assert proc.returncode == 0, f"rank {rank}: {proc.stderr[-3000:]}"
    return done


def _tokens(doc: dict) -> list:
    return [(o["prompt"], o["token_ids"], o["finish_reason"]) for o in doc["outputs"]]


@pytest.mark.parametrize("mode", ["target", pytest.param("eagle", marks=pytest.mark.slow)])  # eagle: ~60 s
def test_two_processes_tp4_equal_one_process(tiny_dirs, mode):
    target, head = tiny_dirs
    extra = ["--speculative-algorithm", "none"] if mode == "target" else ["--draft", str(head), *SMALL_TIER]
    want = run_single(target, extra)
    rank0, rank1 = run_two_processes(target, extra)
    got = json.loads(rank0.stdout)
    assert _tokens(got) == _tokens(want)
    assert all(len(o["token_ids"]) == 12 for o in got["outputs"])
    assert rank1.stdout == "" and "node rank 1 of 2" in rank1.stderr  # only rank 0 prints the output
    if mode == "eagle":
        assert got["stats"]["accept_length"] == want["stats"]["accept_length"]


SEED_SCRIPT = """
import sys
from jeagle.parallel.distributed import initialize, shared_seed, shutdown
initialize(2, int(sys.argv[1]), sys.argv[2])
import jax
print(jax.process_index(), jax.device_count(), shared_seed())
shutdown()
"""


def test_joined_processes_share_rank_0s_seed_and_a_clean_stdout():
    """Both processes see the four devices and rank 0's random seed; gloo's connection notes (printed by
    native code on stdout) go to stderr, so stdout holds only what Python prints."""
    addr = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", SEED_SCRIPT, str(rank), addr], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env(2)) for rank in (0, 1)]
    try:
        outs = [proc.communicate(timeout=300) for proc in procs]  # (2-3 s alone; CI runs beside it)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-2000:]
    (r0, n0, s0), (r1, n1, s1) = (tuple(map(int, out.split())) for out, _ in outs)
    assert (r0, r1, n0, n1) == (0, 1, 4, 4) and s0 == s1


def _parse(*argv):
    from jeagle.generate import parse_args

    return parse_args(["--target", "t", "--speculative-algorithm", "none", *argv, "hi"])


@pytest.mark.parametrize("argv, message", [
    (("--nnodes", "0"), "--nnodes must be >= 1"),
    (("--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"), "--node-rank must be in [0, 1]"),
    (("--node-rank", "-1"), "--node-rank must be in [0, 0]"),
    (("--nnodes", "2", "--node-rank", "1"), "needs --dist-init-addr"),
    (("--nnodes", "2", "--dist-init-addr", "hostonly"), "must be HOST:PORT"),
    (("--nnodes", "2", "--dist-init-addr", "h:99999"), "must be HOST:PORT"),
    (("--nnodes", "2", "--dist-init-addr", ":80"), "must be HOST:PORT"),
])
def test_node_flags_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(*argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_node_flags_defaults_and_the_timing_free_settings():
    from jeagle.engine import EngineSpec
    from jeagle.parallel.distributed import parse_addr

    a = _parse()
    assert (a.nnodes, a.node_rank, a.dist_init_addr) == (1, 0, None)
    b = _parse("--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000", "--tp", "16")
    assert (b.nnodes, b.node_rank, parse_addr(b.dist_init_addr)) == (2, 1, ("10.0.0.1", 5000))
    assert parse_addr("[::1]:29500") == ("::1", 29500)
    one = EngineSpec(tp=2, dispatch_thread=True, admission_delay=3.0)
    assert (one.admission_delay, one.dispatch_thread) == (3.0, True)  # --nnodes 1 changes nothing
    many = EngineSpec(tp=2, nnodes=2, dispatch_thread=True, admission_delay=3.0)
    assert (many.admission_delay, many.dispatch_thread) == (0.0, False)
    assert EngineSpec.from_namespace(b).nnodes == 2


def test_the_throughput_policy_is_refused_across_processes(tmp_path):
    from jeagle.config import ConfigError
    from jeagle.engine import EngineSpec

    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps({"policy": "throughput"}))
    assert EngineSpec(draft="d", speculative_adaptive_config=str(path)).adaptive().policy == "throughput"
    with pytest.raises(ConfigError, match="'ema' policy"):
        EngineSpec(draft="d", nnodes=2, speculative_adaptive_config=str(path)).adaptive()
    assert EngineSpec(draft="d", nnodes=2, speculative_adaptive=True).adaptive().policy == "ema"


def start_serve_nodes(target, extra, logs):
    """`python -m jeagle.serve` as ranks 0 and 1 (two CPU devices each, `--tp 4`); rank 0's URL."""
    addr, port = f"127.0.0.1:{free_port()}", free_port()
    procs = []
    for rank in (0, 1):
        with open(logs / f"rank{rank}.txt", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "jeagle.serve", "--target", str(target),  # dtype auto: float32 on CPU
                 "--no-compile-cache", "--batch-size", "4", "--max-context", "64", "--port", str(port),
                 "--tp", "4", "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", addr, *extra],
                stdout=subprocess.DEVNULL, stderr=err, env=_env(2)))
    return procs, f"http://127.0.0.1:{port}"


def _generate(c, text: str, **params) -> list[int]:
    r = c.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True,
                                                                     "temperature": 0} | params})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@pytest.mark.parametrize("mode", ["target", pytest.param("eagle", marks=pytest.mark.slow)])
def test_serve_across_two_processes_equals_one_process(tiny_dirs, mode, tmp_path):
    """`jeagle.serve --nnodes 2`: rank 0 serves HTTP and the other rank follows its engine pass by pass.
    Concurrent greedy requests equal `jeagle.generate --tp 1`; a sampled request without a seed (rank 0's
    seed source, shared) and a streamed request dropped midway (an abort every rank applies) leave the
    processes in step, so the same requests again give the same tokens. Target-only: when rank 0 stops, so
    does rank 1. EAGLE: rank 1 killed, rank 0's next step fails (gloo hears the lost peer at once), the
    request gets an error at once and the server reports the engine down (503s)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.test_serve import wait_until_healthy

    target, head = tiny_dirs
    extra = ["--speculative-algorithm", "none"] if mode == "target" else ["--draft", str(head), *SMALL_TIER]
    want = [ids for _, ids, _ in _tokens(run_single(target, extra))]
    # EAGLE compiles what the requests need, not the whole warm-up (the target-only case covers that)
    procs, url = start_serve_nodes(target, extra + ["--no-warmup"] * (mode == "eagle"), tmp_path)
    logs = lambda: "\n".join((tmp_path / f"rank{r}.txt").read_text()[-3000:] for r in (0, 1))  # noqa: E731
    try:
        wait_until_healthy(url, procs[0], logs, timeout=600)
        assert procs[1].poll() is None, logs()
        with httpx.Client(base_url=url, timeout=300) as c, ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(lambda p: _generate(c, p), PROMPTS)) == want
            sampled = _generate(c, PROMPTS[0], temperature=0.9, max_new_tokens=8)
            assert len(sampled) == 8
            with c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 40, "stream": True,
                                                            "temperature": 0, "ignore_eos": True}) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # then dropped: the server aborts it
            assert list(pool.map(lambda p: _generate(c, p), PROMPTS)) == want
            info = c.get("/server_info").json()
            assert info["compilations"] > 0 and info["running_requests"] == 0
            if mode == "eagle":  # a node lost: the next step fails, its request gets an error, the engine stops
                procs[1].kill()
                procs[1].wait(timeout=30)
                started = time.time()
                r = c.post("/generate", json={"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 12}})
                # its step fails (500), or a step left over from the last requests failed first (503: gone)
                assert (r.status_code, r.status_code == 500 and "engine failure" in r.text or r.status_code == 503
                        and "engine process exited" in r.text) in ((500, True), (503, True)), r.text
                assert time.time() - started < 5
                while c.get("/health").status_code != 503:  # the engine process exits; the server says so
                    assert time.time() - started < 30, logs()
                    time.sleep(0.2)
                assert c.post("/generate", json={"text": "abc"}).status_code == 503
                assert procs[0].poll() is None  # the HTTP server keeps answering
    finally:
        procs[0].terminate()
        codes = [proc.wait(timeout=120) for proc in procs]
    assert "following rank 0's engine" in logs() and "node rank 0 of 2 (the other nodes follow it)" in logs()
    if mode == "target":  # rank 0 stopped: so does rank 1, cleanly
        assert codes[1] == 0 and "rank 0 stopped after" in logs(), logs()
    else:
        assert "a step failed, so the nodes can no longer be trusted" in logs()


def test_serve_node_flags_are_checked(capsys):
    from jeagle.serve.options import parse_options

    base = ["--target", "t", "--speculative-algorithm", "none", "--nnodes", "2", "--dist-init-addr", "h:1"]
    for more, message in ((["--dp", "2"], "cannot be combined with --dp"),
                          (["--engine-thread"], "cannot be combined with --engine-thread"),
                          (["--node-rank", "2"], "--node-rank must be in [0, 1]")):
        with pytest.raises(SystemExit) as e:
            parse_options(base + more)
        assert e.value.code == 2 and message in capsys.readouterr().err
    a = parse_options(base + ["--node-rank", "1", "--tp", "4"])
    assert (a.nnodes, a.node_rank, a.dist_init_addr) == (2, 1, "h:1")
