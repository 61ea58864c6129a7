"""The house rules of `make check` (tools/house_rules.py): no hand-written module over 500
lines, and no citation of the project's issues in code or docs, while other projects'
issues, issue URLs, anchors, CSS colours and arXiv ids pass.

The citations below are built from templates ("N" and "M" stand for numbers), so that
this file cites nothing itself."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import house_rules  # noqa: E402  (tools/ is a folder of scripts, not a package)


def cite(template: str) -> str:
    """A citation from its template: N and M become numbers."""
    return template.replace("N", "33").replace("M", "34")


def _write(root: Path, path: str, text: str | bytes) -> str:
    file = root / path
    file.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        file.write_bytes(text)
    else:
        file.write_text(text)
    return path


def _lines(n: int, *, last_newline: bool = True) -> str:
    text = "\n".join(f"x{i} = {i}" for i in range(n))
    return text + "\n" if last_newline else text


# ---------------------------------------------------------------------------- rule 1
def test_a_module_over_the_limit_is_reported_at_its_first_line_past_it(
        tmp_path: Path) -> None:
    paths = [
        _write(tmp_path, "pkg/at_limit.py", _lines(500)),
        _write(tmp_path, "pkg/over.py", _lines(501)),
        _write(tmp_path, "pkg/unterminated.py", _lines(501, last_newline=False)),
        _write(tmp_path, "tests/unit/test_big.py", _lines(612)),  # tests count too
    ]
    found = house_rules.long_modules(tmp_path, paths)
    assert [str(v) for v in found] == [
        "pkg/over.py:501: 501 lines, over the limit of 500: split the module by concept",
        "pkg/unterminated.py:501: 501 lines, over the limit of 500: split the module by "
        "concept",
        "tests/unit/test_big.py:501: 612 lines, over the limit of 500: split the module by "
        "concept",
    ]


def test_generated_stubs_and_other_files_have_no_line_limit(tmp_path: Path) -> None:
    paths = [
        _write(tmp_path, "proto/v1/service_pb2.py", _lines(900)),
        _write(tmp_path, "proto/v1/service_pb2_grpc.py", _lines(900)),
        _write(tmp_path, "proto/v1/service_pb2.pyi", _lines(900)),
        _write(tmp_path, "docs/long.md", _lines(900)),
        "pkg/deleted.py",  # listed by git, gone from the work tree
    ]
    assert house_rules.long_modules(tmp_path, paths) == []


def test_the_line_count_is_wc_l_plus_an_unterminated_last_line() -> None:
    assert house_rules.line_count(b"") == 0
    assert house_rules.line_count(b"a\nb\n") == 2
    assert house_rules.line_count(b"a\nb") == 2
    assert house_rules.line_count(b"a\fb\n") == 1  # a form feed is no line break


# ---------------------------------------------------------------------------- rule 2
@pytest.mark.parametrize("template", [
    "see issue N",
    "Issue #N",
    "ISSUE N",
    "issue  #N, which",
    "issues N and M",
    "Issues #N, #M",
    "## Status (issue N)",
    "what issue N's goals were",
    "a fix (#N)",
    "both (#N, #M)",
    "(#N and #M)",
])
def test_citations_of_the_projects_issues_are_found(template: str) -> None:
    text = cite(template)
    found = house_rules.issue_citations(text)
    assert found and all(line == 1 for line, _ in found), text


@pytest.mark.parametrize("text", [
    "meta-pytorch/torchft#171 fixed it",
    "(meta-pytorch/torchft#171)",
    "pytorch/torchtitan#4209 and pytorch/pytorch#179291",
    "the pytorch/pytorch issue 179291 discusses it",
    "https://github.com/x/y/issues/12",
    "[the report](https://github.com/x/y/issues/12)",
    "color: #333; background: #000000",
    "DiLoCo, arXiv 2311.08105; arXiv:2401.09135",
    "[numbered](#1-intro) and [named](#the-floors)",
    "def test_issue_33_regression(): pass",
    "a known issue\n33 workers later",
    "## Known issues\n\n1. the first",
    "this issue, that issue",
    "issues/33 is a path",
    "tissue 33",
])
def test_other_references_and_numbers_are_no_citations(text: str) -> None:
    assert house_rules.issue_citations(text) == []


def test_a_citation_is_reported_at_its_line() -> None:
    text = "\n".join(["title", "", cite("more (#N)"), cite("and issue M here")])
    assert house_rules.issue_citations(text) == [(3, cite("(#N)")), (4, cite("issue M"))]


def test_css_colours_in_parentheses_are_not_citations_but_a_css_comment_can_be(
        tmp_path: Path) -> None:
    paths = [
        _write(tmp_path, "static/style.css",
               "a { box-shadow: var(--x, (" + cite("#NN") + ")); }\n"
               + cite("/* issue N */\n")),
        _write(tmp_path, "static/page.html", cite("<p>fixed (#N)</p>\n")),
    ]
    found = house_rules.cited_issues(tmp_path, paths)
    assert [(v.path, v.line) for v in found] == [("static/style.css", 2),
                                                ("static/page.html", 1)]


def test_every_text_file_is_searched_and_data_and_binaries_are_not(tmp_path: Path) -> None:
    paths = [
        _write(tmp_path, "docs/guide.md", "# Guide\n\n" + cite("Done (issue N).\n")),
        _write(tmp_path, "deploy/Dockerfile", cite("# issue N\nFROM python\n")),
        _write(tmp_path, "Makefile", cite("check:  # issue N\n")),
        _write(tmp_path, "pyproject.toml", cite("# Issue #N\n")),
        _write(tmp_path, "proto/v1/service.proto", cite("// (#N)\n")),
        _write(tmp_path, "results/run.json", cite('{"note": "issue N"}\n')),
        _write(tmp_path, "docs/img/plot.png", cite("\x89PNG issue N").encode()),
        _write(tmp_path, "pkg/binary.py", b"\0" + cite("issue N").encode()),
        _write(tmp_path, "pkg/latin1.py", cite("# issue N \xe9").encode("latin-1")),
        _write(tmp_path, "pkg/clean.py", '"""No citation here: pytorch/pytorch#1."""\n'),
    ]
    found = house_rules.cited_issues(tmp_path, paths)
    assert sorted(f"{v.path}:{v.line}" for v in found) == [
        "Makefile:1", "deploy/Dockerfile:1", "docs/guide.md:3", "proto/v1/service.proto:1",
        "pyproject.toml:1"]
    assert all("cites an issue" in v.message for v in found)


# ---------------------------------------------------------------------------- the files
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_files_are_gits_tracked_ones(tmp_path: Path) -> None:
    _write(tmp_path, "tracked.py", _lines(501))
    _write(tmp_path, "untracked.py", _lines(501))
    for args in (["init", "-q"], ["add", "tracked.py"]):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, timeout=60)
    assert house_rules.tracked_files(tmp_path) == ["tracked.py"]
    long, cited, checked = house_rules.check(tmp_path)
    assert [v.path for v in long] == ["tracked.py"] and cited == [] and checked == 1


def test_without_git_the_tree_is_walked_past_hidden_and_built_folders(
        tmp_path: Path) -> None:
    for path in ("pkg/module.py", "README.md", ".git/config", ".hidden/x.py",
                 ".venv/lib/site.py", "build/lib/copy.py", "pkg/__pycache__/m.pyc",
                 "ripples.egg-info/PKG-INFO"):
        _write(tmp_path, path, "")
    assert house_rules.tracked_files(tmp_path) == ["README.md", "pkg/module.py"]


def test_main_prints_each_violation_then_a_summary_unless_quiet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, "big.py", _lines(501))
    _write(tmp_path, "notes.md", cite("(#N)\n"))
    monkeypatch.setattr(house_rules, "REPO", tmp_path)
    assert house_rules.main([]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("big.py:501: ") and lines[1].startswith("notes.md:1: ")
    assert lines[2] == "house rules: 1 module(s) over 500 lines, 1 issue citation(s), in 2 files"
    assert house_rules.main(["--quiet"]) == 1
    assert len(capsys.readouterr().out.splitlines()) == 2
    (tmp_path / "big.py").write_text(_lines(3))
    (tmp_path / "notes.md").write_text("nothing cited\n")
    assert house_rules.main(["--quiet"]) == 0
    assert capsys.readouterr().out == ""
