"""`python -m jeagle.generate`: arguments → `GenerateArgs` → the library. Nothing else lives here."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from jeagle.config import DTYPES


@dataclass(frozen=True)
class GenerateArgs:
    prompts: tuple[str, ...] = ()
    prompts_file: str | None = None
    target: str | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    chat: bool | None = None  # None = chat template when the tokenizer has one
    batch_size: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    json: bool = False
    dtype: str = "bfloat16"
    max_context: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    decode_steps: int = 1
    unroll_layers: bool = False
    layer_unroll: int | None = None
    draft: str | None = None
    speculative_algorithm: str | None = None
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
    verify_done_wait: str | None = None
    warmup: bool = False
    compile_cache_dir: str | None = None
    no_compile_cache: bool = False
    compile_workers: int | None = None
    tp: int = 1
    tp_vocab: str = "shard"
    tp_draft: str = "auto"


def build_parser(prog: str = "python -m jeagle.generate", prompts: bool = True,
                 description: str = "Generate text with a Llama-family model (default: SmolLM2-135M-Instruct).",
                 ) -> argparse.ArgumentParser:
    """Every engine option (shared by `jeagle.generate` and `jeagle.serve`), plus prompts if asked."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    if prompts:
        p.add_argument("prompts", nargs="*", help="prompts (each one request)")
        p.add_argument("--prompts-file", help="a .txt file (one prompt per line) or .jsonl (a 'prompt' field per line)")
    p.add_argument("--target", help="converted jeagle dir, Hugging Face model dir or .gguf file "
                                    "(default: SmolLM2-135M-Instruct, fetched and converted once)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (request i uses seed + i)")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap prompts in the chat template (default when the tokenizer has one)")
    chat.add_argument("--raw", dest="chat", action="store_false", help="feed prompts as raw text")
    p.add_argument("--batch-size", "--max-running-requests", dest="batch_size", type=int, default=None,
                   help="max requests decoded together (default: number of prompts, at most 48 with a draft, "
                        "16 without)")
    p.add_argument("--stop-token-ids", type=lambda s: tuple(int(x) for x in s.split(",") if x), default=())
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object (outputs + stats) on stdout")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--max-context", type=int, default=None, help="context window (default: model's, max 8192)")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV cache slots")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="size the KV cache to this fraction of GPU memory instead")
    p.add_argument("--decode-steps", type=int, default=1, help="tokens per decode dispatch")
    p.add_argument("--unroll-layers", action="store_true", help="unroll the layer loop (slower compile)")
    p.add_argument("--layer-unroll", type=int, default=None, metavar="K",
                   help="K layers per iteration of the layer loop (default: 3 for decode steps and rounds, "
                        "a plain loop for prefill; 1 = a plain loop everywhere)")
    rt = p.add_argument_group("runtime")
    rt.add_argument("--buckets", type=lambda s: tuple(int(x) for x in s.split(",") if x), default=None,
                    help="batch buckets, e.g. 1,2,4,8 (default: SGLang's list up to the batch size)")
    rt.add_argument("--max-bucket", type=int, default=None, help="cap the default bucket list")
    rt.add_argument("--disable-padding", action="store_true", help="compile one executable per exact batch size")
    rt.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="dispatch the next round before the host processes the last one (default on)")
    rt.add_argument("--verify-done-wait", choices=["sync", "dataflow"], default=None,
                    help="after a round: hard wait (sync, default) or data dependence only (dataflow; also "
                         "JEAGLE_VERIFY_DONE_STREAM_WAIT=1)")
    rt.add_argument("--warmup", action="store_true",
                    help="compile every (phase, bucket) executable at start-up (progress on stderr)")
    rt.add_argument("--compile-cache-dir", default=None,
                    help="persistent compilation cache and, under executables/, the serialized executables a "
                         "warm start loads without tracing (default: $JEAGLE_CACHE/xla)")
    rt.add_argument("--no-compile-cache", action="store_true", help="do not persist compilations")
    rt.add_argument("--tp", type=int, default=1, metavar="N",
                    help="tensor parallelism: split the target over N devices of this host (heads, MLP, vocabulary; "
                         "KV pools by KV heads); outputs equal --tp 1")
    rt.add_argument("--tp-vocab", choices=["shard", "replicate"], default="shard",
                    help="with --tp: the lm_head/embedding rows split over the devices (default) or replicated")
    rt.add_argument("--tp-draft", choices=["auto", "replicate", "shard"], default="auto",
                    help="with --tp: the EAGLE head split like a target layer when its heads divide (auto, the "
                         "default), always replicated, or always split")
    rt.add_argument("--compile-workers", type=int, default=None,
                    help="threads that load and compile executables during --warmup (default: min(16, CPUs))")
    spec = p.add_argument_group("speculative decoding (EAGLE)")
    spec.add_argument("--draft", help="EAGLE head: a jeagle draft dir or a PyTorch EAGLE/EAGLE-3 dir (converted on "
                                      "first use and cached); default with no --target: jeagle's trained head for "
                                      "SmolLM2-135M-Instruct (jeagle/heads/)")
    spec.add_argument("--speculative-algorithm", choices=["EAGLE", "EAGLE3", "none"], default=None,
                      help="default: detected from the head; 'none' decodes with the target only")
    spec.add_argument("--speculative-num-steps", type=int, default=None, help="S (default 5)")
    spec.add_argument("--speculative-eagle-topk", type=int, default=None, help="K (default 4)")
    spec.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="N (default 8; S+1 when K=1)")
    spec.add_argument("--speculative-accept-threshold-single", type=float, default=1.0)
    spec.add_argument("--speculative-accept-threshold-acc", type=float, default=1.0)
    spec.add_argument("--speculative-adaptive", action="store_true",
                      help="switch between pre-compiled (S, K, N) tiers after each round by the EMA of the accept "
                           "length (default tiers: steps 1, 3, 7 with the given topk; the given steps snap to the "
                           "nearest); every tier is compiled, so warm-up compiles a round executable per tier")
    spec.add_argument("--speculative-adaptive-config", metavar="FILE",
                      help="JSON: candidate_steps, candidate_tiers ([[S, K, N], ...]), ema_alpha, warmup_batches, "
                           "update_interval, down_hysteresis, up_hysteresis (omitted keys: defaults); "
                           "implies --speculative-adaptive")
    return p


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Errors in option combinations (argparse's usage error, exit 2), and the default draft."""
    if a.draft is None and a.target is None and a.speculative_algorithm != "none":
        from jeagle.heads import default_head_dir

        if (default_head_dir() / "config.json").is_file():
            a.draft = str(default_head_dir())  # the default target's shipped EAGLE-3 head
    given = [x is not None for x in (a.speculative_num_steps, a.speculative_eagle_topk, a.speculative_num_draft_tokens)]
    if any(given) and not all(given):
        p.error("give all three of --speculative-num-steps, --speculative-eagle-topk, "
                "--speculative-num-draft-tokens, or none (defaults 5/4/8)")
    if a.layer_unroll is not None and a.layer_unroll < 1:
        p.error(f"--layer-unroll must be >= 1, got {a.layer_unroll}")
    if a.tp < 1:
        p.error(f"--tp must be >= 1, got {a.tp}")
    if a.speculative_algorithm in ("EAGLE", "EAGLE3") and not a.draft:
        p.error(f"--speculative-algorithm {a.speculative_algorithm} needs --draft")
    if (a.speculative_adaptive or a.speculative_adaptive_config) and (not a.draft or a.speculative_algorithm == "none"):
        p.error("--speculative-adaptive needs speculative decoding (--draft, not --speculative-algorithm none)")


def parse_args(argv: list[str] | None = None) -> GenerateArgs:
    p = build_parser()
    a = p.parse_args(argv)
    if not a.prompts and not a.prompts_file:
        p.error("give prompts as arguments or --prompts-file")
    check_args(p, a)
    return GenerateArgs(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in vars(a).items()})


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


ALGORITHMS = {"eagle1": "EAGLE", "eagle3": "EAGLE3"}


def load_speculative_draft(args: GenerateArgs, target_dir, model):
    """The draft head for --draft (converted on first use), or None for target-only decoding."""
    if args.speculative_algorithm == "none" or not args.draft:
        return None
    from jeagle.checkpoint import load_draft
    from jeagle.config import ConfigError
    from jeagle.fetch import resolve_draft

    draft_dir = resolve_draft(args.draft, target_dir, dtype=args.dtype, quiet=args.json)
    head = load_draft(draft_dir, target=model.cfg, dtype=args.dtype)
    detected = ALGORITHMS[head.cfg.kind]
    if args.speculative_algorithm is not None and args.speculative_algorithm != detected:
        raise ConfigError(f"--speculative-algorithm {args.speculative_algorithm}, but {args.draft} is an "
                          f"{detected} head")
    return head


def adaptive_config(args):
    """The adaptive policy the options ask for, or None (read before anything loads: fails fast)."""
    if not (args.speculative_adaptive or args.speculative_adaptive_config):
        return None
    from jeagle.adaptive import AdaptiveConfig

    return (AdaptiveConfig.from_json(args.speculative_adaptive_config) if args.speculative_adaptive_config
            else AdaptiveConfig())


def build_engine(args, target_dir, n_requests: int | None = None, adaptive=None):
    """The engine the options describe: the target (and draft) loaded, the compilation cache set up.
    `n_requests`: the number of prompts, which bounds the default batch (None: a server's default,
    48 running requests with a draft, 16 without). Returns (engine, load seconds)."""
    import time

    from jeagle.checkpoint import load_model
    from jeagle.engine import Engine, EngineConfig

    exe_store = None
    if not args.no_compile_cache:
        from jeagle.fetch import cache_dir
        from jeagle.runtime import enable_compile_cache

        compile_cache = Path(args.compile_cache_dir or cache_dir() / "xla")
        enable_compile_cache(compile_cache)
        import jax

        # Serialized CPU executables can fail to run after loading ("Function wrapped_iota not found"
        # in CI): the store is used on GPUs only, where it is measured and tested.
        exe_store = str(compile_cache / "executables") if jax.default_backend() == "gpu" else None
    t_load = time.perf_counter()
    model = load_model(target_dir, dtype=args.dtype)
    draft = load_speculative_draft(args, target_dir, model)
    default_batch = 48 if draft is not None else 16
    batch = args.batch_size or (default_batch if n_requests is None else min(n_requests, default_batch))
    engine_cfg = EngineConfig(max_batch_size=batch, max_context=args.max_context,
                              max_total_tokens=args.max_total_tokens, mem_fraction_static=args.mem_fraction_static,
                              decode_steps=args.decode_steps, unroll_layers=True if args.unroll_layers else args.layer_unroll,
                              batch_buckets=args.buckets, max_bucket=args.max_bucket,
                              disable_padding=args.disable_padding, overlap=args.overlap,
                              verify_done_wait=args.verify_done_wait, executable_cache_dir=exe_store,
                              compile_workers=args.compile_workers, tp=args.tp, tp_vocab=args.tp_vocab,
                              tp_draft=args.tp_draft)
    if draft is None:
        engine = Engine(model, engine_cfg)
    else:
        from jeagle.spec.engine import SpecEngine
        from jeagle.spec.round import SpecConfig

        s, k, n = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
        if s is None:
            s, k, n = 5, 4, 8
        spec = SpecConfig(num_steps=s, topk=k, num_draft_tokens=n,
                          threshold_single=args.speculative_accept_threshold_single,
                          threshold_acc=args.speculative_accept_threshold_acc)
        engine = SpecEngine(model, draft, engine_cfg, spec, adaptive=adaptive)
    return engine, time.perf_counter() - t_load


def run(args: GenerateArgs) -> dict:
    from jeagle.fetch import resolve_target
    from jeagle.sampling import SamplingParams
    from jeagle.tokenizer import StreamDecoder, Tokenizer

    texts = list(args.prompts) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    adaptive = adaptive_config(args)
    target_dir = resolve_target(args.target, dtype=args.dtype, quiet=args.json)
    tokenizer = Tokenizer.from_dir(target_dir)
    use_chat = tokenizer.has_chat_template if args.chat is None else args.chat
    if use_chat and not tokenizer.has_chat_template:
        raise ValueError("--chat: this tokenizer has no chat template; use --raw")
    ids = [tokenizer.encode_chat([{"role": "user", "content": t}]) if use_chat else tokenizer.encode(t)
           for t in texts]
    engine, load_s = build_engine(args, target_dir, len(ids), adaptive)
    batch = engine.max_reqs
    if args.warmup:
        # Only what these prompts can dispatch: batch sizes up to theirs, their prompt-length buckets,
        # prefix buckets up to the longest possible context, the greedy and/or sampled variants.
        n = min(len(ids), batch)
        longest = max(engine._prefix_bound(len(x), args.max_new_tokens) for x in ids)
        modes = (args.temperature == 0.0,)  # every request shares the temperature: greedy or sampled variants
        engine.warmup(batch_sizes=range(1, n + 1), prefill_lengths=[len(x) for x in ids],
                      kv_lengths=[k for k in engine.kv_buckets if k < longest] + [longest], greedy=modes,
                      progress=not args.json)
    params = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, seed=None if args.seed is None else args.seed + i,
                             stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos)
              for i in range(len(ids))]

    stream = StreamDecoder(tokenizer)

    def print_tokens(_index, new_ids):
        for t in new_ids:
            if t in engine.model_cfg.eos_token_ids or t in args.stop_token_ids:
                continue
            sys.stdout.write(stream.push(t))
        sys.stdout.flush()

    on_tokens = print_tokens if len(ids) == 1 and not args.json else None  # stream one prompt's text

    outputs = engine.generate(ids, params, on_tokens=on_tokens)
    stats = engine.last_stats
    results = []
    for text, out in zip(texts, outputs):
        body = out.token_ids
        if out.finish_reason == "stop" and body:
            body = body[:-1]  # the stop token itself is not text
        results.append({"prompt": text, "text": tokenizer.decode(body), "token_ids": out.token_ids,
                        "finish_reason": out.finish_reason})
    ttft = [o.time_to_first_token_s for o in outputs if o.time_to_first_token_s is not None]
    doc = {
        "outputs": results,
        "stats": {
            "prompt_tokens": stats["prompt_tokens"],
            "new_tokens": stats["new_tokens"],
            "time_to_first_token_s": sum(ttft) / len(ttft) if ttft else None,
            "tokens_per_second": stats["new_tokens"] / stats["wall_s"] if stats["wall_s"] > 0 else None,
            "wall_s": stats["wall_s"],
            "compile_s": stats["compile_s"],
            "load_s": load_s,
            "target": str(target_dir),
            "draft": args.draft if args.speculative_algorithm != "none" else None,
            "batch_size": batch,
            # Tokens emitted per round per request, bonus included (1.0 without a draft).
            "accept_length": stats.get("accept_length", 1.0),
            "rounds": stats.get("rounds", 0),
            "accept_length_histogram": stats.get("accept_length_histogram", {}),
            "warmup_s": stats["warmup_s"],
            "compilations": stats["compilations"],
            "compilations_after_warmup": stats["compilations_after_warmup"],
            "executables_from_store": stats["executables_from_store"],
            "host_blocked_ms": stats["host_blocked_ms"],
            "buckets_used": stats["buckets_used"],
            "overlap": stats["overlap"],
            "verify_done_wait": stats["verify_done_wait"],
            # Speculative tiers: the round index (from 0) each tier started at; one entry when static.
            "adaptive": stats.get("adaptive", False),
            "tiers": stats.get("tiers", []),
            "tier_history": stats.get("tier_history", {}),
            "tier_switches": stats.get("tier_switches", 0),
        },
    }
    if args.json:
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
    from jeagle.errors import USER_ERRORS, report

    try:
        run(args)
    except USER_ERRORS as e:
        return report(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
