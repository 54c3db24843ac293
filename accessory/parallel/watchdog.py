"""Liveness across ranks: a rank that stops answering (frozen, swapped out, its machine lost) ends the job within
`--rank-timeout` seconds, with its rank named, instead of leaving the others waiting in a collective until the
process group's own timeout.

Every rank runs a `Watchdog` thread beside its main loop. Each beat it adds one to its counter in the process group's
store and reads the others'; a rank whose counter has not moved for `timeout_s` is lost. The thread beats whatever the
main loop does (a collective that waits, a long step, an idle server), so only a rank that cannot run at all goes
silent. Counters, not clocks: machines' clocks need not agree.

A rank that fails in a way the others cannot see (it found the ranks at different generation steps, while another
rank waits in a collective that will never complete) says so in the store (`announce_failure`); every other rank's
watchdog reads it at its next beat and ends that rank the same way, naming the rank and its message.

On a lost rank the watchdog logs which one, runs the failure hooks (the server tells its open streams), kills the
lost rank if it runs on this machine (a stopped process cannot act on the SIGTERM torchrun would send), and exits
with status EXIT_RANK_LOST: its main thread may be blocked in a collective that would never return.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import Callable, Optional

import torch.distributed as dist

log = logging.getLogger(__name__)

EXIT_RANK_LOST = 3
FLUSH_S = 1.5  # after the failure hooks, time for the server to send what they wrote
_active: Optional["Watchdog"] = None


class Watchdog:
    def __init__(self, store, rank: int, world_size: int, timeout_s: float):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.interval_s = min(1.0, timeout_s / 10)
        self.failure_hooks: list[Callable[[str], None]] = []  # called with the message before exiting
        self._silent_since = {r: time.monotonic() for r in range(world_size) if r != rank}
        self._counts = {r: -1 for r in self._silent_since}
        self.announced = False  # this rank failed and said so: it raises on its own, others' failures are no news
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="accessory-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self.store.set(_key("where", self.rank), f"{socket.gethostname()} {os.getpid()}")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def silent_ranks(self, after_s: float) -> dict[int, float]:
        """Ranks whose heartbeat has not moved for more than `after_s` seconds, with how long."""
        now = time.monotonic()
        return {r: now - t for r, t in self._silent_since.items() if now - t > after_s}

    def _run(self) -> None:
        store_silent_since = None
        while not self._stop.wait(self.interval_s):
            if not dist.is_initialized():  # the script left the process group (destroy_process_group): done
                return
            try:
                self.store.add(_key("beat", self.rank), 1)
                for r in self._silent_since:
                    count = self.store.add(_key("beat", r), 0)  # reads without waiting for the key
                    if count != self._counts[r]:
                        self._counts[r], self._silent_since[r] = count, time.monotonic()
                failed = self.announced_failure()
                store_silent_since = None
            except Exception as e:  # the store's host is gone, or leaving as this rank leaves the group
                store_silent_since = store_silent_since or time.monotonic()
                if time.monotonic() - store_silent_since > self.timeout_s:
                    self._fail(f"the process group's store has not answered for {self.timeout_s:g} s ({e})", None)
                continue
            if failed is not None and not self.announced:
                self._fail(f"rank {failed[0]} failed: {failed[1]}; ending every rank", None)
            lost = self.silent_ranks(self.timeout_s)
            if lost:
                rank = max(lost, key=lost.get)
                self._fail(f"rank {rank}{self._role(rank)} has not answered for {lost[rank]:.0f} s (--rank-timeout "
                           f"{self.timeout_s:g}): it is frozen or lost; ending every rank", rank)

    def announce_failure(self, message: str) -> None:
        self.announced = True
        self.store.set(_key("failed", self.rank), message)

    def announced_failure(self) -> Optional[tuple[int, str]]:
        """(rank, message) of another rank that announced a failure, if one did."""
        for rank in self._silent_since:
            if self.store.check([_key("failed", rank)]):
                return rank, self.store.get(_key("failed", rank)).decode()
        return None

    def _role(self, rank: int) -> str:
        """" (pipeline stage 1 of 2)", what `name_rank` said rank `rank` does, or ""."""
        try:
            return f" ({self.store.get(_key('role', rank)).decode()})" if self.store.check([_key("role", rank)]) else ""
        except Exception:  # the store is gone too: the rank's number alone
            return ""

    def _fail(self, message: str, lost_rank: Optional[int]) -> None:
        log.error("%s", message)
        for hook in self.failure_hooks:
            try:
                hook(message)
            except Exception:
                log.exception("a failure hook raised")
        if self.failure_hooks:
            time.sleep(FLUSH_S)
        if lost_rank is not None:
            self._kill_if_here(lost_rank)
        os._exit(EXIT_RANK_LOST)

    def _kill_if_here(self, rank: int) -> None:
        try:
            if not self.store.check([_key("where", rank)]):
                return
            host, pid = self.store.get(_key("where", rank)).decode().split()
            if host == socket.gethostname():
                os.kill(int(pid), signal.SIGKILL)
                log.error("killed rank %d (pid %s): a frozen process cannot end itself", rank, pid)
        except Exception as e:
            log.warning("could not end rank %d: %s", rank, e)


def _key(kind: str, rank: int) -> str:
    return f"accessory/watchdog/{kind}/{rank}"


def start_watchdog(timeout_s: float) -> Optional[Watchdog]:
    """Start this rank's watchdog over the default process group (once); None for a single process."""
    global _active
    if _active is None and dist.is_initialized() and dist.get_world_size() > 1:
        store = dist.distributed_c10d._get_default_store()
        _active = Watchdog(store, dist.get_rank(), dist.get_world_size(), timeout_s).start()
    return _active


def name_rank(role: str) -> None:
    """Say what this rank does ("pipeline stage 1 of 2"), for the other ranks' watchdogs to name it if it is lost;
    nothing without a watchdog."""
    if _active is not None:
        try:
            _active.store.set(_key("role", _active.rank), role)
        except Exception as e:
            log.warning("could not record this rank's role: %s", e)


def active_watchdog() -> Optional[Watchdog]:
    return _active


def announced_failure() -> Optional[tuple[int, str]]:
    """(rank, message) of another rank that announced a failure; None if none did, or without a watchdog."""
    try:
        return _active.announced_failure() if _active is not None else None
    except Exception:  # the store is gone too
        return None


def announce_failure(message: str) -> None:
    """Tell the other ranks' watchdogs that this rank failed (they end their ranks); nothing without a watchdog."""
    if _active is not None:
        try:
            _active.announce_failure(message)
        except Exception as e:  # the store is gone: the others will find this rank silent instead
            log.warning("could not tell the other ranks of this failure: %s", e)


def await_verdict_on_silent_ranks() -> None:
    """For a rank that waited in vain for the others: if some of them are silent (frozen or lost, not merely
    elsewhere), the watchdog is about to end this rank, naming them and killing a frozen one on this machine; wait
    for it rather than leave first (a stopped process would outlive this rank). Returns if none are silent."""
    watchdog = _active
    if watchdog is not None and watchdog.silent_ranks(2 * watchdog.interval_s):
        time.sleep(watchdog.timeout_s + 2 * watchdog.interval_s)  # the watchdog exits this process meanwhile


def stop_watchdog() -> None:
    global _active
    if _active is not None:
        _active.stop()
        _active = None
