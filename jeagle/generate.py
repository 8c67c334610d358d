"""`python -m jeagle.generate`: arguments → `EngineSpec` + sampling parameters → the library. Nothing else lives here."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jeagle.cli import build_parser, check_args, dispatch_thread, kernel_settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed, checked options (the engine's part becomes an `EngineSpec` in `run`); lists as tuples."""
    p = build_parser(nodes=True)
    a = p.parse_args(argv)
    if not a.prompts and not a.prompts_file:
        p.error("give prompts as arguments or --prompts-file")
    check_args(p, a)
    return argparse.Namespace(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in vars(a).items()})


def read_prompts_file(path: str) -> list[str]:
    text = Path(path).read_text()
    if path.endswith(".jsonl"):
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected a JSON object with a 'prompt' field ({e})") from e
        return out
    return [line for line in text.splitlines() if line.strip()]


def compile_grammar(args, tokenizer, model_cfg):
    """--json-schema / --regex / --ebnf as a compiled grammar (None without one); a bad one raises
    GrammarError (a ValueError: one line, exit 2)."""
    kind, source = next(((k, getattr(args, k)) for k in ("json_schema", "regex", "ebnf") if getattr(args, k, None)),
                        (None, None))
    if kind is None:
        return None
    try:
        if kind != "regex" and Path(source).is_file():
            source = Path(source).read_text()
    except OSError:  # an inline schema or grammar too long for a file name
        pass
    try:
        from jeagle.sampling.grammar import GrammarBackend

        backend = GrammarBackend(tokenizer, model_cfg.vocab_size, model_cfg.eos_token_ids[0])
    except ImportError:
        raise ValueError(f"--{kind.replace('_', '-')} needs llguidance: pip install llguidance") from None
    return backend.compile(kind, source)


def describe_decoding(spec) -> str:
    if not spec.uses_draft:
        return "target only"
    tier = spec.tier()
    return f"EAGLE draft {Path(spec.draft).name} ({tier.num_steps},{tier.topk},{tier.num_draft_tokens})" + (
        ", adaptive" if spec.speculative_adaptive or spec.speculative_adaptive_config else "")


def engine_spec(args: argparse.Namespace):
    """The engine the options describe (XLA's dynamic-slice fusions on unless `--slice-fusion off`: a
    batch decode here is device-bound, where they save 5-9 %, bench/HISTORY.md, 2026-11-27; the calls on
    the engine's thread unless `--dispatch-thread`: nothing else runs beside them here)."""
    from jeagle.engine import EngineSpec

    return EngineSpec.from_namespace(args, quiet=args.json, kernels=kernel_settings(args, slice_fusion=True),
                                     dispatch_thread=dispatch_thread(args, default=False))


def run(args: argparse.Namespace) -> dict:
    from jeagle.engine import build_engine
    from jeagle.loading.fetch import resolve_target
    from jeagle.sampling import SamplingParams
    from jeagle.loading.tokenizer import StreamDecoder, Tokenizer

    texts = list(args.prompts) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    spec = engine_spec(args)
    spec.adaptive()  # a bad adaptive config fails before anything loads
    target_dir = resolve_target(args.target, dtype=spec.dtype, quiet=args.json)
    tokenizer = Tokenizer.from_dir(target_dir)
    use_chat = tokenizer.has_chat_template if args.chat is None else args.chat
    if use_chat and not tokenizer.has_chat_template:
        raise ValueError("--chat: this tokenizer has no chat template; use --raw")
    ids = [tokenizer.encode_chat([{"role": "user", "content": t}]) if use_chat else tokenizer.encode(t)
           for t in texts]
    engine, load_s = build_engine(spec, target_dir, len(ids))
    # Under --nnodes every process runs all of this (the same steps: docs/multi-gpu.md); rank 0 prints.
    lead = getattr(args, "node_rank", 0) == 0
    grammar = compile_grammar(args, tokenizer, engine.model_cfg)
    seed = args.seed
    if seed is None and getattr(args, "nnodes", 1) > 1:
        from jeagle.parallel.distributed import shared_seed

        seed = shared_seed()  # one seed for every process: their sampling must draw the same
    params = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, seed=None if seed is None else seed + i,
                             stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
                             frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                             repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens, grammar=grammar)
              for i in range(len(ids))]
    # The executables these requests run (with logprobs, penalties or a grammar: those compiled for them).
    modes = dict(logprobs=(args.logprobs is not None,), penalties=(params[0].penalized,),
                 grammar=(grammar is not None,))
    if not args.warmup:
        for i, (x, sp) in enumerate(zip(ids, params)):
            engine.check(x, sp, i)  # a request generate() refuses is refused before the preload, as there
        # A warm start: what these prompts can dispatch loads from the executable store now, in parallel,
        # and runs once on padding rows, so the first token waits for neither (nothing compiles here).
        t0 = time.perf_counter()
        engine.preload_for([len(x) for x in ids], args.max_new_tokens, greedy=(args.temperature == 0.0,), **modes)
        load_s += time.perf_counter() - t0
    if not args.json and lead:
        print(f"[jeagle] {target_dir.name}, {spec.describe_dtype()}, {describe_decoding(spec)}, "
              f"batch {engine.max_running}, loaded in {load_s:.1f} s", file=sys.stderr)
    if args.warmup:
        # Only what these prompts can dispatch; every request shares the temperature: greedy or sampled.
        engine.warmup_for([len(x) for x in ids], args.max_new_tokens, greedy=(args.temperature == 0.0,),
                          progress=not args.json and lead, **modes)

    stream = StreamDecoder(tokenizer)

    def print_tokens(_index, new_ids):
        for t in new_ids:
            if t in engine.model_cfg.eos_token_ids or t in args.stop_token_ids:
                continue
            sys.stdout.write(stream.push(t))
        sys.stdout.flush()

    on_tokens = print_tokens if len(ids) == 1 and not args.json and lead else None  # stream one prompt's text

    outputs = engine.generate(ids, params, on_tokens=on_tokens)
    stats = engine.last_stats
    results = []
    for text, out in zip(texts, outputs):
        body = out.token_ids
        if out.finish_reason == "stop" and body:
            body = body[:-1]  # the stop token itself is not text
        results.append({"prompt": text, "text": tokenizer.decode(body), "token_ids": out.token_ids,
                        "finish_reason": out.finish_reason})
        if out.logprobs is not None:  # one entry per token id
            results[-1]["logprobs"] = [{"token": tokenizer.token_text(t), "logprob": lp.logprob,
                                        "top_logprobs": [{"id": i, "token": tokenizer.token_text(i), "logprob": p}
                                                         for i, p in lp.top(args.logprobs)]}
                                       for t, lp in zip(out.token_ids, out.logprobs)]
    ttft = [o.time_to_first_token_s for o in outputs if o.time_to_first_token_s is not None]
    # The engine's stats (accept_length: tokens per round per request, bonus included, 1.0 without a
    # draft; tier_history: the round index (from 0) each tier started at) and the run's own facts.
    doc = {"outputs": results,
           "stats": stats.to_dict() | {
               "time_to_first_token_s": sum(ttft) / len(ttft) if ttft else None,
               "tokens_per_second": stats.tokens_per_second, "load_s": load_s, "target": str(target_dir), "dtype": spec.dtype,
               "draft": args.draft if spec.uses_draft else None, "batch_size": engine.max_running}}
    if not lead:
        print(f"[jeagle] node rank {args.node_rank} of {args.nnodes}: done (rank 0 prints the output)", file=sys.stderr)
    elif args.json:
        print(json.dumps(doc))
    else:
        if on_tokens is not None:
            sys.stdout.write(stream.flush() + "\n")
        else:
            for r in results:
                print(f"=== {r['prompt']}\n{r['text']}\n")
        s = doc["stats"]
        print(f"[{s['new_tokens']} new tokens, {s['tokens_per_second']:.1f} tok/s, "
              f"TTFT {s['time_to_first_token_s']:.3f} s, compile {s['compile_s']:.1f} s]", file=sys.stderr)
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from jeagle.runtime.startup import on_demand_allocation, warm_devices

    on_demand_allocation()  # a one-shot command: no preallocation of most of the GPU's memory
    if args.nnodes > 1:  # before any device is used: the devices listed are then every process's
        from jeagle.parallel.distributed import initialize

        initialize(args.nnodes, args.node_rank, args.dist_init_addr)

    devices = warm_devices()  # the devices come up on a thread while the rest imports and the tokenizer loads
    try:
        from jeagle.errors import USER_ERRORS, report

        try:
            run(args)
        except USER_ERRORS as e:
            return report(e)
        return 0
    finally:
        devices.join()
        if args.nnodes > 1:
            from jeagle.parallel.distributed import shutdown

            shutdown()


def exit_now(code: int) -> None:
    """End a one-shot command once its output is written, skipping the interpreter's teardown (freeing
    every device buffer and collecting every object: about 0.5 s after a run on an H100); the process's
    exit releases it all the same. Nothing of jeagle's is left to run at exit (stores and caches write
    synchronously, warm-up workers are joined)."""
    import logging
    import os

    try:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
    except OSError:  # e.g. a closed pipe: Python's own exit would fail the same way
        code = code or 120
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
