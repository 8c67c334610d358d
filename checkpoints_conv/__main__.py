"""`python -m checkpoints_conv {hf,gguf} SRC OUT_DIR [--dtype ...]` — convert a target checkpoint."""

from __future__ import annotations

import argparse
import sys

from jeagle.config import DTYPES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m checkpoints_conv", description=__doc__)
    sub = p.add_subparsers(dest="kind", required=True)
    hf = sub.add_parser("hf", help="Hugging Face Llama/Qwen2/Qwen3 safetensors dir")
    hf.add_argument("src", help="model dir with config.json and model.safetensors[.index.json]")
    hf.add_argument("out", help="output dir")
    gg = sub.add_parser("gguf", help="llama.cpp GGUF file")
    gg.add_argument("src", help=".gguf file")
    gg.add_argument("out", help="output dir")
    for sp in (hf, gg):
        sp.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="stored weight dtype")
        sp.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)

    from jeagle.checkpoint import CheckpointError
    from jeagle.config import ConfigError

    try:
        if args.kind == "hf":
            from checkpoints_conv.hf import convert_hf

            out = convert_hf(args.src, args.out, dtype=args.dtype, progress=not args.quiet)
        else:
            from checkpoints_conv.gguf import convert_gguf

            out = convert_gguf(args.src, args.out, dtype=args.dtype, progress=not args.quiet)
    except (CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
