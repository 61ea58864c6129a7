"""Every command's --help renders: option help comes from docstrings, which may hold '%'."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

import pytest

from ripples.bench import coordinator_load, harness, preduce
from ripples.cli.main import build_parser


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_ripples_subcommand_renders_its_help() -> None:
    parsers = list(_parsers(build_parser()))
    assert {p.prog for p in parsers} >= {"ripples run", "ripples coordinator serve",
                                         "ripples worker run", "ripples schedule"}
    for parser in parsers:
        text = parser.format_help()
        assert text.startswith("usage: " + parser.prog), text[:200]


def test_run_help_documents_the_optimizer_state_flag() -> None:
    run = next(p for p in _parsers(build_parser()) if p.prog == "ripples run")
    text = " ".join(run.format_help().split())
    assert "--average-optimizer-state, --no-average-optimizer-state" in text
    assert "~15% (--no-average-optimizer-state" in text  # '%' survives argparse formatting


@pytest.mark.parametrize("main", [harness.main, preduce.main, coordinator_load.main])
def test_bench_help_exits_cleanly(main: Callable[[list[str]], int],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")
