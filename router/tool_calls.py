"""Tool calls in a model's output text: the formats the supported families write, parsed
whole (a finished reply) or as it streams (token by token), in pure functions.

- `hermes` (Qwen2, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call;
- `llama3_json` (Llama 3.1+): `<|python_tag|>` (optional) then `{"name": ..., "parameters": {...}}`,
  several separated by `;`; only at the start of the reply;
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`; the marker is a special
  token the detokenizer drops, so a reply starting with `[{"name"` counts too.

A call's `arguments` is the raw JSON text of its arguments object, the same whether the
reply streamed or not (a streaming client gets it in pieces). Text that could still become a
marker is held back from the streamed content, so no markup leaks into it.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes", "llama3_json", "mistral")  # --tool-call-parser takes these and auto

# The head of a call object, its name first: `{"name": "f", "arguments": ` (or "parameters").
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class Scan(enum.Enum):
    COMPLETE = "complete"  # every call closed, nothing malformed
    PARTIAL = "partial"  # could still become complete as more text comes
    INVALID = "invalid"  # cannot parse, whatever comes next


@dataclass(frozen=True)
class CallFormat:
    """How one family writes its calls: around the first call, between calls, after each
    call and at the end (each a literal, whitespace allowed around it; "" for none).
    `markers` start the calls anywhere in a reply; `start_markers` only at its start."""

    name: str
    markers: tuple[str, ...]
    start_markers: tuple[str, ...]
    # What opens the calls: a literal out of each tuple in turn ("": nothing needed).
    first: tuple[tuple[str, ...], ...]
    between: str
    after_call: str
    end: str

    def find_start(self, text: str) -> int | None:
        """Where the calls start in `text`, or None."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        stripped = len(text) - len(text.lstrip())
        if any(text.startswith(m, stripped) for m in self.start_markers):
            found.append(stripped)
        return min(found) if found else None

    def held_back(self, text: str) -> int:
        """How many characters at the end of the reply so far, `text` (which holds no whole
        marker), could be the start of one: they wait for more before they count as content."""
        if any(m.startswith(text.lstrip()) for m in self.start_markers):
            return len(text)
        for num_chars in range(min(len(text), max(map(len, self.markers), default=0)), 0, -1):
            if any(m.startswith(text[-num_chars:]) for m in self.markers):
                return num_chars
        return 0


HERMES = CallFormat(
    "hermes", ("<tool_call>",), (), (("<tool_call>",),), "<tool_call>", "</tool_call>", ""
)
LLAMA3_JSON = CallFormat(
    "llama3_json", ("<|python_tag|>",), ('{"name"',), (("<|python_tag|>", ""),), ";", "", ""
)
MISTRAL = CallFormat(
    "mistral", ("[TOOL_CALLS]",), ('[{"name"',), (("[TOOL_CALLS]", ""), ("[",)), ",", "", "]"
)
CALL_FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One call, OpenAI's `message.tool_calls[i]` (`to_openai`)."""

    name: str
    arguments: str  # the arguments object's JSON text
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class _Partial:
    name: str
    arguments: str  # what has come of the arguments' text so far
    complete: bool


# ---------------------------------------------------------------- scanning


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _expect(text: str, pos: int, literals: tuple[str, ...]) -> int | Scan:
    """Past one of `literals` (after whitespace) at `pos`; PARTIAL when the text ends
    inside one, INVALID when none can follow."""
    pos = _skip_ws(text, pos)
    rest = text[pos:]
    for literal in literals:
        if rest.startswith(literal):
            return pos + len(literal)
    if any(literal.startswith(rest) for literal in literals):
        return Scan.PARTIAL
    return Scan.INVALID


def _object_end(text: str, pos: int) -> int | None:
    """The end of the JSON object opening at `text[pos]` ('{'), or None if it is not
    closed yet. Strings are skipped whole, so braces in them do not count."""
    depth, in_string, escaped = 0, False, False
    for index in range(pos, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def _call(text: str, pos: int) -> tuple[_Partial | None, int | Scan]:
    """The call object at `pos`: (the call so far, the position after it or PARTIAL), or
    (None, PARTIAL / INVALID) before its name is known."""
    head = _HEAD.match(text, pos)
    if head is None:
        # Not a call head yet: PARTIAL unless the text can no longer be one.
        rest = text[pos:]
        return None, Scan.INVALID if rest[:1] not in ("", "{") else Scan.PARTIAL
    try:
        name = json.loads(f'"{head.group(1)}"')
    except ValueError:
        return None, Scan.INVALID
    start = head.end()
    if start < len(text) and text[start] != "{":
        return None, Scan.INVALID  # arguments are an object
    end = _object_end(text, start) if start < len(text) else None
    if end is None:
        return _Partial(name, text[start:], False), Scan.PARTIAL
    closed = _expect(text, end, ("}",))
    if isinstance(closed, Scan):
        return _Partial(name, text[start:end], False), closed
    return _Partial(name, text[start:end], True), closed


def scan(fmt: CallFormat, region: str) -> tuple[list[_Partial], Scan]:
    """The calls in `region` (text from where the calls start), the last maybe unfinished,
    and whether the region parses."""
    calls: list[_Partial] = []
    pos: int | Scan = 0
    for literals in fmt.first:
        pos = _expect(region, pos, literals)
        if isinstance(pos, Scan):
            return calls, pos
    while not isinstance(pos, Scan):
        call, pos = _call(region, _skip_ws(region, pos))
        if call is not None:
            calls.append(call)
        if isinstance(pos, Scan):
            break
        if fmt.after_call:
            pos = _expect(region, pos, (fmt.after_call,))
            if isinstance(pos, Scan):
                break
        after = _skip_ws(region, pos)
        if after == len(region):
            # The calls may end here (or more may come).
            return calls, Scan.PARTIAL if fmt.end else Scan.COMPLETE
        if fmt.end and region.startswith(fmt.end, after):
            return calls, Scan.COMPLETE  # text after the end is ignored
        pos = _expect(region, after, (fmt.between,))
        if pos is Scan.INVALID and not fmt.end and calls:
            return calls, Scan.COMPLETE  # prose after the calls is ignored
    return calls, pos


def _arguments_valid(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def parse(fmt: CallFormat, text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished reply: (content, calls). The content is the text before the calls (None
    when blank); a reply whose calls do not all parse is content, with no calls."""
    start = fmt.find_start(text)
    if start is None:
        return text, []
    partials, status = scan(fmt, text[start:])
    if (
        status is not Scan.COMPLETE
        or not partials
        or not all(p.complete and _arguments_valid(p.arguments) for p in partials)
    ):
        return text, []
    content = text[:start]
    return (content if content.strip() else None), [ToolCall(p.name, p.arguments) for p in partials]


# ---------------------------------------------------------------- streaming


@dataclass
class StreamDelta:
    """What one piece of text adds to a streamed reply: content, and OpenAI's
    `delta.tool_calls` entries (a call's first has its id, type and name)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.content:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = self.tool_calls
        return delta


class ToolCallStream:
    """Parses one streamed reply as its text comes (`feed`), then `finish`es it."""

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.num_content_chars = 0  # of `text` sent as content
        self.region_start: int | None = None
        self.sent: list[int] = []  # per call announced: characters of its arguments sent

    @property
    def num_calls(self) -> int:
        return len(self.sent)

    def feed(self, text: str) -> StreamDelta:
        self.text += text
        delta = StreamDelta()
        if self.region_start is None:
            start = self.fmt.find_start(self.text)
            if start is None:
                upto = len(self.text) - self.fmt.held_back(self.text)
                return StreamDelta(self._content_until(upto))
            delta.content = self._content_until(start)
            self.region_start = start
        partials, _ = scan(self.fmt, self.text[self.region_start :])
        for index, call in enumerate(partials):
            if index == len(self.sent):
                self.sent.append(0)
                delta.tool_calls.append(
                    {
                        "index": index,
                        "id": new_call_id(),
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            piece = call.arguments[self.sent[index] :]
            if piece:
                self.sent[index] += len(piece)
                delta.tool_calls.append({"index": index, "function": {"arguments": piece}})
        return delta

    def finish(self) -> StreamDelta:
        """The end of the reply: what was held back goes out as content, and so does the
        whole of calls that never named a function (malformed markup)."""
        if self.region_start is None or not self.sent:
            return StreamDelta(self._content_until(len(self.text)))
        return StreamDelta()

    def _content_until(self, upto: int) -> str:
        content = self.text[self.num_content_chars : upto]
        self.num_content_chars = max(upto, self.num_content_chars)
        return content


# ---------------------------------------------------------------- choosing a format


def choose_format(flag: str, model_type: str, chat_template: str) -> CallFormat:
    """The format for `--tool-call-parser` (`auto`: by the model's type, then by what its
    chat template writes; hermes when neither tells)."""
    if flag != "auto":
        return CALL_FORMATS[flag]
    model_type = model_type.lower()
    if model_type.startswith("llama"):
        return LLAMA3_JSON
    if model_type.startswith(("mistral", "mixtral")):
        return MISTRAL
    if "[TOOL_CALLS]" in chat_template:
        return MISTRAL
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template:
        return LLAMA3_JSON
    return HERMES
