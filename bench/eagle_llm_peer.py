"""The official EAGLE code (`eagle-llm==1.2.1`, SafeAILab/EAGLE) as a peer, on the same EAGLE-1 head.

eagle-llm 1.2.1 is EAGLE-1: an fc over [token embedding | target feature], decoder layers, the
target's lm_head, and a fixed tree (`mc_sim_7b_63`: 25 draft tokens + the root, depth 5, top-10). It
cannot load the shipped EAGLE-3 head, so this bench takes a jeagle EAGLE-1 head (trained with
`python -m jeagle.train_draft --kind eagle1`), exports it to eagle-llm's format (below), and times,
at batch 1 (eagle-llm runs one sequence only), on the same prompt token ids, greedy, EOS ignored:

    eagle-llm       EaModel.eagenerate (temperature 0), bf16, CUDA
    jeagle          target-only
    jeagle-eagle1   the same head, one row per --tiers entry (default (5,10,26): eagle-llm's 26-token
                    budget, depth 5 and top-10, as a dynamic EAGLE-2 tree; and (5,4,8))

eagle-llm's on-disk head: `config.json` (read by its `EConfig`, plus `bias` for fc.bias) and
`pytorch_model.bin` with `embed_tokens.weight` (the target's, which it keeps a copy of), `fc.*` and
`layers.N.*` (jeagle's `export-eagle` layout). Running it under transformers 5 needs call-time patches
(the package is not modified; `patch_eagle_llm`):
  1. its attention's `_init_rope` tests `config.rope_scaling is None`; in transformers 5 that is an
     alias of `rope_parameters`, so it takes the scaled path and fails (KeyError 'type'); it also
     hard-codes the RoPE base 10000. Patched: plain RoPE with the config's rope_theta.
  2. `_tied_weights_keys` is the transformers-4 list; 5 wants {target: source}.
  3. transformers 5 builds the model on the meta device, so the rotary `inv_freq` buffer (not in the
     checkpoint) and the cos/sin caches are left uninitialised (NaN / 1e26 garbage, all-zero output,
     no error). Recomputed after loading.
  4. `EaModel.__init__` loads a tokenizer from the base dir, used only for its EOS id: given a stub
     with EOS -1 (so no request stops early; every system generates exactly --max-new-tokens).
  and `.eval()` (its draft has gradient checkpointing on; in training mode it drops its KV cache).
eagenerate stops once it has passed max_new_tokens, overshooting by up to a round (depth + 1 tokens):
tokens/s counts what it generated.

    python bench/eagle_llm_peer.py --head RUN/head --prompts .data/mtbench.jsonl --num-prompts 8 \
        --json-out eagle_llm.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from common import chat_ids, device_kind, emit, git_commit, plain_hf_model, read_prompts


def patch_eagle_llm() -> None:
    """Call-time patches for eagle-llm 1.2.1 under transformers 5 (see the module docstring)."""
    import eagle.model.cnets as cnets
    import eagle.model.ea_model as ea
    import eagle.model.modeling_llama_kv as kv

    if getattr(ea, "_jeagle_patched", False):
        return

    def init_rope(mod):
        def _init_rope(self):
            params = getattr(self.config, "rope_parameters", None) or {}
            kind = params.get("rope_type", params.get("type", "default"))
            if kind != "default":
                raise NotImplementedError(f"eagle-llm peer: rope_type {kind!r} is not supported")
            theta = float(params.get("rope_theta", getattr(self.config, "rope_theta", 10000.0)))
            self.rotary_emb = mod.LlamaRotaryEmbedding(self.head_dim, max_position_embeddings=self.max_position_embeddings,
                                                       base=theta)
        return _init_rope

    kv.LlamaAttention._init_rope = init_rope(kv)
    cnets.LlamaAttention._init_rope = init_rope(cnets)
    kv.LlamaForCausalLM._tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    class NoEosTokenizer:
        eos_token_id = -1

    class Auto:
        @staticmethod
        def from_pretrained(*_a, **_k):
            return NoEosTokenizer()

    ea.AutoTokenizer = Auto
    ea._jeagle_patched = True


def fix_rotary(model) -> None:
    """Recompute every rotary embedding's inv_freq and cos/sin caches (patch 3) on the model's device."""
    import eagle.model.cnets as cnets
    import eagle.model.modeling_llama_kv as kv
    import torch

    dev = next(model.parameters()).device
    for m in model.modules():
        if isinstance(m, (kv.LlamaRotaryEmbedding, cnets.LlamaRotaryEmbedding)):
            m.inv_freq = 1.0 / (m.base ** (torch.arange(0, m.dim, 2, device=dev).float() / m.dim))
            m._set_cos_sin_cache(seq_len=m.max_position_embeddings, device=dev, dtype=torch.float32)


def export_for_eagle_llm(head_dir: Path, embed: np.ndarray, out: Path) -> Path:
    """A jeagle EAGLE-1 head in eagle-llm's format: export-eagle's tensors + the target's embedding,
    as pytorch_model.bin, and its config.json."""
    import torch
    from safetensors.numpy import load_file

    from checkpoints_conv.eagle import export_eagle

    export_eagle(head_dir, out)
    hf = json.loads((out / "config.json").read_text())
    if hf.get("architectures") != ["LlamaForCausalLM"] or "bias" not in hf:
        raise SystemExit(f"{head_dir}: eagle-llm 1.2.1 runs EAGLE-1 heads only; this is {hf.get('architectures')}")
    if hf["head_dim"] * hf["num_attention_heads"] != hf["hidden_size"]:
        raise SystemExit("eagle-llm derives head_dim = hidden_size / heads; this head differs")
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v).astype(np.float32)) for k, v in
               load_file(str(out / "model.safetensors")).items()}
    tensors["embed_tokens.weight"] = torch.from_numpy(np.ascontiguousarray(embed, dtype=np.float32))
    torch.save(tensors, out / "pytorch_model.bin")
    (out / "model.safetensors").unlink()
    return out


def load_eagle_llm(base_dir: Path, head_dir: Path, device: str, dtype):
    import torch

    patch_eagle_llm()
    from eagle.model.ea_model import EaModel
    from eagle.model.modeling_llama_kv import LlamaForCausalLM as KVLlama

    base = KVLlama.from_pretrained(str(base_dir), dtype=dtype).to(device)
    fix_rotary(base)
    model = EaModel(base, str(base_dir), str(head_dir / "config.json"))
    state = torch.load(head_dir / "pytorch_model.bin", map_location=device, weights_only=True)
    model.ea_layer.load_state_dict(state, strict=True)
    fix_rotary(model.ea_layer)
    return model.eval()


def smollm2_hf_dir(out: Path) -> Path:
    """SmolLM2-135M-Instruct as a transformers dir: its GGUF dequantised to bf16 (what the hf peer of
    decode.py runs)."""
    from jeagle.loading.fetch import smollm2_gguf_path

    plain_hf_model(smollm2_gguf_path(quiet=True)).save_pretrained(out)
    return out


def agreement(a: list[int], b: list[int]) -> int:
    """Length of the common prefix."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, help="a jeagle EAGLE-1 draft dir")
    p.add_argument("--target", default=None, help="a Hugging Face Llama dir (default: SmolLM2-135M-Instruct from its GGUF)")
    p.add_argument("--prompts", default=None)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--tiers", default="5,10,26:5,4,8", help="jeagle-eagle1 tiers, S,K,N:S,K,N")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a code-path check")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="every system's weights")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    import jax
    import torch

    from jeagle.loading.checkpoint import load_draft, load_model
    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.loading.fetch import resolve_draft, resolve_target
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams
    from jeagle.speculative.round import SpecConfig
    from jeagle.loading.tokenizer import Tokenizer

    if args.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")
    target_dir = resolve_target(args.target, dtype=args.dtype, quiet=True)
    head_dir = resolve_draft(args.head, target_dir, dtype=args.dtype, quiet=True)
    model = load_model(target_dir)
    head = load_draft(head_dir, target=model.cfg)
    if head.cfg.kind != "eagle1":
        raise SystemExit(f"{args.head}: an {head.cfg.kind} head; eagle-llm 1.2.1 runs EAGLE-1 heads only")
    if args.prompts:
        tok = Tokenizer.from_dir(target_dir)
        texts = read_prompts(args.prompts, "")[: args.num_prompts]
        prompts = chat_ids(tok, texts)
    else:  # a code-path check without a tokenizer
        rng = np.random.default_rng(0)
        prompts = [rng.integers(4, model.cfg.vocab_size, 12).tolist() for _ in range(args.num_prompts)]
    n_new = args.max_new_tokens
    doc = {"bench": "eagle_llm_peer", "model": target_dir.name, "dtype": args.dtype, "head": str(args.head), "prompts": args.prompts,
           "num_prompts": len(prompts), "max_new_tokens": n_new, "batch": 1,
           "device": device_kind(), "jax": jax.__version__, "torch": torch.__version__,
           "commit": git_commit(), "rows": []}

    # jeagle: the target alone, then the same head at each tier; batch 1, one prompt after another.
    ec = EngineConfig(max_batch_size=1, batch_buckets=(1,), max_context=max(map(len, prompts)) + n_new + 256,
                      kernels=KernelSettings.from_env())
    sp = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
    systems = {"jeagle": (target_only(model, ec), None)}
    for t in args.tiers.split(":"):
        tier = tuple(int(x) for x in t.split(","))
        systems[f"jeagle-eagle1 {tier}"] = (speculative(model, head, ec, SpecConfig(*tier)), tier)
    reference = None
    for name, (eng, tier) in systems.items():
        eng.warmup(batch_sizes=[1], greedy=(True,), progress=False)  # every prefill length and KV bucket
        eng.generate([prompts[0]], sp)
        outs, secs, acc = [], 0.0, []
        for ids in prompts:
            t0 = time.perf_counter()
            out = eng.generate([ids], sp)[0].token_ids
            secs += time.perf_counter() - t0
            if eng.last_stats.compile_s:
                raise RuntimeError(f"{name}: a timed run compiled")
            outs.append(out)
            acc.append(eng.last_stats.accept_length)
        row = {"system": name, "tokens_per_s": round(len(prompts) * n_new / secs, 1)}
        if tier:
            row |= {"tier": list(tier), "accept_length": round(statistics.mean(acc), 3)}
        if reference is None:
            reference = outs
        row["common_prefix_with_jeagle_target_only"] = [agreement(o, r) for o, r in zip(outs, reference)]
        doc["rows"].append(row)
        print(json.dumps(row), flush=True)

    # eagle-llm on the same head and prompt ids.
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.target) if args.target else smollm2_hf_dir(Path(tmp) / "base")
        embed = np.asarray(jax.device_get(model.embed[...]), np.float32)
        ea_head = export_for_eagle_llm(head_dir, embed, Path(tmp) / "head")
        ea = load_eagle_llm(base, ea_head, args.device, getattr(torch, args.dtype))
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        first = torch.tensor([prompts[0]], device=args.device)
        ea.eagenerate(first, temperature=0.0, max_new_tokens=n_new)  # warm-up
        outs, secs, made = [], 0.0, 0
        steps = []
        import eagle.model.ea_model as eam

        update = eam.update_inference_inputs
        count = [0]

        def counted(*a, **k):
            count[0] += 1
            return update(*a, **k)

        eam.update_inference_inputs = counted
        try:
            for ids in prompts:
                x = torch.tensor([ids], device=args.device)
                count[0] = 0
                sync()
                t0 = time.perf_counter()
                y = ea.eagenerate(x, temperature=0.0, max_new_tokens=n_new)
                sync()
                secs += time.perf_counter() - t0
                new = y[0, len(ids):].tolist()
                made += len(new)
                steps.append(len(new) / max(count[0], 1))
                outs.append(new[:n_new])
        finally:
            eam.update_inference_inputs = update
    row = {"system": "eagle-llm", "tokens_per_s": round(made / secs, 1), "accept_length": round(statistics.mean(steps), 3),
           "tree": "mc_sim_7b_63 (26 tokens, depth 5, top-10)", "dtype": args.dtype,
           "common_prefix_with_jeagle_target_only": [agreement(o, r) for o, r in zip(outs, reference)]}
    doc["rows"].append(row)
    print(json.dumps(row), flush=True)
    base_tps = doc["rows"][0]["tokens_per_s"]
    print(f"\n{'system':<26} {'tokens/s':>9} {'vs jeagle':>9} {'accept':>7}  common prefix with jeagle target-only")
    for r in doc["rows"]:
        r["vs_jeagle_target_only"] = round(r["tokens_per_s"] / base_tps, 2)
        print(f"{r['system']:<26} {r['tokens_per_s']:>9.1f} {r['vs_jeagle_target_only']:>9} {r.get('accept_length', ''):>7}  "
              f"{r['common_prefix_with_jeagle_target_only']}")
    emit(doc, args.json_out)
    return doc


if __name__ == "__main__":
    main()
