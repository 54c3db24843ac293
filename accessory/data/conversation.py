"""Multi-turn conversation templates, drop-in for LLaMA2-Accessory's `accessory.data.conversation`.

Same names (`Conversation`, `SeparatorStyle`, `conv_templates`, `default_conversation`) and `get_prompt()` strings
byte-identical to the original's for all seven templates: a model fine-tuned on a template expects exactly its bytes.

    conv = default_conversation()              # a fresh copy each call
    conv.load_qas([[q1, a1], [q2, None]])      # None: the answer to generate
    prompt = conv.get_prompt()
    model.generate([prompt], additional_stop_symbols=conv.stop_symbols)
"""
from __future__ import annotations

import dataclasses
from enum import Enum, auto
from typing import Any, Callable, Sequence


class SeparatorStyle(Enum):
    """How messages are laid out (in the templates here, `sep` is "###" for SINGLE, and " " / "</s>" for TWO)."""
    SINGLE = auto()  # "{system}\n\n{sep}" + " {role}: {message}\n{sep}" per message
    TWO = auto()  # "{system}{sep}" + " {role}: {message}" closed by sep, sep2, sep, sep2, ... by message index


@dataclasses.dataclass
class Conversation:
    """A template (system text, role names, separators) and the messages of one conversation.

    `messages` holds `[role, message]` pairs; a message may be a tuple whose first item is the text (Accessory's
    multimodal entries), and the last one may be None: the turn the model is to write, left open by `get_prompt()`.
    """
    system: str
    roles: tuple[str, str]
    messages: list = dataclasses.field(default_factory=list)
    sep_style: SeparatorStyle = SeparatorStyle.SINGLE
    sep: str = "###"
    sep2: str | None = None
    version: str = "Unknown"
    skip_next: bool = False
    offset: int = 0  # messages before it are hidden from to_gradio_chatbot(); the prompt always has them all

    def _layout(self) -> tuple[str, tuple[str, str]]:
        """(text before the first message, closers of messages at even / odd index)."""
        if self.sep_style is SeparatorStyle.SINGLE:
            return self.system + "\n\n" + self.sep, ("\n" + self.sep,) * 2
        if self.sep_style is not SeparatorStyle.TWO:
            raise ValueError(f"invalid sep_style {self.sep_style!r}; expected a SeparatorStyle")
        if self.sep2 is None:
            raise ValueError("sep_style TWO needs sep2, the closer of every second message (e.g. '</s>')")
        return self.system + self.sep, (self.sep, self.sep2)

    def _is_open(self, message: Any) -> bool:
        # Accessory leaves a turn open on None in SINGLE style but on any falsy message ("" too) in TWO style;
        # kept as is, since the prompt bytes depend on it.
        return message is None if self.sep_style is SeparatorStyle.SINGLE else not message

    def process(self) -> dict[str, Any]:
        """{"conv": the prompt text, "to_predict": each assistant message with its closer (training targets)}."""
        text, closers = self._layout()
        to_predict = []
        for i, (role, message) in enumerate(self.messages):
            if self._is_open(message):
                if i != len(self.messages) - 1:
                    raise ValueError(f"messages[{i}] ({role!r}) of {len(self.messages)} is empty; only the last "
                                     f"message may be left open for the model to write")
                text += f" {role}:"
                continue
            if isinstance(message, tuple):
                message = message[0]
            closed = message + closers[i % 2]
            text += f" {role}: {closed}"
            if role == self.roles[1]:
                to_predict.append(closed)
        return {"conv": text, "to_predict": to_predict}

    def get_prompt(self) -> str:
        return self.process()["conv"]

    def append_message(self, role: str, message: Any) -> None:
        self.messages.append([role, message])

    def load_qas(self, qas: Sequence[Sequence[str | None]]) -> None:
        """Replace the messages with `[[question, answer], ...]`; the last answer may be None (to be generated)."""
        self.messages = []
        for question, answer in qas:
            self.append_message(self.roles[0], question)
            self.append_message(self.roles[1], answer)

    def copy(self) -> Conversation:
        """An independent copy (every field, unlike the original's, which dropped `version`)."""
        return dataclasses.replace(self, messages=[[role, message] for role, message in self.messages])

    @property
    def response_end_signal(self) -> str:
        """The text that closes every assistant message of this template."""
        return "\n" + self.sep if self.sep_style is SeparatorStyle.SINGLE else self.sep2

    @property
    def stop_symbols(self) -> list[str]:
        """Strings that end the assistant's turn in generated text: cut the reply before the first one found."""
        # The closer training put after every assistant message (process()'s to_predict), so a model tuned on
        # this template writes it when its answer is done. In SINGLE style it also opens the next human turn
        # ("\n### Human:"), so this one string covers both.
        stops = [self.response_end_signal]
        if self.sep_style is SeparatorStyle.TWO:
            # TWO closes with sep2 "</s>", which a model trained through an HF tokenizer emits as the EOS token
            # (the engine stops on that) rather than as text; should it skip the closer and start the user's next
            # turn itself, that turn opens with " USER:".
            stops.append(f" {self.roles[0]}:")
        return stops

    def to_gradio_chatbot(self) -> list[list[Any]]:
        """[[user message, assistant message or None], ...] from `offset` on, as gradio's Chatbot takes it."""
        pairs: list[list[Any]] = []
        for i, (_, message) in enumerate(self.messages[self.offset:]):
            if i % 2 == 0:
                pairs.append([message, None])
            else:
                pairs[-1][1] = message
        return pairs

    def dict(self) -> dict[str, Any]:
        return {"system": self.system, "roles": self.roles, "messages": self.messages, "offset": self.offset,
                "sep_style": self.sep_style.name, "sep": self.sep, "sep2": self.sep2, "version": self.version}


class _Templates(dict):
    def __missing__(self, name: str):
        raise KeyError(f"unknown conversation template {name!r}; known: {', '.join(self)}")


def _single(system: str) -> Conversation:
    return Conversation(system, ("Human", "Assistant"), sep_style=SeparatorStyle.SINGLE, sep="###")


def _two(system: str, roles: tuple[str, str], version: str = "Unknown") -> Conversation:
    return Conversation(system, roles, sep_style=SeparatorStyle.TWO, sep=" ", sep2="</s>", version=version)


_HUMAN_SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the human's questions.")
_USER_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                "The assistant gives helpful, detailed, and polite answers to the user's questions.")
_LLAVA_SYSTEM = (  # sic: no spaces between the sentences
    "You are LLaVA, a large language and vision assistant trained by UW Madison WAIV Lab."
    "You are able to understand the visual content that the user provides, and assist the user with a variety of "
    "tasks using natural language."
    "Follow the instructions carefully and explain your answers in detail.")

# name -> factory of a fresh Conversation, as in Accessory: `conv = conv_templates["vicuna_v1_1"]()`.
conv_templates: dict[str, Callable[[], Conversation]] = _Templates({
    name: template.copy for name, template in {
        "default": _single(_HUMAN_SYSTEM),
        "simple": _single(_HUMAN_SYSTEM),
        "multimodal": _single(_LLAVA_SYSTEM),
        "llava_v1": _two(_LLAVA_SYSTEM, ("USER", "ASSISTANT"), version="v1"),
        # FastChat's names
        "v1": _single(_HUMAN_SYSTEM),
        "bair_v1": _two("BEGINNING OF CONVERSATION:", ("USER", "GPT")),
        "vicuna_v1_1": _two(_USER_SYSTEM, ("USER", "ASSISTANT"), version="v1"),
    }.items()
})


def template_names() -> list[str]:
    """The names in `conv_templates`."""
    return list(conv_templates)


def get_conversation(name: str) -> Conversation:
    """A fresh conversation on template `name`; ValueError listing the known names if there is none."""
    if name not in conv_templates:
        raise ValueError(f"unknown conversation template {name!r}; known: {', '.join(template_names())}")
    return conv_templates[name]()


def default_conversation() -> Conversation:
    """A fresh conversation on the "default" template (Accessory's conv_v1_2: "### Human: ... ### Assistant:")."""
    return conv_templates["default"]()
