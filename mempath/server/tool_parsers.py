"""Tool-call parsers: a model's text → OpenAI tool calls, whole or as it streams.

Two formats, under vLLM's ``--tool-call-parser`` names:

- ``hermes`` (Hermes, Qwen2.5/Qwen3, the shipped mempath-tiny):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number of them,
  text before the first one being the message's content;
- ``llama3_json`` (Llama 3.1/3.2): the whole answer is ``{"name": ..., "parameters":
  {...}}`` (optionally after ``<|python_tag|>``), several separated by ``;``.

``parser_for_template`` picks one from a chat template, as the template's own
tool-call format shows. A text that does not parse as calls stays content, as in vLLM.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from mempath.safe_io import loads_json


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_from(obj, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser:
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

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

    def complete_calls(self, calls_text: str, finished: bool) -> list[ToolCall] | None:
        """The calls in ``calls_text`` that are complete (all of them once finished; None: not calls)."""
        calls = []
        rest = calls_text
        while True:
            rest = rest.lstrip()
            if not rest:
                return calls
            if not rest.startswith(self.start):
                return calls if not finished else None
            body = rest[len(self.start):]
            end = body.find(self.end)
            if end < 0:
                if not finished:
                    return calls
                end = len(body)  # a model that stopped before closing its last call
            try:
                call = _call_from(loads_json(body[:end]), "arguments")
            except ValueError:
                call = None
            if call is None:
                return calls if not finished else None
            calls.append(call)
            rest = body[end + len(self.end):]


class Llama3JsonParser:
    name = "llama3_json"
    tag = "<|python_tag|>"

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

    def complete_calls(self, calls_text: str, finished: bool) -> list[ToolCall] | None:
        text = calls_text.strip()
        if text.startswith(self.tag):
            text = text[len(self.tag):]
        decoder, calls, index = json.JSONDecoder(), [], 0
        while True:
            while index < len(text) and text[index] in " \t\n;":
                index += 1
            if index >= len(text):
                return calls
            try:
                obj, index = decoder.raw_decode(text, index)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser recurses
                return calls if not finished else None
            call = _call_from(obj, "parameters")
            if call is None:
                return None
            calls.append(call)


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


def parse_tool_calls(parser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished answer as (content, calls); no calls when its calls part does not parse."""
    start = parser.calls_start(text)
    if start is None:
        return text, []
    calls = parser.complete_calls(text[start:], finished=True)
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls
