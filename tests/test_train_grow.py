"""Larger heads from trained ones (the head goals' variants, bench/HISTORY.md): `--init-from HEAD
--num-layers N` grows a head by layers that start as the identity, and `python -m jeagle.train.vocab trim`
cuts a head's draft vocabulary to its most frequent tokens. Tiny target, CPU, fp32."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jeagle.train.data import DraftData
from jeagle.train.model import draft_unrolled, grow_layers, target_outputs
from jeagle.train.vocab import fit_row_map, trim_vocab
from tests.spec_models import draft_config, target_config


def _params(head):
    pure = nnx.to_pure_dict(nnx.split(head)[1])
    pure.pop("d2t", None)
    return {k: v for k, v in pure.items() if v is not None}


@pytest.mark.parametrize("kind,layers", [("eagle3", 1), ("eagle1", 2)])
def test_grown_head_predicts_as_the_trained_one(kind, layers):
    """Every training-time-test step's hidden and logits are the trained head's, exactly: the new layers'
    residual branches add zero. The new layer is the last one copied, its output projections zero."""
    from jeagle.models.eagle import random_draft
    from jeagle.models.llama import random_model

    tcfg = target_config()
    target = random_model(tcfg, 1)
    cfg = draft_config(tcfg, kind).replace(fc_bias=kind == "eagle1", num_layers=layers)
    params = _params(random_draft(cfg, 2))
    grown, gcfg = grow_layers(params, cfg, layers + 2)
    assert gcfg.num_layers == layers + 2 and grown["wqkv"].shape[0] == layers + 2
    np.testing.assert_array_equal(grown["wqkv"][-1], params["wqkv"][-1])
    assert not np.asarray(grown["wo"][layers:]).any() and not np.asarray(grown["w_down"][layers:]).any()
    np.testing.assert_array_equal(grown["wo"][:layers], params["wo"])
    if kind == "eagle1":
        assert grown["attn_norm"].shape == (layers + 1, cfg.hidden_size)

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(4, tcfg.vocab_size, (2, 10)), jnp.int32)
    lengths = jnp.asarray([10, 7], jnp.int32)
    hidden, aux, _ = target_outputs(target, tokens, lengths, aux_layers=cfg.aux_layer_ids)
    feature = aux if kind == "eagle3" else hidden
    head = params["lm_head"] if kind == "eagle3" else target.lm_head[...]
    a = draft_unrolled(params, cfg, target.embed[...], head, tokens, feature, lengths, 3)
    b = draft_unrolled(grown, gcfg, target.embed[...], head, tokens, feature, lengths, 3)
    for (ha, la), (hb, lb) in zip(a, b):
        np.testing.assert_array_equal(np.asarray(ha), np.asarray(hb))
        np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
    assert grow_layers(params, cfg, layers)[0] is params
    with pytest.raises(ValueError, match="cannot be shrunk"):
        grow_layers(params, cfg, layers - 1 if layers > 1 else 0)


def test_trim_vocab_keeps_the_most_frequent_trained_rows():
    d2t = np.array([3, 3, 5, 6], np.int32)  # target ids 3, 4, 7, 9
    lm_head = np.arange(8, dtype=np.float32).reshape(4, 2)
    data = DraftData.from_samples([([1, 9, 9, 4, 3], 1), ([2, 9, 4, 7, 7, 7], 1)], 16)  # 9: 2, 4: 2, 7: 3, 3: 1
    rows, new = trim_vocab(lm_head, d2t, data, 3)
    np.testing.assert_array_equal(np.arange(3) + new, [4, 7, 9])  # 3 dropped: the least frequent
    np.testing.assert_array_equal(rows, lm_head[[1, 2, 3]])
    rows, new = trim_vocab(lm_head, d2t, data, 2, always=(3,))
    np.testing.assert_array_equal(np.arange(2) + new, [3, 7])
    with pytest.raises(ValueError, match="trim size"):
        trim_vocab(lm_head, d2t, data, 5)


def test_grow_train_trim_end_to_end(tiny_target_dir, tmp_path):
    """A trained head grown to two layers predicts as before (--steps 0), trains (--steps 2: the new
    layer's output projection moves off zero), decodes losslessly in the engine, and trims to a smaller
    vocabulary that loads; bad sizes are clear errors."""
    from safetensors.numpy import load_file

    from jeagle.loading.checkpoint import load_draft, load_model
    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.sampling import SamplingParams
    from jeagle.speculative.round import SpecConfig
    from jeagle.train import vocab
    from jeagle.train_draft import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"{w} {i}?"]}) + "\n"
                               for i, w in enumerate(["alpha", "beta", "gamma"] * 4)))
    common = ["--target", str(tiny_target_dir), "--prompts", str(prompts), "--max-new-tokens", "12", "--gen-batch", "8",
              "--target-dtype", "float32", "--compute-dtype", "float32", "--eval-prompts", "0", "--draft-vocab-size",
              "24", "--no-progress", "--batch-size", "4", "--seq-len", "32", "--length-buckets", "2", "--lr", "3e-2",
              "--warmup-steps", "1"]
    assert main(["--out", str(tmp_path / "a"), *common, "--steps", "3"]) == 0
    a = tmp_path / "a" / "head"
    assert main(["--out", str(tmp_path / "b"), *common, "--steps", "0", "--init-from", str(a), "--num-layers", "2"]) == 0
    assert main(["--out", str(tmp_path / "c"), *common, "--steps", "2", "--init-from", str(a), "--num-layers", "2"]) == 0
    ta, tb, tc = (load_file(str(tmp_path / r / "head" / "model.safetensors")) for r in "abc")
    assert tb["wqkv"].shape[0] == 2 and not tb["wo"][1].any() and tc["wo"][1].any()
    np.testing.assert_array_equal(tb["wqkv"][:1], ta["wqkv"])
    info = json.loads((tmp_path / "c" / "head" / "training.json").read_text())
    assert info["grown_from_layers"] == 1 and info["train_config"]["num_layers"] == 2

    model = load_model(tiny_target_dir, dtype="float32")
    heads = {r: load_draft(tmp_path / r / "head", target=model.cfg, dtype="float32") for r in "ab"}
    rng = np.random.default_rng(1)
    feature = jnp.asarray(rng.normal(size=(1, 6, 3 * model.cfg.hidden_size)), jnp.float32)
    tokens = jnp.asarray(rng.integers(4, model.cfg.vocab_size, (1, 6)), jnp.int32)
    outs = [draft_unrolled(_params(heads[r]), heads[r].cfg, model.embed[...], heads[r].lm_head[...], tokens, feature,
                           jnp.asarray([6], jnp.int32), 2) for r in "ab"]
    for (ha, la), (hb, lb) in zip(*outs):
        np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=1e-6, atol=1e-6)

    trimmed = tmp_path / "trimmed"
    assert vocab.main(["trim", str(tmp_path / "c" / "head"), "--data", str(tmp_path / "c" / "data.npz"), "--size", "16",
                       "--out", str(trimmed)]) == 0
    info = json.loads((trimmed / "training.json").read_text())["vocab_trim"]
    assert info["size"] == 16 and info["from_size"] == 24 and info["coverage_after"] <= info["coverage_before"]
    assert "trimmed" in (trimmed / "README.md").read_text()
    tt = load_file(str(trimmed / "model.safetensors"))
    used_c, used_t = np.arange(24) + tc["d2t"], np.arange(16) + tt["d2t"]
    assert set(used_t) <= set(used_c)
    for j, t in enumerate(used_t):
        np.testing.assert_array_equal(tt["lm_head"][j], tc["lm_head"][list(used_c).index(t)])

    cfg = EngineConfig(max_batch_size=2, max_context=128)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ids = [[5, 9, 13, 2, 7], [11, 4, 6]]
    plain = [o.token_ids for o in target_only(model, cfg).generate(ids, params)]
    for head_dir in (tmp_path / "c" / "head", trimmed):
        head = load_draft(head_dir, target=model.cfg, dtype="float32")
        eng = speculative(model, head, cfg, SpecConfig(num_steps=3, topk=2, num_draft_tokens=4))
        assert [o.token_ids for o in eng.generate(ids, params)] == plain, head_dir  # greedy: lossless

    assert vocab.main(["trim", str(tmp_path / "c" / "head"), "--data", str(tmp_path / "c" / "data.npz"), "--size", "30",
                       "--out", str(tmp_path / "bad")]) == 2
    assert main(["--out", str(tmp_path / "d"), *common, "--steps", "0", "--init-from", str(tmp_path / "c" / "head"),
                 "--num-layers", "1"]) == 2


def test_rebuild_vocab_to_a_wider_vocabulary_trains_and_resumes(tiny_target_dir, tmp_path, monkeypatch):
    """--init-from HEAD --rebuild-vocab --draft-vocab-size N (N > the head's): the trained rows follow their
    tokens, the new ones start as their target rows carried by the map fitted on the shared tokens; a run
    stopped by its time limit resumes over the same vocabulary; another size without --rebuild-vocab is a
    clear error. The card of a run without held-out prompts says
    so, and the commit recorded is JEAGLE_COMMIT's (a GPU runner's copy of the tree has no .git)."""
    from safetensors.numpy import load_file

    from jeagle.loading.checkpoint import load_draft, load_model
    from jeagle.train.trainer import checkpoint_steps
    from jeagle.train_draft import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"{w} {i}?"]}) + "\n"
                               for i, w in enumerate(["alpha", "beta", "gamma", "delta"] * 3)))
    common = ["--target", str(tiny_target_dir), "--prompts", str(prompts), "--max-new-tokens", "12", "--gen-batch", "8",
              "--target-dtype", "float32", "--compute-dtype", "float32", "--eval-prompts", "0", "--no-progress",
              "--batch-size", "4", "--seq-len", "32", "--length-buckets", "2", "--lr", "3e-2", "--warmup-steps", "1"]
    assert main(["--out", str(tmp_path / "a"), *common, "--steps", "3", "--draft-vocab-size", "16"]) == 0
    a = tmp_path / "a" / "head"
    wide = ["--init-from", str(a), "--rebuild-vocab", "--draft-vocab-size", "32"]
    assert main(["--out", str(tmp_path / "w0"), *common, *wide, "--steps", "0"]) == 0
    ta, tw = load_file(str(a / "model.safetensors")), load_file(str(tmp_path / "w0" / "head" / "model.safetensors"))
    used_a, used_w = list(np.arange(16) + ta["d2t"]), np.arange(32) + tw["d2t"]
    assert tw["lm_head"].shape[0] == 32 and json.loads((tmp_path / "w0" / "head" / "config.json").read_text())[
        "draft_vocab_size"] == 32
    model = load_model(tiny_target_dir, dtype="float32")
    target_rows = np.asarray(model.embed[...] if model.lm_head is None else model.lm_head[...], np.float32)
    shared = [t for t in used_w if t in used_a]
    a_map = fit_row_map(target_rows[shared], ta["lm_head"].astype(np.float32)[[used_a.index(t) for t in shared]])
    for j, t in enumerate(used_w):
        if t in used_a:  # the trained row, exactly
            np.testing.assert_array_equal(tw["lm_head"][j], ta["lm_head"][used_a.index(t)])
        else:  # the target's row carried by the map fitted on the shared tokens (bf16)
            want = target_rows[t] @ a_map
            assert np.abs(want).max() > 0
            np.testing.assert_allclose(tw["lm_head"][j].astype(np.float32), want, rtol=2e-2, atol=2e-2)

    run = ["--out", str(tmp_path / "w1"), *common, *wide, "--steps", "3", "--save-every", "1"]
    assert main([*run, "--time-limit", "0"]) == 0
    assert checkpoint_steps(tmp_path / "w1" / "ckpt", tmp_path / "w1" / "portable")[0] == 1  # stopped after step 1
    monkeypatch.setenv("JEAGLE_COMMIT", "c0ffee1")
    assert main([*run, "--resume"]) == 0
    assert checkpoint_steps(tmp_path / "w1" / "ckpt", tmp_path / "w1" / "portable")[0] == 3
    info = json.loads((tmp_path / "w1" / "head" / "training.json").read_text())
    assert info["train_config"]["draft_vocab_size"] == 32 and info["final_metrics"] and info["commit"] == "c0ffee1"
    card = (tmp_path / "w1" / "head" / "README.md").read_text()
    assert "not run (--eval-prompts 0)" in card and "n/a" not in card and "jeagle commit c0ffee1" in card
    head = load_draft(tmp_path / "w1" / "head", target=model.cfg, dtype="float32")
    assert head.lm_head[...].shape[0] == 32
    np.testing.assert_array_equal(np.load(tmp_path / "w1" / "d2t.npy"), tw["d2t"])

    assert main(["--out", str(tmp_path / "bad"), *common, "--init-from", str(a), "--draft-vocab-size", "32",
                 "--steps", "0"]) == 2


def test_row_map_recovers_a_linear_relation():
    """fit_row_map finds A where trained rows are the target's carried linearly; remap_lm_head uses it for
    new tokens only, and keeps zero rows without a target head."""
    from jeagle.train.vocab import remap_lm_head

    rng = np.random.default_rng(3)
    target = rng.normal(size=(200, 6)).astype(np.float32)
    a = rng.normal(size=(6, 6)).astype(np.float32)
    old_d2t = np.zeros(160, np.int32)  # target ids 0..159
    trained = target[:160] @ a
    np.testing.assert_allclose(fit_row_map(target[:160], trained, ridge=1e-6), a, rtol=1e-3, atol=1e-3)
    new_d2t = (np.arange(40, 200) - np.arange(160)).astype(np.int32)  # target ids 40..199: 120 shared, 40 new
    out = remap_lm_head(trained, old_d2t, new_d2t, target)
    np.testing.assert_array_equal(out[:120], trained[40:])
    np.testing.assert_allclose(out[120:], target[160:] @ a, rtol=0.05, atol=0.05)  # ridge 1 over 120 rows: ~1 % shrink
    assert not remap_lm_head(trained, old_d2t, new_d2t)[120:].any()


def test_memory_analysis_sees_the_second_layer():
    """Trainer.memory_analysis (bench/probes/train_step.py --memory-only: does a batch shape fit the GPU?)
    compiles the step without running it; a second layer needs more temporaries than one."""
    from jeagle.models.llama import random_model
    from jeagle.train.trainer import TrainConfig, Trainer, draft_config_for

    tcfg = target_config()
    target = random_model(tcfg, 1)
    used = np.arange(24) + 4
    batch = {"tokens": jnp.zeros((4, 32), jnp.int32), "lengths": jnp.full((4,), 32, jnp.int32),
             "loss_mask": jnp.ones((4, 32), bool)}
    temps = []
    for layers in (1, 2):
        tc = TrainConfig(kind="eagle3", num_layers=layers, draft_vocab_size=24, ttt_steps=3, batch_size=4, seq_len=32,
                         compute_dtype="float32")
        tr = Trainer(target, draft_config_for(tcfg, tc), tc, used_ids=used)
        temps.append(tr.memory_analysis(batch).temp_size_in_bytes)
        assert tr.step == 0  # nothing ran
    assert 0 < temps[0] < temps[1]
