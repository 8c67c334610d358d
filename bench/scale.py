"""A large random-weight target (default: Llama-3.1-8B's shape, bf16) decoded target-only and with an
EAGLE-3-shaped head at simulated accept lengths, on 1 or more GPUs (tensor parallelism), against the
bandwidth bound measured in the same run; optionally the share of device time in collectives.

What is timed: greedy generation of `--max-new-tokens` tokens (EOS ignored) for `batch` copies of a
`--context`-token prompt, after a warm-up run that compiles every executable the timed run uses
(`generate`, prefill included; the median of `--repeats`). Acceptance cannot come from random
weights, so the speculative runs force it: `speculative(..., simulate_accept=τ)` accepts τ tokens per round
on average (bonus included) whatever the draft (SGLang's SGLANG_SIMULATE_ACC_LEN); everything a round
does — draft steps, tree, verify forward, commit — runs as usual.

Bandwidth bound (per device): a decode step reads the weights once (1/tp of them) and the batch's KV
prefix (1/tp of the KV heads); bound tokens/s = batch / (bytes per step / copy bandwidth), with the copy
bandwidth measured here (an elementwise pass over 2 GiB: read + write).

With tp > 1, `--tp-variants` lists the placements to compare, VOCAB:DRAFT each (the lm_head and
embedding rows "shard"ed or "replicate"d; the EAGLE head "replicate"d or "shard"ed like a target
layer); the bound counts a replicated lm_head whole on every device.

    python bench/scale.py --shape llama8b --tp 1,2 --batch-sizes 1,16 --tau 3,4.68 --profile
    python bench/scale.py --tp 2 --tp-variants shard:replicate,replicate:replicate,shard:shard
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import tempfile
import time

from common import DRAFT_VOCAB, SHAPES, device_events_by_device, emit, git_commit, median_run, random_eagle3_head

# SGLang's published single-H100 Llama-3.1-8B figures: tokens/s at batch 1.
SGLANG_H100 = {"target_only": 158.3, "eagle3_tau_4.68": 361.7, "eagle3_mtbench": 373.3}
# NCCL kernels, and XLA's own collective kernels (Triton one-shot all-reduce: "all_reduce_96_0_fusion_1")
COLLECTIVE = re.compile(r"all[-_]?reduce|all[-_]?gather|reduce[-_]scatter|collective[-_]permute|all[-_]to[-_]all|nccl",
                        re.I)


def copy_bandwidth(n_bytes: int = 2 << 30, repeats: int = 20) -> float:
    """Bytes/s of an elementwise pass (read n + write n) on the default device, median of `repeats`."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((n_bytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a * jnp.bfloat16(1.5))
    f(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    del x
    return 2 * n_bytes / sorted(times)[len(times) // 2]


def timed(engine, prompt, batch: int, max_new: int, repeats: int) -> tuple[float, dict]:
    """(tokens/s, stats) of the median of `repeats` timed runs after a warm-up (decode.py's timing)."""
    from jeagle.sampling import SamplingParams

    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    engine.generate([prompt] * batch, sp)  # compiles every shape used below

    def once():
        engine.flush_cache()  # every run starts cold, as the warm-up did (a prefix-cache hit is another executable)
        outs = engine.generate([prompt] * batch, sp)
        if engine.last_stats.compile_s:
            raise RuntimeError("the timed run compiled")
        st = engine.last_stats.to_dict()
        # the decode phase alone: tokens after each request's first, over the time after the last first token
        ttft = max(o.time_to_first_token_s for o in outs)
        st["ttft_s"] = ttft
        st["decode_tokens_per_s"] = (st["new_tokens"] - len(outs)) / max(st["wall_s"] - ttft, 1e-9)
        return sum(len(o.token_ids) for o in outs), st

    return median_run(once, repeats)


def collective_share(run) -> dict:
    """Trace `run()`; per GPU and per phase ("prefill": the prompt executables, "decode": the decode
    steps or rounds, told apart by the HLO module each op ran in): device-busy µs, µs in collectives,
    their share, the top collectives and the top ops overall (what to look at when tp 2 is slower than
    tp 1). A collective's time includes its wait for the slower GPU (NCCL kernels spin until both
    arrive), so a GPU that runs ahead shows more of it."""
    import jax

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            run()
        per_dev = device_events_by_device(d, with_module=True)

    def summary(ev):
        busy = sum(t for _, t in ev)
        coll, ops = collections.Counter(), collections.Counter()
        for name, t in ev:
            ops[name] += t
            if COLLECTIVE.search(name):
                coll[name] += t
        c = sum(coll.values())
        return {"busy_us": round(busy), "collective_us": round(c), "collective_share": round(c / busy, 4) if busy else 0,
                "top_collectives": [(n, round(t)) for n, t in coll.most_common(4)],
                "top_ops": [(n[:80], round(t)) for n, t in ops.most_common(10)]}

    out = {}
    for dev, ev in sorted(per_dev.items()):
        phases = {"all": [(n, t) for n, t, _, _ in ev]}
        if any(m for *_, m in ev):  # the trace names each op's module
            phases["prefill"] = [(n, t) for n, t, _, m in ev if "prefill" in m]
            phases["decode"] = [(n, t) for n, t, _, m in ev if m and "prefill" not in m]
        out[dev] = {k: summary(v) for k, v in phases.items()}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama8b")
    p.add_argument("--tp", default="1", help="comma list of tensor-parallel sizes")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--tau", default="3,4.68", help="comma list of simulated accept lengths (empty: no EAGLE runs)")
    p.add_argument("--tier", default="5,4,8", help="S,K,N of the EAGLE runs")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--context", type=int, default=256, help="prompt tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tp-variants", default="shard:replicate",
                   help="tp > 1 placements, VOCAB:DRAFT comma list (vocab shard|replicate, draft replicate|shard)")
    p.add_argument("--profile", action="store_true", help="trace each tp and batch: collectives' share per phase")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    variants = [tuple(x.strip() for x in v.split(":")) for v in args.tp_variants.split(",") if v.strip()]
    if not variants or any(len(v) != 2 or v[0] not in ("shard", "replicate") or v[1] not in ("replicate", "shard")
                           for v in variants):
        p.error(f"--tp-variants: VOCAB:DRAFT pairs (shard|replicate:replicate|shard), got {args.tp_variants!r}")

    import jax
    from flax import nnx

    from jeagle.config import ModelConfig
    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.kernels.settings import KernelSettings
    from jeagle.models.llama import random_model
    from jeagle.sampling import SamplingParams
    from jeagle.speculative.round import SpecConfig

    cfg = ModelConfig(**{**SHAPES[args.shape], "tie_word_embeddings": False})
    batches = [int(b) for b in args.batch_sizes.split(",")]
    taus = [float(t) for t in args.tau.split(",") if t.strip()]
    s, k, n = (int(x) for x in args.tier.split(","))
    kernels = KernelSettings.from_env()  # JEAGLE_KERNELS, JEAGLE_PAGED_ATTENTION_SPLITS, ...: read once, here
    bw = copy_bandwidth()
    model = random_model(cfg)
    head = random_eagle3_head(cfg, draft_vocab=DRAFT_VOCAB.get(args.shape)) if taus else None
    # A decode step reads every weight but the input embedding (B rows of it; tied: it is the lm_head).
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    if not cfg.tie_word_embeddings:
        weight_bytes -= model.embed[...].nbytes
    head_bytes = (model.embed if cfg.tie_word_embeddings else model.lm_head)[...].nbytes
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    prompt = list(range(100, 100 + args.context))
    max_ctx = args.context + args.max_new_tokens + 64
    doc = {"bench": "scale", "shape": args.shape, "device": jax.devices()[0].device_kind, "devices": len(jax.devices()),
           "jax": jax.__version__, "commit": git_commit(),
           "kernels": kernels.backend or "default", "copy_bandwidth_GBps": round(bw / 1e9, 1),
           "weight_GB_read_per_step": round(weight_bytes / 1e9, 3), "tier": [s, k, n], "max_new_tokens": args.max_new_tokens,
           "context": args.context, "sglang_h100_llama8b": SGLANG_H100, "rows": [], "profiles": []}
    print(f"{args.shape}: {weight_bytes / 1e9:.2f} GB of weights read per step; copy bandwidth {bw / 1e9:.0f} GB/s "
          f"({doc['device']} x{doc['devices']})", flush=True)
    runs = [(tp, v) for tp in (int(t) for t in args.tp.split(",")) for v in (variants if tp > 1 else [("-", "-")])]
    timed_target: set = set()
    for tp, (vocab, draft_place) in runs:
        placement = {} if tp == 1 else {"tp_vocab": vocab, "tp_draft": draft_place}
        ec = EngineConfig(max_batch_size=max(batches), batch_buckets=tuple(sorted(set(batches))), max_context=max_ctx,
                          max_total_tokens=max(batches) * max_ctx + 4096, tp=tp, kernels=kernels, **placement)
        # target-only depends on the vocabulary placement only: timed once per (tp, vocab)
        engines = {} if (tp, vocab) in timed_target else {"target-only": target_only(model, ec)}
        timed_target.add((tp, vocab))
        for tau in taus:
            engines[f"eagle3 tau={tau:g}"] = speculative(model, head, ec, SpecConfig(s, k, n), simulate_accept=tau)
        for batch in batches:
            avg_ctx = args.context + args.max_new_tokens / 2
            replicated = head_bytes * (tp - 1) / tp if vocab == "replicate" else 0.0  # the rest of the lm_head
            step_bytes = (weight_bytes + batch * avg_ctx * kv_bytes_per_token) / tp + replicated
            bound = batch / (step_bytes / bw)
            for name, eng in engines.items():
                tps, stats = timed(eng, prompt, batch, args.max_new_tokens, args.repeats)
                row = {"tp": tp, **placement, "batch": batch, "system": name, "tokens_per_s": round(tps, 1),
                       "decode_tokens_per_s": round(stats["decode_tokens_per_s"], 1), "ttft_s": round(stats["ttft_s"], 4),
                       "accept_length": round(stats.get("accept_length", 1.0), 3),  # realised (τ is a mean)
                       "compile_s": round(getattr(eng, "compile_seconds", 0.0), 1)}
                if name == "target-only":  # the bound is a target step's; a round also runs the draft
                    row |= {"bytes_per_step": int(step_bytes), "bandwidth_bound_tokens_per_s": round(bound, 1),
                            "fraction_of_bound": round(tps / bound, 3),
                            "decode_fraction_of_bound": round(stats["decode_tokens_per_s"] / bound, 3)}
                doc["rows"].append(row)
                print(json.dumps(row), flush=True)
        if args.profile:
            sp = SamplingParams(max_new_tokens=32, ignore_eos=True)
            for batch in batches:
                for name, eng in engines.items():
                    prof = collective_share(lambda: eng.generate([prompt] * batch, sp))
                    doc["profiles"].append({"tp": tp, **placement, "batch": batch, "system": name, "per_device": prof})
                    print(json.dumps(doc["profiles"][-1]), flush=True)
        del engines
    print(f"\n{'tp':>3} {'vocab:draft':<19} {'batch':>5} {'system':<18} {'tokens/s':>9} {'decode':>9} {'ttft s':>7} "
          f"{'bound':>9} {'accept':>7}")
    for r in doc["rows"]:
        where = f"{r['tp_vocab']}:{r['tp_draft']}" if "tp_vocab" in r else "-"
        print(f"{r['tp']:>3} {where:<19} {r['batch']:>5} {r['system']:<18} {r['tokens_per_s']:>9.1f} "
              f"{r['decode_tokens_per_s']:>9.1f} {r['ttft_s']:>7.3f} "
              f"{r.get('bandwidth_bound_tokens_per_s', float('nan')):>9.1f} {r['accept_length']:>7.2f}")
    emit(doc, args.json_out)
    return doc


if __name__ == "__main__":
    main()
