"""`python -m ripples.bench.scale`: flat and sharded coordinators side by side."""

from __future__ import annotations

from pathlib import Path

import pytest

from ripples.bench import scale


def test_the_scale_bench_prints_flat_and_sharded_rows_and_plots(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert scale.default_runs([1000, 100_000]) == [
        scale.ScaleRun(workers=1000, shards=1, iterations=60, data_blocks=4),
        scale.ScaleRun(workers=1000, shards=4, iterations=60, data_blocks=4),
        scale.ScaleRun(workers=100_000, shards=1, iterations=6, data_blocks=100),
        scale.ScaleRun(workers=100_000, shards=100, iterations=6, data_blocks=100)]
    assert scale.main(["--workers", "96", "--markdown", "--plot", str(tmp_path / "s")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| workers | coordinators | s/epoch")
    flat, sharded = (line.split("|") for line in lines[2:4])
    assert flat[2].strip() == "1 (flat)" and sharded[2].strip() == "4 shards + root"
    # The busiest of 4 shard coordinators serves about a quarter of the flat one's RPCs.
    rpcs = [float(row[7].replace(",", "")) for row in (flat, sharded)]
    assert rpcs[1] < 0.4 * rpcs[0]
    assert (tmp_path / "s-load.png").stat().st_size > 0
    assert (tmp_path / "s-consensus.png").stat().st_size > 0
    # Data that differs by shard: the flat run mixes it, the shards keep it apart.
    assert scale.main(["--workers", "96", "--data-skew", "0.9"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.strip().splitlines()[1:]]
    flat_distance, sharded_distance = (float(row[-4]) for row in rows)
    assert sharded_distance > 5 * flat_distance


def test_a_bad_size_is_refused_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        scale.main(["--workers", "4"])  # 4 shards of 4 workers on 1 host
    assert "each shard needs a host" in capsys.readouterr().err
