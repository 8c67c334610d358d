"""What JAX's per-call argument flatten costs the host for a decoder's parameters (bench/HISTORY.md, 2026-11-27).

Executables take the params as one flat tuple (`jeagle.runtime.executables.param_step`) because JAX
flattens every argument on every call, and the nnx parameter state flattens in Python per variable.
This times `jax.tree_util.tree_flatten` of the spec decoder's params (SmolLM2 shape + EAGLE-3 head)
against the same leaves as a tuple, and the state's unflatten, in µs per call (two passes).

    JAX_PLATFORMS=cpu python bench/probes/param_flatten.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import DRAFT_VOCAB, SHAPES, device_kind, git_commit, random_eagle3_head  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--calls", type=int, default=3000)
    args = p.parse_args(argv)

    import jax

    from jeagle.config import ModelConfig
    from jeagle.engine import EngineConfig, speculative
    from jeagle.models.llama import random_model
    from jeagle.speculative.round import SpecConfig

    cfg = ModelConfig(**SHAPES[args.shape])
    model, head = random_model(cfg), random_eagle3_head(cfg, draft_vocab=DRAFT_VOCAB.get(args.shape))
    dec = speculative(model, head, EngineConfig(max_batch_size=2, max_context=256), SpecConfig(5, 4, 8)).decoder
    leaves, treedef = jax.tree_util.tree_flatten(dec.params)
    as_tuple = tuple(leaves)

    def us(f):
        t0 = time.perf_counter()
        for _ in range(args.calls):
            f()
        return round((time.perf_counter() - t0) / args.calls * 1e6, 1)

    rows = [{"leaves": len(leaves), "flatten_state_us": us(lambda: jax.tree_util.tree_flatten(dec.params)),
             "flatten_tuple_us": us(lambda: jax.tree_util.tree_flatten(as_tuple)),
             "unflatten_state_us": us(lambda: jax.tree_util.tree_unflatten(treedef, leaves))} for _ in range(2)]
    for row in rows:
        print(json.dumps(row))
    print(json.dumps({"bench": "param_flatten", "shape": args.shape, "device": device_kind(), "commit": git_commit(),
                      "rows": rows}))


if __name__ == "__main__":
    main()
