"""Which device each worker of a host trains on (worker/devices.py): one worker per GPU,
more workers than GPUs only on purpose, and the NCCL environment of a shared GPU. The
GPU counts are given, so that every rule is checked on a machine without one; the CLI
checks run here, where no GPU is visible."""

from __future__ import annotations

import pytest

from ripples.cli import main as cli
from ripples.worker.daemon import WorkerConfig
from ripples.worker.devices import (
    check_device_choice,
    nccl_environment,
    plan_devices,
    shares_a_gpu,
    visible_gpus,
)


def test_auto_takes_one_gpu_per_worker_and_the_cpu_without_gpus() -> None:
    assert plan_devices(4, "auto", gpus=4) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert plan_devices(2, "auto", gpus=8) == ["cuda:0", "cuda:1"]
    assert plan_devices(3, "auto", gpus=0) == ["cpu"] * 3
    assert plan_devices(3, "", gpus=0) == ["cpu"] * 3
    assert plan_devices(2, "cpu", gpus=8) == ["cpu", "cpu"]


def test_more_workers_than_gpus_is_an_error_that_says_how_to_share_them() -> None:
    with pytest.raises(ValueError) as err:
        plan_devices(4, "auto", gpus=1)
    message = str(err.value)
    assert "4 workers and 1 GPU" in message and "--share-gpus" in message
    assert "NCCL_HOSTID" in message and "--device cpu" in message
    with pytest.raises(ValueError, match="3 slots and 2 GPUs"):
        plan_devices(3, "cuda", gpus=2, what="slots")


def test_shared_on_purpose_workers_take_the_gpus_in_turn() -> None:
    devices = plan_devices(5, "cuda", gpus=2, share_gpus=True)
    assert devices == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert shares_a_gpu(devices)
    assert not shares_a_gpu(["cuda:0", "cuda:1", "cpu", "cpu"])


def test_one_named_gpu_holds_one_worker_unless_shared() -> None:
    assert plan_devices(1, "cuda:1", gpus=2) == ["cuda:1"]
    with pytest.raises(ValueError, match="2 workers and 1 GPU"):
        plan_devices(2, "cuda:1", gpus=2)
    assert plan_devices(2, "cuda:1", gpus=2, share_gpus=True) == ["cuda:1", "cuda:1"]
    with pytest.raises(ValueError, match=r"only 2 GPU\(s\) visible \(cuda:0 to cuda:1\)"):
        plan_devices(1, "cuda:2", gpus=2)


def test_cuda_without_a_gpu_and_a_bad_choice_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        plan_devices(1, "cuda", gpus=0)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        plan_devices(1, "cuda:0", gpus=0)
    for bad in ("gpu", "cuda:", "cuda:x", "mps", "cuda:0,1"):
        with pytest.raises(ValueError, match="must be auto, cpu, cuda or cuda:K"):
            check_device_choice(bad)
    assert check_device_choice(" CUDA:3 ") == "cuda:3"
    with pytest.raises(ValueError, match="at least one"):
        plan_devices(0, "cpu")


def test_only_a_shared_gpu_gets_an_nccl_host_id_of_its_own() -> None:
    shared = ["cuda:0", "cuda:0", "cuda:1"]
    first = nccl_environment(shared, 0, "run7", loopback=True, environ={})
    second = nccl_environment(shared, 1, "run7", loopback=True, environ={})
    assert first == {"NCCL_HOSTID": "run7-0", "NCCL_SOCKET_IFNAME": "lo"}
    assert second["NCCL_HOSTID"] == "run7-1"
    assert nccl_environment(shared, 2, "run7", loopback=True, environ={}) == {}  # its own
    assert nccl_environment(["cpu", "cpu"], 0, "run7", loopback=True, environ={}) == {}
    # The user's interface wins; one NCCL_HOSTID for every worker would break the
    # sharing, so the worker's own replaces it. Across hosts, no loopback.
    user = {"NCCL_SOCKET_IFNAME": "eth1", "NCCL_HOSTID": "same-for-all"}
    assert nccl_environment(shared, 0, "run7", loopback=True, environ=user) == {
        "NCCL_HOSTID": "run7-0"}
    assert nccl_environment(shared, 1, "hostA", loopback=False, environ={}) == {
        "NCCL_HOSTID": "hostA-1"}


def test_a_hosts_launch_takes_the_gpus_from_its_first_local_rank_on() -> None:
    # Two launches on one 4-GPU host (--local-rank 0 and 2, two workers each) must not
    # meet on one GPU: the second takes cuda:2 and cuda:3. Without GPUs: the CPU.
    config = WorkerConfig(coordinator="127.0.0.1:1", nproc_per_node=2, local_rank=2)
    assert config.host_devices() == ["cpu", "cpu"]  # no GPU here
    assert plan_devices(4, "auto", gpus=4)[2:] == ["cuda:2", "cuda:3"]
    with pytest.raises(ValueError, match="must be auto, cpu, cuda or cuda:K"):
        WorkerConfig(coordinator="127.0.0.1:1", device="gpu0")


@pytest.mark.skipif(visible_gpus() > 0, reason="checks the refusal on a machine without GPUs")
def test_ripples_run_refuses_cuda_without_a_gpu_before_starting_anything(
        capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    code = cli.main(["run", "--workers", "2", "--device", "cuda", "--output", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "ripples run: error: --device cuda: no CUDA device is visible" in err
    assert not (tmp_path / "state").exists()  # nothing started
    code = cli.main(["run", "--workers", "2", "--device", "tpu", "--output", str(tmp_path)])
    assert code == 2
    assert "--device must be auto, cpu, cuda or cuda:K, got 'tpu'" in capsys.readouterr().err
