"""Where a start of `python -m jeagle.generate` goes: wall-clock phases of one process, in the order
`jeagle.generate` runs them (arguments, the device warm-up thread, imports, target, tokenizer, then
build_engine's checkpoint loads and engine, the warm start's preload, generate()).

    python bench/probes/startup.py [jeagle.generate options] PROMPT     # one start: run it twice
    python bench/probes/startup.py --json ... PROMPT                   # also the phases as one JSON line
    STARTUP_SYNC=1 python bench/probes/startup.py ...                  # + the device time of the first dispatches

Executables loaded or compiled inside generate() are timed per step key, and the host time of its first
dispatches is listed. The table (seconds) goes to stderr. Interpreter start and exit are not included:
time the whole process for those (bench/gpu_session.sh's `startup` step).
"""

from __future__ import annotations

import time

T0 = time.perf_counter()
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

PHASES: list[tuple[str, float]] = []
_last = [T0]


def mark(name: str) -> None:
    now = time.perf_counter()
    PHASES.append((name, now - _last[0]))
    _last[0] = now


def main(argv=None) -> None:
    from jeagle.generate import parse_args

    args = parse_args(argv)
    mark("parse args")
    try:  # as jeagle.generate.main does: on-demand allocation (older trees: preallocation)
        from jeagle.runtime.startup import on_demand_allocation

        on_demand_allocation()
    except ImportError:
        pass
    try:  # as jeagle.generate.main does: the devices come up on a thread (older trees: no such thread)
        from jeagle.runtime.startup import warm_devices

        warm = warm_devices()
    except ImportError:
        warm = None
    import jax

    mark("import jax")
    import flax.nnx  # noqa: F401

    mark("import flax")
    import jeagle.checkpoint
    import jeagle.engine
    from jeagle.engine import EngineSpec, build_engine
    from jeagle.errors import USER_ERRORS  # noqa: F401  (main imports it)
    from jeagle.fetch import resolve_target
    from jeagle.kernels.settings import KernelSettings
    from jeagle.runtime import executables as ex
    from jeagle.sampling import SamplingParams
    from jeagle.tokenizer import Tokenizer

    mark("import jeagle (engine, errors, fetch, tokenizer)")
    jax.devices()
    mark("backend init (jax.devices; with the thread: what is left of it)")
    spec = EngineSpec.from_namespace(args, quiet=True, kernels=KernelSettings.from_env())
    target_dir = resolve_target(args.target, dtype=spec.dtype, quiet=True)
    mark("resolve target")
    tok = Tokenizer.from_dir(target_dir)
    chat = tok.has_chat_template if args.chat is None else args.chat
    ids = [tok.encode_chat([{"role": "user", "content": t}]) if chat else tok.encode(t) for t in args.prompts]
    mark("tokenizer load + encode")

    def timed(module, name, phase):  # build_engine's parts, each a phase (the function looked up at call time)
        fn = getattr(module, name)

        def wrapper(*a, **k):
            mark(f"build_engine before {phase}")
            out = fn(*a, **k)
            if phase == "load target":
                jax.block_until_ready(nnx_state(out))
            mark(phase)
            return out
        setattr(module, name, wrapper)

    timed(jeagle.checkpoint, "load_model", "load target")
    timed(jeagle.engine, "load_speculative_draft", "load draft")
    loads: list[tuple[str, float]] = []
    get = ex.Executables.get

    def timed_get(self, key):
        fresh = key not in self._exes
        t = time.perf_counter()
        exe = get(self, key)
        if fresh:
            loads.append((key.label, time.perf_counter() - t))
        return exe

    ex.Executables.get = timed_get
    preload_parts = {"store_load_s": 0.0, "store_loads": 0, "prime_s": 0.0}
    from jeagle.runtime import store as store_mod

    store_load = store_mod.ExecutableStore.load

    def timed_store_load(self, key, args):  # on the preload's threads: the sum over threads
        t = time.perf_counter()
        try:
            return store_load(self, key, args)
        finally:
            preload_parts["store_load_s"] += time.perf_counter() - t
            preload_parts["store_loads"] += 1

    store_mod.ExecutableStore.load = timed_store_load
    engine, _ = build_engine(spec, target_dir, len(ids))
    mark("build engine (state, executables object)")
    greedy = (args.temperature == 0.0,)
    if args.warmup:
        engine.warmup_for([len(x) for x in ids], args.max_new_tokens, greedy=greedy, progress=False)
        mark("warm-up")
    elif hasattr(engine, "preload_for"):  # as jeagle.generate does (older trees have none)
        prime = engine.decoder.prime

        def timed_prime(key):
            t = time.perf_counter()
            prime(key)
            jax.block_until_ready(engine.decoder.state)
            preload_parts["prime_s"] += time.perf_counter() - t
        engine.decoder.prime = timed_prime
        engine.preload_for([len(x) for x in ids], args.max_new_tokens, greedy=greedy)
        mark("preload executables (store, parallel) + prime")
    run = type(engine.decoder)._run

    def timed_run(self, exe, inputs):  # the host's time in each of the first dispatches
        t = time.perf_counter()
        out = run(self, exe, inputs)
        if len(dispatches) < 4:
            dispatches.append(round(time.perf_counter() - t, 4))
            if sync:  # diagnosis only: the device time of the first dispatches too (serialises them)
                jax.block_until_ready((out, self.state))
                dispatches.append(("+device", round(time.perf_counter() - t, 4)))
        return out

    dispatches: list = []
    sync = os.environ.get("STARTUP_SYNC") == "1"
    type(engine.decoder)._run = timed_run
    params = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, seed=None if args.seed is None else args.seed + i,
                             stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos) for i in range(len(ids))]
    first = []
    outs = engine.generate(ids, params, on_tokens=lambda i, n: first or first.append(time.perf_counter()))
    t_gen = _last[0]
    mark("generate")
    stats = engine.last_stats
    if warm is not None:
        warm.join()
    doc = {"phases": {k: round(v, 4) for k, v in PHASES}, "total_s": round(time.perf_counter() - T0, 3),
           "executable_loads": {k: round(v, 4) for k, v in loads},
           "preload_parts": {k: round(v, 4) for k, v in preload_parts.items()},
           "first_dispatches_host_s": dispatches, "first_token_after_generate_s": round(first[0] - t_gen, 4) if first else None,
           "ttft_s": outs[0].time_to_first_token_s, "compile_s": stats.compile_s, "compilations": stats.compilations,
           "executables_from_store": stats.executables_from_store, "new_tokens": stats.new_tokens,
           "decode_wall_s": stats.wall_s, "backend": jax.default_backend()}
    for k, v in PHASES:
        print(f"{v:8.3f}  {k}", file=sys.stderr)
    for k, v in loads:
        print(f"{v:8.3f}    executable {k}", file=sys.stderr)
    print(f"         preload: {preload_parts['store_loads']} store loads {preload_parts['store_load_s']:.3f} s "
          f"(summed over threads), prime (to the device's end) {preload_parts['prime_s']:.3f} s", file=sys.stderr)
    print(f"{doc['total_s']:8.3f}  TOTAL in process (interpreter start and exit not included)\n"
          f"ttft {doc['ttft_s']}, first token {doc['first_token_after_generate_s']} s after generate() began, "
          f"first dispatches (host s) {dispatches}, compile_s {stats.compile_s:.3f}, compilations {stats.compilations}, from store {stats.executables_from_store}",
          file=sys.stderr)
    if args.json:
        print(json.dumps(doc))


def nnx_state(model):
    from flax import nnx

    return nnx.state(model)


if __name__ == "__main__":
    main()
