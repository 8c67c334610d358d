"""How far bf16 moves the gap between the target's two best logits (the scale a parting's fp32 gap is
judged against): one prefill-shaped forward of SmolLM2 over an MT-bench-like prompt and a
continuation, in bf16 and in fp32; at every position, |gap_bf16 - gap_fp32| for the fp32 top-2 pair.

    python bench/probes/bf16_gap_noise.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import prompt_logits  # noqa: E402

PROMPT = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
          "and must-see attractions. ") * 3
CONTINUATION = (" Hawaii is a paradise of volcanic beaches, lush valleys and a rich culture that welcomes every "
                "visitor with aloha. The first stop on my trip was Honolulu.")


def main() -> None:
    import numpy as np

    from jeagle.loading.checkpoint import load_model
    from jeagle.loading.fetch import resolve_target
    from jeagle.loading.tokenizer import Tokenizer

    target_dir = resolve_target(None, dtype="bfloat16", quiet=True)
    tok = Tokenizer.from_dir(target_dir)
    ids = tok.encode_chat([{"role": "user", "content": PROMPT}]) + tok.encode(CONTINUATION)
    lb, lf = (prompt_logits(load_model(target_dir, dtype=d), ids, last_only=False) for d in ("bfloat16", "float32"))
    top2 = np.argsort(-lf, -1)[:, :2]
    r = np.arange(len(ids))
    gap = lambda lg: lg[r, top2[:, 0]] - lg[r, top2[:, 1]]  # noqa: E731
    d = np.abs(gap(lf) - gap(lb))
    print(len(ids), "|gap_bf16 - gap_fp32| over top-2 pairs: median %.3f p75 %.3f p90 %.3f max %.3f"
          % tuple(np.percentile(d, [50, 75, 90, 100])))
    print("|logit bf16 - fp32| of the top token: median %.3f p90 %.3f"
          % tuple(np.percentile(np.abs(lb[r, top2[:, 0]] - lf[r, top2[:, 0]]), [50, 90])))


if __name__ == "__main__":
    main()
