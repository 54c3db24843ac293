"""What each data-parallel group reports when its share is done (GroupStats), and the summary global rank 0 prints
from them (with the energy report, if one was asked for)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from accessory.batch.energy import EnergyReport
from accessory.batch.options import BatchOptions
from accessory.parallel.context import GroupLayout


@dataclass
class GroupStats:
    records: int = 0
    failed: int = 0  # records whose generation ended in an error (written with finish_reason "error")
    prompt_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0


def format_summary(options: BatchOptions, layout: GroupLayout, sampling: dict, records: int, skipped: int,
                   stats: list[GroupStats], encode_s: float, energy: Optional[EnergyReport] = None) -> str:
    generated, failed = sum(s.records for s in stats), sum(s.failed for s in stats)
    tokens_in, tokens_out = sum(s.prompt_tokens for s in stats), sum(s.output_tokens for s in stats)
    generate_s = max(s.seconds for s in stats) if stats else 0.0  # the groups run side by side
    rate = tokens_out / generate_s if generate_s > 0 else 0.0
    return "\n".join([
        f"batch summary: {options.output}",
        f"  layout          {layout.dp_size} data-parallel x {layout.mp_size} model-parallel rank(s), "
        f"batch size {options.batch_size} per group, max_gen_len {sampling['max_gen_len']}",
        f"  records         {records} ({generated} generated, {failed} failed, {skipped} already done)",
        f"  tokens          {tokens_in} input, {tokens_out} output",
        f"  encode latency  {encode_s:.3f} s (render and tokenize on rank 0)",
        f"  generate        {generate_s:.3f} s, {rate:.1f} output tokens/s",
        *(energy.lines() if energy is not None else []),
    ])
