"""One compiled executable per step key: from memory, else from the executable store, else compiled
ahead of time (`jit(...).lower(...).compile()`); and warm-up, which does that for a whole plan in
parallel (threads, and worker processes for a cold start).

A step key is a frozen, hashable value naming everything an executable depends on besides the code
and the JAX version: the decoder's static configuration (model, draft, tier, state sizes, layer
unrolling, kernel settings) and the bucket. Keys come from the decoders (`jeagle.runtime.target`,
`jeagle.speculative.decoder`); each has

    label                 a short file-name-safe name ("prefill-b4-t64")
    kernels               the KernelSettings its trace runs under
    build(shapes)         -> StepBuild(fn, abstract args, donated argnums, out shardings)
                             (`param_step`: the params as one flat tuple of arrays, the state donated)
    compiler_options()    XLA options for its compile
    static.shapes()       the device shapes of its decoder, rebuilt from configs alone (worker processes)

`shapes` (`DeviceShapes`) is the decoder's device state as shapes: its graphdefs, abstract params
and state (with their shardings under a mesh). The live engine passes its own; a worker process
rebuilds them from the key, so workers compile from configs, never from an engine.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import jax

from jeagle.kernels.settings import use
from jeagle.runtime.store import ExecutableStore, code_fingerprint

log = logging.getLogger("jeagle.runtime")


@dataclass(frozen=True)
class StepBuild:
    fn: Callable
    args: tuple  # abstract (jax.ShapeDtypeStruct) arguments
    donate: tuple[int, ...]
    out_shardings: Any = None  # under a mesh: where the outputs live (the state stays where it was)


def param_step(fn: Callable, shapes: "DeviceShapes", inputs) -> StepBuild:
    """The StepBuild of a step `fn(params, state, inputs)` whose executable takes the params as one flat
    tuple of arrays (`FlatParams.param_leaves`) and donates the state. JAX flattens every argument on
    every call, and flattening the nnx parameter state runs Python per variable (24-31 us a call on
    a 2-core CPU for SmolLM2 + head, against ~2 us for a tuple of the same leaves;
    bench/probes/param_flatten.py): the step rebuilds the state from the leaves at trace time instead."""
    treedef = jax.tree.structure(shapes.params)

    def flat(leaves, state, inputs):
        return fn(jax.tree.unflatten(treedef, leaves), state, inputs)

    # The step's own name, which JAX gives the HLO module ("jit_round_step"): traces join on it.
    inner = fn
    while getattr(inner, "__name__", None) is None and isinstance(inner, functools.partial):
        inner = inner.func
    flat.__name__ = flat.__qualname__ = getattr(inner, "__name__", "step")
    args = (tuple(jax.tree.leaves(shapes.params)), shapes.state, inputs)
    return StepBuild(flat, args, (1,), shapes.out_shardings(flat, args))


class FlatParams:
    """For a decoder with `params`: `param_leaves`, the flat tuple its executables take (`param_step`),
    built once per params object (a decoder whose params are replaced gets the new ones' leaves)."""
    params: Any

    @property
    def param_leaves(self) -> tuple:
        cached = getattr(self, "_param_leaves", None)
        if cached is None or cached[0] is not self.params:
            cached = self._param_leaves = (self.params, tuple(jax.tree.leaves(self.params)))
        return cached[1]


@dataclass
class DeviceShapes:
    """A decoder's device state as shapes: what a step function is traced against."""
    graphdefs: tuple  # the models' nnx graphdefs (target[, draft])
    params: Any  # abstract params (jax.ShapeDtypeStruct leaves)
    state: Any  # abstract donated device state
    mesh: Any = None

    @classmethod
    def of(cls, graphdefs, params, state, mesh=None) -> "DeviceShapes":
        def abstract(x):
            if mesh is None:
                return jax.ShapeDtypeStruct(x.shape, x.dtype)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return cls(tuple(graphdefs), jax.tree.map(abstract, params), jax.tree.map(abstract, state), mesh)

    def out_shardings(self, fn, args):
        """Under a mesh: results replicated, the returned state where the donated state lives."""
        if self.mesh is None:
            return None
        from jax.sharding import NamedSharding, PartitionSpec as P

        result, _ = jax.eval_shape(fn, *args)
        replicated = NamedSharding(self.mesh, P())
        return (jax.tree.map(lambda _: replicated, result), jax.tree.map(lambda x: x.sharding, self.state))


def compiler_options(kernels, *, cublas_only: bool) -> dict:
    """XLA options for one executable (per compile, so nothing leaks into other JAX code).
    cublas_only: the speculative executables compile with XLA's Triton GEMM fusions off (cuBLAS for
    every matmul): on the H100 that halves their compile time (4-5 s instead of 8-10 s per round
    executable) and the rounds run as fast or faster (bench/HISTORY.md, "XLA options"); kept on with
    `KernelSettings.triton_gemm` (JEAGLE_TRITON_GEMM=1). Deterministic mode: cuBLAS in every executable;
    on the reference backend (its jnp form, where XLA's matmuls carry the target) also no autotuning, so
    one matmul shape gets one algorithm everywhere. On a kernel backend the target's products are
    `linear_invariant`'s and its attention `ordered_attention`'s, whose numerics no XLA option changes,
    and autotuning stays on: without it the draft's cuBLAS calls took the H100 21x the default's time
    per token at batch 16, with it 1.06x (bench/RESULTS.md, 2026-12-07). Deterministic mode on every
    backend: XLA's excess precision off, so a fusion rounds to bf16 after every op as the program says
    instead of carrying fp32 across the ops it fused; which ops fuse follows the layer loop's form, which
    differs between the decode step and the verify (the loop is cut at EAGLE-3's aux layers), and with
    excess precision on the same layer gave other bits in each (bench/probes/loop_forms.py; greedy EAGLE
    parted from target-only at batch 1 on the H100, bench/RESULTS.md 2026-12-07). Otherwise on a CPU no
    options of ours. `slice_fusion=False`: XLA's dynamic-slice fusions off (KernelSettings says why). Then the
    settings' own `xla_options` (JEAGLE_XLA_OPTIONS), which win."""
    extra = dict(kernels.xla_options)
    if kernels.deterministic:
        extra = {"xla_allow_excess_precision": False} | extra
    if jax.default_backend() != "gpu":
        return extra
    if not kernels.slice_fusion:
        extra = {"xla_gpu_enable_dynamic_slice_fusion": False} | extra
    if kernels.deterministic and kernels.resolved() == "reference":  # one cuBLAS algorithm per matmul shape
        return {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0} | extra
    if kernels.deterministic:
        return {"xla_gpu_enable_triton_gemm": False} | extra
    if not cublas_only or kernels.triton_gemm:
        return extra
    return {"xla_gpu_enable_triton_gemm": False} | extra


def lower(build: StepBuild, key, mesh=None):
    """Trace and lower one step under its kernel settings (and the context mesh, whose shard_maps
    read it)."""
    with warnings.catch_warnings(), use(key.kernels):
        # CPU backends cannot donate; the GPU path does.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        if mesh is None:
            return jax.jit(build.fn, donate_argnums=build.donate).lower(*build.args)
        with jax.set_mesh(mesh):
            return jax.jit(build.fn, donate_argnums=build.donate,
                           out_shardings=build.out_shardings).lower(*build.args)


class Executables:
    """The executables of one engine, by step key."""

    def __init__(self, shapes: DeviceShapes, *, store_dir: str | None = None, compile_workers: int | None = None,
                 compile_processes: int | None = None):
        self.shapes = shapes
        # The store is off under a mesh: a sharded executable is not worth keeping across starts yet.
        self.store = (ExecutableStore(store_dir, code_fingerprint()) if store_dir and shapes.mesh is None
                      else None)
        self.compile_workers, self.compile_processes = compile_workers, compile_processes
        self._exes: dict = {}
        self.compile_seconds = 0.0  # compiling and loading, on first use or in warm-up (start-up, not serving)
        self.warmup_seconds: float | None = None
        # Of the last warm-up's executables, those loaded that the store held when it began (None without a
        # store): what a cold warm-up's worker processes compile comes back through the store too, so
        # `loaded_from_store` alone would count a cold start's as stored.
        self.warmup_from_store: int | None = None

    @property
    def num_compiled(self) -> int:
        return len(self._exes)

    @property
    def loaded_from_store(self) -> int | None:
        return self.store.loaded if self.store is not None else None

    def add_startup_seconds(self, seconds: float) -> None:
        """Count work that belongs to start-up (timing executables after a warm-up) like compiling:
        in compile time, and in the warm-up's time once there was one."""
        self.compile_seconds += seconds
        if self.warmup_seconds is not None:
            self.warmup_seconds += seconds

    def has(self, key) -> bool:
        """Whether `key`'s executable is in memory (no load, no compile)."""
        return key in self._exes

    def build(self, key) -> StepBuild:
        return key.build(self.shapes)

    def get(self, key) -> Callable:
        """The executable for `key`: from memory, else from the store, else compiled now (and stored)."""
        exe = self._exes.get(key)
        if exe is None:
            t0 = time.perf_counter()
            build = self.build(key)
            exe = self.store.load(key, build.args) if self.store is not None else None
            if exe is None:
                exe = lower(build, key, self.shapes.mesh).compile(key.compiler_options())
                if self.store is not None:
                    self.store.save(key, build.args, exe)
            self.compile_seconds += time.perf_counter() - t0
            self._exes[key] = exe
        return exe

    def _processes(self, todo: int) -> int:
        """Worker processes for a cold warm-up of `todo` executables (0: threads only). They need the
        store to hand executables back; auto (None) uses them on a GPU for 8 or more, where the
        serial trace + lower on one thread would otherwise dominate."""
        n = self.compile_processes
        if n is None:
            n = min(8, os.cpu_count() or 1) if jax.default_backend() == "gpu" and todo >= 8 else 0
        return min(n, todo) if self.store is not None and todo else 0

    def warmup(self, keys, progress: bool = True) -> float:
        """Load or compile every key not in memory yet, with a progress bar: the stored ones load on a
        thread pool; the rest compile in worker processes (cold, with a store, on a GPU) and/or are
        traced and lowered here (Python holds the GIL) and compiled on the pool (XLA releases it).
        Returns the seconds taken (also `warmup_seconds`); all of it counts as compile time."""
        from concurrent.futures import ThreadPoolExecutor, as_completed

        from tqdm import tqdm

        keys = list(dict.fromkeys(keys))
        workers = self.compile_workers or min(16, os.cpu_count() or 1)
        t0 = time.perf_counter()
        bar = tqdm(total=len(keys), desc="warm-up", unit="exe", disable=not progress, file=sys.stderr)
        try:
            todo = [k for k in keys if k not in self._exes]
            bar.update(len(keys) - len(todo))
            builds = {k: self.build(k) for k in todo}
            store = self.store
            cold = [(k, store.path(k, builds[k].args).name) for k in todo
                    if store is not None and not store.has(k, builds[k].args)]
            processes = self._processes(len(cold))
            compiled_now, held = {k for k, _ in cold}, 0
            if processes > 1:
                bar.set_postfix_str(f"compiling {len(cold)} in {processes} processes")
                compile_in_processes(cold, store, processes)
            with ThreadPoolExecutor(max_workers=workers) as pool:
                loads = pool.map(lambda k: store.load(k, builds[k].args) if store is not None else None, todo)
                futures = {}
                for key, exe in zip(todo, list(loads)):
                    if exe is not None:
                        self._exes[key] = exe
                        held += key not in compiled_now
                        bar.update(1)
                    else:
                        lowered = lower(builds[key], key, self.shapes.mesh)
                        futures[pool.submit(lowered.compile, key.compiler_options())] = key
                for fut in as_completed(futures):
                    key = futures[fut]
                    self._exes[key] = exe = fut.result()
                    if store is not None:
                        store.save(key, builds[key].args, exe)
                    bar.update(1)
                    bar.set_postfix_str(key.label)
        finally:
            bar.close()
        self.warmup_seconds = time.perf_counter() - t0
        self.compile_seconds += self.warmup_seconds
        self.warmup_from_store = held if store is not None else None
        return self.warmup_seconds

    def preload(self, keys, prime: Callable | None = None) -> int:
        """Load from the store, on a thread pool, the executables of `keys` it holds (nothing compiles:
        the others still compile on first use) and hand each to `prime(key)` as it arrives, while the
        rest load (the decoder runs it once on padding rows: its first run on the device, done before a
        request waits on it). Counted as compile time; returns how many loaded."""
        from concurrent.futures import ThreadPoolExecutor, as_completed

        store, todo = self.store, [k for k in dict.fromkeys(keys) if k not in self._exes]
        if store is None or not todo:
            return 0
        t0 = time.perf_counter()
        builds = {k: self.build(k) for k in todo}
        stored = [k for k in todo if store.has(k, builds[k].args)]
        loaded = 0
        if stored:
            workers = min(len(stored), self.compile_workers or min(16, os.cpu_count() or 1))
            with ThreadPoolExecutor(max_workers=workers) as pool:
                futures = {pool.submit(store.load, k, builds[k].args): k for k in stored}
                for fut in as_completed(futures):
                    key, exe = futures[fut], fut.result()
                    if exe is None:  # logged by the store; compiled on first use
                        continue
                    self._exes[key] = exe
                    loaded += 1
                    if prime is not None:
                        prime(key)
        self.compile_seconds += time.perf_counter() - t0
        return loaded


def compile_in_processes(items, store, processes: int) -> float:
    """Compile `items` ((step key, store file name) pairs) in `processes` workers into `store`;
    returns the seconds taken."""
    t0 = time.perf_counter()
    shares = [items[i::processes] for i in range(processes)]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", TF_CPP_MIN_LOG_LEVEL="2")
    cache_dir = jax.config.jax_compilation_cache_dir
    if cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    procs = []
    for share in shares:
        if not share:
            continue
        proc = subprocess.Popen([sys.executable, "-m", "jeagle.runtime.warmup"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        proc.stdin.write(pickle.dumps({"items": share, "root": store.root, "fingerprint": store.fingerprint}))
        proc.stdin.close()
        procs.append(proc)
    for proc in procs:
        err = proc.stderr.read().decode(errors="replace")
        if proc.wait() != 0:
            log.warning("a warm-up worker failed (exit %s); the engine compiles its share itself:\n%s",
                        proc.returncode, err[-2000:])
    return time.perf_counter() - t0
