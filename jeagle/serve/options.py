"""The server's options (`ServeArgs`) and what loads its engine (`load`), apart from `__main__` so the
engine's own process can import them by name (`load_from_argv` is EngineProcess's build)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from jeagle.cli import build_parser, check_args, dispatch_thread, kernel_settings
from jeagle.engine import EngineSpec
from jeagle.serve.tools import PARSERS

# XLA's dynamic-slice fusions in the server's executables (`--slice-fusion`): off. Admissions, streaming and
# the round's call keep the served engine's host busy 0.8-0.9 of the wall at 16-32 clients, and without
# those fusions a round's call costs the host a fifth less: EAGLE +6-10 % tok/s at 16 and 32 clients, no
# visible change at 1 client or target-only (H100, bench/HISTORY.md, 2026-11-27). jeagle.generate keeps them:
# its batch decode is device-bound, where the slice copies cost 5-9 % (2026-11-27).
SERVER_SLICE_FUSION = False
# The executables called on a dispatch thread (`--dispatch-thread`, `EngineConfig.dispatch_thread`): on. XLA's
# host work in each call then runs beside the engine's Python (processing the last step, admission, the
# hand-over to the server): at 32 clients the engine's thread went from 0.85-0.87 of the wall busy to
# 0.64-0.73 and EAGLE served +5-22 % plain, +7-9 % json_schema, -5 to +10 % with logprobs (H200, two A/B
# cycles, bench/HISTORY.md, 2026-11-27).
SERVER_DISPATCH_THREAD = True


@dataclass(frozen=True)
class ServeArgs:
    engine: EngineSpec | None  # None: the engine runs in its own process, which parses the options itself
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # None: the target's folder name
    warmup: bool = True  # every executable compiled (or loaded from the store) before the first request
    metrics: bool = True  # Prometheus' /metrics (--disable-metrics: off)
    tool_call_parser: str = "auto"  # the format tool calls are parsed in (`jeagle.serve.tools.PARSERS`)
    node_rank: int = 0  # under --nnodes (the engine's `nnodes` > 1): this process's rank; rank 0 serves HTTP
    dist_init_addr: str | None = None  # rank 0's JAX coordinator, HOST:PORT


def parse_options(argv: list[str] | None = None):
    """The options, checked, without building anything (the server's process never touches the GPU
    when the engine runs in its own)."""
    p = build_parser("python -m jeagle.serve", prompts=False, warmup=True, nodes=True,
                     description="OpenAI-compatible server (default model: SmolLM2-135M-Instruct).")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("JEAGLE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics "
                   "(or JEAGLE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model id clients name (default: the target's name)")
    p.add_argument("--disable-metrics", action="store_true", help="serve no Prometheus /metrics (default: served)")
    p.add_argument("--tool-call-parser", choices=PARSERS, default="auto",
                   help="the format of the model's tool calls in chat answers to requests with 'tools': llama3 "
                   "(Llama 3.x JSON calls), qwen25 / hermes (<tool_call> blocks: Qwen2.5, Qwen3, Hermes), auto "
                   "(default: the one the chat template writes, none if it writes neither), none (never parsed)")
    p.add_argument("--engine-thread", action="store_true",
                   help="run the engine in a thread of the HTTP server's process (default: a process of its own, "
                   "so building responses never holds up the engine)")
    p.add_argument("--dp", type=int, default=1, metavar="N",
                   help="data parallelism: N engine replicas behind this one server, each in a process of its own "
                   "with its own --tp GPUs (replica i: the i-th group of CUDA_VISIBLE_DEVICES); a cache-aware router "
                   "sends each request to the replica most likely to hold its prompt's prefix, else the least "
                   "loaded (default 1: one engine)")
    a = p.parse_args(argv)
    check_args(p, a)
    if a.dp < 1:
        p.error(f"--dp must be >= 1, got {a.dp}")
    if a.dp > 1 and a.engine_thread:
        p.error("--dp runs each replica in a process of its own: it cannot be combined with --engine-thread")
    if a.nnodes > 1 and (a.dp > 1 or a.engine_thread):
        p.error("--nnodes > 1 runs one engine over every node's devices, in a process of its own: it cannot be "
                "combined with " + ("--dp" if a.dp > 1 else "--engine-thread"))
    return a


def parse_args(argv: list[str] | None = None, join: bool = False) -> ServeArgs:
    """The options as `ServeArgs`. join: under --nnodes > 1 join the distributed runtime first (in the
    engine's process: before anything asks JAX for its devices, the engine options' dtype "auto" included;
    the devices listed are then every process's)."""
    a = parse_options(argv)
    if join and a.nnodes > 1:
        from jeagle.parallel.distributed import initialize

        initialize(a.nnodes, a.node_rank, a.dist_init_addr)
    return ServeArgs(EngineSpec.from_namespace(a, kernels=kernel_settings(a, slice_fusion=SERVER_SLICE_FUSION),
                                               dispatch_thread=dispatch_thread(a, default=SERVER_DISPATCH_THREAD)),
                     host=a.host, port=a.port,
                     api_key=a.api_key, served_model_name=a.served_model_name, warmup=a.warmup,
                     metrics=not a.disable_metrics, tool_call_parser=a.tool_call_parser, node_rank=a.node_rank,
                     dist_init_addr=a.dist_init_addr)


def load(args: ServeArgs):
    """The engine, its tokenizer and what the server says of it: (engine, tokenizer, facts dict).
    Raises the user errors of a bad target, draft or configuration (jeagle.errors.USER_ERRORS)."""
    from jeagle.engine import build_engine
    from jeagle.loading.fetch import resolve_target
    from jeagle.loading.tokenizer import Tokenizer

    spec = args.engine
    spec.adaptive()  # a bad adaptive config fails before anything loads
    target_dir = resolve_target(spec.target, dtype=spec.dtype, quiet=False)
    tokenizer = Tokenizer.from_dir(target_dir)
    engine, load_s = build_engine(spec, target_dir)
    warmup = None
    if args.warmup:  # the store's executables load, the rest compile (`Executables.warmup`)
        seconds = engine.warmup(progress=True, prefix=(False, True))  # prefills after a prefix-cache hit too
        warmup = {"s": seconds, "executables": engine.num_compiled, "from_store": engine.executables.warmup_from_store}
    aliases = (spec.target, str(target_dir)) if spec.target else (str(target_dir),)
    return engine, tokenizer, {"name": args.served_model_name or target_dir.name, "dtype": spec.dtype,
                               "load_s": load_s, "aliases": aliases, "target_dir": str(target_dir), "warmup": warmup,
                               "nnodes": spec.nnodes}


def warmup_line(warmup: dict | None) -> str | None:
    """The start-up line on the warm-up (`load`'s facts["warmup"]), None without one."""
    if warmup is None:
        return None
    store = "no executable store" if warmup["from_store"] is None else f"{warmup['from_store']} from the store"
    return f"[jeagle.serve] warm-up: {warmup['executables']} executables in {warmup['s']:.1f} s ({store})"


def load_from_argv(argv: list[str]):
    """`load` in the engine's process (EngineProcess's build): the options parsed there; a user error
    is printed as the CLI prints it (one line) and raised as EngineFailed."""
    from jeagle.errors import USER_ERRORS, report
    from jeagle.serve.engine_process import EngineFailed

    try:
        return load(parse_args(argv, join=True))
    except USER_ERRORS as e:
        report(e)
        raise EngineFailed(str(e)) from None
