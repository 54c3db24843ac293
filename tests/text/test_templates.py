"""Prompt templates against LLaMA2-Accessory's.

Every expected string below is written out by hand from the original source (Alpha-VLLM/LLaMA2-Accessory,
`accessory/data/system_prompt.py` and `accessory/data/conversation/lib.py`: `format_prompt` and
`Conversation.process`), not produced by this package: a model fine-tuned on a template expects exactly these bytes.
"""
from __future__ import annotations

import pytest

from accessory.data.conversation import (Conversation, SeparatorStyle, conv_templates, default_conversation,
                                         get_conversation)
from accessory.data.conversation import template_names as conversation_names
from accessory.data.system_prompt import format_prompt
from accessory.data.system_prompt import template_names as prompt_names

# ---------------------------------------------------------------- format_prompt (single turn)

ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\nName a color.\n\n### Response:")
ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n### Instruction:\nTranslate to "
                "English.\n\n### Input:\nBonjour\n\n### Response:")


@pytest.mark.parametrize("format_dict, sys_name, expected", [
    ({"instruction": "Name a color."}, "alpaca", ALPACA_NO_INPUT),
    ({"instruction": "Translate to English.", "input": "Bonjour"}, "alpaca", ALPACA_INPUT),
    # an input that is None, empty or whitespace counts as no input
    ({"instruction": "Name a color.", "input": None}, "alpaca", ALPACA_NO_INPUT),
    ({"instruction": "Name a color.", "input": ""}, "alpaca", ALPACA_NO_INPUT),
    ({"instruction": "Name a color.", "input": " \n\t"}, "alpaca", ALPACA_NO_INPUT),
    ({"instruction": "What color is the sky?"}, "shortqa",
     "Below is an instruction that describes a task. Write a response that appropriately completes the request "
     "using a single word or phrase.\n\n### Instruction:\nWhat color is the sky?\n\n### Response:"),
    ({"instruction": "Paris"}, "qg", "Generate a question whose answer is:\nParis\n\nQuestion:\n"),
    ({"instruction": "ignored"}, "caption", ""),
    ({}, "caption", ""),
    ({"instruction": "Tell me a joke."}, "None", "Tell me a joke."),
    # values are inserted verbatim (format_map does not re-read braces inside them); extra keys are ignored
    ({"instruction": "Fill {this} in.", "extra": 1}, "None", "Fill {this} in."),
])
def test_format_prompt_matches_accessory(format_dict, sys_name, expected):
    assert format_prompt(format_dict, sys_name) == expected


def test_format_prompt_defaults_to_alpaca():
    assert format_prompt({"instruction": "Name a color."}) == ALPACA_NO_INPUT
    assert prompt_names() == ["alpaca", "shortqa", "qg", "caption", "None"]


@pytest.mark.parametrize("sys_name", ["vicuna", "Alpaca", "", None])
def test_format_prompt_unknown_template_names_the_known_ones(sys_name):
    """Accessory returned None here (it built the ValueError but never raised it)."""
    with pytest.raises(ValueError, match=r"unknown prompt template.*alpaca, shortqa, qg, caption, None"):
        format_prompt({"instruction": "x"}, sys_name)


@pytest.mark.parametrize("format_dict, sys_name", [
    ({}, "alpaca"), ({"input": "has input"}, "alpaca"), ({"question": "x"}, "shortqa"), ({}, "qg"), ({}, "None"),
])
def test_format_prompt_missing_key_is_named(format_dict, sys_name):
    with pytest.raises(ValueError, match=r"needs the key 'instruction'"):
        format_prompt(format_dict, sys_name)


# ---------------------------------------------------------------- conversations (multi turn)

HUMAN_SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. The assistant gives "
                "helpful, detailed, and polite answers to the human's questions.")
USER_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
               "detailed, and polite answers to the user's questions.")
LLAVA_SYSTEM = ("You are LLaVA, a large language and vision assistant trained by UW Madison WAIV Lab.You are able to "
                "understand the visual content that the user provides, and assist the user with a variety of tasks "
                "using natural language.Follow the instructions carefully and explain your answers in detail.")

# load_qas([["Q1", "A1"], ["Q2", None]]).get_prompt(): one finished turn, then the assistant's turn left open.
# SINGLE: system + "\n\n###", then " {role}: {message}\n###" per message, " {role}:" for the open one.
# TWO: system + " ", then " {role}: {message}" closed by " " (even index) or "</s>" (odd index).
TWO_TURNS = {
    "default": HUMAN_SYSTEM + "\n\n### Human: Q1\n### Assistant: A1\n### Human: Q2\n### Assistant:",
    "simple": HUMAN_SYSTEM + "\n\n### Human: Q1\n### Assistant: A1\n### Human: Q2\n### Assistant:",
    "v1": HUMAN_SYSTEM + "\n\n### Human: Q1\n### Assistant: A1\n### Human: Q2\n### Assistant:",
    "multimodal": LLAVA_SYSTEM + "\n\n### Human: Q1\n### Assistant: A1\n### Human: Q2\n### Assistant:",
    "llava_v1": LLAVA_SYSTEM + "  USER: Q1  ASSISTANT: A1</s> USER: Q2  ASSISTANT:",
    "bair_v1": "BEGINNING OF CONVERSATION:  USER: Q1  GPT: A1</s> USER: Q2  GPT:",
    "vicuna_v1_1": USER_SYSTEM + "  USER: Q1  ASSISTANT: A1</s> USER: Q2  ASSISTANT:",
}
# load_qas([["Q", None]]).get_prompt(): the single-turn case every Accessory demo builds.
ONE_TURN = {
    "default": HUMAN_SYSTEM + "\n\n### Human: Q\n### Assistant:",
    "simple": HUMAN_SYSTEM + "\n\n### Human: Q\n### Assistant:",
    "v1": HUMAN_SYSTEM + "\n\n### Human: Q\n### Assistant:",
    "multimodal": LLAVA_SYSTEM + "\n\n### Human: Q\n### Assistant:",
    "llava_v1": LLAVA_SYSTEM + "  USER: Q  ASSISTANT:",
    "bair_v1": "BEGINNING OF CONVERSATION:  USER: Q  GPT:",
    "vicuna_v1_1": USER_SYSTEM + "  USER: Q  ASSISTANT:",
}
SINGLE_STYLE = {"default", "simple", "v1", "multimodal"}


def test_the_seven_templates():
    assert set(conv_templates) == set(TWO_TURNS) == set(conversation_names())
    for name in SINGLE_STYLE:
        conv = conv_templates[name]()
        assert (conv.roles, conv.sep_style, conv.sep, conv.sep2) == (("Human", "Assistant"), SeparatorStyle.SINGLE,
                                                                     "###", None)
    for name, roles in [("llava_v1", ("USER", "ASSISTANT")), ("bair_v1", ("USER", "GPT")),
                        ("vicuna_v1_1", ("USER", "ASSISTANT"))]:
        conv = conv_templates[name]()
        assert (conv.roles, conv.sep_style, conv.sep, conv.sep2) == (roles, SeparatorStyle.TWO, " ", "</s>")
    assert [conv_templates[n]().version for n in ("default", "llava_v1", "bair_v1", "vicuna_v1_1")] == [
        "Unknown", "v1", "Unknown", "v1"]


@pytest.mark.parametrize("name", sorted(TWO_TURNS))
def test_two_turns_with_open_assistant_turn(name):
    conv = conv_templates[name]()
    conv.load_qas([["Q1", "A1"], ["Q2", None]])
    assert conv.get_prompt() == TWO_TURNS[name]


@pytest.mark.parametrize("name", sorted(ONE_TURN))
def test_one_turn(name):
    conv = get_conversation(name)
    conv.load_qas([["Q", None]])
    assert conv.get_prompt() == ONE_TURN[name]


@pytest.mark.parametrize("name", sorted(TWO_TURNS))
def test_append_message_builds_the_same_prompt_as_load_qas(name):
    conv = conv_templates[name]()
    for message in ["Q1", "A1", "Q2", None]:
        conv.append_message(conv.roles[len(conv.messages) % 2], message)
    assert conv.get_prompt() == TWO_TURNS[name]


def test_closed_conversation_and_training_targets():
    conv = default_conversation()
    assert conv.get_prompt() == HUMAN_SYSTEM + "\n\n###"
    conv.load_qas([["Q1", "A1"], ["Q2", "A2"]])
    assert conv.process() == {
        "conv": HUMAN_SYSTEM + "\n\n### Human: Q1\n### Assistant: A1\n### Human: Q2\n### Assistant: A2\n###",
        "to_predict": ["A1\n###", "A2\n###"],
    }
    conv = conv_templates["vicuna_v1_1"]()
    conv.load_qas([["Q1", "A1"], ["Q2", "A2"]])
    assert conv.process() == {
        "conv": USER_SYSTEM + "  USER: Q1  ASSISTANT: A1</s> USER: Q2  ASSISTANT: A2</s>",
        "to_predict": ["A1</s>", "A2</s>"],
    }


def test_empty_message_is_kept_in_single_style_and_open_in_two_style():
    """Accessory's quirk, kept for byte compatibility: SINGLE opens a turn only on None, TWO on any empty message."""
    conv = default_conversation()
    conv.load_qas([["Q", ""]])
    assert conv.get_prompt() == HUMAN_SYSTEM + "\n\n### Human: Q\n### Assistant: \n###"
    conv = conv_templates["vicuna_v1_1"]()
    conv.load_qas([["Q", ""]])
    assert conv.get_prompt() == USER_SYSTEM + "  USER: Q  ASSISTANT:"


def test_tuple_message_uses_its_text():
    """Accessory's multimodal entries are (text, image, mode) tuples; the prompt takes the text."""
    conv = default_conversation()
    conv.load_qas([[("Q", object(), "crop"), None]])
    assert conv.get_prompt() == HUMAN_SYSTEM + "\n\n### Human: Q\n### Assistant:"


@pytest.mark.parametrize("name", ["default", "vicuna_v1_1"])
def test_only_the_last_message_may_be_open(name):
    conv = conv_templates[name]()
    conv.load_qas([["Q1", None], ["Q2", None]])
    with pytest.raises(ValueError, match=r"messages\[1\] .* of 4 is empty; only the last"):
        conv.get_prompt()


def test_bad_layout_is_an_error():
    with pytest.raises(ValueError, match="needs sep2"):
        Conversation("sys", ("A", "B"), sep_style=SeparatorStyle.TWO, sep=" ").get_prompt()


def test_unknown_template():
    with pytest.raises(ValueError, match=r"unknown conversation template 'chatml'; known: default, simple"):
        get_conversation("chatml")
    with pytest.raises(KeyError, match="known: default, simple"):
        conv_templates["chatml"]


def test_response_end_signal_and_stop_symbols():
    for name in SINGLE_STYLE:
        conv = conv_templates[name]()
        assert conv.response_end_signal == "\n###"
        assert conv.stop_symbols == ["\n###"]
    for name, human in [("llava_v1", " USER:"), ("bair_v1", " USER:"), ("vicuna_v1_1", " USER:")]:
        conv = conv_templates[name]()
        assert conv.response_end_signal == "</s>"
        assert conv.stop_symbols == ["</s>", human]


@pytest.mark.parametrize("name", sorted(TWO_TURNS))
def test_stop_symbols_mark_where_the_next_turn_would_start(name):
    """What the template writes after a finished answer begins with a stop symbol, so generation ends there."""
    conv = conv_templates[name]()
    conv.load_qas([["Q1", "A1"], ["Q2", None]])
    after_answer = TWO_TURNS[name].split("A1", 1)[1]
    assert any(after_answer.startswith(stop) for stop in conv.stop_symbols)


def test_default_conversation_returns_independent_copies():
    a, b = default_conversation(), default_conversation()
    assert a is not b and a.messages is not b.messages
    a.load_qas([["Q", None]])
    a.append_message("Human", "more")
    a.system = "changed"
    fresh = default_conversation()
    assert fresh.messages == [] and fresh.system == HUMAN_SYSTEM and b.messages == []
    assert conv_templates["default"]().get_prompt() == HUMAN_SYSTEM + "\n\n###"


def test_copy_is_independent_and_keeps_every_field():
    conv = conv_templates["vicuna_v1_1"]()
    conv.load_qas([["Q1", "A1"]])
    conv.offset = 2
    dup = conv.copy()
    assert dup == conv and dup.version == "v1" and dup.offset == 2
    dup.messages[0][1] = "changed"
    dup.append_message("USER", "Q2")
    assert conv.messages == [["USER", "Q1"], ["ASSISTANT", "A1"]]


def test_gradio_and_dict_views():
    conv = default_conversation()
    conv.load_qas([["Q1", "A1"], ["Q2", None]])
    assert conv.to_gradio_chatbot() == [["Q1", "A1"], ["Q2", None]]
    conv.offset = 2
    assert conv.to_gradio_chatbot() == [["Q2", None]]
    assert conv.dict() == {"system": HUMAN_SYSTEM, "roles": ("Human", "Assistant"), "messages": conv.messages,
                           "offset": 2, "sep_style": "SINGLE", "sep": "###", "sep2": None, "version": "Unknown"}
