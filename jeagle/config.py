"""Frozen, hashable configs: the target model's architecture.

A `ModelConfig` is static under jit (it is hashed into the compilation cache key), so every field is
an immutable value. `from_hf` reads a Hugging Face `config.json` dict (transformers 4.x `rope_scaling`
and 5.x `rope_parameters` spellings both); `to_dict`/`from_dict` round-trip jeagle's own config file.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Architectures the target model implements, keyed by Hugging Face `model_type`.
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
DTYPES = ("bfloat16", "float32", "float16")
DTYPE_CHOICES = ("auto",) + DTYPES  # what the entry points accept: "auto" resolves per backend (auto_dtype)


def auto_dtype(platform: str) -> str:
    """The dtype `--dtype auto` means on a JAX platform: bfloat16 where the hardware computes it natively
    (GPU, TPU), float32 elsewhere. XLA on a CPU emulates bf16 matmuls by rounding fp32 results, and
    small models then pick visibly worse tokens at near ties (SmolLM2 answers "What is the capital of
    France?" with French nonsense in bf16 on a CPU, "Paris" in fp32)."""
    return "bfloat16" if platform in ("gpu", "tpu", "cuda", "rocm") else "float32"


class ConfigError(ValueError):
    """A model config that jeagle cannot run; the message names the field."""


class _ConfigFile:
    """What the target and draft configs share: attention sizes and the JSON file round trip.
    Subclasses set FORMAT and TUPLE_FIELDS (list-valued in JSON, tuples in the frozen config)."""

    FORMAT = ""
    TUPLE_FIELDS: tuple[str, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for name in self.TUPLE_FIELDS:
            d[name] = list(d[name])
        return {"format": self.FORMAT, **d}

    @classmethod
    def _fields_from_dict(cls, d: dict[str, Any]) -> dict[str, Any]:
        d = dict(d)
        fmt = d.pop("format", cls.FORMAT)
        if fmt != cls.FORMAT:
            raise ConfigError(f"config format {fmt!r}, expected {cls.FORMAT!r}")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown config keys {sorted(unknown)}")
        for name in cls.TUPLE_FIELDS:
            d[name] = tuple(d.get(name, ()))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        return cls(**cls._fields_from_dict(d))

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path):
        try:
            d = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(d)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: "llama3", "linear", or "freq_factors" (per-frequency divisors, as
    llama.cpp stores Llama 3.1's scaling in the GGUF tensor `rope_freqs.weight`)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelConfig(_ConfigFile):
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"  # weights and activations; norms, softmax and logits are fp32
    name: str = ""

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ConfigError(f"unsupported architecture {self.arch!r}; jeagle supports {SUPPORTED_ARCHS}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} not in {DTYPES}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even for RoPE")

    FORMAT = "jeagle-target-v1"
    TUPLE_FIELDS = ("eos_token_ids",)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = cls._fields_from_dict(d)
        if d.get("rope_scaling") is not None:
            rs = dict(d["rope_scaling"])
            rs["freq_factors"] = tuple(rs.get("freq_factors", ()))
            d["rope_scaling"] = RopeScaling(**rs)
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, dtype: str = "bfloat16", name: str = "") -> "ModelConfig":
        """Read a Hugging Face config.json dict (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)."""
        arch = hf.get("model_type")
        if arch not in SUPPORTED_ARCHS:
            archs = hf.get("architectures")
            raise ConfigError(f"unsupported architecture: model_type={arch!r} architectures={archs}; "
                              f"jeagle supports model_type in {SUPPORTED_ARCHS}")
        if hf.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported")
        if arch == "qwen2" and hf.get("use_sliding_window"):
            raise ConfigError("Qwen2 with use_sliding_window=true is not supported")
        if arch == "qwen3" and hf.get("use_sliding_window"):
            raise ConfigError("Qwen3 with use_sliding_window=true is not supported")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act={act!r} is not supported (only silu)")
        hidden = hf["hidden_size"]
        heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=parse_rope_scaling(scaling),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            o_bias=arch == "llama" and bool(hf.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=dtype,
            name=name,
        )


def parse_rope_scaling(d: dict[str, Any] | None) -> RopeScaling | None:
    if not d:
        return None
    kind = d.get("rope_type") or d.get("type")
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(d["factor"]),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
        )
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(d["factor"]))
    raise ConfigError(f"unsupported rope scaling type {kind!r} (supported: llama3, linear)")


def rope_inv_freq(cfg_head_dim: int, theta: float, scaling: RopeScaling | None) -> "list[float]":
    """Inverse frequencies (head_dim/2,) in float64, with llama3/linear scaling applied."""
    half = cfg_head_dim // 2
    inv = [1.0 / theta ** (2 * i / cfg_head_dim) for i in range(half)]
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return [f / scaling.factor for f in inv]
    if scaling.kind == "freq_factors":
        if len(scaling.freq_factors) != half:
            raise ConfigError(f"rope freq_factors has {len(scaling.freq_factors)} entries, head_dim/2 is {half}")
        return [f / s for f, s in zip(inv, scaling.freq_factors)]
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / scaling.factor)
        else:
            smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor)
            out.append((1 - smooth) * f / scaling.factor + smooth * f)
    return out



DRAFT_KINDS = ("eagle1", "eagle3")


@dataclass(frozen=True)
class DraftConfig(_ConfigFile):
    """An EAGLE draft head. `eagle1` covers EAGLE-1/2 heads (same weights; EAGLE-2 differs only in
    the dynamic tree). `aux_layer_ids` (EAGLE-3): the target layers whose *entering* residual stream
    is concatenated low|mid|high as the draft's input feature (jeagle's convention, see README)."""

    kind: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    fc_bias: bool = False
    qkv_bias: bool = False
    draft_vocab_size: int = 0  # EAGLE-3 lm_head size (0 for EAGLE-1, which uses the target's head)
    target_hidden_size: int = 0
    aux_layer_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    name: str = ""

    # The attention helpers read these off any config.
    o_bias = False
    qk_norm = False

    def __post_init__(self):
        if self.kind not in DRAFT_KINDS:
            raise ConfigError(f"unknown draft kind {self.kind!r}; expected one of {DRAFT_KINDS}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} not in {DTYPES}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"draft num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.kind == "eagle3" and (not self.draft_vocab_size or len(self.aux_layer_ids) != 3):
            raise ConfigError("an EAGLE-3 draft needs draft_vocab_size and three aux_layer_ids")

    FORMAT = "jeagle-draft-v1"
    TUPLE_FIELDS = ("aux_layer_ids",)

    @property
    def rope_scaling(self):
        return None  # EAGLE heads use plain RoPE with their own theta

    def check_target(self, target: ModelConfig) -> None:
        """A clear error, naming both sides, when this head cannot run on `target`."""
        if self.vocab_size != target.vocab_size:
            raise ConfigError(f"draft vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}")
        if self.kind == "eagle1" and self.hidden_size != target.hidden_size:
            raise ConfigError(f"draft hidden_size {self.hidden_size} != target hidden_size {target.hidden_size} "
                              "(an EAGLE-1/2 head reads the target's hidden state and embedding)")
        if self.kind == "eagle3":
            if self.target_hidden_size != target.hidden_size:
                raise ConfigError(f"draft fc expects target hidden size {self.target_hidden_size} "
                                  f"(3 x {self.target_hidden_size} features), the target has {target.hidden_size}")
            if self.hidden_size != target.hidden_size:
                raise ConfigError(f"draft hidden_size {self.hidden_size} != target hidden_size "
                                  f"{target.hidden_size} (the head embeds tokens with the target's embedding)")
            bad = [i for i in self.aux_layer_ids if not 0 <= i < target.num_layers]
            if bad:
                raise ConfigError(f"draft aux layers {list(self.aux_layer_ids)}: {bad} outside the target's "
                                  f"{target.num_layers} layers")


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default features: the residual stream entering layers 2, L//2 and L-3."""
    return (2, num_layers // 2, num_layers - 3)
