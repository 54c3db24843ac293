"""A browser chat with a conversation: the model sees every earlier message of it when it answers.

    python demos/multi_turn.py [--pretrained_path DIR] [--port 7860]                       (one process)
    torchrun --nproc-per-node=3 demos/multi_turn.py [--pretrained_path DIR] [--port 7860]  (3 model-parallel ranks)

Flags and controls: docs/demos.md.
"""
from __future__ import annotations

import chat_ui  # demos/chat_ui.py: a script's own folder is on sys.path


def whole_conversation(history: chat_ui.Messages) -> chat_ui.Messages:
    return list(history)


if __name__ == "__main__":
    chat_ui.main("accessory multi-turn chat", whole_conversation)
