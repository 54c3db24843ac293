"""Collectives at memory speed between the ranks of a model-parallel group that share one machine.

gloo moves a decode step's 576 floats between two local processes in about 1.2 ms (loopback TCP and its own
polling); a tensor-parallel step makes two such all-reduces a layer. Here the ranks exchange them through a shared
memory segment instead (kernels/collectives.c: a round of posts and waits on counters, in microseconds), as vLLM's CPU
backend and DeepSpeed's CPU inference do. gloo stays the rendezvous (this module sets the segment up over it), the
transport of a group that spans machines, and the fallback wherever a segment cannot be made.

The segment is private to the job: rank 0 creates it in /dev/shm under a name made from the rendezvous and a random
token (O_EXCL, mode 0600), every rank maps it, and once all have, it is unlinked. From then on it has no name: nothing
is left in /dev/shm however the job ends, SIGKILL included, and no other job can open it.

`ACCESSORY_TRANSPORT=gloo` keeps gloo for every collective (a comparison, or a machine whose /dev/shm is too small).
"""
from __future__ import annotations

import ctypes
import datetime
import hashlib
import logging
import os
import secrets
import socket
import stat
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from accessory.errors import ConfigError
from accessory.kernels import build

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 1 << 20  # each rank's part of one round; a larger tensor takes several rounds
SPIN_US = 100.0  # how long a waiting rank spins before it sleeps, when every rank has a core of its own
YIELD_US = 2000.0  # how long it spins yielding its core to a ready rank before it sleeps, when ranks outnumber cores
TRANSPORT_VARIABLE = "ACCESSORY_TRANSPORT"
OUT_OF_STEP = "not in the same collective"  # in the error of ranks whose calls went out of step (collectives.c)
_DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3, torch.int32: 4, torch.int64: 5}


class SharedMemoryError(RuntimeError):
    """A shared-memory collective failed: a rank ended or did not come in time (the message names it)."""


class SharedMemoryGroup:
    """This rank's handle on a group's segment: the collectives ParallelContext routes here."""

    def __init__(self, handle: int, rank: int, world: int, timeout_s: float):
        self.handle, self.rank, self.world, self.timeout_s = handle, rank, world, timeout_s
        self._lib = ctypes.CDLL(str(build.library_path()))  # the library torch loaded: same groups table
        self._lib.accessory_shm_bytes_sent.restype = ctypes.c_int64
        self._lib.accessory_shm_waited_s.restype = ctypes.c_double

    # all_reduce and all_gather are operators (torch_ops.cpp), so that compiled steps call them; they raise
    # RuntimeError with the C side's message (SharedMemoryError for the rest)

    def all_reduce(self, x: torch.Tensor, timeout_s: float = 0.0) -> torch.Tensor:
        """The sum of every rank's x, added in rank order (the same bits on every rank); a new tensor.
        `timeout_s`: the longest to wait for the other ranks (0: the process group's timeout)."""
        return torch.ops.accessory.shm_all_reduce(x, self.handle, timeout_s)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x stacked in rank order: (world, *x.shape)."""
        return torch.ops.accessory.shm_all_gather(x, self.handle, self.world, 0.0)

    def broadcast_(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """x (contiguous) becomes rank `src`'s x on every rank, in place."""
        self._check(self._lib.accessory_shm_broadcast(self.handle, ctypes.c_void_p(x.data_ptr()),
                                                      ctypes.c_int64(x.nbytes), src, ctypes.c_double(0.0)))
        return x

    def gather(self, x: torch.Tensor, dst: int) -> Optional[torch.Tensor]:
        """Every rank's x stacked in rank order (world, *x.shape) on rank `dst`; None elsewhere."""
        x = x.contiguous()
        out = x.new_empty(self.world, *x.shape) if self.rank == dst else None
        self._check(self._lib.accessory_shm_gather(self.handle, ctypes.c_void_p(x.data_ptr()),
                                                   ctypes.c_void_p(out.data_ptr() if out is not None else 0),
                                                   ctypes.c_int64(x.nbytes), dst, ctypes.c_double(0.0)))
        return out

    @property
    def bytes_sent(self) -> int:
        """What this rank has written into the segment for the others so far (what a network would carry)."""
        return self._lib.accessory_shm_bytes_sent(self.handle)

    @property
    def waited_s(self) -> float:
        """Seconds this rank has spent so far waiting for the others to reach its collectives: what uneven work
        between the ranks, and waking them, cost (the collectives' own copying is not counted)."""
        return self._lib.accessory_shm_waited_s(self.handle)

    def close(self) -> None:
        self._lib.accessory_shm_detach(self.handle)

    def _check(self, status: int) -> None:
        if status:
            raise SharedMemoryError(_last_error(self._lib))


def _last_error(lib) -> str:
    lib.accessory_shm_error.restype = ctypes.c_char_p
    return lib.accessory_shm_error().decode()


def host_key() -> str:
    """What ranks that can share a segment have in common: the machine's boot, and the pid, mount and network
    namespaces (a rank's pid must mean the same process to the others, /dev/shm the same folder; ranks in other
    network namespaces stand for other machines)."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid", "/proc/self/ns/mnt", "/proc/self/ns/net"):
        try:
            parts.append(os.readlink(path) if path.startswith("/proc/self/ns") else Path(path).read_text().strip())
        except OSError:
            return ""  # cannot tell: no segment
    return " ".join(parts)


_made: dict[int, tuple[dist.ProcessGroup, Optional[SharedMemoryGroup]]] = {}  # id(group) -> (group, its segment)


def for_group(group: dist.ProcessGroup) -> Optional[SharedMemoryGroup]:
    """The segment of `group`, made at the first call for it (collective then: every rank of the group calls this
    at the same point); None where gloo carries its collectives. The group is held, so its id stays its own."""
    if id(group) not in _made:
        made = shared_memory_group(group, dist.get_rank(group), dist.get_world_size(group))
        _made[id(group)] = (group, made)
    return _made[id(group)][1]


def forget_groups() -> None:
    """Unmap every segment (the process group is being destroyed: its groups' ranks are leaving)."""
    for _, made in _made.values():
        if made is not None:
            made.close()
    _made.clear()


def shared_memory_group(group: dist.ProcessGroup, rank: int, world: int) -> Optional[SharedMemoryGroup]:
    """A segment for `group` when all its ranks are on this machine, else None (gloo carries its collectives).

    Collective over `group` (through gloo): every rank of it calls this at the same point."""
    wanted = os.environ.get(TRANSPORT_VARIABLE, "auto")
    if wanted not in ("auto", "shm", "gloo"):
        raise ConfigError(f"{TRANSPORT_VARIABLE}={wanted!r}: expected auto, shm or gloo")
    local = wanted != "gloo" and SHM_DIR.is_dir() and build.cpu_kernels()
    views = [None] * world
    dist.all_gather_object(views, (host_key() if local else "", socket.gethostname()), group=group)
    if not all(key and key == views[0][0] for key, _ in views):
        hosts = sorted({name for _, name in views})
        why = (f"{TRANSPORT_VARIABLE}=gloo" if wanted == "gloo" else f"its ranks are on {len(hosts)} machines"
               if len(hosts) > 1 else "not every rank can make one (no kernels or no /dev/shm)")
        (log.warning if wanted == "shm" else log.info)("model-parallel group of %d ranks: gloo collectives (%s)",
                                                         world, why)
        return None
    return _attach(group, rank, world)


def _attach(group: dist.ProcessGroup, rank: int, world: int) -> Optional[SharedMemoryGroup]:
    """Rank 0 creates the segment and names it to the others; every rank maps it; then it is unlinked."""
    lib = ctypes.CDLL(str(build.library_path()))
    lib.accessory_shm_segment_bytes.restype = ctypes.c_int64
    size = lib.accessory_shm_segment_bytes(world, ctypes.c_int64(SLOT_BYTES))
    ranks, cores = ranks_and_cores()
    yields = ranks > cores
    spin = YIELD_US if yields else SPIN_US
    timeout_s = group_timeout_s(group)
    path, handle, problem = None, -1, None
    try:
        if rank == 0:  # creates it and writes its header before the others are told its name
            path = _create(group, size)
            if path is not None:
                handle = _map(lib, path, size, rank, world, spin, yields, timeout_s)
        box = [str(path) if path else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        if box[0] is None:
            raise OSError("rank 0 could not make a segment")
        path = Path(box[0])
        if rank != 0:
            handle = _map(lib, path, size, rank, world, spin, yields, timeout_s)
    except OSError as e:
        problem = f"rank {rank}: {e}"
    problems = [None] * world
    dist.all_gather_object(problems, problem, group=group)  # every rank has mapped it, or failed to
    if rank == 0 and path is not None:
        path.unlink(missing_ok=True)
    failed = [p for p in problems if p is not None]
    if failed:
        if handle >= 0:
            lib.accessory_shm_detach(handle)
        log.warning("model-parallel group of %d ranks: gloo collectives (no shared-memory segment: %s)", world,
                    "; ".join(failed))
        return None
    log.info("model-parallel group of %d ranks on this machine: shared-memory collectives (%s waits)", world,
             f"more ranks than cores: yielding for {spin:g} us, then sleeping" if yields else
             f"spinning {spin:g} us, then sleeping")
    return SharedMemoryGroup(handle, rank, world, timeout_s)


def _map(lib, path: Path, size: int, rank: int, world: int, spin: float, yields: bool, timeout_s: float) -> int:
    """Map the segment at `path` as `rank`; its handle in the kernels' table."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        _check_segment(fd, path, size)
        handle = lib.accessory_shm_attach(fd, ctypes.c_int64(size), rank, world, ctypes.c_int64(SLOT_BYTES),
                                          ctypes.c_double(spin), int(yields), ctypes.c_double(timeout_s))
    finally:
        os.close(fd)  # the mapping stays
    if handle < 0:
        raise OSError(_last_error(lib))
    return handle


def _create(group: dist.ProcessGroup, size: int) -> Optional[Path]:
    """A new segment of `size` bytes, named from the rendezvous and a random token, mode 0600; None if it cannot
    be made (every rank then keeps gloo)."""
    _remove_orphans()
    where = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}:{group.group_name}"
    job = hashlib.sha256(where.encode()).hexdigest()[:12]
    path = SHM_DIR / f"accessory-{job}-{os.getpid()}-{secrets.token_hex(8)}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        log.warning("cannot create a shared-memory segment in %s: %s", SHM_DIR, e)
        return None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.posix_fallocate(fd, 0, size)  # the pages exist now: a full /dev/shm fails here, not with SIGBUS later
    except OSError as e:
        os.close(fd)
        path.unlink(missing_ok=True)
        log.warning("cannot make a shared-memory segment of %d bytes in %s: %s", size, SHM_DIR, e)
        return None
    os.close(fd)
    return path


def _check_segment(fd: int, path: Path, size: int) -> None:
    """The segment is the one rank 0 made: ours, a regular file, mode 0600, `size` bytes."""
    info = os.fstat(fd)
    if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) != 0o600
            or info.st_size != size):
        raise OSError(f"{path} is not the segment rank 0 made (owner {info.st_uid}, mode "
                      f"{stat.S_IMODE(info.st_mode):o}, {info.st_size} bytes)")


def _remove_orphans() -> None:
    """Segments whose creator died before it unlinked them (a kill in the moment between the two): remove them."""
    for path in SHM_DIR.glob("accessory-*-*-*"):
        try:
            pid = int(path.name.split("-")[2])
            if path.stat().st_uid == os.getuid() and not Path(f"/proc/{pid}").exists():
                path.unlink()
        except (ValueError, IndexError, OSError):
            continue


def ranks_and_cores() -> tuple[int, int]:
    """How many ranks torchrun started on this machine (all of the world without torchrun's variable), and how many
    cores this process may use: more ranks than cores take turns on them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())), len(os.sched_getaffinity(0))


def group_timeout_s(group: dist.ProcessGroup) -> float:
    """The process group's own timeout: how long gloo would wait in a collective."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout.total_seconds() if isinstance(dist.default_pg_timeout,
                                                                   datetime.timedelta) else 1800.0
