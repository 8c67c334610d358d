"""The per-category accept-length evaluation (jeagle/train/evaluate.py) and its curve over training:
categories run apart and pool as tokens ÷ rounds (checked against one engine run over every prompt),
groups pool their categories, raw records skip the chat template, later turns carry the first answer,
sampling is seeded; the curve reads a training log's evaluation rows and bench/accept_length.py draws it.

    python -m pytest -q tests/test_train_eval.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jeagle.train.records import Record
from jeagle.train.evaluate import GROUPS, accept_lengths, curve, plot_curve, pooled_groups, read_eval_set

REPO = Path(__file__).resolve().parents[1]
SPEC = (3, 2, 4)
NEW = 16

# Raw records of different endings next to chat ones: the bigram target's continuation depends on the
# last token only, and every chat prompt ends "assistant\n".
RECORDS = [
    Record(("Write a short poem about rain.",), "mtbench", "writing"),
    Record(("Pretend you are a pirate.", "Now say it again, louder."), "mtbench", "roleplay"),
    Record(("def add(a, b):\n    return",), "code", "code", raw=True),
    Record(("Twelve times seven is",), "gsm8k", "math", raw=True),
    Record(("for x in range(3):",), "mtbench", "coding", raw=True),
    Record(("Hello there.",), "legacy", ""),
    Record(("Dear Kim, I am writing to say",), "mtbench", "writing", raw=True),
]

@pytest.fixture(scope="module")
def parts():
    """The bigram target soft enough that sampling varies (tests/test_train.py's), a noisy oracle head
    (partial acceptance), the character tokenizer with a chat template."""
    from tests.spec_models import bigram_target, signed_identity_head, target_config
    from tests.test_serve import char_tokenizer

    target = bigram_target(target_config(), seed=3, scale=40.0)
    return target, signed_identity_head(target, +1.0, noise=0.08), char_tokenizer()


@pytest.fixture(scope="module")
def engines():
    return {}


def run(parts, engines, records=RECORDS, **kw):
    target, head, tok = parts
    return accept_lengths(target, head, tok, records, **{"spec": SPEC, "max_new_tokens": NEW, "batch_size": 4,
                                                         "buckets": (4,), "engines": engines} | kw)


@pytest.fixture(scope="module")
def greedy(parts, engines):
    return run(parts, engines)


def tau(counts) -> float:
    counts = list(counts)
    return sum(c["round_tokens"] for c in counts) / sum(c["rounds"] for c in counts)


def test_categories_split_as_given_and_pool_as_tokens_over_rounds(parts, engines, greedy):
    from jeagle.engine import EngineConfig, SpecConfig, speculative
    from jeagle.sampling import SamplingParams

    target, head, tok = parts
    assert list(greedy["categories"]) == ["writing", "roleplay", "code", "math", "coding", ""]
    assert len(set(greedy["categories"].values())) >= 3  # the records tell categories apart
    assert {c: v["prompts"] for c, v in greedy["counts"].items()} == {
        "writing": 2, "roleplay": 1, "code": 1, "math": 1, "coding": 1, "": 1}
    assert greedy["prompts"] == len(RECORDS) and greedy["spec"] == list(SPEC) and greedy["temperature"] == 0.0
    for cat, c in greedy["counts"].items():
        assert c["rounds"] > 0 and greedy["categories"][cat] == pytest.approx(c["round_tokens"] / c["rounds"], abs=1e-4)
    assert greedy["rounds"] == sum(c["rounds"] for c in greedy["counts"].values())
    assert greedy["accept_length"] == pytest.approx(tau(greedy["counts"].values()), abs=1e-4)
    assert sum(int(k) * v for k, v in greedy["histogram"].items()) == sum(
        c["round_tokens"] for c in greedy["counts"].values())
    # Independent of the pooling: one engine run over every prompt averages the same request-rounds.
    ids = [r.prompt_ids(tok) for r in RECORDS]
    eng = speculative(target, head, EngineConfig(max_batch_size=4, max_context=256, batch_buckets=(4,)),
                      SpecConfig(*SPEC))
    eng.generate(ids, SamplingParams(max_new_tokens=NEW))
    assert eng.last_stats.speculative.rounds == greedy["rounds"]
    assert greedy["accept_length"] == pytest.approx(eng.last_stats.accept_length, abs=1e-4)
    # A category's figure is its own run's: the writing records alone give the same.
    alone = run(parts, engines, [r for r in RECORDS if r.category == "writing"])
    assert alone["accept_length"] == greedy["categories"]["writing"]
    assert alone["counts"]["writing"] == greedy["counts"]["writing"]


def test_groups_pool_their_categories(greedy):
    c = greedy["counts"]
    assert set(GROUPS["code"]) == {"coding", "code"} and "" in GROUPS["chat"]
    assert list(greedy["groups"]) == ["code", "math", "writing", "chat"]
    assert greedy["groups"]["code"] == pytest.approx(tau([c["coding"], c["code"]]), abs=1e-4)
    assert abs(greedy["groups"]["code"] - (greedy["categories"]["coding"] + greedy["categories"]["code"]) / 2) > 0.01
    assert greedy["groups"]["chat"] == pytest.approx(tau([c["roleplay"], c[""]]), abs=1e-4)
    assert greedy["groups"]["writing"] == greedy["categories"]["writing"]
    # Pooled over two results: their categories' counts together, not a mean of the two.
    other = {"counts": {"code": {"prompts": 1, "rounds": 10, "round_tokens": 40, "new_tokens": 41}}}
    assert pooled_groups([greedy, other])["code"] == pytest.approx(
        tau([c["coding"], c["code"], other["counts"]["code"]]), abs=1e-4)


def test_raw_records_skip_the_chat_template(parts):
    tok = parts[2]
    raw, chat = RECORDS[2], RECORDS[0]
    assert raw.prompt_ids(tok) == tok.encode(raw.turns[0])
    assert tok.decode(raw.prompt_ids(tok), skip_special_tokens=False) == raw.turns[0]
    ids = chat.prompt_ids(tok)
    assert ids == tok.encode_chat([{"role": "user", "content": chat.turns[0]}])
    text = f"<|im_start|>user\n{chat.turns[0]}<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids, skip_special_tokens=False) == text
    with pytest.raises(ValueError):
        raw.prompt_ids(tok, ["an answer"])


def test_later_turns_carry_the_first_answer(parts, engines, greedy):
    tok, rec = parts[2], RECORDS[1]
    second = tok.decode(rec.prompt_ids(tok, ["ARR"]), skip_special_tokens=False)
    assert second == (f"<|im_start|>user\n{rec.turns[0]}<|im_end|>\n<|im_start|>assistant\nARR<|im_end|>\n"
                      f"<|im_start|>user\n{rec.turns[1]}<|im_end|>\n<|im_start|>assistant\n")
    # The engine is asked the second turn with the first answer it gave as history.
    engine = next(iter(engines.values()))
    calls, generate = [], engine.generate
    engine.generate = lambda ids, params: calls.append((ids, generate(ids, params))) or calls[-1][1]
    try:
        both = run(parts, engines, [rec], turns="all")
    finally:
        del engine.generate
    assert len(calls) == 2 and calls[0][0] == [rec.prompt_ids(tok)]
    answer = tok.decode(calls[0][1][0].token_ids)
    assert answer and calls[1][0] == [rec.prompt_ids(tok, [answer])]
    first = run(parts, engines, [rec])
    assert both["turns"] == "all" and both["rounds"] > first["rounds"] == greedy["counts"]["roleplay"]["rounds"]


def test_sampled_runs_repeat_for_a_seed(parts, engines, greedy):
    a = run(parts, engines, temperature=0.7, seed=5)
    b = run(parts, engines, temperature=0.7, seed=5)
    c = run(parts, engines, temperature=0.7, seed=6)
    drop = lambda r: {k: v for k, v in r.items() if k != "wall_s"}  # noqa: E731
    assert a["temperature"] == 0.7 and drop(a) == drop(b)
    assert (a["counts"], a["histogram"]) != (c["counts"], c["histogram"])  # the seed reaches the sampler
    assert (a["counts"], a["histogram"]) != (greedy["counts"], greedy["histogram"])


def result(counts: dict) -> dict:
    """An accept_lengths-shaped result from {category: (round_tokens, rounds)}."""
    counts = {c: {"prompts": 1, "rounds": r, "round_tokens": t, "new_tokens": t} for c, (t, r) in counts.items()}
    return {"accept_length": tau(counts.values()), "counts": counts,
            "categories": {c: v["round_tokens"] / v["rounds"] for c, v in counts.items()}}


def synthetic_log() -> list[dict]:
    rows = []
    for step, tokens, k in ((200, 100_000, 3), (20, 1_000, 1), (100, 10_000, 2)):  # out of order on purpose
        rows.append({"step": step, "tokens_seen": tokens, "loss": 1.0 / k})  # a training row: ignored
        for temperature in (0.0, 0.7):
            rows.append({"kind": "eval", "step": step, "tokens_seen": tokens, "spec": [5, 4, 8],
                         "temperature": temperature, "sets": {
                             "mtbench": result({"writing": (20 * k, 10), "coding": (30 * k, 10)}),
                             "code": result({"code": (60 * k, 30)})}})
    return rows


def test_curve_reads_the_evaluation_rows():
    series = curve(synthetic_log())
    assert [x for x, _ in series["mtbench"]] == [1_000, 10_000, 100_000]
    assert series["mtbench"] == [(1_000, 2.5), (10_000, 5.0), (100_000, 7.5)]
    assert series["mtbench/coding"][0] == (1_000, 3.0) and series["code/code"][-1] == (100_000, 6.0)
    # The code group pools mtbench/coding (30 tokens / 10 rounds) with code/code (60 / 30): 90 / 40.
    assert series["group/code"][0] == (1_000, pytest.approx(2.25))
    assert series["group/writing"][0] == (1_000, 2.0)
    assert set(series) == {"mtbench", "mtbench/writing", "mtbench/coding", "code", "code/code", "group/code",
                           "group/writing"}
    assert len(curve(synthetic_log(), temperature=0.7)["mtbench"]) == 3
    assert curve([{"step": 1, "loss": 2.0}]) == {}


def test_plot_curve_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_curve(curve(synthetic_log()), tmp_path / "curve.png", spec=[5, 4, 8], temperature=0.0)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_bench_plot_log(tmp_path):
    """bench/accept_length.py --plot-log: one PNG per (tier, temperature) of the log, no engine."""
    pytest.importorskip("matplotlib")
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in synthetic_log()))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "accept_length.py"), "--plot-log", str(log),
                           "--plot-out", str(tmp_path / "curve.png")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["evaluations"] == 6 and len(doc["plots"]) == 2
    for p in doc["plots"]:
        assert Path(p).read_bytes()[:4] == b"\x89PNG"
    assert "group/code" in proc.stdout


def test_read_eval_set_names_counts_and_errors(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text('{"turns": ["a?"], "category": "chat"}\n{"prompt": "b?"}\n{"turns": ["c?", "d?"]}\n')
    name, records = read_eval_set(f"small={path}:2")
    assert name == "small" and [r.turns for r in records] == [("a?",), ("b?",)]
    assert len(read_eval_set(f"all={path}")[1]) == 3
    from jeagle.train.data import DataError

    with pytest.raises(DataError, match="N is 0"):
        read_eval_set(f"none={path}:0")
    with pytest.raises(DataError, match="no records"):
        (tmp_path / "empty.jsonl").write_text("")
        read_eval_set(f"e={tmp_path / 'empty.jsonl'}:2")
    with pytest.raises(DataError, match="expected NAME=FILE"):
        read_eval_set(str(path))
    with pytest.raises(DataError, match="no such file"):
        read_eval_set(f"x={tmp_path / 'missing.jsonl'}:3")


def test_a_small_eval_set_covers_every_category():
    from jeagle.train.evaluate import spread
    from jeagle.train.records import Record

    rows = [Record(turns=(f"{c}{i}?",), category=c) for c in "abc" for i in range(3)]  # a0 a1 a2 b0 ... c2
    assert [r.turns[0] for r in spread(rows, 4)] == ["a0?", "a1?", "b0?", "c0?"]  # in turn, then file order
    assert spread(rows, 20) == rows
    mixed = [Record(turns=("x?",), category="code", source=s) for s in ("instruct", "instruct", "raw")]
    assert spread(mixed, 2) == [mixed[0], mixed[2]]  # sources count as well as categories
