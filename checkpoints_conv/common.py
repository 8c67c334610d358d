"""What the target converters share: canonical tensor names → jeagle's fused, stacked layout.

Each source format maps its own names to the canonical per-tensor names below (a declarative table
in hf.py and gguf.py); `assemble_target` then transposes to [in, out], fuses q|k|v and gate|up, and
stacks layers. Canonical tensors are in the PyTorch [out, in] layout with HF's rotate-half RoPE.

    embed, final_norm, lm_head (optional)
    per layer i: "{i}.attn_norm", "{i}.q", "{i}.k", "{i}.v", "{i}.o", "{i}.q_bias", "{i}.k_bias",
                 "{i}.v_bias", "{i}.o_bias", "{i}.q_norm", "{i}.k_norm", "{i}.mlp_norm",
                 "{i}.gate", "{i}.up", "{i}.down"
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from jeagle.loading.checkpoint import CheckpointError
from jeagle.config import ModelConfig

Getter = Callable[[str], "np.ndarray | None"]


def read_config_json(src: Path, what: str) -> dict:
    """`src/config.json` as a dict; a clear CheckpointError naming `what` the dir should be."""
    cfg_file = Path(src) / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{src} is not {what}: {cfg_file} is missing")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from e


def assemble_target(cfg: ModelConfig, get: Getter, *, source: str) -> dict[str, np.ndarray]:
    """Build jeagle's parameter dict from a getter of canonical tensors (None when absent)."""

    def need(name: str) -> np.ndarray:
        x = get(name)
        if x is None:
            raise CheckpointError(f"{source}: tensor {name!r} is missing")
        return np.asarray(x)

    def stack(fn) -> np.ndarray:
        return np.stack([fn(i) for i in range(cfg.num_layers)])

    params: dict[str, np.ndarray] = {
        "embed": need("embed"),
        "final_norm": need("final_norm"),
        "attn_norm": stack(lambda i: need(f"{i}.attn_norm")),
        "mlp_norm": stack(lambda i: need(f"{i}.mlp_norm")),
        "wqkv": stack(lambda i: np.concatenate([need(f"{i}.q"), need(f"{i}.k"), need(f"{i}.v")], 0).T),
        "wo": stack(lambda i: need(f"{i}.o").T),
        "w_gate_up": stack(lambda i: np.concatenate([need(f"{i}.gate"), need(f"{i}.up")], 0).T),
        "w_down": stack(lambda i: need(f"{i}.down").T),
    }
    if cfg.qkv_bias:
        params["bqkv"] = stack(lambda i: np.concatenate([need(f"{i}.q_bias"), need(f"{i}.k_bias"), need(f"{i}.v_bias")]))
    if cfg.o_bias:
        params["bo"] = stack(lambda i: need(f"{i}.o_bias"))
    if cfg.qk_norm:
        params["q_norm"] = stack(lambda i: need(f"{i}.q_norm"))
        params["k_norm"] = stack(lambda i: need(f"{i}.k_norm"))
    if not cfg.tie_word_embeddings:
        params["lm_head"] = need("lm_head")
    return params
