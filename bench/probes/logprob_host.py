"""The engine thread's per-token host cost of logprobs (issue 24): a decoder's `unpack` of synthetic
host results, `Request.take` (the scheduler's `_deliver`) and the served token event
(`EngineLoop._tokens`), with and without logprobs. CPU only, no model: the real host code, fed
results shaped as the device returns them.

Speculative: `--width` tokens per row (W), each row accepting 1..W of them (uniform, seeded);
target-only: W = decode_steps tokens per row, all taken. Prints µs per delivered token, and one
JSON line.

    JAX_PLATFORMS=cpu python bench/probes/logprob_host.py --batch 16 48 --width 6
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from jeagle.logprobs import LOGPROB_COLUMNS  # noqa: E402
from jeagle.runtime.requests import Output, Request  # noqa: E402
from jeagle.runtime.target import TargetDecoder  # noqa: E402
from jeagle.sampling import SamplingParams  # noqa: E402
from jeagle.serve.engine_loop import EngineLoop  # noqa: E402
from jeagle.spec.decoder import SpecDecoder  # noqa: E402


def make_requests(b: int, k: int | None, max_new: int):
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True, logprobs=k)
    reqs = [Request(index=i, prompt=[1, 2, 3], params=params, eos=frozenset(), max_new=max_new,
                    out=Output(prompt_ids=[1, 2, 3], logprobs=None if k is None else []))
            for i in range(b)]
    loop = SimpleNamespace(_out=[])
    for r in reqs:
        job = SimpleNamespace(request=r, told=False)
        r.on_tokens = lambda _i, ids, j=job: EngineLoop._tokens(loop, j, ids)
    return reqs, loop


def spec_hosts(rng, b: int, w: int, lp: bool, n: int):
    """n round results [b, W + 2 (+ W·C)] (-1 padded tokens, accepted, finished, logprob blocks)."""
    out = []
    for _ in range(n):
        take = rng.integers(1, w + 1, b)
        toks = rng.integers(4, 49000, (b, w)).astype(np.int32)
        toks[np.arange(w)[None, :] >= take[:, None]] = -1
        cols = [toks, (take - 1)[:, None].astype(np.int32), np.zeros((b, 1), np.int32)]
        if lp:
            cols.append(rng.integers(-2**31, 2**31 - 1, (b, w * LOGPROB_COLUMNS)).astype(np.int32))
        out.append(np.concatenate(cols, 1))
    return out


def target_hosts(rng, b: int, w: int, lp: bool, n: int):
    out = []
    for _ in range(n):
        cols = [rng.integers(4, 49000, (b, w)).astype(np.int32)]
        if lp:
            cols.append(rng.integers(-2**31, 2**31 - 1, (b, w * LOGPROB_COLUMNS)).astype(np.int32))
        out.append(np.concatenate(cols, 1))
    return out


def run(kind: str, b: int, w: int, k: int | None, steps: int, reps: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    hosts = (spec_hosts if kind == "spec" else target_hosts)(rng, b, w, k is not None, steps)
    best = float("inf")
    for _ in range(reps):
        reqs, loop = make_requests(b, k, max_new=10 ** 9)
        if kind == "spec":
            dec = SimpleNamespace(_dispatches=deque((1, None, 0.0, False, 0) for _ in range(steps)), timed=False,
                                  last_read=None, rounds_per_dispatch=1, accept_counts=np.zeros(w + 1, np.int64),
                                  recent_accepts=deque(maxlen=512), controller=None,
                                  tiers=[SimpleNamespace(num_steps=w - 1)] * 2)
            unpack = SpecDecoder.unpack
        else:
            dec = SimpleNamespace(config=SimpleNamespace(decode_steps=w))
            unpack = TargetDecoder.unpack
        t0 = time.perf_counter()
        for host in hosts:
            for r, got in zip(reqs, unpack(dec, "step", reqs, host)):
                new = r.take(got.tokens, 0.0, got.logprobs)  # Scheduler._deliver
                if new and r.on_tokens is not None:
                    r.on_tokens(r.index, new)
        dt = time.perf_counter() - t0
        best = min(best, dt)
        tokens = sum(len(r.out.token_ids) for r in reqs)
    # What the public API then builds, once, off the hot path (RequestOutput.logprobs).
    t0 = time.perf_counter()
    if k is not None:
        n_lp = sum(len(r.out.logprobs) for r in reqs)
        assert n_lp == tokens, (n_lp, tokens)
    lazy = time.perf_counter() - t0
    return dict(kind=kind, batch=b, width=w, logprobs=k, tokens=tokens, us_per_token=1e6 * best / tokens,
                us_per_step=1e6 * best / steps, public_list_us_per_token=1e6 * lazy / tokens)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[16, 48])
    p.add_argument("--width", type=int, default=6, help="speculative: tokens per row (W)")
    p.add_argument("--target-width", type=int, default=1, help="target-only: decode_steps")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=5, help="the requests' logprobs k")
    a = p.parse_args(argv)
    rows = []
    for kind, w in (("spec", a.width), ("target", a.target_width)):
        for b in a.batch:
            for k in (None, a.top):
                row = run(kind, b, w, k, a.steps, a.reps)
                rows.append(row)
                print(f"{kind:6s} B={b:3d} W={w} logprobs={str(k):4s}: {row['us_per_token']:.3f} us/token "
                      f"({row['us_per_step']:.1f} us/step; public list {row['public_list_us_per_token']:.3f} us/token)")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
