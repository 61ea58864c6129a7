"""Check two house rules that `make check` enforces beside the floors (tools/layers.py).

1. **No module over 500 lines.** A module holds one concept, and most hold 100-300
   lines; one that grows past 500 holds more than one, and is split by concept (whole
   concepts move to well-named sibling modules) before it passes the limit. Every
   git-tracked Python module counts, tests included; generated protobuf stubs
   (`*_pb2.py`, `*_pb2_grpc.py`, `*_pb2.pyi`) do not, since nobody writes them.
2. **No citation of the project's issues in code or docs.** Code and docs speak of the
   project as it is, not of how it was made: an issue number tells a reader nothing the
   sentence should not say itself, and it goes stale. Flagged, case-insensitively, in
   every git-tracked text file: the word issue or issues followed on the same line by a
   number (with or without a '#'), and a '#' and a number alone in parentheses. Left
   alone: another repository's issue (owner/repo#N, or owner/repo and then the word),
   issue URLs (.../issues/N), '#' anchors that go on past the number, CSS colours (the
   parenthesised form is not looked for in .css files) and arXiv ids.

    python tools/house_rules.py           every violation and a summary (exit 1 if any)
    python tools/house_rules.py --quiet   violations only

Files come from `git ls-files`; without git, from a walk of the tree that skips hidden
folders, virtual environments and build outputs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MAX_MODULE_LINES = 500
"""The most lines a hand-written Python module may have."""
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
"""Generated protobuf stubs: exempt from the line limit."""
TEXT_SUFFIXES = frozenset({".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".txt", ".cfg",
                           ".ini", ".js", ".html", ".css", ".proto"})
"""Text files searched for issue citations (JSON data files are not)."""
TEXT_NAMES = frozenset({"Dockerfile", "Makefile"})
"""Text files without a suffix, by name."""
WALK_SKIPS = frozenset({".git", ".venv", "venv", "build", "dist", "node_modules",
                        "__pycache__"})
"""Folders the walk without git leaves out (besides every hidden one)."""

ISSUE_WORD = re.compile(r"\bissues?[ \t]*#?[0-9]+\b", re.IGNORECASE)
"""The word, then a number on the same line: 'issue N', 'Issues N and M', 'issue #N' (N
a number). A URL's '/issues/N' has a slash, not a blank, between them; an identifier
such as `issue_N` has no word boundary before the word."""
ISSUE_HASH = re.compile(r"\(#[0-9]+(?=[),;]|[ \t])")
"""A '#' and a number first in parentheses: '(#N)', '(#N, #M)' (N, M numbers). Another
repository's reference has its name between the parenthesis and the '#'; a Markdown
anchor to a numbered heading goes on past the number ('#N-intro')."""
OTHER_REPOSITORY = re.compile(r"[\w.-]+/[\w.-]+[ \t]*$")
"""owner/repo right before the word: another project's issue, which it may name."""


@dataclass(frozen=True)
class Violation:
    """One broken rule, where it is."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def tracked_files(root: Path = REPO) -> list[str]:
    """The repository's files (relative paths): git's list, else a walk of the tree."""
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"],
                                capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return sorted(_walk(root))
    return sorted(name for name in listed.decode().split("\0") if name)


def _walk(root: Path) -> Iterator[str]:
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in WALK_SKIPS
                   and not d.endswith(".egg-info")]
        for name in files:
            yield (Path(folder) / name).relative_to(root).as_posix()


def is_generated(path: str) -> bool:
    """Whether a file is a generated protobuf stub."""
    return path.endswith(GENERATED_SUFFIXES)


def is_text(path: str) -> bool:
    """Whether a file is searched for issue citations (by its suffix or name)."""
    name = Path(path).name
    return Path(path).suffix in TEXT_SUFFIXES or name in TEXT_NAMES


def line_count(data: bytes) -> int:
    """Lines as `wc -l` counts them, and a last one without its newline."""
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def long_modules(root: Path, paths: Iterable[str],
                 limit: int = MAX_MODULE_LINES) -> list[Violation]:
    """Rule 1: every hand-written Python module over `limit` lines (reported at the first
    line past it)."""
    found = []
    for path in paths:
        if not path.endswith(".py") or is_generated(path):
            continue
        file = root / path
        if not file.is_file():  # listed by git, deleted in the work tree
            continue
        lines = line_count(file.read_bytes())
        if lines > limit:
            found.append(Violation(path, limit + 1, f"{lines} lines, over the limit of "
                                   f"{limit}: split the module by concept"))
    return found


def issue_citations(text: str, *, parenthesised: bool = True) -> list[tuple[int, str]]:
    """Rule 2 on one text: (line, what was found) for each citation of the project's
    issues; `parenthesised`: look for '(#N)' too (not in CSS, where '#333' is a
    colour)."""
    found = []
    for match in ISSUE_WORD.finditer(text):
        start = text.rfind("\n", 0, match.start()) + 1
        if OTHER_REPOSITORY.search(text, start, match.start()):
            continue
        found.append((match.start(), match.group()))
    if parenthesised:
        found += [(m.start(), m.group() + ")") for m in ISSUE_HASH.finditer(text)]
    return [(text.count("\n", 0, offset) + 1, cited) for offset, cited in sorted(found)]


def cited_issues(root: Path, paths: Iterable[str]) -> list[Violation]:
    """Rule 2: every issue citation in the repository's text files (binary files and
    those that are not UTF-8 are skipped)."""
    found = []
    for path in paths:
        file = root / path
        if not is_text(path) or not file.is_file():
            continue
        data = file.read_bytes()
        if b"\0" in data:
            continue
        try:
            text = data.decode()
        except UnicodeDecodeError:
            continue
        for line, cited in issue_citations(text, parenthesised=not path.endswith(".css")):
            found.append(Violation(path, line, f"cites an issue ({cited.strip()!r}): say "
                                   "what it means instead of its number"))
    return found


def check(root: Path = REPO) -> tuple[list[Violation], list[Violation], int]:
    """(modules over the limit, issue citations, files checked)."""
    paths = tracked_files(root)
    return long_modules(root, paths), cited_issues(root, paths), len(paths)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quiet", action="store_true", help="print violations only")
    args = parser.parse_args(argv)
    long, cited, checked = check(REPO)
    for violation in (*long, *cited):
        print(violation)
    if not args.quiet:
        print(f"house rules: {len(long)} module(s) over {MAX_MODULE_LINES} lines, "
              f"{len(cited)} issue citation(s), in {checked} files")
    return 1 if long or cited else 0


if __name__ == "__main__":
    sys.exit(main())
