"""tools / tool_choice / parallel_tool_calls: what the model may call, how it is enforced, what comes back.

- ``none``: the tools are shown to the template, the answer is plain content.
- ``auto`` (the default with tools): the model answers freely and the server's tool-call
  parser (server/tool_parsers.py) finds calls in it; as in vLLM this needs
  ``--enable-auto-tool-choice`` and a parser (``--tool-call-parser`` or the chat
  template's own format).
- ``required`` and a named function are enforced by the grammar, as vLLM does: the
  output must be a JSON array of ``{"name", "parameters"}`` objects (one at most when
  ``parallel_tool_calls`` is false), or the named function's arguments object.

A message with calls has ``tool_calls`` (OpenAI's shape) and finish_reason
``tool_calls`` (``length`` where max_tokens cut it). Text that is not a complete call is
content, also where max_tokens cut a call short, but for a named function, whose arguments
are a call however far they got (as in vLLM); with ``parallel_tool_calls`` false only the
first call comes back, as in vLLM. A stream sends the same content and calls as the whole
answer (``ToolPlan.split`` gives both): each call once it is complete, as OpenAI does, a
first delta with its index, id, type and function name (arguments ""), then its arguments;
a named function's arguments stream as they are written.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from mempath.server.protocol import APIError
from mempath.server.structured_request import StructuredRequest
from mempath.server.tool_parsers import PARSERS, ToolCall, skip_characters, split_answer
from mempath.structured import StructuredOutputsParams

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[dict]  # as the client sent them (the template shows them)
    parser: object | None = None
    named: str | None = None
    parallel: bool = True
    functions: dict[str, dict] = field(default_factory=dict)  # name -> parameters schema

    def grammar(self) -> StructuredOutputsParams | None:
        """The constraint that enforces required / named choices (None for none and auto)."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self.functions[self.named])
        if self.mode != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in self.functions.items()]
        array = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    def grammar_field(self) -> str:
        """The request field a compile error of ``grammar()`` names: the named function's schema, or tools."""
        if self.mode == "named":
            return f"tools.{list(self.functions).index(self.named)}.function.parameters"
        return "tools"

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished answer as (content, calls); content None when the calls are all of it."""
        content, calls = self.split(text, finished=True)
        return (content or None) if calls else content, calls

    def split(self, text: str, finished: bool, parsed: "ParsedItems | None" = None) -> tuple[str, list[ToolCall]]:
        """The answer's content and calls, by the same rules whether it is streamed or not. Before it finishes,
        only what more text cannot change (content that begins the final content, calls that stay calls): what
        a stream may send. Text that is not a complete call is content, also where max_tokens cut the answer.
        ``parsed``: a stream's record of the calls an earlier, shorter ``text`` held (required choices)."""
        if self.mode == "named":  # the grammar writes the arguments and nothing else: a call, cut short or not
            return "", [ToolCall(self.named, text)]
        if self.mode == "required":
            content, calls = _required_split(text, finished, self.functions, parsed)
        elif self.mode == "auto":
            content, calls = split_answer(self.parser, text, finished)
        else:
            return text, []
        return content, calls if self.parallel else calls[:1]  # vLLM too keeps only the first


def check_tools(tools: list[dict]) -> dict[str, dict]:
    """name -> parameters schema; APIError naming the first malformed tool."""
    functions = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise APIError(400, f"tools.{i} must be {{'type': 'function', 'function': {{...}}}}", f"tools.{i}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"tools.{i}.function.name must be a non-empty string", f"tools.{i}.function.name")
        parameters = function.get("parameters")
        if not isinstance(parameters, (dict, type(None))):
            raise APIError(400, f"tools.{i}.function.parameters must be a JSON schema object (or left out "
                                f"for a function without parameters), got {type(parameters).__name__}",
                           f"tools.{i}.function.parameters")
        if name in functions:  # one name, two schemas: the grammar and the parser could only keep one
            first = list(functions).index(name)
            raise APIError(400, f"tools.{i}.function.name {name[:64]!r} is tools.{first} already; give each "
                                "function its own name", f"tools.{i}.function.name")
        functions[name] = parameters or EMPTY_PARAMETERS  # OpenAI: left out, the function takes none
    return functions


def named_function(choice: dict, functions: dict[str, dict]) -> str:
    """The function a ``{"type": "function", "function": {"name": ...}}`` choice names; APIError naming
    the part of it that is wrong."""
    if choice.get("type") != "function":
        raise APIError(400, f"tool_choice.type must be 'function' (or tool_choice none, auto or required), "
                            f"got {choice.get('type')!r}", "tool_choice.type")
    function = choice.get("function")
    if not isinstance(function, dict):
        raise APIError(400, 'tool_choice.function must be an object naming one of tools: {"name": "..."}, '
                            f"got {type(function).__name__}", "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str):
        raise APIError(400, f"tool_choice.function.name must be a string, got {type(name).__name__}",
                       "tool_choice.function.name")
    if name not in functions:
        shown = name if len(name) <= 64 else name[:64] + "..."
        raise APIError(400, f"tool_choice names function {shown!r}, which is not in tools",
                       "tool_choice.function.name")
    return name


def plan_tools(req, parser_name: str | None, auto_tool_choice: bool) -> ToolPlan | None:
    """The request's tool plan, or None when it has no tools; APIError for a choice we cannot honour."""
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    functions = check_tools(tools)
    plan = ToolPlan("auto", tools, parallel=req.parallel_tool_calls, functions=functions)
    if isinstance(choice, dict):
        plan.mode, plan.named = "named", named_function(choice, functions)
    elif choice in ("none", "required"):
        plan.mode = choice
    elif choice not in (None, "auto"):
        raise APIError(400, f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                       "tool_choice")
    elif not auto_tool_choice or parser_name is None:
        raise APIError(400, '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                            "and a tool-call parser (--tool-call-parser, or a chat template with a tool-call "
                            "format); or use tool_choice required or a named function", "tool_choice")
    else:
        plan.parser = PARSERS[parser_name](tool_names=functions)
    return plan


def with_tool_constraint(plan: ToolPlan | None, structured: StructuredRequest | None) -> StructuredRequest | None:
    """The request's one output constraint: a required or named tool choice's grammar, or the structured output
    the client asked for; APIError when it asked for both."""
    if plan is None or plan.grammar() is None:
        return structured
    if structured is not None:
        raise APIError(400, f"tool_choice {plan.mode} constrains the output; it cannot be combined "
                            f"with {structured.field}", "tool_choice")
    return StructuredRequest(plan.grammar(), plan.grammar_field())


async def located_tools_error(plan: ToolPlan | None, error: APIError, grammar_error) -> APIError:
    """``error`` naming the function whose schema does not compile, where it named only tools: a required
    choice's one grammar spans every function. ``grammar_error``: the engine's compile of one constraint (async:
    its error message, or None). Unchanged when every schema compiles alone."""
    if plan is None or plan.mode != "required" or error.param != plan.grammar_field():
        return error
    for i, schema in enumerate(plan.functions.values()):  # in the order of tools (check_tools)
        constraint = StructuredOutputsParams(json=schema)
        message = await grammar_error(constraint)
        if message is not None:
            located = StructuredRequest(constraint, f"tools.{i}.function.parameters")
            return located.field_error(APIError(400, message, "structured_outputs"))
    return error


def tool_message(plan: ToolPlan | None, text: str, finish_reason: str) -> tuple[dict, str]:
    """The assistant message of a finished answer and its finish_reason."""
    if plan is None or plan.mode == "none":
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = plan.calls(text)
    if not calls:
        return {"role": "assistant", "content": content}, finish_reason
    message = {"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolStream:
    """One streamed choice's text deltas → OpenAI chat deltas: the content and the calls ``ToolPlan.split`` finds
    in the text so far, each sent once, so that they add up to the message ``tool_message`` would give."""

    def __init__(self, plan: ToolPlan | None):
        self.plan = plan
        self.text = ""
        self.sent_content = 0  # characters of the content sent
        self.num_calls = 0
        self.parsed = ParsedItems()  # a required choice's complete calls so far: each delta parses only what is new

    def take(self, delta: str, finished: bool) -> list[dict]:
        """The deltas to send for this much more text."""
        self.text += delta
        if self.plan is None or self.plan.mode == "none":
            return [{"content": delta}] if delta else []
        if self.plan.mode == "named":  # its arguments stream as they are written, as OpenAI and vLLM send them
            out = [] if self.num_calls else self._header(ToolCall(self.plan.named, ""))
            return out + ([self._arguments(0, delta)] if delta else [])
        content, calls = self.plan.split(self.text, finished, self.parsed)
        out = []
        if len(content) > self.sent_content:
            out.append({"content": content[self.sent_content:]})
            self.sent_content = len(content)
        for call in calls[self.num_calls:]:
            out += self._header(call) + [self._arguments(self.num_calls - 1, call.arguments)]
        return out

    def _header(self, call: ToolCall) -> list[dict]:
        self.num_calls += 1
        return [{"tool_calls": [{"index": self.num_calls - 1, "id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": ""}}]}]

    @staticmethod
    def _arguments(index: int, fragment: str) -> dict:
        return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.num_calls and reason == "stop" else reason


def _required_split(text: str, finished: bool, functions: dict[str, dict],
                    parsed: "ParsedItems | None" = None) -> tuple[str, list[ToolCall]]:
    """A required choice's JSON array as (content, calls): its complete calls, and once finished the text after
    them as content, when max_tokens cut the array short (all of it, if no call was complete)."""
    calls, end, closed = _array_items(text, functions, parsed)
    if not finished or (closed and calls):
        return "", calls
    return (text[end:].lstrip(" \t\r\n,") if calls else text), calls


@dataclass
class ParsedItems:
    """How far a stream's array has been parsed: its complete calls and where the text after them begins. A
    stream's text only grows, so what was complete stays complete, and re-parsing it each delta made a long
    answer's stream quadratic (a 42 KB array in 4-character deltas took 1.3 s of the event loop)."""
    calls: list = field(default_factory=list)
    end: int = 0  # 0: no complete call yet


def _array_items(text: str, functions: dict[str, dict],
                 parsed: ParsedItems | None = None) -> tuple[list[ToolCall], int, bool]:
    """The complete {"name", "parameters"} calls of a JSON array being written, where the text after the last
    one begins, and whether the array is closed there with nothing after it. ``parsed``: resumed from, and
    brought up to date."""
    start = text.find("[")
    if start < 0:
        return [], 0, False
    decoder, index, calls, end = json.JSONDecoder(), start + 1, [], 0
    if parsed is not None and parsed.end:
        index, calls, end = parsed.end, list(parsed.calls), parsed.end
    while True:
        if parsed is not None:
            parsed.calls, parsed.end = list(calls), end
        index = skip_characters(text, index, " \t\r\n,")
        if text.find("}", index) < 0:  # no call can end in what is left: skip a failing parse of it
            return calls, end, text[index:index + 1] == "]" and not text[index + 1:].strip()
        try:
            item, index = decoder.raw_decode(text, index)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser recurses
            return calls, end, text[index:index + 1] == "]" and not text[index + 1:].strip()
        # the grammar shapes the parameters by the function's schema, whatever it is: no check of them here
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or name not in functions or "parameters" not in item:
            return calls, end, False
        calls.append(ToolCall(name, json.dumps(item["parameters"], ensure_ascii=False)))
        end = index

