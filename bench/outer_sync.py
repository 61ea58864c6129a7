"""What one synchronisation costs, by form: plain P-Reduce against the outer optimizer's
forms, fp32 and bf16, beside a training step of the same model.

Every member builds the same Transformer LM (examples/transformer_lm.py's TinyGPT) once
per form and averages it over the group, side by side in one run, interleaved round by
round so that machine noise hits every form alike:

- ``train step``: one AdamW step (forward, backward, step; bf16 autocast on a GPU) on a
  batch of its own: what a synchronisation every H steps is spread over;
- ``preduce model+adamw``: ``preduce`` of the parameters and AdamW's two moments (3P
  values: Ripples' default for plain averaging, every step);
- ``preduce model``: ``preduce`` of the parameters (P);
- ``outer group fp32``: ``outer_preduce`` in the group form (the provisional anchor and
  momentum, 2P: ripples-smart, ripples-random, ripples-static with the outer optimizer);
- ``outer group bf16``: the same with the momentum in bfloat16 (1.5P's bytes);
- ``outer delta fp32``: the same-anchor form (the pseudo-gradient, P: allreduce's
  DiLoCo once the anchors agree);
- ``outer delta bf16``: the pseudo-gradient in bfloat16 with error feedback (0.5P's).

    python -m ripples.bench.outer_sync                       # gloo on CPU, 3 members
    python -m ripples.bench.outer_sync --device cuda --members 4 --d-model 512 --layers 8 \
        --heads 8 --block-size 256                           # NCCL: the 25.5M GPT

(On a machine where the project is installed with `pip install --target` rather than
in a virtual environment, run it from outside the checkout, or as `python
bench/outer_sync.py`: from the checkout's root, `-m` finds the source folder `ripples/`
first, which holds no `bench`.)

With ``--device cuda`` member i uses cuda:(i mod the GPUs there are); several members on
one GPU get distinct NCCL host ids, so NCCL treats them as separate hosts and talks over
its socket transport on loopback (one GPU cannot hold two ranks of one host otherwise).

Prints per-call medians, each form's median ratio to ``preduce model+adamw`` in the same
round, the bytes each member feeds in, and what one synchronisation every H steps adds
to a step (its median over H, against the training step). Ends non-zero if the members
of any form did not leave it with bit-identical models.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ripples.bench.members import run_members
from ripples.examples.transformer_lm import VOCAB_SIZE, TinyGPT
from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.communicators import (
    Communicator,
    CommunicatorCache,
    CommunicatorFactory,
    connect_store,
)
from ripples.worker.dataplane.outer_state import OuterState, outer_preduce
from ripples.worker.dataplane.preduce import preduce

TIMEOUT_SECONDS = 120.0
STEP = "train step"
BASELINE = "preduce model+adamw"
FORMS = (BASELINE, "preduce model", "outer group fp32", "outer group bf16",
         "outer delta fp32", "outer delta bf16")
METHODS = (STEP, *FORMS)
EVERY = (1, 8, 16)
"""The H values the report spreads a synchronisation over."""


@dataclass(kw_only=True)
class OuterSyncConfig:
    members: int = 3
    device: str = "cpu"
    """cpu (gloo) or cuda (NCCL)."""
    d_model: int = 64
    layers: int = 2
    heads: int = 2
    block_size: int = 64
    batch_size: int = 16
    calls: int = 5
    """Timed calls per method per round."""
    rounds: int = 5
    """Interleaved rounds; the report takes the median over rounds."""


@dataclass
class _Form:
    """One form's own model, its state, and the call that synchronises it."""

    model: torch.nn.Module
    state: AveragedState
    outer: OuterState | None
    sync: Callable[[Communicator], None]


def _build_form(name: str, cfg: OuterSyncConfig, device: torch.device,
                batch: tuple[torch.Tensor, torch.Tensor]) -> _Form:
    torch.manual_seed(0)
    model = TinyGPT(block_size=cfg.block_size, d_model=cfg.d_model, layers=cfg.layers,
                    heads=cfg.heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _train_step(model, optimizer, batch, device)  # AdamW's moments exist
    state = AveragedState(model)
    if name == BASELINE:
        state.adopt_optimizer_state(optimizer)
    outer = None
    if name.startswith("outer"):
        outer = OuterState(state, lr=0.7, momentum=0.5,
                           compression="bf16" if name.endswith("bf16") else "none")
        outer.take_anchor()
    same_anchor = name.startswith("outer delta")

    def sync(comm: Communicator) -> None:
        if outer is None:
            preduce(state, comm, TIMEOUT_SECONDS)
            return
        outer.record_step()  # a round's progress to spend (its values do not change the cost)
        outer_preduce(outer, comm, TIMEOUT_SECONDS, same_anchor=same_anchor)

    return _Form(model=model, state=state, outer=outer, sync=sync)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> None:
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _member(rank: int, port: int, cfg: OuterSyncConfig, out: mp.Queue) -> None:
    if cfg.device == "cuda":
        os.environ["NCCL_HOSTID"] = f"outer-sync-{os.getpid()}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        device = torch.device(f"cuda:{rank % torch.cuda.device_count()}")
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    store = connect_store("127.0.0.1", port, TIMEOUT_SECONDS)
    cache = CommunicatorCache(CommunicatorFactory(store, device, TIMEOUT_SECONDS,
                                                  gloo_hostname="127.0.0.1"))
    comm = cache.get("bench/outer-sync", rank, cfg.members, create=True)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, VOCAB_SIZE, (cfg.batch_size, cfg.block_size + 1), generator=gen)
    batch = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))
    forms = {name: _build_form(name, cfg, device, batch) for name in FORMS}
    torch.manual_seed(0)
    trainee = TinyGPT(block_size=cfg.block_size, d_model=cfg.d_model, layers=cfg.layers,
                      heads=cfg.heads).to(device)  # its own: the forms' models stay agreed
    step_optimizer = torch.optim.AdamW(trainee.parameters(), lr=1e-4)
    barrier = torch.zeros(1, device=device)

    ops: dict[str, Callable[[], None]] = {
        STEP: lambda: _train_step(trainee, step_optimizer, batch, device)}
    for name, form in forms.items():
        ops[name] = functools.partial(form.sync, comm)
    for name, form in forms.items():  # the same-anchor form's anchors agree (as allreduce's
        if name.startswith("outer delta") and form.outer is not None:  # after its first)
            outer_preduce(form.outer, comm, TIMEOUT_SECONDS)
    for op in ops.values():  # warm-up (the first sync of each form builds NCCL's channels)
        op()
    results: dict[str, list[float]] = {m: [] for m in METHODS}
    for round_index in range(cfg.rounds):
        shift = round_index % len(METHODS)
        for name in METHODS[shift:] + METHODS[:shift]:
            comm.allreduce_sum_(barrier, TIMEOUT_SECONDS)  # start together
            _sync_device(device)
            start = time.perf_counter()
            for _ in range(cfg.calls):
                ops[name]()
            _sync_device(device)
            results[name].append((time.perf_counter() - start) / cfg.calls)
    fingerprints = {name: form.state.fingerprint() for name, form in forms.items()}
    sent = {name: (form.state.staged_bytes if form.outer is None else
                   form.outer.sent_bytes(same_anchor=name.startswith("outer delta")))
            for name, form in forms.items()}
    out.put((rank, results, fingerprints, sent,
             sum(p.numel() for p in trainee.parameters()),
             torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"))
    comm.allreduce_sum_(barrier, TIMEOUT_SECONDS)  # leave together
    cache.close()


def run(cfg: OuterSyncConfig) -> dict[str, object]:
    """Member 0's seconds per call by method and round, every member's fingerprints."""
    if cfg.members < 2:
        raise ValueError("members must be at least 2")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    replies = run_members(_member, cfg.members, cfg, replies=cfg.members, timeout_seconds=900)
    replies.sort(key=lambda r: r[0])
    _, results, _, sent, params, device_name = replies[0]
    agree = {name: len({r[2][name] for r in replies}) == 1 for name in FORMS}
    return {"results": results, "agree": agree, "bytes": sent, "params": params,
            "device": device_name}


def report(measured: dict[str, object]) -> list[dict[str, object]]:
    """Rows: per-call median, the median of same-round ratios to the baseline form, the
    bytes, and the median per step of one synchronisation every H steps."""
    results: dict[str, list[float]] = measured["results"]  # type: ignore[assignment]
    sent: dict[str, int] = measured["bytes"]  # type: ignore[assignment]
    agree: dict[str, bool] = measured["agree"]  # type: ignore[assignment]
    step = statistics.median(results[STEP])
    rows: list[dict[str, object]] = [{"method": STEP, "ms": step * 1e3}]
    base = results[BASELINE]
    for name in FORMS:
        times = results[name]
        ms = statistics.median(times) * 1e3
        rows.append({
            "method": name, "ms": ms, "bytes": sent[name],
            "ratio": statistics.median(t / b for t, b in zip(times, base, strict=True)),
            "agree": agree[name],
            **{f"per_step_h{h}": ms / h / (step * 1e3) for h in EVERY}})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = OuterSyncConfig()
    parser.add_argument("--members", type=int, default=defaults.members)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=defaults.device)
    for knob in ("d_model", "layers", "heads", "block_size", "batch_size", "calls",
                 "rounds"):
        parser.add_argument(f"--{knob.replace('_', '-')}", type=int,
                            default=getattr(defaults, knob))
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    cfg = OuterSyncConfig(**{k: v for k, v in vars(args).items() if k != "json"})
    if min(cfg.d_model, cfg.layers, cfg.heads, cfg.block_size, cfg.batch_size, cfg.calls,
           cfg.rounds) < 1 or cfg.d_model % cfg.heads:
        parser.error("every size must be at least 1, and --d-model a multiple of --heads")
    measured = run(cfg)
    rows = report(measured)
    if args.json:
        print(json.dumps({"config": asdict(cfg), "device": measured["device"],
                          "params": measured["params"], "rows": rows}))
    else:
        print(f"one synchronisation by form: {cfg.members} members, "
              f"{'NCCL' if cfg.device == 'cuda' else 'gloo'} on {measured['device']}, "
              f"{measured['params']:,} parameters, median of {cfg.rounds} interleaved "
              f"rounds of {cfg.calls} calls")
        print(f"{'method':22} {'ms/call':>9} {'x baseline':>10} {'MB in':>8} "
              + " ".join(f"{'/step H=' + str(h):>10}" for h in EVERY) + "  members agree")
        for row in rows:
            if row["method"] == STEP:
                print(f"{STEP:22} {row['ms']:9.2f}")
                continue
            print(f"{row['method']:22} {row['ms']:9.2f} {row['ratio']:10.2f} "
                  f"{int(row['bytes']) / 1e6:8.2f} "  # type: ignore[call-overload]
                  + " ".join(f"{row[f'per_step_h{h}']:10.1%}" for h in EVERY)
                  + f"  {'yes' if row['agree'] else 'NO'}")
        print("(/step H: one synchronisation every H steps, as a share of a training step)")
    if not all(measured["agree"].values()):  # type: ignore[attr-defined]
        print("members did not leave a form with bit-identical models", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
