"""What `accessory batch` was asked to do: the files, the data-parallel x model-parallel split, the rows in flight,
the conversation template, the image transform, and the country whose electricity the energy report assumes."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union


@dataclass(frozen=True)
class BatchOptions:
    input: Path
    output: Path
    mp: int = 1  # model-parallel size; the data-parallel size is world / mp
    batch_size: Union[int, str] = 8  # rows in flight per model-parallel group; "auto": the model's pick
    template: Optional[str] = None  # a conversation template name; None: the model's own chat template
    max_seq_len: int = 4096
    image_transform: str = "padded_resize"  # for records with an image (a vision-language model)
    country_iso_code: Optional[str] = None  # energy and CO2 estimated by codecarbon for this country (energy.py)
