"""`python -m jeagle.serve` (and the `jeagle-serve` script): arguments → `ServeArgs` → the library."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from jeagle.cli import build_parser, check_args
from jeagle.engine import EngineSpec


@dataclass(frozen=True)
class ServeArgs:
    engine: EngineSpec
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # None: the target's folder name
    warmup: bool = False


def parse_args(argv: list[str] | None = None) -> ServeArgs:
    p = build_parser("python -m jeagle.serve", prompts=False,
                     description="OpenAI-compatible server (default model: SmolLM2-135M-Instruct).")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("JEAGLE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (or JEAGLE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model id clients name (default: the target's name)")
    a = p.parse_args(argv)
    check_args(p, a)
    from jeagle.kernels.settings import KernelSettings

    return ServeArgs(EngineSpec.from_namespace(a, kernels=KernelSettings.from_env()), host=a.host, port=a.port,
                     api_key=a.api_key, served_model_name=a.served_model_name, warmup=a.warmup)


def serve(args: ServeArgs) -> int:
    """Load the engine, then serve until interrupted."""
    import uvicorn

    from jeagle.engine import build_engine
    from jeagle.errors import USER_ERRORS, report
    from jeagle.fetch import resolve_target
    from jeagle.serve.app import create_app
    from jeagle.tokenizer import Tokenizer

    spec = args.engine
    try:
        spec.adaptive()  # a bad adaptive config fails before anything loads
        target_dir = resolve_target(spec.target, dtype=spec.dtype, quiet=False)
        tokenizer = Tokenizer.from_dir(target_dir)
        engine, load_s = build_engine(spec, target_dir)
    except USER_ERRORS as e:
        return report(e)
    if args.warmup:
        engine.warmup(progress=True, prefix=(False, True))  # prefills after a prefix-cache hit too
    name = args.served_model_name or target_dir.name
    print(f"[jeagle.serve] {name} ({spec.dtype}) loaded in {load_s:.1f} s; serving on http://{args.host}:{args.port}", file=sys.stderr)
    aliases = (spec.target, str(target_dir)) if spec.target else (str(target_dir),)
    uvicorn.run(create_app(engine, tokenizer, name, args.api_key, aliases), host=args.host, port=args.port, log_level="warning")
    return 0


def main(argv: list[str] | None = None) -> int:
    return serve(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
