"""The ``ripples schedule`` subcommand: print the static schedule (paper Figure 9).

Without ``--json`` it prints one row per iteration and one column per global rank, each
cell the label of the rank's group in that row (G1, G2, ... numbered by first rank) or
``-`` where the worker skips synchronization. With ``--json`` it prints
``json.dumps(schedule(...))``: one entry per iteration from 0, each a list of groups,
each group a sorted list of global ranks.
"""

from __future__ import annotations

import argparse
import json
import sys

from ripples.static_schedule import schedule


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``schedule`` options to ``parser``.

    Args:
        parser: The (sub)parser of the ``schedule`` command.
    """
    parser.add_argument("--nodes", type=int, required=True, help="number of nodes N, >= 1")
    parser.add_argument(
        "--workers-per-node", type=int, required=True, help="workers per node K, >= 1"
    )
    parser.add_argument(
        "--iterations", type=int, required=True, help="iterations to print from 0, >= 1"
    )
    parser.add_argument(
        "--json", action="store_true", help="print a JSON list of groups per iteration"
    )


def format_table(rows: list[list[list[int]]], num_ranks: int) -> str:
    """Render a schedule as a table like Figure 9 of the paper.

    Args:
        rows: Groups per iteration, as returned by ``schedule``.
        num_ranks: Total number of workers (table columns).

    Returns:
        The table text, one line per iteration after a header, without a final newline.
    """
    header = ["Iteration"] + [f"W{rank}" for rank in range(num_ranks)]
    lines = [header]
    for iteration, groups in enumerate(rows):
        cells = ["-"] * num_ranks
        for index, group in enumerate(groups, start=1):
            for rank in group:
                cells[rank] = f"G{index}"
        lines.append([str(iteration), *cells])
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    return "\n".join(
        "  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def run(args: argparse.Namespace) -> int:
    """Print the schedule described by ``args``.

    Args:
        args: Parsed options from :func:`add_arguments`.

    Returns:
        0 on success, 2 if an option is out of range (the message goes to stderr).
    """
    limits = [
        ("--nodes", args.nodes),
        ("--workers-per-node", args.workers_per_node),
        ("--iterations", args.iterations),
    ]
    for flag, value in limits:
        if value < 1:
            print(f"ripples schedule: error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    rows = schedule(args.nodes, args.workers_per_node, args.iterations)
    if args.json:
        print(json.dumps(rows))
    else:
        print(format_table(rows, args.nodes * args.workers_per_node))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(
        prog="ripples schedule", description="Print the conflict-free static schedule."
    )
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
