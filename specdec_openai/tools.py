"""Tool calling on chat completions: ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

The wire format is Hermes' (NousResearch), which Qwen 2.5 / 3 templates teach and
vLLM's ``hermes`` parser reads: each call is written in the text as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The tools reach the model through the chat template (``tools=``, as transformers and vLLM
pass them). What it may write is constrained through the structured-output path, as an
xgrammar structural tag (``guided_decoding_guide_type`` ``structural_tag``, lossless under
speculation like every guide): each tool is a tag whose begin holds its name and whose
content is its ``parameters`` schema, so a call's name is one of the tools and its
arguments validate.

* ``auto`` (the default with tools): free text, and once the model writes ``<tool_call>``
  (the trigger) the call must be well formed; vLLM's ``auto`` instead parses whatever the
  model wrote, which a small model may get wrong.
* ``required``: one call or more (one with ``parallel_tool_calls`` false), nothing else.
* a named function: exactly one call of it. ``none``: no constraint and no parsing.

:class:`ToolCallParser` reads calls out of the text as it streams, and gives the deltas
vLLM's server streams (a call's first delta carries its ``id``, ``type`` and ``name``,
later ones pieces of ``arguments``); a whole response is the same parser run over the
whole text, so the two agree.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from specdec_openai.protocol import RequestError

BEGIN = "<tool_call>\n"
END = "\n</tool_call>"
TRIGGER = "<tool_call>"
_HEADER = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


@dataclass(frozen=True)
class ToolChoice:
    """A request's tools as the server uses them; ``mode`` is auto, required, named or none."""

    tools: tuple[dict[str, Any], ...]  # the request's tools, for the chat template
    mode: str
    name: str | None = None  # the function of a named choice
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def guide(self) -> str | None:
        """The structural tag that constrains the output (none for ``none``)."""
        functions = {t["function"]["name"]: t["function"] for t in self.tools}
        if self.mode == "none":
            return None
        names = [self.name] if self.mode == "named" else list(functions)
        tags = [_tag(name, functions[name].get("parameters")) for name in names]
        if self.mode == "named":
            form: dict[str, Any] = tags[0]
        elif self.mode == "required":
            form = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                    "stop_after_first": not self.parallel}  # fmt: skip
        else:
            form = {"type": "triggered_tags", "triggers": [TRIGGER], "tags": tags, "stop_after_first": not self.parallel}
        return json.dumps({"type": "structural_tag", "format": form})


def _tag(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    schema = parameters if parameters else {"type": "object"}
    return {"type": "tag", "begin": BEGIN + '{"name": ' + json.dumps(name) + ', "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema}, "end": "}" + END}  # fmt: skip


def tool_choice_of(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool | None) -> ToolChoice | None:
    """The request's tools checked: each a function with a name and an object schema; a choice that names a
    function not among them, or any choice without tools, is refused naming ``tool_choice``."""
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"'tools[{i}]' must be {{'type': 'function', 'function': {{'name': ..., "
                               "'parameters': {...}}}}", "tools")  # fmt: skip
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise RequestError(f"'tools[{i}]' parameters must be a JSON schema (an object)", "tools")
        names.append(function["name"])
    if len(set(names)) != len(names):
        raise RequestError(f"'tools' names a function twice: {names}", "tools")
    mode, name = _mode(choice if choice is not None else "auto")
    if name is not None and name not in names:
        raise RequestError(f"'tool_choice' names function {name!r}, which is not among the tools ({', '.join(names)})",
                           "tool_choice")  # fmt: skip
    return ToolChoice(tuple(tools), mode, name, parallel if parallel is not None else True)


def _mode(choice: Any) -> tuple[str, str | None]:
    if choice in ("auto", "required", "none"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if isinstance(name, str):
            return "named", name
    raise RequestError("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                       f"{{'name': ...}}}}, got {choice!r}", "tool_choice")  # fmt: skip


class ToolCallParser:
    """One choice's text, as it streams, into content and tool-call deltas (OpenAI's chat chunk ``delta``)."""

    def __init__(self):
        self.text = ""
        self._at = 0  # text before this is handed out
        self._calls = 0
        self._arguments_at: int | None = None  # inside a call's arguments: where they begin

    @property
    def num_calls(self) -> int:
        return self._calls

    def push(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        deltas = []
        while True:
            delta = self._next(final=False)
            if delta is None:
                return deltas
            deltas.append(delta)

    def finish(self) -> list[dict[str, Any]]:
        """What the text left held back: an unfinished call's arguments, or text that was not a call after all."""
        deltas = []
        while (delta := self._next(final=True)) is not None:
            deltas.append(delta)
        return deltas

    def _next(self, final: bool) -> dict[str, Any] | None:
        if self._arguments_at is not None:
            return self._arguments(final)
        start = self.text.find(BEGIN, self._at)
        if start < 0:  # hold back what may begin a call
            end = len(self.text) if final else len(self.text) - _partial_suffix(self.text[self._at :], BEGIN)
            return self._content(end)
        if start > self._at:
            return self._content(start)
        header = _HEADER.match(self.text, start + len(BEGIN))
        if header is None:
            if final or len(self.text) - start > len(BEGIN) + 512 or self.text.find(END, start) >= 0:
                return self._content(start + len(BEGIN))  # not a call: plain text
            return None
        self._arguments_at = self._at = header.end()
        call = {"index": self._calls, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": json.loads(header.group(1)), "arguments": ""}}  # fmt: skip
        self._calls += 1
        return {"tool_calls": [call]}

    def _arguments(self, final: bool) -> dict[str, Any] | None:
        close = self.text.find("}" + END, self._at)  # JSON strings hold no raw newline: the first one ends the call
        if close >= 0:
            piece = self.text[self._at : close]
            self._at, self._arguments_at = close + len("}" + END), None
            return self._arguments_delta(piece) if piece else self._next(final)
        end = len(self.text) if final else len(self.text) - _partial_suffix(self.text[self._at :], "}" + END)
        if end <= self._at:
            return None
        piece, self._at = self.text[self._at : end], end
        return self._arguments_delta(piece)

    def _arguments_delta(self, piece: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": self._calls - 1, "function": {"arguments": piece}}]}

    def _content(self, end: int) -> dict[str, Any] | None:
        if end <= self._at:
            return None
        piece, self._at = self.text[self._at : end], end
        if self._calls and not piece.strip():  # the separator between calls, or after the last
            return self._next(final=False) if self._at < len(self.text) else None
        return {"content": piece}


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is ``marker``'s beginning (or holds all of it but its end)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def message_of(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """A whole assistant message from a parser's deltas: content (None when only calls), then ``tool_calls``."""
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                calls.append({"id": call["id"], "type": "function", "function": dict(call["function"])})
            else:
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content.strip() or None, "tool_calls": calls}


def finish_reason(reason: str, choice: ToolChoice, num_calls: int) -> str:
    """``tool_calls`` where the model chose to call (auto, required), as OpenAI's; a named choice keeps ``stop``."""
    return "tool_calls" if reason == "stop" and num_calls and choice.mode in ("auto", "required") else reason
