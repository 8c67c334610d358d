"""PyTorch EAGLE heads (official EAGLE-1/2, EAGLE-3 from EAGLE/SpecForge/SGLang) ⇄ jeagle.

Import: `python -m checkpoints_conv eagle SRC_DIR OUT_DIR --target TARGET`
    SRC_DIR holds `config.json` and `pytorch_model.bin` (read with torch, weights_only=True) or
    `model.safetensors`. EAGLE-1 vs EAGLE-3 is told from the keys (EAGLE-3 heads have a `midlayer`
    with a `hidden_norm`, an own `lm_head` and `d2t`). A leading `model.` is stripped, `rotary_emb.*`
    buffers are ignored, and an `embed_tokens.weight` in the head must equal the target's embedding
    (the runtime always uses the target's). `t2d` is implied by `d2t` and not stored.
Export: `python -m checkpoints_conv export-eagle SRC OUT_DIR`
    writes `model.safetensors` + `config.json` in the layout SGLang and vLLM load (EAGLE-3:
    `LlamaForCausalLMEagle3` with `midlayer.*`, `d2t`, `t2d`; EAGLE-1: `LlamaForCausalLM` with
    `layers.N.*`), without the embedding, which those engines take from the target.

EAGLE-3 aux layers. jeagle's `aux_layer_ids` are the layers whose *entering* residual stream is a
feature (default {2, L//2, L-3}). SGLang/SpecForge write `eagle_config.eagle_aux_hidden_state_layer_ids`
as "output of layer i" (= entering layer i+1), so jeagle adds 1; vLLM's top-level
`eagle_aux_hidden_state_layer_ids` already means the entering layer and is used as-is.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from checkpoints_conv.cache import converted_target
from checkpoints_conv.common import read_config_json
from jeagle.loading.checkpoint import CheckpointError, save_checkpoint
from jeagle.config import ConfigError, DraftConfig, ModelConfig, default_aux_layer_ids

ARCHITECTURES = ("LlamaForCausalLM", "LlamaForCausalLMEagle", "LlamaForCausalLMEagle3", "Qwen2ForCausalLM")

# per-layer canonical suffixes shared by both head kinds (HF decoder-layer names)
LAYER_KEYS = {
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight", "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
    "input_norm": "input_layernorm.weight", "hidden_norm": "hidden_norm.weight",
}


def read_eagle_weights(src: Path) -> dict[str, np.ndarray]:
    """All tensors of a head as fp32 numpy, keys with any leading `model.` stripped."""
    bin_file, st_file = src / "pytorch_model.bin", src / "model.safetensors"
    if st_file.is_file():
        from safetensors import safe_open

        try:
            with safe_open(st_file, framework="pt") as f:
                raw = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:
            raise CheckpointError(f"cannot read {st_file}: {e}") from e
    elif bin_file.is_file():
        import torch

        try:
            raw = torch.load(bin_file, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"cannot read {bin_file}: {e}") from e
    else:
        raise CheckpointError(f"{src} has neither pytorch_model.bin nor model.safetensors")
    out = {}
    for k, t in raw.items():
        k = k[len("model."):] if k.startswith("model.") else k
        if "rotary_emb" in k:
            continue
        t = t.detach().cpu()
        out[k] = t.numpy() if not t.is_floating_point() else t.float().numpy()
    return out


def detect_kind(weights: dict[str, np.ndarray]) -> str:
    if "d2t" in weights or any("hidden_norm" in k for k in weights) or any(k.startswith("midlayer.") for k in weights):
        return "eagle3"
    if "fc.weight" in weights and any(k.startswith("layers.") for k in weights):
        return "eagle1"
    raise CheckpointError("not an EAGLE head: no fc.weight with decoder layers, nor an EAGLE-3 midlayer")


def aux_layers_from_config(hf: dict, target: ModelConfig) -> tuple[int, ...]:
    sglang = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm = hf.get("eagle_aux_hidden_state_layer_ids")
    if sglang is not None:
        return tuple(int(i) + 1 for i in sglang)
    if vllm is not None:
        return tuple(int(i) for i in vllm)
    return default_aux_layer_ids(target.num_layers)


def draft_config_from_hf(hf: dict, kind: str, weights: dict, target: ModelConfig, *, dtype: str, name: str) -> DraftConfig:
    archs = hf.get("architectures") or []
    if archs and not set(archs) & set(ARCHITECTURES):
        raise ConfigError(f"unsupported draft architecture {archs}; expected one of {ARCHITECTURES}")
    if "LlamaForCausalLMEagle3" in archs and kind != "eagle3":
        raise ConfigError("config.json says LlamaForCausalLMEagle3 but the weights are an EAGLE-1 head")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    prefix = "midlayer." if any(k.startswith("midlayer.") for k in weights) else "layers.0."
    layers = 1 if kind == "eagle3" else 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("layers."))
    if kind == "eagle3" and hf.get("num_hidden_layers", 1) != 1:
        raise ConfigError(f"EAGLE-3 heads with {hf['num_hidden_layers']} layers are not supported (one midlayer)")
    fc_in = weights["fc.weight"].shape[1]
    cfg = DraftConfig(
        kind=kind,
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        vocab_size=hf.get("vocab_size", target.vocab_size),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        fc_bias="fc.bias" in weights,
        qkv_bias=f"{prefix if kind == 'eagle3' else 'layers.0.'}self_attn.q_proj.bias" in weights,
        draft_vocab_size=weights["lm_head.weight"].shape[0] if kind == "eagle3" else 0,
        target_hidden_size=(hf.get("target_hidden_size") or fc_in // 3) if kind == "eagle3" else 0,
        aux_layer_ids=aux_layers_from_config(hf, target) if kind == "eagle3" else (),
        dtype=dtype,
        name=name,
    )
    if kind == "eagle3" and fc_in != 3 * cfg.target_hidden_size:
        raise ConfigError(f"draft fc takes {fc_in} features, config target_hidden_size {cfg.target_hidden_size} "
                          f"implies {3 * cfg.target_hidden_size}")
    if kind == "eagle1" and "bias" in hf and bool(hf["bias"]) != cfg.fc_bias:
        raise ConfigError(f"config.json says bias={hf['bias']} but fc.bias is {'present' if cfg.fc_bias else 'absent'}")
    cfg.check_target(target)
    return cfg


def assemble_draft(cfg: DraftConfig, w: dict[str, np.ndarray], src: str) -> dict[str, np.ndarray]:
    def need(key):
        if key not in w:
            raise CheckpointError(f"{src}: tensor {key!r} is missing")
        return w[key]

    prefixes = ["midlayer." if any(k.startswith("midlayer.") for k in w) else "layers.0."] if cfg.kind == "eagle3" \
        else [f"layers.{j}." for j in range(cfg.num_layers)]

    def layer(name):
        return [need(p + LAYER_KEYS[name]) for p in prefixes]

    def stack(fn):
        return np.stack(fn())

    p = {
        "fc_w": need("fc.weight").T,
        "wqkv": stack(lambda: [np.concatenate([q, k, v], 0).T for q, k, v in zip(layer("q"), layer("k"), layer("v"))]),
        "wo": stack(lambda: [o.T for o in layer("o")]),
        "mlp_norm": stack(lambda: layer("mlp_norm")),
        "w_gate_up": stack(lambda: [np.concatenate([g, u], 0).T for g, u in zip(layer("gate"), layer("up"))]),
        "w_down": stack(lambda: [d.T for d in layer("down")]),
    }
    if cfg.fc_bias:
        p["fc_b"] = need("fc.bias")
    if cfg.qkv_bias:
        p["bqkv"] = stack(lambda: [np.concatenate(b) for b in zip(layer("q_bias"), layer("k_bias"), layer("v_bias"))])
    if cfg.kind == "eagle1":
        if cfg.num_layers > 1:
            p["attn_norm"] = np.stack([need(f"layers.{j}.{LAYER_KEYS['input_norm']}") for j in range(1, cfg.num_layers)])
    else:
        p["input_norm"] = need(prefixes[0] + LAYER_KEYS["input_norm"])
        p["hidden_norm"] = need(prefixes[0] + LAYER_KEYS["hidden_norm"])
        p["final_norm"] = need("norm.weight")
        p["lm_head"] = need("lm_head.weight")
        d2t = need("d2t").astype(np.int64)
        ids = np.arange(cfg.draft_vocab_size) + d2t
        if d2t.shape != (cfg.draft_vocab_size,) or ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise CheckpointError(f"{src}: d2t maps draft ids outside the target vocabulary of {cfg.vocab_size}")
        if "t2d" in w and not np.array_equal(np.flatnonzero(w["t2d"]), np.sort(ids)):
            raise CheckpointError(f"{src}: t2d does not match d2t")
        p["d2t"] = d2t.astype(np.int32)
    return p


def convert_eagle(src, out, *, target, dtype: str = "bfloat16") -> Path:
    """Convert a PyTorch EAGLE head for the target `target` (a converted dir, HF dir or .gguf)."""
    from jeagle.loading.checkpoint import load_config, load_model

    src, out = Path(src), Path(out)
    hf = read_config_json(src, "an EAGLE head dir")
    target_dir = converted_target(str(target), quiet=True)
    target_cfg = load_config(target_dir)
    weights = read_eagle_weights(src)
    kind = detect_kind(weights)
    cfg = draft_config_from_hf(hf, kind, weights, target_cfg, dtype=dtype, name=src.name)
    if "embed_tokens.weight" in weights:
        target_embed = np.asarray(load_model(target_dir, dtype="float32").embed[...])
        head_embed = weights["embed_tokens.weight"].astype(target_embed.dtype)
        # The target may be stored in bf16: compare at the target's stored precision.
        import ml_dtypes

        cast = (lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)) if target_cfg.dtype == "bfloat16" else (lambda x: x)
        if head_embed.shape != target_embed.shape or not np.array_equal(cast(head_embed), cast(target_embed)):
            raise CheckpointError(f"{src}: the head's embed_tokens differs from the target's embedding "
                                  f"({head_embed.shape} vs {target_embed.shape}); the head was trained for another target")
    params = assemble_draft(cfg, weights, str(src))
    save_checkpoint(out, cfg, params, source=str(src))
    return out


def export_eagle(src, out) -> Path:
    """Write a converted jeagle head in the PyTorch layout SGLang and vLLM load."""
    import jax.numpy as jnp
    from flax import nnx
    from safetensors.flax import save_file

    from jeagle.loading.checkpoint import DRAFT_FORMAT, is_converted, load_draft

    src, out = Path(src), Path(out)
    if not is_converted(src, DRAFT_FORMAT):
        raise CheckpointError(f"{src} is not a converted jeagle draft")
    head = load_draft(src)  # in its stored dtype, so export → import is exact
    cfg = head.cfg
    p = {k: np.asarray(v) for k, v in nnx.to_pure_dict(nnx.state(head)).items()}
    prefixes = ["midlayer."] if cfg.kind == "eagle3" else [f"layers.{j}." for j in range(cfg.num_layers)]
    t: dict[str, np.ndarray] = {"fc.weight": p["fc_w"].T}
    if cfg.fc_bias:
        t["fc.bias"] = p["fc_b"]
    q, kv = cfg.q_size, cfg.kv_size
    for j, pre in enumerate(prefixes):
        wqkv = p["wqkv"][j].T
        t[pre + LAYER_KEYS["q"]], t[pre + LAYER_KEYS["k"]], t[pre + LAYER_KEYS["v"]] = wqkv[:q], wqkv[q:q + kv], wqkv[q + kv:]
        if cfg.qkv_bias:
            b = p["bqkv"][j]
            t[pre + LAYER_KEYS["q_bias"]], t[pre + LAYER_KEYS["k_bias"]], t[pre + LAYER_KEYS["v_bias"]] = b[:q], b[q:q + kv], b[q + kv:]
        t[pre + LAYER_KEYS["o"]] = p["wo"][j].T
        t[pre + LAYER_KEYS["mlp_norm"]] = p["mlp_norm"][j]
        gate_up = p["w_gate_up"][j].T
        t[pre + LAYER_KEYS["gate"]], t[pre + LAYER_KEYS["up"]] = np.split(gate_up, 2, axis=0)
        t[pre + LAYER_KEYS["down"]] = p["w_down"][j].T
        if cfg.kind == "eagle1" and j > 0:
            t[pre + LAYER_KEYS["input_norm"]] = p["attn_norm"][j - 1]
    hf = {
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "hidden_act": "silu", "model_type": "llama", "torch_dtype": "bfloat16",
        "max_position_embeddings": 8192, "tie_word_embeddings": False,
    }
    if cfg.kind == "eagle3":
        t[prefixes[0] + LAYER_KEYS["input_norm"]] = p["input_norm"]
        t[prefixes[0] + LAYER_KEYS["hidden_norm"]] = p["hidden_norm"]
        t["norm.weight"] = p["final_norm"]
        t["lm_head.weight"] = p["lm_head"]
        d2t = p["d2t"].astype(np.int64)
        t2d = np.zeros(cfg.vocab_size, bool)
        t2d[np.arange(cfg.draft_vocab_size) + d2t] = True
        t["d2t"], t["t2d"] = d2t, t2d
        hf.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=cfg.draft_vocab_size,
                  target_hidden_size=cfg.target_hidden_size,
                  # SGLang/SpecForge convention: output of layer i (jeagle: entering layer i + 1)
                  eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids]})
    else:
        hf.update(architectures=["LlamaForCausalLM"], bias=cfg.fc_bias)
    if cfg.qkv_bias:
        hf["attention_bias"] = True
    out.mkdir(parents=True, exist_ok=True)
    hf["torch_dtype"] = cfg.dtype
    # d2t is written as int32 (JAX without x64); SGLang and vLLM copy it into their int64 buffers.
    save_file({k: jnp.asarray(np.ascontiguousarray(v)) for k, v in t.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out
