"""Training EAGLE heads (jeagle/train): the training-time-test forward equals the inference draft, the
data and vocabulary helpers, and a tiny end-to-end run whose loss falls and whose head loads."""

from __future__ import annotations

import io
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jeagle.models.common import AttnInputs
from jeagle.train.data import (DataError, DraftData, batches, epoch_batches, iter_sharegpt, length_buckets,
                               read_prompts)
from jeagle.train.model import draft_unrolled, target_outputs
from jeagle.train.vocab import coverage, draft_vocab
from tests.spec_models import draft_config, target_config


def _head_params(head):
    pure = nnx.to_pure_dict(nnx.split(head)[1])
    pure.pop("d2t", None)
    return pure


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_ttt_forward_equals_inference_draft(kind):
    """Step 0 of the unrolled forward is the draft run over the sequence through its KV pool; step s at
    base t is the tree draft's depth-s node: the prefix keys 0..t plus its chain of ancestors."""
    from jeagle.models.eagle import random_draft
    from jeagle.models.llama import random_model

    tcfg = target_config()
    target = random_model(tcfg, 1)
    cfg = draft_config(tcfg, kind).replace(fc_bias=kind == "eagle1", num_layers=2 if kind == "eagle1" else 1)
    head = random_draft(cfg, 2)
    T, steps = 12, 3
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(4, tcfg.vocab_size, (1, T)), jnp.int32)
    lengths = jnp.asarray([T], jnp.int32)
    hidden, aux, _ = target_outputs(target, tokens, lengths, aux_layers=cfg.aux_layer_ids)
    feature = aux if kind == "eagle3" else hidden
    embed = target.embed[...]
    out_head = head.lm_head[...] if kind == "eagle3" else target.lm_head[...]
    outs = draft_unrolled(_head_params(head), cfg, embed, out_head, tokens, feature, lengths, steps)

    slots = 1 + T + steps + 1
    shape = (cfg.num_layers, slots, cfg.num_kv_heads, cfg.head_dim)
    kp, vp = jnp.zeros(shape), jnp.zeros(shape)
    shifted = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    attn = AttnInputs(positions=pos, write_slots=pos + 1, kv_slots=pos + 1, kv_len=lengths)
    ref0 = head(shifted, feature, attn, kp, vp, embed=embed, lm_head=None if kind == "eagle3" else out_head)
    np.testing.assert_allclose(np.asarray(outs[0][0]), np.asarray(ref0.hidden), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(np.asarray(outs[0][1]), np.asarray(ref0.logits), rtol=2e-4, atol=2e-4)

    for t in (0, 4, T - steps - 1):
        kp_t, vp_t = ref0.k, ref0.v
        feat = ref0.hidden[:, t:t + 1]
        chain = []
        for s in range(1, steps):
            slot = 1 + T + s
            chain.append(slot)
            kv_slots = jnp.asarray([list(range(1, t + 2)) + chain], jnp.int32)
            a = AttnInputs(positions=jnp.asarray([[t + s]], jnp.int32), write_slots=jnp.asarray([[slot]], jnp.int32),
                           kv_slots=kv_slots, kv_len=jnp.asarray([kv_slots.shape[1]], jnp.int32),
                           mask=jnp.ones((1, 1, kv_slots.shape[1]), bool))
            r = head(tokens[:, t + 1 + s:t + 2 + s], feat, a, kp_t, vp_t, embed=embed,
                     lm_head=None if kind == "eagle3" else out_head)
            kp_t, vp_t, feat = r.k, r.v, r.hidden
            np.testing.assert_allclose(np.asarray(outs[s][0][:, t]), np.asarray(r.hidden[:, 0]), rtol=2e-4, atol=2e-5,
                                       err_msg=f"step {s} base {t}")
            np.testing.assert_allclose(np.asarray(outs[s][1][:, t]), np.asarray(r.logits[:, 0]), rtol=2e-4, atol=2e-4)


def test_sharegpt_reader_streams_and_survives_truncation():
    recs = [{"id": str(i), "conversations": [{"from": "human", "value": f"question {i} {'x' * i}"},
                                            {"from": "gpt", "value": "answer"}]} for i in range(50)]
    text = json.dumps(recs, indent=1)
    cut = text[: int(len(text) * 0.8)]  # truncated mid-record, like the packaged file
    got = list(iter_sharegpt(io.StringIO(cut), chunk_chars=97))
    assert 30 < len(got) < 50 and [r["id"] for r in got] == [str(i) for i in range(len(got))]
    assert len(list(iter_sharegpt(io.StringIO(text), chunk_chars=64))) == 50
    with pytest.raises(DataError):
        list(iter_sharegpt(io.StringIO('{"a": 1}')))
    broken = text.replace('"id": "3"', '"id": "3",,', 1)  # malformed mid-file: an error, not a silent stop
    with pytest.raises(DataError, match="malformed"):
        list(iter_sharegpt(io.StringIO(broken), chunk_chars=64, max_record_chars=400))


def test_read_prompts_sources_and_exclusions(tmp_path):
    recs = [{"conversations": [{"from": "human", "value": v}]} for v in
            ["What is 2+2?", "what is  2+2?", "Tell me a story.", "hi", "Name three colours."]]
    (tmp_path / "s.json").write_text(json.dumps(recs))
    got = read_prompts(str(tmp_path / "s.json"), exclude=["NAME three colours."])
    assert got == ["What is 2+2?", "Tell me a story."]  # duplicate (normalised), too short, excluded
    assert read_prompts(str(tmp_path / "s.json"), limit=1) == ["What is 2+2?"]
    multi = [{"conversations": [{"from": "human", "value": "First question?"}, {"from": "gpt", "value": "A."},
                                {"from": "human", "value": "A follow-up question?"}]}]
    (tmp_path / "m.json").write_text(json.dumps(multi))
    assert read_prompts(str(tmp_path / "m.json")) == ["First question?"]
    assert read_prompts(str(tmp_path / "m.json"), all_turns=True) == ["First question?", "A follow-up question?"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "Explain gravity."}\n\n{"question": "Why is the sky blue?"}\n')
    assert read_prompts(str(tmp_path / "p.jsonl")) == ["Explain gravity.", "Why is the sky blue?"]
    with pytest.raises(DataError, match="no such file"):
        read_prompts(str(tmp_path / "missing.json"))
    (tmp_path / "p.csv").write_text("x")
    with pytest.raises(DataError, match="expected"):
        read_prompts(str(tmp_path / "p.csv"))


def test_dataset_roundtrip_batches_and_vocab(tmp_path):
    samples = [([1, 2, 3, 4, 5, 6], 2), ([7, 8, 9], 1), ([5, 5, 5, 5], 3), ([9, 9, 2, 2, 2], 2)]
    data = DraftData.from_samples(samples, vocab_size=16, target_name="t")
    path = data.save(tmp_path / "d.npz")
    back = DraftData.load(path)
    assert len(back) == 4 and back.sample(1).tolist() == [7, 8, 9] and back.num_response_tokens == 4 + 2 + 1 + 3
    with pytest.raises(DataError, match="vocabulary"):
        back.check_target(32)
    with pytest.raises(DataError, match="generated by 't'"):
        back.check_target(16, "another-model")
    back.check_target(16, "t")
    assert [back.without_prompts({(7,)}).sample(i).tolist() for i in range(3)] == [[1, 2, 3, 4, 5, 6], [5, 5, 5, 5],
                                                                                  [9, 9, 2, 2, 2]]
    train, held = back.split(1)
    assert len(train) == 3 and held.sample(0).tolist() == [9, 9, 2, 2, 2]
    b = next(batches(back, 2, 5, seed=0))
    for row, n, m in zip(b["tokens"], b["lengths"], b["loss_mask"]):
        i = next(i for i, (ids, _) in enumerate(samples) if ids[:5] == row[:n].tolist())
        p = samples[i][1]
        assert m.tolist() == [p - 1 <= j < n - 1 for j in range(5)]  # label positions of response tokens
    # Resuming at step k yields the batch the uninterrupted run had at step k.
    full = batches(back, 2, 5, seed=3)
    seq = [next(full)["tokens"] for _ in range(5)]
    np.testing.assert_array_equal(next(batches(back, 2, 5, seed=3, start_step=3))["tokens"], seq[3])
    d2t, t2d = draft_vocab(back, 16, 4, always=(15,))
    used = np.arange(4) + d2t
    # The most frequent response tokens (2: 3 times, 5: twice, then the smallest id of those seen once),
    # EOS forced in, sorted by id.
    assert used.tolist() == [2, 3, 5, 15]
    assert t2d.sum() == 4 and coverage(back, t2d) == pytest.approx((2 + 0 + 1 + 3) / 10)


def _train_cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "jeagle.train_draft", "--no-progress", *args], capture_output=True,
                          text=True, timeout=900)


def test_train_draft_end_to_end(tiny_target_dir, tmp_path):
    """Regenerate data with the tiny target from a training mix (one-turn, multi-turn and raw records,
    one excluded), train a few dozen steps (the loss falls) with evaluation sets, evaluate with the real
    engine, export; the exported head loads with --draft and decodes losslessly; --resume continues, also
    from the portable checkpoint alone; a fresh run over a checkpoint is refused before it writes."""
    prompts = tmp_path / "mix.jsonl"
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    rows = [{"turns": [" ".join(rng.choice(words, 4)) + f" {i}?"], "source": "chat-src"} for i in range(34)]
    rows += [{"turns": [f"omega {i}?", "and then?", "why so?"], "source": "multi", "category": "multiturn"}
             for i in range(2)]
    rows += [{"turns": [f"def f{i}(x):\n"], "source": "code-src", "raw": True} for i in range(3)]
    rows.insert(7, {"turns": ["alpha gamma 1?"], "source": "chat-src"})  # an evaluation prompt: excluded
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    kind = "eagle3"
    common = ["--out", str(out), "--target", str(tiny_target_dir), "--prompts", str(prompts), "--num-prompts", "40",
              "--max-new-tokens", "24", "--gen-batch", "16", "--kind", kind, "--draft-vocab-size", "48",
              "--ttt-steps", "3" if kind == "eagle3" else "1", "--batch-size", "8", "--seq-len", "64", "--lr", "3e-3",
              "--warmup-steps", "5", "--compute-dtype", "float32", "--target-dtype", "float32", "--log-every", "5",
              "--save-every", "20", "--eval-prompts", "4", "--eval-max-new-tokens", "12", "--eval-spec", "3,2,4",
              "--eval-batch", "4", "--length-buckets", "2"]  # two row lengths: each one more compile on CPU
    evalset = tmp_path / "evalset.jsonl"
    evalset.write_text('{"turns": ["alpha gamma 1?"], "category": "chat"}\n'
                       '{"turns": ["def g(y):\\n"], "category": "code", "raw": true}\n{"prompt": "beta beta 2?"}\n')
    common += ["--exclude", str(evalset)]
    proc = _train_cli(*common, "--steps", "40", "--eval-set", f"small={evalset}", "--eval-every", "20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    log = [r for r in rows if "kind" not in r]
    assert log[-1]["step"] == 40 and log[-1]["loss"] < 0.8 * log[0]["loss"], (log[0], log[-1])
    assert log[-1]["tokens_seen"] > log[0]["tokens_seen"] > 0
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [0, 20, 40] and evals[2]["tokens_seen"] == log[-1]["tokens_seen"]
    assert evals[0]["tokens_seen"] == 0 and set(evals[2]["sets"]["small"]["categories"]) == {"chat", "code", ""}
    assert evals[2]["sets"]["small"]["accept_length"] >= 1.0
    info = json.loads((out / "head" / "training.json").read_text())
    assert info["eval"]["accept_length"] >= 1.0 and info["data"]["prompts"] == 39 and info["data"]["excluded"] == 3
    sources = info["data"]["sources"]  # every turn of a multi-turn record is a sample
    assert sources["multi"]["samples"] == 6 and sources["code-src"]["samples"] == 3 and sources["chat-src"]["samples"] == 34
    assert json.loads((out / "portable" / "trainer_state.json").read_text())["step"] == 40
    card = (out / "head" / "README.md").read_text()
    assert "accept length" in card and "python -m jeagle.train_draft" in card
    assert (out / "head" / "model.safetensors").is_file()

    # The exported head runs through the CLI; greedy output equals target-only.
    from tests.test_cli import run_cli

    spec = json.loads(run_cli("--target", str(tiny_target_dir), "--draft", str(out / "head"), "--json", "--raw",
                              "--ignore-eos", "--max-new-tokens", "16", "alpha beta", "gamma").stdout)
    plain = json.loads(run_cli("--target", str(tiny_target_dir), "--speculative-algorithm", "none", "--json", "--raw",
                               "--ignore-eos", "--max-new-tokens", "16", "alpha beta", "gamma").stdout)
    assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in plain["outputs"]]
    assert spec["stats"]["accept_length"] >= 1.0

    # Resume: the dataset is reused and training continues from the last checkpoint to the new total.
    proc = _train_cli(*common, "--steps", "50", "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 40" in proc.stdout and "dataset " in proc.stdout
    assert "the learning rate jumps" in proc.stdout  # 40 planned steps, now 50: the schedule changed
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if "kind" not in line]
    assert log[-1]["step"] == 50
    # The run moves machines: only the portable checkpoint travels; --resume continues from it.
    import shutil

    shutil.rmtree(out / "ckpt")
    before = (out / "train_log.jsonl").read_text()
    proc = _train_cli(*common, "--steps", "55", "--eval-set", f"small={evalset}")  # --resume forgotten
    assert proc.returncode == 2 and "already holds a checkpoint at step 50" in proc.stderr
    assert (out / "train_log.jsonl").read_text() == before  # refused before it wrote anything
    assert json.loads((out / "portable" / "trainer_state.json").read_text())["step"] == 50
    proc = _train_cli(*common, "--steps", "55", "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from the portable checkpoint" in proc.stdout and "at step 50" in proc.stdout
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if "kind" not in line]
    assert log[-1]["step"] == 55 and log[-1]["tokens_seen"] > log[-2]["tokens_seen"]
    # A fresh run into an --out that holds checkpoints is refused (orbax would drop its older steps).
    proc = _train_cli(*common, "--steps", "30")
    assert proc.returncode == 2 and "already holds a checkpoint at step 55" in proc.stderr


def test_train_draft_bad_input(tiny_target_dir, tmp_path):
    proc = _train_cli("--out", str(tmp_path / "o"), "--target", str(tiny_target_dir), "--prompts", str(tmp_path / "no.json"))
    assert proc.returncode == 2 and "no such file" in proc.stderr
    bad = tmp_path / "d.npz"
    bad.write_bytes(b"not a zip")
    proc = _train_cli("--out", str(tmp_path / "o"), "--target", str(tiny_target_dir), "--data", str(bad))
    assert proc.returncode == 2 and "not a jeagle draft-training dataset" in proc.stderr
    proc = _train_cli("--out", str(tmp_path / "o"), "--target", str(tiny_target_dir), "--prompts", str(bad),
                      "--length-buckets", "0")  # refused before the prompts are read, let alone answered
    assert proc.returncode == 2 and "length buckets: 0" in proc.stderr


def test_eagle1_training_lowers_loss_and_decodes(tiny_target_dir):
    """EAGLE-1 (feature regression + 0.1 CE), in process: data regenerated by the tiny target, the loss
    falls, and the trained head drafts in the real engine."""
    from jeagle.loading.checkpoint import load_model
    from jeagle.engine import EngineConfig, target_only
    from jeagle.train.data import regenerate
    from jeagle.train.model import head_module
    from jeagle.train.trainer import TrainConfig, Trainer, draft_config_for, evaluate_accept_length, train

    model = load_model(tiny_target_dir)
    rng = np.random.default_rng(1)
    prompts = [[1] + rng.integers(4, 90, 6).tolist() for _ in range(24)]
    samples = regenerate(target_only(model, EngineConfig(max_batch_size=8, max_context=64)), prompts, max_new_tokens=20,
                         temperatures=(0.0, 0.8), progress=False)
    data = DraftData.from_samples(samples, model.cfg.vocab_size)
    tc = TrainConfig(kind="eagle1", ttt_steps=1, steps=40, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=5,
                     compute_dtype="float32", log_every=10)
    trainer = Trainer(model, draft_config_for(model.cfg, tc), tc)
    history = train(trainer, data, progress=False)
    assert history[-1]["loss"] < 0.7 * history[0]["loss"] and history[-1]["reg0"] < history[0]["reg0"]
    head = head_module(trainer.params, trainer.cfg, trainer.d2t)
    ev = evaluate_accept_length(model, head, prompts[:4], spec=(3, 1, 4), max_new_tokens=12)
    from jeagle.sampling import SamplingParams

    plain = target_only(model, EngineConfig(max_batch_size=4, max_context=64)).generate(prompts[:4],
                                                                                  SamplingParams(max_new_tokens=12))
    assert ev["outputs"] == [o.token_ids for o in plain]  # lossless (greedy)
    assert ev["accept_length"] > 1.0


def test_length_bucketed_batches_cover_an_epoch_and_resume():
    rng = np.random.default_rng(0)
    lens = rng.integers(3, 40, 203)  # some longer than seq_len 32: cut to it
    samples = [(list(rng.integers(1, 4096, n)), int(rng.integers(1, n))) for n in lens]  # told apart by prefix
    data = DraftData.from_samples(samples, vocab_size=4096)
    assert length_buckets(32, 4) == (8, 16, 24, 32) and length_buckets(32, 1) == (32,) and length_buckets(5, 4) == (5,)
    with pytest.raises(ValueError, match="largest seq_len"):
        next(batches(data, 4, 32, seed=0, buckets=(8, 16)))
    it = batches(data, 4, 32, seed=1, buckets=length_buckets(32, 4))
    per_epoch = len(epoch_batches(data, 4, 32, seed=1, buckets=length_buckets(32, 4)))
    seen, shapes = [], set()
    for _ in range(per_epoch):
        b = next(it)
        rows, s = b["tokens"].shape
        shapes.add((rows, s))
        assert rows == 4 * 32 // s  # (about) the same positions every step
        for row, n, m in zip(b["tokens"], b["lengths"], b["loss_mask"]):
            i = next(i for i, (ids, _) in enumerate(samples) if len(ids) >= n and ids[:n] == row[:n].tolist()
                     and i not in seen)
            seen.append(i)
            assert n == min(len(samples[i][0]), s)  # a short sample may ride up a bucket (an epoch's leftovers)
            p = samples[i][1]
            assert m.tolist() == [p - 1 <= j < n - 1 for j in range(s)]
    assert shapes == {(16, 8), (8, 16), (5, 24), (4, 32)}
    assert len(seen) == len(set(seen)) and len(data) - len(seen) < 4  # each sample once; < one long batch left
    # Leftovers ride up: 17 short samples fill one batch of 16 rows of 8, the 17th joins the 3 long ones.
    few = DraftData.from_samples([([1] * 5, 2)] * 17 + [([2] * 30, 2)] * 3, vocab_size=4096)
    plan = epoch_batches(few, 4, 32, seed=0, buckets=length_buckets(32, 4))
    assert sorted((s, len(ids)) for s, ids in plan) == [(8, 16), (32, 4)]
    assert sorted(np.concatenate([ids for _, ids in plan]).tolist()) == list(range(20))
    # The same samples in fewer steps than rows of seq_len take (lengths uniform in 3..39 here): less padding.
    assert per_epoch <= 0.8 * (len(data) // 4)
    # A resumed run continues the order, into the next epoch too.
    full = batches(data, 4, 32, seed=1, buckets=length_buckets(32, 4))
    seq = [next(full)["tokens"] for _ in range(per_epoch + 3)]
    for k in (2, per_epoch + 1):
        np.testing.assert_array_equal(next(batches(data, 4, 32, seed=1, start_step=k,
                                                   buckets=length_buckets(32, 4)))["tokens"], seq[k])
    with pytest.raises(DataError, match="fewer than one batch"):
        next(batches(DraftData.from_samples(samples[:3], vocab_size=4096), 4, 32, seed=0))
