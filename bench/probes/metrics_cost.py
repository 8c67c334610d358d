"""What /metrics costs the server per request: the time `metered` adds to a request's stream of pieces (one
piece per engine step or round) on the server's event loop, against the same stream bare, here on this host;
compare it with the server process's CPU per request that `bench/serve.py --metrics on,off` reports on the
GPU machine. The engine's own loop runs none of it (its gauges are read from `info()` at scrape time).

    python bench/probes/metrics_cost.py --pieces 256,90 --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import device_kind, emit, git_commit  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pieces", default="256,90", help="pieces per request (256: target-only at 256 tokens, one "
                   "token a piece; 90: EAGLE at ~2.8 tokens a round)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    from jeagle.serve.metrics import Metrics, metered

    class Loop:
        def info(self):
            return {}

    rows = []
    for pieces in (int(x) for x in args.pieces.split(",")):
        marks = [round(args.tokens * (i + 1) / pieces) for i in range(pieces)]
        items = [SimpleNamespace(n_tokens=n, finish="length" if i == pieces - 1 else None) for i, n in enumerate(marks)]

        @metered
        async def stream(s, job, stops):  # app.pieces' place: the stream of one choice's pieces
            for it in items:
                yield it

        async def drain(s):
            for _ in range(args.requests):
                job = SimpleNamespace(arrived=time.perf_counter(), prompt=[0] * 64, cached_tokens=0)
                async for _ in stream(s, job, None):
                    pass

        times = {}
        for label, s in (("off", SimpleNamespace(metrics=None)), ("on", SimpleNamespace(metrics=Metrics(Loop(), "m")))):
            best = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                asyncio.run(drain(s))
                best.append((time.perf_counter() - t0) / args.requests)
            times[label] = min(best)
        rows.append({"pieces": pieces, "us_per_request_off": 1e6 * times["off"], "us_per_request_on": 1e6 * times["on"],
                     "metrics_us_per_request": 1e6 * (times["on"] - times["off"])})
        print(f"{pieces} pieces a request: bare {1e6 * times['off']:.1f} us, metered {1e6 * times['on']:.1f} us: "
              f"/metrics adds {1e6 * (times['on'] - times['off']):.1f} us a request", flush=True)
    emit({"probe": "metrics_cost", "commit": git_commit(), "device": device_kind(), "rows": rows}, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
