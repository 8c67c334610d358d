"""What the host spends dispatching one prefill (issue 25: a prefix-cache hit's time to first token):
the executable's call with the inputs as NumPy arrays (what the engine passes), the inputs' transfer
alone (`jax.device_put` of the whole input tree), the call with the inputs already on the device, and
the device's time to the end, for a SmolLM2-shaped target (random weights) at batch 1.

    python bench/probes/prefill_dispatch.py [--shape smollm2] [--lengths 40,200,1000] [--repeats 20]

Each prefill's inputs are captured from the engine's own dispatch (`decoder._run`), so the arrays and
their number are the engine's: 19 arrays before session 22, one packed vector since
(jeagle/runtime/packing.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import device_kind, git_commit, random_target_and_head  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--lengths", default="40,200,1000")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)

    import jax
    import numpy as np

    from jeagle.engine import EngineConfig, target_only
    from jeagle.kernels.settings import KernelSettings
    from jeagle.runtime.steps import PrefillInputs
    from jeagle.sampling import SamplingParams

    model, _ = random_target_and_head(args.shape)
    lengths = [int(x) for x in args.lengths.split(",")]
    eng = target_only(model, EngineConfig(max_batch_size=1, max_context=max(lengths) + 64, prefix_cache=False,
                                          kernels=KernelSettings.from_env()))
    dec = eng.decoder
    captured = []
    run = type(dec)._run

    def capture(self, exe, inputs):
        if isinstance(inputs, (PrefillInputs, np.ndarray)):  # packed into one vector since session 22
            captured.append((exe, inputs))
        return run(self, exe, inputs)
    type(dec)._run = capture
    sp = SamplingParams(max_new_tokens=2)
    rng = np.random.default_rng(0)
    for n in lengths:
        captured.clear()
        prompt = rng.integers(10, model.cfg.vocab_size - 10, n).tolist()
        eng.generate([prompt], sp)
        eng.generate([prompt], sp)  # every executable has run once
        exe, inputs = captured[-1]
        leaves = jax.tree.leaves(inputs)
        rows = {"numpy_call_ms": [], "device_put_ms": [], "device_call_ms": [], "to_end_ms": []}
        for _ in range(args.repeats):
            jax.block_until_ready(dec.state)
            t0 = time.perf_counter()
            out, dec.state = exe(dec.param_leaves, dec.state, inputs)
            t1 = time.perf_counter()
            jax.block_until_ready((out, dec.state))
            t2 = time.perf_counter()
            rows["numpy_call_ms"].append((t1 - t0) * 1e3)
            rows["to_end_ms"].append((t2 - t0) * 1e3)
            t0 = time.perf_counter()
            on_device = jax.device_put(inputs)
            t1 = time.perf_counter()
            jax.block_until_ready(on_device)
            out, dec.state = exe(dec.param_leaves, dec.state, on_device)
            t2 = time.perf_counter()
            jax.block_until_ready((out, dec.state))
            rows["device_put_ms"].append((t1 - t0) * 1e3)
            rows["device_call_ms"].append((t2 - t1) * 1e3)
        print(json.dumps({"probe": "prefill_dispatch", "device": device_kind(), "commit": git_commit(),
                          "prompt": n, "input_arrays": len(leaves),
                          "input_bytes": int(sum(np.asarray(x).nbytes for x in leaves))}
                         | {k: round(statistics.median(v), 3) for k, v in rows.items()}), flush=True)
    type(dec)._run = run


if __name__ == "__main__":
    main()
