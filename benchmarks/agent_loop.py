"""An agent's two-step tool loop against `accessory serve`, through the official `openai` and `anthropic` clients:
ask a question that needs a tool, receive the call, run the tool, send its result back, receive the final answer.

The script starts the server on `--pretrained_path` (a model trained for tools: its chat template must write them),
waits until it answers, then for each question of QUESTIONS (`--runs` of them, cycling) and each way of asking
(OpenAI's chat completions and Anthropic's messages, each whole and streamed) runs the loop with tool_choice
"auto". A loop completes when the first reply is calls only (finish_reason "tool_calls" / stop_reason
"tool_use"), each call names a tool of the request with arguments valid against its schema (`jsonschema`), and the
second reply is text with no calls. It reports, per way of asking, the loops completed, the calls that were valid,
and the seconds a loop took on average.

    python benchmarks/agent_loop.py --pretrained_path qwen2.5-coder-0.5b-instruct-q4_k_m.gguf [--runs 8] \
        [--threads 2] [--serve-args --max_seq_len 2048]

Greedy (temperature 0) unless `--temperature` says otherwise (then seed i for question i).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).parent))
from serve import free_port, start_server, wait_ready  # noqa: E402  (a sibling benchmark's server helpers)

CITY = {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name"}},
        "required": ["city"]}
ZONE = {"type": "object", "properties": {"timezone": {"type": "string", "description": "An IANA zone, e.g. "
                                                                                         "Europe/Paris"}},
        "required": ["timezone"]}
TOOLS = {"get_weather": ("The current weather in a city", CITY, lambda a: {"city": a["city"], "celsius": 21,
                                                                         "sky": "sunny"}),
         "get_time": ("The current time in a time zone", ZONE, lambda a: {"timezone": a["timezone"],
                                                                         "time": "14:05"})}
QUESTIONS = ["What's the weather like in Paris right now?", "What time is it in Tokyo?",
             "Is it raining in London at the moment?", "What is the local time in New York?",
             "How warm is it in Cairo today?", "Tell me the current time in Sydney.",
             "What's the weather in Buenos Aires?", "What time is it in Berlin right now?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrained_path", required=True)
    parser.add_argument("--runs", type=int, default=8, help="questions asked each way")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args()
    args.nproc, args.serve_args = 1, ["--pretrained_path", args.pretrained_path, "--model-name", "agent",
                                      *args.serve_args]
    port = free_port()
    server = start_server(port, args)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server)
        print(f"accessory serve --pretrained_path {args.pretrained_path}, {args.threads} thread(s), temperature "
              f"{args.temperature}, {args.runs} question(s) each way")
        print(f"{'way':>22} {'completed':>9} {'valid calls':>11} {'s a loop':>8}")
        for api in ("openai", "anthropic"):
            for stream in (False, True):
                report(f"{api}{' streamed' if stream else ''}", [loop(url, api, stream, i, args)
                                                                for i in range(args.runs)])
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)


def report(way: str, loops: list[dict]) -> None:
    completed = sum(run["completed"] for run in loops)
    valid, calls = sum(run["valid"] for run in loops), sum(run["calls"] for run in loops)
    seconds = sum(run["seconds"] for run in loops) / len(loops)
    print(f"{way:>22} {completed:>5} / {len(loops):<2} {valid:>6} / {calls:<3} {seconds:>8.2f}")
    for run in loops:
        if not run["completed"]:
            print(f"{'':>22} not completed: {run['why']}")


def loop(url: str, api: str, stream: bool, i: int, args) -> dict:
    """One two-step loop: {"completed", "valid" calls, "calls", "seconds", "why" it did not complete}."""
    start = time.perf_counter()
    ask = OpenAIAsk(url, stream, i, args) if api == "openai" else AnthropicAsk(url, stream, i, args)
    calls, finished = ask.first(QUESTIONS[i % len(QUESTIONS)])
    valid = [call for call in calls if valid_call(*call)]
    outcome = {"valid": len(valid), "calls": len(calls)}
    if not calls or not finished or len(valid) < len(calls):
        why = f"first reply: {calls or 'no call'}, finished as calls: {finished}"
        return {**outcome, "completed": False, "why": why, "seconds": time.perf_counter() - start}
    text, called_again = ask.second(calls)
    done = bool(text.strip()) and not called_again
    why = "" if done else f"second reply: {text!r:.200} (calls again: {called_again})"
    return {**outcome, "completed": done, "why": why, "seconds": time.perf_counter() - start}


def valid_call(call_id: str, name: str, arguments: dict) -> bool:
    if name not in TOOLS:
        return False
    try:
        jsonschema.validate(arguments, TOOLS[name][1])
    except jsonschema.ValidationError:
        return False
    return True


def run_tool(name: str, arguments: dict) -> str:
    return json.dumps(TOOLS[name][2](arguments))


class OpenAIAsk:
    def __init__(self, url: str, stream: bool, i: int, args):
        import openai

        self.client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600)
        self.stream, self.messages = stream, []
        self.fields = {"model": "agent", "max_tokens": args.max_tokens, "temperature": args.temperature,
                       "tools": [{"type": "function", "function": {"name": name, "description": description,
                                                                   "parameters": schema}}
                                 for name, (description, schema, _) in TOOLS.items()]}
        if args.temperature:
            self.fields["seed"] = i

    def first(self, question: str) -> tuple[list[tuple[str, str, dict]], bool]:
        self.messages = [{"role": "user", "content": question}]
        content, calls, finish = self.reply()
        self.messages.append({"role": "assistant", "content": content or None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            for call_id, name, arguments in calls]})
        return [(call_id, name, json.loads(arguments)) for call_id, name, arguments in calls], finish == "tool_calls"

    def second(self, calls: list[tuple[str, str, dict]]) -> tuple[str, bool]:
        self.messages += [{"role": "tool", "tool_call_id": call_id, "content": run_tool(name, arguments)}
                          for call_id, name, arguments in calls]
        content, again, _ = self.reply()
        return content, bool(again)

    def reply(self) -> tuple[str, list[tuple[str, str, str]], str]:
        if not self.stream:
            choice = self.client.chat.completions.create(messages=self.messages, **self.fields).choices[0]
            calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
            return choice.message.content or "", calls, choice.finish_reason
        content, calls, finish = "", {}, None
        for chunk in self.client.chat.completions.create(messages=self.messages, stream=True, **self.fields):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for piece in delta.tool_calls or ():
                call = calls.setdefault(piece.index, [piece.id, piece.function.name, ""])
                call[2] += piece.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        return content, [tuple(calls[i]) for i in sorted(calls)], finish


class AnthropicAsk:
    def __init__(self, url: str, stream: bool, i: int, args):
        import anthropic

        self.client = anthropic.Anthropic(base_url=url, api_key="none", timeout=600)
        self.stream, self.messages = stream, []
        self.fields = {"model": "agent", "max_tokens": args.max_tokens,
                       "extra_body": {"temperature": min(args.temperature, 1.0)},
                       "tools": [{"name": name, "description": description, "input_schema": schema}
                                 for name, (description, schema, _) in TOOLS.items()]}

    def first(self, question: str) -> tuple[list[tuple[str, str, dict]], bool]:
        self.messages = [{"role": "user", "content": question}]
        message = self.reply()
        self.messages.append({"role": "assistant", "content": [block.model_dump() for block in message.content]})
        calls = [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"]
        return calls, message.stop_reason == "tool_use"

    def second(self, calls: list[tuple[str, str, dict]]) -> tuple[str, bool]:
        self.messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call_id, "content": run_tool(name, arguments)}
            for call_id, name, arguments in calls]})
        message = self.reply()
        text = "".join(block.text for block in message.content if block.type == "text")
        return text, any(block.type == "tool_use" for block in message.content)

    def reply(self):
        if not self.stream:
            return self.client.messages.create(messages=self.messages, **self.fields)
        with self.client.messages.stream(messages=self.messages, **self.fields) as stream:
            return stream.get_final_message()


if __name__ == "__main__":
    main()
