"""How far bf16 moves the gap between the target's two best logits (the scale a parting's fp32 gap is
judged against, issue 27): one prefill-shaped forward of SmolLM2 over an MT-bench-like prompt and a
continuation, in bf16 and in fp32; at every position, |gap_bf16 - gap_fp32| for the fp32 top-2 pair.

    python bench/probes/bf16_gap_noise.py
"""

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from jeagle.fetch import resolve_target  # noqa: E402
from jeagle.checkpoint import load_model  # noqa: E402
from jeagle.tokenizer import Tokenizer  # noqa: E402
from jeagle.cache import init_pools  # noqa: E402
from jeagle.models.common import AttnInputs  # noqa: E402

td = resolve_target(None, dtype="bfloat16", quiet=True)
tok = Tokenizer.from_dir(td)
text = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and must-see attractions. " * 3
ids = tok.encode_chat([{"role": "user", "content": text}]) + tok.encode(" Hawaii is a paradise of volcanic beaches, lush valleys and a rich culture that welcomes every visitor with aloha. The first stop on my trip was Honolulu.")


def logits(m):
    t = len(ids); pos = jnp.arange(t, dtype=jnp.int32)[None]
    k, v = init_pools(m.cfg, num_slots=t + 2)
    a = AttnInputs(positions=pos, write_slots=pos + 1, kv_slots=pos + 1, kv_len=jnp.asarray([t], jnp.int32))
    return np.asarray(m(jnp.asarray([ids], jnp.int32), a, k, v).logits[0], np.float64)


lb, lf = logits(load_model(td, dtype="bfloat16")), logits(load_model(td, dtype="float32"))
top2 = np.argsort(-lf, -1)[:, :2]
r = np.arange(len(ids))
gf = lf[r, top2[:, 0]] - lf[r, top2[:, 1]]; gb = lb[r, top2[:, 0]] - lb[r, top2[:, 1]]
d = np.abs(gf - gb)
print(len(ids), "|gap_bf16 - gap_fp32| over top-2 pairs: median %.3f p75 %.3f p90 %.3f max %.3f" % tuple(np.percentile(d, [50, 75, 90, 100])))
print("|logit bf16 - fp32| of the top token: median %.3f p90 %.3f" % tuple(np.percentile(np.abs(lb[r, top2[:,0]] - lf[r, top2[:,0]]), [50, 90])))
