"""What a call of an XLA executable costs the host, by how many kernels its command buffer holds.

A round executable of SmolLM2 holds ~520-630 commands in one command buffer when every layer is unrolled
(XLA's log, `gpu_session.sh run hostcall`), and its call still takes 0.4-0.8 ms of host time of which the
command buffer's update is only 40-70 us. This probe separates the parts: a chain of `--kernels` small
kernels (an elementwise op each, kept apart by optimization barriers), compiled ahead of time, called
`--calls` times with its state donated (every buffer at the same address: no update) or not (a new
output every call: one updated allocation), results read one call late as the decoder does. Prints the
host ms of the call (p50) and the wall ms per call, per kernel count.

    python bench/probes/graph_launch.py --kernels 10,100,300,600,1000
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import device_kind, git_commit  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default="10,100,300,600,1000")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--width", type=int, default=1024, help="f32 elements per kernel")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    rows = []
    for n in [int(x) for x in args.kernels.split(",")]:
        def chain(x, n=n):
            for _ in range(n):
                x = jax.lax.optimization_barrier(jnp.sin(x) * 0.5 + 0.25)
            return x, x[:8] + 0  # the state and a small "result" (a new buffer each call)

        x0 = jnp.zeros((args.width,), jnp.float32)
        for donate in (True, False):
            exe = jax.jit(chain, donate_argnums=(0,) if donate else ()).lower(x0).compile()
            x = jnp.zeros((args.width,), jnp.float32)
            for _rep in range(2):
                inflight = collections.deque()
                call_ms = []
                jax.block_until_ready(x)
                t_start = time.perf_counter()
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    x, res = exe(x)
                    call_ms.append((time.perf_counter() - t0) * 1e3)
                    res.copy_to_host_async()
                    inflight.append(res)
                    if len(inflight) > 1:
                        np.asarray(inflight.popleft())
                while inflight:
                    np.asarray(inflight.popleft())
                wall = (time.perf_counter() - t_start) * 1e3 / args.calls
                row = {"kernels": n, "donate": donate, "call_ms_p50": round(statistics.median(call_ms), 4),
                       "call_ms_p90": round(float(np.percentile(call_ms, 90)), 4),
                       "wall_ms_per_call": round(wall, 4)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(json.dumps({"bench": "graph_launch", "device": device_kind(), "commit": git_commit(), "rows": rows}))


if __name__ == "__main__":
    main()
