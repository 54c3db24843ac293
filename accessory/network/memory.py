"""Memory for the weights: whether a model built from a config can fit, checked on the meta device before any memory
is allocated; and, once loaded, where the CPU's weights live (huge pages, memory freed while loading returned)."""
from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from accessory.errors import ConfigError
from accessory.untrusted import shown


def weight_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes this rank's parameters and buffers take once materialized with floats in `dtype` (tied tensors once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    return sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in tensors)


BUDGET_ENV = "ACCESSORY_MEMORY_BUDGET"  # bytes per rank, replacing what is measured


def memory_budget(device: torch.device) -> tuple[int, str]:
    """(bytes this rank may still allocate, where that figure comes from): `ACCESSORY_MEMORY_BUDGET` if set; on CUDA
    the device's free memory; on the CPU the least of the RAM available (MemAvailable) and the room left under this
    process's memory cgroup (`cgroup_room`): the RAM shared by this machine's ranks (LOCAL_WORLD_SIZE), a cgroup's
    room by the ranks inside it (a rank in a cgroup of its own has its room to itself)."""
    override = os.environ.get(BUDGET_ENV)
    if override:
        return budget_override(override), BUDGET_ENV
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory of {device}"
    ranks = local_ranks()
    ram = (available_ram() // ranks, f"available RAM / {ranks} local ranks" if ranks > 1 else "available RAM")
    return min([ram, *cgroup_room()])


MAX_BUDGET = 1 << 60  # bytes (1 EiB): more than any machine has; a larger figure overflows the sizes made from it


def budget_override(text: str) -> int:
    """ACCESSORY_MEMORY_BUDGET's bytes: a number from 1 to MAX_BUDGET (4000000000 or 4e9), else a ConfigError
    naming it."""
    try:
        value = int(text) if text.strip().isdigit() else float(text)  # exact for digits; 4e9 read too
    except ValueError:  # not a number, or thousands of digits
        value = 0
    if not 1 <= value <= MAX_BUDGET:  # NaN fails this too
        raise ConfigError(f"{BUDGET_ENV} must be a positive number of bytes per rank, got {shown(text)} (at most "
                          f"{MAX_BUDGET}, 2**60)")
    return int(value)


def local_ranks() -> int:
    """Ranks on this machine (torchrun's LOCAL_WORLD_SIZE): on the CPU they share its RAM."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def available_ram() -> int:
    """The kernel's estimate of the RAM that can be allocated without swapping (MemAvailable, what psutil reports as
    `available`); free pages where /proc/meminfo cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(model: nn.Module, dtype: torch.dtype, device: torch.device, config_source: str,
               what_fits: Optional[Callable[[int], str]] = None) -> None:
    """Refuse a model whose weights cannot fit in this rank's memory budget (`memory_budget`), before allocating
    them; `what_fits(room)` says what would (runtime/placement.py)."""
    room, where = memory_budget(device)
    need = weight_bytes(model, dtype)
    if need > room:
        args = model.args
        sizes = (f"dim {args.dim}, n_layers {args.n_layers}, vocab_size {args.vocab_size}, "
                 f"hidden size {args.ffn_hidden_dim}")
        stage = model.stage
        here = f" ({stage.describe()})" if stage.count > 1 else ""
        raise ConfigError(f"{config_source}: the model ({sizes}) needs {_gib(need)} of {dtype} weights on each "
                          f"rank{here}; only {_gib(room)} is available ({where})"
                          + (f"; {what_fits(room)}" if what_fits is not None else ""))


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


CGROUP_ROOT = Path("/sys/fs/cgroup")
# version -> (the memory controller's folder under CGROUP_ROOT, the limit's file, the usage's file)
CGROUP_FILES = {2: ("", "memory.max", "memory.current"), 1: ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes")}
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def cgroup_room(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT,
                sharing: Callable[[Path], int] = lambda group: ranks_in_cgroup(group)) -> list[tuple[int, str]]:
    """[(this rank's share of the bytes left under its process's memory cgroup limits, naming the limit's file)], or
    [] without a limit. The cgroup is this process's own, found through /proc/self/cgroup (a rank may have one of
    its own), and its parents' limits count too; v2 (`memory.max`) and v1 (`memory.limit_in_bytes`). A limit's
    room is shared by this job's ranks inside that cgroup (`sharing`)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        version = 2 if line.startswith("0::") else 1 if "memory" in controllers.split(",") else None
        if version is None:
            continue
        folder, limit_name, usage_name = CGROUP_FILES[version]
        top = root / folder
        group = top / path.lstrip("/")
        while group == top or top in group.parents:  # this cgroup, then its parents up to the top
            room = _room(group / limit_name, group / usage_name)
            if room is not None:
                ranks = sharing(group)
                found.append((room // ranks, f"the memory limit in {group / limit_name}"
                                             + (f" / {ranks} ranks in it" if ranks > 1 else "")))
            if group == top:
                break
            group = group.parent
    return [min(found)] if found else []


def ranks_in_cgroup(group: Path) -> int:
    """How many of this job's ranks on this machine (torchrun's workers of this run) are in cgroup `group` or below
    it, sharing its limit: at least 1, this one."""
    run, ranks = os.environ.get("TORCHELASTIC_RUN_ID"), local_ranks()
    if run is None or ranks == 1:
        return 1
    mark, count = f"TORCHELASTIC_RUN_ID={run}".encode(), 0
    for folder, _, _ in os.walk(group):
        try:
            pids = Path(folder, "cgroup.procs").read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            count += mark in environ and any(item.startswith(b"LOCAL_RANK=") for item in environ)
    return max(1, min(count, ranks))


def _room(limit_file: Path, usage_file: Path) -> Optional[int]:
    try:
        limit = limit_file.read_text().strip()
        if limit == "max" or int(limit) >= NO_LIMIT:
            return None
        return max(0, int(limit) - int(usage_file.read_text()))
    except (OSError, ValueError):
        return None


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # linux/mman.h


def back_with_huge_pages(model: nn.Module, min_bytes: int = 4 * HUGE_PAGE) -> int:
    """Ask Linux to back the model's large CPU tensors (`min_bytes` or more) with 2 MiB pages; returns the bytes
    moved. A decode step streams every weight once, and on 4 KiB pages the TLB misses on a large one cost: Gemma 3
    270M's 178 MB head on huge pages decodes about 6% faster here (benchmarks/README.md). Transparent huge pages are
    usually on only for memory that asks ("madvise"); MADV_COLLAPSE (Linux 6.1) moves what is already written. Best
    effort: nothing happens where either is missing."""
    if sys.platform != "linux":
        return 0
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    moved, seen = 0, set()
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        if tensor.device.type != "cpu" or storage.nbytes() < min_bytes or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        start = -(-storage.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # whole huge pages inside the storage
        end = (storage.data_ptr() + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
        if end > start and madvise(start, end - start, _MADV_HUGEPAGE) == 0 \
                and madvise(start, end - start, _MADV_COLLAPSE) == 0:
            moved += end - start
    return moved


def return_freed_memory() -> None:
    """Hand the heap memory that loading freed (float slices quantized, pieces read) back to the system: glibc keeps
    it otherwise, and a quantized model would hold tens of MB more than its tensors for nothing."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
