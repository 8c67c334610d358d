"""EngineConfig: every option of an engine, a frozen value (the scheduler's and the decoders')."""

from __future__ import annotations

from dataclasses import dataclass, field

from jeagle.kernels.settings import KernelSettings


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 16  # rows = max running requests
    max_context: int | None = None  # default: the model's max_position_embeddings, capped at 8192
    max_total_tokens: int | None = None  # KV slots; default max_batch_size * (max_context + tree slots) (CPU) ...
    mem_fraction_static: float | None = None  # ... or this fraction of GPU memory
    max_prefill_tokens: int = 8192  # padded tokens per prefill call (a longer single prompt still runs)
    decode_steps: int = 1  # tokens per decode dispatch (lax.fori_loop inside one executable)
    # Speculative rounds per dispatch: one executable runs this many rounds on the device; the host
    # reads them with one copy. Output is the same for any value (tests/test_rounds_per_dispatch.py).
    rounds_per_dispatch: int = 1
    # rounds_per_dispatch > 1: the rounds written out one after another in the executable (every
    # dispatch runs all R; R x a round's compile time), or False: a lax.while_loop that stops once every
    # row has finished. On the H100 (SmolLM2, MT-bench, batch 16, R = 2) the loop ran at 0.65 of R = 1
    # and the unrolled rounds at 0.97 (bench/HISTORY.md, 2026-11-27): XLA reads a while loop's
    # predicate back to the host every iteration.
    unroll_rounds: bool = True
    # Layer loop: False (a loop), True (unrolled), k >= 2 (k layers per iteration); None: for the
    # decode and round executables 3 (halves the host's dispatch time per step for +10-30% compile
    # time, bench/HISTORY.md "dispatch"); the decode step unrolled when a layer's weights pass
    # UNROLL_ALL_BYTES (a loop slices each layer's weights by a traced index, and XLA copies the slice
    # before a Triton GEMM: 2.5x the step time of a Llama-8B shape, bench/HISTORY.md, 2026-11-23; the
    # round's GEMMs went to cuBLAS without copies there, and unrolling it measured no faster); a loop
    # for prefill, 3 per iteration for small ones on a GPU (runtime/steps.py SMALL_PREFILL_TOKENS).
    unroll_layers: bool | int | None = None
    # The same for the decode step and the round only (overrides unroll_layers there; prefills keep
    # theirs), so that a server can unroll what it calls every step without the unrolled prefills'
    # compile time. Measured served at 32 clients on the H100: 0.97x the default, 0.80x with
    # XLA's dynamic-slice fusions off (bench/HISTORY.md, 2026-11-27), so no default uses it.
    step_unroll_layers: bool | int | None = None
    batch_buckets: tuple[int, ...] | None = None  # default: SGLang's list capped at max_batch_size
    max_bucket: int | None = None  # cap the default list (the largest bucket is then max_batch_size)
    disable_padding: bool = False  # one executable per exact batch size
    overlap: bool = True  # dispatch step r+1 before the host processes step r
    # The executables' calls on a thread of their own, the host processing the last step's results
    # meanwhile (runtime/dispatch.py). Off until the GPU measures it.
    dispatch_thread: bool = False
    # Prefix caching (runtime/radix.py): a request reuses the KV of the longest cached prefix of its
    # prompt (prompts and finished requests are cached; LRU eviction when slots run short).
    prefix_cache: bool = True
    # Admission under a short pool (SGLang's --schedule-conservativeness): a request is admitted while
    # the free slots cover the prompt plus this times the expected share of every running request's
    # remaining tokens (`KVFlow._expected_room`); 0: admit whatever fits now (and retract later).
    schedule_conservativeness: float = 1.0
    # Admission in groups under a queue (runtime/admission.py): while requests run and more wait than the
    # free rows take, a free row waits until its idle batch time reaches this times one prefill call's
    # measured host time, or for at most admission_max_wait_steps steps; 0: admit at once (SGLang). 2 measured
    # best of 0 / 1 / 2 on an H200 (bench/decode.py --continuous, EAGLE at batch 16 and 48: +4.5 % and +23 %
    # over 0, bench/HISTORY.md, 2026-11-28).
    admission_delay: float = 2.0
    admission_max_wait_steps: int = 20
    # A running batch moves down to a smaller batch bucket only once its rows fill at most 1/this of its
    # bucket (then to the smallest that fits); 1: always the smallest that fits (SGLang's rule). The first
    # call of a bucket's executable after others ran re-records its XLA command buffers (+0.3-1.3 ms of host
    # time at batch 16-48 on an H200, bench/HISTORY.md, 2026-11-28), and a batch draining from 48 passes up to
    # 19 of SGLang's buckets, while a padded row costs a host-bound round little. 2 against 1 on three H200s
    # (SmolLM2, MT-bench, one engine, runs interleaved; 2026-12-01), batch 16 / 48: the throughput policy
    # +9-14 % / +4 %, the EMA policy -3 % (inside its spread) / +6.5 %, continuous batching 0-7 %, static
    # (5,4,8) and target-only unmoved. Not measured on a device-bound model, where 1 may serve better.
    bucket_shrink_ratio: float = 2.0
    # A grammar round whose rows the host all walked (greedy, no penalties) sends each tree node's allowed
    # token ids [B, N, C] to the accept instead of vocabulary bitmasks [B, N, W] (jeagle/sampling/grammar_walk.py);
    # False: always bitmasks (an A/B switch: `bench/serve.py --engine-config '{"grammar_token_ids":false}'`).
    grammar_token_ids: bool = True
    verify_done_wait: str | None = None  # "sync" | "dataflow"; None: JEAGLE_VERIFY_DONE_STREAM_WAIT, else dataflow
    min_kv_bucket: int = 128
    executable_cache_dir: str | None = None  # ExecutableStore root (store.py); None: no store
    compile_workers: int | None = None  # warm-up load/compile threads; None: min(16, CPUs)
    compile_processes: int | None = None  # warm-up worker processes (need the store); None: auto (8 on a GPU), 0: none
    min_prefill_bucket: int = 64
    tp: int = 1  # tensor parallelism: devices the target is split over (jeagle/parallel/sharding.py)
    tp_vocab: str = "shard"  # lm_head / embedding rows split over the devices, or "replicate"
    tp_draft: str = "auto"  # the draft head split like a target layer when it divides; "replicate" | "shard"
    # Kernel backend, paged-attention split, XLA options: read from the environment once, by the
    # entry points (`KernelSettings.from_env()`); part of every executable's key.
    kernels: KernelSettings = field(default_factory=KernelSettings)

    def __post_init__(self):
        from jeagle.parallel.sharding import TP_DRAFT, TP_VOCAB

        if self.tp_vocab not in TP_VOCAB or self.tp_draft not in TP_DRAFT:
            raise ValueError(f"tp_vocab must be one of {TP_VOCAB} and tp_draft one of {TP_DRAFT}; got "
                             f"{self.tp_vocab!r}, {self.tp_draft!r}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.rounds_per_dispatch < 1:
            raise ValueError(f"rounds_per_dispatch must be >= 1, got {self.rounds_per_dispatch}")
        if self.schedule_conservativeness < 0:
            raise ValueError(f"schedule_conservativeness must be >= 0, got {self.schedule_conservativeness}")
        if self.admission_delay < 0 or self.admission_max_wait_steps < 0:
            raise ValueError(f"admission_delay and admission_max_wait_steps must be >= 0, got {self.admission_delay}, "
                             f"{self.admission_max_wait_steps}")
        if not self.bucket_shrink_ratio >= 1:
            raise ValueError(f"bucket_shrink_ratio must be >= 1, got {self.bucket_shrink_ratio}")
        if self.decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {self.decode_steps}")
