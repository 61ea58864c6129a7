"""Large values through the rendezvous store (a torch.distributed TCPStore): checkpoint
files a restart round hands to a rank that lacks them, models published for a consensus.

The coordinator's store (libuv backend) refuses a value over 8 MiB and resets the
connection, after which every call on that client fails ("Broken pipe"): measured with
torch 2.13, 9 MB refused, 7 MB stored. So a blob goes in chunks of CHUNK_BYTES under
KEY/0, KEY/1, ..., and KEY/n, the chunk count, is written last: a reader that sees the
count sees every chunk.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

CHUNK_BYTES = 4 << 20
"""Half the store's limit on one value."""


def put_blob(store: dist.Store, key: str, data: bytes) -> None:
    chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    for i, chunk in enumerate(chunks):
        store.set(f"{key}/{i}", chunk)  # type: ignore[arg-type]  # bytes are stored as they are
    store.set(f"{key}/n", str(len(chunks)))


def has_blob(store: dist.Store, key: str) -> bool:
    """Whether the whole blob is there (its count is written last)."""
    return bool(store.check([f"{key}/n"]))


def wait_blob(store: dist.Store, key: str, timeout_seconds: float) -> bytes:
    """The blob once it is whole; TimeoutError after `timeout_seconds`."""
    try:
        store.wait([f"{key}/n"], timedelta(seconds=timeout_seconds))
    except dist.DistStoreError:
        raise TimeoutError(f"{key} did not arrive within {timeout_seconds:.0f} s") from None
    return get_blob(store, key)


def _count(store: dist.Store, key: str) -> int:
    return int(store.get(f"{key}/n").decode())


def get_blob(store: dist.Store, key: str) -> bytes:
    return b"".join(store.get(f"{key}/{i}") for i in range(_count(store, key)))


def delete_blob(store: dist.Store, key: str) -> None:
    """Remove the blob (nothing if it is not there)."""
    if not has_blob(store, key):
        return
    count = _count(store, key)
    store.delete_key(f"{key}/n")
    for i in range(count):
        store.delete_key(f"{key}/{i}")
