"""Which device each worker of one host trains on: one worker per GPU, or GPUs shared on
purpose (docs/gpu.md).

Every launcher of a host's workers asks here: `ripples run` (all of a local run's
workers), `ripples worker run --nproc-per-node K` and the host agent (K slots). The rule
is the same for all three: with GPUs, worker i trains on cuda:i, and more workers than
GPUs is an error that says what to do, unless the user shares the GPUs on purpose
(`--share-gpus`). Ranks on one GPU then cannot use NCCL's in-host transports (NCCL
refuses two ranks of one communicator on one device of one host): each worker gets an
NCCL_HOSTID of its own, so that NCCL takes them for separate hosts and talks over its
socket transport (`nccl_environment`).

Imports torch only to count the GPUs, and only when the choice needs the count.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

DEVICE_CHOICES = ("auto", "cpu", "cuda")
"""What --device takes, besides an explicit cuda:K."""

_CUDA_INDEX = re.compile(r"cuda:(\d+)")


def visible_gpus() -> int:
    """The CUDA devices this process can use (0 without CUDA or without torch's CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:  # a broken driver: no usable GPU
        return 0


def check_device_choice(device: str, option: str = "--device") -> str:
    """`device` normalised ("" is auto), or ValueError saying what the option takes."""
    choice = device.strip().lower() or "auto"
    if choice in DEVICE_CHOICES or _CUDA_INDEX.fullmatch(choice):
        return choice
    raise ValueError(f"{option} must be auto, cpu, cuda or cuda:K, got {device[:40]!r}")


def plan_devices(count: int, device: str = "auto", *, share_gpus: bool = False,
                 gpus: int | None = None, option: str = "--device",
                 what: str = "workers") -> list[str]:
    """The device of each of a host's `count` workers (index = local rank).

    `device`: auto (the GPUs when there are any, else cpu), cpu, cuda (every GPU, one
    worker each) or cuda:K (that GPU). `gpus`: how many are visible (counted when None).
    More workers than the GPUs they may use is a ValueError that says how to share them
    on purpose, unless `share_gpus`: then worker i takes GPU i mod G."""
    if count < 1:
        raise ValueError(f"need at least one of the {what}")
    choice = check_device_choice(device, option)
    if choice == "cpu":
        return ["cpu"] * count
    available = visible_gpus() if gpus is None else gpus
    if choice == "auto" and available == 0:
        return ["cpu"] * count
    if available == 0:
        raise ValueError(f"{option} {choice}: no CUDA device is visible here (torch without "
                         "CUDA, no GPU, or CUDA_VISIBLE_DEVICES empty); use "
                         f"{option} cpu, or auto to take GPUs only where there are some")
    indexed = _CUDA_INDEX.fullmatch(choice)
    if indexed:
        index = int(indexed.group(1))
        if index >= available:
            raise ValueError(f"{option} {choice}: only {available} GPU(s) visible "
                             f"(cuda:0 to cuda:{available - 1})")
        usable = [index]
    else:
        usable = list(range(available))
    if count > len(usable) and not share_gpus:
        where = f"{len(usable)} GPU" + ("s" if len(usable) > 1 else "")
        raise ValueError(
            f"{count} {what} and {where} to put them on: one worker per GPU is the rule. "
            f"Run {len(usable)} {what}, or share the GPUs on purpose with --share-gpus "
            f"(worker i on GPU i mod {len(usable)}; several ranks on one GPU cannot use "
            "NCCL's in-host transports, so each gets its own NCCL_HOSTID and they talk over "
            f"NCCL's sockets: slower than one worker per GPU), or {option} cpu")
    return [f"cuda:{usable[i % len(usable)]}" for i in range(count)]


def shares_a_gpu(devices: list[str]) -> bool:
    """Whether two of these workers train on one GPU."""
    cuda = [d for d in devices if d.startswith("cuda")]
    return len(set(cuda)) < len(cuda)


def nccl_environment(devices: list[str], index: int, tag: str, *, loopback: bool,
                     environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment worker `index` needs for NCCL when it shares its GPU with another
    worker of `devices` (empty when its GPU is its own): an NCCL_HOSTID of its own (`tag`
    names the launch, so that two hosts' ids never meet; set even over the user's, which
    one value for every worker would break), and with `loopback` (every rank on this
    machine: `ripples run`) NCCL_SOCKET_IFNAME=lo unless the user chose an interface in
    `environ`."""
    device = devices[index]
    if not device.startswith("cuda") or devices.count(device) < 2:
        return {}
    environ = os.environ if environ is None else environ
    extra = {"NCCL_HOSTID": f"{tag}-{index}"}
    if loopback and "NCCL_SOCKET_IFNAME" not in environ:
        extra["NCCL_SOCKET_IFNAME"] = "lo"
    return extra
