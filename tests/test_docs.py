"""The user documentation stays true to the tree: README.md stays short, every relative link in README.md,
ARCHITECTURE.md and docs/*.md resolves (files, and `#anchors` to headings), and every `--flag` shown beside
one of jeagle's commands is an option of that command's parser. CPU only, no models: the parsers are
taken in-process from each command's own `main`, stopped at its first parse."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
LINKED = [REPO / "README.md", REPO / "ARCHITECTURE.md", *DOCS]
WITH_COMMANDS = [REPO / "README.md", *DOCS]

# `python -m NAME` (or the console script) → the module whose `main(argv)` builds and parses its options.
COMMANDS = {
    "jeagle.generate": "jeagle.generate",
    "jeagle.serve": "jeagle.serve",
    "checkpoints_conv": "checkpoints_conv",
    "jeagle.train_draft": "jeagle.train_draft",
    "jeagle.train.sources": "jeagle.train.sources",
}
SCRIPTS = {"jeagle-generate": "jeagle.generate", "jeagle-serve": "jeagle.serve"}

FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)
HTML_ID = re.compile(r"""<a\s+[^>]*(?:id|name)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def without_code(text: str) -> str:
    """The text with fenced blocks and inline code blanked (line numbers kept)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return INLINE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower-cased, punctuation but '-' and '_' dropped,
    spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    found, seen = set(), {}
    for m in HEADING.finditer(FENCE.sub(lambda f: "\n" * f.group(0).count("\n"), text)):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found | set(HTML_ID.findall(text))


def test_the_slugs():
    assert slug("Warm starts and the executable store") == "warm-starts-and-the-executable-store"
    assert slug("`/server_info`") == "server_info"
    assert slug("SGLang's `/generate`") == "sglangs-generate"
    assert slug("Speculation, memory and precision flags") == "speculation-memory-and-precision-flags"
    assert slug("Several GPUs: tensor parallelism") == "several-gpus-tensor-parallelism"


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; keep it at most 150 (details go to docs/)"


def test_relative_links_resolve():
    bad = []
    for path in LINKED:
        if not path.is_file():
            bad.append(f"{rel(path)}: missing")
            continue
        text = without_code(path.read_text())
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:, ...
                continue
            line = text.count("\n", 0, m.start()) + 1
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                bad.append(f"{rel(path)}:{line}: {target} -> no such file")
                continue
            if anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{rel(path)}:{line}: {target} -> no heading #{anchor} in {rel(dest)}")
    assert not bad, "broken links:\n" + "\n".join(bad)


# ---- flags beside commands --------------------------------------------------------------------------

class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def parser_of(module: str) -> argparse.ArgumentParser:
    """The parser `python -m module` builds: its `main([])` run until its first parse."""
    name = module + ".__main__" if importlib.util.find_spec(module).submodule_search_locations else module
    main = importlib.import_module(name).main

    def stop(self, *args, **kwargs):
        raise _Parsed(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", stop)
        mp.setattr(argparse.ArgumentParser, "parse_known_args", stop)
        try:
            main([])
        except _Parsed as e:
            return e.parser
    raise AssertionError(f"{name}.main([]) never parsed its arguments")


def options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of the parser and of its subcommands' parsers."""
    out = set()
    for action in parser._actions:
        out.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= options(sub)
    return out


_OPTIONS: dict[str, set[str]] = {}


def options_of(command: str) -> set[str]:
    if command not in _OPTIONS:
        _OPTIONS[command] = options(parser_of(COMMANDS[command]))
    return _OPTIONS[command]


def command_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command line) of every line of a fenced block (a trailing `\\` joins the next
    line) and every inline code span."""
    out = []
    for m in FENCE.finditer(text):
        first = text.count("\n", 0, m.start(2)) + 1
        lines = m.group(2).split("\n")
        i = 0
        while i < len(lines):
            start, line = first + i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            out.append((start, line))
            i += 1
    prose = FENCE.sub(lambda f: "\n" * f.group(0).count("\n"), text)
    for m in INLINE.finditer(prose):
        out.append((prose.count("\n", 0, m.start()) + 1, m.group(2).replace("\n", " ")))
    return out


def words(line: str) -> list[str]:
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        return list(lexer)
    except ValueError:  # an unbalanced quote (prose in a span): plain words
        return line.split()


def flags_beside_commands(line: str) -> list[tuple[str, str]]:
    """(command, flag) for every `--flag` after `python -m COMMAND` (or its console script), up to the
    end of that shell command (`;`, `&&`, `|`; comments are dropped by the lexer)."""
    found, command, previous = [], None, None
    for w in words(line):
        if w and set(w) <= set(";&|"):
            command = None
        elif w in COMMANDS and previous == "-m":
            command = w
        elif w in SCRIPTS:
            command = SCRIPTS[w]
        elif command and w.startswith("--") and len(w) > 2:
            found.append((command, w.split("=", 1)[0]))
        previous = w
    return found


def test_flag_extraction():
    assert flags_beside_commands("python -m jeagle.generate --target x \"--not-a-flag\"") == [
        ("jeagle.generate", "--target"), ("jeagle.generate", "--not-a-flag")]
    assert flags_beside_commands("pip install x && python -m jeagle.serve --port 1 | grep --color x") == [
        ("jeagle.serve", "--port")]
    assert flags_beside_commands("python -m jeagle.generate --json   # with --bogus in a comment") == [
        ("jeagle.generate", "--json")]
    assert flags_beside_commands("python -m pytest -q --durations=5") == []
    joined = command_lines("```bash\npython -m checkpoints_conv eagle A B \\\n  --target T\n```\n")
    assert flags_beside_commands(joined[0][1]) == [("checkpoints_conv", "--target")]


def test_every_flag_beside_a_command_is_an_option_of_it():
    bad = []
    for path in WITH_COMMANDS:
        for line_no, line in command_lines(path.read_text()):
            for command, flag in flags_beside_commands(line):
                if flag not in options_of(command):
                    bad.append(f"{rel(path)}:{line_no}: python -m {command} has no option {flag}")
    assert not bad, "flags the commands do not take:\n" + "\n".join(bad)


def test_the_sizing_pages_tables_are_what_its_script_prints():
    """docs/sizing.md: every worked `python bench/sizing.py ...` example is followed by the table that
    command prints."""
    import subprocess
    import sys

    text = (REPO / "docs" / "sizing.md").read_text()
    examples = re.findall(r"```bash\n(python bench/sizing\.py [^\n]+)\n```\n\n(\| \| \|\n(?:\|[^\n]*\n)+)", text)
    assert len(examples) == text.count("\n| | |\n") >= 2  # every worked table is checked
    for command, table in examples:
        argv = shlex.split(command)[1:]
        got = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, check=True).stdout
        assert got == table, command
