"""What `--rebuild-vocab` costs a trained head at the start, by how its new draft tokens' output rows are
initialised: the shipped SmolLM2 EAGLE-3 head with `--swap` of its draft tokens replaced by random
others (seeded), new rows at zero, at a fraction of the trained rows' median norm (the target's head
row's direction), or the target's head rows as they are; accept length with the real engine, greedy,
fp32, on the first MT-bench prompts.

    python bench/probes/vocab_swap.py --prompts .data/mtbench.jsonl --swap 1000 --modes orig,zero,quarter,half,target

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import device_kind, emit, git_commit  # noqa: E402

SCALES = {"zero": 0.0, "quarter": 0.25, "half": 0.5, "full": 1.0}  # × the trained rows' median norm


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True, help="records .jsonl (e.g. `sources eval`'s mtbench.jsonl)")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--swap", type=int, default=1000, help="draft tokens replaced by random others")
    p.add_argument("--modes", default="orig,zero,quarter,half,target")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jeagle.checkpoint import load_draft, load_model
    from jeagle.fetch import resolve_target
    from jeagle.heads import default_head_dir
    from jeagle.tokenizer import Tokenizer
    from jeagle.train.evaluate import accept_lengths
    from jeagle.train.model import head_module
    from jeagle.train.records import read_records
    from jeagle.train.vocab import remap_lm_head

    tdir = resolve_target(None, dtype="float32")
    model, tok = load_model(tdir, dtype="float32"), Tokenizer.from_dir(tdir)
    head = load_draft(default_head_dir(), target=model.cfg, dtype="float32")
    pure = nnx.to_pure_dict(nnx.split(head)[1])
    d2t = np.asarray(pure.pop("d2t"))
    params = {k: jnp.asarray(v) for k, v in pure.items() if v is not None}
    trained = np.asarray(params["lm_head"])
    target_rows = np.asarray((model.embed if model.lm_head is None else model.lm_head)[...], np.float32)
    used = np.arange(len(d2t)) + d2t
    rng = np.random.default_rng(0)
    drop = rng.choice(len(used), args.swap, replace=False)
    pool = np.setdiff1d(np.arange(target_rows.shape[0]), used)
    new_used = np.sort(np.concatenate([np.delete(used, drop), rng.choice(pool, args.swap, replace=False)]))
    new_d2t = (new_used - np.arange(len(new_used))).astype(np.int32)
    fresh = ~np.isin(new_used, used)
    norm = float(np.median(np.linalg.norm(trained, axis=1)))
    records = read_records(args.prompts, limit=args.num_prompts)
    rows = []
    for mode in args.modes.split(","):
        if mode == "orig":
            lm, dd = trained, d2t
        else:
            lm, dd = remap_lm_head(trained, d2t, new_d2t), new_d2t  # the rule: new rows at zero
            if mode == "target":
                lm[fresh] = target_rows[new_used[fresh]]
            elif mode in SCALES:
                t = target_rows[new_used[fresh]]
                lm[fresh] = t / np.linalg.norm(t, axis=1, keepdims=True) * SCALES[mode] * norm
            elif mode != "zero":
                raise SystemExit(f"--modes: unknown {mode!r}")
        r = accept_lengths(model, head_module({**params, "lm_head": jnp.asarray(lm)}, head.cfg, dd), tok, records,
                           spec=(5, 4, 8), max_new_tokens=args.max_new_tokens, batch_size=8)
        rows.append({"mode": mode, "accept_length": r["accept_length"]})
        print(f"{mode:<8} {r['accept_length']:.3f}", flush=True)
    emit({"bench": "vocab_swap", "swap": args.swap, "prompts": len(records), "max_new_tokens": args.max_new_tokens,
          "device": device_kind(), "commit": git_commit(), "rows": rows}, args.json_out)


if __name__ == "__main__":
    main()
