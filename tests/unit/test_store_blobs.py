"""Blobs over the coordinator's store limit (8 MiB a value with the libuv TCPStore) go
through in chunks: a 20 MB checkpoint file or published model arrives whole."""

from __future__ import annotations

import os

import torch.distributed as dist

from ripples.store_blobs import delete_blob, get_blob, has_blob, put_blob, wait_blob


def test_a_blob_larger_than_one_store_value_goes_through_whole() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           use_libuv=True)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    data = os.urandom(20 << 20)
    assert not has_blob(server, "k")
    put_blob(client, "k", data)  # a client's set returns before the server has it:
    assert wait_blob(server, "k", 10.0) == data  # the count, written last, says when
    assert has_blob(server, "k") and get_blob(client, "k") == data
    delete_blob(server, "k")
    assert not has_blob(server, "k") and not server.check(["k/0"])
    put_blob(client, "empty", b"")
    assert wait_blob(server, "empty", 10.0) == b""
