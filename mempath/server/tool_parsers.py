"""Tool-call parsers: a model's text → OpenAI tool calls, whole or as it streams.

Two formats, under vLLM's ``--tool-call-parser`` names:

- ``hermes`` (Hermes, Qwen2.5/Qwen3, the shipped mempath-tiny):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number of them;
- ``llama3_json`` (Llama 3.1/3.2): the answer is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several separated by ``;``.

``parser_for_template`` picks one from a chat template, as the template's own
tool-call format shows.

A call is an object naming one of the request's tools with its arguments under
``arguments`` or ``parameters`` (vLLM reads either); anything else, such as a JSON
answer that merely has a "name" key, is no call. The calls are the run of calls where
the first one begins: text before them and after them is the content, and an answer
whose first call does not parse is content exactly as written. ``split_answer`` applies
these rules to a finished answer and, while it is still being written, tells what more
text cannot change, so a stream sends the same content and calls as the whole answer.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field

from mempath.safe_io import loads_json


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallsRun:
    """The calls read from where the first one begins."""
    calls: list[ToolCall]
    end: int  # where the text after the last call begins
    open: bool  # the text after ``end`` may still become a call (an answer still being written)


def call_from(obj, tool_names: Collection[str] | None) -> ToolCall | None:
    """The call ``obj`` is, or None: a name among ``tool_names`` (None: any name) and an arguments object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if tool_names is not None and obj["name"] not in tool_names:
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    arguments = obj.get(key)
    if isinstance(arguments, str):  # some models write the arguments object as JSON text
        try:
            is_object = isinstance(loads_json(arguments), dict)
        except ValueError:
            is_object = False
        return ToolCall(obj["name"], arguments) if is_object else None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def skip_characters(text: str, index: int, characters: str) -> int:
    while index < len(text) and text[index] in characters:
        index += 1
    return index


class HermesParser:
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    separators = " \t\r\n"  # what may stand between two calls

    def __init__(self, tool_names: Collection[str] | None = None):
        self.tool_names = None if tool_names is None else frozenset(tool_names)

    def calls_start(self, text: str) -> int | None:
        """Where the tool calls begin in ``text``, if they have."""
        index = text.find(self.start)
        return None if index < 0 else index

    def may_start(self, text: str) -> int:
        """How many characters at the end of ``text`` could be the start of a call."""
        for n in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-n:]):
                return n
        return 0

    def read_calls(self, text: str, start: int, finished: bool) -> CallsRun:
        """The calls one after another from ``start``, where ``calls_start`` found the first."""
        calls, end = [], start
        while True:
            at = skip_characters(text, end, self.separators)
            if not text.startswith(self.start, at):
                # nothing yet, or only the beginning of "<tool_call>": another call may follow
                return CallsRun(calls, end, not finished and self.start.startswith(text[at:]))
            body = at + len(self.start)
            close = text.find(self.end, body)
            if close < 0 and not finished:
                return CallsRun(calls, end, True)
            # a model that stopped before closing its last call still made it, if its JSON is whole
            call = self._call(text[body:close if close >= 0 else len(text)])
            if call is None:
                return CallsRun(calls, end, False)
            calls.append(call)
            end = len(text) if close < 0 else close + len(self.end)

    def _call(self, body: str) -> ToolCall | None:
        try:
            return call_from(loads_json(body), self.tool_names)
        except ValueError:
            return None


class Llama3JsonParser:
    name = "llama3_json"
    tag = "<|python_tag|>"
    separators = " \t\r\n;"

    def __init__(self, tool_names: Collection[str] | None = None):
        self.tool_names = None if tool_names is None else frozenset(tool_names)

    def calls_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.tag) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def may_start(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or self.tag.startswith(stripped):
            return len(text)  # nothing yet says whether this is a call
        return 0

    def read_calls(self, text: str, start: int, finished: bool) -> CallsRun:
        """The calls one after another from ``start``, where ``calls_start`` found the first."""
        end = start + len(self.tag) if text.startswith(self.tag, start) else start
        decoder, calls = json.JSONDecoder(), []
        while True:
            at = skip_characters(text, end, self.separators)
            if at == len(text):
                return CallsRun(calls, end, not finished)
            if text[at] != "{":
                return CallsRun(calls, end, False)
            try:
                obj, after = decoder.raw_decode(text, at)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser recurses
                return CallsRun(calls, end, not finished)  # an object still being written, or no JSON
            call = call_from(obj, self.tool_names)
            if call is None:
                return CallsRun(calls, end, False)
            calls.append(call)
            end = after


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def parser_for_template(template: str | None) -> str | None:
    """The parser whose format a chat template's tool calls use, or None."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return "llama3_json"
    return None


def split_answer(parser, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
    """An answer's content and calls. Before it finishes, only what more text cannot change: content that
    begins the final content, and calls that stay calls; a stream sends these."""
    start = parser.calls_start(text)
    if start is None:
        if finished:
            return text, []
        # held back: what may begin a call, and the spaces before it, which a call's content leaves out
        return text[:len(text) - parser.may_start(text)].rstrip(), []
    run = parser.read_calls(text, start, finished)
    if not run.calls:
        return (text[:start].rstrip(), []) if run.open else (text, [])
    before, after = text[:start].rstrip(), "" if run.open else text[run.end:]
    if not after.strip(parser.separators):
        after = ""
    elif not before:
        after = after.lstrip(parser.separators)
    return before + after, run.calls


def parse_tool_calls(parser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished answer as (content, calls); content None when the calls are all of it."""
    content, calls = split_answer(parser, text, finished=True)
    return (content or None) if calls else content, calls
