"""A browser chat about an image: the model sees the uploaded image, then every earlier message of the conversation.

    python demos/multi_turn_mm.py --pretrained_path LLAVA_DIR [--port 7860]                       (one process)
    torchrun --nproc-per-node=2 demos/multi_turn_mm.py --pretrained_path LLAVA_DIR [--port 7860]  (2 ranks)

LLAVA_DIR: a vision-language checkpoint (llama_type 'llava'). A new image starts a new conversation. Flags and
controls: docs/demos.md.
"""
from __future__ import annotations

import chat_ui  # demos/chat_ui.py: a script's own folder is on sys.path
from multi_turn import whole_conversation

if __name__ == "__main__":
    chat_ui.main("accessory multi-turn chat about an image", whole_conversation, image=True)
