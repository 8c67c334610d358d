"""Top-1 agreement of bf16 logits with transformers' fp32 logits, SmolLM2 on the GPU, by prefill attention
(tests/test_gpu.py's prompts and positions, plus more MT-bench prompts): jeagle with the gathered jnp
attention, jeagle with the paged-attention kernel's causal form, and transformers' own bf16.

    python bench/probes/bf16_agreement.py [--prompts .data/mtbench.jsonl --num 16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prompts", default=None)
    p.add_argument("--num", type=int, default=16)
    args = p.parse_args(argv)

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from jeagle.loading.checkpoint import load_model
    from jeagle.loading.fetch import resolve_target, smollm2_gguf_path
    from jeagle.kernels.settings import KernelSettings, use
    from jeagle.loading.tokenizer import Tokenizer
    from tests.test_gpu import PROMPTS
    from tests.util import max_rel_err, ragged_forward

    target_dir = resolve_target(None, quiet=True)
    gguf = smollm2_gguf_path(quiet=True)
    tok = Tokenizer.from_dir(target_dir)
    texts = list(PROMPTS)
    if args.prompts:
        texts += [json.loads(line)["prompt"] for line in open(args.prompts)][: args.num]
    ids = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
    model = load_model(target_dir)
    hf = {dt: AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dt).cuda().eval()
          for dt in (torch.float32, torch.bfloat16)}
    refs = []
    for p_ in ids:
        with torch.no_grad():
            x = torch.tensor([p_]).cuda()
            refs.append((hf[torch.float32](x).logits[0].float().cpu().numpy(),
                         hf[torch.bfloat16](x).logits[0].float().cpu().numpy()))
    rows = {}
    for name in ("gathered", "paged"):
        with use(KernelSettings(prefill_attention=name)):
            ours = np.concatenate([ragged_forward(model, ids[i:i + 4])[0][j, : len(ids[i + j])]
                                   for i in range(0, len(ids), 4) for j in range(min(4, len(ids) - i))])
        rows[name] = ours
    ref32 = np.concatenate([r[0] for r in refs])
    ref16 = np.concatenate([r[1] for r in refs])
    first = sum(len(p_) for p_ in ids[: len(PROMPTS)])
    out = {"positions": len(ref32), "test_positions": first}
    for name, x in [("transformers_bf16", ref16)] + list(rows.items()):
        top = x.argmax(-1) == ref32.argmax(-1)
        out[name] = {"agree": int(top.sum()), "agree_test_prompts": int(top[:first].sum()),
                     "max_rel_err": float(max_rel_err(x, ref32))}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
