"""The command-line options every engine entry point shares (`jeagle.generate`, `jeagle.serve`)."""

from __future__ import annotations

import argparse

from jeagle.config import DTYPE_CHOICES
from jeagle.runtime.config import EngineConfig


def build_parser(prog: str = "python -m jeagle.generate", prompts: bool = True,
                 description: str = "Generate text with a Llama-family model (default: SmolLM2-135M-Instruct).",
                 warmup: bool = False, nodes: bool = False) -> argparse.ArgumentParser:
    """Every engine option (shared by `jeagle.generate` and `jeagle.serve`), plus prompts if asked.
    warmup: the entry point warms up unless told not to (`--no-warmup`; `--warmup` is accepted and changes
    nothing); else only with `--warmup`. nodes: `--nnodes`, `--node-rank`, `--dist-init-addr` (tensor
    parallelism across processes, jeagle/parallel/distributed.py; `jeagle.generate` only so far)."""
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
    if prompts:
        p.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2], over the new tokens")
        p.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2], over the new tokens")
        p.add_argument("--repetition-penalty", type=float, default=1.0, help="(0, 10], over prompt and new tokens")
        p.add_argument("--min-tokens", type=int, default=0, help="EOS and stop tokens held back until this many")
        grammar = p.add_mutually_exclusive_group()
        grammar.add_argument("--json-schema", metavar="FILE_OR_JSON",
                             help="the output follows this JSON schema (a file, or the schema itself)")
        grammar.add_argument("--regex", help="the output matches this regular expression")
        grammar.add_argument("--ebnf", metavar="FILE_OR_GRAMMAR", help="the output follows this GBNF grammar")
        p.add_argument("--logprobs", type=int, default=None, metavar="K",
                       help="with --json: each new token's logprob and the K (0-20) most likely tokens at its position")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weights and activations (default auto: bfloat16 on a GPU, float32 on a CPU, where bf16 "
                        "is emulated and picks worse tokens at near ties)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant target forward: greedy output is the same tokens with or without a draft, "
                        "at any batch size, in bf16 too (slower; jeagle/models/deterministic.py)")
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
    rt.add_argument("--bucket-shrink-ratio", type=float, default=EngineConfig.bucket_shrink_ratio, metavar="X",
                    help="a running batch moves down to a smaller bucket only once its requests fill at most 1/X of "
                         "its bucket (each bucket's first round after another's costs the host a command-buffer "
                         "update; default %(default)s; 1: always the smallest bucket that fits, as SGLang)")
    rt.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="dispatch the next round before the host processes the last one (default on)")
    rt.add_argument("--dispatch-thread", action=argparse.BooleanOptionalAction, default=None,
                    help="call the executables on a thread of their own while the host processes the last step's "
                         "results (XLA's per-call host work beside the engine's Python; default: on for jeagle.serve, "
                         "whose engine is host-bound under load, off for jeagle.generate: bench/HISTORY.md, "
                         "2026-11-27)")
    rt.add_argument("--disable-prefix-cache", action="store_true",
                    help="prefill every prompt whole (default: reuse the KV of the longest cached prefix — earlier "
                         "prompts and answers — and evict the least recently used when slots run short)")
    rt.add_argument("--schedule-conservativeness", type=float, default=1.0,
                    help="admission when KV slots are short (SGLang's flag): room is kept for this times the "
                         "expected share of every running request's remaining tokens (0: admit what fits now, "
                         "retract later)")
    rt.add_argument("--admission-delay", type=float, default=EngineConfig.admission_delay, metavar="X",
                    help="with a queue, admit freed rows in groups: a free row waits until its idle time reaches X "
                         "times one prefill call's measured host time (fewer prefill calls; default %(default)s; "
                         "0: admit at once, as SGLang)")
    rt.add_argument("--admission-max-wait-steps", type=int, default=EngineConfig.admission_max_wait_steps,
                    metavar="N", help="the most steps a free row waits for a group (default %(default)s)")
    rt.add_argument("--verify-done-wait", choices=["sync", "dataflow"], default=None,
                    help="after a round: data dependence only (dataflow, the default) or a hard wait (sync; also "
                         "JEAGLE_VERIFY_DONE_STREAM_WAIT=0)")
    rt.add_argument("--rounds-per-dispatch", type=int, default=1, metavar="R",
                    help="speculative rounds one dispatch runs on the device; the host reads them with one copy "
                         "(default 1)")
    rt.add_argument("--rounds-loop", choices=["unrolled", "while"], default="unrolled",
                    help="R > 1: the rounds written out in one executable (default; R x the compile time) or a "
                         "device loop that stops once every request of the batch has finished (slower on the "
                         "H100: XLA reads its predicate back every iteration)")
    rt.add_argument("--slice-fusion", choices=["on", "off"], default=None,
                    help="XLA's dynamic-slice fusions on a GPU (a GEMM reads its layer's slice of the stacked weights "
                         "in place); off: the slice is copied first, a little more device time for about a fifth less "
                         "host work per call. Default: on for jeagle.generate, off for jeagle.serve (whose host "
                         "sets the pace: +6-10%% at 16-32 clients on the H100, bench/HISTORY.md, 2026-11-27)")
    if warmup:  # the server: a compilation on a request's path holds up every request in the batch
        rt.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="compile (or load from the executable store) every (phase, bucket) executable before "
                             "serving, progress on stderr (default on; --no-warmup: each compiles on first use, "
                             "in the time of the requests that need it)")
    else:
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
    if nodes:
        dist = p.add_argument_group("several processes and hosts (docs/multi-gpu.md)")
        dist.add_argument("--nnodes", type=int, default=1, metavar="N",
                          help="processes (one per host) that --tp spans; every one runs the same command and "
                               "options with its own --node-rank; rank 0 prints the output (jeagle.generate: the "
                               "same prompts on every node) or serves HTTP (jeagle.serve: the others follow it)")
        dist.add_argument("--node-rank", type=int, default=0, metavar="I", help="this process's rank, 0 to N-1")
        dist.add_argument("--dist-init-addr", metavar="HOST:PORT",
                          help="where rank 0 serves JAX's coordinator (the same on every node)")
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


def dispatch_thread(a: argparse.Namespace, *, default: bool) -> bool:
    """`--dispatch-thread` / `--no-dispatch-thread` when given, else the entry point's default."""
    return default if a.dispatch_thread is None else a.dispatch_thread


def kernel_settings(a: argparse.Namespace, *, slice_fusion: bool):
    """The kernel settings of an entry point: the environment's (`KernelSettings.from_env`), with
    `--slice-fusion` when given, else the entry point's default `slice_fusion`."""
    import dataclasses

    from jeagle.kernels.settings import KernelSettings

    chosen = slice_fusion if a.slice_fusion is None else a.slice_fusion == "on"
    return dataclasses.replace(KernelSettings.from_env(), slice_fusion=chosen)


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
    if hasattr(a, "nnodes"):
        from jeagle.parallel.distributed import check

        problem = check(a.nnodes, a.node_rank, a.dist_init_addr)
        if problem:
            p.error(problem)
    if a.rounds_per_dispatch < 1:
        p.error(f"--rounds-per-dispatch must be >= 1, got {a.rounds_per_dispatch}")
    if getattr(a, "logprobs", None) is not None:
        from jeagle.sampling.logprobs import LOGPROB_TOP

        if not 0 <= a.logprobs <= LOGPROB_TOP:
            p.error(f"--logprobs must be in [0, {LOGPROB_TOP}], got {a.logprobs}")
        if not a.json:
            p.error("--logprobs needs --json (they are reported per token there)")
    if a.speculative_algorithm in ("EAGLE", "EAGLE3") and not a.draft:
        p.error(f"--speculative-algorithm {a.speculative_algorithm} needs --draft")
    if (a.speculative_adaptive or a.speculative_adaptive_config) and (not a.draft or a.speculative_algorithm == "none"):
        p.error("--speculative-adaptive needs speculative decoding (--draft, not --speculative-algorithm none)")
