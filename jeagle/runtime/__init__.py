"""The host side of decoding: a scheduler (`scheduler.Engine`) driving a decoder.

    kv_cache.py     the device KV layout: slot pools, `req_to_token`, `assign_rows`
    config.py       EngineConfig: the engine's options (frozen)
    requests.py     Request / Output and the checks a request passes before it is queued
    slots.py        the KV slot pool and request rows, and how one request's slots are laid out
    buckets.py      the padded batch / length buckets: planning a padded batch and trimming it
    executables.py  one compiled executable per step key: in memory, from the store, or compiled
    store.py        compiled executables on disk and JAX's persistent compilation cache
    warmup.py       compiling a warm-up plan in worker processes
    startup.py      the devices brought up on a thread while a start imports (jeagle.generate)
    verify_done.py  the wait on a speculative round's verify results
    stats.py        what a generate() call reports
    gc_clock.py     the garbage collector timed, and frozen for a serving process
    target.py       the target-only decoder; its pure step functions are in steps.py
    scheduler.py    the Engine: queue, admission, continuous batching, overlap, readback, stats

The speculative decoder lives in `jeagle.speculative.decoder`; `jeagle.engine` builds engines.
"""
