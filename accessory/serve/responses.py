"""The shapes of the API's answers: the head every answer and chunk starts with, the model card, usage, and how
chat and completions word their choices, streamed chunks and log-probs (Chat, Completion)."""
from __future__ import annotations

import functools
import hashlib
import time
from typing import Optional, Sequence

import torch
from fastapi import Request

from accessory.generation.chat import ReplyStream, read_reply
from accessory.generation.requests import Event
from accessory.serve.service import GenerationService, Handle
from accessory.text.reasoning import ReasoningFormat
from accessory.text.tool_calls import ToolReading


def head(model_name: str, service: GenerationService, handle: Handle, request: Request) -> dict:
    """The fields every answer and chunk of a request starts with."""
    return {"id": handle.id, "created": int(time.time()), "model": model_name,
            "system_fingerprint": system_fingerprint(service, model_name)}


def model_card(name: str, service: GenerationService, served: str) -> dict:
    """/v1/models' entry for the served model `served` or one of its LoRA adapters (vLLM's: with its `parent`)."""
    card = {"id": name, "object": "model", "created": 0, "owned_by": "accessory", "max_model_len": service.columns}
    return card if name == served else {**card, "parent": served}


@functools.lru_cache(maxsize=8)
def system_fingerprint(service: GenerationService, model_name: str) -> str:
    """Names what produced an answer (this version, the model's configuration and its parallel layout), so a
    client can tell when outputs for the same seed may differ."""
    from accessory import __version__

    settings = (model_name, __version__, torch.__version__, repr(service.engine.model.args), service.ctx.world_size,
                str(service.engine.model.dtype), service.engine.settings)
    return "fp_" + hashlib.sha256(repr(settings).encode()).hexdigest()[:12]


def usage(handle: Handle, finals) -> dict:
    completion = sum(final.completion_tokens for final in finals)
    return {"prompt_tokens": handle.prompt_tokens, "completion_tokens": completion,
            "total_tokens": handle.prompt_tokens + completion}


class Chat:
    """How /v1/chat/completions words its answers: whole choices, streamed chunks, and log-probs; with `calls`, a
    reply's tool calls as `tool_calls` (finish_reason "tool_calls"), their markup kept out of the content; with
    `reasoning` (its markers, and whether the prompt opened the block), the reply's reasoning as
    `reasoning_content`, the calls read in the answer after it."""
    prefix, object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def __init__(self, tokenizer, calls: Optional[ToolReading] = None,
                 reasoning: Optional[tuple[ReasoningFormat, bool]] = None):
        self.tokenizer, self.calls, self.reasoning = tokenizer, calls, reasoning
        self.streams: dict[int, ReplyStream] = {}  # each streamed choice's reader

    def echoed(self, index: int) -> str:
        return ""  # chat never repeats the prompt

    def prompt_entries(self, event: Event, index: int) -> list:
        return []

    def choice(self, index: int, text: str, finish: Optional[str], logprobs: Optional[list]) -> dict:
        reply = read_reply(text, self.reasoning, self.calls)
        message = {"role": "assistant", "content": reply.content}
        if self.reasoning is not None:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [call.openai() for call in reply.tool_calls]
            finish = "tool_calls" if finish == "stop" else finish
        return {"index": index, "message": message, "logprobs": self.logprobs(logprobs), "finish_reason": finish}

    def opening(self, index: int) -> Optional[dict]:
        """The first chunk of choice `index`, before any text: the role, as OpenAI streams it."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def chunk_choice(self, index: int, delta: str, finish: Optional[str], logprobs: Optional[list],
                     first: bool = False) -> dict:
        if index not in self.streams:
            self.streams[index] = ReplyStream(self.reasoning, self.calls)
        reading = self.streams[index]
        thought, delta, calls = reading.feed(delta, finish is not None)
        finish = "tool_calls" if finish == "stop" and reading.call_count else finish
        fields = {"reasoning_content": thought} if thought else {}
        fields.update({"content": delta} if delta else {}, **({"tool_calls": calls} if calls else {}))
        return {"index": index, "delta": fields, "logprobs": self.logprobs(logprobs), "finish_reason": finish}

    def logprobs(self, entries: Optional[list]) -> Optional[dict]:
        if entries is None:
            return None
        return {"content": [{**self._token(e.token, e.logprob),
                             "top_logprobs": [self._token(t, lp) for t, lp in e.top]} for e in entries]}

    def _token(self, token: int, logprob: float) -> dict:
        text = self.tokenizer.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class Completion(Chat):
    """/v1/completions: text choices, and log-probs in the legacy shape (tokens, token_logprobs, top_logprobs,
    text_offset). With `echo`, each choice starts with the prompt (and, with logprobs, the prompt's tokens: their
    log-probs come with the first event)."""
    prefix, object, chunk_object = "cmpl-", "text_completion", "text_completion"

    def __init__(self, tokenizer, echoes: Sequence[str] = (), n: int = 1):
        super().__init__(tokenizer)
        self.echoes, self.n = echoes, n

    def echoed(self, index: int) -> str:
        """What choice `index` repeats of its prompt (choice i * n + j is prompt i's sample j)."""
        return self.echoes[index // self.n] if self.echoes else ""

    def choice(self, index: int, text: str, finish: Optional[str], logprobs: Optional[list]) -> dict:
        return {"index": index, "text": self.echoed(index) + text, "logprobs": self.logprobs(logprobs),
                "finish_reason": finish}

    def opening(self, index: int) -> Optional[dict]:
        return None  # the echoed prompt comes with the first event (with its log-probs, when asked for)

    def chunk_choice(self, index: int, delta: str, finish: Optional[str], logprobs: Optional[list],
                     first: bool = False) -> dict:
        return {"index": index, "text": self.echoed(index) + delta if first else delta,
                "logprobs": self.logprobs(logprobs), "finish_reason": finish}

    def prompt_entries(self, event: Event, index: int) -> list:
        """The prompt's tokens and log-probs to show before the completion's: without the BOS token the prompt's
        text does not hold (the first shown then has a log-prob, given BOS)."""
        entries, bos = list(event.prompt_logprobs or ()), self.tokenizer.bos_id
        if entries and entries[0].token == bos and not self.echoed(index).startswith(self.tokenizer.token_text(bos)):
            entries = entries[1:]
        return entries

    def logprobs(self, entries: Optional[list]) -> Optional[dict]:
        if entries is None:
            return None
        texts = [self.tokenizer.token_text(e.token) for e in entries]
        offsets = [sum(map(len, texts[:i])) for i in range(len(texts))]  # within the choice's text
        return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.tokenizer.token_text(t): lp for t, lp in e.top} if e.logprob is not None
                                 else None for e in entries],
                "text_offset": offsets}
