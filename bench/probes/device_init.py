"""How long a process takes to bring its GPU up, by JAX allocator setting (the second start):
`import jax`, the backend's initialisation (`jax.devices()`), the first buffer (the allocator's first
allocation: with preallocation, most of the GPU's memory) and a 256 MiB buffer after it, each in a
fresh process per setting.

    python bench/probes/device_init.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import time
t0 = time.perf_counter()
import jax, numpy as np
t1 = time.perf_counter()
d = jax.devices()[0]
t2 = time.perf_counter()
jax.block_until_ready(jax.device_put(np.zeros((), np.float32), d))
t3 = time.perf_counter()
jax.block_until_ready(jax.device_put(np.zeros((64 << 20,), np.float32), d))
t4 = time.perf_counter()
stats = d.memory_stats() or {}
print(json.dumps({"import_jax_s": round(t1 - t0, 3), "backend_init_s": round(t2 - t1, 3),
                  "first_buffer_s": round(t3 - t2, 3), "buffer_256mib_s": round(t4 - t3, 3),
                  "bytes_limit_gib": round(stats.get("bytes_limit", 0) / 2**30, 1), "device": d.device_kind}))
"""

SETTINGS = {
    "default (preallocate 75%)": {},
    "XLA_PYTHON_CLIENT_PREALLOCATE=false": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "XLA_PYTHON_CLIENT_MEM_FRACTION=0.1": {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1"},
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    for name, env in SETTINGS.items():
        for i in range(args.repeats):
            base = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT_")}
            out = subprocess.run([sys.executable, "-c", "import json\n" + CHILD], env=base | env,
                                 capture_output=True, text=True)
            row = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-300:]}
            print(json.dumps({"setting": name, "run": i} | row), flush=True)


if __name__ == "__main__":
    main()
