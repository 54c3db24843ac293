"""The TCP links between ranks (accessory/parallel/links.py): messages arrive whole and in order, a send never waits
for the reader, a receive that polls or sleeps takes what comes, a message of another kind or size says the ranks
are out of step, a peer that left is named, and a connection without this job's token is dropped."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from accessory.errors import CollectivesOutOfStep
from accessory.parallel.links import BROADCAST, HELLO, HIDDEN, POLL_S, SUM, Link, LinkClosed, _accept
from distributed import run_ranks


@pytest.fixture(params=[0.0, 0.05], ids=["sleeping", "polling"])
def pair(request):
    """Two linked ends; a receive sleeps at once, or polls first (a rank with a core of its own)."""
    a, b = socket.socketpair()
    first, second = Link(a, 1, request.param), Link(b, 0, request.param)
    yield first, second
    first.close(), second.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float16])
def test_a_message_arrives_whole_with_its_values(pair, dtype):
    x = (torch.randn(3, 5) * 100).to(dtype)
    pair[0].send(x, SUM)
    assert torch.equal(pair[1].receive((3, 5), dtype, SUM), x)


def test_messages_arrive_in_the_order_sent(pair):
    for i in range(50):
        pair[0].send(torch.full((i + 1,), float(i)), HIDDEN)
    for i in range(50):
        assert torch.equal(pair[1].receive((i + 1,), torch.float32, HIDDEN), torch.full((i + 1,), float(i)))


def test_a_send_larger_than_the_socket_buffers_returns_before_the_peer_reads(pair):
    """A prefill's hidden states may exceed what the kernel buffers: the rest is sent by a thread, so the sender goes
    on (with micro-batches in flight the next stage reads a step later), and the values sent are kept as they were
    even if the sender's tensor then changes."""
    x = torch.arange(8 << 20, dtype=torch.float32)  # 32 MiB
    start = time.monotonic()
    pair[0].send(x, HIDDEN)
    pair[0].send(torch.ones(4), SUM)  # queued behind it, in order
    assert time.monotonic() - start < 5
    expected = x.clone()
    x.zero_()
    assert torch.equal(pair[1].receive(x.shape, x.dtype, HIDDEN), expected)
    assert torch.equal(pair[1].receive((4,), torch.float32, SUM), torch.ones(4))
    pair[0].flush()


def test_a_message_of_another_kind_or_size_says_the_ranks_are_out_of_step(pair):
    pair[0].send(torch.zeros(2), BROADCAST)
    with pytest.raises(CollectivesOutOfStep, match="rank 0 sent a broadcast of 8 bytes where this rank waited for a "
                                                   "sum of 8 bytes: the ranks are not in the same collective"):
        pair[1].receive((2,), torch.float32, SUM)
    pair[0].send(torch.zeros(3), SUM)
    with pytest.raises(CollectivesOutOfStep, match="sent a sum of 12 bytes where this rank waited for a sum of 8"):
        pair[1].receive((2,), torch.float32, SUM)


def test_a_receive_takes_a_message_sent_while_it_waits(pair):
    threading.Timer(0.1, pair[0].send, (torch.ones(3), SUM)).start()
    assert torch.equal(pair[1].receive((3,), torch.float32, SUM, timeout_s=10), torch.ones(3))


def test_a_receive_with_a_timeout_raises_when_nothing_comes(pair):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 0 sent nothing for 0.3 s"):
        pair[1].receive((2,), torch.float32, SUM, timeout_s=0.3)
    assert time.monotonic() - start < 3


def test_a_peer_that_left_is_named(pair):
    threading.Timer(0.2, pair[0].close).start()
    with pytest.raises(LinkClosed, match="connection to rank 0 closed by peer"):
        pair[1].receive((2,), torch.float32, SUM)
    with pytest.raises(LinkClosed):
        pair[1].send(torch.zeros(1 << 22), HIDDEN)  # a large send: the thread finds the connection gone
        pair[1].flush()


def test_a_connection_without_the_jobs_token_is_dropped():
    """The listener takes only connections that prove they are of this job (the token shared over gloo) and come
    from a rank it expects; a stranger's, or a wrong rank's, is closed."""
    listener = socket.create_server(("127.0.0.1", 0))
    token, port = b"t" * 16, listener.getsockname()[1]
    stranger = socket.create_connection(("127.0.0.1", port))
    stranger.sendall(HELLO.pack(b"x" * 16, 1))
    wrong_rank = socket.create_connection(("127.0.0.1", port))
    wrong_rank.sendall(HELLO.pack(token, 5))
    rank = socket.create_connection(("127.0.0.1", port))
    rank.sendall(HELLO.pack(token, 1))
    accepted = _accept(listener, token, {1}, timeout_s=5)
    assert list(accepted) == [1]
    assert stranger.recv(1) == b"" and wrong_rank.recv(1) == b""  # closed
    for sock in (*accepted.values(), stranger, wrong_rank, rank, listener):
        sock.close()


def _linked_ranks(token_size: int) -> list:
    import torch.distributed as dist

    from accessory.parallel.links import close_links, connect

    rank, world = dist.get_rank(), dist.get_world_size()
    links = connect(dist.group.WORLD, list(range(1, world)) if rank == 0 else [0], timeout_s=30)
    if rank == 0:
        got = [links[r].receive((token_size,), torch.float32, SUM).tolist() for r in range(1, world)]
        for r in range(1, world):
            links[r].send(torch.full((2,), float(r * 10)), BROADCAST)
    else:
        links[0].send(torch.full((token_size,), float(rank)), SUM)
        got = links[0].receive((2,), torch.float32, BROADCAST).tolist()
    peers = {r: (link.peer, link.poll_s) for r, link in links.items()}
    close_links()
    dist.barrier()
    return got, peers


@pytest.mark.parametrize("on_this_machine", [3, 1])
def test_ranks_link_through_the_rendezvous_and_exchange_messages(monkeypatch, on_this_machine):
    """Three gloo ranks: the source links to each other rank, each other rank to the source (the star the engine's
    messages take across machines), each link naming its peer's global rank. A receive polls only where the
    machine's ranks (LOCAL_WORLD_SIZE) have a core each."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(on_this_machine))
    poll = POLL_S if on_this_machine <= len(os.sched_getaffinity(0)) else 0.0
    results = run_ranks(3, _linked_ranks, 4)
    assert results[0] == ([[1.0] * 4, [2.0] * 4], {1: (1, poll), 2: (2, poll)})
    assert results[1] == ([10.0, 10.0], {0: (0, poll)}) and results[2] == ([20.0, 20.0], {0: (0, poll)})
