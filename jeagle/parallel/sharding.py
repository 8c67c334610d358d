"""Tensor parallelism with JAX's SPMD partitioner: one table from logical axes to mesh axes, and the
placement of a target's weights and KV pools on a mesh (Megatron-style).

    attention   q|k|v columns by heads (column-parallel), wo by its input rows (row-parallel: one
                all-reduce per layer); KV pools by KV heads, so each device holds its heads' cache
    MLP         gate|up columns by the intermediate dimension, w_down by its rows (one all-reduce)
    vocabulary  lm_head (and a tied embedding) by vocabulary rows; logits come out vocabulary-sharded
                and the sampler's reductions gather them
    the rest    norms, biases of replicated outputs, the slot table and request rows: replicated

The fused matmuls of `models/` keep one matmul per layer for q|k|v and gate|up. For a contiguous
column split to give every device whole heads, the fused columns are re-laid out per shard
([q_s | k_s | v_s], [gate_s | up_s]; `interleave`) and the model told its group count (`tp_groups`),
which `qkv_rope` and `mlp_sublayer` split by. Correctness never depends on the table: the
partitioner preserves semantics for any sharding; the table decides the communication.

The engines (`EngineConfig.tp`, `--tp`) place their state with this module and compile every
executable for the mesh (`jax.set_mesh`) with output shardings that keep the state where it lives
(Engine._lower). The partitioner cannot split a Pallas (Triton) custom call: it would gather the
operands whole onto every device, KV pools included. The paged-attention kernel therefore runs under
`shard_map` per KV-head shard (`over_kv_heads`): each device attends its own heads over its own part
of the pools, and nothing is communicated. The other kernels read only replicated bookkeeping (the
slot table, the tree, argmax tokens) and run replicated as they are.
Two places where the partitioner's own choice measured slow on GPUs are written out by hand:
`embed_rows` (Megatron's vocabulary-parallel embedding lookup) and `whole_vocab` (the samplers' sort
and cumsum on whole vocabulary rows).
The draft head is split like a target layer when it divides (`EngineConfig.tp_draft = "auto"`, the
default), or always replicated ("replicate") or always split ("shard"). Split, it goes like a target
layer ("shard": its q|k|v, o, gate|up and down by heads / the intermediate dimension; fc and norms
replicated; an EAGLE-3 head's own lm_head follows `tp_vocab`); its pools split by KV heads when they
divide. The target's lm_head and embedding are split by vocabulary rows by default or replicated
(`tp_vocab = "replicate"`: the logits need no gather, but every device reads the whole lm_head).
Both choices are measured by bench/scale.py --tp-variants. Tests: tests/test_sharding.py (4 virtual CPU devices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

TP = "tp"

# Logical axes of every target parameter (models/llama.py's layout), and where each axis goes.
TARGET_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("vocab", "embed"),
    "final_norm": ("embed",),
    "attn_norm": ("layers", "embed"),
    "mlp_norm": ("layers", "embed"),
    "wqkv": ("layers", "embed", "qkv"),
    "bqkv": ("layers", "qkv"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "wo": ("layers", "heads", "embed"),
    "bo": ("layers", "embed"),
    "w_gate_up": ("layers", "embed", "mlp2"),
    "w_down": ("layers", "mlp", "embed"),
}
KV_POOL_AXES = ("layers", "slots", "kv_heads", "head_dim")
RULES = {"qkv": TP, "heads": TP, "kv_heads": TP, "mlp": TP, "mlp2": TP, "vocab": TP}
# The draft head's parameters (models/eagle.py); its decoder layers use the target's layer axes.
DRAFT_AXES = {
    "fc_w": ("fc_in", "embed"),
    "fc_b": ("embed",),
    "attn_norm": ("layers", "embed"),
    "input_norm": ("embed",),
    "hidden_norm": ("embed",),
    "final_norm": ("embed",),
    "lm_head": ("vocab", "embed"),
    "d2t": ("draft_vocab_ids",),
} | {k: TARGET_AXES[k] for k in ("wqkv", "bqkv", "wo", "mlp_norm", "w_gate_up", "w_down")}
TP_DRAFT = ("auto", "replicate", "shard")  # auto: split when the head divides, else replicated
TP_VOCAB = ("shard", "replicate")


def rules(vocab: str = "shard") -> dict:
    """RULES with the vocabulary axis split ("shard") or replicated ("replicate")."""
    if vocab not in TP_VOCAB:
        raise ValueError(f"tp_vocab must be one of {TP_VOCAB}, got {vocab!r}")
    return RULES if vocab == "shard" else {k: v for k, v in RULES.items() if k != "vocab"}


def make_mesh(tp: int, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if tp > len(devices):
        raise ValueError(f"--tp {tp}: only {len(devices)} devices are visible")
    return Mesh(np.asarray(devices[:tp]), (TP,))


def spec(axes: tuple[str, ...], rules=RULES) -> P:
    return P(*(rules.get(a) for a in axes))


def check_divisible(cfg, tp: int, *, vocab: bool = True, what_model: str = "target") -> None:
    """Clear errors for a model that cannot be split `tp` ways by heads and MLP (and vocabulary)."""
    sizes = [("num_kv_heads", cfg.num_kv_heads), ("num_heads", cfg.num_heads),
             ("intermediate_size", cfg.intermediate_size)]
    if vocab:
        sizes.append(("vocab_size", cfg.vocab_size))
    for what, n in sizes:
        if n % tp:
            hint = {"vocab_size": " (tp_vocab='replicate' keeps the vocabulary whole)"}.get(what, "")
            if what_model == "draft":
                hint = " (tp_draft='replicate' keeps the head whole)"
            raise ValueError(f"tensor parallelism {tp}: the {what_model}'s {what} {n} is not divisible by {tp}{hint}")


def interleave(params: dict, cfg, tp: int) -> dict:
    """Fused q|k|v and gate|up columns re-laid out per shard ([q_s|k_s|v_s] and [gate_s|up_s])."""
    out = dict(params)
    qs, ks = cfg.q_size, cfg.kv_size

    def qkv(w):
        lead = w.shape[:-1]
        q = w[..., :qs].reshape(*lead, tp, qs // tp)
        k = w[..., qs:qs + ks].reshape(*lead, tp, ks // tp)
        v = w[..., qs + ks:].reshape(*lead, tp, ks // tp)
        return jnp.concatenate([q, k, v], -1).reshape(*lead, -1)

    def gate_up(w):
        lead, i = w.shape[:-1], w.shape[-1] // 2
        g = w[..., :i].reshape(*lead, tp, i // tp)
        u = w[..., i:].reshape(*lead, tp, i // tp)
        return jnp.concatenate([g, u], -1).reshape(*lead, -1)

    for name, fn in (("wqkv", qkv), ("bqkv", qkv), ("w_gate_up", gate_up)):
        if out.get(name) is not None:
            out[name] = fn(jnp.asarray(out[name]))
    return out


def _place(module, axes: dict, mesh: Mesh, table: dict):
    tp = mesh.shape[TP]
    graphdef, state = nnx.split(module)
    pure = interleave(nnx.to_pure_dict(state), module.cfg, tp)
    placed = {k: jax.device_put(v, NamedSharding(mesh, spec(axes[k], table))) for k, v in pure.items()}
    nnx.replace_by_pure_dict(state, placed)
    sharded = nnx.merge(graphdef, state)
    sharded.tp_groups = tp
    sharded.vocab_split = table.get("vocab") == TP
    return sharded


def shard_target(model, mesh: Mesh, vocab: str = "shard"):
    """The target with its weights re-laid out and placed on `mesh` by TARGET_AXES (the vocabulary
    split or replicated)."""
    table = rules(vocab)
    check_divisible(model.cfg, mesh.shape[TP], vocab=vocab == "shard")
    return _place(model, TARGET_AXES, mesh, table)


def check_draft(cfg, tp: int, vocab: str = "shard") -> None:
    """Clear errors for a draft head that cannot be split `tp` ways (heads, MLP, its own vocabulary)."""
    check_divisible(cfg, tp, vocab=False, what_model="draft")
    if vocab == "shard" and cfg.kind == "eagle3" and cfg.draft_vocab_size % tp:
        raise ValueError(f"tensor parallelism {tp}: the draft's draft_vocab_size {cfg.draft_vocab_size} is not "
                         f"divisible by {tp} (use tp_vocab='replicate')")


def split_draft(cfg, tp: int, placement: str, vocab: str = "shard") -> bool:
    """Whether the draft head is split (`placement`: EngineConfig.tp_draft). "auto" splits it when it
    divides — measured 12 % faster at batch 1 and 7 % at batch 16 on 2 x H200 (Llama-3 8B shape,
    bench/HISTORY.md, 2026-11-23), and what SGLang does (its draft runs at the target's tp)."""
    if tp == 1 or placement == "replicate":
        return False
    if placement == "shard":
        check_draft(cfg, tp, vocab)
        return True
    try:
        check_draft(cfg, tp, vocab)
    except ValueError:
        return False
    return True


def shard_draft(draft, mesh: Mesh, vocab: str = "shard"):
    """A draft head split like a target layer (DRAFT_AXES); an EAGLE-3 head's own lm_head by vocabulary
    rows when `vocab` is "shard"."""
    check_draft(draft.cfg, mesh.shape[TP], vocab)
    return _place(draft, DRAFT_AXES, mesh, rules(vocab))


def pool_sharding(mesh: Mesh, shape) -> NamedSharding:
    """KV pools [L, slots, kv_heads, D] split by KV heads (replicated when the heads do not divide)."""
    return NamedSharding(mesh, spec(KV_POOL_AXES) if shape[2] % mesh.shape[TP] == 0 else P())


def shard_pools(k_pool, v_pool, mesh: Mesh):
    s = pool_sharding(mesh, k_pool.shape)
    return jax.device_put(k_pool, s), jax.device_put(v_pool, s)


def context_tp() -> int:
    """The `tp` size of the mesh being traced under (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or TP not in mesh.axis_names else mesh.shape[TP]


def whole_vocab(x):
    """`x` (logits or probabilities [..., V]) replicated when traced under a tp mesh; as is otherwise.
    The samplers sort and cumsum along the vocabulary. Left to propagation, vocabulary-split logits
    keep the cumsum split by vocabulary, and XLA:GPU then runs that scan as a sequential loop, one
    iteration per vocabulary entry of a shard (64,128 for Llama-3 at tp 2: 1.58 s to the first token
    at batch 16 against 0.10 s at tp 1, 2 x H200, bench/HISTORY.md, 2026-11-23). Gathering [B, V] is
    cheap next to that; each device then samples the whole rows."""
    if context_tp() == 1:
        return x
    return jax.lax.with_sharding_constraint(x, P())


def embed_rows(embed, tokens, vocab_split: bool):
    """`embed[tokens]`; with the table split by vocabulary rows under a tp mesh, Megatron's
    vocabulary-parallel lookup: each device takes the rows it holds (zeros for the others) and one
    all-reduce sums them. Left to the partitioner, a decode step at batch 1 all-gathered the whole
    table instead (1.05 GB per step for Llama-3 8B: 1.9 ms of a 6.5 ms step on 2 x H200,
    bench/HISTORY.md, 2026-11-23)."""
    tp = context_tp()
    if not vocab_split or tp == 1 or embed.shape[0] % tp:
        return embed[tokens]

    def local(e, t):
        lo = jax.lax.axis_index(TP) * e.shape[0]
        i = t - lo
        mine = (i >= 0) & (i < e.shape[0])
        rows = jnp.where(mine[..., None], e[jnp.where(mine, i, 0)], jnp.zeros((), e.dtype))
        return jax.lax.psum(rows, TP)  # one nonzero term per element: exact in any dtype

    return jax.shard_map(local, in_specs=(P(TP, None), P()), out_specs=P(), check_vma=False)(embed, tokens)


def over_kv_heads(fn, q, k_pool, v_pool, *rest):
    """`fn(q, k_pool, v_pool, *rest)` (paged attention: q [B,T,Hq,D], pools [L,slots,Hkv,D], the rest
    replicated bookkeeping) per tensor-parallel shard of the heads, when traced under a mesh with a
    `tp` axis > 1 that divides the KV heads; otherwise as is. Query head h reads KV head h // (Hq/Hkv),
    so splitting both head axes into `tp` contiguous blocks keeps every shard's groups whole."""
    tp = context_tp()
    if tp == 1 or k_pool.shape[2] % tp or q.shape[2] % tp:
        return fn(q, k_pool, v_pool, *rest)
    heads = P(None, None, TP, None)
    return jax.shard_map(fn, in_specs=(heads, heads, heads) + (P(),) * len(rest), out_specs=heads,
                         check_vma=False)(q, k_pool, v_pool, *rest)


def replicate(tree, mesh: Mesh):
    return jax.device_put(tree, NamedSharding(mesh, P()))
