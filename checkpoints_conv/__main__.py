"""`python -m checkpoints_conv {hf,gguf,eagle,export-eagle} ...` — convert targets and EAGLE heads."""

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
    ea = sub.add_parser("eagle", help="PyTorch EAGLE-1/2 or EAGLE-3 head dir (pytorch_model.bin or model.safetensors)")
    ea.add_argument("src", help="head dir with config.json and weights")
    ea.add_argument("out", help="output dir")
    ea.add_argument("--target", required=True, help="the target: converted dir, Hugging Face dir or .gguf file")
    ex = sub.add_parser("export-eagle", help="write a converted head in the SGLang/vLLM PyTorch layout")
    ex.add_argument("src", help="converted jeagle draft dir")
    ex.add_argument("out", help="output dir (model.safetensors + config.json)")
    for sp in (hf, gg, ea):
        sp.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="stored weight dtype")
    for sp in (hf, gg):
        sp.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)

    from jeagle.loading.checkpoint import CheckpointError
    from jeagle.config import ConfigError

    try:
        if args.kind == "hf":
            from checkpoints_conv.hf import convert_hf

            out = convert_hf(args.src, args.out, dtype=args.dtype, progress=not args.quiet)
        elif args.kind == "gguf":
            from checkpoints_conv.gguf import convert_gguf

            out = convert_gguf(args.src, args.out, dtype=args.dtype, progress=not args.quiet)
        elif args.kind == "eagle":
            from checkpoints_conv.eagle import convert_eagle

            out = convert_eagle(args.src, args.out, target=args.target, dtype=args.dtype)
        else:
            from checkpoints_conv.eagle import export_eagle

            out = export_eagle(args.src, args.out)
    except (CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
