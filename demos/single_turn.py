"""A browser question box: each question is answered alone, without the questions and answers above it.

    python demos/single_turn.py [--pretrained_path DIR] [--port 7860]                       (one process)
    torchrun --nproc-per-node=3 demos/single_turn.py [--pretrained_path DIR] [--port 7860]  (3 model-parallel ranks)

Flags and controls: docs/demos.md.
"""
from __future__ import annotations

import chat_ui  # demos/chat_ui.py: a script's own folder is on sys.path


def last_question(history: chat_ui.Messages) -> chat_ui.Messages:
    return [history[-1]]  # the question just asked; the page still shows the earlier ones


if __name__ == "__main__":
    chat_ui.main("accessory single-turn questions", last_question)
