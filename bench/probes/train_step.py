"""Where an EAGLE-3 training step's time goes: the whole step, the target's forward alone, and the step at
fewer training-time-test steps, on random weights of a named shape (what a step computes depends on
shapes, not weights), warm, `block_until_ready` after each step. Loss tokens per second is the figure
`jeagle.train_draft` logs (`tokens_per_s`); the FLOP rate puts it against the chip.

    python bench/probes/train_step.py --shape smollm2 --batch 32 --seq-len 640 --ttt-steps 1,4,7

With `--trace DIR` the last configuration's steps are also written as a profiler trace. Prints a table,
then one JSON line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import SHAPES, device_kind, emit, git_commit  # noqa: E402


def batch_of(rng, batch: int, seq_len: int, vocab: int, prompt_len: int):
    """Random token rows, all of seq_len, the loss on every position past the prompt."""
    import numpy as np

    tokens = rng.integers(4, vocab, (batch, seq_len)).astype(np.int32)
    mask = np.zeros((batch, seq_len), bool)
    mask[:, prompt_len - 1:seq_len - 1] = True
    return {"tokens": tokens, "lengths": np.full((batch,), seq_len, np.int32), "loss_mask": mask}


def timed(fn, steps: int) -> float:
    """Median seconds of `steps` calls of fn (each waits for its result), after two warm ones."""
    fn()
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=640)
    p.add_argument("--prompt-len", type=int, default=128, help="positions before the loss starts")
    p.add_argument("--ttt-steps", default="1,4,7", help="training-time-test steps to time, comma-separated")
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration (median)")
    p.add_argument("--compute-dtype", default="bfloat16")
    p.add_argument("--trace", default=None, help="write a profiler trace of the last configuration here")
    p.add_argument("--data", default=None, help="a train_draft dataset (data.npz): also time the real batches of "
                   "it at the last --ttt-steps, rows all seq-len long against --length-buckets")
    p.add_argument("--length-buckets", type=int, default=8)
    p.add_argument("--data-steps", type=int, default=24, help="timed steps per batching (after every shape is warm)")
    p.add_argument("--num-layers", type=int, default=1, help="the head's decoder layers")
    p.add_argument("--memory-only", action="store_true",
                   help="only compile each step and report its temporaries (XLA's memory analysis; on a CPU an "
                        "estimate of whether a shape fits the GPU), no timing")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jeagle.config import ModelConfig
    from jeagle.models.llama import random_model
    from jeagle.train.model import target_outputs
    from jeagle.train.trainer import TrainConfig, Trainer, draft_config_for

    cfg = ModelConfig(**SHAPES[args.shape]).replace(dtype=args.compute_dtype)
    target = random_model(cfg)
    rng = np.random.default_rng(0)
    batch = batch_of(rng, args.batch, args.seq_len, cfg.vocab_size, args.prompt_len)
    loss_tokens = int(batch["loss_mask"].sum())
    used = np.sort(rng.choice(cfg.vocab_size, min(args.draft_vocab_size, cfg.vocab_size), replace=False))
    dev = {k: jnp.asarray(v) for k, v in batch.items()}
    # FLOPs of the target's forward (2 per weight per token; attention's T x T products on top).
    n_params = sum(np.size(x) for x in jax.tree.leaves(target_params(target)))
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * args.seq_len * args.seq_len * args.batch / 2
    target_flop = 2 * n_params * args.batch * args.seq_len + attn

    rows = []
    aux = draft_config_for(cfg, TrainConfig()).aux_layer_ids  # the layers an EAGLE-3 head reads
    fwd = jax.jit(lambda t, b: target_outputs(t, b["tokens"], b["lengths"], aux_layers=aux))
    if args.memory_only:
        return memory_rows(args, target, cfg, used, dev)
    s = timed(lambda: jax.block_until_ready(fwd(target, dev)), args.steps)
    rows.append({"what": "target forward", "ttt_steps": 0, "step_ms": round(s * 1e3, 2),
                 "loss_tokens_per_s": round(loss_tokens / s), "tflops": round(target_flop / s / 1e12, 1)})
    for k in (int(x) for x in args.ttt_steps.split(",")):
        tc = train_config(args, used, k)
        trainer = Trainer(target, draft_config_for(cfg, tc), tc, used_ids=used)
        s = timed(lambda: jax.block_until_ready(trainer.train_step(batch)), args.steps)
        rows.append({"what": "train step", "ttt_steps": k, "step_ms": round(s * 1e3, 2),
                     "loss_tokens_per_s": round(loss_tokens / s)})
        if args.trace and k == int(args.ttt_steps.split(",")[-1]):
            jax.profiler.start_trace(args.trace)
            for _ in range(3):
                jax.block_until_ready(trainer.train_step(batch))
            jax.profiler.stop_trace()

    if args.data:
        rows += data_rows(args, trainer)
    print(f"{args.shape}, batch {args.batch} x {args.seq_len} ({loss_tokens} loss tokens), {args.compute_dtype}, "
          f"{device_kind()}")
    print(f"{'what':<16} {'TTT':>4} {'ms/step':>9} {'loss tok/s':>11} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['what']:<16} {r['ttt_steps']:>4} {r['step_ms']:>9.2f} {r['loss_tokens_per_s']:>11,} "
              f"{r.get('tflops', ''):>8}")
    emit({"bench": "train_step", "shape": args.shape, "batch": args.batch, "seq_len": args.seq_len,
          "loss_tokens": loss_tokens, "dtype": args.compute_dtype, "device": device_kind(), "commit": git_commit(),
          "rows": rows}, args.json_out)


def train_config(args, used, ttt_steps: int):
    """The EAGLE-3 training configuration timed (or compiled) at `ttt_steps`."""
    from jeagle.train.trainer import TrainConfig

    return TrainConfig(kind="eagle3", ttt_steps=ttt_steps, batch_size=args.batch, seq_len=args.seq_len,
                       draft_vocab_size=len(used), compute_dtype=args.compute_dtype, steps=10**6,
                       num_layers=args.num_layers)


def memory_rows(args, target, cfg, used, batch) -> None:
    """--memory-only: each configuration's step compiled, its temporaries and arguments (GB) printed."""
    from jeagle.train.trainer import Trainer, draft_config_for

    rows = []
    for k in (int(x) for x in args.ttt_steps.split(",")):
        tc = train_config(args, used, k)
        tr = Trainer(target, draft_config_for(cfg, tc), tc, used_ids=used)
        m = tr.memory_analysis(batch)
        rows.append({"what": "train step memory", "ttt_steps": k, "num_layers": args.num_layers,
                     "temp_gb": round(m.temp_size_in_bytes / 1e9, 2), "args_gb": round(m.argument_size_in_bytes / 1e9, 2)})
        print(f"{args.shape}, batch {args.batch} x {args.seq_len}, {args.num_layers} layer(s), TTT {k}: "
              f"temporaries {rows[-1]['temp_gb']} GB, arguments {rows[-1]['args_gb']} GB ({device_kind()})", flush=True)
    emit({"bench": "train_step_memory", "shape": args.shape, "batch": args.batch, "seq_len": args.seq_len,
          "dtype": args.compute_dtype, "device": device_kind(), "commit": git_commit(), "rows": rows}, args.json_out)


def data_rows(args, trainer) -> list[dict]:
    """Loss tokens per second over real batches of a dataset: every row seq_len long, then grouped by length
    (`--length-buckets`); each batching's shapes compiled and warmed before its timed steps."""
    import time

    import jax

    from jeagle.train.data import DraftData, batches, epoch_batches, length_buckets

    data = DraftData.load(args.data)
    out = []
    for n in sorted({1, args.length_buckets}):
        buckets = length_buckets(args.seq_len, n)
        epoch = epoch_batches(data, args.batch, args.seq_len, seed=0, buckets=buckets)
        want = {s for s, _ in epoch}  # the row lengths that occur (a bucket may hold too few for a batch)
        warm, shapes = batches(data, args.batch, args.seq_len, seed=0, buckets=buckets), set()
        for _ in range(len(epoch)):  # one step of each row length: its compile
            if shapes == want:
                break
            b = next(warm)
            if b["tokens"].shape[1] not in shapes:
                shapes.add(b["tokens"].shape[1])
                jax.block_until_ready(trainer.train_step(b))
        it = batches(data, args.batch, args.seq_len, seed=1, buckets=buckets)
        steps = [next(it) for _ in range(args.data_steps)]
        t0 = time.perf_counter()
        for b in steps:
            metrics = trainer.train_step(b)
        jax.block_until_ready(metrics)
        s = time.perf_counter() - t0
        loss = sum(int(b["loss_mask"].sum()) for b in steps)
        out.append({"what": f"data, {n} bucket(s)", "ttt_steps": trainer.tc.ttt_steps,
                    "step_ms": round(s / len(steps) * 1e3, 2), "loss_tokens_per_s": round(loss / s),
                    "buckets": list(buckets), "loss_tokens_per_step": round(loss / len(steps))})
    return out


def target_params(target):
    from flax import nnx

    return nnx.to_pure_dict(nnx.split(target)[1])


if __name__ == "__main__":
    main()
