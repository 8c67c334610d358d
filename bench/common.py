"""What the bench scripts share: the repository on sys.path, the model shapes they build at random,
prompt loading, the timing loop, trace parsing, and the run's identity (commit, device) and output.

Importing this module puts the repository root on sys.path, so a script run as `python bench/x.py`
(or `python bench/probes/x.py`, which first puts bench/ on the path) can import jeagle, checkpoints_conv
and tests without installing them. Everything here imports JAX lazily: `--help` stays fast.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHAPES = {
    # SmolLM2-135M-Instruct
    "smollm2": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True,
                    max_position_embeddings=8192, rms_norm_eps=1e-5),
    # Llama-3.1-8B
    "llama8b": dict(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                    num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192,
                    rms_norm_eps=1e-5),
    # a CPU smoke-test shape for the bench scripts (numbers meaningless)
    "tiny": dict(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True,
                 max_position_embeddings=2048, rms_norm_eps=1e-5),
}


# ---- the run's identity and output ----------------------------------------------------------------------
def git_commit() -> str:
    """JEAGLE_COMMIT (the GPU runner gets a copy of the tree without .git), else git's HEAD, else "unknown"."""
    if os.environ.get("JEAGLE_COMMIT"):
        return os.environ["JEAGLE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def device_kind() -> str:
    """The first JAX device's kind ("NVIDIA H100 80GB HBM3"; on CPU the platform)."""
    import jax

    dev = jax.devices()[0]
    return getattr(dev, "device_kind", dev.platform)


def emit(doc: dict, json_out: str | None = None) -> None:
    """Write `doc` to `json_out` (indented) when given, then print it as the last line (one JSON document)."""
    if json_out:
        Path(json_out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))


# ---- prompts --------------------------------------------------------------------------------------------
def read_prompts(path: str | None, fallback: str) -> list[str]:
    """The prompts of a .jsonl file (a "prompt" field per line, or a bare string); [fallback] without one."""
    if not path:
        return [fallback]
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    return [r["prompt"] if isinstance(r, dict) else str(r) for r in rows]


def chat_ids(tok, texts: list[str]) -> list[list[int]]:
    """Each text as one user turn through the tokenizer's chat template."""
    return [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]


def prompt_logits(model, ids: list[int], last_only: bool = True):
    """The target's logits over `ids` from one prefill-shaped forward, float64 on the host: the
    next-token logits [V] after `ids` (last_only), else every position's [T, V]."""
    import jax.numpy as jnp
    import numpy as np

    from jeagle.cache import init_pools
    from jeagle.models.common import AttnInputs

    t = len(ids)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    k, v = init_pools(model.cfg, num_slots=t + 2)
    attn = AttnInputs(positions=pos, write_slots=pos + 1, kv_slots=pos + 1, kv_len=jnp.asarray([t], jnp.int32))
    out = model(jnp.asarray([ids], jnp.int32), attn, k, v,
                logits_index=jnp.asarray([t - 1], jnp.int32) if last_only else None)
    return np.asarray(out.logits[0], np.float64)


# ---- timing ---------------------------------------------------------------------------------------------
def median_run(fn, repeats: int) -> tuple[float, dict]:
    """fn() -> (new tokens, info); returns (tokens/s, info) of the median run."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n, info = fn()
        runs.append((n / (time.perf_counter() - t0), info))
    runs.sort(key=lambda r: r[0])
    return runs[len(runs) // 2]


# ---- random models of a named shape ---------------------------------------------------------------------
def random_eagle3_head(cfg, seed: int = 1):
    """A one-layer EAGLE-3 head shaped for `cfg` (32k draft vocabulary, as the published 8B heads)."""
    from jeagle.config import DraftConfig
    from jeagle.models.eagle import random_draft

    n = cfg.num_layers
    return random_draft(DraftConfig(kind="eagle3", hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                                    num_layers=1, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                                    draft_vocab_size=min(32000, cfg.vocab_size), target_hidden_size=cfg.hidden_size,
                                    aux_layer_ids=(min(2, n - 1), n // 2, max(n - 3, 0)), rope_theta=cfg.rope_theta,
                                    rms_norm_eps=cfg.rms_norm_eps), seed=seed)


def random_target_and_head(shape: str):
    """A random-weight target of a named shape and a random one-layer EAGLE-1 head for it: what the
    speculative benches time (a round's cost depends on shapes, not weights)."""
    from jeagle.config import DraftConfig, ModelConfig
    from jeagle.models.eagle import random_draft
    from jeagle.models.llama import random_model

    cfg = ModelConfig(**SHAPES[shape])
    head = random_draft(DraftConfig(kind="eagle1", hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                                    num_layers=1, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, fc_bias=True), seed=1)
    return random_model(cfg), head


def phased_models(shape: str, mid_noise: float, seed: int = 0):
    """(target, {phase: head params}, head graph) with acceptance made, not found (bench/adaptive.py's
    workload, also bench/serve.py's): the target has `shape`'s sizes (so every step costs what that
    model's does) with its attention and MLP outputs zeroed and its lm_head a row permutation of its
    embedding, which makes its next token a fixed permutation of the current one; a one-layer EAGLE-1
    head whose fc maps the token embedding through (identity + noise) proposes that function with a
    chosen error rate. Phases (same graph, new values):

        high   the noiseless head: the target's own next token at every depth (accepts everything)
        mid    fc noise `mid_noise`: partial acceptance
        low    the sign-flipped head: never the target's token (accepts nothing)
    """
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jeagle.config import DraftConfig, ModelConfig
    from jeagle.models.eagle import random_draft
    from jeagle.models.llama import random_model

    # Untied: lm_head = the embedding rows permuted, so the next token is perm⁻¹(token) (a tied head
    # would make every token its own successor). The step reads the same bytes as a tied head.
    cfg = ModelConfig(**{**SHAPES[shape], "tie_word_embeddings": False})
    target = random_model(cfg, seed)
    e = np.asarray(target.embed[...], np.float32)
    e /= np.sqrt((e * e).mean(-1, keepdims=True))
    target.embed[...] = jnp.asarray(e, target.embed[...].dtype)
    target.lm_head[...] = jnp.asarray(e[np.random.default_rng(seed).permutation(len(e))], target.lm_head[...].dtype)
    target.wo[...] = jnp.zeros_like(target.wo[...])
    target.w_down[...] = jnp.zeros_like(target.w_down[...])

    dcfg = DraftConfig(kind="eagle1", hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_layers=1, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       vocab_size=cfg.vocab_size, fc_bias=False, dtype=cfg.dtype)
    h = cfg.hidden_size
    params = {}
    graph = None
    for phase, (sign, noise) in {"high": (1.0, 0.0), "mid": (1.0, mid_noise), "low": (-1.0, 0.0)}.items():
        head = random_draft(dcfg, seed + 1)
        fc = np.zeros((2 * h, h), np.float32)
        fc[:h] = sign * np.eye(h)
        fc += noise * np.random.default_rng(seed + 2).standard_normal(fc.shape).astype(np.float32)
        head.fc_w[...] = jnp.asarray(fc, head.fc_w[...].dtype)
        head.wo[...] = jnp.zeros_like(head.wo[...])
        head.w_down[...] = jnp.zeros_like(head.w_down[...])
        graph, params[phase] = nnx.split(head)
    return target, params, nnx.merge(graph, params["high"])


def plain_hf_model(gguf: Path, dtype: str = "bfloat16"):
    """SmolLM2 from its GGUF as a plain (unquantized) transformers model: dequantised on load, then the
    same weights in a model without the GGUF quantization config (which blocks save_pretrained, needed by
    eagle_llm_peer.py; both peers then run the very same model object type and weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    plain = type(loaded)(config).to(getattr(torch, dtype))
    plain.load_state_dict(loaded.state_dict())
    return plain


# ---- profiler traces ------------------------------------------------------------------------------------
def device_events(trace_dir: str):
    """(name, duration_us) of every op the trace puts on a GPU stream."""
    return [e for evs in device_events_by_device(trace_dir).values() for e in evs]


def device_events_by_device(trace_dir: str, with_module: bool = False) -> dict[str, list[tuple]]:
    """{device process name: [(name, duration_us), ...]} of the ops the trace puts on GPU streams;
    with_module: [(name, duration_us, start_us, hlo module or "")] (the module: which executable ran it)."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    files += glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        raise RuntimeError(f"no trace json under {trace_dir}")
    with gzip.open(sorted(files)[-1]) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    gpu_pids = {e["pid"]: str(e["args"]["name"]) for e in events if e.get("ph") == "M"
                and e.get("name") == "process_name" and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    out: dict[str, list[tuple]] = {name: [] for name in gpu_pids.values()}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids:
            dur = float(e.get("dur", 0))
            if with_module:
                args = e.get("args") or {}
                out[gpu_pids[e["pid"]]].append((e["name"], dur, float(e.get("ts", 0)), str(args.get("hlo_module", ""))))
            else:
                out[gpu_pids[e["pid"]]].append((e["name"], dur))
    return out
