"""Conversation records: what the target is asked, in training (the mix `jeagle/train/sources.py`
builds) and in evaluation (`jeagle/train/evalsets.py`). A .jsonl of {"turns": [user turn, ...],
"source": str, "category": str, "raw": bool} (MT-bench's own shape; a line with only "prompt" reads as
one turn). A record of several turns is a multi-turn conversation: the target answers each turn in
turn, its own answers becoming the history. A raw record's single turn is text the target continues
without the chat template (code completion).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from jeagle.train.data import MAX_TURNS, DataError, jsonl_rows, read_prompts


@dataclass(frozen=True)
class Record:
    """One conversation to regenerate or evaluate: the user turns (the assistant's are the target's own),
    where it came from, its evaluation category, and whether its one turn is raw text to continue."""
    turns: tuple[str, ...]
    source: str = ""
    category: str = ""
    raw: bool = False

    def prompt_ids(self, tokenizer, answers: Iterable[str] = ()) -> list[int]:
        """The target's input for the next turn: a raw record's text as is (no template), else the chat
        template over the user turns so far interleaved with the assistant's `answers` to them, ending
        with the generation prompt (turn len(answers) is asked)."""
        answers = list(answers)
        if len(answers) >= len(self.turns):
            raise ValueError(f"{len(answers)} answers to a record of {len(self.turns)} turns: no turn left to ask"
                             + (" (a raw record has one turn)" if self.raw else ""))
        if self.raw:
            return tokenizer.encode(self.turns[0])
        messages = []
        for user, answer in zip(self.turns, answers):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": self.turns[len(answers)]})
        return tokenizer.encode_chat(messages)

    def to_json(self) -> dict:
        return {"turns": list(self.turns), "source": self.source, "category": self.category, "raw": self.raw}

    @classmethod
    def from_json(cls, row, where: str = "") -> "Record":
        """A record from a parsed .jsonl line: {"turns": [...]} (MT-bench's own shape), or a legacy
        {"prompt"|"question"|"instruction": text}. Anything else raises DataError naming `where`."""
        if not isinstance(row, dict):
            raise DataError(f"{where}: a record is a JSON object, got {type(row).__name__}")
        turns = row.get("turns")
        if turns is None:
            text = next((row[k] for k in ("prompt", "question", "instruction") if k in row), None)
            if text is None:
                raise DataError(f"{where}: a record needs \"turns\" (or \"prompt\")")
            turns = [text]
        if (not isinstance(turns, list) or not 1 <= len(turns) <= MAX_TURNS
                or not all(isinstance(t, str) and t.strip() for t in turns)):
            raise DataError(f"{where}: \"turns\" must be a list of 1..{MAX_TURNS} non-empty strings")
        source, category, raw = row.get("source", ""), row.get("category", ""), row.get("raw", False)
        if not isinstance(source, str) or not isinstance(category, str) or not isinstance(raw, bool):
            raise DataError(f"{where}: \"source\" and \"category\" must be strings, \"raw\" a boolean")
        if raw and len(turns) != 1:
            raise DataError(f"{where}: a raw record has exactly one turn (text to continue), got {len(turns)}")
        return cls(tuple(turns), source, category, raw)


def read_records(path, *, limit: int | None = None) -> list[Record]:
    """The records of a .jsonl file (see the module docstring), at most `limit`; a malformed line raises
    DataError with its file and line number."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"{path}: no such file")
    out: list[Record] = []
    with open(path, encoding="utf-8") as f:
        for where, row in jsonl_rows(f, path):
            if limit is not None and len(out) >= limit:
                break
            out.append(Record.from_json(row, where))
    if not out:
        raise DataError(f"{path}: no records")
    return out


def write_records(path, records: Iterable[Record], *, prompt_field: bool = False) -> Path:
    """A .jsonl of records; with `prompt_field` each line also has "prompt" (the first turn), for readers
    of the older one-prompt files."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            row = r.to_json() | ({"prompt": r.turns[0]} if prompt_field else {})
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def read_exclude(paths: Iterable[str]) -> list[str]:
    """Every turn of every record in `paths`, texts never to train on: .jsonl records (or {"prompt"}
    lines), a .txt of one prompt a line, or anything `read_prompts` reads (ShareGPT)."""
    texts: list[str] = []
    for p in paths:
        if str(p).endswith(".jsonl"):
            texts += [t for r in read_records(p) for t in r.turns]
        elif str(p).endswith(".txt"):
            if not Path(p).expanduser().exists():
                raise DataError(f"{p}: no such file")
            texts += [line for line in Path(p).expanduser().read_text(encoding="utf-8").splitlines() if line.strip()]
        else:
            texts += read_prompts(str(p), max_chars=10**9, min_chars=1)
    return texts
