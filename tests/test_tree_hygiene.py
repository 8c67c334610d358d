"""The tracked tree cites measurements by date, commit and place (a bench/RESULTS.md row, a
bench/HISTORY.md date section), never by the number of the working session or issue they came
from: those numbers mean nothing to a reader of the repository. Every tracked text file is read
(binary files are the only ones left out)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# "session N", "sessions N-M", "Issue N", "issues N, M" (N a number), also broken over a line and a
# comment marker; "work" + " session(s)" in any form. A Python `scope="session"` or an HTTP client session
# has no number after it.
NUMBERED = re.compile(r"\b(?:sessions?|issues?)\s+(?:(?:#|//|\*)\s*)?\d+", re.IGNORECASE)
WORK_SESSION = re.compile(r"\bwork[ -]sessions?\b", re.IGNORECASE)


def tracked_text_files() -> list[tuple[str, str]]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in out.decode().split("\0"):
        path = REPO / name
        if not name or not path.is_file():  # deleted in the work tree, or a submodule
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary
            continue
        try:
            files.append((name, data.decode("utf-8")))
        except UnicodeDecodeError:  # binary too (every text file here is UTF-8)
            continue
    return files


def mentions(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each mention of a numbered session or issue in `text`."""
    found = []
    for rx in (NUMBERED, WORK_SESSION):
        for m in rx.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append((line, text.splitlines()[line - 1].strip()))
    return sorted(set(found))


def test_the_patterns():
    s, i = "sess" + "ion", "iss" + "ue"  # spelt apart: this file is in the tree it checks
    assert mentions(f"bench/HISTORY.md {s} 31") and mentions(f"{s}s 39–41") and mentions(f"{i.title()} 25's 5×")
    assert mentions(f"{i}s 6, 7") and mentions(f"(bench/HISTORY.md {s}\n# 27)")[0][0] == 1
    assert mentions(f"a helper's work {s}") and mentions(f"Work-{s}s")
    assert not mentions('@pytest.fixture(scope="session")\nasync with aiohttp.ClientSession() as session:\n'
                        "requests.Session()  # session 'abc'; 2 issues: a, b; see bench/HISTORY.md, 2026-11-27")
    assert not mentions("obsession 3, tissues 4")


def test_no_work_session_or_issue_numbers_in_the_tree():
    bad = [f"{name}:{line}: {text[:140]}" for name, content in tracked_text_files()
           for line, text in mentions(content)]
    assert not bad, ("cite by date and place (e.g. 'bench/HISTORY.md, 2026-11-27'), not by a session or "
                     "issue number:\n" + "\n".join(bad))
