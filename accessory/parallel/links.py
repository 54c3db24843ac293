"""Point-to-point messages between two ranks over a TCP connection of their own: a pipeline's hidden states from one
stage to the next, and the engine's small per-step messages through the source rank where the ranks span machines
(`ParallelContext.star`).

gloo moves a point-to-point message in two steps, the receiver first saying it is ready, each through a thread of its
own: a round trip of 2.3 KB over the two-namespace link took 528 us, a link's 91 us (benchmarks/README.md, "Links"),
and a decode step at `--pp 2` makes two such hops. Here each message is one write of a small
frame (its kind and size, then its bytes), which the kernel buffers: a send never waits for the peer to read, and a
receive is one read. The connections are made once, when the group is set up, over gloo's rendezvous; gloo keeps the
collectives.

Each connection carries one kind of traffic in order, so both sides read its messages in the order they were sent;
a frame of another kind or size than the reader expects means the ranks' calls went out of step, and says so.
"""
from __future__ import annotations

import fcntl
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

from accessory.errors import CollectivesOutOfStep
from accessory.parallel.shared_memory import ranks_and_cores

log = logging.getLogger(__name__)

FRAME = struct.Struct("<iq")  # a message's kind (a tag) and its size in bytes, before its bytes
HELLO = struct.Struct("<16si")  # the listener's token and the connecting rank, the first bytes on a new connection
# the kinds of message, each a tag: the pipeline's hidden states, and the context's collectives through the source rank
HIDDEN, SUM, GATHER, BROADCAST = 1, 7, 8, 9
KINDS = {HIDDEN: "hidden states", SUM: "a sum", GATHER: "a gather", BROADCAST: "a broadcast"}
SIOCGIFADDR = 0x8915  # ioctl: an interface's IPv4 address
# How long a receive polls before it sleeps, on a rank with a core of its own: a core that sleeps between a decode
# step's messages costs that step its wake-up and its cold caches (a token at `--pp 2`, batch 1: 11.31 ms polling
# against 11.92 sleeping at once, 7 pairs on average: benchmarks/README.md, "Links"). Where ranks outnumber cores a
# poller would take the core of the rank it waits for, so it sleeps at once.
POLL_S = 0.02
_open: list["Link"] = []  # every link this process made, closed when it leaves the process group


class LinkClosed(RuntimeError):
    """The peer closed the connection or it broke (the peer ended, or its machine or the link went away)."""


class Link:
    """One TCP connection to one peer rank (`peer`: its global rank, for messages)."""

    def __init__(self, sock: socket.socket, peer: int, poll_s: float = 0.0):
        self.sock, self.peer, self.poll_s = sock, peer, poll_s
        self._pending: deque[list[bytes]] = deque()  # frames the kernel had no room for yet: `_drain` sends them
        self._changed = threading.Condition()
        self._failure: Optional[BaseException] = None
        self._drainer: Optional[threading.Thread] = None

    def send(self, x: torch.Tensor, tag: int) -> None:
        """Send x's bytes as a message of kind `tag`, without waiting for the peer to read them (what the kernel
        cannot take at once is copied and sent by a thread); x may change as soon as this returns."""
        frame = [FRAME.pack(tag, x.nbytes), _bytes_of(x)]
        with self._changed:
            self._raise_failure()
            if not self._pending:
                try:
                    sent = self.sock.sendmsg(frame, (), socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError as e:
                    raise self._closed(e) from None
                if sent == FRAME.size + x.nbytes:
                    return
                frame = _after(frame, sent)
            self._pending.append([bytes(part) for part in frame])
            if self._drainer is None:
                self._drainer = threading.Thread(target=self._drain, name=f"link to rank {self.peer}", daemon=True)
                self._drainer.start()
            self._changed.notify_all()

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype, tag: int,
                timeout_s: Optional[float] = None) -> torch.Tensor:
        """The next message, which must be of kind `tag` and hold a `shape` `dtype` tensor (CollectivesOutOfStep
        if not: the ranks are not in the same call). `timeout_s`: the longest to wait (TimeoutError)."""
        out = torch.empty(shape, dtype=dtype)
        header = bytearray(FRAME.size)
        self._read([memoryview(header), _bytes_of(out)], timeout_s)
        got_tag, size = FRAME.unpack(header)
        if got_tag != tag or size != out.nbytes:
            raise CollectivesOutOfStep(f"rank {self.peer} sent {_kind(got_tag)} of {size} bytes where this rank "
                                       f"waited for {_kind(tag)} of {out.nbytes} bytes: the ranks are not in the same "
                                       f"collective")
        return out

    def flush(self) -> None:
        """Wait until the kernel holds every message sent (raising the error of one that failed)."""
        with self._changed:
            while self._pending and self._failure is None:
                self._changed.wait()
            self._raise_failure()

    def close(self) -> None:
        with self._changed:
            self._failure = self._failure or LinkClosed(f"the link to rank {self.peer} was closed")
            self._changed.notify_all()
        self.sock.close()

    def _read(self, views: list[memoryview], timeout_s: Optional[float]) -> None:
        """Fill `views` from the connection, in order."""
        now = time.monotonic()
        deadline, polled = None if timeout_s is None else now + timeout_s, now + self.poll_s
        views = [v.cast("B") for v in views if v.nbytes]
        while views:
            try:
                got = self.sock.recvmsg_into(views, 0, socket.MSG_DONTWAIT)[0]
            except BlockingIOError:
                if time.monotonic() >= polled:  # sleep until the peer sends
                    left = None if deadline is None else deadline - time.monotonic()
                    if (left is not None and left <= 0) or not select.select([self.sock], [], [], left)[0]:
                        raise TimeoutError(f"rank {self.peer} sent nothing for {timeout_s:g} s") from None
                continue
            except OSError as e:
                raise self._closed(e) from None
            if got == 0:
                raise self._closed(None)
            views = _after(views, got)

    def _drain(self) -> None:
        """The thread that sends what the kernel had no room for, in order, as the peer reads."""
        while True:
            with self._changed:
                while not self._pending and self._failure is None:
                    self._changed.wait()
                if self._failure is not None:
                    return
                frame = self._pending[0]
            try:
                for part in frame:
                    self.sock.sendall(part)
            except OSError as e:
                with self._changed:
                    self._failure = self._closed(e)
                    self._changed.notify_all()
                return
            with self._changed:
                self._pending.popleft()
                self._changed.notify_all()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _closed(self, e: Optional[OSError]) -> LinkClosed:
        # "closed by peer", as gloo says it: the context then waits for the reason the peer announced
        return LinkClosed(f"connection to rank {self.peer} closed by peer" + (f" ({e})" if e else ""))


def connect(group: dist.ProcessGroup, peers: list[int], timeout_s: float) -> dict[int, Link]:
    """Links from this rank to each of `peers` (ranks in `group`), by group rank. Collective over `group`: every
    rank calls it at the same point, naming its own peers (a rank named by a peer must name that peer).

    Of each pair, the lower rank listens and the higher connects, then proves it is of this job with the listener's
    token (shared over gloo; a stranger's connection is dropped). Each listens on the address its machine reaches the
    rendezvous from (GLOO_SOCKET_IFNAME's when set, as for gloo)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    address, token = reachable_address(), secrets.token_bytes(16)
    listener = None
    if any(peer > rank for peer in peers):
        listener = socket.create_server((address, 0), family=_family(address), backlog=world)
    views = [None] * world
    dist.all_gather_object(views, (address, listener.getsockname()[1] if listener else 0, token), group=group)
    links = {}
    try:
        for peer in (p for p in peers if p < rank):
            host, port, their_token = views[peer]
            sock = socket.create_connection((host, port), timeout=timeout_s)
            sock.sendall(HELLO.pack(their_token, rank))
            links[peer] = _linked(sock, group, peer)
        if listener is not None:
            for peer, sock in _accept(listener, token, {p for p in peers if p > rank}, timeout_s).items():
                links[peer] = _linked(sock, group, peer)
    except OSError as e:
        raise RuntimeError(f"rank {dist.get_rank()} could not link to its peers {sorted(peers)} of the model-parallel "
                           f"group at {[views[p][:2] for p in peers]}: {e}") from None
    finally:
        if listener is not None:
            listener.close()
    _open.extend(links.values())
    return links


def close_links() -> None:
    """Close every link (this process is leaving the process group)."""
    while _open:
        _open.pop().close()


def reachable_address() -> str:
    """This machine's address as the other ranks can reach it: GLOO_SOCKET_IFNAME's first interface's when set, else
    the one it reaches MASTER_ADDR from, else its hostname's."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if interface:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", interface[:15].encode()))
                return socket.inet_ntoa(packed[20:24])
            except OSError:
                log.warning("GLOO_SOCKET_IFNAME=%s has no IPv4 address; links use the route to MASTER_ADDR", interface)
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            family, _, _, _, where = socket.getaddrinfo(master, int(os.environ.get("MASTER_PORT", "29500")),
                                                        type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(where)  # no packet is sent: this only picks the route
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def _accept(listener: socket.socket, token: bytes, expected: set[int], timeout_s: float) -> dict[int, socket.socket]:
    """The connections of the `expected` group ranks, each proven by the listener's token; others are closed."""
    accepted, deadline = {}, time.monotonic() + timeout_s
    while expected - accepted.keys():
        listener.settimeout(max(0.0, deadline - time.monotonic()))
        try:
            sock, _ = listener.accept()
        except socket.timeout:
            raise RuntimeError(f"model-parallel ranks {sorted(expected - accepted.keys())} did not link to rank "
                               f"{dist.get_rank() if dist.is_initialized() else 0} within {timeout_s:g} s") from None
        sock.settimeout(min(5.0, timeout_s))
        try:
            hello = sock.recv(HELLO.size, socket.MSG_WAITALL)
        except OSError:
            hello = b""
        their_token, peer = HELLO.unpack(hello) if len(hello) == HELLO.size else (b"", -1)
        if their_token != token or peer not in expected - accepted.keys():
            sock.close()  # not a rank of this group that this rank waits for
            continue
        accepted[peer] = sock
    return accepted


def _linked(sock: socket.socket, group: dist.ProcessGroup, peer: int) -> Link:
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a step's message goes now, not with the next
    ranks, cores = ranks_and_cores()
    return Link(sock, dist.get_global_rank(group, peer), POLL_S if ranks <= cores else 0.0)


def _kind(tag: int) -> str:
    return KINDS.get(tag, f"a message of kind {tag}")


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def _bytes_of(x: torch.Tensor) -> memoryview:
    """x's bytes (x contiguous, on the CPU), without a copy."""
    x = x.reshape(-1)
    return memoryview((x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy()).cast("B")  # numpy lacks bf16


def _after(views: list, n: int) -> list:
    """What is left of `views` once their first n bytes have gone."""
    left = []
    for v in views:
        v = memoryview(v).cast("B")
        if n >= v.nbytes:
            n -= v.nbytes
            continue
        left.append(v[n:])
        n = 0
    return left
