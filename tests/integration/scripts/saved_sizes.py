"""A user's script for the checkpoint-size test (the public API only): an MLP on digits
with AdamW, whose rank writes, part-way through the run, what `torch.save` makes of its
wrapped model's and optimizer's `state_dict()` next to the same state held by a plain
model and optimizer (what DDP would save), loads the saved state back into the run, and
trains on."""

from __future__ import annotations

import argparse
import io
import json

import torch
from torch import nn

import ripples
from ripples.worker.tasks.digits import load_digits_arrays


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def saved_bytes(value: object) -> int:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return len(buffer.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-at", type=int, default=15)
    parser.add_argument("--record", required=True, help="a JSON file per rank: {rank} in it")
    args = parser.parse_args()

    worker = ripples.init()
    pixels, labels = load_digits_arrays()
    x_all = torch.tensor(pixels / 16.0, dtype=torch.float32)[worker.rank::worker.num_workers]
    y_all = torch.tensor(labels)[worker.rank::worker.num_workers]
    torch.manual_seed(0)
    model = build()
    opt = ripples.Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model,
                            planned_steps=args.steps)
    record: dict[str, object] = {"rank": worker.rank}
    while not opt.stopped:
        start = (opt.local_step * 32) % (len(x_all) - 32)
        x, y = x_all[start:start + 32], y_all[start:start + 32]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.report_loss(loss, num_samples=len(x))
        if opt.local_step == args.save_at:
            record.update(_measure(model, opt))
    with open(args.record.format(rank=worker.rank), "w") as f:
        json.dump(record, f)


def _measure(model: nn.Module, opt: ripples.Optimizer) -> dict[str, object]:
    """Sizes of the saves, then the combined save loaded back into the run."""
    # Ripples averages the optimizer state with the model: its tensors and the model's
    # are views into one buffer, larger than each of them.
    in_buffer = all(s["exp_avg"].untyped_storage().nbytes() > s["exp_avg"].nbytes
                    for s in opt.state.values())
    sizes = {
        "together": saved_bytes({"model": model.state_dict(), "optimizer": opt.state_dict()}),
        "model": saved_bytes(model.state_dict()),
        "optimizer": saved_bytes(opt.state_dict()),
        # What the docs said to write before state_dict() copied: the model cloned.
        "model_cloned_and_optimizer": saved_bytes(
            {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "optimizer": opt.state_dict()}),
    }
    # The same state in a plain model and optimizer, copied tensor by tensor (loaded as
    # they are, the optimizer's state would be the very tensors given, and so would share
    # whatever storage those have).
    plain = build()
    plain.load_state_dict(model.state_dict())
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    state = opt.state_dict()  # a plain optimizer ignores its "ripples" entry
    state["state"] = {k: {n: v.clone() for n, v in s.items()} for k, s in state["state"].items()}
    plain_opt.load_state_dict(state)
    plain_sizes = {
        "together": saved_bytes({"model": plain.state_dict(), "optimizer": plain_opt.state_dict()}),
        "model": saved_bytes(plain.state_dict()),
        "optimizer": saved_bytes(plain_opt.state_dict()),
    }
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    loaded = torch.load(io.BytesIO(buffer.getvalue()))
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    restored = (all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
                and all(torch.equal(s["exp_avg"], m)
                        for s, m in zip(opt.state.values(), moments, strict=True)))
    return {"ripples": sizes, "plain": plain_sizes, "restored": restored,
            "state_in_one_buffer": in_buffer, "step": opt.local_step}


if __name__ == "__main__":
    main()
