"""Hugging Face Llama / Qwen2 / Qwen3 safetensors (single file or sharded with an index) → jeagle.

HF checkpoints already use the rotate-half RoPE layout, so q/k rows are taken as they are.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
from safetensors import safe_open
from tqdm import tqdm

from checkpoints_conv.common import assemble_target, read_config_json
from jeagle.loading.checkpoint import CheckpointError, save_checkpoint
from jeagle.config import ModelConfig

# canonical name → HF name (per-layer names take the layer index)
HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def hf_name(canonical: str) -> str:
    if canonical in HF_NAMES:
        return HF_NAMES[canonical]
    layer, name = canonical.split(".", 1)
    return f"model.layers.{layer}.{HF_LAYER_NAMES[name]}"


def read_hf_config(src: Path, dtype: str) -> ModelConfig:
    hf = read_config_json(src, "a Hugging Face model dir")
    cfg = ModelConfig.from_hf(hf, dtype=dtype, name=src.name)
    gen = src / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            extra = eos if isinstance(eos, list) else [eos]
            cfg = cfg.replace(eos_token_ids=tuple(dict.fromkeys([*cfg.eos_token_ids, *extra])))
    return cfg


def weight_files(src: Path) -> dict[str, Path]:
    """HF tensor name → the safetensors file holding it."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        files = {name: src / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{index} names {f.name}, which is missing")
        return files
    single = src / "model.safetensors"
    if not single.is_file():
        bins = sorted(src.glob("pytorch_model*.bin"))
        hint = " (found PyTorch .bin files: re-save with safetensors)" if bins else ""
        raise CheckpointError(f"{src} has neither model.safetensors nor model.safetensors.index.json{hint}")
    try:
        with safe_open(single, framework="flax") as f:
            return {name: single for name in f.keys()}
    except Exception as e:
        raise CheckpointError(f"cannot read {single}: {e}") from e


def convert_hf(src, out, *, dtype: str = "bfloat16", progress: bool = True) -> Path:
    src, out = Path(src), Path(out)
    cfg = read_hf_config(src, dtype)
    files = weight_files(src)
    handles: dict[Path, object] = {}
    cpu = jax.devices("cpu")[0]
    bar = tqdm(total=len(files), desc="reading tensors", unit="t", disable=not progress, file=sys.stderr)

    def get(canonical: str):
        name = hf_name(canonical)
        if name not in files:
            return None
        path = files[name]
        try:
            if path not in handles:
                handles[path] = safe_open(path, framework="flax")
            with jax.default_device(cpu):
                x = handles[path].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name} from {path}: {e}") from e
        bar.update(1)
        return np.asarray(x)

    params = assemble_target(cfg, get, source=str(src))
    bar.close()
    save_checkpoint(out, cfg, params, source=str(src))
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out
