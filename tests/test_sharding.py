"""Tensor parallelism at the model level (jeagle/parallel/sharding.py): on 4 virtual CPU devices, a target
sharded tp = 2 and 4 ways gives the single-device logits and KV pools (fp32), for a prefill through
the paged pool and a decode step, with the jnp attention and with the Pallas kernel (interpreted) run
per KV-head shard; the re-laid-out fused columns alone change nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

SCRIPT = textwrap.dedent('''
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from jeagle.config import ModelConfig
    from jeagle.kernels.settings import KernelSettings, use
    from jeagle.models.common import AttnInputs
    from jeagle.models.llama import random_model
    from jeagle.parallel.sharding import make_mesh, shard_pools, shard_target, replicate
    assert len(jax.devices()) == 4
    cfg = ModelConfig(arch="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=8,
                      num_kv_heads=4, head_dim=8, dtype="float32", max_position_embeddings=256, qkv_bias=True)
    model = random_model(cfg, 0)
    B, T, S = 2, 6, 64
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (B, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    slots = 1 + pos + T * jnp.arange(B, dtype=jnp.int32)[:, None]
    lengths = jnp.asarray([T, T - 2], jnp.int32)
    attn = AttnInputs(positions=pos, write_slots=jnp.where(pos < lengths[:, None], slots, 0), kv_slots=slots,
                      kv_len=lengths)
    shape = (cfg.num_layers, S, cfg.num_kv_heads, cfg.head_dim)

    def run(m, k, v, unroll=False):
        out = jax.jit(lambda m, t, a, k, v: m(t, a, k, v))(m, tokens, attn, k, v)
        nxt = jnp.argmax(out.logits[jnp.arange(B), lengths - 1], -1).astype(jnp.int32)
        dpos = lengths
        dslot = 1 + 2 * T + jnp.arange(B, dtype=jnp.int32)
        kv_slots = jnp.concatenate([slots, jnp.zeros((B, 2), jnp.int32)], 1)
        d = AttnInputs(positions=dpos[:, None], write_slots=dslot[:, None], kv_slots=kv_slots, kv_len=dpos,
                       extra_slots=dslot[:, None], extra_mask=jnp.ones((B, 1, 1), bool))
        out2 = jax.jit(lambda m, t, a, k, v: m(t, a, k, v, unroll=unroll))(m, nxt[:, None], d, out.k, out.v)
        return [np.asarray(x) for x in (out.logits, out.k, out2.logits, out2.k, out2.v)]

    for kernels in ("reference", "interpret"):  # the paged-attention kernel runs per KV-head shard (shard_map)
        with use(KernelSettings(backend=kernels)):
            ref = run(model, jnp.zeros(shape), jnp.zeros(shape))
        for tp in (2, 4):
            mesh = make_mesh(tp)
            sm = shard_target(model, mesh)
            assert sm.wqkv[...].sharding.spec[-1] == "tp" and sm.tp_groups == tp
            k, v = shard_pools(jnp.zeros(shape), jnp.zeros(shape), mesh)
            for unroll in ((False, True) if kernels == "interpret" else (False,)):  # decode: loop and unrolled
                with jax.set_mesh(mesh), use(KernelSettings(backend=kernels)):
                    got = run(sm, k, v, unroll)
                for a, b in zip(ref, got):
                    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
            print("tp", tp, kernels, "ok", flush=True)
    # the decode step's attention is a manual (shard_map) computation under the mesh, not a gather
    d = AttnInputs(positions=lengths[:, None], write_slots=slots[:, :1], kv_slots=slots, kv_len=lengths,
                   extra_slots=slots[:, :1], extra_mask=jnp.ones((B, 1, 1), bool))
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda m, t, a, k, v: m(t, a, k, v).logits).lower(sm, tokens[:, :1], d, k, v).as_text()
    assert "manual_computation" in hlo or "SPMDFullToShardShape" in hlo, hlo[:2000]
    print("shard_map ok", flush=True)
''')


def _run_on_4_devices(script: str):
    """Run `script` in a fresh interpreter (the device count is fixed when JAX starts)."""
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, env=env,
                          cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_sharded_target_equals_single_device(tmp_path):
    proc = _run_on_4_devices(SCRIPT)
    for line in ("tp 2 reference ok", "tp 4 reference ok", "tp 2 interpret ok", "tp 4 interpret ok", "shard_map ok"):
        assert line in proc.stdout, proc.stdout


def _relaid(module, cfg, tp=2):
    """A copy of `module` with its fused columns laid out per shard and told its group count."""
    from flax import nnx

    from jeagle.parallel.sharding import interleave

    graphdef, state = nnx.split(module)
    nnx.replace_by_pure_dict(state, interleave(nnx.to_pure_dict(state), cfg, tp))
    relaid = nnx.merge(graphdef, state)
    relaid.tp_groups = tp
    return relaid


def _prefill_inputs(t=5):
    """Attention inputs of a t-token prefill into empty 8-slot pools of 2 KV heads x 8, and the pool."""
    import jax.numpy as jnp

    from jeagle.models.common import AttnInputs

    pos = jnp.arange(t, dtype=jnp.int32)[None]
    attn = AttnInputs(positions=pos, write_slots=pos + 1, kv_slots=pos + 1, kv_len=jnp.asarray([t], jnp.int32))
    return attn, jnp.zeros((1, 8, 2, 8))


def test_interleave_alone_changes_nothing():
    """The per-shard column layout with the matching group count computes the same layer."""
    import jax.numpy as jnp

    from jeagle.config import ModelConfig
    from jeagle.models.llama import random_model
    from jeagle.parallel.sharding import check_divisible

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=8, dtype="float32", max_position_embeddings=64, qkv_bias=True)
    model = random_model(cfg, 1)
    relaid = _relaid(model, cfg)
    attn, z = _prefill_inputs()
    tokens = jnp.asarray([[3, 9, 27, 1, 60]], jnp.int32)
    a, b = model(tokens, attn, z, z), relaid(tokens, attn, z, z)
    np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="num_kv_heads 2 is not divisible by 4"):
        check_divisible(cfg, 4)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_draft_interleave_alone_changes_nothing(kind):
    """A draft head re-laid out per shard (tp_draft="shard") with its group count computes the same
    logits and hidden state (random heads: attention and MLP both contribute)."""
    import jax.numpy as jnp

    from jeagle.config import DraftConfig
    from jeagle.models.eagle import random_draft

    eagle3 = kind == "eagle3"
    cfg = DraftConfig(kind=kind, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=8, vocab_size=64, dtype="float32", draft_vocab_size=32 if eagle3 else 0,
                      target_hidden_size=32 if eagle3 else 0, aux_layer_ids=(0, 1, 1) if eagle3 else ())
    head = random_draft(cfg, 3)
    relaid = _relaid(head, cfg)
    t = 5
    attn, z = _prefill_inputs(t)
    rng = np.random.default_rng(0)
    embed = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
    feature = jnp.asarray(rng.normal(size=(1, t, 96 if eagle3 else 32)), jnp.float32)
    tokens = jnp.asarray([[3, 9, 27, 1, 60]], jnp.int32)
    kw = dict(embed=embed, lm_head=None if eagle3 else embed)
    a, b = head(tokens, feature, attn, z, z, **kw), relaid(tokens, feature, attn, z, z, **kw)
    np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(a.hidden), np.asarray(b.hidden), rtol=1e-5, atol=1e-5)
    # And the layout matters: the re-laid-out weights with one group compute something else.
    relaid.tp_groups = 1
    assert not np.allclose(np.asarray(relaid(tokens, feature, attn, z, z, **kw).logits), np.asarray(a.logits), atol=1e-3)


ENGINE_SCRIPT = textwrap.dedent('''
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.sampling import SamplingParams
    from jeagle.speculative.round import SpecConfig
    from tests.spec_models import bigram_target, signed_identity_head, target_config
    cfg = target_config(vocab=96).replace(num_heads=8, num_kv_heads=4, head_dim=4)
    target = bigram_target(cfg, scale=30.0)
    head = signed_identity_head(target, +1.0, noise=0.08)  # 2 KV heads: its pools replicate at tp 4
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 96, n).tolist() for n in (5, 9, 3, 12, 7)]
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    ref = [o.token_ids for o in target_only(target, EngineConfig(max_batch_size=4, max_context=64)).generate(prompts, params)]
    for tp in (2, 4):
        ec = EngineConfig(max_batch_size=4, max_context=64, tp=tp)
        if tp == 4:  # target-only once, the vocabulary replicated (the speculative engines split it)
            import dataclasses
            from flax import nnx
            eng = target_only(target, dataclasses.replace(ec, tp_vocab="replicate"))
            assert eng.decoder.state.cache.k.sharding.spec[2] == "tp"
            assert tuple(nnx.to_pure_dict(eng.decoder.params)["lm_head"].sharding.spec)[:1] in ((), (None,))
            got = [o.token_ids for o in eng.generate(prompts, params)]
            assert got == ref, (tp, got, ref)
        spec = speculative(target, head, ec, SpecConfig(num_steps=3, topk=2, num_draft_tokens=4))
        got = [o.token_ids for o in spec.generate(prompts, params)]
        assert got == ref, ("spec", tp, got, ref)
        assert spec.last_stats.accept_length > 1.0
        from jeagle.parallel.sharding import pool_sharding  # the rounds' outputs keep every pool where it was placed
        for pool in (spec.decoder.state.cache.k, spec.decoder.state.cache.v, spec.decoder.state.draft_k, spec.decoder.state.draft_v):
            assert pool.sharding.spec == pool_sharding(spec.decoder.mesh, pool.shape).spec, (tp, pool.shape, pool.sharding)
        split = [tuple(x.sharding.spec)[2:3] == ("tp",) for x in (spec.decoder.state.cache.k, spec.decoder.state.draft_k)]
        assert split == [True, tp == 2], (tp, split)  # the head's 2 KV heads split over 2, not over 4
        # tp_draft "auto" (the default): the head itself split where it divides (tp 2), replicated at tp 4
        from flax import nnx
        wqkv = nnx.to_pure_dict(spec.decoder.params[1])["wqkv"]
        assert spec.decoder.draft_split == (tp == 2) and (tuple(wqkv.sharding.spec)[2:3] == ("tp",)) == (tp == 2), \
            (tp, spec.decoder.draft_split, wqkv.sharding)
        print("engine tp", tp, "ok", spec.last_stats.accept_length, flush=True)
    # An EAGLE-3 head split like a target layer, its own lm_head split by rows with the vocabulary.
    from jeagle.models.eagle import random_draft
    from tests.spec_models import draft_config
    eagle3 = random_draft(draft_config(cfg, "eagle3"), seed=4)
    for draft, vocab in ((eagle3, "shard"),):  # (an EAGLE-1 head split at tp 2: the loop above)
        ec = EngineConfig(max_batch_size=4, max_context=64, tp=2, tp_draft="shard", tp_vocab=vocab)
        spec = speculative(target, draft, ec, SpecConfig(num_steps=3, topk=2, num_draft_tokens=4))
        placed = nnx.to_pure_dict(spec.decoder.params[1])
        assert placed["wqkv"].sharding.spec[2] == "tp" and placed["w_down"].sharding.spec[1] == "tp"
        assert nnx.to_pure_dict(spec.decoder.params[0])["lm_head"].sharding.spec[0] == ("tp" if vocab == "shard" else None)
        if draft is eagle3:
            assert placed["lm_head"].sharding.spec[0] == "tp"
        got = [o.token_ids for o in spec.generate(prompts, params)]
        assert got == ref, ("draft sharded", draft.cfg.kind, vocab, got, ref)
        print("draft sharded", draft.cfg.kind, "vocab", vocab, "ok", flush=True)
''')


def test_engines_on_a_mesh_equal_single_device():
    """Target-only (vocabulary replicated) and speculative (vocabulary split; EAGLE-1 head split at tp 2
    and replicated at tp 4 by tp_draft "auto", an EAGLE-3 head split) on 2 and 4 of 4 virtual devices,
    greedy fp32: the single-device output, with the continuous batch crossing buckets; the KV pools
    split by KV heads."""
    proc = _run_on_4_devices(ENGINE_SCRIPT)
    assert "engine tp 2 ok" in proc.stdout and "engine tp 4 ok" in proc.stdout
    assert "draft sharded eagle3 vocab shard ok" in proc.stdout


SAMPLER_SCRIPT = textwrap.dedent('''
    import os, re
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jeagle.sampling import sample
    from jeagle.parallel.sharding import make_mesh
    from jeagle.kernels.tree_speculative_sampling import sample_residual
    from jeagle.speculative.verify import target_probs
    B, N, V = 3, 4, 256
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(B, V)) * 3, jnp.float32)
    tree_logits = jnp.asarray(rng.normal(size=(B, N, V)) * 3, jnp.float32)
    temperature = jnp.asarray([0.7, 1.0, 0.0], jnp.float32)
    top_k = jnp.asarray([0, 20, 0], jnp.int32)
    top_p = jnp.asarray([0.9, 1.0, 0.8], jnp.float32)
    seeds, positions = jnp.asarray([1, 2, 3], jnp.uint32), jnp.asarray([5, 6, 7], jnp.int32)
    coin = jnp.asarray([0.2, 0.5, 0.9], jnp.float32)

    def fns(lg, tl):
        probs = target_probs(tl, temperature, top_k, top_p)
        resid = 0.5 * probs[:, 1]
        return (sample(lg, seeds, positions, temperature, top_k, top_p, all_greedy=False), probs,
                sample_residual(probs[:, 0], resid, coin))

    ref = [np.asarray(x) for x in jax.jit(fns)(logits, tree_logits)]
    for tp in (2, 4):
        mesh = make_mesh(tp)
        lg = jax.device_put(logits, NamedSharding(mesh, P(None, "tp")))  # as a vocabulary-split lm_head gives them
        tl = jax.device_put(tree_logits, NamedSharding(mesh, P(None, None, "tp")))
        with jax.set_mesh(mesh):
            compiled = jax.jit(fns).lower(lg, tl).compile()
            got = [np.asarray(x) for x in compiled(lg, tl)]
        np.testing.assert_array_equal(ref[0], got[0])
        np.testing.assert_allclose(ref[1], got[1], rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(ref[2], got[2])
        # Every sort and scan (cumsum: reduce-window) runs on whole vocabulary rows, none on a V/tp split.
        hlo = compiled.as_text()
        ops = re.findall(r"= \\(?([a-z0-9]+\\[[0-9,]*\\])[^=]*? (sort|reduce-window)\\(", hlo)
        assert any(op == "sort" for _, op in ops), "no sort found"
        split = [(shape, op) for shape, op in ops if shape.endswith(f",{V // tp}]")]
        assert not split, (tp, split)
        print("samplers tp", tp, "whole rows ok", flush=True)

    # The vocabulary-parallel embedding lookup: exact rows (ids at every shard's edges), one all-reduce
    # of the looked-up rows and no gather of the table; a replicated table is looked up as is.
    from jeagle.parallel.sharding import embed_rows
    H = 8
    table = jnp.asarray(rng.normal(size=(V, H)), jnp.bfloat16)
    for tp in (2, 4):
        mesh = make_mesh(tp)
        edges = sorted({0, V - 1} | {j * V // tp + d for j in range(1, tp) for d in (-1, 0)})
        for tokens in (jnp.asarray([[edges[1]]], jnp.int32), jnp.asarray([edges, edges[::-1]], jnp.int32)):
            split = jax.device_put(table, NamedSharding(mesh, P("tp", None)))
            whole = jax.device_put(table, NamedSharding(mesh, P()))
            with jax.set_mesh(mesh):
                compiled = jax.jit(lambda e, t: embed_rows(e, t, True)).lower(split, tokens).compile()
                got = np.asarray(compiled(split, tokens))
                as_is = np.asarray(jax.jit(lambda e, t: embed_rows(e, t, False))(whole, tokens))
            want = np.asarray(table)[np.asarray(tokens)]
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(as_is, want)
            hlo = compiled.as_text()
            assert "all-gather" not in hlo, hlo
            reduced = re.findall(r"= [a-z0-9]+(\\[[0-9,]*\\])[^ ]* all-reduce(?:-start)?\\(", hlo)  # (CPU: in f32)
            assert reduced == [f"[{','.join(map(str, tokens.shape))},{H}]"], reduced
        print("embed lookup tp", tp, "ok", flush=True)
''')


def test_vocab_split_samplers_and_embedding():
    """Under a tp mesh with the vocabulary split (bench/HISTORY.md, 2026-11-23, 2 x H200):
    - the samplers (sampling.sample, verify.target_probs, the tree walk's sample_residual) give the
      single-device draws and probabilities with every sort and cumsum on whole vocabulary rows (a
      vocabulary-split cumsum became a sequential loop of V/tp iterations on the GPU: 1.58 s to first
      token at tp 2, batch 16, Llama-3 shape);
    - the embedding lookup is exact and communicates only the looked-up rows (left to the partitioner,
      a batch-1 decode step all-gathered the whole 1.05 GB table on the GPU)."""
    proc = _run_on_4_devices(SAMPLER_SCRIPT)
    for line in ("samplers tp 2 whole rows ok", "samplers tp 4 whole rows ok", "embed lookup tp 2 ok",
                 "embed lookup tp 4 ok"):
        assert line in proc.stdout, proc.stdout
