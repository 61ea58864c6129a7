"""A small decoder-only Transformer language model, trained from scratch with Ripples.

    python examples/transformer_lm.py --steps 200                     # alone
    ripples run --workers 4 --protocol ripples-smart --target-loss 2.0 \\
        -- python examples/transformer_lm.py --steps 2000             # a local cluster
    ripples run --workers 4 --ranks-per-worker 2 --protocol ripples-smart \\
        -- python examples/transformer_lm.py --steps 2000             # sharded workers

The text is the Python standard library's own source code, present on every machine
(`sysconfig`'s stdlib folder), read as bytes (a vocabulary of 256) and streamed by an
IterableDataset that gives each worker, and each DataLoader process of a worker, files of
its own. What a modern training script does: AdamW with weight decay, a linear warm-up
then cosine learning rate that follows the run's global progress (`opt.global_step`, so a
slow or late worker follows the run's schedule), gradient clipping, mixed precision
(bf16 autocast on CPU; fp16 with a GradScaler on a GPU), and `torch.nn.functional.
scaled_dot_product_attention` with a causal mask. On a worker of several ranks
(`--ranks-per-worker G`) the blocks and the model are sharded with FSDP2 over the
worker's ranks, each of which reads files of its own, in bf16 autocast.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn import functional
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import ripples

VOCAB_SIZE = 256  # bytes


def stdlib_files() -> list[Path]:
    """Every .py file of the standard library, in a fixed order (tests excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if "test" not in p.parts and "site-packages" not in p.parts)


class ByteStream(IterableDataset):  # type: ignore[type-arg]
    """(input, target) blocks of `block_size` bytes from this worker's share of the files:
    file i goes to the stream whose index is i mod the number of streams, where the
    streams are (Ripples worker) x (DataLoader process). Blocks are shuffled within a
    buffer; each pass over the files reshuffles their order."""

    def __init__(self, files: list[Path], block_size: int, *, rank: int, num_workers: int,
                 seed: int, shuffle_buffer: int = 256) -> None:
        self.files, self.block_size = files, block_size
        self.rank, self.num_workers = rank, num_workers
        self.seed, self.shuffle_buffer = seed, shuffle_buffer

    def _my_files(self) -> tuple[list[Path], int]:
        info = get_worker_info()
        loaders, loader = (info.num_workers, info.id) if info is not None else (1, 0)
        streams, stream = self.num_workers * loaders, self.rank * loaders + loader
        mine = self.files[stream::streams]
        if not mine:
            raise ValueError(f"no files for stream {stream} of {streams}: use fewer workers")
        return mine, stream

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        files, stream = self._my_files()
        rng = random.Random(self.seed * 1009 + stream)
        buffer: list[torch.Tensor] = []
        n = self.block_size + 1
        while True:  # passes over this stream's files, until the training loop stops
            rng.shuffle(files)
            for path in files:
                raw = path.read_bytes()
                if len(raw) < n:  # an empty __init__.py: no block (frombuffer refuses 0 bytes)
                    continue
                data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                for start in range(0, len(data) - n + 1, n):
                    buffer.append(data[start : start + n].long())
                    if len(buffer) >= self.shuffle_buffer:
                        block = buffer.pop(rng.randrange(len(buffer)))
                        yield block[:-1], block[1:]


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attention = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, `layers` pre-norm blocks, a tied output head."""

    def __init__(self, *, block_size: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB_SIZE, d_model)
        self.positions = nn.Embedding(block_size, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE, bias=False)
        self.head.weight = self.tokens.weight  # tied
        for module in self.modules():  # GPT-2's initialisation: small logits at the start
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        logits: torch.Tensor = self.head(self.ln(self.blocks(x)))
        return logits


def warmup_cosine(step: int, *, warmup: int, total: int) -> float:
    """The learning-rate factor: linear warm-up, then cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def build_parser() -> argparse.ArgumentParser:
    """The script's options (the benchmark's peers build the same model from them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000,
                        help="optimizer steps of the schedule (per worker)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    parser.add_argument("--amp", choices=("auto", "off"), default="auto",
                        help="auto: bf16 autocast on CPU, fp16 + GradScaler on a GPU")
    parser.add_argument("--loader-workers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--evaluate", metavar="MODEL_PT", default="",
                        help="train nothing: print the mean loss of a saved model (a run's "
                             "model.pt) on batches of the byte stream, then exit")
    return parser


def build_model(args: argparse.Namespace) -> TinyGPT:
    """The model every worker starts from (seeded by --seed)."""
    torch.manual_seed(args.seed)
    return TinyGPT(block_size=args.block_size, d_model=args.d_model, layers=args.layers,
                   heads=args.heads)


def build_adamw(model: nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW, weight decay on the matrices only."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95))


def evaluate(model: nn.Module, args: argparse.Namespace, batches: int = 64) -> float:
    """The model's mean loss on `batches` batches of the byte stream (one stream, a seed
    of its own), in full precision on the CPU."""
    data = ByteStream(stdlib_files(), args.block_size, rank=0, num_workers=1,
                      seed=args.seed + 12345)
    loader = DataLoader(data, batch_size=args.batch_size)
    model.eval()
    losses = []
    with torch.no_grad():
        for (x, y), _ in zip(loader, range(batches), strict=False):
            losses.append(float(functional.cross_entropy(model(x).flatten(0, 1), y.flatten())))
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.evaluate:
        model = build_model(args)
        model.load_state_dict(torch.load(args.evaluate, map_location="cpu"))
        print(f"{args.evaluate}: loss {evaluate(model, args):.4f}")
        return

    worker = ripples.init()
    device = worker.device
    model = build_model(args).to(device)  # every worker starts from the same model
    sharded = worker.ranks_per_worker > 1
    if sharded:  # FSDP2 over the worker's ranks: each block, then the rest
        for block in model.blocks:
            fully_shard(block, mesh=worker.mesh)
        fully_shard(model, mesh=worker.mesh)
    opt = ripples.Optimizer(build_adamw(model, args), model, planned_steps=args.steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: warmup_cosine(
        opt.global_step, warmup=args.warmup, total=args.steps))

    cuda = device.type == "cuda"
    amp = args.amp == "auto"
    half = torch.float16 if cuda and not sharded else torch.bfloat16
    autocast = torch.autocast(device.type, dtype=half) if amp else contextlib.nullcontext()
    scaler = torch.amp.GradScaler("cuda", enabled=amp and half == torch.float16)
    # Where the launch asks (`ripples run --checkpoint-dir DIR`): go on from the newest
    # checkpoint, save every --checkpoint-every steps. The stream restarts reshuffled.
    checkpoints = ripples.Checkpointer(opt, scheduler=schedule, scaler=scaler)
    start = checkpoints.restore()
    ranks = worker.ranks_per_worker  # each rank of a sharded worker reads its own files
    data = ByteStream(stdlib_files(), args.block_size,
                      rank=worker.rank * ranks + worker.rank_in_worker,
                      num_workers=worker.num_workers * ranks, seed=args.seed + start)
    loader = DataLoader(data, batch_size=args.batch_size, num_workers=args.loader_workers,
                        pin_memory=cuda)

    model.train()
    for step, (x, y) in enumerate(loader, start=start + 1):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(opt)
        scaler.update()
        schedule.step()
        checkpoints.step()
        opt.report_loss(loss.detach(), num_samples=len(x))  # no host sync on a GPU
        if worker.rank == 0 and worker.rank_in_worker == 0 and step % args.log_every == 0:
            print(f"step {step} (global {opt.global_step}): loss {loss.item():.3f} "
                  f"lr {schedule.get_last_lr()[0]:.2e}", flush=True)
        if opt.stopped or step >= args.steps:
            break


if __name__ == "__main__":
    main()
