"""Training runs beyond one step (jeagle/train, jeagle.train_draft): multi-turn and raw records regenerated
turn by turn, datasets that keep their sources and conversations, regeneration continued in blocks, the
portable checkpoint, --rebuild-vocab, every prompt source through regeneration, and the training loop's
save / evaluate / time-limit bookkeeping. All on the tiny target, CPU, fp32."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jeagle.train.data import DataError, DraftData


def test_regenerate_records_multiturn_raw_and_sources(tiny_target_dir):
    """Each answered turn is a sample; a later turn's prompt holds the target's own earlier answer (the
    chat template over the conversation so far); a raw record is continued without the template; a turn
    over max_prompt_tokens ends its conversation; every sample keeps its record's source."""
    from jeagle.loading.checkpoint import load_model
    from jeagle.engine import EngineConfig, target_only
    from jeagle.loading.tokenizer import Tokenizer
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


def test_portable_checkpoint_resumes_the_schedule(tiny_target_dir, tmp_path, capsys):
    """The portable checkpoint (fp32 weights + step, no optimizer moments) restores the weights exactly,
    the step and tokens seen, and the learning-rate schedule's position; training goes on from it."""
    from jeagle.loading.checkpoint import load_model
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
    # Other batching resumes, with a word: the samples come in another order from there on.
    regrouped = Trainer(model, cfg, TrainConfig(**{**tc.__dict__, "length_buckets": 1}), used_ids=used)
    capsys.readouterr()
    regrouped.load_portable(path)
    assert "samples come in another order" in capsys.readouterr().out and regrouped.step == 6
    b.load_portable(path)
    assert "another order" not in capsys.readouterr().out


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
    # The dataset records what it excluded: reusing it under an --exclude it was made without is refused.
    banned = tmp_path / "banned.txt"
    banned.write_text("some evaluation prompt\n")
    assert main(["--out", str(tmp_path / "whole"), *common, "--exclude", str(banned)]) == 2
    whole, parts = (DraftData.load(tmp_path / d / "data.npz") for d in ("whole", "parts"))
    assert parts.fingerprint() == whole.fingerprint() and parts.turns.tolist() == whole.turns.tolist()
    assert len(whole) == 24  # 20 first turns + 4 second turns
    prompts.write_text("".join(json.dumps(r | {"turns": ["other " + r["turns"][0]]}) + "\n" for r in rows))
    assert main(["--out", str(tmp_path / "parts2"), *common, "--regenerate-block", "8", "--regenerate-time-limit", "0"]) == 0
    rows[0]["turns"] = ["changed"]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--out", str(tmp_path / "parts2"), *common, "--regenerate-block", "8"]) == 2  # other prompts: refused
    train_args = [a for a in common if a != "--regenerate-only"] + ["--steps", "2", "--batch-size", "2", "--seq-len",
                                                                     "32", "--eval-prompts", "0", "--length-buckets", "2"]
    assert main(["--out", str(tmp_path / "parts3"), *train_args, "--regenerate-block", "8",
                 "--regenerate-time-limit", "0"]) == 0
    assert not (tmp_path / "parts3" / "head").exists() and not (tmp_path / "parts3" / "ckpt").exists()


def test_rebuild_vocab_keeps_the_trained_rows(tiny_target_dir, tmp_path):
    """--init-from HEAD --rebuild-vocab: the draft vocabulary comes from the new data; a token in both
    keeps the head's row, a new one starts at zero. Response tokens are what a per-sample loop gives."""
    from safetensors.numpy import load_file

    from jeagle.loading.checkpoint import load_model
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
    trained = ["--steps", "3", "--lr", "3e-2", "--warmup-steps", "1", "--batch-size", "4", "--seq-len", "32",
               "--length-buckets", "2"]
    assert main(["--out", str(tmp_path / "a"), "--prompts", prompts("a.jsonl", ["alpha", "beta"]), *common,
                 *trained]) == 0
    assert main(["--out", str(tmp_path / "b"), "--prompts", prompts("b.jsonl", ["omega", "kappa", "beta"]),
                 "--init-from", str(tmp_path / "a" / "head"), "--rebuild-vocab", "--new-rows", "zero", *common]) == 0
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
    from jeagle.loading.checkpoint import load_model
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
