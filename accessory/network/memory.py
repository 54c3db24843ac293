"""Memory for the weights: whether a model built from a config can fit, checked on the meta device before any memory
is allocated; and, once loaded, where the CPU's weights live (huge pages, memory freed while loading returned)."""
from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from accessory.errors import ConfigError


def weight_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes this rank's parameters and buffers take once materialized with floats in `dtype` (tied tensors once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    return sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in tensors)


def available_bytes(device: torch.device) -> Optional[tuple[int, str]]:
    """(bytes free for this process's tensors, where that figure comes from), or None where it cannot be known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory of {device}"
    found = []
    meminfo = _meminfo_kib("MemAvailable")
    if meminfo is not None:
        found.append((meminfo * 1024, "MemAvailable in /proc/meminfo"))
    limit = _cgroup_room()
    if limit is not None:
        found.append((limit, "this container's memory limit (cgroup)"))
    return min(found) if found else None


def check_fits(model: nn.Module, dtype: torch.dtype, device: torch.device, config_source: str) -> None:
    """Refuse a model whose weights cannot fit in the memory this machine has left, before allocating them.
    On the CPU the ranks of one machine (LOCAL_WORLD_SIZE) share its memory."""
    available = available_bytes(device)
    if available is None:
        return
    room, where = available
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    need = weight_bytes(model, dtype) * ranks_here
    if need > room:
        args = model.args
        sizes = (f"dim {args.dim}, n_layers {args.n_layers}, vocab_size {args.vocab_size}, "
                 f"hidden size {args.ffn_hidden_dim}")
        ranks = f" for the {ranks_here} ranks on this machine" if ranks_here > 1 else ""
        raise ConfigError(f"{config_source}: the model ({sizes}) needs {_gib(need)} of {dtype} weights{ranks}; "
                          f"only {_gib(room)} is available ({where})")


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


def _meminfo_kib(field: str) -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _cgroup_room() -> Optional[int]:
    """Bytes left under a cgroup v2 memory limit (memory.max minus memory.current), if there is one."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
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
