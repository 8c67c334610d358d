"""Cold warm-up in worker processes.

Compiling releases the GIL, so threads compile in parallel; tracing and lowering do not, and for
SmolLM2's round they take about 0.5-0.75 s per executable on the main thread: with dozens of batch
buckets that serial part alone approaches a minute. Worker processes do all three in parallel: each
gets step keys (frozen configs), rebuilds the device shapes they imply from the configs alone
(`key.static.shapes()`: abstract weights and state, no KV pool allocated), compiles its share and
saves each executable in the engine's `ExecutableStore`; the engine then loads them all from the
store.

    python -m jeagle.runtime.warmup < payload.pickle     (started by executables.compile_in_processes)

Anything a worker fails to produce is compiled by the engine itself afterwards, so a failed worker
costs time, never correctness.
"""

from __future__ import annotations

import os
import pickle
import sys


def main() -> None:
    from jeagle.runtime.executables import lower
    from jeagle.runtime.store import ExecutableStore, enable_compile_cache

    p = pickle.loads(sys.stdin.buffer.read())
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        enable_compile_cache(os.environ["JAX_COMPILATION_CACHE_DIR"])
    store = ExecutableStore(p["root"], p["fingerprint"])
    shapes = {}
    for key, name in p["items"]:
        if key.static not in shapes:
            shapes[key.static] = key.static.shapes()
        build = key.build(shapes[key.static])
        if store.path(key, build.args).name != name:  # e.g. weights whose structure the configs do not imply
            sys.exit(f"the configs do not reproduce {name} (got {store.path(key, build.args).name}); "
                     "leaving it to the engine")
        store.save(key, build.args, lower(build, key).compile(key.compiler_options()))


if __name__ == "__main__":
    main()
