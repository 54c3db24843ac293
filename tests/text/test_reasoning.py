"""Reasoning kept apart from the answer (accessory/text/reasoning.py): replies that open the block themselves or
continue one the prompt opened, cut short, empty, or without reasoning, split into exactly the expected reasoning and
answer, whole and streamed split anywhere alike; the format is found in a template that writes both markers."""
from __future__ import annotations

import pytest

from accessory.text.reasoning import REASONING_FORMATS, ReasoningStream, opens_reasoning, reasoning_format, \
    split_reasoning

THINK = REASONING_FORMATS["qwen3"]
CASES = [  # reply, whether the prompt opened the block, reasoning, answer
    ("<think>\nThe user wants a city.\n</think>\n\nParis.", False, "The user wants a city.", "Paris."),
    ("Paris.", False, "", "Paris."),
    ("  <thin", False, "", "  <thin"),
    ("<think></think>Paris.", False, "", "Paris."),
    ("<think>\nStill thinking about </thi", False, "Still thinking about </thi", ""),
    ("The user asks.\n</think>\n\nParis. <think> stays", True, "The user asks.", "Paris. <think> stays"),
    ("Cut short", True, "Cut short", ""),
    ("\n\n</think>\n\n<tool_call>{}</tool_call>", True, "", "<tool_call>{}</tool_call>"),
]


@pytest.mark.parametrize("reply, opened, reasoning, answer", CASES)
def test_a_whole_reply_splits_into_its_reasoning_and_answer(reply, opened, reasoning, answer):
    assert split_reasoning(reply, THINK, opened, final=True) == (reasoning, answer)


@pytest.mark.parametrize("reply, opened, reasoning, answer", CASES)
def test_a_stream_split_anywhere_adds_up_to_the_whole_reply(reply, opened, reasoning, answer):
    for pieces in [[reply[:cut], reply[cut:]] for cut in range(len(reply) + 1)] + [list(reply)]:
        stream, sent = ReasoningStream(THINK, opened), []
        sent = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        assert ("".join(r for r, _ in sent), "".join(a for _, a in sent)) == (reasoning, answer), pieces


def test_the_prompt_that_opens_the_block_and_the_template_that_writes_it():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n", THINK)
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
    assert reasoning_format("auto", "{{ '<think>' }} ... {{ '</think>' }}") is THINK
    assert reasoning_format("auto", "{{ '<|im_start|>' }}") is None
    assert reasoning_format("none", "<think></think>") is None
    assert reasoning_format("deepseek_r1", "") is REASONING_FORMATS["deepseek_r1"]
