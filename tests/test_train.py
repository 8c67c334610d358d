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
from jeagle.train.data import DataError, DraftData, batches, iter_sharegpt, read_prompts
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


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    """A converted tiny fp32 target (EOS 3) with the character tokenizer and chat template: the bigram
    target (the next token a function of the current one, tests/spec_models.py), sharp enough that a
    head has something to learn and soft enough that sampled responses vary."""
    from jeagle.checkpoint import save_checkpoint
    from tests.spec_models import bigram_target
    from tests.test_serve import TEMPLATE, char_tokenizer

    out = tmp_path_factory.mktemp("tiny_target")
    cfg = target_config().replace(name="tiny")
    model = bigram_target(cfg, seed=3, scale=40.0)
    save_checkpoint(out, cfg, {k: np.asarray(v) for k, v in nnx.to_pure_dict(nnx.split(model)[1]).items()})
    char_tokenizer()._fast.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "unk_token": "<unk>",
                                                           "chat_template": TEMPLATE}))
    return out


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
              "--eval-batch", "4"]
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


def test_eagle1_training_lowers_loss_and_decodes(tiny_target_dir):
    """EAGLE-1 (feature regression + 0.1 CE), in process: data regenerated by the tiny target, the loss
    falls, and the trained head drafts in the real engine."""
    from jeagle.checkpoint import load_model
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


def test_regenerate_records_multiturn_raw_and_sources(tiny_target_dir):
    """Each answered turn is a sample; a later turn's prompt holds the target's own earlier answer (the
    chat template over the conversation so far); a raw record is continued without the template; a turn
    over max_prompt_tokens ends its conversation; every sample keeps its record's source."""
    from jeagle.checkpoint import load_model
    from jeagle.engine import EngineConfig, target_only
    from jeagle.tokenizer import Tokenizer
    from jeagle.train.data import regenerate_records
    from jeagle.train.records import Record

    model = load_model(tiny_target_dir)
    tok = Tokenizer.from_dir(tiny_target_dir)
    records = [Record(("alpha beta", "and gamma?"), "chat-src", "multiturn"),
               Record(("def f(x):\n",), "code-src", "code", raw=True),
               Record(("delta omega",), "chat-src", "chat")]
    engine = target_only(model, EngineConfig(max_batch_size=4, max_context=200))
    samples, sources, turns = regenerate_records(engine, tok, records, max_new_tokens=10, temperatures=(0.0, 0.8),
                                                 progress=False)
    # Grouped by conversation, in record order: record 0's two turns, then records 1 and 2.
    assert len(samples) == 4 and sources == ["chat-src", "chat-src", "code-src", "chat-src"] and turns == [0, 1, 0, 0]
    (p0, n0), (p3, n3), (p1, n1), (p2, n2) = samples
    assert p1[:n1] == tok.encode("def f(x):\n") and p2[:n2] == records[2].prompt_ids(tok)
    first_answer = tok.decode(p0[n0:])
    assert p3[:n3] == records[0].prompt_ids(tok, [first_answer]) and n3 > n0 + len(tok.encode("and gamma?")) - 2
    assert p3[:n0 - 1] == p0[:n0 - 1]  # the conversation so far, then the answer and the second turn
    data = DraftData.from_samples(samples, model.cfg.vocab_size, sources=sources, turns=turns)
    assert data.source_counts()["code-src"]["samples"] == 1 and data.source(3) == "chat-src"
    train_part, held = data.split(2)
    assert (len(train_part), len(held)) == (2, 2) and held.turns.tolist() == [0, 0]
    # Holding out 3 would cut the first conversation: its second turn's prompt holds the first turn's
    # answer, which must not be trained on; the whole conversation is held out, and nothing is left.
    with pytest.raises(DataError, match="cannot hold out"):
        data.split(3)
    # The second turn's prompt is over the limit: that conversation ends after one answer.
    short, _, _ = regenerate_records(engine, tok, records[:1], max_new_tokens=10, max_prompt_tokens=n3 - 1,
                                     progress=False)
    assert len(short) == 1
    with pytest.raises(ValueError, match="one turn"):
        records[1].prompt_ids(tok, ["an answer"])


def test_dataset_sources_survive_save_concat_split(tmp_path):
    a = DraftData.from_samples([([1, 2, 3], 1), ([4, 5], 1)], 16, "t", ["x", "y"])
    b = DraftData.from_samples([([6, 7, 8], 2)], 16, "t", ["y"])
    both = DraftData.concat([a, b])
    assert [both.source(i) for i in range(3)] == ["x", "y", "y"]
    back = DraftData.load(both.save(tmp_path / "d.npz"))
    assert back.source_counts() == {"x": {"samples": 1, "response_tokens": 2}, "y": {"samples": 2, "response_tokens": 2}}
    train_part, held = back.split(1)
    assert [train_part.source(i) for i in range(2)] == ["x", "y"] and held.source(0) == "y"
    assert back.without_prompts({(1,)}).source(0) == "y"
    # A dataset saved before sources were recorded loads as one source.
    old = tmp_path / "old.npz"
    np.savez(old, tokens=a.tokens, offsets=a.offsets, prompt_lens=a.prompt_lens,
             meta=np.array(json.dumps({"vocab_size": 16, "target_name": "t"})))
    assert DraftData.load(old).source_counts() == {"unknown": {"samples": 2, "response_tokens": 3}}
    np.savez(old, tokens=a.tokens[:2], offsets=a.offsets, prompt_lens=a.prompt_lens,
             meta=np.array(json.dumps({"vocab_size": 16, "target_name": "t"})))
    with pytest.raises(DataError, match="inconsistent"):
        DraftData.load(old)


def test_portable_checkpoint_resumes_the_schedule(tiny_target_dir, tmp_path):
    """The portable checkpoint (fp32 weights + step, no optimizer moments) restores the weights exactly,
    the step and tokens seen, and the learning-rate schedule's position; training goes on from it."""
    from jeagle.checkpoint import load_model
    from jeagle.train.trainer import TrainConfig, Trainer, draft_config_for, train

    model = load_model(tiny_target_dir)
    rng = np.random.default_rng(2)
    data = DraftData.from_samples([([1] + rng.integers(4, 90, 20).tolist(), 4) for _ in range(16)], model.cfg.vocab_size)
    used = np.arange(40) + 4
    tc = TrainConfig(kind="eagle3", draft_vocab_size=40, ttt_steps=2, steps=12, batch_size=4, seq_len=24, lr=3e-3,
                     warmup_steps=2, compute_dtype="float32", log_every=3)
    cfg = draft_config_for(model.cfg, tc)
    a = Trainer(model, cfg, tc, used_ids=used)
    tc6 = TrainConfig(**{**tc.__dict__, "steps": 6})
    a.tc = tc6
    train(a, data, progress=False)
    a.tc = tc
    path = a.save_portable(tmp_path / "portable", cfg)
    b = Trainer(model, cfg, tc, used_ids=used)
    b.load_portable(path)
    assert b.step == 6 and b.tokens_seen == a.tokens_seen > 0
    for k in a.params:
        np.testing.assert_array_equal(np.asarray(b.params[k]), np.asarray(a.params[k]))
    import optax

    counts = [int(v) for _, v in optax.tree_utils.tree_get_all_with_path(b.opt_state, "count")]
    assert counts and set(counts) == {6}  # the schedule and Adam's bias correction continue at step 6
    history = train(b, data, progress=False)
    assert b.step == 12 and all(np.isfinite(h["loss"]) for h in history)
    assert history[-1]["tokens_seen"] == b.tokens_seen
    other = Trainer(model, cfg, tc, used_ids=used + 1)
    with pytest.raises(ValueError, match="draft vocabulary"):
        other.load_portable(path)


def test_regeneration_continues_where_it_stopped(tiny_target_dir, tmp_path):
    """--regenerate-time-limit stops between blocks with the dataset saved as partial; runs with the same
    prompts continue it, and the result is the dataset one uninterrupted run makes; other prompts over a
    partial dataset are refused; a partial dataset is not trained on."""
    from jeagle.train_draft import main

    prompts = tmp_path / "mix.jsonl"
    rows = [{"turns": [f"alpha beta {i}?"] + (["and then?"] if i % 5 == 0 else []), "source": "s"} for i in range(20)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--target", str(tiny_target_dir), "--prompts", str(prompts), "--num-prompts", "20", "--max-new-tokens",
              "8", "--gen-batch", "8", "--target-dtype", "float32", "--regenerate-only", "--no-progress"]
    assert main(["--out", str(tmp_path / "whole"), *common]) == 0
    for _ in range(3):  # blocks of 8: a time limit of 0 answers one block a run
        assert main(["--out", str(tmp_path / "parts"), *common, "--regenerate-block", "8",
                     "--regenerate-time-limit", "0"]) == 0
        meta = json.loads((tmp_path / "parts" / "data.json").read_text())
        assert meta["records_done"] == min(8 * (_ + 1), 20) and meta["complete"] == (_ == 2)
    whole, parts = (DraftData.load(tmp_path / d / "data.npz") for d in ("whole", "parts"))
    assert parts.fingerprint() == whole.fingerprint() and parts.turns.tolist() == whole.turns.tolist()
    assert len(whole) == 24  # 20 first turns + 4 second turns
    prompts.write_text("".join(json.dumps(r | {"turns": ["other " + r["turns"][0]]}) + "\n" for r in rows))
    assert main(["--out", str(tmp_path / "parts2"), *common, "--regenerate-block", "8", "--regenerate-time-limit", "0"]) == 0
    rows[0]["turns"] = ["changed"]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--out", str(tmp_path / "parts2"), *common, "--regenerate-block", "8"]) == 2  # other prompts: refused
    train_args = [a for a in common if a != "--regenerate-only"] + ["--steps", "2", "--batch-size", "2", "--seq-len",
                                                                     "32", "--eval-prompts", "0"]
    assert main(["--out", str(tmp_path / "parts3"), *train_args, "--regenerate-block", "8",
                 "--regenerate-time-limit", "0"]) == 0
    assert not (tmp_path / "parts3" / "head").exists() and not (tmp_path / "parts3" / "ckpt").exists()


def test_rebuild_vocab_keeps_the_trained_rows(tiny_target_dir, tmp_path):
    """--init-from HEAD --rebuild-vocab: the draft vocabulary comes from the new data; a token in both
    keeps the head's row, a new one starts at zero. Response tokens are what a per-sample loop gives."""
    from safetensors.numpy import load_file

    from jeagle.checkpoint import load_model
    from jeagle.train.vocab import remap_lm_head
    from jeagle.train_draft import main

    def head_of(run):
        t = load_file(str(tmp_path / run / "head" / "model.safetensors"))
        return t["lm_head"].astype(np.float32), t["d2t"]

    def prompts(name, words):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"turns": [f"{w} {i}?"]}) + "\n" for i, w in enumerate(words * 4)))
        return str(path)

    common = ["--target", str(tiny_target_dir), "--max-new-tokens", "12", "--gen-batch", "8", "--target-dtype",
              "float32", "--compute-dtype", "float32", "--steps", "0", "--eval-prompts", "0", "--draft-vocab-size",
              "24", "--no-progress"]
    trained = ["--steps", "3", "--lr", "3e-2", "--warmup-steps", "1", "--batch-size", "4", "--seq-len", "32"]
    assert main(["--out", str(tmp_path / "a"), "--prompts", prompts("a.jsonl", ["alpha", "beta"]), *common,
                 *trained]) == 0
    assert main(["--out", str(tmp_path / "b"), "--prompts", prompts("b.jsonl", ["omega", "kappa", "beta"]),
                 "--init-from", str(tmp_path / "a" / "head"), "--rebuild-vocab", *common]) == 0
    (head_a, d2t_a), (head_b, d2t_b) = head_of("a"), head_of("b")
    used_a, used_b = np.arange(24) + d2t_a, np.arange(24) + d2t_b
    assert set(used_a) != set(used_b) and set(used_a) & set(used_b)
    target = np.asarray(load_model(tiny_target_dir).lm_head[...], np.float32)
    assert np.abs(head_a - target[used_a]).mean() > 0.02  # trained rows: not the target's
    for j, t in enumerate(used_b):
        if t in used_a:  # the trained row, exactly (bf16 in both heads)
            np.testing.assert_array_equal(head_b[j], head_a[list(used_a).index(t)])
        else:
            assert not head_b[j].any()
    np.testing.assert_array_equal(remap_lm_head(head_a, d2t_a, d2t_a), head_a)

    data = DraftData.from_samples([([1, 2, 3, 4], 1), ([5, 6], 2), ([7, 8, 9], 0)], 16)
    loop = np.concatenate([data.sample(i)[int(data.prompt_lens[i]):] for i in range(len(data))])
    np.testing.assert_array_equal(data.response_tokens(), loop)


def test_every_source_through_regeneration(tiny_target_dir, tmp_path):
    """A mix of a few records from every prompt source (ShareGPT from a small file), built by the
    `sources build` command and answered by the tiny target: each source's samples and licence are
    recorded with the dataset."""
    from jeagle.train import sources
    from jeagle.train_draft import main

    convs = [{"conversations": [{"from": "human", "value": f"Opening question number {i}?"},
                                {"from": "gpt", "value": "An answer."},
                                {"from": "human", "value": f"A follow-up to question {i}?"}]} for i in range(6)]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    mix = tmp_path / "mix.jsonl"
    counts = ",".join(f"{name}:2" for name in sources.SOURCES)
    assert sources.main(["build", "--mix", counts, "--sharegpt", str(tmp_path / "sg.json"), "--out", str(mix)]) == 0
    assert main(["--out", str(tmp_path / "run"), "--target", str(tiny_target_dir), "--prompts", str(mix),
                 "--max-new-tokens", "6", "--gen-batch", "8", "--target-dtype", "float32", "--regenerate-only",
                 "--no-progress"]) == 0
    meta = json.loads((tmp_path / "run" / "data.json").read_text())
    assert set(meta["sources"]) == set(sources.SOURCES) and meta["prompts"] == 2 * len(sources.SOURCES)
    assert meta["sources"]["sharegpt-multiturn"]["samples"] == 4  # two conversations of two turns
    assert all(meta["mix"][name]["licence"] for name in sources.SOURCES)


def test_train_loop_saves_and_evaluates_once_per_step_and_stops_in_time(tiny_target_dir, tmp_path):
    """The loop's bookkeeping: an evaluation before the first step of a fresh schedule (not after a
    restore), every eval_every steps and at the stop; one save per step at most; a time limit spent by an
    evaluation stops the run at that step, saved and logged."""
    from jeagle.checkpoint import load_model
    from jeagle.train.trainer import TrainConfig, Trainer, draft_config_for, train

    model = load_model(tiny_target_dir)
    rng = np.random.default_rng(4)
    data = DraftData.from_samples([([1] + rng.integers(4, 90, 16).tolist(), 4) for _ in range(8)], model.cfg.vocab_size)
    tc = TrainConfig(kind="eagle3", draft_vocab_size=40, ttt_steps=1, steps=20, batch_size=4, seq_len=16, lr=1e-3,
                     warmup_steps=1, compute_dtype="float32", log_every=4, save_every=3)
    trainer = Trainer(model, draft_config_for(model.cfg, tc), tc, used_ids=np.arange(40) + 4)
    saves, evals = [], []

    def on_eval(tr):
        evals.append(tr.step)
        if tr.step == 6:
            import time

            time.sleep(1.5)  # this evaluation spends the time limit

    history = train(trainer, data, ckpt_dir=tmp_path / "ckpt", progress=False, time_limit=1.0,
                    on_save=lambda tr: saves.append(tr.step), on_eval=on_eval, eval_every=2, eval_at_start=True)
    # Steps are fast here, so the 1 s limit is spent by the evaluation at step 6, if not before it.
    stop = trainer.step
    assert stop <= 6 and evals[0] == 0 and evals[-1] == stop and evals == sorted(set(evals))
    assert saves == sorted(set(saves)) and saves[-1] == stop  # once a step, the last step saved
    assert history[-1]["step"] == stop  # the last step logged though off the log interval
    # A resumed run restores and does not evaluate "before the first step" again.
    evals.clear()
    trainer2 = Trainer(model, draft_config_for(model.cfg, tc), tc, used_ids=np.arange(40) + 4)
    train(trainer2, data, ckpt_dir=tmp_path / "ckpt", resume=True, progress=False, on_eval=on_eval, eval_every=100,
          eval_at_start=True)
    assert evals == [20] and trainer2.step == 20
