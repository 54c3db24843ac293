"""`max_batch_size="auto"` (`--max-batch-size auto`): the most rows whose KV cache and step workspace fit the memory
this rank really has once the model is loaded, with a stated margin; every rank of the group takes the smallest
rank's pick, and if allocating that many rows still fails the pick is halved until it does not.

Per row: the KV cache at max_seq_len (every layer, this rank's KV heads, the model's dtype: the model's
`KVCaches.row_nbytes`) plus a decode step's workspace (`step_row_nbytes`). The memory: this rank's budget
(network/memory.py `memory_budget`: the GPU's free memory, or on the CPU the available RAM and the memory cgroup's room,
shared by the ranks of this machine; `ACCESSORY_MEMORY_BUDGET`, bytes per rank, replaces what is measured). The
prefix cache's bytes (finished sequences kept, `prefix_cache_bytes`) come off the top. At most MAX_ROWS rows,
however large the budget.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from accessory.errors import ConfigError
from accessory.network.kv_caches import KVCaches
from accessory.network.memory import memory_budget

log = logging.getLogger(__name__)

MARGIN = 0.05  # of the memory left free: allocator slack, fragmentation, the host's own objects
AUTO = "auto"
MAX_ROWS = 4096  # auto's ceiling: more rows than a step batches usefully, and sizes that cannot overflow a tensor's


@dataclass(frozen=True)
class BatchSizing:
    """One rank's arithmetic for `auto`."""
    memory: int  # bytes this rank may use
    source: str  # where `memory` comes from
    reserved: int  # the prefix cache's bytes, taken off first
    cache_row: int  # KV-cache bytes per row at `columns` positions
    step_row: int  # decode-step workspace bytes per row
    columns: int

    @property
    def rows(self) -> int:
        usable = int(self.memory * (1 - MARGIN)) - self.reserved
        return min(MAX_ROWS, max(1, usable // (self.cache_row + self.step_row)))

    def describe(self) -> str:
        return (f"max_batch_size auto: {self.source} {mib(self.memory)}, less {MARGIN:.0%} margin and "
                f"{mib(self.reserved)} prefix cache, / ({mib(self.cache_row)} KV cache at {self.columns} positions + "
                f"{mib(self.step_row)} step workspace) per row = {self.rows} rows"
                + (" (the most auto takes)" if self.rows == MAX_ROWS else ""))


def mib(n: int) -> str:
    return f"{n / 2 ** 20:.2f} MiB"


# Float32 logits over the vocabulary live at once for each row, at most: the previous step's (the scheduler samples
# them while the next step runs), and this step's decode and prefill rows with their concatenation (model_runner.py).
# Sampling works on one row at a time.
LOGITS_COPIES = 3


def step_row_nbytes(model, columns: int) -> int:
    """What a run allocates for each row besides its KV cache: its float32 logits (LOGITS_COPIES), one token's
    attention weights over `columns` positions per local head, and its hidden states through a block."""
    args, attn = model.args, model.layers[0].attention
    logits = LOGITS_COPIES * args.vocab_size * 4
    scores = attn.n_local_heads * columns * 4
    hidden = (4 * args.dim + 3 * args.ffn_hidden_dim + 3 * attn.n_local_heads * attn.head_dim) * 4
    return logits + scores + hidden


def auto_sizing(model, reserved: int) -> BatchSizing:
    """This rank's arithmetic for a model loaded and materialized, keeping `reserved` bytes (the prefix cache)."""
    columns = model.args.max_seq_len
    memory, source = memory_budget(model.device)
    return BatchSizing(memory, source, reserved, KVCaches.row_nbytes(model, columns), step_row_nbytes(model, columns),
                       columns)


def auto_batch_size(model, reserved: int) -> int:
    """The rows every rank of `model`'s group can hold (the smallest pick of any rank), logged with its arithmetic;
    halved while allocating that many rows' KV cache at max_seq_len fails on any rank."""
    sizing, error = None, None
    try:
        sizing = auto_sizing(model, reserved)
    except ConfigError as e:  # raised on every rank, not left for the others to wait on
        error = e
    model.ctx.raise_if_any_failed(error)
    log.info("%s", sizing.describe())
    rows = min(model.ctx.all_gather_object(sizing.rows))
    if rows != sizing.rows:
        log.info("max_batch_size auto: %d rows, the smallest of the ranks' picks", rows)
    return backed_off(model, rows, sizing.step_row)


def backed_off(model, rows: int, step_row: int) -> int:
    """`rows`, or half of it as many times as allocating that many rows' KV cache at max_seq_len and their step
    workspace (`step_row` bytes a row) fails on some rank (on every rank alike); both are released again."""
    while True:
        error: Optional[str] = None
        caches = workspace = None
        try:
            with torch.inference_mode():
                caches = KVCaches.allocate(model, rows, model.args.max_seq_len)
                workspace = torch.empty(rows * step_row, dtype=torch.uint8, device=model.device)
        except (RuntimeError, MemoryError) as e:  # torch's OutOfMemoryError is a RuntimeError
            error = f"{type(e).__name__}: {e}"
        finally:
            del caches, workspace  # released before the next try
        failures = [f for f in model.ctx.all_gather_object(error) if f]
        if not failures:
            return rows
        if rows == 1:
            raise ConfigError(f"max_batch_size auto: not even one row's KV cache at {model.args.max_seq_len} "
                              f"positions could be allocated ({failures[0]}); lower --max_seq_len")
        log.warning("max_batch_size auto: allocating %d rows failed (%s); trying %d", rows, failures[0], rows // 2)
        rows //= 2
