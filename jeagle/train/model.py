"""The training forward of an EAGLE head, its losses, and the target's features for it.

Alignment (the same pairing as inference, `jeagle/speculative/round.py`): the draft consumes (token at t+1,
feature at t) at position t and predicts token t+2, whose label is the target's distribution at
position t+1.

Training-time test (EAGLE-3): step s ≥ 1 feeds token t+1+s at RoPE position t+s with the draft's own
hidden from step s-1 at t, exactly as the tree draft's depth-s node is fed at inference. Its query
sees the step-0 keys at positions ≤ t (the draft's prefix cache) and, for every step 1..s, the key
of its own position (its chain of ancestors): `ttt_attention`. Step s is weighted `decay**s`.

Losses:
    eagle3  Σ_s decay^s · CE(draft logits, target distribution restricted to the draft vocabulary)
    eagle1  Σ_s decay^s · (smooth-L1(draft hidden, target hidden at t+1+s) + ce_weight · CE(draft
            logits over the target head, target distribution))
The loss covers label positions whose next token is a response token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jeagle.config import DraftConfig
from jeagle.models.common import AttnInputs, attention_output, mlp_sublayer, qkv_rope, rms_norm, rope_cos_sin
from jeagle.models.eagle import LAYER_PARAMS, EagleHead, abstract_draft


def target_outputs(target, tokens, lengths, *, aux_layers=()):
    """The target over whole sequences (dense causal attention, no KV pool): (final hidden [B,T,H]
    post-norm, aux hidden [B,T,3H] or None, logits [B,T,V] fp32)."""
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    zeros = jnp.zeros((b, t), jnp.int32)
    attn = AttnInputs(positions=pos, write_slots=zeros, kv_slots=zeros, kv_len=lengths.astype(jnp.int32))
    out = target(tokens, attn, None, None, aux_layers=tuple(aux_layers))
    return out.hidden, out.aux_hidden, out.logits


def ttt_attention(q, ks, vs, lengths):
    """q [B,T,Hq,D] of step s = len(ks)-1; ks/vs: the K/V [B,T,Hkv,D] of steps 0..s. The query at t sees
    step-0 keys j ≤ t (j < length) and the step-1..s keys at t only. fp32 scores → [B,T,Hq,D]."""
    b, t, hq, d = q.shape
    hkv = ks[0].shape[2]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    scale = 1.0 / np.sqrt(d)
    s0 = jnp.einsum("btkgd,bskd->bkgts", qg, ks[0], preferred_element_type=jnp.float32) * scale
    j = jnp.arange(t)
    visible = (j[None, :] <= j[:, None])[None] & (j[None, None, :] < lengths[:, None, None])  # [B,T,S]
    s0 = jnp.where(visible[:, None, None], s0, -jnp.inf)
    diag = [jnp.einsum("btkgd,btkd->bkgt", qg, k, preferred_element_type=jnp.float32)[..., None] * scale for k in ks[1:]]
    scores = jnp.concatenate([s0, *diag], axis=-1)  # [B,Hkv,G,T,T+s]
    probs = jax.nn.softmax(scores, axis=-1)  # every row sees at least its own diagonal or key 0
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t].astype(vs[0].dtype), vs[0], preferred_element_type=jnp.float32)
    for i, v in enumerate(vs[1:]):
        p = probs[..., t + i]  # [B,Hkv,G,T]
        out = out + jnp.einsum("bkgt,btkd->btkgd", p, v.astype(jnp.float32))
    return out.astype(q.dtype).reshape(b, t, hq, d)


def draft_unrolled(params: dict, cfg: DraftConfig, embed, head, tokens, feature, lengths, steps: int):
    """The draft over whole sequences for `steps` training-time-test steps. params: the head's pure
    dict (compute dtype); embed [V,H] the target's; head: the output head ([Vd,H] EAGLE-3, the target's
    [V,H] EAGLE-1). Returns [(hidden [B,T,H], logits [B,T,Vd] fp32)] per step."""
    b, t = tokens.shape
    eps = cfg.rms_norm_eps
    dt = jnp.dtype(cfg.dtype)
    feature = feature.astype(dt)

    def fc(x):
        y = x @ params["fc_w"]
        return y + params["fc_b"] if params.get("fc_b") is not None else y

    h = fc(feature) if cfg.kind == "eagle3" else feature
    caches = [([], []) for _ in range(cfg.num_layers)]
    outs = []
    for s in range(steps):
        tok = jnp.pad(tokens[:, 1 + s:], ((0, 0), (0, 1 + s)))  # token t+1+s at t (0 past the end)
        e = embed[tok].astype(dt)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + s, (b, t))
        cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, None)
        if cfg.kind == "eagle1":
            h = fc(jnp.concatenate([e, h], -1))
        for layer in range(cfg.num_layers):
            wi = {n: (params[n][layer] if params.get(n) is not None else None) for n in LAYER_PARAMS}
            if cfg.kind == "eagle3":
                x = jnp.concatenate([rms_norm(e, params["input_norm"], eps), rms_norm(h, params["hidden_norm"], eps)], -1)
            else:
                x = h if layer == 0 else rms_norm(h, params["attn_norm"][layer - 1], eps)
            q, k, v = qkv_rope(x, wi, cos, sin, cfg)
            caches[layer][0].append(k)
            caches[layer][1].append(v)
            o = ttt_attention(q, caches[layer][0], caches[layer][1], lengths)
            h = h + attention_output(o, wi, cfg)
            h = h + mlp_sublayer(rms_norm(h, wi["mlp_norm"], eps), wi)
        x = rms_norm(h, params["final_norm"], eps) if cfg.kind == "eagle3" else h
        logits = jnp.einsum("bth,vh->btv", x, head.astype(x.dtype), preferred_element_type=jnp.float32)
        outs.append((h, logits))
    return outs


def shift_left(x, n: int):
    """x[:, t+n] at t, zero-padded (axis 1)."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n)
    return jnp.pad(x[:, n:], pad)


def draft_loss(params, cfg: DraftConfig, target_params: dict, target_out, batch, *, steps: int, decay: float = 0.8,
               used_ids=None, ce_weight: float = 0.1):
    """Training loss and metrics. target_out: (hidden, aux, logits) of `target_outputs`, no gradient;
    used_ids [Vd]: the target ids of the draft vocabulary (EAGLE-3)."""
    hidden_t, aux_t, logits_t = target_out
    tokens, lengths, mask = batch["tokens"], batch["lengths"], batch["loss_mask"]
    embed = target_params["embed"]
    if cfg.kind == "eagle3":
        head = params["lm_head"]
        feature = aux_t
    else:
        head = target_params["lm_head"] if target_params.get("lm_head") is not None else embed
        feature = hidden_t
    outs = draft_unrolled(params, cfg, embed, head, tokens, feature, lengths, steps)
    target_top = jnp.argmax(logits_t, -1)  # [B,T] the target's greedy next token
    if cfg.kind == "eagle3":
        label_logits = jnp.take(logits_t, used_ids, axis=-1)
    else:
        label_logits = logits_t
    label_p = jax.nn.softmax(label_logits, -1)
    total = 0.0
    metrics = {}
    for s, (h, logits) in enumerate(outs):
        m = shift_left(mask, 1 + s).astype(jnp.float32)  # label position t+1+s predicts a response token
        denom = jnp.maximum(m.sum(), 1.0)
        p = shift_left(label_p, 1 + s)
        ce = -(p * jax.nn.log_softmax(logits, -1)).sum(-1)
        ce_s = (ce * m).sum() / denom
        pred = jnp.argmax(logits, -1)
        if cfg.kind == "eagle3":
            pred = used_ids[pred]
        acc = ((pred == shift_left(target_top, 1 + s)) * m).sum() / denom
        if cfg.kind == "eagle3":
            loss_s = ce_s
        else:
            want = shift_left(hidden_t, 1 + s).astype(jnp.float32)
            diff = jnp.abs(h.astype(jnp.float32) - want)
            sl1 = jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5).mean(-1)
            loss_s = (sl1 * m).sum() / denom + ce_weight * ce_s
            metrics[f"reg{s}"] = (sl1 * m).sum() / denom
        total = total + decay ** s * loss_s
        metrics[f"ce{s}"] = ce_s
        metrics[f"acc{s}"] = acc
    metrics["loss"] = total
    return total, metrics


# ---------------------------------------------------------------------------------------------------
# Parameters: a head's trainable pure dict, and back to an EagleHead module.

def init_params(cfg: DraftConfig, target_params: dict, *, seed: int = 0, used_ids=None) -> tuple[dict, np.ndarray | None]:
    """Initial fp32 parameters (trainable dict) and d2t. EAGLE-3's lm_head starts as the target's head
    rows of the draft vocabulary and its final norm as the target's: the draft begins where the target's
    own output layer is."""
    head = nnx.jit(lambda: EagleHead(cfg.replace(dtype="float32"), rngs=nnx.Rngs(seed)))()
    pure = nnx.to_pure_dict(nnx.split(head)[1])
    d2t = None
    if cfg.kind == "eagle3":
        pure.pop("d2t")
        tgt_head = target_params["lm_head"] if target_params.get("lm_head") is not None else target_params["embed"]
        pure["lm_head"] = jnp.asarray(tgt_head, jnp.float32)[jnp.asarray(used_ids)]
        pure["final_norm"] = jnp.asarray(target_params["final_norm"], jnp.float32)
        d2t = (np.asarray(used_ids) - np.arange(len(used_ids))).astype(np.int32)
    return {k: v for k, v in pure.items() if v is not None}, d2t


def load_params(path, target_cfg=None) -> tuple[dict, np.ndarray | None]:
    """fp32 trainable parameters and d2t (None for EAGLE-1) of a trained head dir (jeagle's loader: its
    format and, with `target_cfg`, its fit to the target are checked)."""
    from jeagle.loading.checkpoint import load_draft

    head = load_draft(path, target=target_cfg, dtype="float32")
    pure = nnx.to_pure_dict(nnx.split(head)[1])
    d2t = pure.pop("d2t", None)
    return {k: jnp.asarray(v, jnp.float32) for k, v in pure.items()}, (None if d2t is None else np.asarray(d2t))


def grow_layers(params: dict, cfg: DraftConfig, num_layers: int) -> tuple[dict, DraftConfig]:
    """A trained head's parameters with decoder layers appended up to `num_layers`: each new layer is a
    copy of the last one with its attention output and MLP down projections at zero, so both residual
    branches add nothing and the grown head predicts exactly as the trained one did; training then
    grows the new layer out of features that already mean something (EAGLE-3 layers all read the
    embedding beside the hidden, so a copy's projections fit it). Returns (params, cfg)."""
    have = cfg.num_layers
    if num_layers < have:
        raise ValueError(f"the head has {have} layers: it cannot be shrunk to {num_layers}")
    if num_layers == have:
        return params, cfg
    out = dict(params)
    extra = num_layers - have
    for name in LAYER_PARAMS:
        w = params.get(name)
        if w is None:
            continue
        last = w[-1:]
        new = jnp.zeros_like(last) if name in ("wo", "w_down") else last
        out[name] = jnp.concatenate([w] + [new] * extra, axis=0)
    if cfg.kind == "eagle1":  # EAGLE-1 layers past the first normalise their input: one more norm per layer
        norms = params.get("attn_norm")
        ones = jnp.ones((extra, cfg.hidden_size), jnp.float32)
        out["attn_norm"] = ones if norms is None else jnp.concatenate([norms, ones], axis=0)
    return out, cfg.replace(num_layers=num_layers)


def export_params(params: dict, cfg: DraftConfig, d2t) -> dict[str, np.ndarray]:
    """The checkpoint tensors of a trained head (cfg.dtype floats; d2t as int32)."""
    out = {k: np.asarray(jnp.asarray(v, jnp.dtype(cfg.dtype)).astype(jnp.float32)) for k, v in params.items()}
    if cfg.kind == "eagle3":
        out["d2t"] = np.asarray(d2t, np.int32)
    return out


def head_module(params: dict, cfg: DraftConfig, d2t) -> EagleHead:
    """An EagleHead (cfg.dtype) holding `params`, ready for the engine."""
    graphdef, state = nnx.split(abstract_draft(cfg))
    target = nnx.to_pure_dict(state)
    tensors = export_params(params, cfg, d2t)
    restored = {k: jnp.asarray(tensors[k], dtype=v.dtype) for k, v in target.items()}
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)
