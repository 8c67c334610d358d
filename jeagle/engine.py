"""The library API: build an engine, run it.

    from jeagle.engine import EngineConfig, target_only, speculative
    engine = speculative(model, draft, EngineConfig(max_batch_size=8), SpecConfig(5, 4, 8))
    outputs = engine.generate(prompt_ids, SamplingParams(max_new_tokens=64))
    engine.last_stats.tokens_per_second

`build_engine(EngineSpec(...), target_dir)` does the same from the command-line options (loading the
target and the draft, the compilation cache, the defaults): what `jeagle.generate`, `jeagle.serve`
and the benchmarks use. An engine is the scheduler (`jeagle.runtime.scheduler.Engine`) driving a
target-only decoder (`jeagle.runtime.target`) or a speculative one (`jeagle.speculative.decoder`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from jeagle.speculative.adaptive import AdaptiveConfig
from jeagle.kernels.settings import KernelSettings
from jeagle.runtime.config import EngineConfig
from jeagle.runtime.requests import Output, PromptTooLong, Request
from jeagle.runtime.scheduler import Engine
from jeagle.runtime.slots import OutOfSlots
from jeagle.runtime.stats import SpecStats, Stats
from jeagle.speculative.round import SpecConfig

__all__ = ["Engine", "EngineConfig", "EngineSpec", "OutOfSlots", "Output", "PromptTooLong", "Request", "SpecConfig",
           "SpecStats", "Stats", "build_engine", "speculative", "target_only"]


def _mesh(config: EngineConfig):
    if config.tp == 1:
        return None
    from jeagle.parallel.sharding import make_mesh

    return make_mesh(config.tp)


def target_only(model, config: EngineConfig = EngineConfig()) -> Engine:
    """An engine decoding with the target alone."""
    from jeagle.runtime.target import TargetDecoder

    return Engine(TargetDecoder(model, config, mesh=_mesh(config)), config)


def speculative(model, draft, config: EngineConfig = EngineConfig(), spec: SpecConfig = SpecConfig(), *,
                adaptive: AdaptiveConfig | None = None, fused_round: bool = True,
                simulate_accept: float = 0.0) -> Engine:
    """An engine running EAGLE rounds with the draft head `draft` (spec: the (initial) tier; adaptive:
    switch between the config's tiers after each round; see `jeagle.speculative.decoder.SpecDecoder`)."""
    from jeagle.speculative.decoder import SpecDecoder

    decoder = SpecDecoder(model, draft, config, spec, adaptive=adaptive, fused_round=fused_round,
                          simulate_accept=simulate_accept, mesh=_mesh(config))
    return Engine(decoder, config)


@dataclass(frozen=True)
class EngineSpec:
    """An engine as the command-line options describe it (the same names as the options)."""
    target: str | None = None  # converted dir, Hugging Face dir or .gguf; None: SmolLM2-135M-Instruct
    dtype: str = "auto"  # "auto" resolves on construction (config.auto_dtype); dtype_auto records that it did
    batch_size: int | None = None  # max running requests; None: the prompts' count, at most 48 (draft) / 16
    max_context: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    decode_steps: int = 1
    unroll_layers: bool = False
    layer_unroll: int | None = None
    draft: str | None = None
    speculative_algorithm: str | None = None  # "EAGLE" | "EAGLE3" | "none" | None (from the head)
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_accept_threshold_single: float = 1.0
    speculative_accept_threshold_acc: float = 1.0
    speculative_adaptive: bool = False
    speculative_adaptive_config: str | None = None
    buckets: tuple[int, ...] | None = None
    max_bucket: int | None = None
    disable_padding: bool = False
    overlap: bool = True
    disable_prefix_cache: bool = False
    schedule_conservativeness: float = 1.0
    admission_delay: float = EngineConfig.admission_delay
    admission_max_wait_steps: int = EngineConfig.admission_max_wait_steps
    bucket_shrink_ratio: float = EngineConfig.bucket_shrink_ratio
    verify_done_wait: str | None = None
    rounds_per_dispatch: int = 1
    rounds_loop: str = "unrolled"  # "unrolled" | "while" (EngineConfig.unroll_rounds)
    dispatch_thread: bool = False
    compile_cache_dir: str | None = None
    no_compile_cache: bool = False
    compile_workers: int | None = None
    tp: int = 1
    tp_vocab: str = "shard"
    tp_draft: str = "auto"
    deterministic: bool = False  # batch-invariant target forward (KernelSettings.deterministic)
    nnodes: int = 1  # processes in the tp mesh (jeagle/parallel/distributed.py): > 1 sets the timing-free settings
    quiet: bool = False  # no progress lines while fetching or converting
    kernels: KernelSettings = field(default_factory=KernelSettings)
    dtype_auto: bool = field(default=False, init=False)

    def __post_init__(self):
        from jeagle.config import DTYPE_CHOICES, ConfigError, auto_dtype

        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"dtype {self.dtype!r} not in {DTYPE_CHOICES}")
        if self.deterministic:
            if self.tp != 1:
                raise ConfigError("--deterministic runs on one device: drop --tp")
            object.__setattr__(self, "kernels", dataclasses.replace(self.kernels, deterministic=True))
        if self.nnodes > 1:  # every process must decide the same: no decision may read the wall clock
            from jeagle.parallel.distributed import TIMING_FREE

            for name, value in TIMING_FREE.items():
                object.__setattr__(self, name, value)
        if self.dtype == "auto":
            import jax

            object.__setattr__(self, "dtype", auto_dtype(jax.default_backend()))
            object.__setattr__(self, "dtype_auto", True)

    def describe_dtype(self) -> str:
        """The dtype and why, for the start-up facts."""
        if not self.dtype_auto:
            return self.dtype
        import jax

        return f"{self.dtype} (auto on {jax.default_backend()}; --dtype to override)"

    @classmethod
    def from_namespace(cls, ns, **overrides) -> "EngineSpec":
        """The engine options of parsed arguments (an argparse namespace or a dataclass with the same
        names); anything else they hold is ignored."""
        values = {f.name: getattr(ns, f.name) for f in fields(cls) if f.init and hasattr(ns, f.name)}
        if isinstance(values.get("buckets"), list):
            values["buckets"] = tuple(values["buckets"])
        return cls(**(values | overrides))

    @property
    def uses_draft(self) -> bool:
        return bool(self.draft) and self.speculative_algorithm != "none"

    def adaptive(self) -> AdaptiveConfig | None:
        """The adaptive policy the options ask for, or None (read before anything loads: fails fast)."""
        if not (self.speculative_adaptive or self.speculative_adaptive_config):
            return None
        config = (AdaptiveConfig.from_json(self.speculative_adaptive_config) if self.speculative_adaptive_config
                  else AdaptiveConfig())
        if self.nnodes > 1:
            from jeagle.parallel.distributed import check_policy

            check_policy(config)
        return config

    def tier(self) -> SpecConfig:
        s, k, n = self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens
        if s is None:
            s, k, n = 5, 4, 8
        return SpecConfig(num_steps=s, topk=k, num_draft_tokens=n, threshold_single=self.speculative_accept_threshold_single,
                          threshold_acc=self.speculative_accept_threshold_acc)

    def engine_config(self, batch: int, executable_cache_dir: str | None) -> EngineConfig:
        return EngineConfig(max_batch_size=batch, max_context=self.max_context, max_total_tokens=self.max_total_tokens,
                            mem_fraction_static=self.mem_fraction_static, decode_steps=self.decode_steps,
                            unroll_layers=True if self.unroll_layers else self.layer_unroll,
                            batch_buckets=self.buckets, max_bucket=self.max_bucket,
                            disable_padding=self.disable_padding, overlap=self.overlap,
                            dispatch_thread=self.dispatch_thread,
                            prefix_cache=not self.disable_prefix_cache,
                            schedule_conservativeness=self.schedule_conservativeness,
                            admission_delay=self.admission_delay,
                            admission_max_wait_steps=self.admission_max_wait_steps,
                            bucket_shrink_ratio=self.bucket_shrink_ratio,
                            verify_done_wait=self.verify_done_wait, rounds_per_dispatch=self.rounds_per_dispatch,
                            unroll_rounds=self.rounds_loop == "unrolled",
                            executable_cache_dir=executable_cache_dir,
                            compile_workers=self.compile_workers, tp=self.tp, tp_vocab=self.tp_vocab,
                            tp_draft=self.tp_draft, kernels=self.kernels)


ALGORITHMS = {"eagle1": "EAGLE", "eagle3": "EAGLE3"}


def load_speculative_draft(spec: EngineSpec, target_dir, model):
    """The draft head for spec.draft (converted on first use), or None for target-only decoding."""
    if not spec.uses_draft:
        return None
    from jeagle.loading.checkpoint import load_draft
    from jeagle.config import ConfigError
    from jeagle.loading.fetch import resolve_draft

    draft_dir = resolve_draft(spec.draft, target_dir, dtype=spec.dtype, quiet=spec.quiet)
    head = load_draft(draft_dir, target=model.cfg, dtype=spec.dtype)
    detected = ALGORITHMS[head.cfg.kind]
    if spec.speculative_algorithm is not None and spec.speculative_algorithm != detected:
        raise ConfigError(f"--speculative-algorithm {spec.speculative_algorithm}, but {spec.draft} is an "
                          f"{detected} head")
    return head


def compile_cache(spec: EngineSpec) -> str | None:
    """Turn on JAX's persistent compilation cache (unless --no-compile-cache) and return the executable
    store's folder (GPUs only: serialized CPU executables can fail to run after loading, "Function
    wrapped_iota not found" in CI; the store is measured and tested on GPUs)."""
    if spec.no_compile_cache:
        return None
    import jax

    from jeagle.loading.fetch import cache_dir
    from jeagle.runtime.store import enable_compile_cache

    path = Path(spec.compile_cache_dir or cache_dir() / "xla")
    enable_compile_cache(path)
    return str(path / "executables") if jax.default_backend() == "gpu" else None


def build_engine(spec: EngineSpec, target_dir, n_requests: int | None = None) -> tuple[Engine, float]:
    """The engine `spec` describes: the target (and draft) loaded from `target_dir` (see
    `jeagle.loading.fetch.resolve_target`), the compilation cache set up. `n_requests`: the number of prompts,
    which bounds the default batch (None: a server's default, 48 running requests with a draft, 16
    without). Returns (engine, load seconds)."""
    from jeagle.loading.checkpoint import load_model

    adaptive = spec.adaptive()
    if spec.nnodes > 1:
        from jeagle.parallel.distributed import check_tp

        check_tp(spec.tp)
    store = compile_cache(spec)
    if store is not None and "xla_gpu_per_fusion_autotune_cache_dir" not in dict(spec.kernels.xla_options):
        # Persisted autotuning: one matmul gets the algorithm its first compilation measured in every later
        # executable and process, so a prefill with and without a draft compiles to the same kernels (XLA's
        # own advice for deterministic compilation, docs/determinism.md), and a cold start autotunes less.
        opts = dict(spec.kernels.xla_options) | {"xla_gpu_per_fusion_autotune_cache_dir":
                                                 str(Path(store).parent / "autotune")}
        spec = dataclasses.replace(spec, kernels=dataclasses.replace(spec.kernels, xla_options=opts))
    t_load = time.perf_counter()
    model = load_model(target_dir, dtype=spec.dtype)
    draft = load_speculative_draft(spec, target_dir, model)
    default_batch = 48 if draft is not None else 16
    batch = spec.batch_size or (default_batch if n_requests is None else min(n_requests, default_batch))
    config = spec.engine_config(batch, store)
    if draft is None:
        engine = target_only(model, config)
    else:
        engine = speculative(model, draft, config, spec.tier(), adaptive=adaptive)
    if spec.nnodes > 1:  # requests without a seed draw theirs alike on every process (rank 0's seed)
        import numpy as np

        from jeagle.parallel.distributed import shared_seed

        engine.decoder.rng = np.random.default_rng(shared_seed())
    return engine, time.perf_counter() - t_load
