"""Cold warm-up in worker processes.

Compiling releases the GIL, so threads compile in parallel; tracing and lowering do not, and for
SmolLM2's round they take about 0.5-0.75 s per executable on the main thread: with dozens of batch
buckets that serial part alone approaches a minute. Worker processes do all three in parallel: each
builds an *abstract* copy of the engine (the same configs, weights and device state as shapes only,
so it allocates no KV pool), compiles its share of the plan and saves each executable in the
engine's `ExecutableStore`; the engine then loads them all from the store.

    python -m jeagle.warmup_workers < payload.pickle     (started by Engine.warmup, not by hand)

Anything a worker fails to produce is compiled by the engine itself afterwards, so a failed worker
costs time, never correctness.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import time

log = logging.getLogger("jeagle.warmup")


def payload(engine, items) -> dict:
    """What a worker needs to rebuild `engine` abstractly and compile `items` (warm-up plan entries)."""
    # The worker must see the same slot count even where the engine sized its pool from free memory.
    cfg = dataclasses.replace(engine.cfg, mem_fraction_static=None, max_total_tokens=engine.allocator.num_slots - 1,
                              executable_cache_dir=engine._store.root)
    spec = getattr(engine, "base_spec", None)
    return {"model_cfg": engine.model_cfg, "cfg": cfg, "draft_cfg": getattr(engine, "draft_cfg", None), "spec": spec,
            "adaptive": getattr(engine, "adaptive", None),
            "fused_round": getattr(engine, "fused_round", True), "items": list(items),
            "root": engine._store.root, "fingerprint": engine._store.fingerprint}


def compile_in_processes(engine, items, processes: int) -> float:
    """Compile `items` ((plan entry, store file name) pairs) in `processes` workers into the engine's
    store; returns the seconds taken."""
    t0 = time.perf_counter()
    shares = [items[i::processes] for i in range(processes)]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", TF_CPP_MIN_LOG_LEVEL="2")
    import jax

    cache_dir = jax.config.jax_compilation_cache_dir
    if cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    procs = []
    for share in shares:
        if not share:
            continue
        proc = subprocess.Popen([sys.executable, "-m", "jeagle.warmup_workers"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        proc.stdin.write(pickle.dumps(payload(engine, share)))
        proc.stdin.close()
        procs.append(proc)
    for proc in procs:
        err = proc.stderr.read().decode(errors="replace")
        if proc.wait() != 0:
            log.warning("a warm-up worker failed (exit %s); the engine compiles its share itself:\n%s",
                        proc.returncode, err[-2000:])
    return time.perf_counter() - t0


def build(p: dict):
    from jeagle.models.common import abstract_module
    from jeagle.models.llama import abstract_model
    from jeagle.runtime import ExecutableStore

    model = abstract_model(p["model_cfg"])
    if p["draft_cfg"] is None:
        from jeagle.engine import Engine

        engine = Engine(model, p["cfg"], abstract=True)
    else:
        from jeagle.models.eagle import EagleHead
        from jeagle.spec.engine import SpecEngine

        engine = SpecEngine(model, abstract_module(EagleHead, p["draft_cfg"]), p["cfg"], p["spec"],
                            adaptive=p["adaptive"], fused_round=p["fused_round"], abstract=True)
    engine._store_obj = ExecutableStore(p["root"], p["fingerprint"])
    return engine


def main() -> None:
    p = pickle.loads(sys.stdin.buffer.read())
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        from jeagle.runtime import enable_compile_cache

        enable_compile_cache(os.environ["JAX_COMPILATION_CACHE_DIR"])
    engine = build(p)
    store = engine._store
    for item, name in p["items"]:
        engine._deferred = []  # the engine's own dispatch code names the executable and builds its args
        request(engine, item)
        (key, fn, args, donate), = engine._deferred
        engine._deferred = None
        if store._path(key, args).name != name:  # e.g. weights whose structure the configs do not imply
            sys.exit(f"the abstract engine does not reproduce {name} (got {store._path(key, args).name}); "
                     "leaving it to the engine")
        exe = engine._lower(key, fn, args, donate).compile(engine._compiler_options(key))
        store.save(key, args, exe)


def request(engine, item) -> None:
    """Ask `engine` for the executable of one warm-up plan entry (as `Engine.warmup` does)."""
    phase, b, size, greedy, *tier = item
    if phase == "prefill":
        engine._prefill_exe(b, size, engine._prefill_inputs([], b, size))
    else:
        engine._decode_exe(b, size, greedy, engine._decode_inputs([], b), *tier)

if __name__ == "__main__":
    main()
