"""A browser question box about an image: each question is answered alone, with the uploaded image in front of it.

    python demos/single_turn_mm.py --pretrained_path LLAVA_DIR [--port 7860]                       (one process)
    torchrun --nproc-per-node=2 demos/single_turn_mm.py --pretrained_path LLAVA_DIR [--port 7860]  (2 ranks)

LLAVA_DIR: a vision-language checkpoint (llama_type 'llava'). Flags and controls: docs/demos.md.
"""
from __future__ import annotations

import chat_ui  # demos/chat_ui.py: a script's own folder is on sys.path
from single_turn import last_question

if __name__ == "__main__":
    chat_ui.main("accessory single-turn questions about an image", last_question, image=True)
